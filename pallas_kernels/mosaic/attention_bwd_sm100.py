"""Block-sparse attention backward for datacenter Blackwell (sm100) in Pallas Mosaic-GPU.

One kernel, one CTA per (kv-block of 128 rows, batch, kv head), after FlashAttention-4's
sm100 backward. Its three warpgroups:

* the load warpgroup TMA-loads the CTA's K and V once, then walks, for each query
  head of the GQA group, the active q-blocks of the kv-block (the kv-major view of the
  BlockMask) in steps of ``q_step`` query rows, and loads each step's Q, dO, lse and
  delta (plus the q mask leaves and, for PARTIAL tiles, the stored tile) into a ring
  of ``stages`` slots; MASKED tiles are never loaded;
* the MMA warpgroup issues every tcgen05 MMA (one elected thread) into tensor memory:
  ``S^T = K Q^T`` and ``dP^T = V dO^T`` of step ``t + 1`` first, then step ``t``'s
  ``dV += P^T dO``, ``dK += dS^T Q`` and ``dQ^T = K^T dS^T``, so that the tensor
  cores run step ``t``'s products while the compute warpgroup's exponentials of step
  ``t + 1`` wait on them least;
* the compute warpgroup (a thread per TMEM lane, so per kv row) reads S^T and dP^T
  from TMEM, applies softcap/score_mod and the mask (FULL steps, listed first in every
  walk, run in a loop without mask code; COMPUTED ones evaluate it from indices and
  leaves; PARTIAL ones read the stored tile, transposed), writes ``P^T = exp2(S^T -
  lse)`` to TMEM (16-bit, the A operand of dV's MMA, as FlashAttention-4 keeps it: no
  shared-memory traffic) and ``dS^T = P^T (dP^T - delta)`` (times the score derivative
  and the scale) to TMEM (dK's A operand) and to shared memory (dQ^T's B operand, which
  must be there), then adds the step's dQ to a float32 sum in global memory; at the
  end it stores dK and dV from TMEM through the K and V buffers.

dK and dV accumulate in TMEM across the whole walk, every query head of the group
included, so GQA needs no atomics. Tensor memory holds ``S^T`` and ``dP^T``
(``q_step`` columns each), P^T and dS^T (half that each), dK and dV (a head dim each) and ``dQ^T``
(``q_step`` columns per 128 head-dim rows) in its 512 columns; where that does not fit (head dims
above 128 beside each other, `tmem_columns`) ``BackwardConfig.split_dkdv`` sums dK
(with dQ) and dV in launches of their own, as the sm90 backward splits for registers.
Steps are 64 query rows, or 32 where the head dims sum above 256 (shared memory then
holds K, V and two ring slots); 128 would need S^T and dP^T to share TMEM columns
with dQ^T. Every MMA operand tile takes one swizzle (128 bytes, 64 at 32-row steps),
as an MMA's two operands must agree.

dQ route. Fused here: ``dQ^T = K^T dS^T`` is one more MMA per step on operands
already in shared memory (K, and dS^T the dK product reads anyway), and its sum
leaves through the TMA engine. A separate dQ kernel (sm90's default below head
dim 128) recomputes S and dP: 7 MMAs a tile instead of 5, 40% more tensor-core
time, while the fused route's cost is ``q_step x head_dim`` float32 a step sent to
L2 (`docs/blackwell.md`: 32 KiB a step at head dim 128, 3.3 TB/s from
the whole B200 at the step's shared-memory bound). dQ^T rather than dQ: its M dimension is the
head dim where dQ's would be the 64 query rows of a step. TMEM cannot be sliced along
rows, so every dQ^T MMA takes 128 head-dim rows: K's smem tile is zero-padded to a
multiple of 128 columns (`k_width`; head dims 64 and 192 compute 64 rows of zeros).
The compute warpgroup sends dQ^T through a float32 smem stage of `DQ_PIECE` columns.
The sum is kept transposed ``[.., head_dim, q]`` and transposed back by XLA.

Determinism (``BackwardConfig.deterministic``, on by default): each kv-block's CTA
stores its dQ into a float32 sum of its own (its steps are distinct (head, q rows),
so plain stores), and XLA adds the sums in a fixed order: ``num_kv_blocks`` times
dQ's size in float32 of memory. Off, one sum takes TMA reduce-adds (atomic, in no
fixed order). The Mosaic backend follows `omni_jax.attention`'s ``deterministic``
argument, and leaves a deterministic call whose sums would be too large to the next
backend. Interpreted runs always keep per-block sums: the interpreter reports
two CTAs' adds as racing.

The in-place dQ sum (an operand aliased to a result,
`compat.mosaic_kernel_accumulating`) cannot be batched: under `jax.vmap` the examples
run one after another. Inside a `jax.shard_map` it runs as outside.

``delta = rowsum(dO * O) - dlse`` is computed in JAX beforehand (the lse cotangent
folds into it). Rows that see no key have lse -inf, passed as ``lse2 = +inf`` so that
their P is exactly 0.

Barriers (those the MMA warpgroup waits on, or that tcgen05 commits arrive on, order
the tensor core): ``q/do/stats/mask/q_leaf_ready[slot]`` loaded; ``mma_consumed``
and ``compute_consumed[slot]`` released by both readers; ``scores_ready`` (S^T, dP^T
in TMEM) and ``scores_free`` (read out); ``p_ready``/``p_free`` and
``ds_ready``/``ds_free`` for the P^T and dS^T tiles; ``dq_ready``/``dq_free``
for dQ^T's TMEM; ``sums_ready`` after the walk's last MMA.
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
from pallas_kernels.block_sparse import KernelMask, MaskLayout, batch_head_index, walk_offsets
from pallas_kernels.mosaic import attention_sm90_common as common
from pallas_kernels.mosaic.attention_bwd_sm90 import walk_loops
from pallas_kernels.mosaic.attention_sm90_common import BLOCK_Q, LOG2E
from pallas_kernels.score_pipeline import ConvertedScoreMod
from pallas_kernels.softmax import softmax_delta
from pallas_kernels.tile_classes import trace_time_eval

Array = Any

BLOCK_KV = 128  # One TMEM lane (one compute thread) per kv row: a 128-row tcgen05 MMA.
SUPPORTED_Q_STEPS = (32, 64)
TMEM_COLUMNS = 512
# Head dims the kernel runs at (zero-padded). K's smem tile is zero-padded further to a
# multiple of 128 columns (`k_width`): dQ^T's MMAs take 128 of its head-dim rows each
# (TMEM cannot be sliced along rows, which a 64-row MMA would need).
KERNEL_HEAD_DIMS = (64, 128, 192, 256)
DQ_PIECE = 16  # dQ^T columns (query rows) a TMA reduce-add takes from its smem stage
# 227 KiB of shared memory per CTA less what `smem_bytes` does not count (walks,
# barriers, 1 KiB alignment of swizzled buffers).
SMEM_LIMIT = common.SMEM_LIMIT
COMPUTE_WG, MMA_WG, LOAD_WG = 0, 1, 2
MIN_STAGES = 2


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tiling of the sm100 backward; ``block_q`` x ``block_kv`` is the BlockMask tile.

    ``stages`` slots of (Q, dO, lse, delta) of ``q_step`` query rows feed the MMAs: at
    least two, as step ``t + 1``'s S^T is issued before step ``t``'s slot is released.
    """

    stages: int
    q_step: int = 64
    block_kv: int = BLOCK_KV
    block_q: int = BLOCK_Q
    # dK (with dQ) and dV summed by launches of their own where the five TMEM
    # accumulators exceed 512 columns (`tmem_columns`).
    split_dkdv: bool = False
    # dQ summed per kv-block and added by XLA in a fixed order (see the module
    # docstring); off, one sum by TMA reduce-add.
    deterministic: bool = True
    # CTAs launched in sections of heads, longest walks (under causal masks the first
    # kv-blocks) first across each section (`attention_sm90_common.sectioned_launch`;
    # measured on the sm90 kernels only).
    sectioned_launch: bool = True

    def __post_init__(self):
        if self.block_q != BLOCK_Q:
            raise ValueError(f"block_q must be {BLOCK_Q}, got {self.block_q}")
        if self.block_kv != BLOCK_KV:
            raise ValueError(f"block_kv must be {BLOCK_KV}, got {self.block_kv}")
        if self.q_step not in SUPPORTED_Q_STEPS:
            raise ValueError(f"q_step must be one of {SUPPORTED_Q_STEPS}, got {self.q_step}")
        if self.stages < MIN_STAGES:
            raise ValueError(f"stages must be at least {MIN_STAGES}, got {self.stages}")


def kernel_head_dim(head_dim: int) -> int | None:
    """The head dim the kernel runs ``head_dim`` at (zero-padded), None above 256."""
    return next((d for d in KERNEL_HEAD_DIMS if head_dim <= d), None)


def k_width(head_dim: int) -> int:
    """Columns of K's tile (zero-padded): whole 128-row MMAs of dQ^T = K^T dS^T."""
    return -(-head_dim // 128) * 128


def _dq_chunks(head_dim: int) -> range:
    """First rows of dQ^T's MMAs, 128 (padded) head-dim rows each."""
    return range(0, k_width(head_dim), 128)


def operand_swizzle(q_step: int, dtype: Any) -> int:
    """The swizzle of every MMA operand tile: dS^T rows are ``q_step`` long, and an MMA's
    two operands must agree."""
    return common.swizzle_bytes(q_step, dtype)


def tmem_columns(head_dim: int, head_dim_v: int, q_step: int,
                 gradients: tuple[str, ...] = ("dk", "dv")) -> int:
    """TMEM columns of a launch summing ``gradients``: S^T; with dK dP^T, dS^T and dQ^T;
    with dV P^T (P^T and dS^T 16-bit, two to a 32-bit column)."""
    columns = q_step
    if "dk" in gradients:
        columns += q_step + q_step // 2 + head_dim + q_step * len(_dq_chunks(head_dim))
    if "dv" in gradients:
        columns += head_dim_v + q_step // 2
    return columns


def backward_config(head_dim: int, head_dim_v: int, dtype: Any,
                    causal: bool) -> BackwardConfig | None:
    """The config for (padded) head dims, or None above the kernel's largest."""
    del dtype, causal  # Same tiles for both 16-bit types; the mask walk skips the rest.
    dim, dim_v = kernel_head_dim(head_dim), kernel_head_dim(head_dim_v)
    if dim is None or dim_v is None:
        return None
    # Wide heads take 32 query rows a step: K, V and two slots of Q and dO fit smem.
    q_step = 32 if dim + dim_v > 256 else 64
    split = tmem_columns(dim, dim_v, q_step) > TMEM_COLUMNS
    return BackwardConfig(stages=3, q_step=q_step, split_dkdv=split)


def smem_bytes(config: BackwardConfig, head_dim: int, head_dim_v: int, itemsize: int,
               has_partial: bool, num_q_leaves: int = 0, num_kv_leaves: int = 0,
               walk_bytes: int = 0) -> int:
    """Shared memory of one CTA (the larger launch's where ``config.split_dkdv``); head
    dims already padded (`kernel_head_dim`); ``walk_bytes``: its walk rows."""
    step = config.q_step
    slot = step * (head_dim + head_dim_v) * itemsize + 2 * step * 4 + num_q_leaves * step * 4
    if has_partial:
        slot += config.block_kv * step
    kv_row = (k_width(head_dim) + head_dim_v) * itemsize + num_kv_leaves * 4
    common_bytes = config.block_kv * kv_row + config.stages * slot
    ds_tile = config.block_kv * step * itemsize  # P^T is in TMEM
    dq_stage = 128 * DQ_PIECE * 4
    return common_bytes + ds_tile + dq_stage + walk_bytes


def fit_config(config: BackwardConfig, limit: int, *args, **kwargs) -> BackwardConfig | None:
    """``config`` with as many stages as fit in ``limit`` bytes (`smem_bytes` arguments)."""
    while smem_bytes(config, *args, **kwargs) > limit:
        if config.stages == MIN_STAGES:
            return None
        config = dataclasses.replace(config, stages=config.stages - 1)
    return config


@dataclasses.dataclass(frozen=True)
class _Statics(common.LeafCounts):
    """Everything static the kernel body needs."""

    config: BackwardConfig
    layout: MaskLayout
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: Any
    scores: common.ScoreSpec
    has_partial: bool
    walk_lines: int
    mask_heads: int
    leaf_slots: tuple[tuple[str, int], ...]
    interpret: bool
    gradients: tuple[str, ...] = ("dk", "dv")  # dQ comes with dK
    walk_part: str = "all"  # `walk_loops`: every step of each walk

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def walk_heads(self) -> int:
        """Walk rows a CTA loads: one per query head of its group if the mask has heads."""
        return self.group_size if self.mask_heads > 1 else 1

    @property
    def steps_per_block(self) -> int:
        return BLOCK_Q // self.config.q_step

    @property
    def per_block_dq(self) -> bool:
        """dQ summed per kv-block (`BackwardConfig.deterministic`, and interpreted)."""
        return self.config.deterministic or self.interpret


def _transposed(ref):
    return ref.transpose((1, 0))


def _kernel(s: _Statics, q_ref, k_ref, v_ref, do_ref, stats_ref, walk_ref, *refs):
    cfg = s.config
    stages, step_rows = cfg.stages, cfg.q_step
    sums_dk, sums_dv = "dk" in s.gradients, "dv" in s.gradients
    partial_ref, q_leaf_ref, kv_leaf_ref, captured_ref, refs = common.split_optional_refs(
        refs, s)
    dq_sum_ref = refs.pop(0) if sums_dk else None
    *grad_refs, scratch = refs
    grad_refs = dict(zip(s.gradients, grad_refs, strict=True))
    smem, tmem, barriers = scratch
    (k_smem, v_smem, walk_smem, q_ring, do_ring, stats_ring, mask_ring, q_leaf_ring,
     kv_leaf_smem, ds_smem, dq_stage, captured_smem) = smem
    s_tmem, dp_tmem, dk_tmem, dv_tmem, dqt_tmem, p_tmem, ds_tmem = tmem
    (walk_barrier, kv_leaf_barrier, k_loaded, v_loaded, q_ready, do_ready, stats_ready,
     mask_ready, q_leaf_ready, mma_consumed, compute_consumed, scores_ready, scores_free,
     p_ready, p_free, ds_ready, ds_free, dq_ready, dq_free, sums_ready,
     captured_barrier) = barriers

    batch_head, kv_block = common.sectioned_launch(
        "kv_block", q_ref.shape[0] * s.num_kv_heads, s.layout.num_kv_blocks,
        sections=s.config.sectioned_launch)
    batch = lax.div(batch_head, s.num_kv_heads)
    kv_head = lax.rem(batch_head, s.num_kv_heads)
    first_head = kv_head * s.group_size
    kv_rows = pl.ds(kv_block * BLOCK_KV, BLOCK_KV)
    wg = lax.axis_index("wg")
    index_offset, flags_offset, partial_offset = walk_offsets(s.layout.num_q_blocks)

    def entry(g, i):
        """Entry ``i`` of the walk of the group's ``g``-th query head."""
        row = g if s.walk_heads > 1 else 0
        return walk_smem[row, lax.div(i, common.WALK_LINE), lax.rem(i, common.WALK_LINE)]

    def head_loops(g):
        """`walk_loops` of head ``g``'s steps (``steps_per_block`` per active q-block)."""
        return walk_loops(s, s.steps_per_block * entry(g, 1),
                           s.steps_per_block * entry(g, 0))

    def step_position(g, j):
        """(q-block flags, first q row, part of the q-block, walk index) of step ``j``."""
        i, part = lax.div(j, s.steps_per_block), lax.rem(j, s.steps_per_block)
        q_block = entry(g, index_offset + i)
        return entry(g, flags_offset + i), q_block * BLOCK_Q + part * step_rows, part, i

    head_cols = pl.ds(0, s.head_dim)  # K's columns without its padding (`k_width`)

    def total_steps():
        return sum(s.steps_per_block * entry(g, 0) for g in range(s.walk_heads)) * (
            s.group_size // s.walk_heads)

    @pl.when(wg == LOAD_WG)
    def _load():
        common.load_captured(s, captured_ref, captured_smem, captured_barrier)
        mask_b, mask_h = batch_head_index(walk_ref, batch, first_head)
        plgpu.copy_gmem_to_smem(walk_ref.at[mask_b, pl.ds(mask_h, s.walk_heads), kv_block],
                                walk_smem, walk_barrier)
        plgpu.copy_gmem_to_smem(k_ref.at[batch, kv_rows, kv_head], k_smem, k_loaded)
        if sums_dk:  # dP^T = V dO^T; a dV launch only stages its sum in V's buffer.
            plgpu.copy_gmem_to_smem(v_ref.at[batch, kv_rows, kv_head], v_smem, v_loaded)
        if s.num_kv_leaves:
            plgpu.copy_gmem_to_smem(kv_leaf_ref.at[batch, :, kv_rows], kv_leaf_smem,
                                    kv_leaf_barrier)
        plgpu.barrier_wait(walk_barrier)

        def head_steps(g, step):
            head = first_head + g

            def fetch(j, step):
                slot = lax.rem(step, stages)

                @pl.when(step >= stages)
                def _():
                    common.wait_released(mma_consumed.at[slot], interpret=s.interpret)
                    common.wait_released(compute_consumed.at[slot], interpret=s.interpret)

                flags, q_start, part, i = step_position(g, j)
                common.load_q_step(
                    s, (q_ref, stats_ref, q_leaf_ref, partial_ref, do_ref),
                    (q_ring, stats_ring, q_leaf_ring, mask_ring, do_ring),
                    (q_ready, stats_ready, q_leaf_ready, mask_ready, do_ready), slot=slot,
                    batch=batch, head=head, q_start=q_start, rows=step_rows, part=part,
                    flags=flags, partial_id=lambda: entry(g, partial_offset + i))
                return step + 1

            for start, stop, _ in head_loops(g):
                step = lax.fori_loop(start, stop, fetch, step)
            return step

        num_loads = lax.fori_loop(0, s.group_size, head_steps, jnp.int32(0))
        common.drain_ring(num_loads, stages, mma_consumed, compute_consumed)

    @pl.when(wg == MMA_WG)
    def _mma():
        plgpu.barrier_wait(walk_barrier)
        plgpu.barrier_wait(k_loaded)
        if sums_dk:
            plgpu.barrier_wait(v_loaded)
        count = total_steps()

        def issue_scores(t):
            """S^T (and dP^T) of step ``t``, once loaded and the last ones read out."""
            slot = lax.rem(t, stages)
            plgpu.barrier_wait(q_ready.at[slot])

            @pl.when(t >= 1)
            def _():
                plgpu.barrier_wait(scores_free)

            plgpu.tcgen05_mma(s_tmem, k_smem.at[:, head_cols], _transposed(q_ring.at[slot]),
                              accumulate=False)
            plgpu.barrier_wait(do_ready.at[slot])
            if sums_dk:
                plgpu.tcgen05_mma(dp_tmem, v_smem, _transposed(do_ring.at[slot]),
                                  accumulate=False)
            plgpu.tcgen05_commit_arrive(scores_ready)

        pl.when(count >= 1)(lambda: issue_scores(jnp.int32(0)))

        @pl.loop(0, count)
        def _(t):
            slot = lax.rem(t, stages)
            pl.when(t + 1 < count)(lambda: issue_scores(t + 1))
            if sums_dv:
                plgpu.barrier_wait(p_ready)
                plgpu.tcgen05_mma(dv_tmem, p_tmem, do_ring.at[slot], accumulate=t > 0)
                plgpu.tcgen05_commit_arrive(p_free)
            if sums_dk:
                plgpu.barrier_wait(ds_ready)
                plgpu.tcgen05_mma(dk_tmem, ds_tmem, q_ring.at[slot], accumulate=t > 0)
            plgpu.tcgen05_commit_arrive(mma_consumed.at[slot])
            if sums_dk:
                @pl.when(t >= 1)
                def _():
                    plgpu.barrier_wait(dq_free)

                for c, row in enumerate(_dq_chunks(s.head_dim)):
                    plgpu.tcgen05_mma(dqt_tmem.at[:, pl.ds(c * step_rows, step_rows)],
                                      _transposed(k_smem.at[:, pl.ds(row, 128)]), ds_smem,
                                      accumulate=False)
                plgpu.tcgen05_commit_arrive(ds_free)
                plgpu.tcgen05_commit_arrive(dq_ready)

        plgpu.tcgen05_commit_arrive(sums_ready)

    @pl.when(wg == COMPUTE_WG)
    def _compute():
        tile_layout = plgpu.Layout.TCGEN05
        row_layout, col_layout = tile_layout.reduce(1), tile_layout.reduce(0)
        tile = (BLOCK_KV, step_rows)  # Transposed scores: kv rows x q columns.
        kv_start = kv_block * BLOCK_KV
        load_tmem = functools.partial(plgpu.async_load_tmem, layout=tile_layout)
        per_q = functools.partial(common.broadcast_over_tile, tile=tile, axis=1,
                                  tile_layout=tile_layout)

        def indices(q_start, read):
            return common.tile_indices(tile, q_start, kv_start, q_axis=1, read=read,
                                       tile_layout=tile_layout)

        kv_leaf_rows = []
        if s.num_kv_leaves:
            plgpu.barrier_wait(kv_leaf_barrier)
            kv_leaf_rows = [compat.mosaic_load(kv_leaf_smem.at[i], row_layout,
                                               interpret=s.interpret)
                            for i in range(s.num_kv_leaves)]
        plgpu.barrier_wait(walk_barrier)
        common.wait_captured(s, captured_barrier)

        def add_dq(head, q_start):
            """Step's dQ^T from TMEM into the float32 sum (`_dq_sum_shape`): compiled, in
            pieces of `DQ_PIECE` query rows through the smem stage."""
            plgpu.barrier_wait(dq_ready)
            adder = kv_block if s.per_block_dq else 0
            pieces = 1 if s.interpret else step_rows // DQ_PIECE
            width = step_rows // pieces
            for c, row in enumerate(_dq_chunks(s.head_dim)):
                for piece in range(pieces):
                    cols = pl.ds(c * step_rows + piece * width, width)
                    value = load_tmem(dqt_tmem.at[:, cols])
                    dst = dq_sum_ref.at[adder, batch, head, pl.ds(row, 128),
                                        pl.ds(q_start + piece * width, width)]
                    if s.interpret:  # A per-block sum: each element written once.
                        dst[...] = value
                        continue
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    dq_stage[...] = value
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dq_stage, dst,
                                            reduction_op=None if s.per_block_dq else "add")
            plgpu.wait_load_tmem()
            plgpu.barrier_arrive(dq_free)

        def head_steps(g, step):
            head = first_head + g
            score_spec = common.with_captured_read(s.scores, captured_smem, batch, head)

            def step_fn(j, step, full: bool):
                slot = lax.rem(step, stages)
                flags, q_start, _, _ = step_position(g, j)
                plgpu.barrier_wait(scores_ready)
                scores = load_tmem(s_tmem)
                dprobs = load_tmem(dp_tmem) if sums_dk else None
                plgpu.wait_load_tmem()
                plgpu.barrier_arrive(scores_free)
                scores = common.log2_scores(score_spec, scores, batch, head,
                                            functools.partial(indices, q_start),
                                            slope=sums_dk)
                scores, slope = scores if sums_dk else (scores, None)
                if s.num_q_leaves:  # Loaded for every step, FULL ones too.
                    plgpu.barrier_wait(q_leaf_ready.at[slot])
                if not full:
                    q_leaf_cols = [compat.mosaic_load(q_leaf_ring.at[slot, i], col_layout,
                                                      interpret=s.interpret)
                                   for i in range(s.num_q_leaves)]
                    leaves = common.tile_leaves(s.leaf_slots, q_leaf_cols, kv_leaf_rows,
                                                tile, q_axis=1, tile_layout=tile_layout)
                    partial = ((mask_ring.at[slot], mask_ready.at[slot])
                               if s.has_partial else None)
                    scores = common.masked_scores(
                        scores, s.layout, flags, functools.partial(indices, q_start),
                        leaves, partial, interpret=s.interpret,
                        tile_layout=tile_layout)
                plgpu.barrier_wait(stats_ready.at[slot])
                lse2 = compat.mosaic_load(stats_ring.at[slot, 0], col_layout,
                                          interpret=s.interpret)
                delta = compat.mosaic_load(stats_ring.at[slot, 1], col_layout,
                                           interpret=s.interpret)
                plgpu.barrier_arrive(compute_consumed.at[slot])
                probs = jnp.exp2(scores - per_q(lse2))

                def write_tile(value, free, ready, tmem_ref, smem_ref=None):
                    @pl.when(step >= 1)  # The last step's MMAs have read the tile.
                    def _():
                        plgpu.barrier_wait(free)

                    value = value.astype(s.dtype)
                    plgpu.async_store_tmem(tmem_ref, value)
                    plgpu.commit_tmem()
                    if smem_ref is not None:
                        smem_ref[...] = value
                        plgpu.commit_smem()
                    plgpu.barrier_arrive(ready)

                if sums_dv:
                    write_tile(probs, p_free, p_ready, p_tmem)
                if sums_dk:
                    dscores = probs * (dprobs - per_q(delta))
                    if slope is not None:
                        dscores = dscores * slope
                    write_tile(dscores * s.scores.scale, ds_free, ds_ready, ds_tmem, ds_smem)
                    add_dq(head, q_start)
                return step + 1

            for start, stop, full in head_loops(g):
                step = lax.fori_loop(start, stop, functools.partial(step_fn, full=full), step)
            return step

        count = lax.fori_loop(0, s.group_size, head_steps, jnp.int32(0))
        # The walk's last MMA (and with it every read of K and V) is done: their buffers
        # stage dK and dV for the TMA stores. No step at all: zeros.
        plgpu.barrier_wait(sums_ready)
        stores = []
        for name, acc, buffer, width in (("dk", dk_tmem, k_smem, s.head_dim),
                                         ("dv", dv_tmem, v_smem, s.head_dim_v)):
            if name not in s.gradients:
                continue
            for col in range(0, width, 64):  # 64 float32 registers a thread at a time
                cols = pl.ds(col, 64)
                value = load_tmem(acc.at[:, cols])
                buffer.at[:, cols][...] = jnp.where(count > 0, value, 0.0).astype(s.dtype)
            stores.append((buffer, grad_refs[name]))
        plgpu.wait_load_tmem()
        plgpu.commit_smem()
        for buffer, ref in stores:
            plgpu.copy_smem_to_gmem(buffer, ref.at[batch, kv_rows, kv_head])
        plgpu.wait_smem_to_gmem(0)


def _scratch(s: _Statics):
    cfg = s.config
    stages, step_rows = cfg.stages, cfg.q_step
    sums_dk = "dk" in s.gradients
    captured_smem, captured_barrier = common.captured_scratch(s)
    operand = functools.partial(common.swizzled, dtype=s.dtype,
                                swizzle=operand_swizzle(step_rows, s.dtype))
    smem = (
        operand((BLOCK_KV, k_width(s.head_dim))),
        operand((BLOCK_KV, s.head_dim_v)),
        plgpu.SMEM((s.walk_heads, s.walk_lines, common.WALK_LINE), jnp.int32),
        operand((stages, step_rows, s.head_dim)),
        operand((stages, step_rows, s.head_dim_v)),
        plgpu.SMEM((stages, 2, step_rows), jnp.float32),
        common.swizzled((stages, BLOCK_KV, step_rows), jnp.int8) if s.has_partial else None,
        plgpu.SMEM((stages, s.num_q_leaves, step_rows), jnp.int32) if s.num_q_leaves else None,
        plgpu.SMEM((s.num_kv_leaves, BLOCK_KV), jnp.int32) if s.num_kv_leaves else None,
        operand((BLOCK_KV, step_rows)) if sums_dk else None,
        (common.swizzled((128, DQ_PIECE), jnp.float32) if sums_dk and not s.interpret
         else None),
        captured_smem,
    )
    tmem = (
        plgpu.TMEM((BLOCK_KV, step_rows), jnp.float32),
        plgpu.TMEM((BLOCK_KV, step_rows), jnp.float32) if sums_dk else None,
        plgpu.TMEM((BLOCK_KV, s.head_dim), jnp.float32) if sums_dk else None,
        plgpu.TMEM((BLOCK_KV, s.head_dim_v), jnp.float32) if "dv" in s.gradients else None,
        (plgpu.TMEM((BLOCK_KV, step_rows * len(_dq_chunks(s.head_dim))), jnp.float32)
         if sums_dk else None),
        (plgpu.TMEM((BLOCK_KV, step_rows), s.dtype, packed=True)
         if "dv" in s.gradients else None),
        plgpu.TMEM((BLOCK_KV, step_rows), s.dtype, packed=True) if sums_dk else None,
    )
    ring = lambda: plgpu.Barrier(num_barriers=stages)
    tensor_core = lambda n=1: plgpu.Barrier(num_barriers=n, orders_tensor_core=True)
    barriers = (
        plgpu.Barrier(num_barriers=1),  # walk
        plgpu.Barrier(num_barriers=1),  # kv leaves
        tensor_core(), tensor_core(),  # K, V loaded
        tensor_core(stages), tensor_core(stages), ring(), ring(), ring(),
        tensor_core(stages),  # mma_consumed
        ring(),  # compute_consumed
        tensor_core(), tensor_core(),  # scores ready, free
        tensor_core(), tensor_core(), tensor_core(), tensor_core(),  # P^T, dS^T
        tensor_core(), tensor_core(),  # dQ^T ready, free
        tensor_core(),  # sums ready
        captured_barrier,
    )
    return smem, tmem, barriers


def _dq_sum_shape(s: _Statics, batch: int) -> tuple[int, ...]:
    """The float32 dQ sum(s), transposed as dQ^T: ``[sums, B, Hq, head_dim, q]``."""
    sums = s.layout.num_kv_blocks if s.per_block_dq else 1
    return sums, batch, s.num_q_heads, k_width(s.head_dim), s.layout.padded_q_len


def deterministic_dq_bytes(batch: int, q_len: int, kv_len: int, num_q_heads: int,
                           head_dim: int) -> int:
    """Bytes of the per-kv-block float32 dQ sums of a deterministic backward
    (`BackwardConfig.deterministic`): they grow with the kv length."""
    blocks = -(-kv_len // BLOCK_KV)
    q_rows = -(-q_len // BLOCK_Q) * BLOCK_Q
    return blocks * batch * num_q_heads * k_width(head_dim) * q_rows * 4


def attention_backward(q: Array, k: Array, v: Array, kmask: KernelMask, layout: MaskLayout,
                       out: Array, lse: Array, dout: Array, dlse: Array, *, scale: float,
                       softcap: float | None, score_mod: ConvertedScoreMod | None,
                       has_partial: bool, config: BackwardConfig,
                       captured: Sequence[Array] = (), mean_full_walk: float | None = None,
                       interpret_params: Any = None) -> tuple[Array, Array, Array, Array]:
    """``(dq, dk, dv, delta)``; shapes as `attention_forward`'s inputs.

    The interface of `attention_bwd_sm90.attention_backward`: ``lse`` is the forward's
    (sinks included), ``delta [B, Hq, Sq]`` float32 is ``rowsum(dO * O) - dlse``,
    returned for the sink gradient; ``captured`` are ``score_mod``'s captured arrays;
    ``has_partial`` False promises no PARTIAL tile. ``mean_full_walk`` is taken for
    that interface: the fused dQ serves every walk here.

    Under `jax.vmap` the examples run one after another (`lax.map`): the in-place dQ
    sum cannot be batched.
    """
    del mean_full_walk
    static = dict(layout=layout, scale=scale, softcap=softcap, score_mod=score_mod,
                  has_partial=has_partial, config=config, interpret_params=interpret_params)
    # Concrete mask arrays stay constants of the kernel (`trace_time_eval`): only the
    # traced ones become operands of the custom_vmap function.
    mask_leaves, mask_tree = jax.tree.flatten(kmask)
    traced = [isinstance(x, jax.core.Tracer) for x in mask_leaves]

    def backward(q, k, v, traced_leaves, out, lse, dout, dlse, captured):
        given = iter(traced_leaves)
        leaves = [next(given) if t else x for t, x in zip(traced, mask_leaves, strict=True)]
        return _backward(q, k, v, jax.tree.unflatten(mask_tree, leaves), out, lse, dout,
                         dlse, captured, **static)

    def one_by_one(axis_size, in_batched, *args):
        del axis_size
        flat, tree = jax.tree.flatten(args)
        batched = jax.tree.leaves(tuple(in_batched))

        def example(mapped):
            given = iter(mapped)
            return backward(*jax.tree.unflatten(
                tree, [next(given) if b else x for b, x in zip(batched, flat, strict=True)]))

        grads = lax.map(example, [x for b, x in zip(batched, flat, strict=True) if b])
        return grads, jax.tree.map(lambda _: True, grads)

    batchable = jax.custom_batching.custom_vmap(backward)
    batchable.def_vmap(one_by_one)
    traced_leaves = [x for t, x in zip(traced, mask_leaves, strict=True) if t]
    return batchable(q, k, v, traced_leaves, out, lse, dout, dlse, tuple(captured))


def _backward(q: Array, k: Array, v: Array, kmask: KernelMask, out: Array, lse: Array,
              dout: Array, dlse: Array, captured: Sequence[Array], *, layout: MaskLayout,
              scale: float, softcap: float | None, score_mod: ConvertedScoreMod | None,
              has_partial: bool, config: BackwardConfig, interpret_params: Any,
              ) -> tuple[Array, Array, Array, Array]:
    """`attention_backward` of one call (no `jax.vmap` around it)."""
    batch, q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads, head_dim_v = k.shape[1], v.shape[2], v.shape[3]
    if (layout.block_q, layout.block_kv) != (config.block_q, config.block_kv):
        raise ValueError(f"layout: mask tiles {(layout.block_q, layout.block_kv)} differ "
                         f"from the kernel's {(config.block_q, config.block_kv)}")
    dim, dim_v = kernel_head_dim(head_dim), kernel_head_dim(head_dim_v)
    if dim is None or dim_v is None:
        raise ValueError(f"q, v: head dims {head_dim}, {head_dim_v}; the kernel takes at "
                         f"most {KERNEL_HEAD_DIMS[-1]}")
    gradients = (("dk",), ("dv",)) if config.split_dkdv else (("dk", "dv"),)
    for names in gradients:
        columns = tmem_columns(dim, dim_v, config.q_step, names)
        if columns > TMEM_COLUMNS:
            raise ValueError(f"config: {names} at head dims {dim}, {dim_v} and q_step "
                             f"{config.q_step} need {columns} TMEM columns, more than "
                             f"{TMEM_COLUMNS}; set split_dkdv")

    delta = softmax_delta(out, dout, dlse)
    q_padded = layout.padded_q_len
    pad_q = lambda x, value: jnp.pad(x, ((0, 0), (0, 0), (0, q_padded - q_len)),
                                     constant_values=value)
    # P = exp2(s2 - lse2): rows that see no key (lse -inf) and padding rows get
    # lse2 = +inf, so their P is exactly 0 instead of NaN.
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * LOG2E)
    stats = jnp.stack([pad_q(lse2, jnp.inf), pad_q(delta, 0.0)], axis=2)  # [B, Hq, 2, Sq]

    pad = lambda x, d: common.pad_sequence(common.pad_last(x, d))
    q, k, v, do = (pad(q, dim), pad(k, k_width(dim)), pad(v, dim_v),
                   pad(dout.astype(q.dtype), dim_v))
    with trace_time_eval(layout, kmask):  # constants when the mask is concrete
        walk = common.packed_walk(kmask, "q")
        q_leaves, kv_leaves, leaf_slots = common.stacked_leaves(kmask, layout, batch)
        partial_masks_kv_major = jnp.swapaxes(kmask.partial_masks.astype(jnp.int8), 1, 2)
    scores, packed_captured = common.score_spec(scale, softcap, score_mod, captured)
    statics = _Statics(
        config=config, layout=layout, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=dim, head_dim_v=dim_v, dtype=q.dtype, scores=scores, has_partial=has_partial,
        walk_lines=walk.shape[-2], mask_heads=walk.shape[1], leaf_slots=leaf_slots,
        interpret=interpret_params is not None)
    leaves = (q_leaves, kv_leaves) if leaf_slots else ()
    operands = [q, k, v, do, stats, walk, *([partial_masks_kv_major] if has_partial else []),
                *(x for x in (*leaves, packed_captured) if x is not None)]
    shapes = {"dk": jax.ShapeDtypeStruct(k.shape, k.dtype),
              "dv": jax.ShapeDtypeStruct(v.shape, v.dtype)}
    launch = dict(grid=(batch * num_kv_heads, layout.num_kv_blocks),
                  grid_names=("batch_head", "kv_block"), num_threads=3, thread_name="wg",
                  compiler_params=plgpu.CompilerParams(
                      approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
                  interpret=interpret_params)

    grads, dq = {}, None
    for names in gradients:
        s = dataclasses.replace(statics, gradients=names)
        out_type = tuple(shapes[name] for name in names)
        body = functools.partial(_kernel, s)
        scratch = _scratch(s)
        if "dk" in names:
            dq_sum = jnp.zeros(_dq_sum_shape(s, batch), jnp.float32)
            results, dq_sum = compat.mosaic_kernel_accumulating(
                body, out_type, scratch_types=(scratch,), **launch)(*operands, dq_sum)
            dq = jnp.swapaxes(dq_sum.sum(0), 2, 3).swapaxes(1, 2)  # [B, Sq, Hq, D]
        else:
            results = compat.mosaic_kernel(body, out_type, scratch_types=(scratch,),
                                           **launch)(*operands)
        grads.update(zip(names, results, strict=True))

    unpad = lambda x, length, d: x[:, :length, :, :d]
    return (unpad(dq, q_len, head_dim).astype(q.dtype), unpad(grads["dk"], kv_len, head_dim),
            unpad(grads["dv"], kv_len, head_dim_v), delta)
