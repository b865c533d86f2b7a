// The differentiable 2-D convolution (namespace tally), PyTorch's torch.nn.functional.conv2d:
// forward, what backward saves, and backward are in tensor/conv/autograd.cpp.
#pragma once

#include "autograd/ops.h"
#include "tensor/conv/ops.h"

namespace tally {

// input [N, C, H, W] or [C, H, W]; weight [O, C / groups, kH, kW]; bias [O] or undefined.
// Saves the input only when the weight needs a gradient and the weight only when the
// input does; the bias gradient needs nothing saved.
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias = {},
              Int2 stride = {1, 1}, Int2 padding = {0, 0}, Int2 dilation = {1, 1},
              int64_t groups = 1, CallSite site = CallSite::current());

}  // namespace tally
