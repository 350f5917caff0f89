// Shape checks for XLA FFI handlers that return an ffi::Error naming the operand.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace omni_jax {

namespace ffi = xla::ffi;

inline std::string FormatDims(ffi::Span<const int64_t> dims) {
  std::ostringstream text;
  text << "[";
  for (size_t i = 0; i < dims.size(); ++i) text << (i ? ", " : "") << dims[i];
  text << "]";
  return text.str();
}

// Splits `dims` into `batch_rank` leading dimensions (their product goes to `batch`) and
// `rank` trailing ones (vmap with vmap_method="broadcast_all" prepends batch dimensions).
inline ffi::Error SplitBatch(const char* op, const char* name, ffi::Span<const int64_t> dims,
                             size_t rank, size_t batch_rank, int64_t& batch,
                             ffi::Span<const int64_t>& trailing) {
  if (dims.size() != rank + batch_rank) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must have rank " +
                                       std::to_string(rank + batch_rank) + ", got shape " +
                                       FormatDims(dims));
  }
  batch = 1;
  for (size_t i = 0; i < batch_rank; ++i) batch *= dims[i];
  trailing = ffi::Span<const int64_t>(dims.begin() + batch_rank, rank);
  return ffi::Error::Success();
}

// Checks that `dims` equals `expected`; the message shows both.
inline ffi::Error ExpectDims(const char* op, const char* name, ffi::Span<const int64_t> dims,
                             ffi::Span<const int64_t> expected) {
  bool same = dims.size() == expected.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = dims[i] == expected[i];
  if (same) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must have shape " +
                                     FormatDims(expected) + ", got " + FormatDims(dims));
}

}  // namespace omni_jax
