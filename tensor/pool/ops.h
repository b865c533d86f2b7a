// Raw 2-D pooling (namespace tally::ops, no autograd): max pooling with argmax indices,
// average pooling, adaptive average pooling, and their backward ops. Inputs are
// [N, C, H, W] or unbatched [C, H, W]; PyTorch's output-size formula and window rules.
#pragma once

#include <optional>
#include <utility>
#include <vector>

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

// PyTorch's upsample_nearest{1,2,3}d, upsample_linear1d, upsample_bilinear2d and
// upsample_trilinear3d: input [N, C, d1, ..., dk] (k = 1, 2 or 3) resampled to output_size
// (k sizes), nearest or linear (linear, bilinear, trilinear by k) with align_corners (linear
// only). scale_factors: the scale_factor the caller gave, one a dim, or empty; as PyTorch, the
// source index then steps by 1 / scale_factor rather than in / out. The output keeps the input's
// dtype (16-bit inputs accumulate in float32).
Tensor upsample(const Tensor& input, const Shape& output_size,
                const std::vector<double>& scale_factors, bool linear, bool align_corners);
// The gradient w.r.t. an input of `input_sizes` in grad_output's dtype: each input element sums
// the weighted gradients of the outputs that read it (a gather, so no atomics and a float32 sum
// for 16-bit gradients; the CUDA sums are the CPU's, in the same order).
Tensor upsample_backward(const Tensor& grad_output, const Shape& input_sizes,
                         const std::vector<double>& scale_factors, bool linear, bool align_corners);

// An interpolation's geometry as its kernels receive it: the input viewed as [planes, D, H, W]
// with the spatial dims it lacks as 1 in front (a 3-D input is [N * C, 1, 1, L]), and each
// axis' source-index scales as PyTorch computes them.
struct InterpParams {
  int64_t planes = 0;
  int64_t in[3] = {1, 1, 1}, out[3] = {1, 1, 1};
  int dims = 1;  // the input's spatial dims (the last `dims` axes)
  bool linear = false, align_corners = false;
  float nearest_scale[3] = {1, 1, 1};  // compute_scales_value<float>
  // area_pixel_compute_scale in float (float and 16-bit inputs) and in double (float64).
  float linear_scale_f[3] = {0, 0, 0};
  double linear_scale_d[3] = {0, 0, 0};
};

// The geometry every pooling kernel (CPU, CUDA) receives, fully resolved.
struct Pool2dParams {
  int64_t kH = 1, kW = 1, sH = 1, sW = 1, pH = 0, pW = 0, dH = 1, dW = 1;
  bool count_include_pad = true;
  int64_t divisor = 0;  // > 0: divisor_override
};

}  // namespace tally::ops
