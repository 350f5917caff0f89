"""The block-sparse mask as Pallas attention kernels consume it (Triton and Mosaic alike).

`kernel_mask` turns a block-sparse mask (an `omni_jax.BlockMask`) into flat kernel
inputs; `tile_visibility` evaluates, inside a kernel, which elements of one
(q-block, kv-block) tile are visible. Both kernel families walk the mask
through these two functions, so the walk and the tile semantics exist once:

* walk the ``count`` active kv-blocks of a q-block (forward, dQ) from
  ``kv_num_blocks``/``kv_indices``, or the active q-blocks of a kv-block
  (dK/dV) from ``q_num_blocks``/``q_indices``;
* FULL tiles (flags 0) need no mask math at all. Each walk lists its FULL
  tiles first (``kv_num_full``/``q_num_full`` of them; the softmax and the
  gradient sums do not depend on the order), so a kernel runs one loop
  without any mask code, then one over the masked tiles, with no per-tile
  branch on FULL;
* COMPUTED tiles evaluate the structured mask_mod from indices and the
  kv bound; PARTIAL tiles read ``partial_masks[partial_id]``.

Kernel configs depend on the walks' mean lengths (`WalkStatistics`): read from the
arrays where the mask is concrete at trace time, else from the mask's ``walk_hint``
(`walk_statistics`).

Structured mask_mods carry arrays (segment ids, prefix lengths). Each leaf has
a kind: ``"q"`` leaves are padded to ``[Bm, num_q_blocks * block_q]`` and a
kernel loads the slice of its q-block; ``"kv"`` leaves are padded to
``[Bm, num_kv_blocks * block_kv]`` and the kernel loads the slice of the
current kv-block; ``"batch"`` leaves are ``[Bm]`` and the kernel loads one
scalar. `tile_visibility` takes those loaded values in leaf order, shaped
``[block_q, 1]``, ``[1, block_kv]`` and scalar respectively.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tile_classes import COMPUTED, FULL, PARTIAL, LeafKind, trace_time_eval

Array = Any


class BlockSparseMask(Protocol):
    """What the kernels read of a block-sparse mask (`omni_jax.BlockMask` is one).

    ``grid`` has the lengths, block sizes and block counts; ``mask_mod`` is None or a
    pytree whose ``leaf_kinds()`` name its leaves' kinds and whose
    ``predicate(q_idx, kv_idx)`` evaluates it at global positions. The walks' arrays
    are those `KernelMask` documents, in ascending block order. ``walk_hint`` is None or
    the `WalkStatistics` of the arrays, for when they are traced.
    """

    grid: Any
    mask_mod: Any
    contiguous_full: bool
    walk_hint: WalkStatistics | None
    kv_num_blocks: Array
    kv_indices: Array
    kv_tile_flags: Array
    kv_partial_ids: Array
    q_num_blocks: Array
    q_indices: Array
    q_tile_flags: Array
    q_partial_ids: Array
    partial_masks: Array


@dataclasses.dataclass(frozen=True)
class WalkStatistics:
    """Mean walk lengths of a block-sparse mask, over its batch, heads and blocks: what
    the kernels' configs are chosen by (kv splits, short-walk tiles, the fused dQ).

    ``mean_kv_blocks``: active kv-blocks per q-block (the forward's and dQ's walk);
    ``mean_full_q_blocks``: FULL q-blocks per kv-block (the dK/dV walk's FULL steps).
    """

    mean_kv_blocks: float
    mean_full_q_blocks: float

    def __post_init__(self):
        for name in ("mean_kv_blocks", "mean_full_q_blocks"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.number)) or not 0 <= value < np.inf:
                raise ValueError(f"WalkStatistics.{name} must be a finite number >= 0, "
                                 f"got {value!r}")
            object.__setattr__(self, name, float(value))

    @classmethod
    def of_tile_flags(cls, tile_flags: Array) -> WalkStatistics:
        """The statistics of concrete dense ``tile_flags [Bm, Hm, nq, nkv]`` (MASKED -1),
        as `BlockMask.tile_flags` returns them (ragged kv tail marked)."""
        flags = np.asarray(tile_flags)
        num_q_blocks, num_kv_blocks = flags.shape[-2:]
        lead = int(np.prod(flags.shape[:-2]))
        return cls(float(np.sum(flags >= 0)) / (lead * num_q_blocks),
                   float(np.sum(flags == FULL)) / (lead * num_kv_blocks))

    @classmethod
    def mean(cls, statistics: Sequence[WalkStatistics]) -> WalkStatistics:
        """The mean of several masks' statistics (of equal grids)."""
        if not statistics:
            raise ValueError("WalkStatistics.mean needs at least one WalkStatistics")
        return cls(float(np.mean([s.mean_kv_blocks for s in statistics])),
                   float(np.mean([s.mean_full_q_blocks for s in statistics])))


@dataclasses.dataclass(frozen=True)
class MaskLayout:
    """Static facts a kernel needs to evaluate a tile's mask."""

    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    num_q_blocks: int
    num_kv_blocks: int
    # Structure of the mask_mod (None: no structured mask) and its leaves' kinds.
    mask_mod_treedef: Any
    leaf_kinds: tuple[LeafKind, ...]
    # `BlockMask.contiguous_full`: FULL tiles may be walked by counting, not by index.
    contiguous_full: bool

    @property
    def ragged_kv(self) -> bool:
        return self.kv_len % self.block_kv != 0

    @property
    def padded_q_len(self) -> int:
        """Query rows the mask's blocks cover (a walk may reach tiles past q_len)."""
        return self.num_q_blocks * self.block_q

    @property
    def padded_kv_len(self) -> int:
        """Key rows the mask's blocks cover."""
        return self.num_kv_blocks * self.block_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelMask:
    """A BlockMask's arrays as kernel inputs (int32 walks, int8 stored tiles).

    Leading dims ``[Bm, Hm]`` are 1 when broadcast: index them with
    ``b if Bm > 1 else 0`` (see `batch_head_index`).
    """

    kv_num_blocks: Array  # [Bm, Hm, nq]
    kv_num_full: Array  # [Bm, Hm, nq]: the walk's first kv_num_full tiles are FULL
    kv_indices: Array  # [Bm, Hm, nq, nkv]
    kv_tile_flags: Array
    kv_partial_ids: Array
    q_num_blocks: Array  # [Bm, Hm, nkv]
    q_num_full: Array  # [Bm, Hm, nkv]
    q_indices: Array  # [Bm, Hm, nkv, nq]
    q_tile_flags: Array
    q_partial_ids: Array
    partial_masks: Array  # [P, block_q, block_kv] int8
    leaves: tuple[Array, ...]  # mask_mod leaves, padded (module docstring)
    # The mask's `WalkStatistics` for when the arrays are traced (static; None: unknown).
    walk_hint: WalkStatistics | None = dataclasses.field(default=None,
                                                         metadata=dict(static=True))


def kernel_mask(mask: BlockSparseMask) -> tuple[KernelMask, MaskLayout]:
    """Kernel inputs and static layout of ``mask``; computed while tracing when ``mask`` is
    concrete (`trace_time_eval`), so that a static mask costs no XLA ops per call."""
    with trace_time_eval(mask.grid, mask):
        return _kernel_mask(mask)


def _kernel_mask(mask: BlockSparseMask) -> tuple[KernelMask, MaskLayout]:
    grid = mask.grid
    if mask.mask_mod is None:
        leaves, treedef, kinds = [], None, ()
    else:
        leaves, treedef = jax.tree.flatten(mask.mask_mod)
        kinds = mask.mask_mod.leaf_kinds()
    padded_length = {"q": grid.num_q_blocks * grid.block_q,
                     "kv": grid.num_kv_blocks * grid.block_kv}
    padded = []
    for leaf, kind in zip(leaves, kinds, strict=True):
        leaf = jnp.asarray(leaf, jnp.int32)
        if kind != "batch":
            leaf = jnp.pad(leaf, ((0, 0), (0, padded_length[kind] - leaf.shape[1])), mode="edge")
        padded.append(leaf)
    kv_walk = _full_tiles_first(mask.kv_num_blocks, mask.kv_indices, mask.kv_tile_flags,
                                mask.kv_partial_ids)
    q_walk = _full_tiles_first(mask.q_num_blocks, mask.q_indices, mask.q_tile_flags,
                               mask.q_partial_ids)
    arrays = KernelMask(
        kv_num_blocks=mask.kv_num_blocks, kv_num_full=kv_walk[0], kv_indices=kv_walk[1],
        kv_tile_flags=kv_walk[2], kv_partial_ids=kv_walk[3],
        q_num_blocks=mask.q_num_blocks, q_num_full=q_walk[0], q_indices=q_walk[1],
        q_tile_flags=q_walk[2], q_partial_ids=q_walk[3],
        partial_masks=mask.partial_masks.astype(jnp.int8), leaves=tuple(padded),
        walk_hint=mask.walk_hint)
    layout = MaskLayout(q_len=grid.q_len, kv_len=grid.kv_len, block_q=grid.block_q,
                        block_kv=grid.block_kv, num_q_blocks=grid.num_q_blocks,
                        num_kv_blocks=grid.num_kv_blocks, mask_mod_treedef=treedef,
                        leaf_kinds=tuple(kinds), contiguous_full=mask.contiguous_full)
    return arrays, layout


def _full_tiles_first(count: Array, indices: Array, flags: Array, partial_ids: Array):
    """A walk reordered so its FULL tiles come first: (num_full, indices, flags, ids).

    Stable within each kind; the padding past ``count`` stays at the end.
    """
    n = indices.shape[-1]
    position = jnp.arange(n, dtype=jnp.int32)
    active = position < count[..., None]
    full = active & (flags == FULL)
    rank = jnp.where(full, 0, jnp.where(active, 1, 2))
    order = jnp.argsort(rank * n + position, axis=-1).astype(jnp.int32)
    reorder = lambda x: jnp.take_along_axis(x, order, axis=-1)
    return (full.sum(axis=-1, dtype=jnp.int32), reorder(indices), reorder(flags),
            reorder(partial_ids))


def walk_statistics(mask: KernelMask) -> WalkStatistics | None:
    """The mask's `WalkStatistics`: from its arrays where they are known at trace time,
    else its ``walk_hint`` (None: unknown)."""
    if isinstance(mask.kv_num_blocks, jax.core.Tracer) or isinstance(mask.q_num_full,
                                                                     jax.core.Tracer):
        return mask.walk_hint
    return WalkStatistics(float(np.mean(np.asarray(mask.kv_num_blocks))),
                          float(np.mean(np.asarray(mask.q_num_full))))


def walk_offsets(num_blocks: int) -> tuple[int, int, int]:
    """Where a packed walk row (`packed_walk`) holds its block indices, flags and partial ids.

    Entry 0 is the count of active blocks, entry 1 the number of FULL ones
    (listed first).
    """
    return 2, 2 + num_blocks, 2 + 2 * num_blocks


def packed_walk(mask: KernelMask, over: Literal["kv", "q"]) -> Array:
    """The walk over kv-blocks of each q-block (``over="kv"``: forward, dQ) or over
    q-blocks of each kv-block (``"q"``: dK/dV) as one int32 array ``[Bm, Hm, n, 2 + 3 * m]``:
    per walked block its count, FULL count, indices, flags and partial ids (`walk_offsets`).

    One array rather than five: a kernel reads one row, and a static mask is one
    constant (XLA materialises uniform constants, such as a dense mask's counts,
    with a kernel of their own at every call).
    """
    count, num_full, indices, flags, partial_ids = (
        getattr(mask, f"{over}_{name}")
        for name in ("num_blocks", "num_full", "indices", "tile_flags", "partial_ids"))
    return jnp.concatenate([count[..., None], num_full[..., None], indices, flags,
                            partial_ids], axis=-1).astype(jnp.int32)


def rotated_add_turns(mask: KernelMask, group_size: int) -> Array:
    """``[Bm, Hm, nkv, nq]`` int32: the turn of the ``p``-th tile of each kv-block's walk
    over q-blocks among the adds to its q-block from its group of kv-blocks, for walks
    of FULL tiles only; 0 past the walk.

    The deterministic fused dQ (`attention_bwd_sm90.BackwardConfig.ordered_dq`) adds a
    q-block's products in a fixed order. Kv-block ``j`` walks its ``n`` tiles rotated,
    from its ``(j mod n)``-th on, so that under a dense mask the kv-blocks of a head start
    at different q-blocks and each q-block's turns follow the order in which the walks
    reach it: turns go by that step, then by kv-block. The kv-blocks form groups of
    ``group_size`` consecutive ones, each ordering its own adds (to a sum of its own). A
    turn ``t`` is stored as ``t``, or as ``-t - 1`` for the group's last add to the
    q-block (which resets the count it waits on).
    """
    num_full, q_indices = mask.q_num_full, mask.q_indices
    num_kv_blocks, num_q_blocks = q_indices.shape[-2:]
    num_groups = -(-num_kv_blocks // group_size)
    position = jnp.arange(num_q_blocks)
    walk_len = jnp.maximum(num_full, 1)[..., None]
    walked = position < num_full[..., None]
    start = jnp.arange(num_kv_blocks)[:, None] % walk_len
    # When each tile is reached (kv-blocks break ties): unique per q-block, and larger
    # than any reached one where the q-block is not walked.
    reached = (position - start) % walk_len * num_kv_blocks + jnp.arange(num_kv_blocks)[:, None]
    never = num_q_blocks * num_kv_blocks

    def by_q_block(indices, reached, walked):  # one kv-block's walk, indexed by q-block
        target = jnp.where(walked, indices, num_q_blocks)
        return jnp.full(num_q_blocks, never, jnp.int32).at[target].set(reached, mode="drop")

    reached = jnp.vectorize(by_q_block, signature="(n),(n),(n)->(n)")(
        q_indices, reached.astype(jnp.int32), walked)  # [..., nkv, nq]
    # [..., groups, group_size, nq], the last group padded with kv-blocks that never add.
    padding = [(0, 0)] * (reached.ndim - 2) + [(0, num_groups * group_size - num_kv_blocks),
                                               (0, 0)]
    grouped = jnp.pad(reached, padding, constant_values=never).reshape(
        *reached.shape[:-2], num_groups, group_size, num_q_blocks)
    turn = jnp.argsort(jnp.argsort(grouped, axis=-2), axis=-2).astype(jnp.int32)  # rank
    adds = (grouped < never).sum(-2, keepdims=True, dtype=jnp.int32)
    turn = jnp.where(turn == adds - 1, -turn - 1, turn)
    turn = turn.reshape(*reached.shape[:-2], -1, num_q_blocks)[..., :num_kv_blocks, :]
    turns = jnp.take_along_axis(turn, jnp.clip(q_indices, 0, num_q_blocks - 1), axis=-1)
    return jnp.where(walked, turns, 0).astype(jnp.int32)


def batch_head_index(mask_array: Array, batch: Array, head: Array) -> tuple[Array, Array]:
    """Indices into the broadcastable leading ``[Bm, Hm]`` dims of a mask array."""
    bm, hm = mask_array.shape[:2]
    return (batch if bm > 1 else 0), (head if hm > 1 else 0)


def structured_visibility(layout: MaskLayout, q_idx: Array, kv_idx: Array,
                          leaf_values: Sequence[Array]) -> Array | None:
    """The structured mask_mod AND ``kv_idx < kv_len`` at global indices, or None when
    both hold everywhere (no mask_mod, and kv_len a whole number of kv-blocks)."""
    visible = kv_idx < layout.kv_len if layout.ragged_kv else None
    if layout.mask_mod_treedef is not None:
        mask_mod = jax.tree.unflatten(layout.mask_mod_treedef, list(leaf_values))
        predicate = mask_mod.predicate(q_idx, kv_idx)
        visible = predicate if visible is None else visible & predicate
    return visible


def tile_visibility(layout: MaskLayout, flags: Array, q_idx: Array, kv_idx: Array,
                    leaf_values: Sequence[Array], partial_tile: Array | None) -> Array | None:
    """Visible elements of a tile with tile ``flags`` (branch-free in the flags), or None
    when the layout can hide none of them.

    ``q_idx [block_q, 1]`` and ``kv_idx [1, block_kv]`` are global positions;
    ``partial_tile [block_q, block_kv]`` is the tile's stored mask (any int or
    bool dtype), or None when the kernel knows no tile is PARTIAL. Kernels
    call this only for tiles with ``flags != 0`` (FULL tiles need no mask).
    Registers are what the kernels run short of: checks that hold for every index
    of the layout (the kv bound of a whole number of kv-blocks) are left out.
    """
    visible = None
    computed = structured_visibility(layout, q_idx, kv_idx, leaf_values)
    if computed is not None:
        visible = ((flags & COMPUTED) == 0) | computed
    if partial_tile is not None:
        stored = ((flags & PARTIAL) == 0) | (partial_tile != 0)
        visible = stored if visible is None else visible & stored
    return visible
