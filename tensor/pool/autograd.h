// The differentiable 2-D pooling ops (namespace tally), PyTorch's
// torch.nn.functional.max_pool2d / avg_pool2d / adaptive_avg_pool2d: forward, what
// backward saves, and backward are in tensor/pool/autograd.cpp.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "tensor/elementwise/autograd.h"
#include "tensor/pool/ops.h"

namespace tally {

// x [N, C, H, W] or [C, H, W]. stride {} (unset) means kernel_size. Saves the int64
// argmax indices for backward, not the input.
Tensor max_pool2d(const Tensor& x, Int2 kernel_size, Int2 stride = {}, Int2 padding = 0,
                  Int2 dilation = 1, bool ceil_mode = false, CallSite site = CallSite::current());
// (output, indices), as max_pool2d(..., return_indices=True); indices carry no gradient.
std::pair<Tensor, Tensor> max_pool2d_with_indices(const Tensor& x, Int2 kernel_size,
                                                  Int2 stride = {}, Int2 padding = 0,
                                                  Int2 dilation = 1, bool ceil_mode = false,
                                                  CallSite site = CallSite::current());
// Saves nothing: the backward is fixed by the shapes.
Tensor avg_pool2d(const Tensor& x, Int2 kernel_size, Int2 stride = {}, Int2 padding = 0,
                  bool ceil_mode = false, bool count_include_pad = true,
                  std::optional<int64_t> divisor_override = std::nullopt,
                  CallSite site = CallSite::current());
// F.interpolate's resampling, PyTorch's upsample_* ops (ops::upsample): x [N, C, d1, ..., dk],
// k = 1, 2 or 3, to output_size, nearest or linear (align_corners), scale_factors as the caller
// gave them (or empty). Saves nothing.
Tensor upsample(const Tensor& x, const Shape& output_size,
                const std::vector<double>& scale_factors = {}, bool linear = false,
                bool align_corners = false, CallSite site = CallSite::current());
// Saves nothing.
Tensor adaptive_avg_pool2d(const Tensor& x, Int2 output_size, CallSite site = CallSite::current());

}  // namespace tally
