"""A concrete `BlockMask` re-tiled to another block size, exactly.

A kernel walks tiles of its own size; a mask built with another one (FlexAttention
users build 64 x 64 or 128 x 64 masks) is cut into tiles of the greatest common
divisor of both sizes, each inheriting its tile's class (a stored tile is sliced),
then those are grouped into the kernel's tiles:

* a tile whose parts are all skipped is skipped, and one whose parts are all FULL is
  FULL, so a regrouped mask skips and saves mask math wherever it can;
* any other tile is COMPUTED when the mask has a structured `mask_mod` (which holds on
  every element the mask admits, as in every mask the constructors build), and also
  PARTIAL, with a stored tile assembled from its parts, when it contains a stored part
  or a skipped part the mask_mod does not already exclude.

Parts past the mask's last block lie beyond the sequence: they count as neither. The
stored tiles are deduplicated, so a causal mask regrouped gains one stored tile at most.
"""

from __future__ import annotations

import math
import weakref

import jax
import numpy as np

from omni_jax.masks.block_mask import BlockMask
from omni_jax.masks.construct import structured_tile_flags
from omni_jax.masks.mask_mods import BlockGrid
from pallas_kernels.tile_classes import COMPUTED, FULL, MASKED, PARTIAL

# Parts past the source mask's blocks (beyond q_len or kv_len): no constraint.
_BEYOND = -2
# The fine grid is built in host memory: masks whose fine grid would hold more tiles
# than this (tiny blocks over long sequences) are not regrouped.
MAX_FINE_TILES = 1 << 24


def regroupable(mask: BlockMask, block_size: tuple[int, int]) -> str | None:
    """Why ``mask`` cannot be regrouped to ``block_size``, or None when it can."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(mask)):
        return ("it is traced (built inside jax.jit or jax.vmap from traced arrays), and "
                "only a concrete mask is re-tiled")
    fine = [math.gcd(a, b) for a, b in zip(mask.block_size, block_size, strict=True)]
    batch, heads = mask.shape[:2]
    tiles = batch * heads * (-(-mask.q_len // fine[0])) * (-(-mask.kv_len // fine[1]))
    if tiles > MAX_FINE_TILES:
        return (f"re-tiling block_size {mask.block_size} to {tuple(block_size)} needs "
                f"{tiles} tiles of {tuple(fine)}, over {MAX_FINE_TILES}")
    return None


def regroup(mask: BlockMask, block_size: tuple[int, int]) -> BlockMask:
    """``mask`` with tiles of ``block_size`` admitting exactly the same elements.

    ``mask`` must be concrete (`regroupable`); it is returned as is when its block
    size is already ``block_size``. Results are kept while ``mask`` lives, so an
    eager loop over one mask re-tiles it once.
    """
    block_size = tuple(int(b) for b in block_size)
    if tuple(mask.block_size) == block_size:
        return mask
    done = _REGROUPED.setdefault(mask, {})
    if block_size not in done:
        done[block_size] = _regroup(mask, block_size)
    return done[block_size]


_REGROUPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _regroup(mask: BlockMask, block_size: tuple[int, int]) -> BlockMask:
    reason = regroupable(mask, block_size)
    if reason is not None:
        raise ValueError(f"cannot regroup this BlockMask: {reason}")
    # Host arithmetic on a concrete mask, also while a jit traces the call around it.
    with jax.ensure_compile_time_eval():
        return _regroup_concrete(mask, block_size)


def _regroup_concrete(mask: BlockMask, block_size: tuple[int, int]) -> BlockMask:
    flags, ids = (np.asarray(x) for x in mask._dense_tiles())
    stored = np.asarray(mask.partial_masks, bool)
    fine = tuple(math.gcd(a, b) for a, b in zip(mask.block_size, block_size, strict=True))
    target = BlockGrid(mask.q_len, mask.kv_len, *block_size)
    counts = (target.num_q_blocks, target.num_kv_blocks)
    flags, ids, stored = _split(flags, ids, stored, mask.block_size, fine, counts, block_size)
    if mask.mask_mod is None:
        # COMPUTED then only bounds kv_len, which the new grid's last tile bounds again.
        flags = np.where(flags >= 0, flags & ~COMPUTED, flags)
        excluded = np.zeros(flags.shape, bool)
    else:
        fine_grid = BlockGrid(mask.q_len, mask.kv_len, *fine)
        empty = np.asarray(structured_tile_flags(mask.mask_mod, fine_grid)) == MASKED
        excluded = _fit(empty, flags.shape, fill=True)
        shape = np.broadcast_shapes(flags.shape, excluded.shape)
        flags, ids, excluded = (np.broadcast_to(x, shape) for x in (flags, ids, excluded))
    new_flags, new_ids, new_stored = _merge(flags, ids, stored, excluded, fine, block_size,
                                            structured=mask.mask_mod is not None)
    return BlockMask.from_tile_flags(
        new_flags, new_ids, new_stored, mask.mask_mod, q_len=mask.q_len, kv_len=mask.kv_len,
        block_size=block_size, contiguous_full=mask.contiguous_full)


def _split(flags, ids, stored, block_size, fine, counts, target_size):
    """The dense tiles cut into ``fine`` tiles, as many as ``counts`` target tiles hold
    (parts past the source's blocks marked `_BEYOND`); stored tiles sliced likewise."""
    (bq, bk), (fq, fk) = block_size, fine
    sq, sk = bq // fq, bk // fk
    lead = flags.shape[:2]
    rows, cols = (n * t // f for n, t, f in zip(counts, target_size, fine, strict=True))
    fine_flags = np.full((*lead, rows, cols), _BEYOND, np.int32)
    fine_ids = np.full((*lead, rows, cols), -1, np.int32)
    split_flags = np.repeat(np.repeat(flags, sq, axis=2), sk, axis=3)
    sub = ((np.arange(flags.shape[2] * sq) % sq)[:, None] * sk
           + (np.arange(flags.shape[3] * sk) % sk)[None, :])
    split_ids = np.repeat(np.repeat(ids, sq, axis=2), sk, axis=3)
    split_ids = np.where(split_ids >= 0, split_ids * (sq * sk) + sub, -1)
    r, c = min(rows, split_flags.shape[2]), min(cols, split_flags.shape[3])
    fine_flags[..., :r, :c] = split_flags[..., :r, :c]
    fine_ids[..., :r, :c] = split_ids[..., :r, :c]
    fine_stored = (stored.reshape(-1, sq, fq, sk, fk).transpose(0, 1, 3, 2, 4)
                   .reshape(-1, fq, fk))
    return fine_flags, fine_ids, fine_stored


def _fit(array: np.ndarray, shape: tuple, fill: bool) -> np.ndarray:
    """``array [.., .., n, m]`` (broadcastable leading dims) padded or cut to the last
    two dims of ``shape``."""
    rows, cols = shape[2:]
    out = np.full((*array.shape[:2], rows, cols), fill, bool)
    r, c = min(rows, array.shape[2]), min(cols, array.shape[3])
    out[..., :r, :c] = array[..., :r, :c]
    return out


def _merge(flags, ids, stored, excluded, fine, block_size, *, structured: bool):
    """Groups fine tiles into tiles of ``block_size``: (flags, partial ids, stored tiles)."""
    (fq, fk), (bq, bk) = fine, block_size
    rq, rk = bq // fq, bk // fk
    *lead, rows, cols = flags.shape
    nq, nk = rows // rq, cols // rk
    parts = lambda x: x.reshape(*lead, nq, rq, nk, rk).swapaxes(-3, -2)  # [.., nq, nk, rq, rk]
    part_flags, part_ids, part_excluded = parts(flags), parts(ids), parts(excluded)
    active = part_flags >= 0
    any_active = active.any(axis=(-2, -1))
    all_full = (active.any(axis=(-2, -1))
                & ((part_flags == FULL) | (part_flags == _BEYOND)).all(axis=(-2, -1)))
    has_stored = (active & ((part_flags & PARTIAL) != 0)).any(axis=(-2, -1))
    if structured:
        skipped_inside = ((part_flags == MASKED) & ~part_excluded).any(axis=(-2, -1))
        needs_tile = has_stored | skipped_inside
        mixed_flags = COMPUTED | np.where(needs_tile, PARTIAL, 0)
    else:
        needs_tile = np.ones(any_active.shape, bool)
        mixed_flags = np.full(any_active.shape, PARTIAL)
    new_flags = np.where(~any_active, MASKED, np.where(all_full, FULL, mixed_flags))
    needs_tile &= any_active & ~all_full
    where = np.nonzero(needs_tile)
    if not where[0].size:
        return new_flags, None, None
    # Each part of a stored tile: its own stored slice, else all visible if it is active.
    sel_flags, sel_ids = part_flags[where], part_ids[where]  # [n, rq, rk]
    sel_active = sel_flags >= 0
    sel_partial = sel_active & ((sel_flags & PARTIAL) != 0)
    bits = np.where(sel_partial[..., None, None], stored[np.maximum(sel_ids, 0)],
                    sel_active[..., None, None])  # [n, rq, rk, fq, fk]
    tiles = bits.transpose(0, 1, 3, 2, 4).reshape(-1, bq, bk)
    unique, inverse = np.unique(tiles, axis=0, return_inverse=True)
    new_ids = np.full(new_flags.shape, -1, np.int32)
    new_ids[where] = inverse.ravel()
    return new_flags, new_ids, unique
