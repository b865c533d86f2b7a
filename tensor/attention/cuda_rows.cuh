// Internal to the attention family's CUDA kernels (tensor/attention/cuda.cu, cuda_fp32.cu):
// how they address a [B, H, T, E] tensor and add into the float32 dq accumulator.
#pragma once

#include <cstdint>

#include "tensor/op_alloc.h"
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

// Where both flash-attention backwards (16-bit and float32) start: q [B, H, L, E] and k
// [B, H, S, E] on device dev, rows = B H L, and the float32 scratch dvec [B, H, L] (dO . O).
struct BwdFrame {
  int dev;
  int64_t B, H, L, E, S, rows;
  Tensor dvec;
};

inline BwdFrame bwd_frame(const Tensor& q, const Tensor& k) {
  const int64_t rows = q.size(0) * q.size(1) * q.size(2);
  return {q.device().index, q.size(0), q.size(1), q.size(2),
          q.size(3),        k.size(2), rows,      alloc_scratch(rows, DType::float32, q.device())};
}

// Zeroes a register tile, unrolled (the tile stays in registers).
template <int M, int N>
__device__ __forceinline__ void zero_tile(float (&t)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) t[i][j] = 0.f;
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
