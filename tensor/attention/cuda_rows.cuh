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

// The attention mask as the kernels read it (AttentionKernels' mask, tensor/attention/
// kernels.h): [B, H, L, S] element strides, 0 on broadcast dims; kind kNoMask (p null),
// kBoolMask (bool, true = take part) or kBiasMask (float32 bias, natural-log units).
constexpr int kNoMask = 0, kBoolMask = 1, kBiasMask = 2;
struct MaskRows {
  const void* p;
  int64_t sb, sh, sl, ss;
  // Whether two neighbouring columns (col even) are one aligned 2-element load: ss == 1, S
  // even, and every row starts 2-element aligned (mask_rows decides).
  bool pairs;
  // The offset (elements) of the (b, h) = (bh / H, bh % H) slice.
  __device__ __forceinline__ int64_t base(int bh, int H) const {
    return static_cast<int64_t>(bh / H) * sb + static_cast<int64_t>(bh % H) * sh;
  }
  // The base-2 bias (times log2 e) of the element at offset o: -inf where a bool mask is
  // false, 0 where true.
  template <int kKind>
  __device__ __forceinline__ float log2_at(int64_t o, float log2e) const {
    if constexpr (kKind == kBoolMask) {
      return __ldg(static_cast<const unsigned char*>(p) + o) ? 0.f : -INFINITY;
    } else {
      return __ldg(static_cast<const float*>(p) + o) * log2e;
    }
  }
  // Columns col and col + 1 (col even) of the row at offset orow: 0 past S (those scores are
  // masked by the caller anyway).
  template <int kKind>
  __device__ __forceinline__ float2 log2_two(int64_t orow, int col, int S, float log2e) const {
    if (pairs) {
      if (col >= S) return make_float2(0.f, 0.f);
      const int64_t o = (orow + col) / 2;
      if constexpr (kKind == kBoolMask) {
        const uchar2 v = __ldg(static_cast<const uchar2*>(p) + o);
        return make_float2(v.x ? 0.f : -INFINITY, v.y ? 0.f : -INFINITY);
      } else {
        const float2 v = __ldg(static_cast<const float2*>(p) + o);
        return make_float2(v.x * log2e, v.y * log2e);
      }
    }
    return make_float2(
        col < S ? log2_at<kKind>(orow + static_cast<int64_t>(col) * ss, log2e) : 0.f,
        col + 1 < S ? log2_at<kKind>(orow + static_cast<int64_t>(col + 1) * ss, log2e) : 0.f);
  }
  // The same for (row, col) of the slice at offset `base`.
  template <int kKind>
  __device__ __forceinline__ float log2_bias(int64_t base, int row, int col, float log2e) const {
    return log2_at<kKind>(base + static_cast<int64_t>(row) * sl + static_cast<int64_t>(col) * ss,
                          log2e);
  }
};

inline int mask_kind(const Tensor& m) {
  if (!m.defined()) return kNoMask;
  return m.dtype() == DType::bool_ ? kBoolMask : kBiasMask;
}

inline MaskRows mask_rows(const Tensor& m) {
  if (!m.defined()) return {nullptr, 0, 0, 0, 0, false};
  const char* p = static_cast<const char*>(m.storage().data()) +
                  m.storage_offset() * static_cast<int64_t>(m.element_size());
  bool pairs = m.strides()[3] == 1 && m.size(3) % 2 == 0 &&
               reinterpret_cast<uintptr_t>(p) % (2 * m.element_size()) == 0;
  for (int d = 0; d < 3; ++d) pairs = pairs && (m.strides()[d] % 2 == 0 || m.size(d) == 1);
  return {p, m.strides()[0], m.strides()[1], m.strides()[2], m.strides()[3], pairs};
}

// The key/value slice that query slice bh = b * H + h reads: (b, h / (H / Hk)) as b * Hk + ...
__device__ __forceinline__ int kv_slice(int bh, int H, int Hk) {
  return (bh / H) * Hk + (bh % H) / (H / Hk);
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
