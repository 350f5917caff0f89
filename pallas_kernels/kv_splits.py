"""Split-KV: several programs share one q-block's kv walk, their results combined by lse.

A call with fewer q-blocks than the GPU has SMs (a decoding step, a short prompt over
a long cache) leaves most SMs idle while each program walks the whole cache. With
``splits`` shares, program ``split`` walks an even share of its q-block's walk and
writes an output normalised over its own keys and their lse; `combine` weighs the
shares by exp(lse_share - lse_total). Both attention forwards (Triton and Mosaic)
use these helpers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
from jax import lax

Array = Any

# A share shorter than this many kv-blocks costs more in its combine and its own
# prologue (the Q load, the first K/V load's latency) than it saves.
MIN_SPLIT_STEPS = 8


def num_splits(num_programs: int, mean_walk: float, num_sms: int, waves: int = 1) -> int:
    """Shares of each q-block's walk for a call of ``num_programs`` q-block programs
    walking ``mean_walk`` kv-blocks on average: as many as fill ``num_sms`` SMs in
    ``waves`` waves, each share at least `MIN_SPLIT_STEPS` long. More than one wave
    serves walks of lengths known only on the device (a ragged batch): the scheduler
    evens out many short CTAs where one wave waits for its longest."""
    return max(1, min(waves * num_sms // max(num_programs, 1),
                      int(mean_walk // MIN_SPLIT_STEPS)))


def share(count: Array, num_full: Array, split: Array,
          splits: int) -> tuple[Array, Array, Array]:
    """(first position, length, FULL steps in it) of share ``split`` of ``splits`` even
    shares of a walk of ``count`` steps whose first ``num_full`` are FULL. Late shares
    of a short walk are empty."""
    if splits == 1:
        return jnp.int32(0), count, num_full
    size = lax.div(count + splits - 1, splits)
    begin = jnp.minimum(split * size, count)
    length = jnp.minimum(begin + size, count) - begin
    return begin, length, jnp.clip(num_full - begin, 0, length)


def combine(out: Array, lse: Array, dtype: Any,
            heads_first: bool = False) -> tuple[Array, Array]:
    """The result of the shares' ``out [S, B, Sq, H, Dv]`` (each normalised over its own
    keys; with ``heads_first`` ``[S, B, H, Sq, Dv]``) and ``lse [S, B, H, Sq]``, as
    ``dtype``. A row no share saw keeps lse -inf and output 0. Sinks join afterwards
    (`omni_jax.backends.base.fold_sinks`).

    Written elementwise over the static shares (no reduction over S): XLA fuses the
    output's weighted sum with the caller's slicing, relayout and dtype cast (separate
    reduction and transpose kernels otherwise, each a launch around a decoding step)."""
    if out.shape[0] == 1:
        return out[0].astype(dtype), lse[0]
    shares = range(out.shape[0])
    peak = functools.reduce(jnp.maximum, (lse[s] for s in shares))
    peak = jnp.where(peak == -jnp.inf, 0.0, peak)
    total = peak + jnp.log(sum(jnp.exp(lse[s] - peak) for s in shares))
    weights = jnp.exp(lse - jnp.where(total == -jnp.inf, 0.0, total))
    if not heads_first:
        weights = jnp.swapaxes(weights, 2, 3)
    weights = weights[..., None]
    combined = sum(weights[s] * out[s].astype(jnp.float32) for s in shares)
    return combined.astype(dtype), total
