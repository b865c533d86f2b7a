// The one hand-written kernel of CUDA conv2d: adding the bias to cuDNN's output (the
// cuDNN calls themselves are host code, in cuda_conv.cpp, which declares conv2d_add_bias
// and is its only caller; the family's kernel table is defined there too).
#include <algorithm>

#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/tensor.h"

namespace tally::cuda {

namespace {

constexpr int kThreads = 256;

// y[i] += b[channel of i], in the accumulation type, rounded once into T.
template <typename T>
__global__ void add_bias_kernel(T* __restrict__ y, const T* __restrict__ b, int64_t n,
                                int64_t plane, int64_t channels) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = (i / plane) % channels;
    y[i] = store<T>(load(y[i]) + load(b[c]));
  }
}

}  // namespace

// Declared (with its contract) in tensor/conv/cuda_conv.cpp.
void conv2d_add_bias(const Tensor& y, const Tensor& bias) {
  const int64_t n = y.numel();
  if (n == 0) return;
  NvtxRange range("conv2d bias (CUDA)");
  DeviceGuard g(y.device().index);
  const int64_t plane = y.size(2) * y.size(3), channels = y.size(1);
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8);
  TALLY_DISPATCH_FLOAT(y.dtype(), "conv2d bias", [&] {
    using T = dev_t<scalar_t>;
    add_bias_kernel<T><<<static_cast<int>(blocks), kThreads, 0, stream(y.device().index)>>>(
        static_cast<T*>(y.data_ptr()), static_cast<const T*>(bias.data_ptr()), n, plane, channels);
  });
  check_launch("conv2d bias (CUDA)");
}

}  // namespace tally::cuda
