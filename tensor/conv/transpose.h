// The transposed 2-D convolution (PyTorch's conv_transpose2d), raw (namespace tally::ops) and
// differentiable (namespace tally): the adjoint of conv2d, computed by conv2d's input-gradient
// kernels on every backend. Defined in tensor/conv/ops.cpp and tensor/conv/autograd.cpp.
#pragma once

#include "tensor/conv/autograd.h"
#include "tensor/conv/ops.h"

namespace tally::ops {

// PyTorch's conv_transpose2d: the adjoint of conv2d (its backward-data) with weight
// [C, O / groups, kH, kW] read as a conv2d weight from O channels to C. input [N, C, H, W]
// or [C, H, W]; output [N, O, OH, OW] with
//   OH = (H - 1) * stride.h - 2 * padding.h + dilation.h * (kH - 1) + output_padding.h + 1.
// output_padding must be smaller than the stride.
Tensor conv_transpose2d(const Tensor& input, const Tensor& weight, const Tensor& bias = {},
                        Int2 stride = {1, 1}, Int2 padding = {0, 0}, Int2 output_padding = {0, 0},
                        int64_t groups = 1, Int2 dilation = {1, 1});

}  // namespace tally::ops

namespace tally {

// PyTorch's conv_transpose2d (see ops::conv_transpose2d): weight [C, O / groups, kH, kW].
// Its backward is conv2d (input) and conv2d's weight gradient with the roles of gradient and
// input exchanged; it saves what conv2d saves.
Tensor conv_transpose2d(const Tensor& input, const Tensor& weight, const Tensor& bias = {},
                        Int2 stride = {1, 1}, Int2 padding = {0, 0}, Int2 output_padding = {0, 0},
                        int64_t groups = 1, Int2 dilation = {1, 1},
                        CallSite site = CallSite::current());

}  // namespace tally
