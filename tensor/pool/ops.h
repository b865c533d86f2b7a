// Raw 2-D pooling (namespace tally::ops, no autograd): max pooling with argmax indices,
// average pooling, adaptive average pooling, and their backward ops. Inputs are
// [N, C, H, W] or unbatched [C, H, W]; PyTorch's output-size formula and window rules.
#pragma once

#include <optional>
#include <utility>

#include "tensor/conv/ops.h"  // Int2, conv_output_size

namespace tally::ops {

// (output, indices): indices (int64, output's shape) are the argmax positions h * W + w
// within each input plane, as PyTorch's max_pool2d(return_indices=True). An unset stride
// ({}) means the kernel size. NaN wins over any number.
std::pair<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, Int2 kernel_size,
                                                  Int2 stride = {}, Int2 padding = 0,
                                                  Int2 dilation = 1, bool ceil_mode = false);
// Gradient w.r.t. an input of `input_sizes` for the forward's window geometry (PyTorch's
// max_pool2d_with_indices_backward), in grad_output's dtype: each input element sums, in
// output order, grad_output over the windows that cover it and chose it (indices). A gather,
// so no float32 buffer of the input's size is needed for 16-bit gradients, and the CUDA sums
// are the CPU's bit for bit. An index its window could not have chosen: the CPU kernel throws
// std::out_of_range; the CUDA kernel never matches it.
Tensor max_pool2d_backward(const Tensor& grad_output, const Tensor& indices,
                           const Shape& input_sizes, Int2 kernel_size, Int2 stride = {},
                           Int2 padding = 0, Int2 dilation = 1, bool ceil_mode = false);

// Mean over each window; the divisor is divisor_override if given, else the window's size
// clipped to the padded input (count_include_pad) or to the input itself.
Tensor avg_pool2d(const Tensor& input, Int2 kernel_size, Int2 stride = {}, Int2 padding = 0,
                  bool ceil_mode = false, bool count_include_pad = true,
                  std::optional<int64_t> divisor_override = std::nullopt);
Tensor avg_pool2d_backward(const Tensor& grad_output, const Shape& input_sizes, Int2 kernel_size,
                           Int2 stride = {}, Int2 padding = 0, bool ceil_mode = false,
                           bool count_include_pad = true,
                           std::optional<int64_t> divisor_override = std::nullopt);

// Output cell i averages rows [floor(i * H / OH), ceil((i + 1) * H / OH)) (same for
// columns).
Tensor adaptive_avg_pool2d(const Tensor& input, Int2 output_size);
// The gradient is laid out as `input_format` (the forward input's: grad_output's [N, C, 1, 1]
// cannot tell).
Tensor adaptive_avg_pool2d_backward(const Tensor& grad_output, const Shape& input_sizes,
                                    MemoryFormat input_format = MemoryFormat::contiguous);

// The geometry every pooling kernel (CPU, CUDA) receives, fully resolved.
struct Pool2dParams {
  int64_t kH = 1, kW = 1, sH = 1, sW = 1, pH = 0, pW = 0, dH = 1, dW = 1;
  bool count_include_pad = true;
  int64_t divisor = 0;  // > 0: divisor_override
};

}  // namespace tally::ops
