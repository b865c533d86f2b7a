// The kernel table of the 2-D pooling family (max, average and adaptive average pooling and
// their gradients; interpolate's resampling over 1 to 3 spatial dims): each kernel's signature,
// once. The CPU reference (tensor/pool/cpu.cpp) and the CUDA kernels (tensor/pool/cuda.cu) each
// define one PoolKernels; tensor/backends.cpp registers them.
//
// Called only by the raw ops (tensor/pool/ops.cpp). Tensors arrive 4-D [N, C, H, W] and
// contiguous, shapes checked; the CUDA max_pool2d and adaptive_avg_pool2d kernels (forward and
// backward) also take them all channels_last (NHWC memory; the indices too), the CPU ones
// never. Forward kernels read and write the input's dtype (accumulating in acc_t: float,
// double for float64); backward kernels write a float32/float64 gradient (acc_t of the
// grad_output's dtype), which they zero first, so overlapping windows add exactly.
// The CUDA kernels as the CPU's twins: docs/notes.md §30.
#pragma once

#include "tensor/dispatch.h"
#include "tensor/pool/ops.h"
#include "tensor/tensor.h"

namespace tally {

// The sizes both backends' loops run over: input planes [N * C] of H x W, output OH x OW.
struct Planes {
  int64_t planes, H, W, OH, OW;  // planes = N * C
};
inline Planes planes_of(const Tensor& in, const Tensor& out) {
  return {in.size(0) * in.size(1), in.size(2), in.size(3), out.size(2), out.size(3)};
}

struct PoolKernels {
  void (*max_pool2d_forward)(const Tensor& out, const Tensor& indices, const Tensor& input,
                             const ops::Pool2dParams& p);
  // A gather into grad_input (grad_output's dtype): each input element sums, in output order,
  // the gradients of the windows covering it whose index names it (math::covering_rows). An
  // index its window could not have chosen: the CPU kernel throws; the CUDA kernel never
  // matches it (a device kernel cannot throw without a host synchronisation).
  void (*max_pool2d_backward)(const Tensor& grad_input, const Tensor& grad_output,
                              const Tensor& indices, const ops::Pool2dParams& p);
  void (*avg_pool2d_forward)(const Tensor& out, const Tensor& input, const ops::Pool2dParams& p);
  void (*avg_pool2d_backward)(const Tensor& grad_input, const Tensor& grad_output,
                              const ops::Pool2dParams& p);
  void (*adaptive_avg_pool2d_forward)(const Tensor& out, const Tensor& input);
  void (*adaptive_avg_pool2d_backward)(const Tensor& grad_input, const Tensor& grad_output);
  // interpolate (ops::upsample): out from input, both contiguous in the input's dtype, their
  // geometry p's. The backward is a gather (math::interp_gather) writing grad_input in
  // grad_output's dtype, every element whole (no zeroing).
  void (*upsample_forward)(const Tensor& out, const Tensor& input, const ops::InterpParams& p);
  void (*upsample_backward)(const Tensor& grad_input, const Tensor& grad_output,
                            const ops::InterpParams& p);
};

// cpu::pool_kernels (tensor/pool/cpu.cpp), cuda::pool_kernels (tensor/pool/cuda.cu), pool_backends
// (tensor/backends.cpp).
TALLY_DECLARE_KERNELS(PoolKernels, pool_kernels, pool_backends);

// The table's entries in member order, each the backend's kernel of the member's name: each
// backend defines its table as `const PoolKernels pool_kernels{TALLY_POOL_KERNELS};`, so the list
// of kernels is written once.
#define TALLY_POOL_KERNELS                                                                \
  .max_pool2d_forward = &max_pool2d_forward, .max_pool2d_backward = &max_pool2d_backward, \
  .avg_pool2d_forward = &avg_pool2d_forward, .avg_pool2d_backward = &avg_pool2d_backward, \
  .adaptive_avg_pool2d_forward = &adaptive_avg_pool2d_forward,                            \
  .adaptive_avg_pool2d_backward = &adaptive_avg_pool2d_backward,                          \
  .upsample_forward = &upsample_forward, .upsample_backward = &upsample_backward

}  // namespace tally
