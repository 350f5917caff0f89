"""`BlockMask`: which (q-block, kv-block) tiles of the score matrix are computed, and how.

Each tile of a ``q_len x kv_len`` score matrix, cut in ``block_size`` tiles, is

* MASKED: absent from the mask; kernels never load its K/V nor do its math;
* FULL (flags 0): every element visible, no mask math at all;
* COMPUTED (flag bit 1): the mask follows from indices: the BlockMask's
  structured `mask_mod` (causal, window, documents, ...) and the sequence
  bound ``kv_idx < kv_len`` are evaluated inside the tile;
* PARTIAL (flag bit 2): the mask is a stored boolean tile
  ``partial_masks[partial_id]``; identical tiles share one stored tile.

Both bits may be set (a stored tile further restricted by a structured mask).

The mask is stored per (batch, head, q-block) as a compacted list of its
active kv-blocks (ascending; past the count, padded with the last active
block, so a prefetch past the end stays in bounds), as the forward kernels
walk it; and per (batch, head, kv-block) as the list of active q-blocks, as
the dK/dV backward walks it. Batch and head dimensions may be 1 (broadcast).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.masks.compiled import compiled_when_concrete
from omni_jax.masks.mask_mods import (
    And,
    BlockGrid,
    MaskMod,
    RepeatedQueries,
    has_contiguous_full_tiles,
)
from pallas_kernels.block_sparse import WalkStatistics
from pallas_kernels.tile_classes import COMPUTED, FULL, MASKED, PARTIAL

Array = Any


def _compact(dense_flags: Array, dense_partial_ids: Array):
    """Lists the active tiles of the last axis first, in ascending order.

    Returns (count, indices, flags, partial_ids), the last three shaped like
    ``dense_flags``; entries past ``count`` repeat the last active tile (block
    0 when there is none) with flags FULL and partial id -1.
    """
    n = dense_flags.shape[-1]
    position = np.arange(n, dtype=np.int32)
    active = dense_flags >= 0
    order = jnp.argsort(jnp.where(active, position, position + n), axis=-1, stable=True)
    order = order.astype(jnp.int32)
    count = active.sum(axis=-1, dtype=jnp.int32)
    valid = position < count[..., None]
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    last = jnp.where(count[..., None] > 0, last, 0)
    indices = jnp.where(valid, order, last)
    flags = jnp.where(valid, jnp.take_along_axis(dense_flags, order, axis=-1), FULL)
    partial_ids = jnp.where(valid, jnp.take_along_axis(dense_partial_ids, order, axis=-1), -1)
    return count, indices, flags.astype(jnp.int32), partial_ids.astype(jnp.int32)


def mark_kv_tail(tile_flags: Array, grid: BlockGrid) -> Array:
    """Adds COMPUTED to active tiles of a ragged last kv block (bound ``kv_idx < kv_len``)."""
    if grid.kv_len % grid.block_kv == 0:
        return tile_flags
    last = tile_flags[..., -1:]
    last = jnp.where(last >= 0, last | COMPUTED, last)
    return jnp.concatenate([tile_flags[..., :-1], last], axis=-1)


# The array work of construction and views: one compiled function each
# (`omni_jax.masks.compiled`). Constants are numpy, which a trace embeds as they are.


@compiled_when_concrete(static_argnames=("grid",))
def _walks(tile_flags: Array, partial_ids: Array | None, partial_masks: Array | None, *,
           grid: BlockGrid):
    """(q-major walk, kv-major walk, stored tiles) of dense tile flags (`_compact`)."""
    tile_flags = mark_kv_tail(jnp.asarray(tile_flags, jnp.int32), grid)
    if partial_ids is None:
        partial_ids = np.full(tile_flags.shape, -1, np.int32)
    partial_ids = jnp.broadcast_to(jnp.asarray(partial_ids, jnp.int32), tile_flags.shape)
    if partial_masks is None:
        partial_masks = np.zeros((1, grid.block_q, grid.block_kv), bool)
    return (_compact(tile_flags, partial_ids),
            _compact(tile_flags.swapaxes(-1, -2), partial_ids.swapaxes(-1, -2)),
            jnp.asarray(partial_masks, bool))


@compiled_when_concrete()
def _dense_tiles(kv_num_blocks: Array, kv_indices: Array, kv_tile_flags: Array,
                 kv_partial_ids: Array) -> tuple[Array, Array]:
    """Dense (flags, partial ids) ``[Bm, Hm, nq, nkv]``, scattered back from the q-major
    walk."""
    *lead, nq, nkv = kv_indices.shape
    valid = np.arange(nkv) < kv_num_blocks[..., None]
    slot = jnp.where(valid, kv_indices, nkv)  # Padding lands in a dropped column.
    index = tuple(np.indices(slot.shape, sparse=True)[:-1]) + (slot,)
    flags = jnp.asarray(np.full((*lead, nq, nkv + 1), MASKED, np.int32)).at[index].set(
        kv_tile_flags)
    ids = jnp.asarray(np.full((*lead, nq, nkv + 1), -1, np.int32)).at[index].set(
        kv_partial_ids)
    return flags[..., :nkv], ids[..., :nkv]


@compiled_when_concrete(static_argnames=("grid",))
def _restricted_tiles(flags: Array, ids: Array, mask_mod: MaskMod, *,
                      grid: BlockGrid) -> tuple[Array, Array]:
    """Dense (flags, ids) AND ``mask_mod``: its empty tiles dropped, its mixed ones
    COMPUTED."""
    full, empty = mask_mod.classify(grid)
    flags = jnp.where(empty, MASKED, jnp.where((flags >= 0) & ~full, flags | COMPUTED, flags))
    return flags, jnp.where(flags >= 0, ids, -1)


@compiled_when_concrete(static_argnames=("group", "num_q_blocks"))
def _repeated_tiles(flags: Array, ids: Array, partial_masks: Array, *, group: int,
                    num_q_blocks: int) -> tuple[Array, Array, Array]:
    """Dense (flags, ids) and stored tiles with ``group`` rows per query position: each
    new q-block is one of ``group`` slices of an old one, and so is each stored tile."""
    _, bq, bkv = partial_masks.shape
    source = np.arange(num_q_blocks) // group  # the q-block each new one lies in
    part = np.arange(num_q_blocks) % group  # and which of its group slices
    flags, ids = flags[:, :, source], ids[:, :, source]
    # Stored tile p seen from slice g: row r of it is row (g * bq + r) // group of p.
    rows = (np.arange(group)[:, None] * bq + np.arange(bq)[None, :]) // group
    partial_masks = partial_masks[:, rows].reshape(-1, bq, bkv)
    return flags, jnp.where(ids >= 0, ids * group + part[:, None], -1), partial_masks


@compiled_when_concrete(static_argnames=("q_len", "kv_len"))
def _elements(flags: Array, ids: Array, partial_masks: Array, mask_mod: MaskMod | None, *,
              q_len: int, kv_len: int) -> Array:
    """The element mask ``[Bm, Hm, q_len, kv_len]`` of dense tile flags and ids."""
    _, bq, bkv = partial_masks.shape
    q_idx = np.arange(q_len, dtype=np.int32)
    kv_idx = np.arange(kv_len, dtype=np.int32)
    tile_flags = flags[:, :, q_idx // bq][:, :, :, kv_idx // bkv]
    tile_ids = ids[:, :, q_idx // bq][:, :, :, kv_idx // bkv]
    bits = partial_masks[jnp.maximum(tile_ids, 0), (q_idx % bq)[:, None],
                         (kv_idx % bkv)[None, :]]
    visible = tile_flags >= 0
    visible &= ((tile_flags & PARTIAL) == 0) | bits
    if mask_mod is not None:
        batch = np.arange(flags.shape[0])[:, None, None, None]
        structured = mask_mod(batch, 0, q_idx[:, None], kv_idx[None, :])
        visible &= ((tile_flags & COMPUTED) == 0) | structured
    return visible


@jax.tree_util.register_pytree_node_class
class BlockMask:
    """Block-sparse attention mask; build one with `create_block_mask`.

    Arrays (``Bm``/``Hm``: batch/heads, 1 when broadcast; ``nq``/``nkv``: blocks):

    * ``kv_num_blocks [Bm, Hm, nq]``, ``kv_indices``, ``kv_tile_flags``,
      ``kv_partial_ids`` ``[Bm, Hm, nq, nkv]``: the q-major walk (forward, dQ);
    * ``q_num_blocks [Bm, Hm, nkv]``, ``q_indices``, ``q_tile_flags``,
      ``q_partial_ids`` ``[Bm, Hm, nkv, nq]``: the kv-major walk (dK, dV);
    * ``partial_masks [P, block_q, block_kv]`` bool: deduplicated stored tiles
      (at least one, all False, when no tile is PARTIAL);
    * ``mask_mod``: the structured predicate of COMPUTED tiles, or None;
    * ``mask_mod`` holds on every element the tiles admit (FULL and stored tiles too), as
      in every mask the constructors build: re-tiling (`omni_jax.masks.regroup`) relies
      on it;
    * ``contiguous_full`` (static): every walk's FULL tiles are consecutive blocks, so a
      kernel can step through them without reading their indices. Set for dense masks
      and those built from a mask_mod with `MaskMod.row_intervals`; False otherwise.
    * ``walk_hint`` (static): None or the mask's `WalkStatistics` (mean walk lengths),
      for a mask whose arrays are traced (built inside `jax.jit` or a `jax.shard_map`
      from traced positions), where the kernels cannot read them while choosing their
      configs (kv splits, short-walk tiles, the fused dQ). It affects only that choice,
      never results; concrete arrays take precedence. Attach it with `with_walk_hint`;
      methods that make a new mask keep it only where it stays exact, else drop it.
    """

    def __init__(self, *, kv_num_blocks, kv_indices, kv_tile_flags, kv_partial_ids,
                 q_num_blocks, q_indices, q_tile_flags, q_partial_ids, partial_masks,
                 mask_mod: MaskMod | None, q_len: int, kv_len: int,
                 block_size: tuple[int, int], contiguous_full: bool = False,
                 walk_hint: WalkStatistics | None = None):
        if walk_hint is not None and not isinstance(walk_hint, WalkStatistics):
            raise ValueError(f"walk_hint must be None or a WalkStatistics, got "
                             f"{type(walk_hint).__name__}")
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.kv_tile_flags = kv_tile_flags
        self.kv_partial_ids = kv_partial_ids
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.q_tile_flags = q_tile_flags
        self.q_partial_ids = q_partial_ids
        self.partial_masks = partial_masks
        self.mask_mod = mask_mod
        self.q_len = q_len
        self.kv_len = kv_len
        self.block_size = block_size
        self.contiguous_full = contiguous_full
        self.walk_hint = walk_hint

    _ARRAYS = ("kv_num_blocks", "kv_indices", "kv_tile_flags", "kv_partial_ids",
               "q_num_blocks", "q_indices", "q_tile_flags", "q_partial_ids", "partial_masks",
               "mask_mod")

    def tree_flatten(self):
        children = tuple(getattr(self, name) for name in self._ARRAYS)
        return children, (self.q_len, self.kv_len, self.block_size, self.contiguous_full,
                          self.walk_hint)

    @classmethod
    def tree_unflatten(cls, aux, children):
        q_len, kv_len, block_size, contiguous_full, walk_hint = aux
        return cls(**dict(zip(cls._ARRAYS, children, strict=True)), q_len=q_len,
                   kv_len=kv_len, block_size=block_size, contiguous_full=contiguous_full,
                   walk_hint=walk_hint)

    def with_walk_hint(self, walk_hint: WalkStatistics | None) -> BlockMask:
        """This mask with ``walk_hint`` (the caller's promise that it is this mask's
        `WalkStatistics`, or near them: see the class docstring)."""
        children, aux = self.tree_flatten()
        return BlockMask.tree_unflatten((*aux[:-1], walk_hint), children)

    def walk_statistics(self) -> WalkStatistics:
        """The mean walk lengths of this mask's arrays (concrete: use outside `jax.jit`)."""
        if isinstance(self.kv_num_blocks, jax.core.Tracer):
            raise TypeError("BlockMask.walk_statistics() reads the mask's arrays, so the "
                            "mask must be concrete: this one is traced; see walk_hint")
        return WalkStatistics.of_tile_flags(self.tile_flags())

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_tile_flags(cls, tile_flags: Array, partial_ids: Array | None = None,
                        partial_masks: Array | None = None, mask_mod: MaskMod | None = None,
                        *, q_len: int, kv_len: int, block_size: tuple[int, int],
                        contiguous_full: bool = False) -> BlockMask:
        """Builds both walks from dense ``tile_flags [Bm, Hm, nq, nkv]`` (MASKED = -1).

        Active tiles of a ragged last kv block get COMPUTED added, so kernels
        bound ``kv_idx < kv_len`` exactly where a tile crosses the end.
        ``contiguous_full`` is the caller's promise (see the class docstring).
        """
        grid = BlockGrid(q_len, kv_len, *block_size)
        expected = (grid.num_q_blocks, grid.num_kv_blocks)
        if np.ndim(tile_flags) != 4 or np.shape(tile_flags)[2:] != expected:
            raise ValueError(f"tile_flags must be [batch, heads, {expected[0]}, {expected[1]}] "
                             f"for q_len={q_len}, kv_len={kv_len}, block_size={block_size}, "
                             f"got shape {np.shape(tile_flags)}")
        kv_walk, q_walk, partial_masks = _walks(tile_flags, partial_ids, partial_masks,
                                                grid=grid)
        return cls(kv_num_blocks=kv_walk[0], kv_indices=kv_walk[1], kv_tile_flags=kv_walk[2],
                   kv_partial_ids=kv_walk[3], q_num_blocks=q_walk[0], q_indices=q_walk[1],
                   q_tile_flags=q_walk[2], q_partial_ids=q_walk[3],
                   partial_masks=partial_masks, mask_mod=mask_mod,
                   q_len=q_len, kv_len=kv_len, block_size=tuple(block_size),
                   contiguous_full=contiguous_full)

    # -- views ------------------------------------------------------------------------------

    @property
    def grid(self) -> BlockGrid:
        """The (q-block, kv-block) tiling this mask was built for."""
        return BlockGrid(self.q_len, self.kv_len, *self.block_size)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, heads, q_len, kv_len); batch or heads is 1 when broadcast."""
        batch, heads = self.kv_num_blocks.shape[:2]
        return batch, heads, self.q_len, self.kv_len

    def tile_flags(self) -> Array:
        """Dense ``[Bm, Hm, nq, nkv]`` tile flags, MASKED (-1) for absent tiles."""
        dense, _ = self._dense_tiles()
        return dense

    def _dense_tiles(self) -> tuple[Array, Array]:
        """Dense (flags, partial ids), scattered back from the q-major walk."""
        return _dense_tiles(self.kv_num_blocks, self.kv_indices, self.kv_tile_flags,
                            self.kv_partial_ids)

    def density(self) -> float:
        """Fraction of tiles that are computed (1.0 for dense attention); needs a concrete
        mask (a Python float)."""
        if isinstance(self.kv_num_blocks, jax.core.Tracer):
            raise TypeError("BlockMask.density() / sparsity() return Python floats, so the "
                            "mask must be concrete: this one is traced (built inside jax.jit "
                            "or jax.vmap); call them outside")
        total = np.prod(self.kv_indices.shape)
        return float(np.sum(self.kv_num_blocks)) / float(total)

    def sparsity(self) -> float:
        """Fraction of tiles skipped entirely (no loads, no math)."""
        return 1.0 - self.density()

    def restrict(self, mask_mod: MaskMod) -> BlockMask:
        """This mask AND a structured mask_mod, classified on this mask's tiles."""
        if not isinstance(mask_mod, MaskMod):
            raise TypeError(f"restrict takes a structured mask (causal_mask, "
                            f"sliding_window_mask, document_mask, ...), got "
                            f"{type(mask_mod).__name__}: build a mask_mod function into a new "
                            f"mask with create_block_mask(and_masks(...), ...) instead")
        mask_mod.check_lengths(self.grid)
        batch = self.shape[0]
        if mask_mod.batch_size() not in (1, batch) and batch != 1:
            raise ValueError(f"restrict: the mask_mod's arrays have batch size "
                             f"{mask_mod.batch_size()}, this mask {batch}")
        new_flags, new_ids = _restricted_tiles(*self._dense_tiles(), mask_mod, grid=self.grid)
        combined = mask_mod if self.mask_mod is None else And(self.mask_mod, mask_mod)
        # Two runs of consecutive FULL blocks intersect in one.
        return BlockMask.from_tile_flags(
            new_flags, new_ids, self.partial_masks, combined, q_len=self.q_len,
            kv_len=self.kv_len, block_size=self.block_size,
            contiguous_full=self.contiguous_full and has_contiguous_full_tiles(mask_mod))

    def repeat_queries(self, group: int) -> BlockMask:
        """This mask over ``group`` query rows per position (row r is position r // group),
        on the same tiles: the mask of grouped-query attention with each group's heads
        packed into rows (`omni_jax.query_groups`). Needs ``group`` to divide block_q, so
        that every new q-block lies in one q-block of this mask."""
        bq, bkv = self.block_size
        if group < 1 or bq % group:
            raise ValueError(f"repeat_queries: group must divide block_q={bq}, got {group}")
        q_len = self.q_len * group
        num_q_blocks = -(-q_len // bq)
        flags, ids, partial_masks = _repeated_tiles(*self._dense_tiles(), self.partial_masks,
                                                    group=group, num_q_blocks=num_q_blocks)
        if not isinstance(partial_masks, jax.core.Tracer):  # identical slices: one tile
            partial_masks, first = np.unique(np.asarray(partial_masks), axis=0,
                                             return_inverse=True)
            ids = np.asarray(ids)
            ids = np.where(ids >= 0, first.ravel().astype(np.int32)[ids], -1)
        mask_mod = None if self.mask_mod is None else RepeatedQueries.of(self.mask_mod, group)
        repeated = BlockMask.from_tile_flags(flags, ids, partial_masks, mask_mod, q_len=q_len,
                                             kv_len=self.kv_len, block_size=self.block_size,
                                             contiguous_full=self.contiguous_full)
        hint = self.walk_hint
        if hint is None or num_q_blocks != group * self.grid.num_q_blocks:
            return repeated  # a ragged last q-block is repeated fewer times: not exact
        # Every q-block's walk repeated ``group`` times: as long on average, and each
        # kv-block walks ``group`` times as many FULL q-blocks.
        return repeated.with_walk_hint(WalkStatistics(
            hint.mean_kv_blocks, hint.mean_full_q_blocks * group))

    def to_dense(self) -> Array:
        """The element mask ``[Bm, Hm, q_len, kv_len]`` bool (O(q_len * kv_len): debugging)."""
        return _elements(*self._dense_tiles(), self.partial_masks, self.mask_mod,
                         q_len=self.q_len, kv_len=self.kv_len)

    def __repr__(self) -> str:
        batch, heads, q_len, kv_len = self.shape
        header = (f"BlockMask(shape=({batch}, {heads}, {q_len}, {kv_len}), "
                  f"block_size={self.block_size}")
        if not isinstance(self.kv_num_blocks, (np.ndarray, jax.Array)) or isinstance(
                self.kv_num_blocks, jax.core.Tracer):
            return header + ", traced)"  # or abstract, as from jax.eval_shape
        flags = np.asarray(self.tile_flags()[0, 0])
        symbols = {MASKED: ".", FULL: "#", COMPUTED: "c", PARTIAL: "p", COMPUTED | PARTIAL: "p"}
        rows = ["".join(symbols[int(f)] for f in row[:64]) + ("..." if len(row) > 64 else "")
                for row in flags[:32]]
        if len(flags) > 32:
            rows.append("...")
        legend = "# full, c computed from indices, p stored partial, . skipped"
        return (header + f", sparsity={self.sparsity():.2%})\n  "
                + "\n  ".join(rows) + f"\n  ({legend}; batch 0, head 0)")

