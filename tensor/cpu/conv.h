// CPU kernels of 2-D convolution: im2col (per sample, per group) + a BLAS GEMM, and
// col2im for the input gradient. Tensors arrive 4-D, contiguous, float32 or float64, all
// of one dtype, shapes already checked (tensor/conv.cpp converts and validates).
#pragma once

#include "tensor/ops/conv.h"

namespace tally::cpu {

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

}  // namespace tally::cpu
