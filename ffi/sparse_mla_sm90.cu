// Sparse MLA prefill for Hopper (sm_90a), bound to JAX through XLA FFI.
//
// One CTA computes 64 query heads of one query row against the `topk` kv rows that row
// lists, in blocks of 64 listed rows. Blocks go in pairs; an odd last block is paired with
// an all-invalid one (zero rows, masked), so every wgmma sits on a uniform path. Three
// warpgroups:
//   WG2 (producer): gathers the listed kv rows of a block (576 bf16 features each) into
//       one of two shared buffers with cp.async, zero-filling invalid rows;
//   WG0 / WG1 (consumers): WG0 takes the even block of a pair (buffer 0), WG1 the odd one
//       (buffer 1). Each computes its 64x64 score tile S = Q K^T with wgmma, masks
//       invalid entries to -inf, optionally stores the raw scores, and the two agree on
//       a common running row max through shared memory (online softmax). The 64x512
//       output accumulator is split by columns: WG0 owns values [0, 256), WG1 [256, 512),
//       so each WG multiplies both blocks' probabilities (its own from registers, the
//       peer's from shared memory) by its half of the values.
//
// Pipelining: every buffer is two halves with their own ready/free barriers, half 0 =
// features [0, 256) (chunks 0-3), half 1 = features [256, 576) (chunks 4-8). Half h of
// buffer b is read by WG b's QK^T and by WG h's PV, so the "local" halves (b == h) are
// free as soon as their WG's first PV (with its own probabilities) is done, and the
// producer refills them for the next pair while the second PV (with the peer's
// probabilities) still runs. The producer refills in the order the halves free up.
//
// Accumulator fragment layout (wgmma m64nN, per thread t of a warpgroup): element i sits at
//   row 16*(t/32) + (t%32)/4 + 8*((i>>1)&1),  column 8*(i>>2) + 2*(t%4) + (i&1).
// The bf16 A-operand fragment of a 64x16 slice k of such a tile is elements 8k..8k+7 in
// pairs, so probabilities go from the score accumulator to the PV wgmma without a shuffle.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "omni_jax/ffi_checks.h"
#include "omni_jax/sm90_gmma.cuh"
#include "xla/ffi/api/ffi.h"

namespace omni_jax::sparse_mla {
namespace {

namespace ffi = xla::ffi;
using cutlass::arch::ClusterBarrier;
using cutlass::arch::NamedBarrier;

constexpr int kDimQK = 576;
constexpr int kDimV = 512;
constexpr int kHeadsPerCta = 64;
constexpr int kTopkPerBlock = 64;
constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;

constexpr int kChunkBytes = 64 * sm90::kSwizzleRowBytes;     // 64 rows x 64 features
constexpr int kChunksQK = kDimQK / 64;                        // 9 feature chunks per tile
constexpr int kTileBytes = kChunksQK * kChunkBytes;           // 64 rows x 576 features
constexpr int kUnitsPerRow = kDimQK * 2 / 16;                 // 72 16-byte units per row
constexpr int kRopeChunk = kDimV / 64;                        // chunk 8: features 512..575
constexpr int kValueChunksPerWg = kDimV / 64 / 2;             // 4 chunks = 256 values

// Shared memory plan (offsets from a 1024-byte aligned base).
constexpr int kQOffset = 0;
constexpr int kKvOffset = kTileBytes;                         // two kv tiles
constexpr int kProbs1Offset = kKvOffset + 2 * kTileBytes;     // WG1's bf16 probabilities
constexpr int kRowMaxOffset = kProbs1Offset + kChunkBytes;    // float[2][64]
constexpr int kRowSumOffset = kRowMaxOffset + 2 * 64 * 4;     // float[2][64]
constexpr int kBarrierOffset = kRowSumOffset + 2 * 64 * 4;    // uint64 ready[4], free[4]
constexpr int kSmemBytes = kBarrierOffset + 8 * 8 + 1024;     // + slack for base alignment
static_assert(kSmemBytes <= 227 * 1024, "exceeds the sm90 shared memory per block");

// The feature chunks [first, end) of half h of a kv buffer.
__host__ __device__ constexpr int HalfFirstChunk(int half) { return half == 0 ? 0 : 4; }
__host__ __device__ constexpr int HalfEndChunk(int half) { return half == 0 ? 4 : kChunksQK; }

// Named barrier ids (CUTLASS offsets them past its reserved ones), all among the 256
// consumer threads.
enum ConsumerBarrier : uint32_t {
  kQLoaded = 0,        // Q tile stored and fenced for wgmma
  kRowMaxReady = 1,    // both WGs' block row maxes are in shared memory
  kProbsReady = 2,     // both WGs' bf16 probabilities are in shared memory
  kRowSumReady = 3,    // both WGs' row sums are in shared memory (epilogue)
};

struct Params {
  const __nv_bfloat16* q;     // [batch, s_q, h_q, 576]
  const __nv_bfloat16* kv;    // [batch, s_kv, 1, 576]
  const int32_t* indices;     // [batch, s_q, 1, topk]
  __nv_bfloat16* out;         // [batch, s_q, h_q, 512]
  float* max_logits;          // [batch, s_q, h_q]
  float* lse;                 // [batch, s_q, h_q]
  float* scores;              // [batch, s_q, h_q, topk] or null
  int s_q, h_q, s_kv, topk;
  float sm_scale;
  float scale_log2;           // sm_scale * log2(e): softmax runs in base 2
};

// Where one CTA's shared memory pieces live, and which problem tile it owns.
struct Cta {
  uint8_t* q_tile;            // [64 heads x 576] swizzled
  uint8_t* kv_tiles;          // two [64 rows x 576] swizzled buffers
  uint8_t* probs1_tile;       // [64 x 64] bf16 probabilities of WG1's block, swizzled
  float (*row_max)[64];       // [wg][row] block row maxes
  float (*row_sum)[64];       // [wg][row] row sums
  uint64_t* half_ready;       // [buffer * 2 + half] producer -> consumers (cp.async arrivals)
  uint64_t* half_free;        // [buffer * 2 + half] consumers -> producer
  int64_t batch;
  int s_idx, head0, num_pairs, num_blocks;
  const int32_t* row_indices;  // this query row's topk indices

  __device__ uint8_t* kv_tile(int buffer) const { return kv_tiles + buffer * kTileBytes; }
  // WG0's bf16 probabilities live in buffer 0's rope chunk (half 1, which only WG0's
  // QK^T and WG1's PV read, the latter together with these probabilities); WG1's have a
  // tile of their own, since buffer 1's half 1 is freed before WG0 reads them.
  __device__ uint8_t* probs_tile(int buffer) const {
    return buffer == 0 ? kv_tile(0) + kRopeChunk * kChunkBytes : probs1_tile;
  }
  __device__ uint64_t* ready_barrier(int buffer, int half) const {
    return &half_ready[buffer * 2 + half];
  }
  __device__ uint64_t* free_barrier(int buffer, int half) const {
    return &half_free[buffer * 2 + half];
  }
};

__device__ __forceinline__ void CpAsync16ZeroFill(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ bool IsValidIndex(int index, int s_kv) {
  return index >= 0 && index < s_kv;
}

// Producer warpgroup: 16 groups of 8 threads; a group gathers 4 rows of a block, its 8
// threads copying alternate 16-byte units of a row so each warp instruction reads 128
// contiguous bytes of 4 rows. Blocks past the end (the pad of an odd count) are all zeros.
// Halves are refilled in the order they free up: the local ones (0,0) and (1,1) first.
__device__ __forceinline__ void Produce(const Params& p, const Cta& cta, int tid) {
  constexpr int kFillOrder[4][2] = {{0, 0}, {1, 1}, {0, 1}, {1, 0}};  // {buffer, half}
  constexpr int kRowsPerThread = kTopkPerBlock / 16;
  const int group = tid / 8;
  const int lane_in_group = tid % 8;
  const __nv_bfloat16* kv = p.kv + cta.batch * p.s_kv * kDimQK;
  for (int pair = 0; pair < cta.num_pairs; ++pair) {
    int row_index[2][kRowsPerThread];  // kv row gathered into each of this thread's rows
#pragma unroll
    for (int buffer = 0; buffer < 2; ++buffer) {
      const int block = 2 * pair + buffer;
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) {
        row_index[buffer][r] =
            block < cta.num_blocks
                ? __ldg(cta.row_indices + block * kTopkPerBlock + group + 16 * r)
                : -1;
      }
    }
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      const int buffer = kFillOrder[step][0], half = kFillOrder[step][1];
      // The half's previous contents (pair - 1) must have been read by every WG using them.
      if (pair > 0) ClusterBarrier::wait(cta.free_barrier(buffer, half), (pair - 1) & 1);
      uint8_t* tile = cta.kv_tile(buffer);
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) {
        const int row = group + 16 * r;
        const int index = row_index[buffer][r];
        const bool valid = IsValidIndex(index, p.s_kv);
        const uint8_t* src = reinterpret_cast<const uint8_t*>(
            kv + static_cast<int64_t>(valid ? index : 0) * kDimQK);
#pragma unroll
        for (int chunk = HalfFirstChunk(half); chunk < HalfEndChunk(half); ++chunk) {
          CpAsync16ZeroFill(tile + chunk * kChunkBytes + sm90::Swizzle128Offset(row, lane_in_group),
                            src + (chunk * 8 + lane_in_group) * 16, valid);
        }
      }
      // Arrives on the half's ready barrier once this thread's copies above have landed.
      cutlass::arch::cpasync_barrier_arrive_noinc(cta.ready_barrier(buffer, half));
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Consumer warpgroup kWg (0 or 1): QK^T, mask, optional score store, online softmax and
// its half of the output for every pair of blocks, then the epilogue. The WG index is a
// template parameter so that every wgmma sits on a path the compiler knows is uniform.
template <int kWg, bool kStoreScores>
__device__ __forceinline__ void Consume(const Params& p, const Cta& cta, int tid) {
  constexpr int kPeer = kWg ^ 1;
  const int frag_row = 16 * (tid / 32) + (tid % 32) / 4;  // rows frag_row and frag_row + 8
  const int frag_col = 2 * (tid % 4);                      // + 8*j + {0, 1}

  {  // Q tile [64 heads x 576] into 128-byte swizzled shared memory, by both consumer WGs.
    const uint8_t* q_rows = reinterpret_cast<const uint8_t*>(
        p.q + ((cta.batch * p.s_q + cta.s_idx) * p.h_q + cta.head0) * kDimQK);
    for (int u = kWg * 128 + tid; u < kHeadsPerCta * kUnitsPerRow; u += kConsumerThreads) {
      const int row = u / kUnitsPerRow, unit = u % kUnitsPerRow;
      const uint4 value =
          __ldg(reinterpret_cast<const uint4*>(q_rows + row * kDimQK * 2 + unit * 16));
      *reinterpret_cast<uint4*>(cta.q_tile + (unit / 8) * kChunkBytes +
                                sm90::Swizzle128Offset(row, unit % 8)) = value;
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> wgmma reads
    NamedBarrier::sync(kConsumerThreads, kQLoaded);
  }

  float acc_o[128];          // this WG's 64 x 256 slice of the output
  float acc_s[32];           // 64 x 64 scores of this WG's block
  uint32_t probs[16];        // bf16 pairs of exp(scores), A-operand layout
  float running_max[2] = {-INFINITY, -INFINITY};  // raw-score row max over all blocks so far
  float row_sum[2] = {0.f, 0.f};                   // this thread's partial sum of this WG's probs
#pragma unroll
  for (int i = 0; i < 128; ++i) acc_o[i] = 0.f;

  for (int pair = 0; pair < cta.num_pairs; ++pair) {
    const int block = 2 * pair + kWg;
    const bool real_block = block < cta.num_blocks;  // false only for WG1's pad block
    int2 listed[8];  // indices of this thread's columns, for the mask
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      listed[j] = real_block ? __ldg(reinterpret_cast<const int2*>(
                                   cta.row_indices + block * kTopkPerBlock + 8 * j + frag_col))
                             : make_int2(-1, -1);
    }

    // S = Q K^T, starting with the half of this WG's buffer that the producer refilled
    // first (the local half kWg), then the other one.
    const uint8_t* k_tile = cta.kv_tile(kWg);
    sm90::FenceOperands(acc_s);
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      const int half = step == 0 ? kWg : kPeer;
      ClusterBarrier::wait(cta.ready_barrier(kWg, half), pair & 1);
      cutlass::arch::fence_view_async_shared();  // cp.async (generic proxy) data -> wgmma
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 4 * HalfFirstChunk(half); k < 4 * HalfEndChunk(half); ++k) {
        const int offset = (k / 4) * kChunkBytes + (k % 4) * 32;  // 16 features = 32 bytes
        sm90::Gmma64x64x16SS(
            sm90::MakeSwizzle128Desc(cta.q_tile + offset, 16, sm90::kSwizzleAtomBytes),
            sm90::MakeSwizzle128Desc(k_tile + offset, 16, sm90::kSwizzleAtomBytes), acc_s,
            step == 0 && k == 4 * HalfFirstChunk(half) ? sm90::ScaleOut::Zero
                                                       : sm90::ScaleOut::One);
      }
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    sm90::FenceOperands(acc_s);

#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const bool valid0 = IsValidIndex(listed[j].x, p.s_kv);
      const bool valid1 = IsValidIndex(listed[j].y, p.s_kv);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (!valid0) acc_s[4 * j + 2 * half] = -INFINITY;
        if (!valid1) acc_s[4 * j + 2 * half + 1] = -INFINITY;
      }
    }

    if constexpr (kStoreScores) {
      // Raw masked scores straight from the fragments, before the softmax touches them:
      // a warp's float2 stores cover 32 contiguous bytes of each of 8 rows.
      if (real_block) {
        float* scores_tile = p.scores +
                             ((cta.batch * p.s_q + cta.s_idx) * p.h_q + cta.head0) * p.topk +
                             block * kTopkPerBlock;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float* row_ptr =
              scores_tile + static_cast<int64_t>(frag_row + 8 * half) * p.topk + frag_col;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            __stcs(reinterpret_cast<float2*>(row_ptr + 8 * j),
                   make_float2(acc_s[4 * j + 2 * half], acc_s[4 * j + 2 * half + 1]));
        }
      }
    }

    // Online softmax. Both WGs fold the same three maxima (running, own block, peer
    // block), so they keep identical running maxima without further exchange.
    float block_max[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        m = fmaxf(m, fmaxf(acc_s[4 * j + 2 * half], acc_s[4 * j + 2 * half + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));  // the 4 threads of a row
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
      block_max[half] = m;
    }
    if (tid % 4 == 0) {
      cta.row_max[kWg][frag_row] = block_max[0];
      cta.row_max[kWg][frag_row + 8] = block_max[1];
    }
    // Also orders the previous pair's reads of row_max (before kProbsReady) before these
    // writes being read again.
    NamedBarrier::sync(kConsumerThreads, kRowMaxReady);

#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float peer_max = cta.row_max[kPeer][frag_row + 8 * half];
      const float new_max = fmaxf(running_max[half], fmaxf(block_max[half], peer_max));
      // While a row has seen no valid entry its max is -inf; shifting by 0 keeps exp2 at 0.
      const float shift = new_max == -INFINITY ? 0.f : new_max * p.scale_log2;
      const float rescale = exp2f(running_max[half] * p.scale_log2 - shift);
      running_max[half] = new_max;
      row_sum[half] *= rescale;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        acc_o[4 * j + 2 * half] *= rescale;
        acc_o[4 * j + 2 * half + 1] *= rescale;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p0 = exp2f(fmaf(acc_s[4 * j + 2 * half], p.scale_log2, -shift));
        const float p1 = exp2f(fmaf(acc_s[4 * j + 2 * half + 1], p.scale_log2, -shift));
        row_sum[half] += p0 + p1;
        __nv_bfloat162 pair_bf16 = __floats2bfloat162_rn(p0, p1);
        probs[2 * j + half] = *reinterpret_cast<uint32_t*>(&pair_bf16);
      }
    }

    {  // Publish this WG's probabilities for the peer's PV: a K-major swizzled A tile.
      uint8_t* tile = cta.probs_tile(kWg);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          *reinterpret_cast<uint32_t*>(tile + sm90::Swizzle128Offset(frag_row + 8 * half, j) +
                                       frag_col * 2) = probs[2 * j + half];
      cutlass::arch::fence_view_async_shared();
    }
    // Done with the peer half of this WG's buffer: its QK^T is over and, for WG0, the
    // probabilities stored there are written (WG1 arrives after reading them).
    ClusterBarrier::arrive(cta.free_barrier(kWg, kPeer));
    NamedBarrier::sync(kConsumerThreads, kProbsReady);

    // acc_o += P_block @ V_block[:, 256*kWg : 256*kWg + 256] for both blocks of the pair:
    // first the local block (probabilities in registers, values in half kWg of this WG's
    // buffer), then the peer's (both from shared memory), one commit group each so the
    // local half is released while the second group still runs.
    sm90::FenceOperands(acc_o);
    sm90::FenceOperands(probs);
    cute::warpgroup_arrive();
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      const int buffer = step == 0 ? kWg : kPeer;
      const uint8_t* v_tile = cta.kv_tile(buffer) + kWg * kValueChunksPerWg * kChunkBytes;
#pragma unroll
      for (int k = 0; k < kTopkPerBlock / 16; ++k) {
        // V is MN-major: 16 topk rows per step; 64-value chunks kChunkBytes apart.
        const uint64_t desc_v = sm90::MakeSwizzle128Desc(
            v_tile + k * 16 * sm90::kSwizzleRowBytes, kChunkBytes, sm90::kSwizzleAtomBytes);
        if (step == 0) {
          const uint32_t a[4] = {probs[4 * k], probs[4 * k + 1], probs[4 * k + 2],
                                 probs[4 * k + 3]};
          sm90::Gmma64x256x16RS(a, desc_v, acc_o);
        } else {
          const uint64_t desc_p = sm90::MakeSwizzle128Desc(cta.probs_tile(buffer) + k * 32, 16,
                                                           sm90::kSwizzleAtomBytes);
          sm90::Gmma64x256x16SS(desc_p, desc_v, acc_o);
        }
      }
      cute::warpgroup_commit_batch();
    }
    cute::warpgroup_wait<1>();
    ClusterBarrier::arrive(cta.free_barrier(kWg, kWg));
    cute::warpgroup_wait<0>();
    ClusterBarrier::arrive(cta.free_barrier(kPeer, kWg));
    sm90::FenceOperands(acc_o);
    sm90::FenceOperands(probs);
  }

  // Epilogue: total row sums over both WGs, normalise, store.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffff, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffff, row_sum[half], 2);
  }
  if (tid % 4 == 0) {
    cta.row_sum[kWg][frag_row] = row_sum[0];
    cta.row_sum[kWg][frag_row + 8] = row_sum[1];
  }
  NamedBarrier::sync(kConsumerThreads, kRowSumReady);
  float total[2];
#pragma unroll
  for (int half = 0; half < 2; ++half)
    total[half] = row_sum[half] + cta.row_sum[kPeer][frag_row + 8 * half];

  const int64_t row0 = (cta.batch * p.s_q + cta.s_idx) * p.h_q + cta.head0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float inv = total[half] > 0.f ? 1.f / total[half] : 0.f;
    __nv_bfloat16* out_row =
        p.out + (row0 + frag_row + 8 * half) * kDimV + kWg * kValueChunksPerWg * 64 + frag_col;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<__nv_bfloat162*>(out_row + 8 * j) = __floats2bfloat162_rn(
          acc_o[4 * j + 2 * half] * inv, acc_o[4 * j + 2 * half + 1] * inv);
  }
  if (kWg == 0 && tid % 4 == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + frag_row + 8 * half;
      const bool any_valid = total[half] > 0.f;
      const float max_logit = running_max[half] * p.sm_scale;
      p.max_logits[row] = any_valid ? max_logit : -INFINITY;
      p.lse[row] = any_valid ? max_logit + logf(total[half]) : -INFINITY;
    }
  }
}

template <bool kStoreScores>
__global__ void __launch_bounds__(kThreads, 1)
    SparseMlaPrefillKernel(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_unaligned[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_unaligned) + 1023) & ~uintptr_t{1023});
  Cta cta;
  cta.q_tile = smem + kQOffset;
  cta.kv_tiles = smem + kKvOffset;
  cta.probs1_tile = smem + kProbs1Offset;
  cta.row_max = reinterpret_cast<float(*)[64]>(smem + kRowMaxOffset);
  cta.row_sum = reinterpret_cast<float(*)[64]>(smem + kRowSumOffset);
  cta.half_ready = reinterpret_cast<uint64_t*>(smem + kBarrierOffset);
  cta.half_free = cta.half_ready + 4;
  const int head_tiles = p.h_q / kHeadsPerCta;
  cta.batch = blockIdx.y;
  cta.s_idx = blockIdx.x / head_tiles;
  cta.head0 = (blockIdx.x % head_tiles) * kHeadsPerCta;
  cta.num_blocks = p.topk / kTopkPerBlock;
  cta.num_pairs = (cta.num_blocks + 1) / 2;
  cta.row_indices = p.indices + (cta.batch * p.s_q + cta.s_idx) * p.topk;

  if (threadIdx.x == 0) {
    for (int buffer = 0; buffer < 2; ++buffer) {
      for (int half = 0; half < 2; ++half) {
        // One cp.async arrival per producer thread.
        ClusterBarrier::init(cta.ready_barrier(buffer, half), 128);
        // A local half (buffer == half) is used by one WG, the others by both.
        ClusterBarrier::init(cta.free_barrier(buffer, half),
                             buffer == half ? 128 : kConsumerThreads);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  if (warpgroup == 2) {
    cutlass::arch::warpgroup_reg_dealloc<56>();  // 56 * 128 + 224 * 256 = 168 * 384 launched
    Produce(p, cta, tid);
  } else {
    cutlass::arch::warpgroup_reg_alloc<224>();
    if (warpgroup == 0) {
      Consume<0, kStoreScores>(p, cta, tid);
    } else {
      Consume<1, kStoreScores>(p, cta, tid);
    }
  }
#else
  // Built for another architecture: the handler only launches on sm90 devices.
  __trap();
#endif
}

ffi::Error CheckSm90Device() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return ffi::Error::Internal("sparse_mla_prefill: cannot query the CUDA device");
  }
  if (major != 9 || minor != 0) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "sparse_mla_prefill: the SM90 kernel needs a compute capability 9.0 GPU, got " +
                          std::to_string(major) + "." + std::to_string(minor));
  }
  return ffi::Error::Success();
}

template <bool kStoreScores>
ffi::Error Launch(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> kv,
                  ffi::Buffer<ffi::S32> indices, float sm_scale, ffi::Buffer<ffi::BF16> out,
                  ffi::Buffer<ffi::F32> max_logits, ffi::Buffer<ffi::F32> lse, float* scores,
                  size_t scores_count) {
  constexpr const char* kOp = "sparse_mla_prefill";
  if (!(sm_scale > 0.f) || !std::isfinite(sm_scale)) {
    return ffi::Error::InvalidArgument("sparse_mla_prefill: sm_scale must be finite and positive");
  }
  if (q.dimensions().size() < 3) {
    return ffi::Error::InvalidArgument("sparse_mla_prefill: q must have rank >= 3, got shape " +
                                       FormatDims(q.dimensions()));
  }
  const size_t batch_rank = q.dimensions().size() - 3;
  int64_t batch = 1, kv_batch = 1, idx_batch = 1;
  ffi::Span<const int64_t> q_dims, kv_dims, idx_dims;
  if (auto e = SplitBatch(kOp, "q", q.dimensions(), 3, batch_rank, batch, q_dims); e.failure())
    return e;
  if (auto e = SplitBatch(kOp, "kv", kv.dimensions(), 3, batch_rank, kv_batch, kv_dims);
      e.failure())
    return e;
  if (auto e = SplitBatch(kOp, "indices", indices.dimensions(), 3, batch_rank, idx_batch, idx_dims);
      e.failure())
    return e;
  for (size_t i = 0; i < batch_rank; ++i) {
    if (kv.dimensions()[i] != q.dimensions()[i] || indices.dimensions()[i] != q.dimensions()[i]) {
      return ffi::Error::InvalidArgument(
          "sparse_mla_prefill: batch dimensions differ: q " + FormatDims(q.dimensions()) + ", kv " +
          FormatDims(kv.dimensions()) + ", indices " + FormatDims(indices.dimensions()));
    }
  }
  const int64_t s_q = q_dims[0], h_q = q_dims[1], s_kv = kv_dims[0], topk = idx_dims[2];
  if (q_dims[2] != kDimQK) {
    return ffi::Error::InvalidArgument("sparse_mla_prefill: q must have d_qk = 576, got shape " +
                                       FormatDims(q.dimensions()));
  }
  if (h_q <= 0 || h_q % kHeadsPerCta != 0 || topk <= 0 || topk % kTopkPerBlock != 0) {
    return ffi::Error::InvalidArgument(
        "sparse_mla_prefill: h_q and topk must be positive multiples of 64, got h_q=" +
        std::to_string(h_q) + ", topk=" + std::to_string(topk));
  }
  if (s_kv < 1 || s_kv > INT32_MAX || s_q > INT32_MAX / (h_q / kHeadsPerCta)) {
    return ffi::Error::InvalidArgument("sparse_mla_prefill: s_q or s_kv out of range");
  }
  const int64_t kv_expected[] = {s_kv, 1, kDimQK};
  const int64_t idx_expected[] = {s_q, 1, topk};
  if (auto e = ExpectDims(kOp, "kv (after batch dims)", kv_dims, {kv_expected, 3}); e.failure())
    return e;
  if (auto e = ExpectDims(kOp, "indices (after batch dims)", idx_dims, {idx_expected, 3}); e.failure())
    return e;
  const size_t rows = static_cast<size_t>(batch * s_q * h_q);
  if (out.element_count() != rows * kDimV || max_logits.element_count() != rows ||
      lse.element_count() != rows || (kStoreScores && scores_count != rows * topk)) {
    return ffi::Error::InvalidArgument("sparse_mla_prefill: result shapes do not match the inputs");
  }
  if (batch == 0 || s_q == 0) return ffi::Error::Success();
  if (auto e = CheckSm90Device(); e.failure()) return e;

  auto kernel = SparseMlaPrefillKernel<kStoreScores>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) !=
      cudaSuccess) {
    return ffi::Error::Internal(std::string("sparse_mla_prefill: cannot reserve shared memory: ") +
                                cudaGetErrorString(cudaGetLastError()));
  }
  // Batch elements go on grid.y (at most 65535 per launch).
  constexpr int64_t kMaxGridY = 65535;
  for (int64_t first = 0; first < batch; first += kMaxGridY) {
    const int64_t count = batch - first < kMaxGridY ? batch - first : kMaxGridY;
    Params params;
    params.q = reinterpret_cast<const __nv_bfloat16*>(q.typed_data()) + first * s_q * h_q * kDimQK;
    params.kv = reinterpret_cast<const __nv_bfloat16*>(kv.typed_data()) + first * s_kv * kDimQK;
    params.indices = indices.typed_data() + first * s_q * topk;
    params.out = reinterpret_cast<__nv_bfloat16*>(out.typed_data()) + first * s_q * h_q * kDimV;
    params.max_logits = max_logits.typed_data() + first * s_q * h_q;
    params.lse = lse.typed_data() + first * s_q * h_q;
    params.scores = kStoreScores ? scores + first * s_q * h_q * topk : nullptr;
    params.s_q = static_cast<int>(s_q);
    params.h_q = static_cast<int>(h_q);
    params.s_kv = static_cast<int>(s_kv);
    params.topk = static_cast<int>(topk);
    params.sm_scale = sm_scale;
    params.scale_log2 = sm_scale * 1.4426950408889634f;
    const dim3 grid(static_cast<unsigned>(s_q * (h_q / kHeadsPerCta)), static_cast<unsigned>(count));
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(params);
  }
  if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) {
    return ffi::Error::Internal(std::string("sparse_mla_prefill: kernel launch failed: ") +
                                cudaGetErrorString(error));
  }
  return ffi::Error::Success();
}

ffi::Error Prefill(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> kv,
                   ffi::Buffer<ffi::S32> indices, float sm_scale, ffi::ResultBuffer<ffi::BF16> out,
                   ffi::ResultBuffer<ffi::F32> max_logits, ffi::ResultBuffer<ffi::F32> lse) {
  return Launch<false>(stream, q, kv, indices, sm_scale, *out, *max_logits, *lse, nullptr, 0);
}

ffi::Error PrefillWithScores(cudaStream_t stream, ffi::Buffer<ffi::BF16> q,
                             ffi::Buffer<ffi::BF16> kv, ffi::Buffer<ffi::S32> indices,
                             float sm_scale, ffi::ResultBuffer<ffi::BF16> out,
                             ffi::ResultBuffer<ffi::F32> max_logits,
                             ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::F32> scores) {
  return Launch<true>(stream, q, kv, indices, sm_scale, *out, *max_logits, *lse,
                      scores->typed_data(), scores->element_count());
}

}  // namespace
}  // namespace omni_jax::sparse_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(OmniJaxSparseMlaPrefillSm90, omni_jax::sparse_mla::Prefill,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // q
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // kv
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // indices
                                  .Attr<float>("sm_scale")
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // max_logits
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(OmniJaxSparseMlaPrefillScoresSm90,
                              omni_jax::sparse_mla::PrefillWithScores,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // q
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // kv
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // indices
                                  .Attr<float>("sm_scale")
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // max_logits
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // lse
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // scores
