// The contiguous fast path of the CUDA elementwise kernels: when the output and every input
// are contiguous, of one dtype, of the output's shape and 16-byte aligned, a grid-stride
// kernel with the operation as a functor type moves 16 bytes per load and store (4 floats,
// 8 halves/bfloat16, 2 doubles), two vectors in flight per thread, with a scalar tail. The
// grid gives each thread two 16-byte packs (grid_for), striding only past 2^20 blocks.
#pragma once

#include <cstdint>

#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/runtime.h"

namespace tally::cuda::vec {

inline constexpr int kThreads = 256;

template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

// out[i] = f(in_0[i], ..., in_{K-1}[i]) over n elements; f takes and returns dacc_t<T>.
template <typename T, int K, typename F>
__global__ void __launch_bounds__(kThreads)
    map_kernel(T* out, const T* a, const T* b, int64_t n, F f) {
  using P = Pack<T>;
  constexpr int N = P::N;
  const int64_t packs = n / N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const P* pa = reinterpret_cast<const P*>(a);
  const P* pb = reinterpret_cast<const P*>(b);
  P* po = reinterpret_cast<P*>(out);
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + stride < packs; i += 2 * stride) {
    const P x0 = pa[i], x1 = pa[i + stride];
    P y0, y1;
    if constexpr (K == 2) {
      y0 = pb[i];
      y1 = pb[i + stride];
    }
    P r0, r1;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if constexpr (K == 2) {
        r0.v[e] = store<T>(f(load(x0.v[e]), load(y0.v[e])));
        r1.v[e] = store<T>(f(load(x1.v[e]), load(y1.v[e])));
      } else {
        r0.v[e] = store<T>(f(load(x0.v[e])));
        r1.v[e] = store<T>(f(load(x1.v[e])));
      }
    }
    po[i] = r0;
    po[i + stride] = r1;
  }
  for (; i < packs; i += stride) {
    const P x0 = pa[i];
    P r0;
    if constexpr (K == 2) {
      const P y0 = pb[i];
#pragma unroll
      for (int e = 0; e < N; ++e) r0.v[e] = store<T>(f(load(x0.v[e]), load(y0.v[e])));
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) r0.v[e] = store<T>(f(load(x0.v[e])));
    }
    po[i] = r0;
  }
  // tail (fewer than N elements), by the first threads of block 0
  if (blockIdx.x == 0) {
    const int64_t j = packs * N + threadIdx.x;
    if (j < n) {
      if constexpr (K == 2)
        out[j] = store<T>(f(load(a[j]), load(b[j])));
      else
        out[j] = store<T>(f(load(a[j])));
    }
  }
}

// Blocks for a walk over `packs` 16-byte packs: two packs a thread, at most 2^20 blocks.
int grid_for(int64_t packs, int device);

// Whether the fast path applies: out and the inputs contiguous, one dtype, one shape,
// 16-byte aligned.
bool applies(const Tensor& out, const Tensor& a, const Tensor* b = nullptr);

template <typename T, int K, typename F>
void launch_map(const char* name, const Tensor& out, const Tensor& a, const Tensor* b, F f) {
  const int64_t n = out.numel();
  if (n == 0) return;
  NvtxRange range(name);
  const int dev = out.device().index;
  DeviceGuard g(dev);
  const int64_t packs = n / Pack<T>::N;
  map_kernel<T, K, F><<<grid_for(packs, dev), kThreads, 0, stream(dev)>>>(
      static_cast<T*>(out.data_ptr()), static_cast<const T*>(a.data_ptr()),
      b ? static_cast<const T*>(b->data_ptr()) : nullptr, n, f);
  check_launch(name);
}

}  // namespace tally::cuda::vec
