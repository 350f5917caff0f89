// Hopper (sm_90a) building blocks shared by our kernels: the 128-byte swizzled shared
// memory layout that wgmma reads, wgmma descriptors for it, and calls of CUTLASS's
// wgmma atoms with plain float arrays as accumulators.
#pragma once

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

namespace omni_jax::sm90 {

// A tile of bf16 rows is stored as 64-feature column chunks (128 bytes per row); inside
// a chunk, 8-row x 128-byte atoms are swizzled: the 16-byte unit u of row r lands at
// unit u ^ (r % 8). Chunks and tiles must be 1024-byte aligned.
constexpr int kSwizzleRowBytes = 128;
constexpr int kSwizzleAtomBytes = 8 * kSwizzleRowBytes;

// Byte offset of 16-byte unit `unit` (0..7) of row `row` inside one column chunk.
__device__ __forceinline__ uint32_t Swizzle128Offset(int row, int unit) {
  return row * kSwizzleRowBytes + ((unit ^ (row & 7)) << 4);
}

// wgmma shared memory descriptor for the 128-byte swizzled layout.
//   K-major operand (rows = M/N, 64 contiguous K values per row): leading_bytes unused,
//     stride_bytes = distance between 8-row groups (kSwizzleAtomBytes).
//   MN-major operand (rows = K, 64 contiguous N values per row): leading_bytes = distance
//     between 64-wide N chunks, stride_bytes = distance between 8-row K groups.
__device__ __forceinline__ uint64_t MakeSwizzle128Desc(const void* smem, uint32_t leading_bytes,
                                                       uint32_t stride_bytes) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ =
      static_cast<uint16_t>(static_cast<uint32_t>(__cvta_generic_to_shared(smem)) >> 4);
  desc.bitfield.leading_byte_offset_ = static_cast<uint16_t>(leading_bytes >> 4);
  desc.bitfield.stride_byte_offset_ = static_cast<uint16_t>(stride_bytes >> 4);
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = static_cast<uint8_t>(cute::SM90::GMMA::LayoutType::B128);
  return desc.desc_;
}

namespace detail {
template <class Atom, size_t N, size_t... I>
__device__ __forceinline__ void GmmaSS(uint64_t desc_a, uint64_t desc_b, float (&acc)[N],
                                       cute::SM90::GMMA::ScaleOut scale, std::index_sequence<I...>) {
  Atom::fma(desc_a, desc_b, acc[I]..., scale);
}
template <class Atom, size_t N, size_t... I>
__device__ __forceinline__ void GmmaRS(const uint32_t (&a)[4], uint64_t desc_b, float (&acc)[N],
                                       cute::SM90::GMMA::ScaleOut scale, std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], desc_b, acc[I]..., scale);
}
}  // namespace detail

using cute::SM90::GMMA::Major;
using cute::SM90::GMMA::ScaleOut;

// acc[64x64] (+)= A[64x16] * B[16x64]^T, A and B K-major in shared memory.
__device__ __forceinline__ void Gmma64x64x16SS(uint64_t desc_a, uint64_t desc_b, float (&acc)[32],
                                               ScaleOut scale) {
  detail::GmmaSS<cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<Major::K, Major::K>>(
      desc_a, desc_b, acc, scale, std::make_index_sequence<32>{});
}

// acc[64x256] += A[64x16] * B[16x256], A K-major in shared memory, B MN-major.
__device__ __forceinline__ void Gmma64x256x16SS(uint64_t desc_a, uint64_t desc_b,
                                                float (&acc)[128]) {
  detail::GmmaSS<cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<Major::K, Major::MN>>(
      desc_a, desc_b, acc, ScaleOut::One, std::make_index_sequence<128>{});
}

// acc[64x256] += A[64x16] * B[16x256], A in registers (accumulator layout, bf16 pairs),
// B MN-major in shared memory.
__device__ __forceinline__ void Gmma64x256x16RS(const uint32_t (&a)[4], uint64_t desc_b,
                                                float (&acc)[128]) {
  detail::GmmaRS<cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<Major::K, Major::MN>>(
      a, desc_b, acc, ScaleOut::One, std::make_index_sequence<128>{});
}

template <size_t N>
__device__ __forceinline__ void FenceOperands(float (&regs)[N]) {
#pragma unroll
  for (size_t i = 0; i < N; ++i) cute::warpgroup_fence_operand(regs[i]);
}

template <size_t N>
__device__ __forceinline__ void FenceOperands(uint32_t (&regs)[N]) {
#pragma unroll
  for (size_t i = 0; i < N; ++i) cute::warpgroup_fence_operand(regs[i]);
}

}  // namespace omni_jax::sm90
