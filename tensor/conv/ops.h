// Raw 2-D convolution (namespace tally::ops, no autograd): conv2d and the two backward
// products (gradient w.r.t. input and weight) the differentiable conv2d is built from.
// Also defines Int2, the (height, width) pair the 2-D conv and pooling ops take, which a
// single int expands to (PyTorch's ExpandingArray<2>).
#pragma once

#include <cstdint>
#include <string>

#include "tensor/tensor.h"

namespace tally {

// (height, width). `2` means {2, 2}; `{2, 1}` is height 2, width 1. `{}` is "unset" (used
// where PyTorch takes an empty list, e.g. max_pool2d's stride defaulting to the kernel).
struct Int2 {
  int64_t h = 0, w = 0;
  bool set = false;
  constexpr Int2() = default;
  constexpr Int2(int64_t v) : h(v), w(v), set(true) {}  // NOLINT: implicit by design
  constexpr Int2(int64_t h_, int64_t w_) : h(h_), w(w_), set(true) {}
  std::string str() const;  // "[h, w]" or "[]"
};

}  // namespace tally

namespace tally::ops {

// PyTorch's conv2d: input [N, C, H, W] (or unbatched [C, H, W]), weight
// [O, C / groups, kH, kW], optional bias [O]. Output [N, O, OH, OW] with
//   OH = (H + 2 * padding.h - dilation.h * (kH - 1) - 1) / stride.h + 1   (same for W).
// input, weight and bias share one floating dtype and one device.
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias = {},
              Int2 stride = {1, 1}, Int2 padding = {0, 0}, Int2 dilation = {1, 1},
              int64_t groups = 1);

// d(conv2d)/d(input): grad_output [N, O, OH, OW] -> a gradient of shape `input_sizes`.
Tensor conv2d_backward_input(const Tensor& grad_output, const Tensor& weight,
                             const Shape& input_sizes, Int2 stride, Int2 padding, Int2 dilation,
                             int64_t groups);

// d(conv2d)/d(weight): grad_output [N, O, OH, OW] and the forward input -> a gradient of
// shape `weight_sizes`.
Tensor conv2d_backward_weight(const Tensor& grad_output, const Tensor& input,
                              const Shape& weight_sizes, Int2 stride, Int2 padding, Int2 dilation,
                              int64_t groups);

// The geometry every conv2d kernel (CPU, CUDA) receives.
struct Conv2dParams {
  Int2 stride{1, 1}, padding{0, 0}, dilation{1, 1};
  int64_t groups = 1;
};

// Output spatial size of a convolution or pooling window along one dimension (PyTorch's
// formula; with ceil_mode the last window must start inside the input or left padding).
int64_t conv_output_size(int64_t in, int64_t kernel, int64_t stride, int64_t padding,
                         int64_t dilation, bool ceil_mode = false);

}  // namespace tally::ops
