"""What the Mosaic-GPU (sm90) attention kernels share: forward, dQ and dK/dV.

* the mask walk packed per walked block into one 2-D TMA box (`packed_walk`,
  `walk_entry`), for either orientation of the BlockMask;
* the producer that fetches the active kv-blocks of a q-block into a ring of
  smem stages (`produce_kv_blocks`, used by the forward and the dQ kernel);
* the score transform in log2 units with its derivative for the backward
  (`log2_scores`), mask leaves, padding and swizzled smem layouts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import block_sparse, compat, runtime
from pallas_kernels.block_sparse import (
    KernelMask,
    MaskLayout,
    batch_head_index,
    structured_visibility,
    tile_visibility,
)
from pallas_kernels.captured import PackedCaptured, score_mod_on_packed
from pallas_kernels.score_pipeline import ConvertedScoreMod, apply_score_mod
from pallas_kernels.tile_classes import PARTIAL

Array = Any

ROWS_PER_CONSUMER = 64  # One wgmma M tile per consumer warpgroup.
BLOCK_Q = 128  # The q tile of every BlockMask the Mosaic kernels walk.
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# A walk row is stored as [rows, WALK_LINE]: a TMA box is at most 256 elements per dim.
WALK_LINE = 128
# 227 KiB of shared memory per CTA on sm90, less what the kernels' `smem_bytes` do not
# count (walks, lse, barriers, 1 KiB alignment of swizzled buffers).
SMEM_LIMIT = 227 * 1024 - 8 * 1024


def padded_head_dim(head_dim: int) -> int | None:
    """The kernel head dim serving ``head_dim`` (zero-padded), or None when too large."""
    return next((d for d in SUPPORTED_HEAD_DIMS if head_dim <= d), None)


def padded_head_dims(head_dim: int, head_dim_v: int) -> tuple[int | None, int | None]:
    """The kernel head dims serving a query-key and a value head dim: each its own
    `padded_head_dim`, except that two different ones above 128 (192 and 256) both take
    the larger. Q and O then share one shared-memory buffer; 192 beside 256 would need
    both and, with kv tiles of 64 rows, more than an SM has."""
    dim, dim_v = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    if dim is not None and dim_v is not None and dim != dim_v and min(dim, dim_v) > 128:
        dim = dim_v = max(dim, dim_v)
    return dim, dim_v


def packed_walk(mask: KernelMask, over: str) -> Array:
    """`block_sparse.packed_walk` as ``[Bm, Hm, n, R, WALK_LINE]``: one walked block's row
    is one 2-D TMA box per CTA."""
    return walk_lines(block_sparse.packed_walk(mask, over))


def walk_lines(rows: Array) -> Array:
    """Walk rows ``[..., n]`` as ``[..., R, WALK_LINE]`` (zero-padded): one TMA box each."""
    rows = jnp.pad(rows, ((0, 0),) * (rows.ndim - 1) + ((0, -rows.shape[-1] % WALK_LINE),))
    return rows.reshape(*rows.shape[:-1], -1, WALK_LINE)


def walk_row_lines(num_blocks: int, ranked: bool = False) -> int:
    """Lines of `WALK_LINE` ids holding a packed walk row over at most ``num_blocks``
    blocks (`block_sparse.packed_walk`: two counts, then indices, flags and partial ids;
    ``ranked``, then the dQ add turns, `block_sparse.rotated_add_turns`). The kernels
    keep whole rows in shared memory, so very long sequences are bounded by it
    (`walk_row_bytes`)."""
    return -(-(2 + (3 + ranked) * num_blocks) // WALK_LINE)


def walk_row_bytes(num_blocks: int, ranked: bool = False) -> int:
    """Shared memory of one packed walk row over ``num_blocks`` blocks."""
    return walk_row_lines(num_blocks, ranked) * WALK_LINE * 4


def has_masked_tiles(layout: MaskLayout, has_partial: bool) -> bool:
    """Whether a walk can hold tiles other than FULL (COMPUTED or PARTIAL)."""
    return has_partial or layout.ragged_kv or layout.mask_mod_treedef is not None


def walk_entry(walk_smem, i):
    """Entry ``i`` of the walk row held in smem as ``[R, WALK_LINE]``."""
    return walk_smem[lax.div(i, WALK_LINE), lax.rem(i, WALK_LINE)]


@dataclasses.dataclass(frozen=True)
class SmemWalk:
    """A packed walk row (`block_sparse.packed_walk`) held in smem as ``[R, WALK_LINE]``,
    read as the kernels read any walk (`pallas_kernels.paged.WalkSteps` is the other
    kind): its count, its FULL count, and per step the block, flags and partial id."""

    smem: Any
    num_blocks: int

    @property
    def count(self) -> Array:
        return self.smem[0, 0]

    @property
    def num_full(self) -> Array:
        return self.smem[0, 1]

    def _entry(self, field: int, step) -> Array:
        return walk_entry(self.smem, block_sparse.walk_offsets(self.num_blocks)[field] + step)

    def index(self, step) -> Array:
        return self._entry(0, step)

    def flags(self, step) -> Array:
        return self._entry(1, step)

    def partial_id(self, step) -> Array:
        return self._entry(2, step)


class LeafCounts:
    """``num_q_leaves``/``num_kv_leaves`` of a kernel's statics, from its ``leaf_slots``
    (per mask_mod leaf: ("q" | "kv", row in its stacked leaf array))."""

    leaf_slots: tuple[tuple[str, int], ...]
    # The kv leaf is computed by the producer (paged keys' sequence lengths,
    # `produce_kv_blocks`' key_lens), not an operand.
    kv_leaves_computed: bool = False

    @property
    def num_q_leaves(self) -> int:
        return sum(kind == "q" for kind, _ in self.leaf_slots)

    @property
    def num_kv_leaves(self) -> int:
        return sum(kind == "kv" for kind, _ in self.leaf_slots)


def split_optional_refs(refs, statics) -> tuple[Any, Any, Any, Any, list]:
    """(partial bit-masks, q leaves, kv leaves, packed captured arrays, the rest) of a
    kernel's trailing refs.

    The optional operands come first, in that order, each only when ``statics``
    (``has_partial``, ``num_q_leaves``, ``num_kv_leaves`` and not
    ``kv_leaves_computed``, ``scores.captured``) says the kernel has it.
    """
    refs = list(refs)
    partial_ref = refs.pop(0) if statics.has_partial else None
    q_leaf_ref = refs.pop(0) if statics.num_q_leaves else None
    kv_leaf_ref = (refs.pop(0) if statics.num_kv_leaves and not statics.kv_leaves_computed
                   else None)
    captured_ref = refs.pop(0) if statics.scores.captured is not None else None
    return partial_ref, q_leaf_ref, kv_leaf_ref, captured_ref, refs


def load_captured(statics, captured_ref, captured_smem, captured_barrier) -> None:
    """Producer: TMA-loads the packed captured arrays (if any) into smem at CTA start."""
    if statics.scores.captured is not None:
        plgpu.copy_gmem_to_smem(captured_ref, captured_smem, captured_barrier)


def wait_captured(statics, captured_barrier) -> None:
    """Consumer: waits once for the captured arrays (if any) before its first scores."""
    if statics.scores.captured is not None:
        plgpu.barrier_wait(captured_barrier)


def captured_scratch(statics) -> tuple[Any, Any]:
    """(smem, barrier) scratch of the packed captured arrays, or (None, None)."""
    layout = statics.scores.captured
    if layout is None:
        return None, None
    return plgpu.SMEM((layout.rows, layout.cols), jnp.float32), plgpu.Barrier(num_barriers=1)


def head_program(statics, batch_head=None) -> tuple[Array, Array, Array]:
    """(batch, query head, kv head) of a CTA of a q-block-major kernel (``batch_head``:
    its index along the batch and heads, by default its "batch_head" grid index)."""
    if batch_head is None:
        batch_head = lax.axis_index("batch_head")
    head = lax.rem(batch_head, statics.num_q_heads)
    return (lax.div(batch_head, statics.num_q_heads), head,
            lax.div(head, statics.group_size))


def q_block_at(num_q_blocks: int, position, *, interleaved: bool):
    """The q-block at ``position`` of a head's launch order.

    Last (under causal-like masks the longest) q-blocks first, which shortens
    the tail of the launch; ``interleaved`` alternates the longest and the
    shortest left (last, first, second to last, ...), so that consecutive
    pairs have even walks under a causal mask.
    """
    if not interleaved:
        return num_q_blocks - 1 - position
    half = lax.div(position, 2)
    return jnp.where(lax.rem(position, 2) == 0, num_q_blocks - 1 - half, half)


def sectioned_position(position, num_heads: int, num_blocks: int, section: int,
                       ) -> tuple[Array, Array]:
    """(head, block rank) of the CTA at launch ``position`` of ``num_heads`` x
    ``num_blocks`` CTAs launched in sections of ``section`` heads, rank by rank across
    a section's heads (the last section has the heads left). A bijection."""
    section_ctas = section * num_blocks
    first = lax.div(position, section_ctas) * section
    heads = jnp.minimum(section, num_heads - first)
    within = lax.rem(position, section_ctas)
    return first + lax.rem(within, heads), lax.div(within, heads)


def sectioned_launch(block_axis: str, num_heads: int, num_blocks: int, *, sections: bool,
                     ) -> tuple[Array, Array]:
    """(batch-head, block rank) of this CTA of a (``"batch_head"``, ``block_axis``) grid,
    whose last axis CUDA launches fastest. Rank 0 is a head's longest walk under causal-
    like masks (the caller maps ranks to blocks). Unsectioned, the heads launch one after
    another; ``sections`` launches them in sections of heads whose blocks fill one wave
    of the SMs (`runtime.num_sms` // ``num_blocks`` heads), rank by rank across the
    section: launched head by head, the last head's longest CTAs start as the launch
    ends and run on alone (under a causal mask, 64 heads of 32 blocks on 132 SMs finish
    about 6% after an even split of the work, in a model of the greedy launch), while
    sections leave the shortest CTAs last and keep the CTAs that run at once on a few
    heads (whose Q/dO or K/V they share in L2). Sections larger than a wave lose most of
    that in the model."""
    batch_head, rank = lax.axis_index("batch_head"), lax.axis_index(block_axis)
    section = runtime.num_sms() // num_blocks
    if not sections or section < 2:
        return batch_head, rank
    return sectioned_position(batch_head * num_blocks + rank, num_heads, num_blocks,
                              section)


def q_block_program(statics, num_heads: int, *, sections: bool,
                    ) -> tuple[Array, Array, Array, Array]:
    """(q-block, batch, query head, kv head) of a CTA of one q-block of the
    ``num_heads`` (batch, query head) pairs: longest first (`q_block_at`), sectioned or
    not (`sectioned_launch`)."""
    num_q_blocks = statics.layout.num_q_blocks
    batch_head, rank = sectioned_launch("q_block", num_heads, num_q_blocks,
                                        sections=sections)
    q_block = q_block_at(num_q_blocks, rank, interleaved=False)
    return (q_block, *head_program(statics, batch_head))


def load_q_block_walk(statics, walk_ref, walk_smem, walk_barrier, q_leaves, *, batch, head,
                      q_block, block_q: int) -> Array:
    """Producer: TMA-loads a q-block's kv walk (and its mask_mod q leaves, ``q_leaves`` =
    (gmem ref, smem, barrier) or None); returns the walk's active count once it landed."""
    mask_b, mask_h = batch_head_index(walk_ref, batch, head)
    plgpu.copy_gmem_to_smem(walk_ref.at[mask_b, mask_h, q_block], walk_smem, walk_barrier)
    if q_leaves is not None:
        leaf_ref, leaf_smem, leaf_barrier = q_leaves
        plgpu.copy_gmem_to_smem(leaf_ref.at[batch, :, pl.ds(q_block * block_q, block_q)],
                                leaf_smem, leaf_barrier)
    plgpu.barrier_wait(walk_barrier)
    return walk_smem[0, 0]


def stacked_leaves(kmask: KernelMask, layout: MaskLayout, batch: int):
    """Mask leaves stacked per kind: q ``[B, Lq, nq*bq]`` and kv ``[B, Lkv, nkv*bkv]``.

    "batch" leaves (one scalar per sequence) are broadcast along q so that the
    kernels read every leaf as a q or kv vector. Also returns, per leaf in
    leaf order, ("q" | "kv", its row in the stacked array).
    """
    q_leaves, kv_leaves, slots = [], [], []
    q_length = layout.padded_q_len
    for leaf, kind in zip(kmask.leaves, layout.leaf_kinds, strict=True):
        if kind == "batch":
            leaf = jnp.broadcast_to(leaf[:, None], (leaf.shape[0], q_length))
            kind = "q"
        leaf = jnp.broadcast_to(leaf, (batch, leaf.shape[1]))
        stack = q_leaves if kind == "q" else kv_leaves
        slots.append((kind, len(stack)))
        stack.append(leaf)
    stack = lambda xs: jnp.stack(xs, axis=1) if xs else None
    return stack(q_leaves), stack(kv_leaves), tuple(slots)


def tile_leaves(leaf_slots, q_values, kv_values, tile: tuple[int, int],
                q_axis: int, tile_layout: Any = None) -> list:
    """Mask leaf values in leaf order, broadcast over a score tile whose q rows run along
    ``q_axis`` (0 for q-major tiles, 1 for the dK/dV kernel's kv-major ones), of
    ``tile_layout`` (`broadcast_over_tile`)."""
    kv_axis = 1 - q_axis
    q_values = [broadcast_over_tile(x, tile, q_axis, tile_layout) for x in q_values]
    kv_values = [broadcast_over_tile(x, tile, kv_axis, tile_layout) for x in kv_values]
    return [q_values[i] if kind == "q" else kv_values[i] for kind, i in leaf_slots]


def load_kv_leaf_columns(statics, ring, ready, slot) -> list:
    """A walk step's kv mask leaves, from ``ring`` slot ``slot`` (stacked kv leaves, with
    their "loaded" barriers ``ready``), as columns of a q-major tile.

    Call it at every step, FULL ones included: a skipped wait would put the barrier's
    tracked parity out of step with its phases.
    """
    if not statics.num_kv_leaves:
        return []
    plgpu.barrier_wait(ready.at[slot])
    return [compat.mosaic_load(ring.at[slot, i], compat.wgmma_col_layout(),
                               interpret=statics.interpret)
            for i in range(statics.num_kv_leaves)]


def tile_indices(tile: tuple[int, int], q_start, kv_start, *, q_axis: int,
                 read: tuple[bool, bool], tile_layout: Any = None) -> tuple[Array, Array]:
    """Global (q_idx, kv_idx) over a WGMMA-layout score tile whose q positions run along
    ``q_axis`` (0 for q-major tiles, 1 for the dK/dV kernel's kv-major ones).

    Built as one vector per axis broadcast over the tile: a thread then holds 2 row and
    ``tile[1] / 4`` column indices, where a 2-D iota holds ``tile[1] / 2`` of each (under
    a causal mask the 2-D form spilled up to 636 bytes a thread in the backward).
    ``tile_layout`` is the register layout of a tile other than WGMMA's (the sm100
    kernels' TMEM loads). Only the indices the caller reads (``read``: q, kv;
    `visibility_reads`, `ScoreSpec.reads_indices`) are built, the others left as their
    scalar start: jax 0.11's Mosaic layout inference fails on a broadcast that nothing
    reads.
    """
    def positions(axis, start, needed):
        if not needed:
            return start
        if tile_layout is None:
            layout = compat.wgmma_row_layout() if axis == 0 else compat.wgmma_col_layout()
        else:
            layout = tile_layout.reduce(1 - axis)
        vector = start + plgpu.broadcasted_iota(jnp.int32, (tile[axis],), 0, layout=layout)
        return broadcast_over_tile(vector, tile, axis, tile_layout)

    return (positions(q_axis, q_start, read[0]),
            positions(1 - q_axis, kv_start, read[1]))


def broadcast_over_tile(vector: Array, tile: tuple[int, int], axis: int,
                        tile_layout: Any = None) -> Array:
    """``vector`` broadcast along ``axis`` of ``tile``; into ``tile_layout`` when given
    (a broadcast's layout is otherwise inferred, WGMMA's where TCGEN05's would fit too)."""
    value = lax.broadcast_in_dim(vector, tile, [axis])
    return value if tile_layout is None else plgpu.layout_cast(value, tile_layout)


@functools.cache
def visibility_reads(layout: MaskLayout) -> tuple[bool, bool]:
    """Whether a masked tile's visibility (`structured_visibility`) reads (q, kv) indices."""
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    leaves = [scalar] * len(layout.leaf_kinds)
    jaxpr = jax.make_jaxpr(lambda q_idx, kv_idx, *leaves: structured_visibility(
        layout, q_idx, kv_idx, leaves))(scalar, scalar, *leaves).jaxpr
    return compat.inputs_read(jaxpr)[:2]


def masked_q_major_scores(statics, scores: Array, flags, indices, q_leaf_rows,
                          kv_leaf_columns, partial=None, tile_layout: Any = None) -> Array:
    """`masked_scores` of a q-major tile (the forward's and the dQ kernel's) from its
    mask leaves: q leaves as rows, kv leaves as columns."""
    leaves = tile_leaves(statics.leaf_slots, q_leaf_rows, kv_leaf_columns, scores.shape,
                         q_axis=0)
    return masked_scores(scores, statics.layout, flags, indices, leaves, partial,
                         interpret=statics.interpret, tile_layout=tile_layout)


def masked_scores(scores: Array, layout: MaskLayout, flags, indices, leaf_values,
                  partial=None, *, interpret: bool, tile_layout: Any = None) -> Array:
    """``scores`` of a tile that is not FULL, with its invisible elements at -inf.

    ``indices(read)`` builds the tile's (q_idx, kv_idx) (`tile_indices`).

    ``partial`` is (this consumer's slice of the stored-tile slot, its "loaded"
    barrier) when the mask can hold PARTIAL tiles: the producer loads a stored
    tile only for PARTIAL tiles, so only those wait for it; its barrier is None where
    the caller already waited for the tile. ``tile_layout``: the scores' register
    layout when not WGMMA.
    """
    partial_tile = None
    if partial is not None:
        tile_ref, loaded = partial

        if loaded is not None:
            @pl.when((flags & PARTIAL) != 0)
            def _():
                plgpu.barrier_wait(loaded)

        # A row per thread (the sm100 tensor-memory layout) reads int8 rows that share
        # banks in any swizzle: that load is planned with conflicts.
        partial_tile = compat.mosaic_load(tile_ref, tile_layout or plgpu.Layout.WGMMA,
                                          interpret=interpret, optimized=tile_layout is None)
    visible = tile_visibility(layout, flags, *indices(visibility_reads(layout)), leaf_values,
                              partial_tile)
    return scores if visible is None else jnp.where(visible, scores, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """How a kernel turns ``q . k`` into scores: scale, softcap, score_mod (whose captured
    arrays, if any, the kernel reads from a packed smem buffer laid out as ``captured``)."""

    scale: float
    softcap: float | None
    score_mod: ConvertedScoreMod | None
    captured: PackedCaptured | None = None
    # Whether the score_mod reads its (q_idx, kv_idx) arguments (`tile_indices`); `score_spec`
    # finds out, and without it both are built (an unread broadcast fails to lower on jax
    # 0.11, but a score_mod never gets a scalar start in place of an index tile).
    reads_indices: tuple[bool, bool] = (True, True)

    @property
    def plain(self) -> bool:
        return self.softcap is None and self.score_mod is None

    @property
    def folds_scale(self) -> bool:
        """Raw ``q . k`` goes to the softmax, which applies the scale inside the exp2
        argument's FMA; a negative scale would turn masked -inf into +inf."""
        return self.plain and self.scale > 0


def score_spec(scale: float, softcap: float | None, score_mod: ConvertedScoreMod | None,
               captured) -> tuple[ScoreSpec, Array | None]:
    """A kernel's `ScoreSpec` and its packed captured-array operand (None without any)."""
    reads = (False, False)
    if score_mod is not None:
        reads = compat.inputs_read(score_mod.jaxpr)[3:5]  # (score, b, h, q_idx, kv_idx)
    spec = ScoreSpec(scale, softcap, score_mod, reads_indices=reads)
    if score_mod is None or not score_mod.num_captured:
        return spec, None
    layout, packed = PackedCaptured.pack(captured)
    return dataclasses.replace(spec, captured=layout), packed


def with_captured_read(spec: ScoreSpec, captured_smem, batch, head) -> ScoreSpec:
    """``spec`` for one (batch, head), its score_mod reading its captured arrays from
    ``captured_smem``, the element reads done now (call it ahead of the kv loop)."""
    if spec.captured is None:
        return spec
    score_mod = score_mod_on_packed(spec.score_mod, captured_smem, spec.captured, batch, head)
    return dataclasses.replace(spec, score_mod=score_mod, captured=None)


def log2_scores(spec: ScoreSpec, qk: Array, batch, head, indices, *, slope: bool = False):
    """Scale, softcap and score_mod of ``qk``, in log2 units (the softmax runs on exp2).

    ``indices(read)`` builds the (q_idx, kv_idx) tiles a score_mod needs (`tile_indices`);
    a score_mod with captured arrays must come through `with_captured_read`. With ``slope``
    returns ``(scores, d score / d(scale * qk) or None when 1)``: the backward's
    chain rule through softcap and score_mod.
    """
    if spec.plain:
        scores = qk * (spec.scale * LOG2E)
        return (scores, None) if slope else scores
    score_mod = spec.score_mod

    def transform(scaled):
        if spec.softcap is not None:
            scaled = spec.softcap * jnp.tanh(scaled * (1.0 / spec.softcap))
        if score_mod is not None:
            scaled = apply_score_mod(score_mod, (), scaled, batch, head,
                                     *indices(spec.reads_indices))
        return scaled

    scaled = qk * spec.scale
    if not slope:
        return transform(scaled) * LOG2E
    scores, derivative = jax.jvp(transform, (scaled,), (jnp.ones_like(scaled),))
    return scores * LOG2E, derivative


def wait_released(consumed_barrier, *, interpret: bool) -> None:
    """Producer: waits until the consumers released a ring slot, before TMA refills it.

    Consumers read some ring buffers with plain loads (lse and delta, mask leaves,
    stored tiles) and release them by a barrier arrival; the TMA that refills them
    writes through the async proxy. The Mosaic-GPU interpreter of jax 0.11 and later
    orders such a write after those reads only through a proxy fence in the issuing
    thread (`commit_smem`), and reports a race without one. Compiled kernels skip the
    fence: the reads are complete (their values in registers) before the arrival that
    the wait observes, which is what CUTLASS's TMA pipelines rely on as well.
    """
    plgpu.barrier_wait(consumed_barrier)
    if interpret:
        plgpu.commit_smem()


def page_copies(block_kv: int, page_size: int | None) -> int:
    """TMA copies that fill one K (V) tile: one per page the tile spans (paged K/V
    sources, `produce_kv_blocks`), else one. Each arrives on the tile's barrier."""
    return 1 if page_size is None else max(1, block_kv // page_size)


def produce_kv_blocks(walk, count, *, stages: int, block_kv: int, batch, kv_head, k, v,
                      consumed, interpret: bool, begin=0, kv_leaves=None, partial=None,
                      first_step=0, v_first=False, pages=None, key_lens=None) -> None:
    """The producer loop of one q-block: TMA-loads steps ``begin .. begin + count - 1`` of
    its ``walk`` (`SmemWalk`, or `pallas_kernels.paged.WalkSteps`) into the ring.

    ``k`` and ``v`` are (gmem ref, smem ring, "loaded" barriers); ``consumed``
    the (K, V) "consumed" barriers the consumers arrive on. The q-block's steps
    are the ring's steps ``first_step ...`` (a CTA that computes several
    q-blocks keeps one ring going across them); a slot's K (V) is refilled
    only after its previous K (V) was consumed. The caller drains the ring
    after its last q-block (`drain_ring`). ``kv_leaves`` (stacked kv mask
    leaves) and ``partial`` (stored int8 tiles, loaded for PARTIAL tiles only)
    are optional (ref, ring, barriers) triples. K is loaded before V, or with
    ``v_first`` after it: the order in which the consumers release them.

    ``pages`` = (page table row in smem as ``[R, WALK_LINE]``, page_size) makes K and V
    paged: their refs are ``[1, num_pages * page_size, kv_heads, D]`` and token ``i`` of
    the sequence is row ``i % page_size`` of page ``table[i // page_size]``, clamped
    here into the cache (no TMA leaves it, whatever the table holds; the mask hides the
    keys of ids outside it). A tile then takes `page_copies` TMAs, each of one page (or
    of the part of one page the tile covers) into consecutive rows of the slot. With
    ``key_lens`` (the sequence's length) the one kv leaf is not loaded but computed here
    (``kv_leaves``' ref None): per key the length, or -1 on a page outside the cache.
    """
    k_consumed, v_consumed = consumed

    @pl.loop(0, count)
    def _fetch(step):
        ring_step = first_step + step
        slot = lax.rem(ring_step, stages)
        kv_block = walk.index(begin + step)
        rows_kv = pl.ds(kv_block * block_kv, block_kv)

        # K and V are refilled independently, each once every consumer released the
        # slot's previous contents (ring_step - stages): a consumer that keeps V for its
        # software-pipelined P @ V then does not hold back the next K. The mask data
        # of a step is read by the softmax, after K was released: it goes with V.
        def wait_slot(consumed):
            @pl.when(ring_step >= stages)
            def _():
                wait_released(consumed.at[slot], interpret=interpret)

        def load_tile(ref, smem, barriers):
            if pages is None:
                plgpu.copy_gmem_to_smem(ref.at[batch, rows_kv, kv_head], smem.at[slot],
                                        barriers.at[slot])
                return
            table, page_size = pages
            copies = page_copies(block_kv, page_size)
            rows = block_kv // copies
            for j in range(copies):
                token = kv_block * block_kv + j * rows
                page = jnp.clip(walk_entry(table, lax.div(token, page_size)), 0,
                                ref.shape[1] // page_size - 1)
                row = page * page_size + lax.rem(token, page_size)
                plgpu.copy_gmem_to_smem(ref.at[0, pl.ds(row, rows), kv_head],
                                        smem.at[slot, pl.ds(j * rows, rows)], barriers.at[slot])

        def load_k():
            wait_slot(k_consumed)
            load_tile(*k)

        if not v_first:
            load_k()
        wait_slot(v_consumed)
        if kv_leaves is not None:
            leaf_ref, leaf_smem, leaf_barriers = kv_leaves
            if leaf_ref is None:
                _store_paged_key_lens(leaf_smem.at[slot, 0], kv_block, key_lens, pages,
                                      num_pages=v[0].shape[1] // pages[1])
                plgpu.barrier_arrive(leaf_barriers.at[slot])
            else:
                plgpu.copy_gmem_to_smem(leaf_ref.at[batch, :, rows_kv], leaf_smem.at[slot],
                                        leaf_barriers.at[slot])
        if partial is not None:
            partial_ref, mask_smem, mask_barriers = partial

            @pl.when((walk.flags(begin + step) & PARTIAL) != 0)
            def _():
                partial_id = walk.partial_id(begin + step)
                plgpu.copy_gmem_to_smem(partial_ref.at[partial_id], mask_smem.at[slot],
                                        mask_barriers.at[slot])

        load_tile(*v)
        if v_first:
            load_k()


def _store_paged_key_lens(leaf_smem, kv_block, length, pages, *, num_pages: int) -> None:
    """Writes the paged key lengths of kv-block ``kv_block`` (`produce_kv_blocks`) into
    ``leaf_smem`` (``[block_kv]``), visible to the consumers once they waited for the
    producer's next arrival. Written in vectors of 64 keys (a consumer row's layout: one
    register a thread, where the producer has few)."""
    table, page_size = pages
    block_kv = leaf_smem.shape[0]
    span = min(page_size, block_kv)  # keys of the tile on one page
    keys = plgpu.broadcasted_iota(jnp.int32, (ROWS_PER_CONSUMER,), 0,
                                  layout=compat.wgmma_row_layout())
    for start in range(0, block_kv, ROWS_PER_CONSUMER):
        lens = keys * 0
        for j in range(start // span, (start + ROWS_PER_CONSUMER - 1) // span + 1):
            page = walk_entry(table, lax.div(kv_block * block_kv + j * span, page_size))
            page_len = jnp.where((page >= 0) & (page < num_pages), length, -1)
            lens = jnp.where((keys + start) // span == j, page_len, lens)
        leaf_smem.at[pl.ds(start, ROWS_PER_CONSUMER)][...] = lens
    plgpu.commit_smem()  # every thread's store lands before the arrival


def load_q_step(statics, sources, rings, ready, *, slot, batch, head, q_start, rows: int,
                part, flags, partial_id) -> None:
    """The TMA loads of one step of a kv-major walk (the dK/dV kernels') into ring slot
    ``slot``: ``rows`` query rows from ``q_start`` of Q, their (lse, delta) stats and q
    mask leaves, the stored tile if the step's tile is PARTIAL (``partial_id()`` names
    it; its ``part``-th ``rows`` q columns) and dO, which the first products need last.

    ``sources``, ``rings`` and ``ready`` are the gmem refs, smem rings and "loaded"
    barriers of (Q, stats, q leaves, stored tiles, dO), None where the kernel has none; one
    barrier may serve several (its arrivals count them).
    """
    q_ref, stats_ref, q_leaf_ref, partial_ref, do_ref = sources
    q_ring, stats_ring, q_leaf_ring, mask_ring, do_ring = rings
    q_ready, stats_ready, q_leaf_ready, mask_ready, do_ready = ready
    q_rows = pl.ds(q_start, rows)
    plgpu.copy_gmem_to_smem(q_ref.at[batch, q_rows, head], q_ring.at[slot], q_ready.at[slot])
    plgpu.copy_gmem_to_smem(stats_ref.at[batch, head, :, q_rows], stats_ring.at[slot],
                            stats_ready.at[slot])
    if statics.num_q_leaves:
        plgpu.copy_gmem_to_smem(q_leaf_ref.at[batch, :, q_rows], q_leaf_ring.at[slot],
                                q_leaf_ready.at[slot])
    if statics.has_partial:
        @pl.when((flags & PARTIAL) != 0)
        def _():
            plgpu.copy_gmem_to_smem(partial_ref.at[partial_id(), :, pl.ds(part * rows, rows)],
                                    mask_ring.at[slot], mask_ready.at[slot])
    plgpu.copy_gmem_to_smem(do_ref.at[batch, q_rows, head], do_ring.at[slot], do_ready.at[slot])


def drain_ring(num_steps, stages: int, *consumed) -> None:
    """Waits until the consumers released the ring's last ``stages`` loads.

    Every phase of a "consumed" barrier is then observed by the producer (the
    Mosaic-GPU interpreter requires it; on hardware it only idles the producer).
    """
    @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
    def _drain(step):
        for barriers in consumed:
            plgpu.barrier_wait(barriers.at[lax.rem(step, stages)])


def pad_last(x: Array, size: int) -> Array:
    """``x`` zero-padded along its last axis to ``size`` (no copy when equal)."""
    if x.shape[-1] == size:
        return x
    return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, size - x.shape[-1]),))


def pad_sequence(x: Array, axis: int = 1, keep_short: bool = False) -> Array:
    """Pads ``axis`` to a multiple of 8 (no copy when it is one, or with ``keep_short``
    when it is shorter than 8).

    TMA boxes into 8-row-tiled smem need sequence lengths that are multiples
    of 8 or (Mosaic's tiled view then takes the dimension as one short tile) below 8;
    rows past the true length lie in the ragged (masked) last block.
    """
    extra = -x.shape[axis] % 8
    if not extra or (keep_short and x.shape[axis] < 8):
        return x
    return jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])


def swizzle_bytes(row_elements: int, dtype) -> int:
    """The widest swizzle (128, 64 or 32 bytes) that divides a row of ``row_elements``
    (a head dim of 96: 64 bytes); a row of fewer than 32 bytes, its own width."""
    row_bytes = row_elements * jnp.dtype(dtype).itemsize
    return next(w for w in (128, 64, 32, row_bytes) if row_bytes % w == 0)


def swizzled(shape, dtype, swizzle: int | None = None) -> Any:
    """SMEM in swizzled 8-row tiles (wgmma operands, register loads), by default with
    `swizzle_bytes`; a wgmma reading both operands from smem needs them to agree."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = swizzle or swizzle_bytes(shape[-1], dtype)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))
