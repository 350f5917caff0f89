"""What the Mosaic-GPU Blackwell (sm100) attention kernels share, beside what they import
from `attention_sm90_common` (walk packing, mask leaves, score spec, captured arrays).

* tensor-memory budgets and the register layout of a tile loaded from tensor memory
  (one row per thread: row reductions stay within a thread);
* `exp2_polynomial`: 2^x on the FMA pipes, for the share of a softmax's exponentials
  that FA4 takes off the MUFU unit (16 exp2 per clock per SM on a B200, against 128
  FMAs per clock);
* `paired_walk`: one kv walk for the q tiles of a CTA (consecutive q-blocks), so that
  they share every K and V load, with each tile's own tile classes.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.block_sparse import KernelMask, MaskLayout
from pallas_kernels.mosaic import attention_sm90_common as common
from pallas_kernels.tile_classes import FULL, MASKED

Array = Any

# Columns of tensor memory per SM (128 lanes x 512 columns of 32 bits).
TMEM_COLUMNS = 512
# A q tile is one tcgen05 MMA of M = 128 rows (one lane per row).
TILE_ROWS = 128
# FA4's threshold for rescaling O: the running max (in log2 units) is raised only when a
# row's new max exceeds it by more than this; below it P's elements stay under 2^8 and
# the stale max cancels out in the final O / sum.
RESCALE_THRESHOLD = 8.0

# 2^f for f in [-1/2, 1/2] as 1 + f (c1 + f (c2 + f c3)): a minimax fit of the relative
# error (at most 1.1e-4, under a half ulp of bf16 and of fp16's P).
_EXP2_COEFFICIENTS = (0.693282878075397, 0.24221020503671603, 0.055008617147191796)
# Below this the result's exponent bits would underflow: such exponentials are 0.
_EXP2_FLOOR = -125.0
# 1.5 * 2^23: a float32 of magnitude below 2^22 plus this is rounded to an integer held
# in the sum's low mantissa bits (whose bit pattern is this one's plus that integer).
_ROUND_TO_INTEGER = 12582912.0


def tmem_layout() -> Any:
    """The register layout of a tile loaded from tensor memory (a row per thread)."""
    return plgpu.Layout.TCGEN05_TMEM_NATIVE


def row_layout() -> Any:
    """The layout of a per-row vector of a `tmem_layout` tile."""
    return tmem_layout().reduce(1)


def row_vector(value: float) -> Array:
    """A per-row float32 vector of a q tile filled with ``value``."""
    return plgpu.layout_cast(jnp.full((TILE_ROWS,), value, jnp.float32), row_layout())


def tmem_columns(block_kv: int, head_dim_v: int, q_tiles: int) -> int:
    """Tensor-memory columns of a forward CTA: per q tile S (float32, ``block_kv``
    columns; P aliases it) and O (float32, ``head_dim_v`` columns)."""
    return q_tiles * (block_kv + head_dim_v)


def exp2_polynomial(x: Array) -> Array:
    """2^x by a cubic on the nearest integer's remainder and an integer add into the
    exponent bits; 0 below 2^-125 and for -inf. FMA and ALU pipes only: no MUFU, and no
    float-integer conversion (those run at MUFU's rate)."""
    clamped = jnp.maximum(x, _EXP2_FLOOR)
    rounded = clamped + _ROUND_TO_INTEGER
    fraction = clamped - (rounded - _ROUND_TO_INTEGER)
    c1, c2, c3 = _EXP2_COEFFICIENTS
    mantissa = 1.0 + fraction * (c1 + fraction * (c2 + fraction * c3))
    # The pattern of 1.5 * 2^23 shifted by 23 bits is 0 (mod 2^32): this adds n << 23.
    exponent = lax.bitcast_convert_type(rounded, jnp.int32) << 23
    bits = lax.bitcast_convert_type(mantissa, jnp.int32) + exponent
    return jnp.where(x < _EXP2_FLOOR, 0.0, lax.bitcast_convert_type(bits, jnp.float32))


def split_exp2(x: Array, emulated_columns: int) -> list[tuple[int, Array]]:
    """2^x of a ``[rows, cols]`` tile as (first column, values) parts: the first
    ``emulated_columns`` columns by `exp2_polynomial`, the rest by the hardware's exp2.
    Parts, not one array: jax 0.10's Mosaic lowering has no concatenation."""
    columns = x.shape[1]
    parts = []
    if emulated_columns > 0:
        parts.append((0, exp2_polynomial(x[:, :min(emulated_columns, columns)])))
    if emulated_columns < columns:
        parts.append((max(emulated_columns, 0), jnp.exp2(x[:, max(emulated_columns, 0):])))
    return parts


def paired_walk(kmask: KernelMask, layout: MaskLayout, tiles: int) -> Array:
    """The kv walk of each group of ``tiles`` consecutive q-blocks, packed per group as
    ``[Bm, Hm, ceil(nq / tiles), R, WALK_LINE]`` (`paired_walk_offsets`): the kv-blocks
    active for any of them, those FULL for all first, and per q-block its tile's flags
    (MASKED where the kv-block is inactive for that q-block alone) and stored-tile ids
    (0 where it has none). One tile is the plain packed walk.
    """
    if tiles == 1:
        return common.packed_walk(kmask, "kv")
    nq, nkv = layout.num_q_blocks, layout.num_kv_blocks
    count, indices = kmask.kv_num_blocks, kmask.kv_indices
    active = jnp.arange(indices.shape[-1]) < count[..., None]
    # Dense per (q-block, kv-block); inactive walk positions land in a spare column.
    column = jnp.where(active, indices, nkv)

    def dense(values, fill):
        grid = jnp.full((*count.shape, nkv + 1), fill, jnp.int32)
        grid = jnp.put_along_axis(grid, column, values.astype(jnp.int32), axis=-1,
                                  inplace=False)[..., :nkv]
        extra = -nq % tiles
        grid = jnp.pad(grid, ((0, 0),) * 2 + ((0, extra), (0, 0)), constant_values=fill)
        return grid.reshape(*grid.shape[:2], -1, tiles, nkv)

    flags, ids = dense(kmask.kv_tile_flags, MASKED), dense(kmask.kv_partial_ids, 0)
    ids = jnp.maximum(ids, 0)
    any_active = (flags != MASKED).any(axis=-2)
    all_full = (flags == FULL).all(axis=-2)
    rank = jnp.where(all_full, 0, jnp.where(any_active, 1, 2))
    order = jnp.argsort(rank * nkv + jnp.arange(nkv), axis=-1).astype(jnp.int32)
    per_tile = lambda x: [jnp.take_along_axis(x[..., t, :], order, axis=-1)
                          for t in range(tiles)]
    rows = jnp.concatenate([any_active.sum(-1, dtype=jnp.int32)[..., None],
                            all_full.sum(-1, dtype=jnp.int32)[..., None], order,
                            *per_tile(flags), *per_tile(ids)], axis=-1)
    return common.walk_lines(rows)


def paired_walk_offsets(num_kv_blocks: int, tiles: int) -> tuple[int, tuple, tuple]:
    """Where a `paired_walk` row holds its kv-block indices, and per q tile its flags and
    stored-tile ids (entry 0: the active count, entry 1: how many are FULL for all)."""
    flags = tuple(2 + (1 + t) * num_kv_blocks for t in range(tiles))
    ids = tuple(2 + (1 + tiles + t) * num_kv_blocks for t in range(tiles))
    return 2, flags, ids


__all__ = ["RESCALE_THRESHOLD", "TILE_ROWS", "TMEM_COLUMNS", "exp2_polynomial",
           "paired_walk", "paired_walk_offsets", "row_layout", "row_vector", "split_exp2",
           "tmem_columns", "tmem_layout"]
