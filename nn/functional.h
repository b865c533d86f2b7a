// torch.nn.functional's layers that Tally composes from its differentiable ops (autograd/),
// so each runs on every backend (CPU, CUDA, meta) with the ops' kernels and gradients:
// leaky_relu, the regression and divergence losses, group_norm, conv1d (conv2d at unit
// height), interpolate (nearest, linear, bilinear, trilinear). PyTorch's names, argument
// orders and defaults; reduction is "mean" | "sum" | "none" (kl_div also "batchmean"). Errors
// name the function and the shapes before anything runs.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "autograd/ops.h"

namespace tally::nn::functional {

// x where x > 0, negative_slope * x elsewhere (the gradient at 0 is negative_slope, as PyTorch).
Tensor leaky_relu(const Tensor& x, double negative_slope = 0.01);

// mean, sum or the elementwise loss itself; `op` names the caller in the error.
Tensor reduce_loss(const Tensor& loss, const std::string& reduction, const char* op);
// (input - target)^2; target broadcasts to input as in PyTorch.
Tensor mse_loss(const Tensor& input, const Tensor& target, const std::string& reduction = "mean");
Tensor l1_loss(const Tensor& input, const Tensor& target, const std::string& reduction = "mean");
// 0.5 d^2 / beta where |d| < beta, |d| - 0.5 beta elsewhere; beta 0 is l1_loss.
Tensor smooth_l1_loss(const Tensor& input, const Tensor& target,
                      const std::string& reduction = "mean", double beta = 1.0);
// 0.5 d^2 where |d| < delta, delta (|d| - 0.5 delta) elsewhere.
Tensor huber_loss(const Tensor& input, const Tensor& target, const std::string& reduction = "mean",
                  double delta = 1.0);
// Sigmoid and binary cross-entropy in PyTorch's stable form; weight (broadcast to input) and
// pos_weight (broadcast along the last dim: one per class) may be undefined.
Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target,
                                        const Tensor& weight = {},
                                        const std::string& reduction = "mean",
                                        const Tensor& pos_weight = {});
// input holds log-probabilities; target probabilities (log-probabilities with log_target).
// "batchmean" divides the sum by input.size(0), the true KL divergence per sample.
Tensor kl_div(const Tensor& input, const Tensor& target, const std::string& reduction = "mean",
              bool log_target = false);

// x [N, C, *] normalized over each of num_groups channel groups (biased variance), then
// weight and bias ([C], may be undefined) per channel.
Tensor group_norm(const Tensor& x, int64_t num_groups, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5);

// input [N, C, L] or [C, L], weight [O, C / groups, K], bias [O] or undefined.
Tensor conv1d(const Tensor& input, const Tensor& weight, const Tensor& bias = {},
              int64_t stride = 1, int64_t padding = 0, int64_t dilation = 1, int64_t groups = 1);

// x [N, C, L], [N, C, H, W] or [N, C, D, H, W] resampled to `size` or by `scale_factor`
// (exactly one given, one value per spatial dim or one for all; the output is
// floor(in * scale)). mode "nearest" (any of those ranks), "linear" (3-D), "bilinear" (4-D),
// "trilinear" (5-D); align_corners only for the linear modes (nullopt is false). A given
// scale_factor steps the source index by its inverse, as PyTorch's. The kernels are the pool
// family's upsample (tally::upsample: CPU, CUDA, meta, autograd).
Tensor interpolate(const Tensor& x, std::optional<std::vector<int64_t>> size,
                   std::optional<std::vector<double>> scale_factor = std::nullopt,
                   const std::string& mode = "nearest",
                   std::optional<bool> align_corners = std::nullopt);
// The 2-D form (nn::Upsample's).
Tensor interpolate(const Tensor& x, std::optional<std::array<int64_t, 2>> size,
                   std::optional<std::array<double, 2>> scale_factor = std::nullopt,
                   const std::string& mode = "nearest",
                   std::optional<bool> align_corners = std::nullopt);

}  // namespace tally::nn::functional
