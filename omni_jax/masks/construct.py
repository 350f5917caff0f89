"""`create_block_mask`: from a ``mask_mod(b, h, q_idx, kv_idx)`` to a `BlockMask`.

Structured mask_mods (`MaskMod`: causal, windows, documents, prefix-LM,
chunks and their and/or combinations) are classified analytically in
O(number of blocks); their mixed tiles become COMPUTED tiles, evaluated
from indices inside the kernels.

Any other mask_mod is evaluated one q-block row at a time (``block_q x
kv_len`` booleans at once). Its mixed tiles become PARTIAL tiles with a
stored boolean tile. Built eagerly, identical tiles are stored once. Built
under a transformation (a mask_mod closing over traced arrays inside
``jit``/``vmap``), the number of mixed tiles is not known when tracing, so
every tile gets a slot: ``num_tiles x block_q x block_kv`` booleans.

The evaluation is jitted with the mask_mod's jaxpr as its static key (the arrays it
captures are operands), so building masks eagerly in a loop compiles once per mask_mod
structure, not at every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax import explicit_sharding
from omni_jax.masks.block_mask import COMPUTED, FULL, MASKED, PARTIAL, BlockMask
from omni_jax.masks.compiled import compiled_when_concrete
from omni_jax.masks.mask_mods import BlockGrid, MaskMod, has_contiguous_full_tiles, is_int
from pallas_kernels.traced_functions import ComparedByJaxpr, evaluate

Array = Any
MaskFn = Callable[[Array, Array, Array, Array], Array]

# Tiles evaluated per step when collecting the stored tiles of an eager mask.
_TILES_PER_STEP = 64


def _check_size(name: str, value: Any, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not is_int(value) or value <= 0:
        kind = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"create_block_mask: {name} must be {kind}, got {value!r}")


def normalize_block_size(block_size: int | tuple[int, int]) -> tuple[int, int]:
    """``block_size`` as (block_q, block_kv), validated."""
    pair = block_size
    if is_int(block_size):
        pair = (block_size, block_size)
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or any(not is_int(b) or b <= 0 for b in pair)):
        raise ValueError("block_size must be a positive int or a pair (block_q, block_kv) of "
                         f"positive ints, got {block_size!r}")
    return int(pair[0]), int(pair[1])


def create_block_mask(mask_mod: MaskFn, batch: int | None, heads: int | None, q_len: int,
                      kv_len: int, block_size: int | tuple[int, int] = (128, 128)) -> BlockMask:
    """Builds the `BlockMask` of ``mask_mod`` (True = query may attend to key).

    Args:
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` with FlexAttention
        semantics (called on scalars through vmap), or a structured `MaskMod`.
      batch, heads: sizes the mask varies over; None broadcasts over that axis.
      q_len, kv_len: sequence lengths (any, not only block multiples).
      block_size: tile size (block_q, block_kv), or one int for both.
    """
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask: mask_mod must be callable, got "
                        f"{type(mask_mod).__name__}")
    _check_size("batch", batch, allow_none=True)
    _check_size("heads", heads, allow_none=True)
    _check_size("q_len", q_len, allow_none=False)
    _check_size("kv_len", kv_len, allow_none=False)
    block_size = normalize_block_size(block_size)
    grid = BlockGrid(int(q_len), int(kv_len), *block_size)
    if isinstance(mask_mod, MaskMod):
        return _structured_block_mask(mask_mod, batch, heads, grid)
    return _evaluated_block_mask(mask_mod, batch or 1, heads or 1, grid)


def structured_tile_flags(mask_mod: MaskMod | None, grid: BlockGrid) -> Array:
    """Dense tile flags ``[Bm, 1, nq, nkv]`` of a structured mask (None: dense attention)."""
    return _structured_tile_flags(mask_mod, grid=grid)


@compiled_when_concrete(static_argnames=("grid", "batch", "heads"))
def _structured_tile_flags(mask_mod: MaskMod | None, *, grid: BlockGrid, batch: int = 1,
                           heads: int = 1) -> Array:
    """`structured_tile_flags` broadcast to at least ``[batch, heads, nq, nkv]``."""
    if mask_mod is None:
        flags = np.full((1, 1, grid.num_q_blocks, grid.num_kv_blocks), FULL, np.int32)
    else:
        full, empty = mask_mod.classify(grid)
        flags = jnp.where(empty, MASKED, jnp.where(full, FULL, COMPUTED)).astype(jnp.int32)
    shape = jnp.broadcast_shapes(flags.shape, (batch, heads, grid.num_q_blocks,
                                               grid.num_kv_blocks))
    return jnp.broadcast_to(flags, shape)


def _structured_block_mask(mask_mod: MaskMod, batch: int | None, heads: int | None,
                           grid: BlockGrid) -> BlockMask:
    mask_batch = mask_mod.batch_size()
    if batch is not None and mask_batch not in (1, batch):
        raise ValueError(f"create_block_mask: batch={batch} but the mask_mod's arrays have "
                         f"batch size {mask_batch}")
    mask_mod.check_lengths(grid)
    flags = _structured_tile_flags(mask_mod, grid=grid, batch=batch or 1, heads=heads or 1)
    return BlockMask.from_tile_flags(flags, mask_mod=mask_mod, q_len=grid.q_len,
                                     kv_len=grid.kv_len, block_size=(grid.block_q,
                                                                     grid.block_kv),
                                     contiguous_full=has_contiguous_full_tiles(mask_mod))


def _evaluate(mask_mod: MaskFn, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
    """``mask_mod`` on the grid ``q_idx x kv_idx`` (scalar semantics, through vmap)."""
    per_key = jax.vmap(lambda q, k: jnp.asarray(mask_mod(b, h, q, k), bool), (None, 0))
    return jax.vmap(per_key, (0, None))(q_idx, kv_idx)


def _row_tiles(mask_mod: MaskFn, grid: BlockGrid, b: Array, h: Array, q_block: Array):
    """The tiles of one q-block row: (visible bits, in-bounds bits), ``[nkv, bq, bkv]``."""
    bq, bkv, nkv = grid.block_q, grid.block_kv, grid.num_kv_blocks
    q_idx = q_block * bq + jnp.arange(bq, dtype=jnp.int32)
    kv_idx = jnp.arange(nkv * bkv, dtype=jnp.int32)
    in_bounds = (q_idx < grid.q_len)[:, None] & (kv_idx < grid.kv_len)[None, :]
    bits = _evaluate(mask_mod, b, h, q_idx, kv_idx) & in_bounds
    as_tiles = lambda x: x.reshape(bq, nkv, bkv).swapaxes(0, 1)
    return as_tiles(bits), as_tiles(in_bounds)


@dataclasses.dataclass(frozen=True, eq=False)
class _HoistedMaskMod(ComparedByJaxpr):
    """A mask_mod traced on scalars, its captured arrays hoisted: the static part of the
    jitted evaluation below, so that eager calls with the same mask_mod structure (new
    closures included) compile once."""

    jaxpr: Any

    def bind(self, captured: Sequence[Array]) -> MaskFn:
        return lambda b, h, q_idx, kv_idx: evaluate(self.jaxpr, captured, b, h, q_idx, kv_idx)


def _hoisted(mask_mod: MaskFn) -> tuple[_HoistedMaskMod, list[Array]]:
    index = jax.ShapeDtypeStruct((), jnp.int32)
    try:
        with explicit_sharding.tracing_without_explicit_mesh():
            closed = jax.make_jaxpr(mask_mod)(index, index, index, index)
    except Exception as error:  # noqa: BLE001 - reported with context
        raise TypeError(f"create_block_mask: mask_mod failed when called as mask_mod(b, h, "
                        f"q_idx, kv_idx) on int32 scalars: {error}") from error
    results = [(aval.shape, aval.dtype) for aval in closed.out_avals]
    if results != [((), jnp.dtype(bool))]:
        raise TypeError(f"create_block_mask: mask_mod(b, h, q_idx, kv_idx) must return one "
                        f"bool scalar (True = may attend), got "
                        f"{[f'{d}{list(s)}' for s, d in results]}")
    return _HoistedMaskMod(closed.jaxpr), list(closed.consts)


def _rows(batch: int, heads: int, grid: BlockGrid) -> Array:
    """Every (b, h, q-block) as int32 rows of a ``[batch * heads * nq, 3]`` array (the
    index type the mask_mod was traced with, also under jax_enable_x64)."""
    return np.stack([a.ravel() for a in np.indices((batch, heads, grid.num_q_blocks))],
                    axis=-1).astype(np.int32)


def _evaluated_block_mask(mask_mod: MaskFn, batch: int, heads: int,
                          grid: BlockGrid) -> BlockMask:
    hoisted, captured = _hoisted(mask_mod)
    flags = _tile_flags(captured, mask_mod=hoisted, batch=batch, heads=heads, grid=grid)
    if isinstance(flags, jax.core.Tracer):
        partial_ids, partial_masks = _all_tiles_stored(hoisted.bind(captured), grid,
                                                       _rows(batch, heads, grid), flags)
    else:
        partial_ids, partial_masks = _deduplicated_tiles(hoisted, captured, grid,
                                                         np.asarray(flags))
    return BlockMask.from_tile_flags(flags, partial_ids, partial_masks, None, q_len=grid.q_len,
                                     kv_len=grid.kv_len,
                                     block_size=(grid.block_q, grid.block_kv))


@compiled_when_concrete(static_argnames=("mask_mod", "batch", "heads", "grid"))
def _tile_flags(captured, *, mask_mod: _HoistedMaskMod, batch: int, heads: int,
                grid: BlockGrid) -> Array:
    """MASKED / FULL / PARTIAL per tile, one q-block row of tiles at a time."""
    fn = mask_mod.bind(captured)

    def classify_row(row):
        bits, in_bounds = _row_tiles(fn, grid, row[0], row[1], row[2])
        return bits.any(axis=(1, 2)), (bits | ~in_bounds).all(axis=(1, 2))

    any_visible, all_visible = jax.lax.map(classify_row, _rows(batch, heads, grid))
    flags = jnp.where(any_visible, jnp.where(all_visible, FULL, PARTIAL), MASKED)
    return flags.reshape(batch, heads, grid.num_q_blocks, grid.num_kv_blocks)


def _all_tiles_stored(mask_mod, grid, rows, flags):
    """Traced construction: one stored tile per tile, ids = tile position."""
    tiles = jax.lax.map(lambda row: _row_tiles(mask_mod, grid, row[0], row[1], row[2])[0], rows)
    partial_masks = tiles.reshape(-1, grid.block_q, grid.block_kv)
    ids = jnp.arange(partial_masks.shape[0], dtype=jnp.int32).reshape(flags.shape)
    return jnp.where(flags == PARTIAL, ids, -1), partial_masks


@compiled_when_concrete(static_argnames=("mask_mod", "grid"))
def _tiles(coords, captured, *, mask_mod: _HoistedMaskMod, grid: BlockGrid) -> Array:
    """The visible bits of the tiles at ``coords`` ``[n, 4]`` (b, h, q-block, kv-block)."""
    fn = mask_mod.bind(captured)
    bq, bkv = grid.block_q, grid.block_kv

    def tile(coord):
        b, h, q_block, kv_block = coord[0], coord[1], coord[2], coord[3]
        q_idx = q_block * bq + jnp.arange(bq, dtype=jnp.int32)
        kv_idx = kv_block * bkv + jnp.arange(bkv, dtype=jnp.int32)
        in_bounds = (q_idx < grid.q_len)[:, None] & (kv_idx < grid.kv_len)[None, :]
        return _evaluate(fn, b, h, q_idx, kv_idx) & in_bounds

    return jax.lax.map(tile, coords)


def _deduplicated_tiles(mask_mod: _HoistedMaskMod, captured, grid, flags: np.ndarray):
    """Eager construction: evaluates only the PARTIAL tiles and stores each distinct one once."""
    coords = np.argwhere(flags == PARTIAL).astype(np.int32)
    partial_ids = np.full(flags.shape, -1, np.int32)
    if len(coords) == 0:
        return partial_ids, np.zeros((1, grid.block_q, grid.block_kv), bool)
    unique: dict[bytes, int] = {}
    stored: list[np.ndarray] = []
    for start in range(0, len(coords), _TILES_PER_STEP):
        chunk = coords[start:start + _TILES_PER_STEP]
        # Every step evaluates _TILES_PER_STEP tiles (the last one padded by repeats), so
        # that all steps share one compiled `_tiles`.
        padded = np.concatenate([chunk, np.repeat(chunk[-1:], _TILES_PER_STEP - len(chunk), 0)])
        bits_of_chunk = np.asarray(_tiles(padded, captured, mask_mod=mask_mod, grid=grid))
        for coord, bits in zip(chunk, bits_of_chunk[:len(chunk)], strict=True):
            key = np.packbits(bits).tobytes()
            if key not in unique:
                unique[key] = len(stored)
                stored.append(bits)
            partial_ids[tuple(coord)] = unique[key]
    return partial_ids, np.stack(stored)
