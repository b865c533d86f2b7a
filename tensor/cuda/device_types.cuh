// Device-side views of Tally's element types, loads/stores through the accumulation type,
// and the strided indexer every elementwise kernel uses.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "tensor/tensor.h"

namespace tally::cuda {

// Storage type on the device for a host scalar type: CUDA's own 16-bit float types stand
// for Half and BFloat16 (same bits), so kernels use their intrinsics.
template <typename T>
using dev_t = std::conditional_t<std::is_same_v<T, Half>, __half,
                                 std::conditional_t<std::is_same_v<T, BFloat16>, __nv_bfloat16, T>>;

// Accumulation type on the device: float for the 16-bit floats, T itself otherwise.
template <typename T>
using dacc_t =
    std::conditional_t<std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, float, T>;

template <typename T>
__device__ __forceinline__ dacc_t<T> load(const T& v) {
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(v);
  else
    return v;
}

template <typename T, typename A>
__device__ __forceinline__ T store(A v) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, bool>)
    return static_cast<double>(v) != 0.0;
  else
    return static_cast<T>(v);
}

inline constexpr int kMaxDims = 10;

// Element offsets of N operands for a linear index over a (coalesced) shape.
template <int N>
struct Indexer {
  int ndim = 0;
  int64_t sizes[kMaxDims];
  int64_t strides[N][kMaxDims];
  int64_t base[N];

  __device__ __forceinline__ void get(int64_t linear, int64_t* off) const {
    if (ndim <= 1) {  // contiguous-like: no divisions
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] = base[k] + (ndim ? linear * strides[k][0] : 0);
      return;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = base[k];
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t sz = sizes[d];
      const int64_t idx = linear % sz;
      linear /= sz;
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += idx * strides[k][d];
    }
  }

  // get() for a linear index below 2^32 (every launch over fewer than 2^31 elements): the
  // same offsets, with 32-bit divisions, several times cheaper than 64-bit ones on the GPU.
  __device__ __forceinline__ void get32(uint32_t linear, int64_t* off) const {
    if (ndim <= 1) {
#pragma unroll
      for (int k = 0; k < N; ++k)
        off[k] = base[k] + (ndim ? static_cast<int64_t>(linear) * strides[k][0] : 0);
      return;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = base[k];
    for (int d = ndim - 1; d >= 0; --d) {
      const uint32_t sz = static_cast<uint32_t>(sizes[d]);
      const uint32_t q = linear / sz;
      const int64_t idx = static_cast<int64_t>(linear - q * sz);
      linear = q;
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += idx * strides[k][d];
    }
  }
};

// Builds the indexer over `sizes` for operands with `strides` (same rank) and element
// offsets: size-1 dims dropped, dims contiguous for every operand merged.
template <int N>
Indexer<N> make_indexer(const Shape& sizes, const std::vector<const Shape*>& strides,
                        const std::vector<int64_t>& offsets) {
  Indexer<N> ix;
  std::vector<int64_t> sz;
  std::vector<std::vector<int64_t>> st(N);
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1) continue;
    bool merge = !sz.empty();
    for (int k = 0; k < N && merge; ++k) merge = st[k].back() == (*strides[k])[d] * sizes[d];
    if (merge) {
      sz.back() *= sizes[d];
      for (int k = 0; k < N; ++k) st[k].back() = (*strides[k])[d];
      continue;
    }
    sz.push_back(sizes[d]);
    for (int k = 0; k < N; ++k) st[k].push_back((*strides[k])[d]);
  }
  if (sz.size() > static_cast<size_t>(kMaxDims))
    throw std::invalid_argument("CUDA elementwise: more than 10 non-mergeable dimensions");
  ix.ndim = static_cast<int>(sz.size());
  for (size_t d = 0; d < sz.size(); ++d) {
    ix.sizes[d] = sz[d];
    for (int k = 0; k < N; ++k) ix.strides[k][d] = st[k][d];
  }
  for (int k = 0; k < N; ++k) ix.base[k] = offsets[static_cast<size_t>(k)];
  return ix;
}

template <typename T>
dev_t<T>* dptr(const Tensor& t) {
  return static_cast<dev_t<T>*>(t.storage().data());
}

}  // namespace tally::cuda
