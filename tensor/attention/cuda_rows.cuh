// Internal to the attention family's CUDA kernels (tensor/attention/cuda.cu, cuda_fp32.cu):
// how they address a [B, H, T, E] tensor and add into the float32 dq accumulator.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace tally::cuda {

// A [B, H, T, E] tensor as the attention kernels address it: base pointer (storage offset
// applied) and the element strides of b, h and t. T is const-qualified for inputs.
template <typename T>
struct BhtRows {
  T* p;
  int64_t sb, sh, st;
  // The first row of the (b, h) = (bh / H, bh % H) slice.
  __device__ __forceinline__ T* rows(int bh, int H) const {
    return p + static_cast<int64_t>(bh / H) * sb + static_cast<int64_t>(bh % H) * sh;
  }
};

template <typename T>
BhtRows<T> bht_rows(const Tensor& t) {
  return {static_cast<T*>(t.storage().data()) + t.storage_offset(), t.strides()[0], t.strides()[1],
          t.strides()[2]};
}

// dst[0] += a, dst[1] += b (dst 8-byte aligned): one float2 atomic on sm_90, two otherwise.
__device__ __forceinline__ void add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// dst[0..3] += a, b, c, d (dst 16-byte aligned): one float4 atomic on sm_90, four otherwise.
__device__ __forceinline__ void add4(float* dst, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), make_float4(a, b, c, d));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
  atomicAdd(dst + 2, c);
  atomicAdd(dst + 3, d);
#endif
}

}  // namespace tally::cuda
