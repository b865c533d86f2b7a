// CUDA kernels of 2-D convolution through cuDNN (cached backend-API execution plans by
// default, the legacy cudnnConvolution* API in benchmark mode and as fallback), twins
// of tensor/cpu/conv.h with the same signatures. Tensors arrive 4-D, all of one floating
// dtype (float32, float64, float16, bfloat16: on CUDA the raw op does not widen 16-bit
// inputs), shapes already checked by tensor/conv.cpp.
//
// Precision: float32 runs with TF32 allowed when cudnn_allow_tf32() (the default, like
// PyTorch), with CUDNN_FMA_MATH (exact float32) when not; float16/bfloat16 with tensor
// cores and float accumulation, float64 in double. The algorithm is chosen once per
// (direction, device, dtype, shapes, strides, stride/padding/dilation/groups) key: by
// cuDNN's heuristics (as an execution plan), or by timing them all when cudnn_benchmark()
// is on (see conv.cpp). Its workspace
// comes from the caching allocator, tagged `workspace` under the calling op.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/cuda/cudnn.h"  // set_cudnn_benchmark, set_cudnn_allow_tf32
#include "tensor/ops/conv.h"

namespace tally::cuda {

// out [N, O, OH, OW] = conv(input [N, C, H, W], weight [O, C/g, kH, kW]) + bias [O]
// (bias may be undefined).
void conv2d_forward(const Tensor& out, const Tensor& input, const Tensor& weight,
                    const Tensor& bias, const ops::Conv2dParams& p);
// grad_input [N, C, H, W] (overwritten) from grad_output [N, O, OH, OW] and weight.
void conv2d_backward_input(const Tensor& grad_input, const Tensor& grad_output,
                           const Tensor& weight, const ops::Conv2dParams& p);
// grad_weight [O, C/g, kH, kW] (overwritten) from grad_output and the forward input.
void conv2d_backward_weight(const Tensor& grad_weight, const Tensor& grad_output,
                            const Tensor& input, const ops::Conv2dParams& p);

// y [N, O, OH, OW] (contiguous) += bias [O] broadcast over batch and plane (same dtype;
// the sum is formed in float and rounded once). conv2d_forward's bias step.
void conv2d_add_bias(const Tensor& y, const Tensor& bias);

// The number of (key -> ranked algorithms) entries of the legacy API cached so far, of
// execution plans of the backend route (the default with cudnn_benchmark() off), and a way
// to drop both.
size_t conv_algorithm_cache_size();
size_t conv_plan_cache_size();
void clear_conv_algorithm_cache();

// cuDNN's legacy API takes int-sized tensors: a batch whose input or output has more than
// this many elements runs as several calls over slices of the batch (default INT32_MAX).
// Exposed so tests can exercise the split on small tensors; n <= 0 restores the default.
void set_conv_max_call_elements(int64_t n);

}  // namespace tally::cuda
