"""Block-sparse attention backward for Hopper (sm90) in Pallas Mosaic-GPU.

Two warp-specialized kernels, both walking the forward's BlockMask (q tiles
of ``BLOCK_Q = 128`` rows, kv tiles of ``block_kv``), or at head dim 128 for
dense masks and long walks the dK/dV kernel adding dQ too (fused dQ, below):

* dK/dV: one CTA per (kv-block, batch, kv head). Each consumer warpgroup TMA-
  loads its 64 rows of K and V once. The producer warpgroup walks, for each
  query head of the GQA group, the active q-blocks of the kv-block (the
  kv-major view of the mask) in steps of `BackwardConfig.q_step` rows (64: two
  halves a q-block; 128: whole q-blocks), and TMA-loads Q, dO, lse and delta of
  each step (plus the q mask leaves and, for PARTIAL tiles, the
  stored tile) into a ring of stages; MASKED tiles are never loaded. Per
  step a consumer computes ``S^T = K Q^T`` and ``dP^T = V dO^T`` by wgmma,
  ``P^T = exp2(S^T - lse)``
  (scores in log2 units; the accumulators of S^T and dP^T start at -lse and -delta,
  `BackwardConfig.seeded_stats`), ``dV += P^T dO`` and
  ``dS^T = P^T (dP^T - delta)`` (times the softcap/score_mod derivative; the
  scale multiplies the sums once, `BackwardConfig.fold_scale`), ``dK += dS^T Q``.
  dK and dV stay in registers across the whole group, so the GQA reduction needs
  no atomics.
* dQ: one CTA per (q-block, batch, q head), structured as the forward: the
  producer fetches K and V of the active kv-blocks (q-major view) through
  the same ring code (`attention_sm90_common.produce_kv_blocks`), two
  consumers own 64 q rows each and accumulate ``dQ += dS K``.

FULL tiles (listed first in every walk) run in a loop without mask code;
COMPUTED tiles evaluate the mask from indices and leaves; PARTIAL tiles read
the stored int8 tile (transposed for dK/dV, whose tiles are kv-major).
``delta = rowsum(dO * O) - dlse`` is computed in JAX beforehand (the lse
cotangent folds into it). Rows that see no key have lse -inf, passed as
``lse2 = +inf`` so that their P is exactly 0.

Above head dim 128 (192 and 256, the forward's 64-row kv tiles) two consumers of a
dK/dV CTA share its 64 kv rows (`BackwardConfig.paired_consumers`): consumer 0
computes S^T and P^T and sums dV, and passes P^T through smem to consumer 1, which
computes dP^T and dS^T and sums dK. Each holds one 64 x 256 float32 sum; one
consumer would need both beside the score tiles. Without the pairing,
`BackwardConfig.split_dkdv` sums them in two launches, one accumulator each
(`_Statics.gradients`), and narrower pairs (DeepSeek's query-key 192 and value 128)
fit one consumer (`MAX_UNSPLIT_DKDV_WIDTH`). The dQ kernel's single accumulator fits
as it is.

Fused dQ (`BackwardConfig.fused_dq`): the dQ kernel recomputes S and dP, so a tile
takes 7 matmuls where FlashAttention-3 takes 5. Fused, each dK/dV consumer also stages
its dS^T tile in smem, and one step later multiplies both consumers' tiles of that
step by its 64 columns of K and adds the product to a float32 dQ buffer by TMA
reduce-add (an operand aliased to a result, `compat.mosaic_kernel_accumulating`). The
producer warpgroup issues those reductions (`BackwardConfig.dq_reducer_warp`,
FlashAttention-3's organisation): a consumer stores its product to its float32 stage
once ``dq_stage_free`` says the last reduction read it, fences and arrives on
``dq_staged``, and never waits for the TMA engine; the producer, which spends most of
a step waiting for ring slots, waits on ``dq_staged`` after its fetch of step t (the
consumers stage step t - stages - 1's product right after releasing step t - stages,
which that fetch waited for), issues the reduction, waits for it to read the stage and
arrives on ``dq_stage_free``. It carries the (head, first q row) of its last stages +
1 fetches to address them. No product reads a step's dS^T tile before the next step,
so a consumer publishes it (fence, warpgroup barrier, ``ds_ready``) with its dQ stage
by one commit (`BackwardConfig.one_commit_a_step`). The reduce-adds are atomic, in no fixed
order, so the sum's last bits vary between runs: `omni_jax.attention`'s
``deterministic=False`` takes them so. Its deterministic default orders them where
that beats the dQ kernel (`BackwardConfig.ordered_dq`, head dim 64: walks of FULL tiles
only, each rotated to start at its kv-block, every add awaiting its turn on a global
semaphore among a group of kv-blocks that fit the SMs together, each group adding into
a sum of its own) and otherwise takes the dQ kernel. The one-step delay keeps the
consumers out of lockstep; an earlier form with a rendezvous every step (commit
0e02a52) was no faster. At head dim 64 the columns do not split into 64-column tiles
between two consumers; there the steps are whole 128-row q-blocks and dQ splits by
rows: consumer w adds rows [64w, 64w + 64) of the step for all 64 columns, from the
transposed 64-column slices of both consumers' 64 x 128 dS^T tiles times their K
(FlashAttention-3's and -4's tiling).

Per step a consumer (`BackwardConfig.overlapped_step`) issues S^T and dP^T and
computes P^T while dP^T runs; stores its dS^T tile; issues the previous step's dQ, dV
and dK (`BackwardConfig.dq_before_dv`), and waits for dQ only, so that dQ's float32
staging (and without the reducer, its reduction) runs under dV and dK. dK and dV
therefore accumulate in wgmma accumulator refs, and no register of a wgmma in flight
is written meanwhile (ptxas would serialize every wgmma of the kernel). At head dim 128
the step computes S and dP q-major instead (`BackwardConfig.q_major_scores`; FA3 and
FA4 keep S^T there) and passes P and dS to dV and dK through smem. The serial
order (`overlapped_step=False`) waits for S^T and dP^T, then for dV and dK, then
issues dQ and waits for it; or issues dQ right behind dV and dK and waits once
(`BackwardConfig.serial_dq_with_dkdv`). Mask code beside the fused dQ's state spills
registers, so under masks with masked tiles the fused launch walks only the FULL steps
and compiles no mask code; a second fused launch walks the masked steps (its few steps
a CTA bear the spills), adding the first launch's dK and dV to its own and its dQ to
the same buffer. That pays where walks are long
(`BackwardConfig.fused_dq_min_full_walk`); shorter ones keep the dQ kernel for every
step, and so does `jax.vmap` (a custom_vmap rule). Inside a `jax.shard_map` the fused
dQ serves as outside.
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

from pallas_kernels import block_sparse, compat, runtime
from pallas_kernels.block_sparse import KernelMask, MaskLayout, batch_head_index, walk_offsets
from pallas_kernels.mosaic import attention_sm90_common as common
from pallas_kernels.mosaic.attention_sm90_common import (
    BLOCK_Q,
    LOG2E,
    ROWS_PER_CONSUMER,
    padded_head_dim,
    padded_head_dims,
)
from pallas_kernels.score_pipeline import ConvertedScoreMod
from pallas_kernels.softmax import softmax_delta
from pallas_kernels.tile_classes import trace_time_eval

Array = Any

# q rows per dK/dV step (`BackwardConfig.q_step`): a q-block in two halves, or whole.
SUPPORTED_Q_STEPS = (ROWS_PER_CONSUMER, BLOCK_Q)
ROW_SPLIT_MAX_HEAD_DIM = 64  # The fused dQ split by rows (128-row steps) up to this head dim.
NUM_DQ_CONSUMERS = BLOCK_Q // ROWS_PER_CONSUMER
# Registers a thread of each of a dQ CTA's three warpgroups (65536 / 384, a multiple of
# 8): what `set_max_registers` moves between producer and consumers must sum within it.
DQ_LAUNCH_REGISTERS = 168 * 3
SUPPORTED_BLOCK_KV = (64, 128)  # 64 kv rows per dK/dV consumer warpgroup: 1 or 2 of them.


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tiling of the backward kernels; ``block_q`` x ``block_kv`` is the BlockMask tile.

    ``dkv_stages`` slots of (Q, dO, lse, delta) steps feed the dK/dV kernel,
    ``dq_stages`` slots of (K, V) blocks the dQ kernel.
    """

    block_kv: int
    dkv_stages: int
    dq_stages: int
    block_q: int = BLOCK_Q
    # dQ added from the dK/dV kernel into a float32 buffer by TMA reduce-add (5 matmuls a
    # tile) instead of the dQ kernel recomputing S and dP (7), for masks without masked
    # tiles or with long walks (see `attention_backward`); under `jax.vmap` the dQ kernel
    # serves.
    fused_dq: bool = False
    # Masks with masked tiles take the fused dQ only where their kv-blocks walk at least
    # this many FULL q-blocks on average (known at trace time for a concrete mask): the
    # FULL steps in one fused launch, the masked ones in a second. That launch (thousands
    # of CTAs of a few steps each) and the fused chain's fixed cost per CTA then weigh
    # little. H100, 2026-11-27 (benchmarks/RESULTS.md), causal fwd+bwd against the dQ
    # kernel: s4096 and s8192 (15.5 and 31.5 FULL q-blocks) 5% and 1% slower, s16384
    # (63.5) 2-4% and s32768 (127.5) 10% faster.
    fused_dq_min_full_walk: float = 48.0
    # dK and dV summed by dK/dV launches of their own, one float32 accumulator each: at
    # head dims 192 and 256 the two (64 x 256 float32: 128 registers a thread each) exceed
    # a warpgroup's registers. The dV launch skips dO V^T; both compute S.
    split_dkdv: bool = False
    # With kv blocks of 64 rows (one consumer's) and the dQ kernel: dK and dV summed by
    # two consumer warpgroups sharing the CTA's kv rows, rather than by one (or, with
    # split_dkdv, by two launches that each compute S). Consumer 0 computes S^T, P^T and
    # dV and passes P^T (times the score slope) through shared memory; consumer 1
    # computes dP^T, dS^T and dK: 4 matmuls a tile where the two launches take 5, and one
    # consumer's softmax runs under the other's matmuls (a CTA of one consumer leaves the
    # tensor cores idle meanwhile: ncu, H200, 52-55% tensor-pipe activity). H200,
    # 2026-11-29 (benchmarks/RESULTS.md), fwd+bwd, dense and causal: head dims 192 and 256
    # 1.29-1.33x faster than the two launches; query-key 192 / value 128 4-6% faster than
    # one consumer.
    paired_consumers: bool = False
    # Registers a thread of each dQ consumer warpgroup takes from the producer, which
    # keeps the rest (at most 40) of `DQ_LAUNCH_REGISTERS`: the warpgroups' increases
    # wait for registers the decreases freed, so the sum must fit (240 leaves it 24).
    dq_consumer_registers: int = 232
    # The dQ kernel's producer loads V before K, the order the consumers release them
    # (V after dP, K after dS K), and its consumers issue dP before S, so that with one
    # stage dP's product hides K's load. H200, 2026-11-27: d256 fwd+bwd 13% faster;
    # head dims 64 and 128 (two or three stages) within the noise.
    dq_v_first: bool = False
    # The fused dQ's step order (FlashAttention-3's, within the one-step-delayed dQ): each
    # consumer waits for S^T alone and computes P^T while dP^T runs; stores dS^T, then
    # issues dV, the previous step's dQ (or dQ first, `dq_before_dv`) and dK and waits
    # for those but dK, staging dQ (and without dq_reducer_warp issuing its reduction)
    # while dK runs. False: S^T and
    # dP^T, dV and dK, then dQ, each awaited whole before the next (the step of commit
    # bc65497; `serial_dq_with_dkdv` issues dQ with dV and dK).
    overlapped_step: bool = True
    # In the overlapped order: the previous step's dQ issued before dV rather than after
    # it, so that staging dQ (a store, a proxy fence and a barrier, which ncu showed
    # outlasting dK: H200, 2026-11-29) runs under both dV and dK. H200, 2026-11-29
    # (benchmarks/RESULTS.md), fwd+bwd with deterministic=False against dQ after dV: head
    # dim 64 1-7% faster (dense and causal, s4096 and s16384), 128 4% at dense s4096,
    # 1% at causal s4096, even at s16384.
    dq_before_dv: bool = True
    # In the serial order: dV, dK and dQ issued back to back and awaited once (dQ's
    # tiles ready first), rather than dQ issued after dV and dK are done. dQ's 64 x 64
    # float32 accumulator (32 registers a thread) then lives beside P^T and dS^T: off
    # until an H200 run shows it does not spill.
    serial_dq_with_dkdv: bool = False
    # With dq_reducer_warp: a consumer publishes its dS^T tile (which no product reads
    # before the next step) with its dQ stage, by one fence and warpgroup barrier, not a
    # commit_smem each (each a BAR.SYNC, MEMBAR.ALL.CTA, FENCE.VIEW.ASYNC.S, BAR.SYNC).
    one_commit_a_step: bool = True
    # dS^T (dS in the dQ kernel) without the softmax scale, one multiply an element
    # fewer, which the sums take once: dK before its store, dQ before its store or, fused,
    # in the wrapper's conversion of the float32 sum (FlashAttention-3's form). The
    # fused dQ's serial order (`overlapped_step=False`) keeps the scale in dS^T. H200,
    # 2026-11-29 (benchmarks/RESULTS.md), fwd+bwd on the deterministic default (the
    # unfused kernels), folded against not: causal d128 s16384 5% faster, causal d64
    # s16384 3%, the other cases within 2%.
    fold_scale: bool = True
    # q rows a dK/dV step walks: 64 (a q-block in two halves; the fused dQ splits dQ's
    # columns between the consumers in 64-column tiles) or 128 (a q-block a step, two
    # consumers; the fused dQ splits dQ's rows, consumer w adding rows [64w, 64w + 64)
    # of every column, which serves head dim 64: `fused_dq_splits`).
    q_step: int = ROWS_PER_CONSUMER
    # The fused dQ's TMA reduce-adds issued by the producer warpgroup (idle between its
    # loads) from the consumers' float32 stages, which they fill and signal by mbarrier
    # and refill once the producer frees them: a consumer stores, fences and arrives,
    # and never waits for the TMA engine. False: each consumer issues its own reduction
    # and waits for it to read its stage before the next store.
    dq_reducer_warp: bool = True
    # The fused dQ's reduce-adds into each q step in a fixed order, so that dQ is the same
    # bit for bit from run to run (`omni_jax.attention`'s ``deterministic``), for walks
    # of FULL tiles only: the reducer waits until a global semaphore per (group of
    # kv-blocks, batch, query head, q step) has counted the adds whose turn comes first
    # (`block_sparse.rotated_add_turns`), adds, waits for the add to land and counts it;
    # the last add resets the count for the next call. Each kv-block walks its q-blocks
    # rotated, from its own index on, so that the kv-blocks of a head reach a q-block one
    # step apart and each finds the adds before its own done (all starting at one
    # q-block, they would form a chain of one add's latency per kv-block: H100,
    # 2026-12-06, dense d128 s4096 fwd+bwd 8% slower than the dQ kernel). A CTA then
    # waits on CTAs launched after it, so a head's kv-blocks order their adds in groups
    # of at most half of the device's SMs (`ordered_dq_groups`), each group into a dQ sum
    # of its own, the sums added in order afterwards. `attention_backward` takes it with
    # the reducer warp (`dq_reducer_warp`, whose adds it orders) and at most
    # `ordered_dq_max_groups` groups; elsewhere the dQ kernel serves.
    ordered_dq: bool = False
    # The ordered dQ's float32 sums (one a group) take this many times dQ's float32 size
    # at most: 4 (eight times a bf16 dQ) serve up to 4 x 66 kv-blocks of 128 rows on an
    # H100, 33792 keys a head.
    ordered_dq_max_groups: int = 4
    # Pallas's automatic warpgroup barriers: one before and one after every register-to-
    # smem store (in the fused dK/dV step, two for dS^T and two for the dQ stage) and one
    # before each TMA load. The kernels order their shared memory themselves: a tile is
    # rewritten only once an mbarrier says its readers (wgmma, TMA) are done, and
    # `commit_smem` (a warpgroup barrier and a proxy fence) publishes it; the gradients'
    # staging tiles are read and written by each thread in one layout. So they compile
    # without them (`CompilerParams.unsafe_no_auto_barriers`). H200, 2026-11-29
    # (benchmarks/RESULTS.md), fwd+bwd with the fused dQ: dense 2-4% faster, causal
    # s16384 1-2%. The interpreter runs the same either way: only compiled GPU tests check
    # this.
    auto_barriers: bool = False
    # The dK/dV step's score accumulators start at the softmax statistics rather than at
    # zero: S^T at -lse / (scale * log2 e) (plain scores with a positive scale only), so
    # that its scaled product is the exp2 argument, and dP^T at -delta, so that it is
    # dP^T - delta. The transposed tiles need each statistic per column, 16 values a
    # thread; loaded beside the live dK, dV, S^T and dP^T sums they left no registers to
    # load them ahead, and ncu (H200, 2026-11-29) showed the softmax's FMAs waiting on
    # those loads one pair of columns at a time. Seeded, they load before the products are
    # issued, into the accumulators' own registers. H200, 2026-11-29 (benchmarks/
    # RESULTS.md), fwd+bwd on the deterministic default: 0-4% faster in 6 of 8 cases
    # (head dims 64 and 128, dense and causal, s4096 and s16384); the overlapped fused
    # step ran even (-3% to +1%) and spilled 12 bytes more, so it does not seed.
    seeded_stats: bool = True
    # Both kernels' CTAs launch in sections of heads that fill one wave of the SMs, each
    # section rank by rank, longest walks first (`attention_sm90_common.sectioned_launch`),
    # rather than head by head, whose last head's longest walks start as the launch ends.
    # H100, 2026-12-07 (benchmarks/RESULTS.md), fwd+bwd with the forward's sections too:
    # causal 4-5% faster at s4096 and s8192 (head dims 64 and 128, deterministic or not),
    # dense within 1%. At s16384 a head's 128 blocks fill a wave alone: unchanged.
    sectioned_launch: bool = True
    # The overlapped fused step with 64-row steps computes S = Q K^T and dP = dO V^T
    # q-major rather than S^T and dP^T (which FlashAttention-3 and -4 compute at head
    # dim 128, `SdP_swapAB`, with dK and dV from registers): P and dS then reach dV, dK
    # and dQ through shared memory (no product takes a register operand, whose
    # registers would stay live until it is done), and
    # lse and delta are per row, 2 registers a thread each instead of 16. It stores P
    # besides dS (8 KiB a consumer a step) and reads both back by wgmma. Masks with
    # PARTIAL tiles keep the transposed step (their stored tiles are kv-major). H200 and
    # H100, 2026-12-07 (benchmarks/RESULTS.md), fwd+bwd with deterministic=False: dense
    # s4096 3-4% faster in three calls of three, dense s16384 +1%, -3% and 0%, causal
    # s16384 +1%; the fused kernel's spills fell from 136 to 44 bytes. Head dim 128 takes
    # it.
    q_major_scores: bool = False

    def __post_init__(self):
        if self.block_q != BLOCK_Q:
            raise ValueError(f"block_q must be {BLOCK_Q}, got {self.block_q}")
        if self.block_kv not in SUPPORTED_BLOCK_KV:
            raise ValueError(f"block_kv must be one of {SUPPORTED_BLOCK_KV}, got "
                             f"{self.block_kv}")
        if self.dkv_stages < 1 or self.dq_stages < 1:
            raise ValueError(f"stages must be at least 1, got {self.dkv_stages}, "
                             f"{self.dq_stages}")
        if self.dq_consumer_registers % 8 or not 64 <= self.dq_consumer_registers <= 240:
            raise ValueError("dq_consumer_registers must be a multiple of 8 from 64 to 240, "
                             f"got {self.dq_consumer_registers}")
        if self.q_step not in SUPPORTED_Q_STEPS:
            raise ValueError(f"q_step must be one of {SUPPORTED_Q_STEPS}, got {self.q_step}")
        if self.q_step == BLOCK_Q and self.block_kv != 2 * ROWS_PER_CONSUMER:
            raise ValueError(f"q_step={BLOCK_Q} needs two dK/dV consumers "
                             f"(block_kv={2 * ROWS_PER_CONSUMER}), got block_kv={self.block_kv}")
        if self.fused_dq and self.split_dkdv:
            raise ValueError("fused_dq adds dQ from a launch summing both dK and dV; "
                             "split_dkdv=True sums them apart")

    @property
    def dkv_consumers(self) -> int:
        return self.block_kv // ROWS_PER_CONSUMER

    @property
    def steps_per_q_block(self) -> int:
        return BLOCK_Q // self.q_step

    def with_block_kv(self, block_kv: int) -> BackwardConfig:
        """This config at a BlockMask's ``block_kv``; one dK/dV consumer (64) walks
        64-row steps (128-row ones need a second consumer for dQ's other rows)."""
        q_step = self.q_step if block_kv == 2 * ROWS_PER_CONSUMER else ROWS_PER_CONSUMER
        return dataclasses.replace(self, block_kv=block_kv, q_step=q_step)


# Per padded head dim (bf16 and fp16 alike, causal or not: the walk decides the work).
# The block_kv matches the forward's (one BlockMask serves both passes); the stage
# counts are upper bounds that `fit_config` lowers until shared memory fits. Two dK/dV
# stages where three fit: H100, 2026-11-27 (benchmarks/RESULTS.md), fwd+bwd even or
# faster in every case (causal d128 s4096 3-10%, dense d192 2-9%, query-key 192 / value
# 128 and 256 / 64 dense 10-13%); at head dim 64 four, three and two ran even.
#
# Head dim 64 walks whole q-blocks and fuses dQ split by rows (FlashAttention-3's and
# -4's tiling: 5 matmuls a tile instead of the dQ kernel's 7). H200, 2026-11-28 11:55
# (benchmarks/RESULTS.md), fwd+bwd with deterministic=False: 8-11% faster than 64-row
# steps with the dQ kernel (dense s4096 and s16384, causal s16384); the overlapped step
# order 2-8% faster than the serial one there. At head dim 128 it was 0-3% slower until
# the producer issued the dQ reductions (`dq_reducer_warp`): H200, 2026-11-28 18:55, 3-4%
# faster than the serial order (dense s4096 and s16384, causal s16384). ptxas: the dense
# fused kernel spills 220 bytes at head dim 64 and 124 at 128 in either order (seeding
# dP^T with -delta would free 32 registers a thread; the interpreter cannot yet run that
# form).
_CONFIGS = {
    # ordered_dq: the deterministic default takes the ordered fused dQ where it beats the
    # dQ kernel. H100, 2026-12-06, dense fwd+bwd s4096 / s8192: 11% / 16% faster at head
    # dim 64, 7% / 7% slower at 128 (whose 64-row steps add twice as often); at head dim
    # 64 s16384 / s32768 (two and four groups of kv-blocks) 17% / 15% faster.
    64: BackwardConfig(block_kv=128, dkv_stages=4, dq_stages=3, q_step=BLOCK_Q,
                       fused_dq=True, ordered_dq=True),
    128: BackwardConfig(block_kv=128, dkv_stages=2, dq_stages=2, fused_dq=True,
                        q_major_scores=True),
    # The dQ kernel fitted to 1 stage at 256, 2 at 192. Its 64 x 256 float32 sum beside
    # the mask code spills at 232 registers: H200, causal d256 fwd+bwd 9% faster at 240
    # (benchmarks/RESULTS.md, 2026-11-27).
    256: BackwardConfig(block_kv=64, dkv_stages=2, dq_stages=2, split_dkdv=True,
                        paired_consumers=True, dq_consumer_registers=240, dq_v_first=True),
}
_CONFIGS[192] = _CONFIGS[256]
# 96 takes 128's tiles; its fused dQ declines (`fused_dq_splits`): 0.95x cuDNN dense
# against 1.14x with the dQ kernel.
_CONFIGS[96] = _CONFIGS[128]


# The widest (head_dim + head_dim_v) whose dK and dV one dK/dV launch sums: a 64-row
# consumer holds (head_dim + head_dim_v) / 2 float32 registers a thread of them. H100,
# 2026-11-27 (benchmarks/RESULTS.md), fwd+bwd: query-key 192 / value 128 and 256 / 64 in
# one launch 13-17% faster than split; 192 / 192 24-33% slower, 256 / 256 twice as slow.
MAX_UNSPLIT_DKDV_WIDTH = 320


def backward_config(head_dim: int, head_dim_v: int, dtype: Any,
                    causal: bool) -> BackwardConfig | None:
    """The tuned config for (padded) head dims, or None above the kernels' largest."""
    del dtype, causal  # Same tiles for both 16-bit types; the mask walk skips the rest.
    config = _CONFIGS.get(padded_head_dim(max(head_dim, head_dim_v)))
    if config is not None and config.split_dkdv and (
            head_dim + head_dim_v <= MAX_UNSPLIT_DKDV_WIDTH):
        config = dataclasses.replace(config, split_dkdv=False)
    return config


def smem_bytes(config: BackwardConfig, head_dim: int, head_dim_v: int, itemsize: int,
               has_partial: bool, num_q_leaves: int = 0, num_kv_leaves: int = 0,
               fused_dq: bool = False, walk_bytes: tuple[int, int] = (0, 0),
               ) -> tuple[int, int]:
    """Shared memory of one (dK/dV, dQ) CTA; head dims already padded. ``fused_dq``:
    the dK/dV CTA of the fused dQ (which walks FULL tiles only); ``walk_bytes``: the
    (dK/dV, dQ) CTAs' walk rows (`walk_bytes`)."""
    width = (head_dim + head_dim_v) * itemsize
    q_step = config.q_step
    dkv_stage = q_step * width + 2 * q_step * 4 + num_q_leaves * q_step * 4
    dq_stage = config.block_kv * width + num_kv_leaves * config.block_kv * 4
    if has_partial:
        dkv_stage += config.block_kv * q_step
        dq_stage += config.block_q * config.block_kv
    dkv = config.block_kv * width + config.dkv_stages * dkv_stage
    if pairs_consumers(config) and not fused_dq:  # P^T tiles of two steps
        dkv += 2 * config.block_kv * q_step * itemsize
    if fused_dq:  # dS^T tiles of two steps, each consumer's float32 dQ stage
        dkv += 2 * config.block_kv * q_step * itemsize + q_step * head_dim * 4
        if scores_q_major(config, has_partial):  # each consumer's P tile
            dkv += config.block_kv * q_step * itemsize
    dq = config.block_q * width + 2 * config.block_q * 4 + config.dq_stages * dq_stage
    return dkv + walk_bytes[0], dq + walk_bytes[1]


def scores_q_major(config: BackwardConfig, has_partial: bool) -> bool:
    """Whether a fused dK/dV launch computes its score tiles q-major
    (`BackwardConfig.q_major_scores`)."""
    return (config.q_major_scores and config.overlapped_step
            and config.q_step == ROWS_PER_CONSUMER and not has_partial)


def pairs_consumers(config: BackwardConfig) -> bool:
    """Whether the dK/dV launch beside the dQ kernel sums dK and dV by paired consumers
    (`BackwardConfig.paired_consumers`); the fused dQ's launches never pair."""
    return config.paired_consumers and config.block_kv == ROWS_PER_CONSUMER


def walk_bytes(num_q_blocks: int, num_kv_blocks: int, dkv_walk_heads: int,
               ranked: bool = False) -> tuple[int, int]:
    """Shared memory of the (dK/dV, dQ) CTAs' walk rows: ``dkv_walk_heads`` rows over the
    q-blocks (one per query head of the group when the mask has heads; ``ranked``, with
    the ordered dQ's ranks), one over the kv-blocks."""
    return (dkv_walk_heads * common.walk_row_bytes(num_q_blocks, ranked),
            common.walk_row_bytes(num_kv_blocks))


def fit_config(config: BackwardConfig, limit: int, *args, **kwargs) -> BackwardConfig | None:
    """``config`` with as many stages as fit in ``limit`` bytes (`smem_bytes` arguments).

    Fitted without ``fused_dq``, the stages are those of the dQ kernel's path;
    `attention_backward` fits the fused path's own when it takes that path.
    """
    while True:
        dkv, dq = smem_bytes(config, *args, **kwargs)
        if dkv <= limit and dq <= limit:
            return config
        if (dkv > limit and config.dkv_stages == 1) or (dq > limit and config.dq_stages == 1):
            return None
        config = dataclasses.replace(
            config, dkv_stages=config.dkv_stages - (dkv > limit),
            dq_stages=config.dq_stages - (dq > limit))


@dataclasses.dataclass(frozen=True)
class _Statics(common.LeafCounts):
    """Everything static the kernel bodies need."""

    config: BackwardConfig
    layout: MaskLayout
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: Any
    scores: common.ScoreSpec
    has_partial: bool
    dq_walk_lines: int
    dkv_walk_lines: int
    mask_heads: int
    leaf_slots: tuple[tuple[str, int], ...]
    interpret: bool
    # What a dK/dV launch sums: both, or one of them (`BackwardConfig.split_dkdv`).
    gradients: tuple[str, ...] = ("dk", "dv")
    fused_dq: bool = False  # dQ from this kernel (`attention_backward` decides)
    # The steps of each walk this launch takes: "all", or with the fused dQ under masked
    # tiles "full" (the first fused launch) and "masked" (the second, which adds theirs).
    walk_part: str = "all"

    @property
    def paired(self) -> bool:
        """Whether the launch's two consumers share 64 kv rows and split the work
        (`BackwardConfig.paired_consumers`): consumer 0 sums dV, consumer 1 dK."""
        return not self.fused_dq and pairs_consumers(self.config)

    @property
    def q_major(self) -> bool:
        """Whether the fused step computes S and dP q-major (`scores_q_major`)."""
        return self.fused_dq and scores_q_major(self.config, self.has_partial)

    @property
    def orders_dq(self) -> bool:
        """Whether the fused dQ's adds go in a fixed order (`BackwardConfig.ordered_dq`)."""
        return self.fused_dq and self.config.ordered_dq

    @property
    def dq_group(self) -> int:
        """Kv-blocks whose ordered dQ adds go into one sum, in order (`ordered_dq_group`)."""
        return ordered_dq_group(self.layout.num_kv_blocks)

    @property
    def dkv_consumers(self) -> int:
        """Consumer warpgroups of a dK/dV CTA."""
        return 2 if self.paired else self.config.dkv_consumers

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def folds_scale(self) -> bool:
        """Whether dS^T leaves out the scale, applied to the sums instead
        (`BackwardConfig.fold_scale`)."""
        return self.config.fold_scale and (self.config.overlapped_step or not self.fused_dq)

    @property
    def seeds_stats(self) -> bool:
        """Whether the step seeds its score accumulators (`BackwardConfig.seeded_stats`):
        all but the overlapped fused step, which keeps them in refs."""
        return self.config.seeded_stats and not (self.fused_dq and self.config.overlapped_step)

    @property
    def seeds_any_stat(self) -> bool:
        """Whether a step waits for its statistics before its products, to seed them."""
        return self.seeds_lse or self.seeds_delta

    @property
    def seeds_lse(self) -> bool:
        """Whether S^T's accumulator starts at -lse (`BackwardConfig.seeded_stats`)."""
        return self.seeds_stats and self.scores.folds_scale

    @property
    def seeds_delta(self) -> bool:
        """Whether dP^T's accumulator starts at -delta (`BackwardConfig.seeded_stats`)."""
        return self.seeds_stats and "dk" in self.gradients

    @property
    def dkv_walk_heads(self) -> int:
        """Walk rows a dK/dV CTA loads: one per query head of its group if the mask has heads."""
        return self.group_size if self.mask_heads > 1 else 1


def walk_loops(s: _Statics, num_full, count) -> list[tuple[Any, Any, bool]]:
    """``(start, stop, full)`` of a launch's loops over a walk of ``count`` steps whose
    ``num_full`` FULL steps come first: FULL steps run in a loop without mask code."""
    loops = []
    if s.walk_part != "masked":
        loops.append((0, num_full, True))
    if s.walk_part != "full" and common.has_masked_tiles(s.layout, s.has_partial):
        loops.append((num_full, count, False))
    return loops


def _transposed(ref):
    return ref.transpose((1, 0))


def _products(tile, *operands, seeds=None, interpret: bool = False):
    """``seed + a @ b`` (float32, ``tile``-shaped) for each ``(a, b)`` of smem operands by
    wgmma, ``seeds`` (one per operand, None for zero) the accumulators' starting values.

    All products are issued before the one wait that reading the results implies. An
    operand ``(a, b, ready)`` first waits for the barrier ``ready``: the products issued
    before it run meanwhile.
    """
    seeds = seeds or (None,) * len(operands)

    def issue(*acc_refs):
        added = [_seed(acc_ref, seed, interpret) for acc_ref, seed in zip(acc_refs, seeds,
                                                                          strict=True)]
        for acc_ref, (a, b, *ready) in zip(acc_refs, operands, strict=True):
            for barrier in ready:
                plgpu.barrier_wait(barrier)
            plgpu.wgmma(acc_ref, a, b)
        return tuple(_load_seeded(acc_ref, add) for acc_ref, add in zip(acc_refs, added,
                                                                         strict=True))

    return pl.run_scoped(issue, *(plgpu.ACC(tile, jnp.float32) for _ in operands))


def _seed(acc_ref, seed, interpret: bool):
    """Starts the zeroed accumulator ``acc_ref`` at ``seed`` (None: zero). The
    interpreter keeps it at zero and returns ``seed`` for `_load_seeded` to add (its
    accumulators are plain arrays: the same value, rounded once more)."""
    if seed is None or interpret:
        return seed
    acc_ref[...] = seed
    return None


def _load_seeded(acc_ref, add):
    """The accumulator's value once its wgmma is done, plus what `_seed` left to ``add``."""
    value = acc_ref[...]
    return value if add is None else value + add


def _staged(staging, value):
    """A register wgmma operand; interpreted, staged in smem (its wgmma reads smem only)."""
    if staging is None:
        return value
    staging[...] = value
    return staging


def _dkv_kernel(s: _Statics, q_ref, k_ref, v_ref, do_ref, stats_ref, walk_ref, *refs):
    cfg = s.config
    rows, stages, consumers = ROWS_PER_CONSUMER, cfg.dkv_stages, s.dkv_consumers
    q_step, steps_per_block = cfg.q_step, cfg.steps_per_q_block
    partial_ref, q_leaf_ref, kv_leaf_ref, captured_ref, refs = common.split_optional_refs(
        refs, s)
    # The masked steps' launch adds its sums to the FULL steps' (the fused launch's).
    full_sums = (refs.pop(0), refs.pop(0)) if s.walk_part == "masked" else None
    dq_sum_ref = refs.pop(0) if s.fused_dq else None
    *grad_refs, smem, barriers = refs
    grad_refs = dict(zip(s.gradients, grad_refs, strict=True))
    (k_smem, v_smem, walk_smem, q_ring, do_ring, stats_ring, mask_ring, q_leaf_ring,
     kv_leaf_smem, staging, captured_smem, ds_smem, dq_stage, pair_smem, p_smem) = smem
    (walk_barrier, kv_leaf_barrier, k_barriers, v_barriers, loaded, mask_ready, q_leaf_ready,
     consumed, captured_barrier, ds_ready, ds_free, dq_staged,
     dq_stage_free, pair_ready, pair_free, operand_read) = barriers

    # Rank 0 is kv-block 0, the longest walk under causal-like masks. The ordered dQ's
    # groups must launch kv-block by kv-block (`ordered_dq_groups`); its walks are even.
    batch_head, kv_block = common.sectioned_launch(
        "kv_block", q_ref.shape[0] * s.num_kv_heads, s.layout.num_kv_blocks,
        sections=cfg.sectioned_launch and not s.orders_dq)
    batch = lax.div(batch_head, s.num_kv_heads)
    kv_head = lax.rem(batch_head, s.num_kv_heads)
    first_head = kv_head * s.group_size
    wg = lax.axis_index("wg")
    index_offset, flags_offset, partial_offset = walk_offsets(s.layout.num_q_blocks)
    turn_offset = partial_offset + s.layout.num_q_blocks  # `rotated_add_turns`
    reducer = s.fused_dq and cfg.dq_reducer_warp
    # The ordered dQ's count of adds per (group of kv-blocks, batch, query head, q step):
    # kept across calls (`pl.get_global`), zero between them, as each q step's last add
    # resets it. The interpreter has no global semaphores: there each kv-block has a sum
    # of its own (`_dq_adders`), added in order afterwards.
    q_steps = q_ref.shape[1] // q_step
    locks = (pl.get_global(plgpu.SemaphoreType.REGULAR(
        (_dq_adders(s) * q_ref.shape[0] * s.num_q_heads * q_steps,)))
             if s.orders_dq and not s.interpret else None)

    # Fused dQ: consumer c's share of a step's dQ (`_dq_share`) is whole 64-column tiles
    # of K for all of the step's rows, or with 128-row steps 64 of the rows for every
    # column.
    dq_rows, dq_cols = _dq_share(s)
    by_rows = dq_rows < q_step

    def dq_origin(c):
        """(first row, first column) of consumer ``c``'s share of a step's dQ."""
        return (c * dq_rows, 0) if by_rows else (0, c * dq_cols)

    def dq_destination(c, head, q_start):
        """Consumer ``c``'s share of dQ of the step at (``head``, ``q_start``) in the sum."""
        row0, col0 = dq_origin(c)
        # A multiple of 8 either way; the mask shows it to jax 0.12's layout inference
        # (a loop-carried q_start hides it), which else rejects the swizzled stage's TMA.
        row = jnp.bitwise_and(q_start + row0, -8)
        return dq_sum_ref.at[_dq_adder(s, kv_block), batch, pl.ds(row, dq_rows),
                             head, pl.ds(col0, dq_cols)]

    def entry(g, i):
        """Entry ``i`` of the walk of the group's ``g``-th query head."""
        row = g if s.dkv_walk_heads > 1 else 0
        return walk_smem[row, lax.div(i, common.WALK_LINE), lax.rem(i, common.WALK_LINE)]

    def num_steps(g):
        return steps_per_block * entry(g, 0)

    def num_full_steps(g):
        return steps_per_block * entry(g, 1)

    def step_position(g, j):
        """(q-block flags, first q row, part of the q-block, walk position) of step ``j``
        of head ``g``'s walk; the ordered dQ's walks start at the kv-block's index
        (`BackwardConfig.ordered_dq`: FULL tiles only)."""
        i, part = lax.div(j, steps_per_block), lax.rem(j, steps_per_block)
        if s.orders_dq:
            walk_len = jnp.maximum(entry(g, 1), 1)
            i = lax.rem(i + lax.rem(kv_block, walk_len), walk_len)
        q_block = entry(g, index_offset + i)
        return entry(g, flags_offset + i), q_block * BLOCK_Q + part * q_step, part, i

    # Registers move from the producer to the consumers only with two consumers: with
    # one, the two warpgroups already get the per-thread maximum each. 240 + 240 + 24
    # fills the register file; the consumers' masked steps still spill a little (36
    # bytes under a causal mask, 52 at 232 registers).
    rebalance = consumers > 1

    @pl.when(wg == consumers)
    def _producer():
        if rebalance:
            plgpu.set_max_registers(24, action="decrease")
        common.load_captured(s, captured_ref, captured_smem, captured_barrier)
        mask_b, mask_h = batch_head_index(walk_ref, batch, first_head)
        plgpu.copy_gmem_to_smem(walk_ref.at[mask_b, pl.ds(mask_h, s.dkv_walk_heads), kv_block],
                                walk_smem, walk_barrier)
        if s.num_kv_leaves:
            plgpu.copy_gmem_to_smem(
                kv_leaf_ref.at[batch, :, pl.ds(kv_block * cfg.block_kv, cfg.block_kv)],
                kv_leaf_smem, kv_leaf_barrier)
        plgpu.barrier_wait(walk_barrier)

        def reduce_dq(dq_step, position):
            """Adds each consumer's staged share of dQ of step ``dq_step`` (at ``position``:
            head, first q row and, ordered, add turn) to the sum and frees the stage once
            read. Step -1's (the consumers' product of a zero tile, `_consumer`) is only
            freed. Ordered, the adds wait for their turn once both stages are filled, and
            count themselves once landed (not only read); the last resets the count."""
            head, q_start, *turn = position
            lock = None
            if locks is not None:
                lock = locks.at[((_dq_adder(s, kv_block) * q_ref.shape[0] + batch)
                                 * s.num_q_heads + head) * q_steps + lax.div(q_start, q_step)]
                last = turn[0] < 0
                turn = jnp.where(last, -turn[0] - 1, turn[0])
                for c in range(consumers):
                    plgpu.barrier_wait(dq_staged.at[c])

                # The last add takes the count back to zero as it passes (it signals
                # nothing): the increment a signal adds must be a constant.
                for is_last in (True, False):
                    pl.when((dq_step >= 0) & (last == is_last))(functools.partial(
                        plgpu.semaphore_wait, lock, turn, decrement=is_last,
                        memory_scope="gpu"))

            def add(dst, stage):
                dst[...] = dst[...] + stage[...]

            for c in range(consumers):
                if lock is None:
                    plgpu.barrier_wait(dq_staged.at[c])
                dst = dq_destination(c, head, q_start)
                if s.interpret:  # No TMA reductions there (`_dq_adders`).
                    pl.when(dq_step >= 0)(functools.partial(add, dst, dq_stage.at[c]))
                else:
                    plgpu.copy_smem_to_gmem(dq_stage.at[c], dst, reduction_op="add",
                                            predicate=dq_step >= 0)
                    if lock is None:
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                if lock is None:
                    plgpu.barrier_arrive(dq_stage_free.at[c])
            if lock is not None:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for c in range(consumers):
                    plgpu.barrier_arrive(dq_stage_free.at[c])
                plgpu.wait_smem_to_gmem(0)  # The adds are in the sum: the next may go.
                pl.when((dq_step >= 0) & ~last)(
                    lambda: plgpu.semaphore_signal(lock, 1, memory_scope="gpu"))

        if reducer:  # The stages start free.
            for c in range(consumers):
                plgpu.barrier_arrive(dq_stage_free.at[c])

        def head_steps(g, carry):
            head = first_head + g

            def fetch(j, carry):
                # ``positions``: (head, first q row) of the last stages + 1 steps fetched,
                # oldest first, for the reductions (the reducer's).
                step, positions = carry
                slot = lax.rem(step, stages)

                # The slot held step - stages: wait until every consumer is done with it.
                @pl.when(step >= stages)
                def _():
                    common.wait_released(consumed.at[slot], interpret=s.interpret)

                flags, q_start, part, i = step_position(g, j)
                common.load_q_step(
                    s, (q_ref, stats_ref, q_leaf_ref, partial_ref, do_ref),
                    (q_ring, stats_ring, q_leaf_ring, mask_ring, do_ring),
                    (loaded, loaded, q_leaf_ready, mask_ready, loaded), slot=slot,
                    batch=batch, head=head, q_start=q_start, rows=q_step, part=part,
                    flags=flags, partial_id=lambda: entry(g, partial_offset + i))
                if reducer:
                    # The consumers stage step - stages - 1's dQ once done with dK and dV
                    # of step - stages, whose release the wait above observed: a short
                    # wait, long before the next fetch's.
                    pl.when(step >= stages)(
                        functools.partial(reduce_dq, step - stages - 1, positions[0]))
                    turn = (entry(g, turn_offset + i),) if s.orders_dq else ()
                    positions = (*positions[1:], (head, q_start, *turn))
                return step + 1, positions

            for start, stop, _ in walk_loops(s, num_full_steps(g), num_steps(g)):
                carry = lax.fori_loop(start, stop, fetch, carry)
            return carry

        # Before any fetch, steps -stages - 1 to -1 (step -1's position is never written).
        position = (first_head, jnp.int32(0), *((jnp.int32(0),) if s.orders_dq else ()))
        positions = (position,) * (stages + 1) if reducer else ()
        num_loads, positions = lax.fori_loop(0, s.group_size, head_steps,
                                             (jnp.int32(0), positions))
        for i, position in enumerate(positions):  # The reductions the loop left.
            dq_step = num_loads - len(positions) + i
            pl.when(dq_step >= -1)(functools.partial(reduce_dq, dq_step, position))
        if reducer and not s.interpret:
            plgpu.wait_smem_to_gmem(0)
        common.drain_ring(num_loads, stages, consumed)

    def _consumer(role: str | None):
        """A consumer warpgroup; ``role`` ("dv" or "dk") that of a paired consumer
        (`BackwardConfig.paired_consumers`): consumer 0 computes S^T and P^T and sums dV,
        publishing P^T (times the score slope) for consumer 1, which computes dP^T and
        dS^T and sums dK."""
        if rebalance:
            plgpu.set_max_registers(240, action="increase")
        sums_dk = "dk" in s.gradients if role is None else role == "dk"
        sums_dv = "dv" in s.gradients if role is None else role == "dv"
        computes_scores = role != "dk"
        tile_index = 0 if s.paired else wg  # This consumer's K and V tiles.
        kv_row0 = tile_index * rows  # Their first row in the kv block.
        kv_start = kv_block * cfg.block_kv + kv_row0
        kv_rows = pl.ds(kv_start, rows)
        k_tile, v_tile = k_smem.at[tile_index], v_smem.at[tile_index]
        if computes_scores:
            plgpu.copy_gmem_to_smem(k_ref.at[batch, kv_rows, kv_head], k_tile,
                                    k_barriers.at[wg])
        if sums_dk:  # dP^T = V dO^T; a dV launch only stages its sum in V's buffer.
            plgpu.copy_gmem_to_smem(v_ref.at[batch, kv_rows, kv_head], v_tile,
                                    v_barriers.at[wg])
        row_layout = compat.wgmma_row_layout()
        col_layout = compat.wgmma_col_layout()
        # Transposed scores: kv rows x q columns; q-major (`_Statics.q_major`) the reverse.
        tile = (q_step, rows) if s.q_major else (rows, q_step)
        q_axis = 0 if s.q_major else 1
        q_layout, kv_layout = ((row_layout, col_layout) if s.q_major else
                               (col_layout, row_layout))  # Of per-q and per-kv vectors.
        p_stage, ds_stage = (None, None) if staging is None else (staging.at[0, wg],
                                                                   staging.at[1, wg])

        def indices(q_start, read):
            return common.tile_indices(tile, q_start, kv_start, q_axis=q_axis, read=read)

        # This consumer's kv mask leaves along its tiles' kv axis.
        kv_leaf_values = []
        if s.num_kv_leaves:
            plgpu.barrier_wait(kv_leaf_barrier)
            for i in range(s.num_kv_leaves):
                kv_leaf_values.append(compat.mosaic_load(
                    kv_leaf_smem.at[i, pl.ds(kv_row0, rows)], kv_layout,
                    interpret=s.interpret))
        plgpu.barrier_wait(walk_barrier)
        if computes_scores:
            plgpu.barrier_wait(k_barriers.at[wg])
        if sums_dk:
            plgpu.barrier_wait(v_barriers.at[wg])
        common.wait_captured(s, captured_barrier)

        # Fused dQ. Step t's dS^T tiles (every consumer's) go to ds_smem[t % 2]; one
        # step later each consumer adds its share of dQ of step t's q rows into the
        # float32 sum: dS K over all of the CTA's kv rows (`dq_origin`; with 128-row
        # steps A is the transposed 64 q columns of each dS^T tile, tile-aligned as K's
        # column tiles are). The delay lets the consumers run out of step (one's softmax
        # under the other's matmuls). ds_ready[p]: both tiles of parity p written;
        # ds_free[p]: both consumers' products have read them. A zero tile of parity 1
        # stands for step -1, so that every step issues its product (a wgmma under a
        # branch would make ptxas serialize all of the kernel's wgmmas); only its add is
        # skipped.
        dq_row0, dq_col0 = dq_origin(wg)

        def dq_products(parity):
            # Own tile first, then the peer's (traced indices: constants would become
            # run_state outputs, which the Mosaic-GPU lowering rejects).
            parts = [wg, consumers - 1 - wg] if consumers > 1 else [wg]
            if by_rows:
                return [(_transposed(ds_smem.at[parity, c, :, pl.ds(dq_row0, dq_rows)]),
                         k_smem.at[c]) for c in parts]
            return [(ds_smem.at[parity, c] if s.q_major else _transposed(ds_smem.at[parity, c]),
                     k_smem.at[c, :, pl.ds(dq_col0, dq_cols)]) for c in parts]

        def dq_product(parity, *products):
            """dQ of the tiles of ``parity``; issued after ``products``, (acc, (a, b))
            pairs, all awaited at once: (the sums of ``products``, dQ)."""
            plgpu.barrier_wait(ds_ready.at[parity])
            zeros = plgpu.layout_cast(jnp.zeros((dq_rows, dq_cols), jnp.float32),
                                      plgpu.Layout.WGMMA)
            *sums, dq = compat.wgmma_accumulate_all(
                (*(acc for acc, _ in products), zeros),
                (*(ab for _, ab in products), dq_products(parity)), interpret=s.interpret)
            plgpu.barrier_arrive(ds_free.at[parity])
            return sums, dq

        # The reducer's step commits its dS^T tile together with its dQ stage
        # (`BackwardConfig.one_commit_a_step`); the q-major step commits it with its P tile.
        shared_commit = reducer and cfg.one_commit_a_step and not s.q_major

        def add_dq(dq, position, when, ds_parity=None):
            """Adds ``dq`` (of the step at ``position``, (head, first q row)) to the
            float32 sum where ``when`` holds, without branching around it when compiled:
            the overlapped step adds while dK's wgmma runs. The reducer's stage takes
            every product, step -1's too (the producer skips its add); its commit also
            publishes the step's dS^T tile of ``ds_parity`` (`write_ds`) if given."""
            if reducer:
                plgpu.barrier_wait(dq_stage_free.at[wg])
                dq_stage.at[wg][...] = dq
                plgpu.commit_smem()
                if ds_parity is not None:
                    plgpu.barrier_arrive(ds_ready.at[ds_parity])
                plgpu.barrier_arrive(dq_staged.at[wg])
                return
            dst = dq_destination(wg, *position)
            if s.interpret:  # No TMA reductions there: a sum of its own (`_dq_adders`).
                @pl.when(when)
                def _():
                    dst[...] = dst[...] + dq
            else:  # The previous reduction has read the stage (`wait_stage_read`).
                dq_stage.at[wg][...] = dq
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dq_stage.at[wg], dst, reduction_op="add",
                                        predicate=when)

        def wait_stage_read():
            """Without the reducer: this consumer's previous reduction has read its dQ
            stage, once the caller's next `commit_smem` (a warpgroup barrier) has ordered
            this for every thread."""
            if not s.interpret and not reducer:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def write_ds(parity, dscores, publish=True):
            """Stores this consumer's dS^T tile of ``parity``; ``publish``: commits it and
            arrives on ``ds_ready`` (else the step's `add_dq` does). Nothing reads the
            tile before the next step's dQ products."""
            wait_stage_read()
            ds_smem.at[parity, wg][...] = dscores
            if publish:
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready.at[parity])

        if s.fused_dq:
            write_ds(1, plgpu.layout_cast(jnp.zeros(tile, s.dtype),
                                          plgpu.Layout.WGMMA))

        # Which statistics this consumer's accumulators start at (`stat_seeds`).
        seeds_lse = s.seeds_lse and computes_scores
        seeds_delta = s.seeds_delta and sums_dk
        seeds_any_stat = seeds_lse or seeds_delta

        def publish_probs(step, probs, slope):
            """Paired consumer 0: P^T (times the score slope: consumer 1's dS^T needs
            nothing else of the scores) of ``step`` to the tile of its parity, once
            consumer 1 read the one of step - 2."""
            parity = lax.rem(step, 2)

            @pl.when(step >= 2)
            def _():
                plgpu.barrier_wait(pair_free.at[parity])

            pair_smem.at[parity][...] = (probs if slope is None else probs * slope
                                         ).astype(s.dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(pair_ready.at[parity])

        def published_probs(step):
            """Paired consumer 1: consumer 0's P^T (times the slope) of ``step``."""
            parity = lax.rem(step, 2)
            plgpu.barrier_wait(pair_ready.at[parity])
            return compat.mosaic_load(pair_smem.at[parity], plgpu.Layout.WGMMA,
                                      interpret=s.interpret).astype(jnp.float32)

        # The overlapped fused step keeps dK and dV in wgmma accumulator refs, so that
        # their products stay in flight while the step goes on.
        overlapped = s.fused_dq and cfg.overlapped_step

        def head_steps(g, carry, sum_refs=None):
            head = first_head + g
            score_spec = common.with_captured_read(s.scores, captured_smem, batch, head)

            def stat(slot, row, factor=1.0):
                """``factor`` times the step's lse (``row`` 0) or delta (1), broadcast over
                the tile's kv positions."""
                values = compat.mosaic_load(stats_ring.at[slot, row], q_layout,
                                            interpret=s.interpret)
                return lax.broadcast_in_dim(values if factor == 1 else values * factor,
                                            tile, [q_axis])

            def stat_seeds(slot):
                """(S^T's, dP^T's) accumulator seeds of the step in ``slot``, None where
                not seeded (`BackwardConfig.seeded_stats`)."""
                if not seeds_any_stat:
                    return None, None
                return (stat(slot, 0, -1 / (s.scores.scale * LOG2E)) if seeds_lse else None,
                        stat(slot, 1, -1.0) if seeds_delta else None)

            def probabilities(scores, slot, flags, q_start, full: bool):
                """(P^T float32, the score slope or None) of the step's S^T (raw, or
                seeded with -lse: `stat_seeds`); q-major, P of S."""
                wants_slope = sums_dk or s.paired  # Paired, consumer 1 takes it.
                scores = common.log2_scores(score_spec, scores, batch, head,
                                            functools.partial(indices, q_start),
                                            slope=wants_slope)
                scores, slope = scores if wants_slope else (scores, None)

                def masked(scores):
                    q_leaf_values = [
                        compat.mosaic_load(q_leaf_ring.at[slot, i], q_layout,
                                           interpret=s.interpret)
                        for i in range(s.num_q_leaves)]
                    leaves = common.tile_leaves(s.leaf_slots, q_leaf_values, kv_leaf_values,
                                                tile, q_axis=q_axis)
                    partial = ((mask_ring.at[slot, pl.ds(kv_row0, rows)],
                                mask_ready.at[slot]) if s.has_partial else None)
                    return common.masked_scores(scores, s.layout, flags,
                                                functools.partial(indices, q_start),
                                                leaves, partial, interpret=s.interpret)

                if s.num_q_leaves:  # Loaded for every step, FULL ones too.
                    plgpu.barrier_wait(q_leaf_ready.at[slot])
                if not full:
                    scores = masked(scores)

                if seeds_lse:
                    return jnp.exp2(scores), slope
                return jnp.exp2(scores - stat(slot, 0)), slope

            def score_grads(probs, dprobs, slope, slot):
                """dS^T in the input dtype: P^T (dP^T - delta), times the slope and the
                scale (unless the sums take it, `_Statics.folds_scale`); ``dprobs`` is
                dP^T - delta already if seeded (`stat_seeds`)."""
                dscores = probs * (dprobs if seeds_delta else dprobs - stat(slot, 1))
                if slope is not None:
                    dscores = dscores * slope
                if not s.folds_scale:
                    dscores = dscores * s.scores.scale
                return dscores.astype(s.dtype)

            def step_fn(j, carry, full: bool):
                dk, dv, step, previous = carry
                slot = lax.rem(step, stages)
                flags, q_start, _, _ = step_position(g, j)
                q_half, do_half = q_ring.at[slot], do_ring.at[slot]

                plgpu.barrier_wait(loaded.at[slot])  # Q, dO and the statistics.
                lse_seed, delta_seed = stat_seeds(slot)
                if not computes_scores:
                    (dprobs,) = _products(tile, (v_tile, _transposed(do_half)),
                                          seeds=(delta_seed,), interpret=s.interpret)
                    probs, slope = published_probs(step), None
                elif sums_dk:
                    scores, dprobs = _products(tile, (k_tile, _transposed(q_half)),
                                               (v_tile, _transposed(do_half)),
                                               seeds=(lse_seed, delta_seed),
                                               interpret=s.interpret)
                else:
                    (scores,) = _products(tile, (k_tile, _transposed(q_half)),
                                          seeds=(lse_seed,), interpret=s.interpret)
                if computes_scores:
                    probs, slope = probabilities(scores, slot, flags, q_start, full)
                if role == "dv":
                    publish_probs(step, probs, slope)
                # (sum, its (a, b) product) of each gradient summed, dV's issued first.
                products = []
                if sums_dv:
                    products.append((dv, (_staged(p_stage, probs.astype(s.dtype)), do_half)))
                if sums_dk:
                    dscores = score_grads(probs, dprobs, slope, slot)
                    products.append((dk, (_staged(ds_stage, dscores), q_half)))
                def accumulate():
                    sums = compat.wgmma_accumulate_all(
                        tuple(acc for acc, _ in products), tuple(ab for _, ab in products),
                        interpret=s.interpret)
                    return sums[-1] if sums_dk else dk, sums[0] if sums_dv else dv

                if not s.fused_dq:
                    dk, dv = accumulate()
                    if role == "dk":  # dS^T, computed from the tile, is in dK's product.
                        plgpu.barrier_arrive(pair_free.at[lax.rem(step, 2)])
                    plgpu.barrier_arrive(consumed.at[slot])
                    return dk, dv, step + 1, previous

                parity = lax.rem(step, 2)

                @pl.when(step >= 1)  # Both products of step - 2 have read the tile.
                def _():
                    plgpu.barrier_wait(ds_free.at[parity])

                write_ds(parity, dscores, publish=not shared_commit)
                if cfg.serial_dq_with_dkdv:
                    (dv, dk), dq = dq_product(1 - parity, *products)
                    plgpu.barrier_arrive(consumed.at[slot])
                else:
                    dk, dv = accumulate()
                    plgpu.barrier_arrive(consumed.at[slot])
                    # After dV and dK: P^T and dS^T are dead, so dQ's accumulator fits.
                    _, dq = dq_product(1 - parity)
                add_dq(dq, previous, step >= 1, parity if shared_commit else None)
                return dk, dv, step + 1, (head, q_start)

            def overlapped_step_fn(j, carry, full: bool):
                """The fused step in the order of `BackwardConfig.overlapped_step`; dK and
                dV accumulate in ``sum_refs``. Transposed, P^T and dS^T feed dV and dK from
                registers; q-major (`_Statics.q_major`), P and dS from shared memory."""
                step, previous = carry
                dk_ref, dv_ref = sum_refs
                slot = lax.rem(step, stages)
                flags, q_start, _, _ = step_position(g, j)
                q_half, do_half = q_ring.at[slot], do_ring.at[slot]

                plgpu.barrier_wait(loaded.at[slot])  # Q, dO and the statistics.

                def softmax(scores_ref, dprobs_ref):
                    if s.q_major:
                        plgpu.wgmma(scores_ref, q_half, _transposed(k_tile))
                        plgpu.wgmma(dprobs_ref, do_half, _transposed(v_tile))
                    else:
                        plgpu.wgmma(scores_ref, k_tile, _transposed(q_half))
                        plgpu.wgmma(dprobs_ref, v_tile, _transposed(do_half))
                    # wgmma groups complete in order: waiting for all but the newest
                    # (dP^T) is waiting for S^T.
                    scores = plgpu.wgmma_accumulator_load(scores_ref, wait_n=1)
                    # Pins P^T ahead of the wait for dP^T, so that it runs under dP^T.
                    probs, slope = lax.optimization_barrier(
                        probabilities(scores, slot, flags, q_start, full))
                    dprobs = plgpu.wgmma_accumulator_load(dprobs_ref, wait_n=0)
                    if s.q_major:  # P rounded once dS is done, as measured (RESULTS.md).
                        dscores = score_grads(probs, dprobs, slope, slot)
                        return probs.astype(s.dtype), dscores
                    return probs.astype(s.dtype), score_grads(probs, dprobs, slope, slot)

                probs, dscores = pl.run_scoped(softmax, plgpu.ACC(tile, jnp.float32),
                                               plgpu.ACC(tile, jnp.float32))
                parity = lax.rem(step, 2)

                @pl.when(step >= 1)  # Both products of step - 2 have read the tile.
                def _():
                    plgpu.barrier_wait(ds_free.at[parity])

                if s.q_major:  # The tile was last read by the previous step's dV.
                    p_smem.at[wg][...] = probs
                    probs_operand = _transposed(p_smem.at[wg])
                    dscores_operand = _transposed(ds_smem.at[parity, wg])
                else:
                    probs_operand = _staged(p_stage, probs)
                    dscores_operand = _staged(ds_stage, dscores)
                write_ds(parity, dscores, publish=not shared_commit)

                # dQ's accumulator is zeroed before dV is issued: no register of a
                # wgmma in flight may be defined.
                def products(dq_ref):
                    if not cfg.dq_before_dv:
                        plgpu.wgmma(dv_ref, probs_operand, do_half)
                    plgpu.barrier_wait(ds_ready.at[1 - parity])
                    for a, b in dq_products(1 - parity):
                        plgpu.wgmma(dq_ref, a, b)
                    if cfg.dq_before_dv:
                        plgpu.wgmma(dv_ref, probs_operand, do_half)
                    plgpu.wgmma(dk_ref, dscores_operand, q_half)
                    # dQ is done (and dV, unless issued after it); dK still runs.
                    return plgpu.wgmma_accumulator_load(
                        dq_ref, wait_n=2 if cfg.dq_before_dv else 1)

                dq = pl.run_scoped(products, plgpu.ACC((dq_rows, dq_cols), jnp.float32))
                plgpu.barrier_arrive(ds_free.at[1 - parity])
                add_dq(dq, previous, step >= 1,  # Under dK.
                       parity if shared_commit else None)
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(consumed.at[slot])  # dK has read Q.
                return step + 1, (head, q_start)

            body = overlapped_step_fn if overlapped else step_fn
            for start, stop, full in walk_loops(s, num_full_steps(g), num_steps(g)):
                carry = lax.fori_loop(start, stop, functools.partial(body, full=full), carry)
            return carry

        # The fused dQ carries the previous step's (head, first q row).
        counters = (jnp.int32(0), (jnp.int32(0), jnp.int32(0)) if s.fused_dq else ())
        if overlapped:
            def walk(dk_ref, dv_ref):
                carry = lax.fori_loop(0, s.group_size,
                                      functools.partial(head_steps, sum_refs=(dk_ref, dv_ref)),
                                      counters)
                return dk_ref[...], dv_ref[...], *carry

            dk, dv, num_steps_done, previous = pl.run_scoped(
                walk, plgpu.ACC((rows, s.head_dim), jnp.float32),
                plgpu.ACC((rows, s.head_dim_v), jnp.float32))
        else:
            zeros = lambda dim: plgpu.layout_cast(jnp.zeros((rows, dim), jnp.float32),
                                                  plgpu.Layout.WGMMA)
            dk, dv, num_steps_done, previous = lax.fori_loop(
                0, s.group_size, head_steps,
                (zeros(s.head_dim) if sums_dk else (), zeros(s.head_dim_v) if sums_dv else (),
                 *counters))
        if s.fused_dq:
            # The last step's product (step -1's when there was none).
            _, dq = dq_product(lax.rem(num_steps_done + 1, 2))
            if not reducer:
                wait_stage_read()
                plgpu.commit_smem()
            add_dq(dq, previous, num_steps_done >= 1)

            # Every product of the last two steps (from step -1 on) has read its dS^T
            # tile and K (the peer's too) before K's buffer stages dK below.
            @pl.loop(jnp.maximum(num_steps_done - 2, -1), num_steps_done)
            def _(t):
                plgpu.barrier_wait(ds_free.at[lax.rem(t + 2, 2)])
        if role == "dv":
            # Consumer 1's reads of the last two steps' tiles (every phase observed).
            @pl.loop(jnp.maximum(num_steps_done - 2, 0), num_steps_done)
            def _(t):
                plgpu.barrier_wait(pair_free.at[lax.rem(t, 2)])
        if s.folds_scale and sums_dk:
            dk = dk * s.scores.scale
        if full_sums is not None:
            # The FULL steps' dK and dV, through the K and V buffers nothing reads any more.
            for ref, tile, barrier in zip(full_sums, (k_tile, v_tile), (k_barriers, v_barriers),
                                          strict=True):
                plgpu.copy_gmem_to_smem(ref.at[batch, kv_rows, kv_head], tile, barrier.at[wg])
            for barrier in (k_barriers, v_barriers):
                plgpu.barrier_wait(barrier.at[wg])
            load = functools.partial(compat.mosaic_load, layout=plgpu.Layout.WGMMA,
                                     interpret=s.interpret)
            dk = dk + load(k_tile).astype(jnp.float32)
            dv = dv + load(v_tile).astype(jnp.float32)
        if s.paired:  # This consumer's operand is read; the other's once it says so.
            plgpu.barrier_arrive(operand_read.at[wg])
            plgpu.barrier_wait(operand_read.at[1 - wg])
        # K and V are no longer read: their buffers stage dK and dV for the TMA store.
        stores = []
        if sums_dk:
            k_tile[...] = dk.astype(s.dtype)
            stores.append((k_tile, grad_refs["dk"]))
        if sums_dv:
            v_tile[...] = dv.astype(s.dtype)
            stores.append((v_tile, grad_refs["dv"]))
        plgpu.commit_smem()
        for buffer, ref in stores:
            plgpu.copy_smem_to_gmem(buffer, ref.at[batch, kv_rows, kv_head])
        if reducer:  # Observes the last phase of the stage's barrier, as the interpreter
            plgpu.barrier_wait(dq_stage_free.at[wg])  # requires (its last reduction's read).
        plgpu.wait_smem_to_gmem(0)

    if s.paired:
        pl.when(wg == 0)(functools.partial(_consumer, "dv"))
        pl.when(wg == 1)(functools.partial(_consumer, "dk"))
    else:
        pl.when(wg < consumers)(functools.partial(_consumer, None))


def _dq_kernel(s: _Statics, q_ref, k_ref, v_ref, do_ref, stats_ref, walk_ref, *refs):
    cfg = s.config
    rows, block_kv, stages = ROWS_PER_CONSUMER, cfg.block_kv, cfg.dq_stages
    partial_ref, q_leaf_ref, kv_leaf_ref, captured_ref, refs = common.split_optional_refs(
        refs, s)
    dq_ref, smem, barriers = refs
    (q_smem, do_smem, stats_smem, walk_smem, k_ring, v_ring, mask_ring, q_leaf_smem,
     kv_leaf_ring, staging, captured_smem) = smem
    (walk_barrier, q_leaf_barrier, q_barriers, do_barriers, stats_barriers, k_ready, v_ready,
     mask_ready, kv_leaf_ready, k_consumed, v_consumed, captured_barrier) = barriers

    q_block, batch, head, kv_head = common.q_block_program(
        s, q_ref.shape[0] * s.num_q_heads, sections=cfg.sectioned_launch)
    wg = lax.axis_index("wg")
    offsets = walk_offsets(s.layout.num_kv_blocks)
    index_offset, flags_offset, _ = offsets

    @pl.when(wg == NUM_DQ_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(min(40, DQ_LAUNCH_REGISTERS - 2 * cfg.dq_consumer_registers),
                                action="decrease")
        common.load_captured(s, captured_ref, captured_smem, captured_barrier)
        count = common.load_q_block_walk(
            s, walk_ref, walk_smem, walk_barrier,
            (q_leaf_ref, q_leaf_smem, q_leaf_barrier) if s.num_q_leaves else None,
            batch=batch, head=head, q_block=q_block, block_q=BLOCK_Q)
        common.produce_kv_blocks(
            common.SmemWalk(walk_smem, s.layout.num_kv_blocks), count, stages=stages,
            block_kv=block_kv, batch=batch, kv_head=kv_head, k=(k_ref, k_ring, k_ready),
            v=(v_ref, v_ring, v_ready), consumed=(k_consumed, v_consumed),
            interpret=s.interpret,
            kv_leaves=((kv_leaf_ref, kv_leaf_ring, kv_leaf_ready)
                       if s.num_kv_leaves else None),
            partial=(partial_ref, mask_ring, mask_ready) if s.has_partial else None,
            v_first=cfg.dq_v_first)
        common.drain_ring(count, stages, k_consumed, v_consumed)

    @pl.when(wg < NUM_DQ_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(cfg.dq_consumer_registers, action="increase")
        q_start = q_block * BLOCK_Q + wg * rows
        q_rows = pl.ds(q_start, rows)
        q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, q_rows, head], q_tile, q_barriers.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[batch, q_rows, head], do_tile, do_barriers.at[wg])
        plgpu.copy_gmem_to_smem(stats_ref.at[batch, head, :, q_rows], stats_smem.at[wg],
                                stats_barriers.at[wg])
        row_layout = compat.wgmma_row_layout()
        tile = (rows, block_kv)
        stage = staging.at[wg] if staging is not None else None

        def indices(kv_block, read):
            return common.tile_indices(tile, q_start, kv_block * block_kv, q_axis=0,
                                       read=read)

        q_leaf_rows = []
        if s.num_q_leaves:
            plgpu.barrier_wait(q_leaf_barrier)
            for i in range(s.num_q_leaves):
                q_leaf_rows.append(compat.mosaic_load(
                    q_leaf_smem.at[i, pl.ds(wg * rows, rows)], row_layout,
                    interpret=s.interpret))
        plgpu.barrier_wait(stats_barriers.at[wg])
        lse2 = compat.mosaic_load(stats_smem.at[wg, 0], row_layout, interpret=s.interpret)
        delta = compat.mosaic_load(stats_smem.at[wg, 1], row_layout, interpret=s.interpret)
        plgpu.barrier_wait(walk_barrier)
        count = walk_smem[0, 0]
        plgpu.barrier_wait(q_barriers.at[wg])
        plgpu.barrier_wait(do_barriers.at[wg])
        common.wait_captured(s, captured_barrier)
        score_spec = common.with_captured_read(s.scores, captured_smem, batch, head)

        def step_fn(step, dq, full: bool):
            slot = lax.rem(step, stages)
            kv_block = common.walk_entry(walk_smem, index_offset + step)
            flags = common.walk_entry(walk_smem, flags_offset + step)
            k_block = k_ring.at[slot]

            s_operands = (q_tile, _transposed(k_block), k_ready.at[slot])
            dp_operands = (do_tile, _transposed(v_ring.at[slot]), v_ready.at[slot])
            if cfg.dq_v_first:
                dprobs, scores = _products(tile, dp_operands, s_operands)
            else:
                scores, dprobs = _products(tile, s_operands, dp_operands)
            scores, slope = common.log2_scores(score_spec, scores, batch, head,
                                               functools.partial(indices, kv_block),
                                               slope=True)

            kv_leaf_columns = common.load_kv_leaf_columns(s, kv_leaf_ring, kv_leaf_ready, slot)
            if not full:
                partial = ((mask_ring.at[slot, pl.ds(wg * rows, rows)], mask_ready.at[slot])
                           if s.has_partial else None)
                scores = common.masked_q_major_scores(s, scores, flags,
                                                      functools.partial(indices, kv_block),
                                                      q_leaf_rows, kv_leaf_columns, partial)
            # The producer refills the step's mask data together with V.
            plgpu.barrier_arrive(v_consumed.at[slot])
            probs = jnp.exp2(scores - lax.broadcast_in_dim(lse2, tile, [0]))

            dscores = probs * (dprobs - lax.broadcast_in_dim(delta, tile, [0]))
            if slope is not None:
                dscores = dscores * slope
            if not s.folds_scale:
                dscores = dscores * s.scores.scale
            dscores = dscores.astype(s.dtype)
            dq = compat.wgmma_accumulate(dq, _staged(stage, dscores), k_block,
                                         interpret=s.interpret)
            plgpu.barrier_arrive(k_consumed.at[slot])
            return dq

        dq = plgpu.layout_cast(jnp.zeros((rows, s.head_dim), jnp.float32), plgpu.Layout.WGMMA)
        for start, stop, full in walk_loops(s, walk_smem[0, 1], count):
            dq = lax.fori_loop(start, stop, functools.partial(step_fn, full=full), dq)
        if s.folds_scale:
            dq = dq * s.scores.scale
        # Q is no longer read: its buffer stages dQ for the TMA store (clipped at q_len).
        q_tile[...] = dq.astype(s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[batch, q_rows, head])
        plgpu.wait_smem_to_gmem(0)


def attention_backward(q: Array, k: Array, v: Array, kmask: KernelMask, layout: MaskLayout,
                       out: Array, lse: Array, dout: Array, dlse: Array, *, scale: float,
                       softcap: float | None, score_mod: ConvertedScoreMod | None,
                       has_partial: bool, config: BackwardConfig,
                       captured: Sequence[Array] = (), mean_full_walk: float | None = None,
                       interpret_params: Any = None) -> tuple[Array, Array, Array, Array]:
    """``(dq, dk, dv, delta)``; shapes as `attention_forward`'s inputs.

    ``lse`` is the forward's (sinks included), ``delta [B, Hq, Sq]`` float32 is
    ``rowsum(dO * O) - dlse``, returned for the sink gradient. ``captured`` are
    ``score_mod``'s captured arrays (read by element, as in the forward; their
    own gradients are the caller's); ``has_partial`` False promises no PARTIAL tile.
    ``config.fused_dq`` applies to masks without masked tiles, and to masks whose
    kv-blocks walk ``mean_full_walk`` >= ``config.fused_dq_min_full_walk`` FULL q-blocks
    on average (None: unknown, as for a traced mask). The masked steps then run in a
    fused launch of their own: the mask code of COMPUTED and PARTIAL steps next to dQ's
    accumulator spills registers (376 bytes under a causal mask, which then ran 12-19%
    slower than the dQ kernel; 148 bytes and 8-23% slower with FULL steps alone fused in
    the same launch: RESULTS.md, 2026-11-27), which a CTA of a few masked steps bears.
    Under `jax.vmap` the dQ kernel serves too (the fused dQ's in-place sum cannot be
    batched); inside a `jax.shard_map` the fused dQ serves as outside.
    """
    static = dict(layout=layout, scale=scale, softcap=softcap, score_mod=score_mod,
                  has_partial=has_partial, interpret_params=interpret_params)
    fused_configs = None
    masked_tiles = common.has_masked_tiles(layout, has_partial)
    long_walks = (mean_full_walk is not None
                  and mean_full_walk >= config.fused_dq_min_full_walk)
    if config.ordered_dq and not (config.dq_reducer_warp and orders_dq(
            layout, masked_tiles, config.ordered_dq_max_groups)):
        config = dataclasses.replace(config, fused_dq=False, ordered_dq=False)
    if config.fused_dq and (long_walks or not masked_tiles):
        group = q.shape[2] // k.shape[2]
        fused_configs = _fused_configs(config, layout, has_partial, masked_tiles, q, v,
                                       group if kmask.kv_num_blocks.shape[1] > 1 else 1)
    if fused_configs is None:
        return _backward(q, k, v, kmask, out, lse, dout, dlse, captured, fused_configs=None,
                         config=config, **static)
    # Concrete mask arrays stay constants of the kernels (`trace_time_eval`): only the
    # traced ones become operands of the custom_vmap function.
    mask_leaves, mask_tree = jax.tree.flatten(kmask)
    traced = [isinstance(x, jax.core.Tracer) for x in mask_leaves]

    def backward(fused_dq, q, k, v, traced_leaves, *rest):
        given = iter(traced_leaves)
        leaves = [next(given) if t else x for t, x in zip(traced, mask_leaves, strict=True)]
        return _backward(q, k, v, jax.tree.unflatten(mask_tree, leaves), *rest,
                         fused_configs=fused_configs if fused_dq else None, config=config,
                         **static)

    def unfused_under_vmap(axis_size, in_batched, *args):
        del axis_size
        in_axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched))
        grads = jax.vmap(functools.partial(backward, False), in_axes=in_axes)(*args)
        return grads, jax.tree.map(lambda _: True, grads)

    def fused_backward(*args):
        return backward(True, *args)

    fused = jax.custom_batching.custom_vmap(fused_backward)
    fused.def_vmap(unfused_under_vmap)
    traced_leaves = [x for t, x in zip(traced, mask_leaves, strict=True) if t]
    return fused(q, k, v, traced_leaves, out, lse, dout, dlse, tuple(captured))


def orders_dq(layout: MaskLayout, masked_tiles: bool, max_groups: int) -> bool:
    """Whether the ordered fused dQ (`BackwardConfig.ordered_dq`) serves a mask: walks of
    FULL tiles only, in at most ``max_groups`` groups of kv-blocks (`ordered_dq_groups`)."""
    return not masked_tiles and ordered_dq_groups(layout.num_kv_blocks) <= max_groups


def ordered_dq_groups(num_kv_blocks: int) -> int:
    """How many groups of consecutive kv-blocks of a head order their dQ adds among
    themselves (`BackwardConfig.ordered_dq`), each into a dQ sum of its own: groups of at
    most half of the device's SMs. A CTA waits on CTAs of its group launched after it,
    so a group's must be resident at once, also beside another kernel holding some SMs
    (one CTA an SM: the fused launch's shared memory takes most of one); CTAs of earlier
    groups wait on nothing launched later, so they finish and make room. A group's CTAs
    launch one after another: Mosaic GPU maps the grid's last axis (``kv_block``) to
    CUDA's fastest, x."""
    return -(-num_kv_blocks // max(runtime.num_sms() // 2, 1))


def ordered_dq_group(num_kv_blocks: int) -> int:
    """Kv-blocks a group (`ordered_dq_groups`) holds: the groups as even as they go."""
    return -(-num_kv_blocks // ordered_dq_groups(num_kv_blocks))


def _fused_configs(config: BackwardConfig, layout: MaskLayout, has_partial: bool,
                   masked_tiles: bool, q: Array, v: Array, dkv_walk_heads: int,
                   ) -> tuple[BackwardConfig, BackwardConfig | None] | None:
    """The fused dQ's (FULL steps' launch, masked steps' launch or None without
    ``masked_tiles``) configs, their stages fitted to shared memory; None if one does
    not fit or the query-key head dim does not split (`fused_dq_splits`)."""
    dims = *padded_head_dims(q.shape[-1], v.shape[-1]), q.dtype.itemsize
    if not fused_dq_splits(dims[0], config.dkv_consumers, config.q_step):
        return None
    walks = walk_bytes(layout.num_q_blocks, layout.num_kv_blocks, dkv_walk_heads,
                       ranked=config.ordered_dq)
    # The FULL steps' launch loads no stored tiles and no mask leaves.
    full = _fit_fused(config, *dims, False, walk_bytes=walks)
    if not masked_tiles:
        return None if full is None else (full, None)
    num_q_leaves = sum(kind != "kv" for kind in layout.leaf_kinds)  # "batch" ones read as q
    masked = _fit_fused(config, *dims, has_partial, num_q_leaves,
                        len(layout.leaf_kinds) - num_q_leaves, walk_bytes=walks)
    return None if full is None or masked is None else (full, masked)


def _fit_fused(config: BackwardConfig, *args, **kwargs) -> BackwardConfig | None:
    """A fused launch's config fitted to shared memory (`fit_config`); where the q-major
    step's P tiles (`BackwardConfig.q_major_scores`) would cost a stage, the transposed
    step (long walks keep their rows in shared memory: `walk_bytes`)."""
    def fit(config):
        return fit_config(config, common.SMEM_LIMIT, *args, fused_dq=True, **kwargs)

    fitted = fit(config)
    if not config.q_major_scores:
        return fitted
    transposed = fit(dataclasses.replace(config, q_major_scores=False))
    if fitted is None or (transposed is not None
                          and transposed.dkv_stages > fitted.dkv_stages):
        return transposed
    return fitted


def _backward(q: Array, k: Array, v: Array, kmask: KernelMask, out: Array, lse: Array,
              dout: Array, dlse: Array, captured: Sequence[Array], *, layout: MaskLayout,
              scale: float, softcap: float | None, score_mod: ConvertedScoreMod | None,
              has_partial: bool, config: BackwardConfig, interpret_params: Any,
              fused_configs: tuple[BackwardConfig, BackwardConfig | None] | None,
              ) -> tuple[Array, Array, Array, Array]:
    """`attention_backward`; with ``fused_configs`` (`_fused_configs`), dQ from the dK/dV
    kernel: the FULL steps in one launch, the masked ones, if any, in a second."""
    batch, q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads, head_dim_v = k.shape[1], v.shape[2], v.shape[3]
    if (layout.block_q, layout.block_kv) != (config.block_q, config.block_kv):
        raise ValueError(f"mask tiles {(layout.block_q, layout.block_kv)} differ from the "
                         f"kernels' {(config.block_q, config.block_kv)}")
    dim, dim_v = padded_head_dims(head_dim, head_dim_v)
    if dim is None or dim_v is None:
        raise ValueError(f"head dims {head_dim}, {head_dim_v}: the kernels take at most "
                         f"{common.SUPPORTED_HEAD_DIMS[-1]}")

    delta = softmax_delta(out, dout, dlse)
    q_padded = layout.padded_q_len
    pad_q = lambda x, value: jnp.pad(x, ((0, 0), (0, 0), (0, q_padded - q_len)),
                                     constant_values=value)
    # P = exp2(s2 - lse2): rows that see no key (lse -inf) and padding rows get
    # lse2 = +inf, so their P is exactly 0 instead of NaN.
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * LOG2E)
    stats = jnp.stack([pad_q(lse2, jnp.inf), pad_q(delta, 0.0)], axis=2)  # [B, Hq, 2, Sq]

    pad = lambda x, d: common.pad_sequence(common.pad_last(x, d))
    q, k, v, do = pad(q, dim), pad(k, dim), pad(v, dim_v), pad(dout.astype(q.dtype), dim_v)
    with trace_time_eval(layout, kmask):  # constants when the mask is concrete
        dq_walk = common.packed_walk(kmask, "kv")
        dkv_walk = common.packed_walk(kmask, "q")
        q_leaves, kv_leaves, leaf_slots = common.stacked_leaves(kmask, layout, batch)
        partial_masks = kmask.partial_masks.astype(jnp.int8)
        partial_masks_kv_major = jnp.swapaxes(partial_masks, 1, 2)
        # The ordered dQ's walks carry each tile's add turn (`BackwardConfig.ordered_dq`).
        ranked_walk = (common.walk_lines(jnp.concatenate(
            [block_sparse.packed_walk(kmask, "q"),
             block_sparse.rotated_add_turns(kmask, ordered_dq_group(layout.num_kv_blocks))],
            axis=-1)) if fused_configs is not None and config.ordered_dq else None)
    interpret = interpret_params is not None
    scores, packed_captured = common.score_spec(scale, softcap, score_mod, captured)
    statics = _Statics(
        config=config, layout=layout, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=dim, head_dim_v=dim_v, dtype=q.dtype, scores=scores, has_partial=has_partial,
        dq_walk_lines=dq_walk.shape[-2], dkv_walk_lines=dkv_walk.shape[-2],
        mask_heads=dq_walk.shape[1], leaf_slots=leaf_slots,
        interpret=interpret)

    def operands(s: _Statics, walk, partial_tiles):
        extra = [partial_tiles] if s.has_partial else []
        leaves = (q_leaves, kv_leaves) if s.leaf_slots else ()
        return [q, k, v, do, stats, walk, *extra,
                *(x for x in (*leaves, packed_captured) if x is not None)]

    params = plgpu.CompilerParams(approx_math=True,
                                  unsafe_no_auto_barriers=not config.auto_barriers)

    def dkv_kernel(s: _Statics, *extra):
        shapes = {"dk": jax.ShapeDtypeStruct(k.shape, k.dtype),
                  "dv": jax.ShapeDtypeStruct(v.shape, v.dtype)}
        return (compat.mosaic_kernel_accumulating if s.fused_dq else compat.mosaic_kernel)(
            functools.partial(_dkv_kernel, s), tuple(shapes[name] for name in s.gradients),
            scratch_types=_dkv_scratch(s),
            # Blocks of one head side by side (the last axis varies fastest), sharing its
            # Q/dO in L2.
            grid=(batch * num_kv_heads, layout.num_kv_blocks),
            grid_names=("batch_head", "kv_block"), num_threads=s.dkv_consumers + 1,
            thread_name="wg", compiler_params=params, interpret=interpret_params,
        )(*operands(s, ranked_walk if s.orders_dq else dkv_walk, partial_masks_kv_major),
          *extra)

    def dq_kernel(s: _Statics):
        return compat.mosaic_kernel(
            functools.partial(_dq_kernel, s), jax.ShapeDtypeStruct(q.shape, q.dtype),
            scratch_types=_dq_scratch(s),
            grid=(batch * num_q_heads, layout.num_q_blocks),
            grid_names=("batch_head", "q_block"), num_threads=NUM_DQ_CONSUMERS + 1,
            thread_name="wg", compiler_params=params, interpret=interpret_params,
        )(*operands(s, dq_walk, partial_masks))

    unpad = lambda x, length, d: x[:, :length, :, :d]
    if fused_configs is None:
        if config.split_dkdv and not statics.paired:
            (dk,) = dkv_kernel(dataclasses.replace(statics, gradients=("dk",)))
            (dv,) = dkv_kernel(dataclasses.replace(statics, gradients=("dv",)))
        else:
            dk, dv = dkv_kernel(statics)
        dq = dq_kernel(statics)
        return (unpad(dq, q_len, head_dim), unpad(dk, kv_len, head_dim),
                unpad(dv, kv_len, head_dim_v), delta)
    # The first fused launch walks the FULL steps only, so it compiles no mask code
    # (which beside the fused dQ's state spills registers); the second, if the mask has
    # masked tiles, walks the rest and adds to the first's sums.
    full_config, masked_config = fused_configs
    if ranked_walk is not None:
        statics = dataclasses.replace(statics, dkv_walk_lines=ranked_walk.shape[-2])
    fused = dataclasses.replace(statics, config=full_config, fused_dq=True,
                                walk_part="full", has_partial=False, leaf_slots=())
    dq_sum = jnp.zeros((_dq_adders(fused), batch, q_padded, num_q_heads, dim), jnp.float32)
    (dk, dv), dq_sum = dkv_kernel(fused, dq_sum)
    if masked_config is not None:
        masked = dataclasses.replace(statics, config=masked_config, fused_dq=True,
                                     walk_part="masked")
        (dk, dv), dq_sum = dkv_kernel(masked, dk, dv, dq_sum)
    dq = dq_sum.sum(0) * scale if fused.folds_scale else dq_sum.sum(0)
    return (unpad(dq, q_len, head_dim).astype(q.dtype), unpad(dk, kv_len, head_dim),
            unpad(dv, kv_len, head_dim_v), delta)


def _dkv_scratch(s: _Statics):
    cfg = s.config
    captured_smem, captured_barrier = common.captured_scratch(s)
    stages, rows, consumers = cfg.dkv_stages, ROWS_PER_CONSUMER, s.dkv_consumers
    q_step = cfg.q_step
    kv_tiles = 1 if s.paired else consumers  # Paired consumers share their kv rows.
    smem = (
        common.swizzled((kv_tiles, rows, s.head_dim), s.dtype),
        common.swizzled((kv_tiles, rows, s.head_dim_v), s.dtype),
        plgpu.SMEM((s.dkv_walk_heads, s.dkv_walk_lines, common.WALK_LINE), jnp.int32),
        common.swizzled((stages, q_step, s.head_dim), s.dtype),
        common.swizzled((stages, q_step, s.head_dim_v), s.dtype),
        plgpu.SMEM((stages, 2, q_step), jnp.float32),
        common.swizzled((stages, cfg.block_kv, q_step), jnp.int8) if s.has_partial else None,
        plgpu.SMEM((stages, s.num_q_leaves, q_step), jnp.int32) if s.num_q_leaves else None,
        plgpu.SMEM((s.num_kv_leaves, cfg.block_kv), jnp.int32) if s.num_kv_leaves else None,
        # Interpreted only: P^T and dS^T staged in smem for their wgmmas.
        common.swizzled((2, consumers, rows, q_step), s.dtype) if s.interpret else None,
        captured_smem,
        # Fused dQ: dS^T tiles of two steps (read with K, so swizzled as K is); each
        # consumer's float32 dQ stage (interpreted, only the reducer's).
        (common.swizzled((2, consumers, rows, q_step), s.dtype,
                         common.swizzle_bytes(s.head_dim, s.dtype)) if s.fused_dq else None),
        # Swizzled: from the wgmma layout, a warp's stores to plain rows hit the same
        # banks 8 times over; unswizzled, the store and its fence took ~15% of dense
        # d128 fwd+bwd (benchmarks/RESULTS.md, 2026-12-08).
        (common.swizzled((consumers, *_dq_share(s)), jnp.float32)
         if s.fused_dq and (cfg.dq_reducer_warp or not s.interpret) else None),
        # Paired consumers: P^T (times the score slope) of two steps.
        common.swizzled((2, rows, q_step), s.dtype) if s.paired else None,
        # The q-major fused step: each consumer's P tile, read by its dV product.
        common.swizzled((consumers, q_step, rows), s.dtype) if s.q_major else None,
    )
    ring = lambda: plgpu.Barrier(num_barriers=stages)
    # A step's Q, statistics and dO signal one barrier (three arrivals): a consumer then
    # waits once a step rather than three times, each wait a shared-memory round trip
    # even when the data is there (fwd+bwd 2.6% faster at dense d128).
    loaded = plgpu.Barrier(num_arrivals=3, num_barriers=stages)
    reducer = s.fused_dq and cfg.dq_reducer_warp
    ds_barrier = (plgpu.Barrier(num_arrivals=consumers, num_barriers=2) if s.fused_dq
                  else None)
    barriers = (
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=consumers),
        plgpu.Barrier(num_barriers=consumers),
        loaded, ring(), ring(),
        plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),
        captured_barrier,
        ds_barrier,
        ds_barrier,
        # The reducer's (`BackwardConfig.dq_reducer_warp`): each consumer's dQ stage
        # filled, and read by its reduction.
        *(plgpu.Barrier(num_barriers=consumers) if reducer else None for _ in range(2)),
        # Paired consumers: P^T of each parity written, and read; each consumer's operand
        # (K, V) read for the last time.
        *(plgpu.Barrier(num_barriers=2) if s.paired else None for _ in range(3)),
    )
    return smem, barriers


def _dq_adders(s: _Statics) -> int:
    """Partial dQ sums of the fused backward, added in order afterwards. Compiled, one
    (TMA reductions are atomic), or ordered one a group of kv-blocks (`ordered_dq_groups`).
    Interpreted, a read-modify-write stands in for them, which would race where two
    writers add to the same elements: each kv-block's CTA then has a sum of its own (the
    interpreter of jax 0.11 and later reports the adds of two CTAs as racing); its
    consumers add disjoint parts (`_dq_share`)."""
    if s.interpret:
        return s.layout.num_kv_blocks
    return ordered_dq_groups(s.layout.num_kv_blocks) if s.orders_dq else 1


def _dq_adder(s: _Statics, kv_block):
    """The partial dQ sum (`_dq_adders`) ``kv_block``'s CTA adds to."""
    if s.interpret:
        return kv_block
    return lax.div(kv_block, s.dq_group) if s.orders_dq else 0


def fused_dq_splits(head_dim: int, consumers: int, q_step: int = ROWS_PER_CONSUMER) -> bool:
    """Whether the fused dQ can serve a (padded) query-key head dim.

    With 64-row steps each dK/dV consumer adds whole 64-column tiles of K's columns,
    over all of the CTA's kv rows (or one consumer adds all). Where the columns do not
    split (64 or 96 between two consumers) both consumers would add every column over
    their own kv rows, twice the reductions: H100, 2026-11-27 (benchmarks/RESULTS.md),
    query-key 96 / value 128 fwd+bwd 13% slower than with the dQ kernel, query-key 64 /
    value 128 even. With 128-row steps the two consumers split the step's rows instead,
    which serves head dim 64: above it, a consumer's 64 x 128 float32 S^T and dP^T
    beside wider dK and dV exceed its registers.
    """
    if q_step == BLOCK_Q:
        return head_dim <= ROW_SPLIT_MAX_HEAD_DIM
    return consumers == 1 or head_dim // consumers >= 64


def _dq_share(s: _Statics) -> tuple[int, int]:
    """(rows, columns) of the dQ tile a dK/dV consumer adds per step (`fused_dq_splits`):
    64 of a 128-row step's rows, or a 64-row step's share of the columns."""
    cfg = s.config
    if cfg.q_step == BLOCK_Q:
        return cfg.q_step // cfg.dkv_consumers, s.head_dim
    return cfg.q_step, s.head_dim // cfg.dkv_consumers


def _dq_scratch(s: _Statics):
    cfg = s.config
    captured_smem, captured_barrier = common.captured_scratch(s)
    stages, rows, consumers = cfg.dq_stages, ROWS_PER_CONSUMER, NUM_DQ_CONSUMERS
    smem = (
        common.swizzled((consumers, rows, s.head_dim), s.dtype),
        common.swizzled((consumers, rows, s.head_dim_v), s.dtype),
        plgpu.SMEM((consumers, 2, rows), jnp.float32),
        plgpu.SMEM((s.dq_walk_lines, common.WALK_LINE), jnp.int32),
        common.swizzled((stages, cfg.block_kv, s.head_dim), s.dtype),
        common.swizzled((stages, cfg.block_kv, s.head_dim_v), s.dtype),
        common.swizzled((stages, BLOCK_Q, cfg.block_kv), jnp.int8) if s.has_partial else None,
        plgpu.SMEM((s.num_q_leaves, BLOCK_Q), jnp.int32) if s.num_q_leaves else None,
        (plgpu.SMEM((stages, s.num_kv_leaves, cfg.block_kv), jnp.int32)
         if s.num_kv_leaves else None),
        # Interpreted only: dS staged in smem for the dS @ K wgmma.
        common.swizzled((consumers, rows, cfg.block_kv), s.dtype) if s.interpret else None,
        captured_smem,
    )
    ring = lambda: plgpu.Barrier(num_barriers=stages)
    consumed = plgpu.Barrier(num_arrivals=consumers, num_barriers=stages)
    barriers = (
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=consumers),
        plgpu.Barrier(num_barriers=consumers),
        plgpu.Barrier(num_barriers=consumers),
        ring(), ring(), ring(), ring(),
        consumed, consumed,
        captured_barrier,
    )
    return smem, barriers
