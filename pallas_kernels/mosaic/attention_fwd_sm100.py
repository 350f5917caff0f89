"""Block-sparse attention forward for Blackwell (sm100) in Pallas Mosaic-GPU, after FA4.

A CTA computes ``ForwardConfig.q_tiles`` consecutive q tiles of ``block_q = 128`` rows
(q-blocks of the BlockMask) of one (batch, q head), so that one tile's softmax runs
while the tensor cores compute the other's matmuls. The tiles walk one kv walk, the
union of theirs (`attention_sm100_common.paired_walk`: kv-blocks FULL for every tile
first, each tile with its own tile classes, MASKED where only another tile sees the
block), so each K and V tile is loaded once for all of them. Warpgroups
(``q_tiles + 2``):

* softmax warpgroups ``0 .. q_tiles - 1``, one per q tile: per kv step load S from
  tensor memory (a row per thread), apply the score transform and the tile's mask
  (none for FULL tiles, which the walk lists first and a loop without mask code
  takes; indices and mask leaves for COMPUTED tiles; the stored int8 tile for PARTIAL
  ones; -inf for MASKED ones), update the running max in log2 units, compute
  P = 2^(S - max) (a static share of the columns by a cubic on the FMA pipes,
  `attention_sm100_common.split_exp2`),
  store P (16-bit, over S's columns) back to tensor memory and keep the row sum.
  The max is raised only when a row's new max exceeds it by more than
  `RESCALE_THRESHOLD` (FA4's conditional rescaling): the per-row factor then goes to
  the correction warpgroup through shared memory;
* the correction warpgroup: rescales O in tensor memory between two P @ V, only when
  some row's factor is not 1, and at the end normalizes O by the row sums, writes the
  lse and TMA-stores both;
* the last warpgroup: warp 0 loads (Q per tile, the walk and the tiles' q leaves, then
  K, V and the mask data of every kv step into a ring of ``num_stages`` slots); warp 1
  issues the tcgen05 MMAs (one thread): per step ``S_t = Q_t K^T`` for each tile, then
  ``O_t += P_t V`` (P read from tensor memory) for each tile.

Barriers, per q tile ``t`` unless said: ``s_full`` (QK^T done, S readable), ``p_full``
(P stored and S read: the softmax's arrival), ``o_full`` (P @ V done: O readable, and
P's columns, which alias S's, free for the next QK^T), ``o_ready`` (the correction
decided on the rescale of O and did it), ``corr_full`` / ``corr_empty`` (the row
factors in shared memory, and once more the final row max and sum), ``q_free`` (the
MMAs read Q for the last time: O may be staged in its buffer); per ring slot K
loaded (with the step's mask leaves and stored tiles), V loaded, K consumed, V
consumed (tensor-core commits).

K/V are keyed by the kv head ``h // group_size`` (GQA/MQA). Sequence tails need no
padding: TMA reads past ``kv_len`` as zeros and the ragged last kv-block is COMPUTED.
Head dims are zero-padded as for sm90 (`padded_head_dims`). Sinks are folded in after
the kernel. Tensor memory holds per tile S (P aliases it) and O: ``q_tiles * (block_kv
+ head_dim_v)`` columns of 512, hence one q tile per CTA at value head dims above 128.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels.block_sparse import KernelMask, MaskLayout
from pallas_kernels.mosaic import attention_sm90_common as common
from pallas_kernels.mosaic import attention_sm100_common as common100
from pallas_kernels.mosaic.attention_sm90_common import (
    BLOCK_Q,
    LN2,
    LOG2E,
    SUPPORTED_HEAD_DIMS,
    padded_head_dim,
    padded_head_dims,
)
from pallas_kernels.score_pipeline import ConvertedScoreMod
from pallas_kernels.tile_classes import MASKED, PARTIAL, trace_time_eval

Array = Any

__all__ = ["BLOCK_Q", "SUPPORTED_HEAD_DIMS", "ForwardConfig", "attention_forward",
           "fit_config", "forward_config", "padded_head_dim", "padded_head_dims", "smem_bytes"]

LOAD_WARP, MMA_WARP = 0, 1


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Tiling of the sm100 forward; ``block_q`` x ``block_kv`` is also the BlockMask tile."""

    block_kv: int
    num_stages: int
    # q tiles per CTA (1 or 2): with two, one tile's softmax runs under the other's MMAs.
    q_tiles: int = 2
    # Share of each row's exponentials computed by `attention_sm100_common.exp2_polynomial`
    # on the FMA pipes instead of MUFU (FA4 emulates part of them at head dims <= 128).
    emulated_exp2: float = 0.0
    rescale_threshold: float = common100.RESCALE_THRESHOLD
    # CTAs launched in sections of heads, longest walks first across each section
    # (`attention_sm90_common.sectioned_launch`; measured on the sm90 kernels only).
    sectioned_launch: bool = True
    block_q: int = BLOCK_Q

    def __post_init__(self):
        if self.block_q != BLOCK_Q:
            raise ValueError(f"block_q must be {BLOCK_Q}, got {self.block_q}")
        if self.block_kv not in (64, 128):
            raise ValueError(f"block_kv must be 64 or 128, got {self.block_kv}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}")
        if self.q_tiles not in (1, 2):
            raise ValueError(f"q_tiles must be 1 or 2, got {self.q_tiles}")
        if not 0.0 <= self.emulated_exp2 <= 1.0:
            raise ValueError(f"emulated_exp2 must lie in [0, 1], got {self.emulated_exp2}")
        if self.rescale_threshold < 0:
            raise ValueError(f"rescale_threshold must be >= 0, got {self.rescale_threshold}")

    @property
    def emulated_columns(self) -> int:
        """Columns of each S row whose exp2 runs on the FMA pipes."""
        return int(round(self.emulated_exp2 * self.block_kv))


def forward_config(head_dim: int, dtype: Any, causal: bool,
                   mean_walk: float | None = None, uniform_walks: bool = False) -> ForwardConfig:
    """The config for the larger of the (padded) head dims; bf16 and fp16, causal or not,
    share it. Not tuned on hardware: it follows FA4 and docs/blackwell.md.

    Up to 128, two q tiles: at 128 their S (128 x 128) and O (128 x 128) fill the 512
    tensor-memory columns, and a quarter of the exp2 runs on the FMA pipes (MUFU would
    tie with the tensor cores). Above 128 one q tile, kv tiles of 64 (shared memory).
    ``mean_walk`` and ``uniform_walks`` (the sm90 forward's) choose nothing here.
    """
    del dtype, causal, mean_walk, uniform_walks
    dim = padded_head_dim(head_dim)
    if dim <= 64:
        return ForwardConfig(block_kv=128, num_stages=3, q_tiles=2, emulated_exp2=0.25)
    if dim <= 128:
        return ForwardConfig(block_kv=128, num_stages=2, q_tiles=2, emulated_exp2=0.25)
    return ForwardConfig(block_kv=64, num_stages=2, q_tiles=1)


def smem_bytes(config: ForwardConfig, head_dim: int, head_dim_v: int, itemsize: int,
               has_partial: bool, num_q_buffers: int = 1, pages_per_seq: int = 0,
               walk_blocks: int = 0) -> int:
    """Shared memory of one CTA: Q per tile (O staged in it, or beside it when the head
    dims differ), the kv ring (with a stored int8 tile per q tile when the mask has
    PARTIAL ones) and the paired walk row over ``walk_blocks`` kv-blocks."""
    del num_q_buffers, pages_per_seq
    walk_entries = 2 + (1 + 2 * config.q_tiles) * walk_blocks  # `paired_walk_offsets`
    walk = -(-walk_entries // common.WALK_LINE) * common.WALK_LINE * 4
    qo = config.q_tiles * config.block_q * (
        head_dim + (head_dim_v if head_dim_v != head_dim else 0)) * itemsize
    ring = config.num_stages * config.block_kv * (head_dim + head_dim_v) * itemsize
    if has_partial:
        ring += config.num_stages * config.q_tiles * config.block_q * config.block_kv
    return qo + ring + walk


def fit_config(config: ForwardConfig, limit: int, head_dim: int, head_dim_v: int,
               itemsize: int, has_partial: bool) -> ForwardConfig:
    """``config``, or with one q tile when its two do not fit ``limit`` bytes of shared
    memory (head dim 128 with stored PARTIAL tiles in the ring)."""
    if config.q_tiles > 1 and smem_bytes(config, head_dim, head_dim_v, itemsize,
                                         has_partial) > limit:
        return dataclasses.replace(config, q_tiles=1)
    return config


@dataclasses.dataclass(frozen=True)
class _Statics(common.LeafCounts):
    """Everything static the kernel body needs."""

    config: ForwardConfig
    layout: MaskLayout
    num_q_heads: int
    group_size: int
    head_dim: int
    head_dim_v: int
    dtype: Any
    scores: common.ScoreSpec
    has_partial: bool
    walk_lines: int
    leaf_slots: tuple[tuple[str, int], ...]
    interpret: bool


def _kernel(statics: _Statics, q_ref, k_ref, v_ref, walk_ref, *refs):
    s = statics
    cfg = s.config
    tiles, stages = cfg.q_tiles, cfg.num_stages
    partial_ref, q_leaf_ref, kv_leaf_ref, captured_ref, refs = common.split_optional_refs(
        refs, s)
    out_ref, lse_ref, smem, tmem, barriers = refs
    (q_smem, o_only_smem, lse_smem, scale_smem, stats_smem, walk_smem, k_smem, v_smem,
     mask_smem, q_leaf_smem, kv_leaf_smem, captured_smem) = smem
    score_tmem, o_tmem = tmem
    (walk_barrier, q_leaf_barrier, q_barriers, k_barriers, v_barriers, k_consumed,
     v_consumed, s_full, p_full, o_full, o_ready, corr_full, corr_empty, q_free,
     captured_barrier) = barriers

    batch_head, rank = common.sectioned_launch(
        "q_blocks", q_ref.shape[0] * s.num_q_heads, _num_groups(s),
        sections=s.config.sectioned_launch)
    batch, head, kv_head = common.head_program(s, batch_head)
    # Heaviest groups of q-blocks (under causal masks the last) first.
    group = common.q_block_at(_num_groups(s), rank, interleaved=False)
    wg = lax.axis_index("wg")
    correction_wg, other_wg = tiles, tiles + 1

    def q_block(t):
        return group * tiles + t

    def valid(t):
        return q_block(t) < s.layout.num_q_blocks

    def walk_count():
        """(active kv-blocks, of them FULL for every tile) of the group, once its walk
        landed."""
        plgpu.barrier_wait(walk_barrier)
        return walk_smem[0, 0], walk_smem[0, 1]

    def s_tmem(t):
        return score_tmem[t][0]

    def p_tmem(t):
        return score_tmem[t][1]

    def o_smem(t):
        return q_smem.at[t] if o_only_smem is None else o_only_smem.at[t]

    @pl.when(wg == other_wg)
    def _other():
        plgpu.set_max_registers(48, action="decrease")

        @plgpu.warp_map
        def _per_warp(warp):
            @pl.when(warp == LOAD_WARP)
            def _load():
                common.load_captured(s, captured_ref, captured_smem, captured_barrier)
                for t in range(tiles):
                    rows = pl.ds(jnp.minimum(q_block(t), s.layout.num_q_blocks - 1)
                                 * cfg.block_q, cfg.block_q)
                    plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[t],
                                            q_barriers.at[t])
                count = common.load_q_block_walk(
                    s, walk_ref, walk_smem, walk_barrier,
                    (q_leaf_ref, q_leaf_smem, q_leaf_barrier) if s.num_q_leaves else None,
                    batch=batch, head=head, q_block=group, block_q=tiles * cfg.block_q)
                _load_kv(s, count, batch, kv_head, walk_smem, k_ref, v_ref, partial_ref,
                         kv_leaf_ref, k_smem, v_smem, mask_smem, kv_leaf_smem, k_barriers,
                         v_barriers, k_consumed, v_consumed)

            @pl.when(warp == MMA_WARP)
            def _mma():
                count, _ = walk_count()
                for t in range(tiles):
                    plgpu.barrier_wait(q_barriers.at[t])

                # Per step every tile's QK^T, then every tile's P @ V: tile 0's softmax
                # runs under tile 1's QK^T, tile 1's under tile 0's P @ V and next QK^T.
                @pl.loop(0, count)
                def _(step):
                    slot = lax.rem(step, stages)
                    plgpu.barrier_wait(k_barriers.at[slot])
                    for t in range(tiles):
                        # P @ V of the previous step read P from S's columns.
                        pl.when(step > 0)(functools.partial(plgpu.barrier_wait,
                                                            o_full.at[t]))
                        plgpu.tcgen05_mma(s_tmem(t), q_smem.at[t],
                                          k_smem.at[slot].transpose((1, 0)), s_full.at[t],
                                          accumulate=False)
                    plgpu.tcgen05_commit_arrive(k_consumed.at[slot])
                    plgpu.barrier_wait(v_barriers.at[slot])
                    for t in range(tiles):
                        plgpu.barrier_wait(p_full.at[t])
                        pl.when(step > 0)(functools.partial(plgpu.barrier_wait,
                                                            o_ready.at[t]))
                        plgpu.tcgen05_mma(o_tmem.at[t], p_tmem(t), v_smem.at[slot],
                                          o_full.at[t], accumulate=step > 0)
                    plgpu.tcgen05_commit_arrive(v_consumed.at[slot])

                for t in range(tiles):
                    plgpu.tcgen05_commit_arrive(q_free.at[t])

    for tile in range(tiles):
        @pl.when(wg == tile)
        def _softmax(t=tile):
            plgpu.set_max_registers(192, action="increase")
            common.wait_captured(s, captured_barrier)
            count, num_full = walk_count()
            q_leaf_rows = []
            if s.num_q_leaves:
                plgpu.barrier_wait(q_leaf_barrier)
                q_leaf_rows = [compat.mosaic_load(
                    q_leaf_smem.at[leaf, pl.ds(t * cfg.block_q, cfg.block_q)],
                    common100.row_layout(), interpret=s.interpret)
                    for leaf in range(s.num_q_leaves)]
            _softmax_tile(s, t, count, num_full, batch, head, q_block(t), walk_smem,
                          q_leaf_rows, kv_leaf_smem, mask_smem, captured_smem, s_tmem(t),
                          p_tmem(t), s_full.at[t], p_full.at[t], corr_full.at[t],
                          corr_empty.at[t], scale_smem.at[t], stats_smem.at[t])

    @pl.when(wg == correction_wg)
    def _correction():
        plgpu.set_max_registers(80, action="decrease")
        count, _ = walk_count()
        layout = common100.tmem_layout()

        @pl.loop(1, jnp.maximum(count, 1))
        def _rescale(step):
            del step
            for t in range(tiles):
                plgpu.barrier_wait(corr_full.at[t])
                factor = compat.mosaic_load(scale_smem.at[t], common100.row_layout(),
                                            interpret=s.interpret)
                plgpu.barrier_arrive(corr_empty.at[t])
                plgpu.barrier_wait(o_full.at[t])

                @pl.when(jnp.min(factor) < 1.0)
                def _(t=t, factor=factor):
                    o = plgpu.async_load_tmem(o_tmem.at[t], layout=layout)
                    plgpu.wait_load_tmem()
                    plgpu.async_store_tmem(o_tmem.at[t], o * lax.broadcast_in_dim(
                        factor, o.shape, [0]))
                    plgpu.commit_tmem()

                plgpu.barrier_arrive(o_ready.at[t])

        # The epilogue takes O in the MMA layout, which stores to swizzled shared memory
        # without bank conflicts (a row per thread would not).
        out_layout = plgpu.Layout.TCGEN05
        for t in range(tiles):
            plgpu.barrier_wait(corr_full.at[t])
            row_max, row_sum = (compat.mosaic_load(stats_smem.at[t, i], out_layout.reduce(1),
                                                   interpret=s.interpret) for i in range(2))
            seen = row_sum > 0
            safe_sum = jnp.where(seen, row_sum, 1.0)
            inverse = jnp.where(seen, 1.0 / safe_sum, 0.0)
            lse_smem[t] = jnp.where(seen, row_max * LN2 + jnp.log(safe_sum), -jnp.inf)
            plgpu.barrier_arrive(corr_empty.at[t])

            def normalized(t=t, inverse=inverse):
                plgpu.barrier_wait(o_full.at[t])
                o = plgpu.async_load_tmem(o_tmem.at[t], layout=out_layout)
                plgpu.wait_load_tmem()
                return o * lax.broadcast_in_dim(inverse, o.shape, [0])

            out = lax.cond(count > 0, normalized,
                           lambda: plgpu.layout_cast(
                               jnp.zeros((cfg.block_q, s.head_dim_v), jnp.float32),
                               out_layout))

            @pl.when(valid(t))
            def _store(t=t, out=out):
                plgpu.barrier_wait(q_free.at[t])
                o_smem(t)[...] = out.astype(s.dtype)
                plgpu.commit_smem()
                start = q_block(t) * cfg.block_q
                plgpu.copy_smem_to_gmem(o_smem(t),
                                        out_ref.at[batch, pl.ds(start, cfg.block_q), head])
                plgpu.copy_smem_to_gmem(lse_smem.at[t],
                                        lse_ref.at[batch, head, pl.ds(start, cfg.block_q)])
        plgpu.wait_smem_to_gmem(0)


def _num_groups(s: _Statics) -> int:
    """Groups of ``q_tiles`` consecutive q-blocks: one CTA each."""
    return -(-s.layout.num_q_blocks // s.config.q_tiles)


def _load_kv(s: _Statics, count, batch, kv_head, walk, k_ref, v_ref, partial_ref,
             kv_leaf_ref, k_smem, v_smem, mask_smem, kv_leaf_smem, k_barriers, v_barriers,
             k_consumed, v_consumed) -> None:
    """Load warp: K, V and the mask data of the group's kv steps into the ring. A step's
    mask leaves and stored tiles (one per q tile) arrive with its K: the softmax reads
    them once its S is in, which the MMA issued after K's barrier; they are released
    with V (whose P @ V follows the softmax's P)."""
    cfg = s.config
    stages, block_kv = cfg.num_stages, cfg.block_kv
    index_offset, flags_offsets, id_offsets = common100.paired_walk_offsets(
        s.layout.num_kv_blocks, cfg.q_tiles)

    @pl.loop(0, count)
    def _(step):
        slot = lax.rem(step, stages)
        rows = pl.ds(common.walk_entry(walk, index_offset + step) * block_kv, block_kv)

        def wait_slot(consumed):
            @pl.when(step >= stages)
            def _():
                common.wait_released(consumed.at[slot], interpret=s.interpret)

        wait_slot(v_consumed)
        if s.num_kv_leaves:
            plgpu.copy_gmem_to_smem(kv_leaf_ref.at[batch, :, rows], kv_leaf_smem.at[slot],
                                    k_barriers.at[slot])
        if s.has_partial:
            # Every step loads a stored tile per q tile (its own where PARTIAL, else tile
            # 0) so that K's barrier counts a fixed number of copies.
            for t in range(cfg.q_tiles):
                is_partial = (common.walk_entry(walk, flags_offsets[t] + step) & PARTIAL) != 0
                tile_id = jnp.where(is_partial, common.walk_entry(walk, id_offsets[t] + step),
                                    0)
                plgpu.copy_gmem_to_smem(partial_ref.at[tile_id], mask_smem.at[slot, t],
                                        k_barriers.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, rows, kv_head], v_smem.at[slot],
                                v_barriers.at[slot])
        wait_slot(k_consumed)
        plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, kv_head], k_smem.at[slot],
                                k_barriers.at[slot])

    common.drain_ring(count, stages, k_consumed, v_consumed)


def _softmax_tile(s: _Statics, t: int, count, num_full, batch, head, q_block, walk,
                  q_leaf_rows, kv_leaf_smem, mask_smem, captured_smem, s_tmem, p_tmem,
                  s_full, p_full, corr_full, corr_empty, scale_smem, stats_smem) -> None:
    """Softmax warpgroup of q tile ``t``: per kv step S -> P in tensor memory, the row
    factors to the correction warpgroup; at the end the row max and sum."""
    cfg = s.config
    stages, block_kv = cfg.num_stages, cfg.block_kv
    index_offset, flags_offsets, _ = common100.paired_walk_offsets(s.layout.num_kv_blocks,
                                                                   cfg.q_tiles)
    layout = common100.tmem_layout()
    tile = (cfg.block_q, block_kv)
    q_start = q_block * cfg.block_q
    fold_scale = s.scores.folds_scale
    score_spec = common.with_captured_read(s.scores, captured_smem, batch, head)

    def to_log2(x):
        return x * (s.scores.scale * LOG2E) if fold_scale else x

    def indices(kv_block, read):
        return common.tile_indices(tile, q_start, kv_block * block_kv, q_axis=0, read=read,
                                   tile_layout=layout)

    def step_fn(step, carry, full: bool):
        row_max, row_sum = carry
        slot = lax.rem(step, stages)
        kv_block = common.walk_entry(walk, index_offset + step)
        plgpu.barrier_wait(s_full)
        scores = plgpu.async_load_tmem(s_tmem, layout=layout)
        # P's stores below overwrite S's columns.
        plgpu.wait_load_tmem()
        if not fold_scale:
            scores = common.log2_scores(score_spec, scores, batch, head,
                                        functools.partial(indices, kv_block))
        if not full:
            kv_leaf_columns = [compat.mosaic_load(kv_leaf_smem.at[slot, i], layout.reduce(0),
                                                  interpret=s.interpret)
                               for i in range(s.num_kv_leaves)]
            partial = (mask_smem.at[slot, t], None) if s.has_partial else None
            flags = common.walk_entry(walk, flags_offsets[t] + step)
            scores = common.masked_q_major_scores(
                s, scores, flags, functools.partial(indices, kv_block), q_leaf_rows,
                kv_leaf_columns, partial, tile_layout=layout)
            if cfg.q_tiles > 1:  # The kv-block is active for another tile of the group only.
                scores = jnp.where(flags == MASKED, -jnp.inf, scores)
        tile_max = jnp.maximum(row_max, to_log2(scores.max(axis=1)))
        # The max moves only past the threshold (a row with no visible key yet: as soon
        # as it sees one); otherwise P's elements stay below 2^threshold.
        raise_max = (tile_max - row_max > cfg.rescale_threshold) | (
            (row_max == -jnp.inf) & (tile_max > -jnp.inf))
        new_max = jnp.where(raise_max, tile_max, row_max)
        factor = jnp.where(raise_max & (row_max > -jnp.inf), jnp.exp2(row_max - new_max), 1.0)

        @pl.when(step > 0)
        def _to_correction():
            pl.when(step > 1)(functools.partial(plgpu.barrier_wait, corr_empty))
            scale_smem[...] = factor
            plgpu.barrier_arrive(corr_full)

        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        row_sum = row_sum * factor
        for start, probs in common100.split_exp2(
                to_log2(scores) - lax.broadcast_in_dim(shift, tile, [0]), cfg.emulated_columns):
            plgpu.async_store_tmem(p_tmem.at[:, pl.ds(start, probs.shape[1])],
                                   probs.astype(s.dtype))
            row_sum = row_sum + probs.sum(axis=1)
        plgpu.commit_tmem()
        plgpu.barrier_arrive(p_full)
        return new_max, row_sum

    carry = (common100.row_vector(-jnp.inf), common100.row_vector(0.0))
    carry = lax.fori_loop(0, num_full, functools.partial(step_fn, full=True), carry)
    if cfg.q_tiles > 1 or common.has_masked_tiles(s.layout, s.has_partial):
        carry = lax.fori_loop(num_full, count, functools.partial(step_fn, full=False), carry)
    row_max, row_sum = carry

    pl.when(count > 1)(functools.partial(plgpu.barrier_wait, corr_empty))
    stats_smem[0] = row_max
    stats_smem[1] = row_sum
    plgpu.barrier_arrive(corr_full)
    # The correction warpgroup read the final stats: every phase of corr_empty observed.
    plgpu.barrier_wait(corr_empty)


def attention_forward(q: Array, k: Array, v: Array, kmask: KernelMask, layout: MaskLayout, *,
                      scale: float, softcap: float | None,
                      score_mod: ConvertedScoreMod | None, has_partial: bool,
                      config: ForwardConfig, captured: Sequence[Array] = (),
                      interpret_params: Any = None,
                      page_table: Array | None = None) -> tuple[Array, Array]:
    """``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32)``; sinks are the caller's.

    The interface of `attention_fwd_sm90.attention_forward`; paged K/V are not served
    here yet (``page_table`` must be None).
    """
    if page_table is not None:
        raise ValueError("page_table: the sm100 forward does not serve paged K/V yet, "
                         "expected None")
    batch, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = v.shape[2], v.shape[3]
    if (layout.block_q, layout.block_kv) != (config.block_q, config.block_kv):
        raise ValueError(f"mask tiles {(layout.block_q, layout.block_kv)} differ from the "
                         f"kernel's {(config.block_q, config.block_kv)}")
    dim, dim_v = padded_head_dims(head_dim, head_dim_v)
    columns = common100.tmem_columns(config.block_kv, dim_v, config.q_tiles)
    if columns > common100.TMEM_COLUMNS:
        raise ValueError(f"config: q_tiles={config.q_tiles} x (block_kv={config.block_kv} + "
                         f"head_dim_v={dim_v}) tensor-memory columns, expected at most "
                         f"{common100.TMEM_COLUMNS}, got {columns}")
    q, k, v = common.pad_last(q, dim), common.pad_last(k, dim), common.pad_last(v, dim_v)
    q, k, v = common.pad_sequence(q), common.pad_sequence(k), common.pad_sequence(v)
    with trace_time_eval(layout, kmask):
        walk = common100.paired_walk(kmask, layout, config.q_tiles)
        q_leaves, kv_leaves, leaf_slots = common.stacked_leaves(kmask, layout, batch)
        partial_tiles = kmask.partial_masks.astype(jnp.int8)
    scores, packed_captured = common.score_spec(scale, softcap, score_mod, captured)
    statics = _Statics(
        config=config, layout=layout, num_q_heads=num_q_heads,
        group_size=num_q_heads // num_kv_heads, head_dim=dim, head_dim_v=dim_v,
        dtype=q.dtype, scores=scores, has_partial=has_partial, walk_lines=walk.shape[-2],
        leaf_slots=leaf_slots, interpret=interpret_params is not None)

    operands = [q, k, v, walk]
    if has_partial:
        operands.append(partial_tiles)
    operands += [x for x in (q_leaves, kv_leaves, packed_captured) if x is not None]
    out_type = (jax.ShapeDtypeStruct((batch, q.shape[1], num_q_heads, dim_v), q.dtype),
                jax.ShapeDtypeStruct((batch, num_q_heads, layout.padded_q_len), jnp.float32))
    out, lse = compat.mosaic_kernel(
        functools.partial(_kernel, statics), out_type,
        scratch_types=_scratch(statics),
        grid=(batch * num_q_heads, _num_groups(statics)),
        grid_names=("batch_head", "q_blocks"),
        num_threads=config.q_tiles + 2, thread_name="wg",
        # Lane semantics (jax 0.11's default, 0.12 switched): warpgroup semantics lowers
        # no implicit broadcast in selects.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params,
    )(*operands)
    return out[:, :q_len, :, :head_dim_v], lse[..., :q_len]


def _scratch(s: _Statics):
    cfg = s.config
    tiles, stages, rows = cfg.q_tiles, cfg.num_stages, cfg.block_q
    captured_smem, captured_barrier = common.captured_scratch(s)
    smem = (
        common.swizzled((tiles, rows, s.head_dim), s.dtype),
        (None if s.head_dim_v == s.head_dim
         else common.swizzled((tiles, rows, s.head_dim_v), s.dtype)),
        plgpu.SMEM((tiles, rows), jnp.float32),  # lse
        plgpu.SMEM((tiles, rows), jnp.float32),  # row factors of O
        plgpu.SMEM((tiles, 2, rows), jnp.float32),  # final row max and sum
        plgpu.SMEM((s.walk_lines, common.WALK_LINE), jnp.int32),
        common.swizzled((stages, cfg.block_kv, s.head_dim), s.dtype),
        common.swizzled((stages, cfg.block_kv, s.head_dim_v), s.dtype),
        (common.swizzled((stages, tiles, rows, cfg.block_kv), jnp.int8) if s.has_partial
         else None),
        plgpu.SMEM((s.num_q_leaves, tiles * rows), jnp.int32) if s.num_q_leaves else None,
        (plgpu.SMEM((stages, s.num_kv_leaves, cfg.block_kv), jnp.int32)
         if s.num_kv_leaves else None),
        captured_smem,
    )
    # Per tile S (float32) and P (16-bit, two to a column) share columns; O beside.
    tmem = (
        tuple(plgpu.RefUnion(plgpu.TMEM((rows, cfg.block_kv), jnp.float32),
                             plgpu.TMEM((rows, cfg.block_kv), s.dtype, packed=True))
              for _ in range(tiles)),
        plgpu.TMEM((tiles, rows, s.head_dim_v), jnp.float32),
    )
    per_tile = functools.partial(plgpu.Barrier, num_barriers=tiles)
    tensor_core = functools.partial(plgpu.Barrier, orders_tensor_core=True)
    k_copies = 1 + (s.num_kv_leaves > 0) + s.has_partial * tiles
    barriers = (
        plgpu.Barrier(num_barriers=1),  # walk
        plgpu.Barrier(num_barriers=1) if s.num_q_leaves else None,
        per_tile(),  # Q
        plgpu.Barrier(num_arrivals=k_copies, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        tensor_core(num_barriers=stages),  # K consumed
        tensor_core(num_barriers=stages),  # V consumed
        tensor_core(num_barriers=tiles),  # s_full
        per_tile(),  # p_full
        tensor_core(num_barriers=tiles),  # o_full
        per_tile(),  # o_ready
        per_tile(),  # corr_full
        per_tile(),  # corr_empty
        tensor_core(num_barriers=tiles),  # q_free
        captured_barrier,
    )
    return smem, tmem, barriers
