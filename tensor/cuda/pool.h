// CUDA kernels of 2-D pooling, twins of tensor/cpu/pool.h with the same signatures and
// the same semantics to the bit: the same window rules (padding, dilation, ceil_mode,
// count_include_pad, divisor_override), the same first-max-on-ties and NaN rules and the
// same flat h * W + w indices for max pooling, and the same summation order for the
// averages. Tensors arrive 4-D [N, C, H, W] and contiguous (tensor/pool.cpp). Forward
// kernels read and write the input's dtype, accumulating in float (double for float64);
// backward kernels write a float32/float64 gradient.
#pragma once

#include "tensor/ops/pool.h"

namespace tally::cuda {

void max_pool2d_forward(const Tensor& out, const Tensor& indices, const Tensor& input,
                        const ops::Pool2dParams& p);
// Scatter-add by index (atomicAdd into the float32/float64 gradient). An index outside
// its input plane is skipped (the CPU kernel throws; a device kernel cannot without a
// host synchronisation).
void max_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output,
                         const Tensor& indices);
void avg_pool2d_forward(const Tensor& out, const Tensor& input, const ops::Pool2dParams& p);
void avg_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output,
                         const ops::Pool2dParams& p);
void adaptive_avg_pool2d_forward(const Tensor& out, const Tensor& input);
void adaptive_avg_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output);

}  // namespace tally::cuda
