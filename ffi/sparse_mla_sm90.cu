// Sparse MLA prefill for Hopper (sm_90a), bound to JAX through XLA FFI.
//
// One CTA computes 64 query heads of one query row against the `topk` kv rows that row
// lists, in blocks of 64 listed rows. Blocks go in pairs; an odd last block is paired with
// an all-invalid one (zero rows, masked), so every wgmma sits on a uniform path. Three
// warpgroups:
//   WG2 (producer): copies the Q tile, then gathers the listed kv rows of each block (576
//       bf16 features each) into one of two shared buffers, all with cp.async (invalid
//       rows zero-filled), so the consumers never wait on a synchronous load;
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
// buffer b is read by WG b's QK^T and by WG h's PV. The QK^T always ends before that PV
// starts (the probabilities it needs come after it), so the WG running the PV alone
// releases the half. The "local" halves (b == h) free up after their WG's first PV (with
// its own probabilities), and the producer refills them for the next pair while the
// second PV (with the peer's probabilities) still runs; it refills in the order the
// halves free up. The consumers run staggered (see Consume): WG0's softmax and WG1's QK^T
// overlap, and WG0 issues its next QK^T under its second PV.
//
// Per CTA costs: one CTA fits on an SM, so the next one's Q load cannot overlap this one's
// work; the producer prefetches that Q tile into L2 once its last gathers are issued. The
// output goes out through shared memory (the Q tile, free by then) in 16-byte stores.
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
constexpr int kBarrierOffset = kRowSumOffset + 2 * 64 * 4;    // uint64 ready[4], free[4], q
constexpr int kSmemBytes = kBarrierOffset + 9 * 8 + 1024;     // + slack for base alignment
static_assert(kSmemBytes <= 227 * 1024, "exceeds the sm90 shared memory per block");

// The feature chunks [first, end) of half h of a kv buffer.
__host__ __device__ constexpr int HalfFirstChunk(int half) { return half == 0 ? 0 : 4; }
__host__ __device__ constexpr int HalfEndChunk(int half) { return half == 0 ? 4 : kChunksQK; }

// Named barrier ids (CUTLASS offsets them past its reserved ones), all among the 256
// consumer threads.
enum ConsumerBarrier : uint32_t {
  kEvenMaxReady = 0,    // WG0's row max m0 of the pair is in shared memory
  kOddMaxReady = 1,     // WG1's row max m1 (the pair's common max) is in shared memory
  kEvenProbsReady = 2,  // WG0's probabilities (rescaled to m1) are in shared memory
  kOddProbsReady = 3,   // WG1's probabilities are in shared memory
  kRowSumReady = 4,     // both WGs' row sums are in shared memory (epilogue)
  kOutStaged = 5,       // + kWg: the WG's normalised output slice is staged in shared memory
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
  int num_sms;                // SMs of the device (the L2 prefetch of the next CTA's Q)
  float sm_scale;
  float scale_log2;           // sm_scale * log2(e): softmax runs in base 2
};

// Where one CTA's shared memory pieces live, and which problem tile it owns.
struct Cta {
  uint8_t* q_tile;            // [64 heads x 576] swizzled
  uint8_t* kv_tiles;          // two [64 rows x 576] swizzled buffers
  uint8_t* probs1_tile;       // [64 x 64] bf16 probabilities of WG1's block, swizzled
  float (*row_max)[64];       // [wg][row] m0 (WG0) and m1 (WG1) of the current pair
  float (*row_sum)[64];       // [wg][row] row sums
  uint64_t* half_ready;       // [buffer * 2 + half] producer -> consumers (cp.async arrivals)
  uint64_t* half_free;        // [buffer * 2 + half] consumers -> producer
  uint64_t* q_ready;          // producer -> consumers (cp.async arrivals): the Q tile landed
  int64_t batch;
  int64_t row0;               // first row of this CTA's 64 heads in the [.., s_q, h_q] arrays
  int num_pairs, num_blocks;
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

// 2^x on the MUFU alone. exp2f without fast math guards every call against a denormal
// result (a compare and two predicated multiplies around the MUFU); softmax weights below
// 2^-126 are as good as zero, so the flush-to-zero form does.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
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
  {  // The Q tile [64 heads x 576], ahead of the first kv block: 36 16-byte units a thread.
    const uint8_t* q_rows = reinterpret_cast<const uint8_t*>(p.q + cta.row0 * kDimQK);
#pragma unroll 4
    for (int u = tid; u < kHeadsPerCta * kUnitsPerRow; u += 128) {
      const int row = u / kUnitsPerRow, unit = u % kUnitsPerRow;
      CpAsync16ZeroFill(cta.q_tile + (unit / 8) * kChunkBytes + sm90::Swizzle128Offset(row, unit % 8),
                        q_rows + row * kDimQK * 2 + unit * 16, true);
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(cta.q_ready);
  }
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
  // The CTA that starts on a freed SM next is about num_sms launch slots ahead: pull its
  // Q tile into L2 now, so that its first QK^T does not wait for DRAM. (Consecutive CTAs
  // of a batch element own consecutive 64-row tiles of q.)
  if (tid == 0 && blockIdx.x + p.num_sms < gridDim.x) {
    const __nv_bfloat16* next_q = p.q + (cta.row0 + int64_t{p.num_sms} * kHeadsPerCta) * kDimQK;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(next_q),
                 "r"(kHeadsPerCta * kDimQK * 2)
                 : "memory");
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Per-thread helpers of the consumer warpgroups. A thread holds rows frag_row and
// frag_row + 8 of a 64-column accumulator tile, columns 8*j + frag_col + {0, 1}.
struct Lane {
  int frag_row;
  int frag_col;
};

// Validity bits of this thread's score columns of `block`: bit 2*j + c for column
// 8*j + frag_col + c. The pad block (past the end) has none.
__device__ __forceinline__ uint32_t LoadValidColumns(const Params& p, const Cta& cta,
                                                     const Lane& lane, int block) {
  if (block >= cta.num_blocks) return 0;
  uint32_t bits = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int2 listed = __ldg(reinterpret_cast<const int2*>(
        cta.row_indices + block * kTopkPerBlock + 8 * j + lane.frag_col));
    bits |= (IsValidIndex(listed.x, p.s_kv) ? 1u : 0u) << (2 * j);
    bits |= (IsValidIndex(listed.y, p.s_kv) ? 1u : 0u) << (2 * j + 1);
  }
  return bits;
}

// Issues S (+)= Q K^T over the feature chunks of half kHalf of kv buffer `buffer`, after
// the producer's copies into that half have landed. The caller commits the batch.
template <int kHalf>
__device__ __forceinline__ void IssueQk(const Cta& cta, int buffer, int phase, bool first,
                                        float (&acc_s)[32]) {
  ClusterBarrier::wait(cta.ready_barrier(buffer, kHalf), phase);
  cutlass::arch::fence_view_async_shared();  // cp.async (generic proxy) data -> wgmma
  cute::warpgroup_arrive();
  // Descriptors of the first chunk, opaque to the compiler so that it does not hoist all
  // 36 per-step descriptors out of the kv loop (72 registers); each step adds its offset.
  uint64_t desc_q = sm90::MakeSwizzle128Desc(cta.q_tile, 16, sm90::kSwizzleAtomBytes);
  uint64_t desc_k = sm90::MakeSwizzle128Desc(cta.kv_tile(buffer), 16, sm90::kSwizzleAtomBytes);
  asm volatile("" : "+l"(desc_q), "+l"(desc_k));
#pragma unroll
  for (int k = 4 * HalfFirstChunk(kHalf); k < 4 * HalfEndChunk(kHalf); ++k) {
    const uint64_t offset = ((k / 4) * kChunkBytes + (k % 4) * 32) >> 4;  // 16-byte units
    sm90::Gmma64x64x16SS(desc_q + offset, desc_k + offset, acc_s,
                         first && k == 4 * HalfFirstChunk(kHalf) ? sm90::ScaleOut::Zero
                                                                 : sm90::ScaleOut::One);
  }
}

// Invalid indices score -inf.
__device__ __forceinline__ void MaskScores(uint32_t valid_columns, float (&acc_s)[32]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (!((valid_columns >> (2 * j + c)) & 1u)) {
        acc_s[4 * j + c] = -INFINITY;
        acc_s[4 * j + 2 + c] = -INFINITY;
      }
    }
  }
}

// Raw masked scores straight from the fragments, before the softmax touches them: a
// warp's float2 stores cover 32 contiguous bytes of each of 8 rows; streaming stores, so
// the scores do not push the gathered kv rows out of L2.
__device__ __forceinline__ void StoreScores(const Params& p, const Cta& cta, const Lane& lane,
                                            int block, const float (&acc_s)[32]) {
  if (block >= cta.num_blocks) return;  // the pad block
  float* scores_tile = p.scores + cta.row0 * p.topk +
                       block * kTopkPerBlock;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float* row_ptr =
        scores_tile + static_cast<int64_t>(lane.frag_row + 8 * half) * p.topk + lane.frag_col;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      __stcs(reinterpret_cast<float2*>(row_ptr + 8 * j),
             make_float2(acc_s[4 * j + 2 * half], acc_s[4 * j + 2 * half + 1]));
  }
}

// Row maxima of the score tile, over the 4 threads that share each row.
__device__ __forceinline__ void RowMax(const float (&acc_s)[32], float (&block_max)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      m = fmaxf(m, fmaxf(acc_s[4 * j + 2 * half], acc_s[4 * j + 2 * half + 1]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
    block_max[half] = m;
  }
}

// exp2 shift of a row max in the base-2 softmax; a row that has seen no valid entry
// (max -inf) shifts by 0 so that exp2 stays 0 instead of NaN.
__device__ __forceinline__ float Shift(float row_max, float scale_log2) {
  return row_max == -INFINITY ? 0.f : row_max * scale_log2;
}

// Rescales the output accumulator and the row sums by a factor per row.
__device__ __forceinline__ void Rescale(const float (&factor)[2], float (&acc_o)[128],
                                        float (&row_sum)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] *= factor[half];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      acc_o[4 * j + 2 * half] *= factor[half];
      acc_o[4 * j + 2 * half + 1] *= factor[half];
    }
  }
}

// P = exp2(S * scale_log2 - shift) in place (float) and as bf16 pairs in the A-operand
// layout, added to this thread's row sums.
__device__ __forceinline__ void Exponentiate(const float (&shift)[2], float scale_log2,
                                             float (&acc_s)[32], uint32_t (&probs)[16],
                                             float (&row_sum)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float& p0 = acc_s[4 * j + 2 * half];
      float& p1 = acc_s[4 * j + 2 * half + 1];
      p0 = Exp2(fmaf(p0, scale_log2, -shift[half]));
      p1 = Exp2(fmaf(p1, scale_log2, -shift[half]));
      row_sum[half] += p0 + p1;
      __nv_bfloat162 pair_bf16 = __floats2bfloat162_rn(p0, p1);
      probs[2 * j + half] = *reinterpret_cast<uint32_t*>(&pair_bf16);
    }
  }
}

// Stores bf16 probabilities (as `factor` x the float ones in acc_s) into a K-major
// swizzled A tile for the peer's PV, fenced for wgmma.
__device__ __forceinline__ void PublishProbs(uint8_t* tile, const Lane& lane,
                                             const float (&acc_s)[32], const float (&factor)[2]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      __nv_bfloat162 pair_bf16 = __floats2bfloat162_rn(acc_s[4 * j + 2 * half] * factor[half],
                                                       acc_s[4 * j + 2 * half + 1] * factor[half]);
      *reinterpret_cast<__nv_bfloat162*>(
          tile + sm90::Swizzle128Offset(lane.frag_row + 8 * half, j) + lane.frag_col * 2) =
          pair_bf16;
    }
  }
  cutlass::arch::fence_view_async_shared();
}

// acc_o += P @ V[:, 256*kWg : 256*kWg + 256] of kv buffer `buffer`, with P from
// registers (the WG's own block) or from a shared tile (the peer's). V is MN-major: 16
// topk rows per step, 64-value chunks kChunkBytes apart. The caller commits the batch.
template <int kWg>
__device__ __forceinline__ void IssuePvLocal(const Cta& cta, const uint32_t (&probs)[16],
                                             float (&acc_o)[128]) {
  const uint8_t* v_tile = cta.kv_tile(kWg) + kWg * kValueChunksPerWg * kChunkBytes;
  cute::warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < kTopkPerBlock / 16; ++k) {
    const uint32_t a[4] = {probs[4 * k], probs[4 * k + 1], probs[4 * k + 2], probs[4 * k + 3]};
    sm90::Gmma64x256x16RS(
        a,
        sm90::MakeSwizzle128Desc(v_tile + k * 16 * sm90::kSwizzleRowBytes, kChunkBytes,
                                 sm90::kSwizzleAtomBytes),
        acc_o);
  }
}

template <int kWg>
__device__ __forceinline__ void IssuePvRemote(const Cta& cta, float (&acc_o)[128]) {
  constexpr int kPeer = kWg ^ 1;
  const uint8_t* v_tile = cta.kv_tile(kPeer) + kWg * kValueChunksPerWg * kChunkBytes;
  const uint8_t* p_tile = cta.probs_tile(kPeer);
  cute::warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < kTopkPerBlock / 16; ++k) {
    sm90::Gmma64x256x16SS(
        sm90::MakeSwizzle128Desc(p_tile + k * 32, 16, sm90::kSwizzleAtomBytes),
        sm90::MakeSwizzle128Desc(v_tile + k * 16 * sm90::kSwizzleRowBytes, kChunkBytes,
                                 sm90::kSwizzleAtomBytes),
        acc_o);
  }
}

// Writes this WG's 64 x 256 output slice, normalised by `inv`, through shared memory so
// that global stores are 16 bytes a thread and 512 contiguous bytes a warp (the fragment
// layout would give 4-byte stores spread over 8 rows). The slice is staged in the WG's
// half of the Q tile, free once both WGs are past their last QK^T (the caller's
// kRowSumReady barrier); 16-byte units are XOR-swizzled by row so that neither side of
// the round trip has bank conflicts.
template <int kWg>
__device__ __forceinline__ void StoreOutput(const Params& p, const Cta& cta, const Lane& lane,
                                            int tid, const float (&inv)[2],
                                            const float (&acc_o)[128]) {
  constexpr int kRowBytes = kValueChunksPerWg * 64 * 2;  // the WG's 256 bf16 values
  static_assert(kRowBytes / 16 == 32, "one warp stores one staged row");
  const uint32_t stage =
      static_cast<uint32_t>(__cvta_generic_to_shared(cta.q_tile)) + kWg * kHeadsPerCta * kRowBytes;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = lane.frag_row + 8 * half;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      __nv_bfloat162 pair = __floats2bfloat162_rn(acc_o[4 * j + 2 * half] * inv[half],
                                                  acc_o[4 * j + 2 * half + 1] * inv[half]);
      const uint32_t address =
          stage + row * kRowBytes + ((j ^ (row & 7)) << 4) + lane.frag_col * 2;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address),
                   "r"(*reinterpret_cast<uint32_t*>(&pair)));
    }
  }
  NamedBarrier::sync(128, kOutStaged + kWg);
  const int warp = tid / 32, unit = tid % 32;
  __nv_bfloat16* out = p.out + cta.row0 * kDimV + kWg * kValueChunksPerWg * 64 + unit * 8;
#pragma unroll 4
  for (int row = warp; row < kHeadsPerCta; row += 4) {
    uint4 value;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
                 : "r"(stage + row * kRowBytes + ((unit ^ (row & 7)) << 4)));
    *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * kDimV) = value;
  }
}

// Consumer warpgroup kWg (0 or 1) over every pair of blocks: WG0 takes the even blocks
// (buffer 0), WG1 the odd ones (buffer 1), each owns 256 of the 512 output values. The
// two run staggered rather than in lockstep, so that one WG's softmax overlaps the other
// WG's wgmma:
//   WG0: softmax with m0 = max(running, own block) -> publishes m0 -> PV of its own block
//        -> waits for WG1's m1 -> rescales its probabilities and output from m0 to m1,
//        publishes the probabilities -> PV of WG1's block, and under it QK^T of its next
//        block.
//   WG1: QK^T -> waits for m0 -> softmax with m1 = max(m0, own block) -> publishes m1 ->
//        PV of its own block -> publishes its probabilities -> PV of WG0's block.
// m1 is then the common running max of both WGs' outputs and row sums.
template <int kWg, bool kStoreScores>
__device__ __forceinline__ void Consume(const Params& p, const Cta& cta, int tid) {
  constexpr int kPeer = kWg ^ 1;
  const Lane lane{16 * (tid / 32) + (tid % 32) / 4, 2 * (tid % 4)};

  // The producer's Q copies; the fence before each QK^T (IssueQk) covers them too.
  ClusterBarrier::wait(cta.q_ready, 0);

  float acc_o[128];          // this WG's 64 x 256 slice of the output
  float acc_s[32];           // 64 x 64 scores (then probabilities) of this WG's block
  uint32_t probs[16];        // bf16 pairs of the probabilities, A-operand layout
  uint32_t valid_columns;    // LoadValidColumns of the block in acc_s
  float running_max[2] = {-INFINITY, -INFINITY};  // common raw-score row max so far
  float row_sum[2] = {0.f, 0.f};  // this thread's partial sum of this WG's probabilities
#pragma unroll
  for (int i = 0; i < 128; ++i) acc_o[i] = 0.f;

  if constexpr (kWg == 0) {  // QK^T of block 0; later ones are issued under the last PV
    valid_columns = LoadValidColumns(p, cta, lane, 0);
    sm90::FenceOperands(acc_s);
    IssueQk<0>(cta, 0, 0, true, acc_s);
    IssueQk<1>(cta, 0, 0, false, acc_s);
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    sm90::FenceOperands(acc_s);
  }

  for (int pair = 0; pair < cta.num_pairs; ++pair) {
    const int block = 2 * pair + kWg;
    const int phase = pair & 1;
    if constexpr (kWg == 1) {  // starting with the half the producer refilled first
      valid_columns = LoadValidColumns(p, cta, lane, block);
      sm90::FenceOperands(acc_s);
      IssueQk<1>(cta, 1, phase, true, acc_s);
      IssueQk<0>(cta, 1, phase, false, acc_s);
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      sm90::FenceOperands(acc_s);
    }
    MaskScores(valid_columns, acc_s);
    float block_max[2], new_max[2];
    RowMax(acc_s, block_max);
    if constexpr (kWg == 0) {
      // m0, published before the score store so that WG1 can go on meanwhile.
#pragma unroll
      for (int half = 0; half < 2; ++half) new_max[half] = fmaxf(running_max[half], block_max[half]);
      if (tid % 4 == 0) {
        cta.row_max[0][lane.frag_row] = new_max[0];
        cta.row_max[0][lane.frag_row + 8] = new_max[1];
      }
      NamedBarrier::arrive(kConsumerThreads, kEvenMaxReady);
      if constexpr (kStoreScores) StoreScores(p, cta, lane, block, acc_s);
    } else {
      if constexpr (kStoreScores) StoreScores(p, cta, lane, block, acc_s);
      NamedBarrier::sync(kConsumerThreads, kEvenMaxReady);
#pragma unroll
      for (int half = 0; half < 2; ++half)
        new_max[half] = fmaxf(cta.row_max[0][lane.frag_row + 8 * half], block_max[half]);
      if (tid % 4 == 0) {
        cta.row_max[1][lane.frag_row] = new_max[0];
        cta.row_max[1][lane.frag_row + 8] = new_max[1];
      }
      NamedBarrier::arrive(kConsumerThreads, kOddMaxReady);
    }

    float shift[2], rescale[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      shift[half] = Shift(new_max[half], p.scale_log2);
      rescale[half] = Exp2(running_max[half] * p.scale_log2 - shift[half]);
    }
    Rescale(rescale, acc_o, row_sum);
    Exponentiate(shift, p.scale_log2, acc_s, probs, row_sum);

    sm90::FenceOperands(acc_o);
    sm90::FenceOperands(probs);
    IssuePvLocal<kWg>(cta, probs, acc_o);
    cute::warpgroup_commit_batch();

    if constexpr (kWg == 0) {
      cute::warpgroup_wait<0>();
      sm90::FenceOperands(acc_o);
      sm90::FenceOperands(probs);
      ClusterBarrier::arrive(cta.free_barrier(0, 0));
      // From m0 to WG1's m1, the common max of the pair: the output and sums so far, and
      // the probabilities WG1 multiplies by its half of the values.
      NamedBarrier::sync(kConsumerThreads, kOddMaxReady);
      float to_common[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float common = cta.row_max[1][lane.frag_row + 8 * half];
        // While WG0 has seen no valid entry of a row, its output and sums are 0.
        to_common[half] = new_max[half] == -INFINITY
                              ? 0.f
                              : Exp2(shift[half] - Shift(common, p.scale_log2));
        running_max[half] = common;
      }
      PublishProbs(cta.probs_tile(0), lane, acc_s, to_common);
      NamedBarrier::arrive(kConsumerThreads, kEvenProbsReady);
      Rescale(to_common, acc_o, row_sum);
      NamedBarrier::sync(kConsumerThreads, kOddProbsReady);
      sm90::FenceOperands(acc_o);
      IssuePvRemote<0>(cta, acc_o);
      cute::warpgroup_commit_batch();
      if (pair + 1 < cta.num_pairs) {  // QK^T of the next block under the PV
        const int next_phase = (pair + 1) & 1;
        sm90::FenceOperands(acc_s);
        IssueQk<0>(cta, 0, next_phase, true, acc_s);
        cute::warpgroup_commit_batch();
        valid_columns = LoadValidColumns(p, cta, lane, block + 2);
        cute::warpgroup_wait<1>();
        ClusterBarrier::arrive(cta.free_barrier(1, 0));
        IssueQk<1>(cta, 0, next_phase, false, acc_s);
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        sm90::FenceOperands(acc_s);
      } else {
        cute::warpgroup_wait<0>();
        ClusterBarrier::arrive(cta.free_barrier(1, 0));
      }
      sm90::FenceOperands(acc_o);
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) running_max[half] = new_max[half];
      const float unscaled[2] = {1.f, 1.f};
      PublishProbs(cta.probs_tile(1), lane, acc_s, unscaled);
      NamedBarrier::sync(kConsumerThreads, kEvenProbsReady);
      IssuePvRemote<1>(cta, acc_o);
      cute::warpgroup_commit_batch();
      NamedBarrier::arrive(kConsumerThreads, kOddProbsReady);
      cute::warpgroup_wait<1>();
      ClusterBarrier::arrive(cta.free_barrier(1, 1));
      cute::warpgroup_wait<0>();
      ClusterBarrier::arrive(cta.free_barrier(0, 1));
      sm90::FenceOperands(acc_o);
      sm90::FenceOperands(probs);
    }
  }

  // Epilogue: total row sums over both WGs, normalise, store.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffff, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffff, row_sum[half], 2);
  }
  if (tid % 4 == 0) {
    cta.row_sum[kWg][lane.frag_row] = row_sum[0];
    cta.row_sum[kWg][lane.frag_row + 8] = row_sum[1];
  }
  NamedBarrier::sync(kConsumerThreads, kRowSumReady);
  float total[2];
#pragma unroll
  for (int half = 0; half < 2; ++half)
    total[half] = row_sum[half] + cta.row_sum[kPeer][lane.frag_row + 8 * half];

  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) inv[half] = total[half] > 0.f ? 1.f / total[half] : 0.f;
  StoreOutput<kWg>(p, cta, lane, tid, inv, acc_o);
  if (kWg == 0 && tid % 4 == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = cta.row0 + lane.frag_row + 8 * half;
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
  // Rounded up through an integer, which hides from the compiler that the pieces below are
  // shared memory. Pointer arithmetic on the array (shared loads and stores instead of
  // generic ones) measured 5-7% slower with the score output (2026-11-25).
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
  cta.q_ready = cta.half_ready + 8;
  const int head_tiles = p.h_q / kHeadsPerCta;
  cta.batch = blockIdx.y;
  const int s_idx = blockIdx.x / head_tiles;
  cta.row0 = (cta.batch * p.s_q + s_idx) * p.h_q + (blockIdx.x % head_tiles) * kHeadsPerCta;
  cta.num_blocks = p.topk / kTopkPerBlock;
  cta.num_pairs = (cta.num_blocks + 1) / 2;
  cta.row_indices = p.indices + (cta.batch * p.s_q + s_idx) * p.topk;

  if (threadIdx.x == 0) {
    for (int buffer = 0; buffer < 2; ++buffer) {
      for (int half = 0; half < 2; ++half) {
        // One cp.async arrival per producer thread.
        ClusterBarrier::init(cta.ready_barrier(buffer, half), 128);
        // Released by the WG whose PV reads the half last (see Consume).
        ClusterBarrier::init(cta.free_barrier(buffer, half), 128);
      }
    }
    ClusterBarrier::init(cta.q_ready, 128);
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

// Checks for a compute capability 9.0 device and reads its SM count.
ffi::Error QuerySm90Device(int& num_sms) {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
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
  int num_sms = 0;
  if (auto e = QuerySm90Device(num_sms); e.failure()) return e;

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
    params.num_sms = num_sms;
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
