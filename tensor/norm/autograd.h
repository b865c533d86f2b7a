// Differentiable normalization ops (namespace tally), PyTorch's names and argument orders:
// layer_norm, rms_norm (torch.nn.functional.layer_norm / rms_norm), batch_norm
// (torch.nn.functional.batch_norm) and group_norm (torch.native_group_norm's node). Each saves the
// input and its small per-row or per-channel statistics for backward, never the normalized output.
#pragma once

#include <optional>
#include <utility>

#include "tensor/elementwise/autograd.h"
#include "tensor/norm/ops.h"

namespace tally {

// Normalizes over the trailing dims `normalized_shape` (x [*, normalized_shape...]) with
// the biased variance: (x - mean) / sqrt(var + eps) * weight + bias. weight and bias
// (shape normalized_shape) may be undefined. out_dtype (nullopt: the input's, after autocast)
// gives the output's dtype, exactly to(layer_norm(...), out_dtype) but without the
// intermediate output when the input is float32 and out_dtype 16-bit (see ops::layer_norm);
// the gradient that comes back in out_dtype is read as is.
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5,
                  std::optional<DType> out_dtype = std::nullopt,
                  CallSite site = CallSite::current());

// {x + residual, layer_norm(x + residual, ...)}: a pre-norm transformer block's residual add
// and the next normalization as one node (ops::add_layer_norm: the sum is normalized as it is
// written, and in backward the sum's gradient is added to the normalization's in the same
// pass). The same values and gradients as add followed by layer_norm; the sum has add's dtype.
// Under autocast a 16-bit sum takes the two ops (layer_norm's float32 policy).
std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual,
                                         const Shape& normalized_shape, const Tensor& weight = {},
                                         const Tensor& bias = {}, double eps = 1e-5,
                                         std::optional<DType> out_dtype = std::nullopt,
                                         CallSite site = CallSite::current());

// x / sqrt(mean(x^2) + eps) * weight over the trailing dims; eps defaults to the machine
// epsilon of x's dtype (PyTorch's eps=None). out_dtype as layer_norm's.
Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = {},
                std::optional<double> eps = std::nullopt,
                std::optional<DType> out_dtype = std::nullopt, CallSite site = CallSite::current());

// {x + residual, rms_norm(x + residual, ...)} as one node, as add_layer_norm (ops::add_rms_norm):
// a LLaMA block's residual add and the norm after it.
std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual,
                                       const Shape& normalized_shape, const Tensor& weight = {},
                                       std::optional<double> eps = std::nullopt,
                                       std::optional<DType> out_dtype = std::nullopt,
                                       CallSite site = CallSite::current());

// Per-channel normalization of x [N, C] or [N, C, *]. training: batch statistics (biased
// variance), and running_mean / running_var (when defined) are updated in place with
// `momentum` (unbiased variance), outside the graph. eval: the running statistics. The
// running buffers are not differentiable; weight and bias ([C]) may be undefined.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight = {}, const Tensor& bias = {}, bool training = false,
                  double momentum = 0.1, double eps = 1e-5, CallSite site = CallSite::current());

// x [N, C, *] normalized per sample over each of num_groups groups of C / num_groups
// channels (biased variance), then weight and bias ([C], may be undefined) per channel, in one
// kernel (ops::group_norm_forward); backward is NativeGroupNormBackward0 (one kernel for dx,
// one for dweight/dbias). In float32 under autocast (PyTorch's policy; a 16-bit input is read
// as it is, the cast fused, and its gradient comes back in its dtype); otherwise the output
// has x's dtype, float32 parameters beside a 16-bit input included (PyTorch's mixed type).
// weight and bias must be of a dtype ops::group_norm_fast_path_applies takes
// (nn::functional::group_norm falls back to the composite for the others).
Tensor group_norm(const Tensor& x, int64_t num_groups, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5, CallSite site = CallSite::current());

}  // namespace tally
