"""The classes of a (q-block, kv-block) tile and the kinds of a mask's leaf arrays.

These are the vocabulary of the block-sparse walk that every attention kernel
reads (`pallas_kernels.block_sparse`); `omni_jax.masks` builds masks in it.

* MASKED: absent from the walk (only in a dense view of the tile flags);
* FULL (flags 0): every element visible, no mask math;
* COMPUTED (bit 1): the mask follows from indices (a structured mask_mod, the kv bound);
* PARTIAL (bit 2): the mask is a stored boolean tile.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import jax

from pallas_kernels import compat

FULL = 0
COMPUTED = 1
PARTIAL = 2
MASKED = -1

# Where a structured mask_mod's array leaf is indexed: by query position, by key
# position, or by batch alone (one scalar per batch row).
LeafKind = Literal["q", "kv", "batch"]

# Grids of at most this many tiles build their walks at trace time where nothing they
# depend on is traced: a jitted call then carries them as constants (a few hundred KiB
# at most) instead of re-sorting them on the device at every call.
_TRACE_TIME_TILES = 1 << 16


def trace_time_eval(grid: Any, *inputs: Any) -> contextlib.AbstractContextManager:
    """Evaluates mask construction for ``grid`` (anything with ``num_q_blocks`` and
    ``num_kv_blocks``) eagerly where its inputs are not traced.

    ``inputs`` (pytrees) are the arrays it reads: where one varies along a `jax.shard_map`
    axis nothing is eager, as JAX cannot mix eager constants with such arrays. Only for
    array code on masks: kernel bodies traced inside it would be evaluated eagerly too."""
    if (grid.num_q_blocks * grid.num_kv_blocks <= _TRACE_TIME_TILES
            and not compat.varying_axes(inputs)):
        return jax.ensure_compile_time_eval()
    return contextlib.nullcontext()
