"""Block-sparse attention forward for Hopper (sm90) in Pallas Mosaic-GPU.

One CTA computes ``ForwardConfig.q_blocks_per_cta`` row blocks of one (batch, q head)
in turn, each of ``ForwardConfig.cta_rows`` = 64 x ``num_consumers`` rows: with two
consumers (the default) a ``block_q = 128``-row BlockMask q-block, with three (dense
head dim 64, FA3's 192-row tile) one and a half q-blocks. Its warpgroups:

* the last warpgroup (producer, few registers) walks the row block's active kv-blocks
  from the shared mask walker (`pallas_kernels.block_sparse`) and TMA-loads K
  and V (plus, when the mask needs them, the kv-block's mask leaves, which a paged
  call's producer computes instead, and its stored PARTIAL tile) into a ring of
  ``num_stages`` shared-memory slots. A slot's K (V) is refilled only after every
  consumer arrived on its K (V) "consumed" barrier. MASKED tiles are never loaded at
  all. A 192-row block spans two q-blocks: it is served only where every q-block walks
  the same FULL kv-blocks (`uniform_full_walks`: a mask known at trace time, with no
  mask data), and takes the walk of the q-block holding its first row;
* warpgroups 0 .. num_consumers - 1 (consumers) each own 64 of the rows: Q once by TMA
  (at head dim 64 then held in registers, ``ForwardConfig.q_in_registers``),
  then per kv-block ``S = Q K^T`` by wgmma, the tile's mask (none for FULL
  tiles, which the walk lists first and a loop without mask code takes;
  indices and mask leaves for COMPUTED tiles; the stored tile for PARTIAL
  ones), online softmax in registers (base 2, running max kept in
  log2 units) and ``O += P V`` by wgmma. Output goes registers -> smem -> TMA
  store (the hardware clips rows past ``q_len``), lse likewise. A consumer whose rows
  all lie past ``q_len`` (a decoding step's few packed rows leave the second one none)
  computes nothing and releases each tile as it lands, so that the ring refills at
  the pace of those that compute (pipelined schedule, no stored tiles). With three consumers
  each SM sub-partition runs three consumer warps, so that one's exp2 and max latency
  hides under the others' work, and each K/V tile loaded serves 192 rows; registers
  are 24 a producer thread and 160 a consumer thread (40 and 232 with two).

Across the q-blocks of a CTA the kv ring runs on (ring step = the CTA's kv steps
so far), and each q-block's walk and q leaves have one of two buffers, so the
producer fetches the next q-block's walk and first K/V blocks while the
consumers finish the current one; each consumer loads its next Q into a second
buffer as it starts a q-block (when shared memory has room, else after its
output store). Within a head the q-blocks go heaviest first (one per CTA) or
heaviest and lightest alternating (several per CTA: even pairs under causal).
With ``ForwardConfig.kv_splits`` > 1 (calls with fewer q-blocks than SMs, decoding
steps above all), that many CTAs share each q-block, each walking an even share of
its kv-blocks and writing its own output and lse, which the wrapper combines.

Two consumer schedules (`ForwardConfig.pipelined`):

* pipelined (the default but at causal head dim 64): software-pipelined by one kv
  step. A consumer issues step i's ``QK^T`` and step i-1's ``P V`` back to
  back, waits for S only, and runs step i's softmax while its ``P V`` is in
  flight (FA3's intra-warpgroup overlap); O lives in a wgmma accumulator
  throughout. The consumers interleave on the tensor cores without a
  ping-pong barrier (measured: the barrier costs 4-7% here); ``staggered``
  (d64 and d128), each consumer c > 0 starts once consumer c - 1 has its first S,
  once per CTA (a barrier per consumer but the last), so that its QK^T runs under
  consumer c - 1's softmax from the first step on;
* serial (the default at causal head dim 64; two consumers only): ``QK^T``,
  softmax, ``P V`` in turn, the consumers ping-ponging on a barrier so that
  one's softmax runs under the other's matmuls.

K/V are keyed by the kv head ``h // group_size`` (GQA/MQA). Sequence tails
need no padding: TMA reads past ``kv_len`` as zeros and the ragged last
kv-block is COMPUTED, so its keys past ``kv_len`` are masked. Head dims are
zero-padded to 64, 128 or 256 by the wrapper. Sinks are folded in after the
kernel (they only change the normaliser).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat, kv_splits
from pallas_kernels.block_sparse import KernelMask, MaskLayout
from pallas_kernels.mosaic import attention_sm90_common as common
from pallas_kernels.mosaic.attention_sm90_common import (
    BLOCK_Q,
    LN2,
    LOG2E,
    ROWS_PER_CONSUMER,
    SUPPORTED_HEAD_DIMS,
    padded_head_dim,
    padded_head_dims,
)
from pallas_kernels.paged import PagedWalk, walk_seeds
from pallas_kernels.score_pipeline import ConvertedScoreMod
from pallas_kernels.tile_classes import trace_time_eval

Array = Any

# set_max_registers per consumer count: (producer, consumer). The CTA's 128 x (consumers
# + 1) threads share an SM's 65536 registers.
_REGISTERS = {2: (40, 232), 3: (24, 160)}
__all__ = ["BLOCK_Q", "SUPPORTED_HEAD_DIMS", "ForwardConfig", "attention_forward",
           "forward_config", "padded_head_dim", "padded_head_dims", "smem_bytes",
           "uniform_full_walks"]


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Tiling of the forward kernel; ``block_q`` x ``block_kv`` is also the BlockMask tile."""

    block_kv: int
    num_stages: int
    # True: each consumer issues step i's QK^T and step i - 1's P @ V back to back and
    # runs step i's softmax while that P @ V is in flight (intra-warpgroup overlap).
    # False: QK^T, softmax, P @ V in turn, the consumers ping-ponging on the tensor
    # cores (one's softmax under the other's matmuls).
    pipelined: bool = False
    # q-blocks of one head that a CTA computes in turn. While a CTA finishes one,
    # its producer already fetches the next one's walk and first K/V blocks and
    # its consumers the next Q, so the fixed costs of a CTA (launch, first
    # loads, output store) are paid once per q_blocks_per_cta q-blocks; they
    # weigh most on short walks (causal, windows, documents).
    q_blocks_per_cta: int = 1
    # Pipelined only (the serial schedule's consumers take turns anyway): consumer 1
    # starts once consumer 0's first S is in, so that its QK^T runs under consumer 0's
    # softmax. The ring keeps that half-step offset for the rest of the CTA; without it
    # the consumers run in step and the tensor cores idle while both are in softmax.
    staggered: bool = False
    # Each consumer loads its Q tile into registers once per q-block and issues QK^T with
    # Q as the register operand: every kv step then reads K alone from shared memory
    # instead of Q and K (a quarter less shared-memory traffic per step at 128 x 128),
    # for head_dim / 4 more registers per thread. Compiled only (the interpreter takes
    # wgmma operands from shared memory).
    q_in_registers: bool = False
    # CTAs per q-block, each walking an even share of its kv-blocks and writing its own
    # output and lse, which the wrapper combines (split-KV, "flash decoding"): for calls
    # with fewer q-blocks than SMs and long walks, decoding steps above all.
    kv_splits: int = 1
    # Consumer warpgroups, 64 query rows each: a CTA computes ``cta_rows`` = 64 x
    # num_consumers rows. Three (192 rows, FA3's tile at head dim 64) let each K/V tile
    # serve 192 rows and give each SM sub-partition a third consumer warp to hide the
    # softmax's MUFU latency behind; a CTA then spans one and a half BlockMask q-blocks,
    # so only masks whose q-blocks all walk the same FULL kv-blocks (`uniform_full_walks`)
    # and only the pipelined schedule, at head dim 64 with kv tiles of at most 128 rows
    # (160 registers a consumer thread), one q-block per CTA and no kv splits: the kernel
    # checks at trace time (a config is not refused on its own, so that fields forced on
    # `forward_config` for A/B runs apply to every config it makes).
    num_consumers: int = 2
    # Without kv splits, the CTAs launch in sections of heads that fill one wave of the
    # SMs, each section rank by rank, longest walks first, rather than head by head
    # (`attention_sm90_common.sectioned_launch`). H100, 2026-12-07 (benchmarks/
    # RESULTS.md): causal d128 forward 4-8% faster at s4096 and s8192, dense even.
    sectioned_launch: bool = True
    block_q: int = BLOCK_Q

    @property
    def cta_rows(self) -> int:
        """Query rows of one CTA (at a time): a q-block with two consumers."""
        return self.num_consumers * ROWS_PER_CONSUMER

    def __post_init__(self):
        if self.block_q != BLOCK_Q:
            raise ValueError(f"block_q must be {BLOCK_Q}, got {self.block_q}")
        if self.q_blocks_per_cta < 1:
            raise ValueError(f"q_blocks_per_cta must be at least 1, got {self.q_blocks_per_cta}")
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"block_kv must be 64, 128, 192 or 256, got {self.block_kv}")
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be at least 2, got {self.num_stages}")
        if self.kv_splits < 1 or (self.kv_splits > 1 and self.q_blocks_per_cta != 1):
            raise ValueError(f"kv_splits must be 1, or above 1 with q_blocks_per_cta=1; got "
                             f"kv_splits={self.kv_splits}, q_blocks_per_cta="
                             f"{self.q_blocks_per_cta}")
        if self.num_consumers not in _REGISTERS:
            raise ValueError(f"num_consumers must be one of {tuple(_REGISTERS)}, got "
                             f"{self.num_consumers}")


# Per (padded head_dim, dtype, causal). Shared memory per CTA: Q/O 128 x D plus
# num_stages x block_kv x (D + Dv), within the 227 KiB of an H100 SM.
# The schedule per head dim (H100, benchmarks/RESULTS.md):
# * 64, causal: serial. The softmax outweighs the matmuls; pipelined and staggered
#   measured 0.92-0.97x cuDNN against 1.05x. Four q-blocks per CTA: a d64 kv step is
#   short, so a CTA's fixed costs weigh more (0.90-0.92x -> 1.01-1.05x). Q in registers
#   (see below): 3% faster on the H100 in short and sustained samples (2026-11-26).
# * 64, not causal: pipelined and staggered: 1.06x cuDNN against serial's 0.96x
#   (2026-11-24 20:55; unstaggered pipelined had lost, 0.83-0.90x). Q in registers: 2-5%
#   faster (H100 and H200, 2026-11-26); at head dim 128 it lost 1-8%, at 256 (64 more
#   registers a thread) 40%. One q-block per CTA: 4% faster than two on the H200 (dense
#   b4 s4096 and b1 s16384, 2026-11-28 15:55, benchmarks/RESULTS.md); four lost 4-5%.
# * 128 and 256: pipelined, ahead of serial in every case of the 2026-11-24 A/B run
#   (d128 1.03-1.08x cuDNN against 0.93-1.02x; d256 1.09-1.10x against 0.93-0.95x).
#   One q-block per CTA: several measured within the noise at d128 dense and causal
#   and 4-6% slower on documents; masks with short walks take two (`SHORT_WALK`).
#   Staggered at d128 (2-4% faster dense and causal up to s16384, 8% on the window, 9%
#   with ALiBi, 1% slower on documents); not at d256, where it lost 13% dense.
# * 96: served natively (rows of 192 bytes in a 64-byte swizzle) instead of padded to
#   128; it takes d128's config, not tuned on its own. 192 (DeepSeek's query-key head
#   dim) likewise takes d256's instead of padding to 256: 1.08x cuDNN dense and causal
#   at b4 s4096 (2026-11-27 10:50-10:57); of six variants only two q-blocks per CTA
#   gained (2-4%, causal only). Causal 192 and 256 take two q-blocks per CTA: at b4
#   s4096, d192 2-4% faster in three A/B runs of five, even in one, 6% slower in one
#   whose timings (cuDNN's too) were 8-25% off the other runs'; d256 1-3% faster in
#   three of three (2026-11-27); dense d192 lost 2%.
_CONFIGS = {
    (64, False): ForwardConfig(block_kv=128, num_stages=3, pipelined=True, staggered=True,
                               q_in_registers=True),
    (64, True): ForwardConfig(block_kv=128, num_stages=3, pipelined=False,
                              q_blocks_per_cta=4, q_in_registers=True),
    (128, False): ForwardConfig(block_kv=128, num_stages=2, pipelined=True, staggered=True),
    (128, True): ForwardConfig(block_kv=128, num_stages=2, pipelined=True, staggered=True),
    (256, False): ForwardConfig(block_kv=64, num_stages=2, pipelined=True),
    (256, True): ForwardConfig(block_kv=64, num_stages=2, pipelined=True, q_blocks_per_cta=2),
}
_CONFIGS |= {(dim, causal): _CONFIGS[(tuned, causal)]  # see "96" above
             for dim, tuned in ((96, 128), (192, 256)) for causal in (False, True)}


# Masks whose q-blocks walk at most this many kv-blocks on average (a sliding window of
# 1024 keys: 9-10) take two q-blocks per CTA up to head dim 128 (where the config takes
# one: dense 64, as until 2026-11-28, and 96 and 128): a CTA's fixed cost,
# several kv steps, then weighs more than pairing the q-blocks loses. H100, head dim 128,
# 2026-11-25 16:51-17:00 (benchmarks/RESULTS.md): window 3.5-7% and causal s2048 (8.5
# steps) 4% faster, causal s1024 (4.5) 2% slower; at 16.5 steps (causal s4096) even,
# beyond that slower (causal documents, 23 steps: 4%; documents, 45: 1-2%).
SHORT_WALK = 12

# Dense head dim 64 (masks with `uniform_full_walks`) takes three consumers, FA3's and
# FA4's tile: the two-consumer kernel measured latency-bound on the H200 (b4 s4096 h16,
# 2026-11-28: 2186 cycles a kv step against 1088 of exp2 and 1024 of tensor work, the
# consumers stalled on exp2 and max dependencies), and longer kv tiles, more stages, Q
# from smem and the serial schedule were all 7-16% slower. Three consumers keep Q in
# shared memory (160 registers a consumer thread): H200, 2026-11-28 23:50, b4 s4096 /
# b1 s16384 dense d64 forward 0.594 / 2.257 ms, against 0.704 / 2.463 with Q in registers
# (benchmarks/RESULTS.md).
THREE_CONSUMER_HEAD_DIMS = (64,)


def forward_config(head_dim: int, dtype: Any, causal: bool,
                   mean_walk: float | None = None,
                   uniform_walks: bool = False) -> ForwardConfig:
    """The tuned config for a (padded) head dim; bf16 and fp16 share one table.

    ``mean_walk``: the mask's mean count of active kv-blocks per q-block, when known
    at trace time (a concrete mask); short walks get several q-blocks per CTA.
    ``uniform_walks``: the mask's q-blocks all walk the same FULL kv-blocks
    (`uniform_full_walks`), which lets CTAs of three consumers span q-blocks.
    """
    del dtype  # Same tile sizes for both 16-bit types.
    dim = padded_head_dim(head_dim)
    config = _CONFIGS[(dim, bool(causal))]
    if uniform_walks and not causal and dim in THREE_CONSUMER_HEAD_DIMS:
        return dataclasses.replace(config, num_consumers=3, q_in_registers=False)
    short_walks = mean_walk is not None and mean_walk <= SHORT_WALK
    if short_walks and dim <= 128 and config.q_blocks_per_cta == 1:
        config = dataclasses.replace(config, q_blocks_per_cta=2)
    return config


def uniform_full_walks(kmask: KernelMask, layout: MaskLayout, has_partial: bool) -> bool:
    """Whether, known at trace time, every q-block of each (batch, head) walks the same
    kv-blocks, all FULL, with no mask data (stored tiles, mask_mod leaves): then any
    q-block's walk serves a CTA whose rows span several (`ForwardConfig.num_consumers`)."""
    arrays = (kmask.kv_num_blocks, kmask.kv_num_full, kmask.kv_indices)
    if (has_partial or layout.mask_mod_treedef is not None or layout.ragged_kv
            or any(isinstance(x, jax.core.Tracer) for x in arrays)):
        return False
    count, num_full, indices = map(np.asarray, arrays)
    return bool((num_full == count).all() and (count == count[..., :1]).all()
                and (indices == indices[..., :1, :]).all())


def q_buffers(config: ForwardConfig, head_dim: int, head_dim_v: int, itemsize: int,
              has_partial: bool, pages_per_seq: int = 0, walk_blocks: int = 0) -> int:
    """Q buffers per consumer: two (the next q-block's Q loads under the current one)
    when a CTA computes several q-blocks and shared memory has room, else one."""
    if config.q_blocks_per_cta > 1 and smem_bytes(
            config, head_dim, head_dim_v, itemsize, has_partial, 2,
            pages_per_seq=pages_per_seq, walk_blocks=walk_blocks) <= common.SMEM_LIMIT:
        return 2
    return 1


def smem_bytes(config: ForwardConfig, head_dim: int, head_dim_v: int, itemsize: int,
               has_partial: bool, num_q_buffers: int = 1, pages_per_seq: int = 0,
               walk_blocks: int = 0) -> int:
    """Shared memory of one CTA (the producer's ring dominates; paged K/V add the
    sequence's page table row of ``pages_per_seq`` ids; the two walk buffers hold rows
    over ``walk_blocks`` kv-blocks)."""
    qo = config.cta_rows * (num_q_buffers * head_dim
                           + (head_dim_v if head_dim_v != head_dim else 0)) * itemsize
    ring = config.num_stages * config.block_kv * (head_dim + head_dim_v) * itemsize
    if has_partial:
        ring += config.num_stages * config.block_q * config.block_kv  # int8 tiles
    walks = 2 * common.walk_row_bytes(walk_blocks)
    return qo + ring + walks + table_lines(pages_per_seq) * common.WALK_LINE * 4


def table_lines(pages_per_seq: int) -> int:
    """Lines of `common.WALK_LINE` ids holding a page table row (one TMA box each way)."""
    return -(-pages_per_seq // common.WALK_LINE)


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
    num_q_buffers: int
    # For each mask_mod leaf, in leaf order: ("q" | "kv", row in its stacked leaf array).
    leaf_slots: tuple[tuple[str, int], ...]
    interpret: bool
    q_len: int
    num_row_blocks: int  # Of ``config.cta_rows`` query rows (q-blocks with two consumers).
    # Paged K/V (`attention_forward`'s page_table): tokens per page, and the page
    # table row's lines of `common.WALK_LINE` ids; None and 0 for contiguous K/V.
    page_size: int | None = None
    table_lines: int = 0
    # Q and O as [B, H, Sq, D] (`attention_forward`'s heads_first), else [B, Sq, H, D].
    heads_first: bool = False
    # A paged call's walks in closed form (`attention_forward`'s paged_walk).
    paged_walk: PagedWalk | None = None

    @property
    def kv_leaves_computed(self) -> bool:
        """Whether the producer computes the kv leaf (a paged call's key lengths, from
        `attention_forward`'s kv_lens, which come with paged_walk)."""
        return self.paged_walk is not None


def _kernel(statics: _Statics, q_ref, k_ref, v_ref, walk_ref, *refs):
    s = statics
    cfg = s.config
    rows, block_kv, stages = ROWS_PER_CONSUMER, cfg.block_kv, cfg.num_stages
    table_ref, refs = (refs[0], refs[1:]) if s.page_size is not None else (None, refs)
    partial_ref, q_leaf_ref, kv_leaf_ref, captured_ref, refs = common.split_optional_refs(
        refs, s)
    out_ref, lse_ref, smem, barriers = refs
    (q_smem, o_only_smem, lse_smem, walk_smem, k_smem, v_smem, mask_smem, q_leaf_smem,
     kv_leaf_smem, p_staging, captured_smem, table_smem) = smem
    (walk_barriers, q_leaf_barriers, q_barriers, k_barriers, v_barriers, mask_barriers,
     kv_leaf_barriers, k_consumed, v_consumed, q_block_done, schedule,
     captured_barrier, table_barrier) = barriers

    # This CTA computes the row blocks (of cta_rows: its q-blocks with two consumers) at
    # positions first .. first + blocks_here - 1 of its head's launch order, in turn.
    # Per row block i, its walk and q leaves sit in buffer i % 2, released by every
    # consumer on q_block_done[i % 2] when done. With kv_splits, consecutive CTAs take
    # the shares of one head's walks.
    splits = cfg.kv_splits
    per_cta, consumers, cta_rows = cfg.q_blocks_per_cta, cfg.num_consumers, cfg.cta_rows
    num_ctas = pl.cdiv(s.num_row_blocks, per_cta)
    program, cta = common.sectioned_launch(
        "q_blocks", q_ref.shape[0] * s.num_q_heads * splits, num_ctas,
        sections=cfg.sectioned_launch and splits == 1)
    split = lax.rem(program, splits)
    batch, head, kv_head = common.head_program(s, lax.div(program, splits))
    first = cta * per_cta
    blocks_here = jnp.minimum(per_cta, s.num_row_blocks - first)

    def row_block_of(i):
        return common.q_block_at(s.num_row_blocks, first + i, interleaved=per_cta > 1)

    # Consumers whose rows may all lie past q_len skip their walk (`release_walk`): in
    # the pipelined schedule (the serial one's consumers take turns) without stored mask
    # tiles (their loads follow the walk's flags).
    skips_rows_past_end = (cfg.pipelined and not s.has_partial
                           and s.num_row_blocks * cta_rows - s.q_len >= rows)

    def walk_q_block(row_block):
        """The q-block whose walk a row block takes: its own with two consumers; else
        (all walks alike) the one holding its first row."""
        if cta_rows == cfg.block_q:
            return row_block
        return lax.div(row_block * cta_rows, cfg.block_q)

    wg = lax.axis_index("wg")

    def q_block_walk(walk_smem, i):
        """Row block ``i``'s walk, once its buffer landed: as loaded, or for a paged call
        computed from its sequence's length and page check (`PagedWalk`), which the
        buffer holds instead."""
        q_block = walk_q_block(row_block_of(i))
        if s.paged_walk is None:
            return common.SmemWalk(walk_smem, s.layout.num_kv_blocks)
        return s.paged_walk.steps(walk_smem[0, 0], walk_smem[0, 1], q_block)

    def head_rows(ref, q_start):
        """This CTA's ``ROWS_PER_CONSUMER`` rows of Q or O from ``q_start`` in ``ref``."""
        sequence = pl.ds(q_start, rows)
        return ref.at[batch, head, sequence] if s.heads_first else ref.at[batch, sequence, head]

    def split_of(walk_count, walk_num_full):
        """(first walk position, steps, FULL steps) of this CTA's share of a walk."""
        return kv_splits.share(walk_count, walk_num_full, split, splits)

    producer_registers, consumer_registers = _REGISTERS[consumers]

    @pl.when(wg == consumers)
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")
        common.load_captured(s, captured_ref, captured_smem, captured_barrier)
        pages = None
        if s.page_size is not None:
            # The sequence's page table row, read by this warpgroup alone (a row shorter
            # than a line fills the line's start: the ids past it are never used unclamped).
            # Awaited with the first walk, whose load runs beside it: a short decoding
            # CTA pays one round trip to global memory before its first K/V load, not two.
            plgpu.copy_gmem_to_smem(table_ref.at[batch],
                                    table_smem.at[:, :table_ref.shape[2]], table_barrier)
            pages = (table_smem, s.page_size)

        def q_block_loads(i, first_step):
            buffer = lax.rem(i, 2)

            @pl.when(i >= 2)
            def _():
                plgpu.barrier_wait(q_block_done.at[buffer])
                # This warpgroup read row block i - 2's walk from the buffer (generic
                # proxy) that the TMA now overwrites (async proxy): a proxy fence orders
                # those reads first (the jax 0.12 interpreter's race check).
                plgpu.commit_smem()

            common.load_q_block_walk(
                s, walk_ref, walk_smem.at[buffer], walk_barriers.at[buffer],
                ((q_leaf_ref, q_leaf_smem.at[buffer], q_leaf_barriers.at[buffer])
                 if s.num_q_leaves else None),
                batch=batch, head=head,
                q_block=0 if s.paged_walk else walk_q_block(row_block_of(i)),
                block_q=cfg.block_q)
            walk = q_block_walk(walk_smem.at[buffer], i)
            if pages is not None:
                pl.when(i == 0)(lambda: plgpu.barrier_wait(table_barrier))
            # A paged walk's buffer holds its sequence's length (`attention_forward`).
            length = walk_smem.at[buffer][0, 0] if s.kv_leaves_computed else None
            begin, count, _ = split_of(walk.count, walk.count)
            common.produce_kv_blocks(
                walk, count, stages=stages, block_kv=block_kv, batch=batch,
                kv_head=kv_head, begin=begin, k=(k_ref, k_smem, k_barriers),
                v=(v_ref, v_smem, v_barriers), consumed=(k_consumed, v_consumed),
                interpret=s.interpret,
                kv_leaves=((kv_leaf_ref, kv_leaf_smem, kv_leaf_barriers)
                           if s.num_kv_leaves else None),
                partial=(partial_ref, mask_smem, mask_barriers) if s.has_partial else None,
                first_step=first_step, pages=pages, key_lens=length)
            return first_step + count

        ring_steps = lax.fori_loop(0, blocks_here, q_block_loads, jnp.int32(0))
        common.drain_ring(ring_steps, stages, k_consumed, v_consumed)

        # Observe the consumers' release of the last two buffers too (the interpreter
        # requires every phase of a barrier to be waited for).
        @pl.loop(jnp.maximum(blocks_here - 2, 0), blocks_here)
        def _(i):
            plgpu.barrier_wait(q_block_done.at[lax.rem(i, 2)])

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        row_layout = compat.wgmma_row_layout()
        tile = (rows, block_kv)
        # Plain scores stay raw until the softmax, which folds the scale into the
        # exp2 argument (one FMA per score); the row max is scaled per row.
        fold_scale = s.scores.folds_scale

        def to_log2(x):
            return x * (s.scores.scale * LOG2E) if fold_scale else x

        def q_buffer(i):
            buffer = lax.rem(i, s.num_q_buffers)
            return q_smem.at[buffer, wg], q_barriers.at[buffer * consumers + wg]

        def load_q(i):
            q_start = row_block_of(i) * cta_rows + wg * rows
            plgpu.copy_gmem_to_smem(head_rows(q_ref, q_start), *q_buffer(i))

        def load_next_q(i):
            @pl.when(i + 1 < blocks_here)
            def _():
                load_q(i + 1)

        def compute_q_block(i, first_step):
            buffer = lax.rem(i, 2)
            q_start = row_block_of(i) * cta_rows + wg * rows
            if s.num_q_buffers == 2:
                # Its buffer held Q and O of q-block i - 1, whose store has read it.
                load_next_q(i)

            # Index tiles are built where needed, never kept live across the loop.
            def indices(kv_block, read):
                return common.tile_indices(tile, q_start, kv_block * block_kv, q_axis=0,
                                           read=read)

            q_leaf_rows = []
            if s.num_q_leaves:
                plgpu.barrier_wait(q_leaf_barriers.at[buffer])
                for leaf in range(s.num_q_leaves):
                    q_leaf_rows.append(compat.mosaic_load(
                        q_leaf_smem.at[buffer, leaf, pl.ds(wg * rows, rows)], row_layout,
                        interpret=s.interpret))
            plgpu.barrier_wait(walk_barriers.at[buffer])
            walk = q_block_walk(walk_smem.at[buffer], i)
            begin, count, num_full = split_of(walk.count, walk.num_full)
            walk_steps, rows_past_end = count, None
            if skips_rows_past_end:
                # A consumer whose rows all lie past q_len (in the last row block: a
                # decoding step's packed rows fill one consumer's) computes nothing and
                # only releases each tile once loaded (`release_walk`), so that the ring
                # refills at the pace of the consumers that compute.
                rows_past_end = q_start >= s.q_len
                count, num_full = (jnp.where(rows_past_end, 0, x) for x in (count, num_full))
            q_tile, q_loaded = q_buffer(i)
            plgpu.barrier_wait(q_loaded)
            q_operand = (compat.mosaic_load(q_tile, plgpu.Layout.WGMMA, interpret=False)
                         if cfg.q_in_registers and not s.interpret else q_tile)

            def softmax(scores, step, row_max, row_sum, full: bool):
                """(P in float32, alpha, new max, new sum) of the step's raw scores."""
                slot = lax.rem(first_step + step, stages)
                kv_block = walk.index(begin + step)
                if not fold_scale:
                    scores = common.log2_scores(score_spec, scores, batch, head,
                                                functools.partial(indices, kv_block))
                kv_leaf_columns = common.load_kv_leaf_columns(s, kv_leaf_smem,
                                                              kv_leaf_barriers, slot)
                if not full:
                    partial = ((mask_smem.at[slot, pl.ds(wg * rows, rows)],
                                mask_barriers.at[slot]) if s.has_partial else None)
                    flags = walk.flags(begin + step)
                    scores = common.masked_q_major_scores(s, scores, flags,
                                                          functools.partial(indices, kv_block),
                                                          q_leaf_rows, kv_leaf_columns, partial)
                new_max = jnp.maximum(row_max, to_log2(scores.max(axis=1)))
                # Rows that have seen no visible key yet keep max -inf: shift by 0 there.
                shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
                alpha = jnp.exp2(row_max - shift)
                probs = jnp.exp2(to_log2(scores) - lax.broadcast_in_dim(shift, tile, [0]))
                row_sum = row_sum * alpha + probs.sum(axis=1)
                return probs, alpha, new_max, row_sum

            consumer = _Consumer(
                statics=s, wg=wg, q=q_operand, k_smem=k_smem, v_smem=v_smem,
                k_barriers=k_barriers, v_barriers=v_barriers, k_consumed=k_consumed,
                v_consumed=v_consumed, schedule=schedule, p_staging=p_staging,
                first_step=first_step, count=count, num_full=num_full, softmax=softmax,
                first_q_block=i == 0)
            if cfg.pipelined:
                acc, row_max, row_sum = _pipelined_steps(consumer)
            else:
                acc, row_max, row_sum = _serial_steps(consumer)
            if rows_past_end is not None:
                # After its (empty) steps, which let the next consumer start.
                pl.when(rows_past_end)(functools.partial(release_walk, first_step, walk_steps))

            seen = row_sum > 0
            safe_sum = jnp.where(seen, row_sum, 1.0)
            inverse = jnp.where(seen, 1.0 / safe_sum, 0.0)
            out = acc * lax.broadcast_in_dim(inverse, acc.shape, [0])
            lse = jnp.where(seen, row_max * LN2 + jnp.log(safe_sum), -jnp.inf)
            # The output reuses Q's buffer when the head dims agree (Q is no longer read).
            o_smem = q_tile if o_only_smem is None else o_only_smem.at[wg]
            o_smem[...] = out.astype(s.dtype)
            lse_smem.at[wg][...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, head_rows(out_ref.at[split], q_start))
            plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                                    lse_ref.at[split, batch, head, pl.ds(q_start, rows)])
            # The stores have read O and lse: their buffers (and this q-block's walk and
            # q leaves) may be refilled.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(q_block_done.at[buffer])
            if s.num_q_buffers == 1:
                load_next_q(i)
            return first_step + walk_steps

        def release_walk(first_step, walk_steps):
            """Each K and V tile of the walk released once loaded: the waits keep the
            arrivals one per tile (the ring refills a slot only after every consumer
            released it)."""
            @pl.loop(0, walk_steps)
            def _(step):
                slot = lax.rem(first_step + step, stages)
                if s.num_kv_leaves:
                    plgpu.barrier_wait(kv_leaf_barriers.at[slot])
                for loaded, consumed in ((k_barriers, k_consumed), (v_barriers, v_consumed)):
                    plgpu.barrier_wait(loaded.at[slot])
                    plgpu.barrier_arrive(consumed.at[slot])

        load_q(0)
        common.wait_captured(s, captured_barrier)
        score_spec = common.with_captured_read(s.scores, captured_smem, batch, head)
        # Each q-block's stores were awaited until they had read shared memory; the CTA
        # exits without waiting for their writes, so that the SM's next CTA starts sooner.
        lax.fori_loop(0, blocks_here, compute_q_block, jnp.int32(0))


@dataclasses.dataclass(frozen=True)
class _Consumer:
    """What a consumer warpgroup's kv loop needs (refs, its walk, its softmax)."""

    statics: _Statics
    wg: Array
    q: Any  # The Q tile: its smem ref, or its registers (`ForwardConfig.q_in_registers`).
    k_smem: Any
    v_smem: Any
    k_barriers: Any
    v_barriers: Any
    k_consumed: Any
    v_consumed: Any
    # The serial schedule's ping-pong barrier; pipelined, the stagger barriers (consumer
    # c + 1 waits on barrier c; or None).
    schedule: Any
    p_staging: Any  # Interpreted only: P staged in smem for the P @ V wgmma.
    first_step: Array  # The ring step of the q-block's first kv-block.
    count: Array  # Active kv-blocks of the q-block...
    num_full: Array  # ...the first num_full of them FULL.
    # (raw scores, step, row max, row sum, full) -> (P float32, alpha, max, sum).
    softmax: Callable[..., tuple]
    first_q_block: Array  # Whether this is the CTA's first q-block.

    @property
    def masked_tiles(self) -> bool:
        return common.has_masked_tiles(self.statics.layout, self.statics.has_partial)

    @property
    def tile(self) -> tuple[int, int]:
        return ROWS_PER_CONSUMER, self.statics.config.block_kv

    def slot(self, step):
        return lax.rem(self.first_step + step, self.statics.config.num_stages)

    def issue_qk(self, s_ref, step) -> None:
        plgpu.wgmma(s_ref, self.q,
                    self.k_smem.at[self.slot(step)].transpose((1, 0)))

    def staged(self, probs):
        """P as the P @ V wgmma takes it (the interpreter reads operands from smem only)."""
        if self.p_staging is None:
            return probs
        self.p_staging.at[self.wg][...] = probs
        return self.p_staging.at[self.wg]

    def loop(self, step_fn, carry, start: int = 0):
        """``step_fn(step, carry, full)`` over the walk: the FULL tiles (listed first) in a
        loop without mask code, then the rest."""
        carry = lax.fori_loop(start, self.num_full, functools.partial(step_fn, full=True),
                              carry)
        if self.masked_tiles:
            carry = lax.fori_loop(jnp.maximum(self.num_full, start), self.count,
                                  functools.partial(step_fn, full=False), carry)
        return carry


def _row_vector(value: float) -> Array:
    """A consumer's per-row float32 vector (running max or sum) filled with ``value``."""
    return plgpu.layout_cast(jnp.full((ROWS_PER_CONSUMER,), value, jnp.float32),
                             compat.wgmma_row_layout())


def _serial_steps(c: _Consumer):
    """(O, row max, row sum): per step QK^T, softmax, P @ V, ping-ponging with the other
    consumer so that one's softmax runs under the other's matmuls."""
    s = c.statics

    # Every pass of `schedule` needs both consumers. Consumer 1 starts one pass
    # behind and consumer 0 catches up after the loop, so both pass it
    # 2 * count + 1 times.
    def schedule_sync():
        plgpu.barrier_arrive(c.schedule)
        plgpu.barrier_wait(c.schedule)

    pl.when(c.wg == 1)(schedule_sync)

    def step_fn(step, carry, full: bool):
        acc, row_max, row_sum = carry
        slot = c.slot(step)
        plgpu.barrier_wait(c.k_barriers.at[slot])

        def qk(s_ref):
            c.issue_qk(s_ref, step)
            schedule_sync()  # The other consumer's P @ V runs while this QK^T does.
            return s_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC(c.tile, jnp.float32))
        plgpu.barrier_arrive(c.k_consumed.at[slot])
        probs, alpha, row_max, row_sum = c.softmax(scores, step, row_max, row_sum, full)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        # Pins the softmax's instruction order ahead of the ping-pong hand-over
        # (measured on the H100: up to 10% faster at head dim 64).
        acc, row_max, row_sum, probs = lax.optimization_barrier(
            (acc, row_max, row_sum, probs.astype(s.dtype)))

        plgpu.barrier_arrive(c.schedule)  # Softmax done...
        plgpu.barrier_wait(c.v_barriers.at[slot])
        plgpu.barrier_wait(c.schedule)  # ...and the tensor cores are ours.
        acc = compat.wgmma_accumulate(acc, c.staged(probs), c.v_smem.at[slot],
                                      interpret=s.interpret)
        plgpu.barrier_arrive(c.v_consumed.at[slot])
        return acc, row_max, row_sum

    acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_CONSUMER, s.head_dim_v), jnp.float32),
                            plgpu.Layout.WGMMA)
    carry = c.loop(step_fn, (acc, _row_vector(-jnp.inf), _row_vector(0.0)))
    pl.when(c.wg == 0)(schedule_sync)
    return carry


def _pipelined_steps(c: _Consumer):
    """(O, row max, row sum), software-pipelined by one step: step i issues its QK^T and
    step i - 1's P @ V back to back, then runs its softmax while that P @ V is in flight.

    O, the output accumulator, compiled lives in a wgmma accumulator ref, so that
    P @ V runs asynchronously into it. The interpreter cannot store into
    accumulator refs: there O is a value threaded through the loop, and its
    (synchronous) P @ V goes through a staged P in smem.
    """
    s = c.statics
    rows = ROWS_PER_CONSUMER

    def issue_pv(o_ref, o, probs, step):
        """O += P @ V of ``step``, issued, not awaited; returns the interpreter's O."""
        slot = c.slot(step)
        plgpu.barrier_wait(c.v_barriers.at[slot])
        if o_ref is None:
            return compat.wgmma_accumulate(o, c.staged(probs), c.v_smem.at[slot],
                                           interpret=True)
        plgpu.wgmma(o_ref, probs, c.v_smem.at[slot])
        return None

    def rescale_output(o_ref, o, alpha):
        """O *= alpha (per row), once no P @ V is in flight; returns the interpreter's O.

        Rescaling while a wgmma is in flight would make ptxas serialize every wgmma
        of the kernel (registers of a pending wgmma defined by other code).
        """
        alpha = lax.broadcast_in_dim(alpha, (rows, s.head_dim_v), [0])
        if o_ref is None:
            return o * alpha
        o_ref[...] = plgpu.wgmma_accumulator_load(o_ref, wait_n=None) * alpha
        return None

    def qk(step, previous=None):
        """(S of ``step``, the interpreter's O); with ``previous`` = (o_ref, o, P,
        step - 1) also issues that step's P @ V right behind and returns while it runs."""
        slot = c.slot(step)
        plgpu.barrier_wait(c.k_barriers.at[slot])

        def issue(s_ref):
            c.issue_qk(s_ref, step)
            o = None if previous is None else issue_pv(*previous)
            # wgmma groups complete in order: waiting for all but the newest (P @ V)
            # is waiting for S.
            return plgpu.wgmma_accumulator_load(
                s_ref, wait_n=0 if previous is None else 1), o

        scores, o = pl.run_scoped(issue, plgpu.ACC(c.tile, jnp.float32))
        plgpu.barrier_arrive(c.k_consumed.at[slot])
        return scores, o

    def release_v(step):
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(c.v_consumed.at[c.slot(step)])

    def step_fn(step, carry, full: bool, o_ref):
        o, probs, row_max, row_sum = carry
        scores, o = qk(step, (o_ref, o, probs, step - 1))
        softmax_out = c.softmax(scores, step, row_max, row_sum, full)
        # The barriers (ordered side effects for LLVM) pin the softmax before the
        # wait for P @ V and the conversion of P after it: the new P reuses the
        # registers that the P @ V in flight reads, and writing them earlier makes
        # ptxas serialize every wgmma of the kernel.
        probs, alpha, row_max, row_sum = lax.optimization_barrier(softmax_out)
        release_v(step - 1)
        probs = lax.optimization_barrier(probs).astype(s.dtype)
        return rescale_output(o_ref, o, alpha), probs, row_max, row_sum

    def steps(o_ref):
        o = (None if o_ref is not None else
             plgpu.layout_cast(jnp.zeros((rows, s.head_dim_v), jnp.float32),
                               plgpu.Layout.WGMMA))
        init = (_row_vector(-jnp.inf), _row_vector(0.0))

        last_consumer = s.config.num_consumers - 1

        def stagger():
            """Each consumer but the last lets the next one start, once per CTA
            (`ForwardConfig.staggered`): one arrival and one wait per stagger barrier in
            all, whatever the q-blocks' walks."""
            if c.schedule is not None:
                pl.when((c.wg < last_consumer) & c.first_q_block)(
                    lambda: plgpu.barrier_arrive(c.schedule.at[c.wg]))

        def first_step():
            # Step 0 may be FULL or not: the masked path is exact for FULL tiles too.
            # O is still zero: it needs no rescaling.
            scores = qk(0)[0]
            stagger()
            probs, _, row_max, row_sum = c.softmax(scores, 0, *init,
                                                   full=not c.masked_tiles)
            return probs.astype(s.dtype), row_max, row_sum

        def no_step():
            stagger()
            return plgpu.layout_cast(jnp.zeros(c.tile, s.dtype), plgpu.Layout.WGMMA), *init

        if c.schedule is not None:
            pl.when((c.wg > 0) & c.first_q_block)(
                lambda: plgpu.barrier_wait(c.schedule.at[c.wg - 1]))
        carry = (o, *lax.cond(c.count > 0, first_step, no_step))
        carry = c.loop(functools.partial(step_fn, o_ref=o_ref), carry, start=1)
        o, probs, row_max, row_sum = carry

        def last_pv():
            last_o = issue_pv(o_ref, o, probs, c.count - 1)
            release_v(c.count - 1)
            return last_o

        if o_ref is None:
            o = lax.cond(c.count > 0, last_pv, lambda: o)
        else:
            pl.when(c.count > 0)(last_pv)
            o = o_ref[...]
        return o, row_max, row_sum

    if s.interpret:
        return steps(None)
    return pl.run_scoped(steps, plgpu.ACC((rows, s.head_dim_v), jnp.float32))


def attention_forward(q: Array, k: Array, v: Array, kmask: KernelMask | None,
                      layout: MaskLayout, *,
                      scale: float, softcap: float | None,
                      score_mod: ConvertedScoreMod | None, has_partial: bool,
                      config: ForwardConfig, captured: Sequence[Array] = (),
                      interpret_params: Any = None, page_table: Array | None = None,
                      heads_first: bool = False, kv_lens: Array | None = None,
                      paged_walk: PagedWalk | None = None) -> tuple[Array, Array]:
    """``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32)``; sinks are the caller's. With
    ``heads_first``, q is ``[B, Hq, Sq, D]`` and out ``[B, Hq, Sq, Dv]``: the layout in
    which a decoding step's packed query rows (`omni_jax.query_groups`) are a view of
    its queries. Fewer than 8 rows are then read and written as they are (a TMA box
    clips them), not padded.

    ``layout`` must tile by ``(config.block_q, config.block_kv)``; ``captured``
    are ``score_mod``'s captured arrays, which it may read only by element
    (`pallas_kernels.captured.scalar_reads_reason`); ``has_partial`` False
    promises no PARTIAL tile.

    With ``page_table`` int32 ``[B, pages_per_seq]``, K and V are paged,
    ``[num_pages, page_size, Hkv, D(v)]``: key ``i`` of sequence ``b`` is row
    ``i % page_size`` of page ``page_table[b, i // page_size]``, ids outside the cache
    clamped into it by the kernel (the mask must hide their keys). ``page_size`` is a power of two
    of at least 8 that divides ``config.block_kv`` or that it divides, and the head dims
    must be the kernel's own (`padded_head_dims`): the cache is never copied. With
    ``kv_lens`` (int32 ``[B]``, paged only) the mask's one leaf, a kv leaf, is each key's
    sequence length, or -1 on pages outside the cache: the producer computes it from the
    page table (no array in memory). ``paged_walk`` comes with it: the kernel computes
    its walks from each sequence's length and page check (`PagedWalk`, `walk_seeds`: the
    walk operand, one line per sequence), so there is no ``kmask`` (None): ``layout``
    alone describes the mask.
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    if heads_first:
        q_len, num_q_heads = num_q_heads, q_len
    num_kv_heads, head_dim_v = v.shape[2], v.shape[3]
    if kv_lens is not None and (page_table is None or layout.leaf_kinds != ("kv",)
                                or has_partial):
        raise ValueError(f"kv_lens needs page_table, a mask of one kv leaf and no PARTIAL "
                         f"tile; got page_table={page_table is not None}, leaf kinds "
                         f"{layout.leaf_kinds}, has_partial={has_partial}")
    if (paged_walk is None) != (kv_lens is None) or (paged_walk is None) != (
            kmask is not None) or (paged_walk is not None and (
                paged_walk.block_kv, paged_walk.num_kv_blocks)
            != (config.block_kv, layout.num_kv_blocks)):
        raise ValueError(f"kv_lens and paged_walk come together, without kmask, the walk "
                         f"over the layout's {layout.num_kv_blocks} kv-blocks of "
                         f"{config.block_kv}; got paged_walk={paged_walk}, kv_lens="
                         f"{kv_lens is not None}, kmask={kmask is not None}")
    page_size = seeds = None
    if page_table is not None:
        page_size = k.shape[1]
        if paged_walk is not None:
            seeds = walk_seeds(kv_lens, page_table, num_pages=k.shape[0],
                               page_size=page_size, width=common.WALK_LINE)
        k, v, page_table = _paged_operands(k, v, page_table, layout.num_kv_blocks,
                                           config.block_kv)
    if (layout.block_q, layout.block_kv) != (config.block_q, config.block_kv):
        raise ValueError(f"mask tiles {(layout.block_q, layout.block_kv)} differ from the "
                         f"kernel's {(config.block_q, config.block_kv)}")
    dim, dim_v = padded_head_dims(head_dim, head_dim_v)
    q, k, v = common.pad_last(q, dim), common.pad_last(k, dim), common.pad_last(v, dim_v)
    # TMA boxes into 8-row-tiled smem need sequence lengths that are multiples of 8;
    # padded keys lie past kv_len, in the ragged (COMPUTED, hence masked) last block.
    q = (common.pad_sequence(q, axis=2, keep_short=True) if heads_first
         else common.pad_sequence(q))
    k, v = common.pad_sequence(k), common.pad_sequence(v)
    if config.num_consumers != 2:
        _check_spanning_ctas(config, kmask, layout, has_partial, (dim, dim_v), page_table)
    if paged_walk is None:
        with trace_time_eval(layout, kmask):  # constants when the mask is concrete
            walk = common.packed_walk(kmask, "kv")
            q_leaves, kv_leaves, leaf_slots = common.stacked_leaves(kmask, layout, batch)
            partial_tiles = kmask.partial_masks.astype(jnp.int8)
    else:
        # One walk line per sequence ([B, 1, 1, 1, WALK_LINE], walk_lines 1); the mask's
        # one leaf, a kv leaf, the producer computes (`_Statics.kv_leaves_computed`).
        walk = seeds[:, None, None, None]
        q_leaves = kv_leaves = partial_tiles = None
        leaf_slots = (("kv", 0),)
    interpret = interpret_params is not None
    scores, packed_captured = common.score_spec(scale, softcap, score_mod, captured)
    statics = _Statics(
        config=config, layout=layout, num_q_heads=num_q_heads,
        group_size=num_q_heads // num_kv_heads, head_dim=dim, head_dim_v=dim_v,
        dtype=q.dtype, scores=scores,
        has_partial=has_partial, walk_lines=walk.shape[-2],
        num_q_buffers=q_buffers(
            config, dim, dim_v, q.dtype.itemsize, has_partial,
            pages_per_seq=0 if page_table is None else page_table.shape[1] * common.WALK_LINE,
            walk_blocks=layout.num_kv_blocks),
        leaf_slots=leaf_slots,
        interpret=interpret, q_len=q_len,
        num_row_blocks=(layout.num_q_blocks if config.cta_rows == BLOCK_Q
                        else -(-q_len // config.cta_rows)),
        page_size=page_size,
        table_lines=0 if page_table is None else page_table.shape[1], heads_first=heads_first,
        paged_walk=paged_walk)

    operands = [q, k, v, walk]
    if page_table is not None:
        operands.append(page_table)
    if has_partial:
        operands.append(partial_tiles)
    operands += [x for x in (q_leaves, kv_leaves, packed_captured) if x is not None]
    q_padded, splits = statics.num_row_blocks * config.cta_rows, config.kv_splits
    q_rows = q.shape[2] if heads_first else q.shape[1]
    out_shape = (batch, num_q_heads, q_rows) if heads_first else (batch, q_rows, num_q_heads)
    out_type = (jax.ShapeDtypeStruct((splits, *out_shape, dim_v), q.dtype),
                jax.ShapeDtypeStruct((splits, batch, num_q_heads, q_padded), jnp.float32))
    out, lse = compat.mosaic_kernel(
        functools.partial(_kernel, statics), out_type,
        scratch_types=_scratch(statics),
        # The last grid axis varies fastest: the CTAs running at once are q-blocks of one
        # or a few heads, which then share those heads' K/V in L2.
        grid=(batch * num_q_heads * splits,
              pl.cdiv(statics.num_row_blocks, config.q_blocks_per_cta)),
        grid_names=("batch_head", "q_blocks"),
        num_threads=config.num_consumers + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params,
    )(*operands)
    out = out[..., :q_len, :head_dim_v] if heads_first else out[..., :q_len, :, :head_dim_v]
    return kv_splits.combine(out, lse[..., :q_len], q.dtype, heads_first=heads_first)


def _check_spanning_ctas(config: ForwardConfig, kmask: KernelMask, layout: MaskLayout,
                         has_partial: bool, dims: tuple[int, int],
                         page_table: Array | None) -> None:
    """Raises unless CTAs of ``config.num_consumers`` consumers (rows spanning q-blocks)
    can serve the call (`ForwardConfig.num_consumers`)."""
    name = f"config.num_consumers={config.num_consumers}"
    if page_table is not None:
        raise ValueError(f"{name} needs contiguous K/V, got a page_table")
    if not (config.pipelined and config.block_kv <= 128 and config.q_blocks_per_cta == 1
            and config.kv_splits == 1):
        raise ValueError(f"{name} needs pipelined=True, block_kv <= 128, q_blocks_per_cta=1 "
                         f"and kv_splits=1; got pipelined={config.pipelined}, block_kv="
                         f"{config.block_kv}, q_blocks_per_cta={config.q_blocks_per_cta}, "
                         f"kv_splits={config.kv_splits}")
    with trace_time_eval(layout, kmask):
        uniform = uniform_full_walks(kmask, layout, has_partial)
    if not uniform:
        raise ValueError(f"{name} needs a mask known at trace time whose q-blocks all walk "
                         f"the same FULL kv-blocks (no stored tiles, mask_mod or ragged "
                         f"kv-block), got has_partial={has_partial}, mask_mod "
                         f"{layout.mask_mod_treedef}, kv_len={layout.kv_len}")
    if dims != (64, 64):
        raise ValueError(f"{name} needs head dims of 64 (after padding), got {dims}")


def _paged_operands(k_pages: Array, v_pages: Array, page_table: Array, num_kv_blocks: int,
                    block_kv: int) -> tuple[Array, Array, Array]:
    """Paged K/V as ``[1, num_pages * page_size, Hkv, D]`` (a view, no copy) and the page
    table as the producer reads it: one id per page of every kv-block the mask may walk
    (past the table's pages: page 0, whose keys the mask hides), in lines of
    `common.WALK_LINE` (``[B, R, WALK_LINE]``). The producer clamps the ids into the
    cache, so a table of whole lines is passed as it is (a view, no XLA kernel), and so
    is one shorter than a line (``[B, 1, pages]``, a TMA box of 16-byte multiples: the
    rest of the producer's line holds ids of pages past the table, hidden by the mask
    and clamped into the cache)."""
    num_pages, page_size = k_pages.shape[:2]
    if page_size < 8 or page_size & (page_size - 1) or (
            block_kv % page_size and page_size % block_kv):
        raise ValueError(f"page_size must be a power of two >= 8 dividing block_kv="
                         f"{block_kv} or divisible by it, got {page_size}")
    dims = (k_pages.shape[3], v_pages.shape[3])
    if padded_head_dims(*dims) != dims:
        raise ValueError(f"paged head dims must be the kernel's own {SUPPORTED_HEAD_DIMS} "
                         f"(the cache is not padded), got {dims}")
    flat = lambda x: x.reshape(1, num_pages * page_size, *x.shape[2:])
    batch, pages_per_seq = page_table.shape
    if pages_per_seq <= common.WALK_LINE and pages_per_seq % 4 == 0:
        table = page_table.astype(jnp.int32).reshape(batch, 1, pages_per_seq)
        return flat(k_pages), flat(v_pages), table
    needed = -(-num_kv_blocks * block_kv // page_size)
    lines = table_lines(needed)
    table = jnp.pad(page_table.astype(jnp.int32),
                    ((0, 0), (0, lines * common.WALK_LINE - page_table.shape[1])))
    return flat(k_pages), flat(v_pages), table.reshape(-1, lines, common.WALK_LINE)


def _schedule_barrier(cfg: ForwardConfig) -> Any:
    """The serial schedule's ping-pong barrier, the pipelined one's stagger barriers (one
    per consumer but the last, one arrival each, once per CTA), or None (pipelined, not
    staggered)."""
    if not cfg.pipelined:
        return plgpu.Barrier(num_arrivals=cfg.num_consumers)
    if not cfg.staggered:
        return None
    return plgpu.Barrier(num_arrivals=1, num_barriers=cfg.num_consumers - 1)


def _scratch(s: _Statics):
    cfg = s.config
    captured_smem, captured_barrier = common.captured_scratch(s)
    stages, rows, consumers = cfg.num_stages, ROWS_PER_CONSUMER, cfg.num_consumers
    # Walks and q leaves of two q-blocks: the next one's load under the current one.
    smem = (
        common.swizzled((s.num_q_buffers, consumers, rows, s.head_dim), s.dtype),
        (None if s.head_dim_v == s.head_dim
         else common.swizzled((consumers, rows, s.head_dim_v), s.dtype)),
        plgpu.SMEM((consumers, rows), jnp.float32),
        plgpu.SMEM((2, s.walk_lines, common.WALK_LINE), jnp.int32),
        common.swizzled((stages, cfg.block_kv, s.head_dim), s.dtype),
        common.swizzled((stages, cfg.block_kv, s.head_dim_v), s.dtype),
        common.swizzled((stages, cfg.block_q, cfg.block_kv), jnp.int8) if s.has_partial else None,
        plgpu.SMEM((2, s.num_q_leaves, cfg.block_q), jnp.int32) if s.num_q_leaves else None,
        (plgpu.SMEM((stages, s.num_kv_leaves, cfg.block_kv), jnp.int32)
         if s.num_kv_leaves else None),
        # Interpreted only: P staged in smem for the P @ V wgmma.
        common.swizzled((consumers, rows, cfg.block_kv), s.dtype) if s.interpret else None,
        captured_smem,
        (plgpu.SMEM((s.table_lines, common.WALK_LINE), jnp.int32)
         if s.page_size is not None else None),
    )
    consumed = plgpu.Barrier(num_arrivals=consumers, num_barriers=stages)
    # A K (V) tile is loaded by one TMA, or paged by one per page, each arriving.
    loaded = plgpu.Barrier(num_arrivals=common.page_copies(cfg.block_kv, s.page_size),
                           num_barriers=stages)
    barriers = (
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=s.num_q_buffers * consumers),
        loaded,
        loaded,
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        consumed,
        consumed,
        # A q-block's walk and q leaves (and Q, O, lse) are no longer read.
        plgpu.Barrier(num_arrivals=consumers, num_barriers=2),
        _schedule_barrier(cfg),
        captured_barrier,
        plgpu.Barrier(num_barriers=1) if s.page_size is not None else None,
    )
    return smem, barriers

