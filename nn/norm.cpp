// BatchNorm2d, BatchNorm1d, LayerNorm, GroupNorm and RMSNorm over autograd's batch_norm,
// layer_norm and rms_norm.
#include "nn/norm.h"

#include <fmt/format.h>

#include "autograd/autocast.h"
#include "nn/functional.h"
#include "nn/init.h"
#include "nn/layers.h"

namespace tally::nn {

BatchNormBase::BatchNormBase(const char* name, int64_t n, double eps_,
                             std::optional<double> momentum_, bool affine_, bool track)
    : Module(name),
      num_features(n),
      eps(eps_),
      momentum(momentum_),
      affine(affine_),
      track_running_stats(track) {
  if (affine) {
    weight = register_parameter("weight", make_parameter({n}));
    bias = register_parameter("bias", make_parameter({n}));
  }
  if (track) {
    running_mean = register_buffer("running_mean", make_parameter({n}));
    running_var = register_buffer("running_var", make_parameter({n}));
    num_batches_tracked = register_buffer("num_batches_tracked", make_parameter({}, DType::int64));
  }
  reset_parameters();  // cheap and deterministic: no generator involved
}

void BatchNormBase::reset_running_stats() {
  if (!track_running_stats) return;
  init::zeros_(running_mean);
  init::ones_(running_var);
  init::zeros_(num_batches_tracked);
}

void BatchNormBase::reset_parameters() {
  reset_running_stats();
  if (affine) {
    init::ones_(weight);
    init::zeros_(bias);
  }
}

void BatchNormBase::check_channels(const Tensor& x) const {
  if (x.size(1) != num_features)
    throw std::invalid_argument(
        fmt::format("{}: input {} has {} channels, expected num_features={}", type_name(),
                    x.shape_string(), x.size(1), num_features));
}

Tensor BatchNormBase::normalize(const Tensor& x) {
  double factor = momentum.value_or(0.0);
  if (is_training() && track_running_stats) {
    NoGradGuard ng;
    ops::add_(num_batches_tracked, 1.0);                           // one kernel, nothing allocated
    if (!momentum) factor = 1.0 / ops::item(num_batches_tracked);  // cumulative average
  }
  // Batch statistics while training, or always when no running statistics are kept.
  const bool use_batch_stats = is_training() || !track_running_stats;
  return batch_norm(x, running_mean, running_var, weight, bias, use_batch_stats, factor, eps);
}

std::string BatchNormBase::extra_repr() const {
  return fmt::format("{}, eps={}, momentum={}, affine={}, track_running_stats={}", num_features,
                     eps, momentum ? fmt::format("{}", *momentum) : "None",
                     affine ? "True" : "False", track_running_stats ? "True" : "False");
}

template <>
Tensor BatchNorm2d::forward(const Tensor& x) {
  if (x.dim() != 4)
    throw std::invalid_argument(fmt::format("BatchNorm2d: expected 4D input (got {}D input {})",
                                            x.dim(), x.shape_string()));
  check_channels(x);
  return normalize(x);
}

LayerNorm::LayerNorm(Shape shape, double eps_, bool affine, bool has_bias)
    : Module("LayerNorm"), normalized_shape(std::move(shape)), eps(eps_) {
  if (affine) {
    weight = register_parameter("weight", make_parameter(normalized_shape));
    if (has_bias) bias = register_parameter("bias", make_parameter(normalized_shape));
  }
  reset_parameters();
}

void LayerNorm::reset_parameters() {
  if (weight.defined()) init::ones_(weight);
  if (bias.defined()) init::zeros_(bias);
}

namespace {
std::optional<DType> layer_norm_out_dtype(bool autocast_output, const Tensor& x) {
  if (autocast_output && autocast::is_active(x.device()) && is_floating(x.dtype()) &&
      x.dtype() != DType::float64)
    return autocast_dtype(x.device().type);
  return std::nullopt;
}
}  // namespace

Tensor LayerNorm::forward(const Tensor& x) {
  return layer_norm(x, normalized_shape, weight, bias, eps,
                    layer_norm_out_dtype(autocast_output, x));
}

std::pair<Tensor, Tensor> LayerNorm::forward_with_residual(const Tensor& x, const Tensor& residual,
                                                           const std::source_location& site) {
  return call(
      [&] {
        return add_layer_norm(x, residual, normalized_shape, weight, bias, eps,
                              layer_norm_out_dtype(autocast_output, x));
      },
      site);
}

std::string LayerNorm::extra_repr() const {
  return fmt::format("{}, eps={}, elementwise_affine={}", shape_str(normalized_shape), eps,
                     weight.defined() ? "True" : "False");
}

template <>
Tensor BatchNorm1d::forward(const Tensor& x) {
  if (x.dim() != 2 && x.dim() != 3)
    throw std::invalid_argument(fmt::format(
        "BatchNorm1d: expected 2D or 3D input (got {}D input {})", x.dim(), x.shape_string()));
  check_channels(x);
  if (is_training() && x.numel() / num_features <= 1)
    throw std::invalid_argument(fmt::format(
        "BatchNorm1d: expected more than 1 value per channel when training, got input {}",
        x.shape_string()));
  // [N, C] -> [N, C, 1, 1], [N, C, L] -> [N, C, L, 1]: the same per-channel statistics.
  const Tensor y = normalize(x.dim() == 2 ? x.unsqueeze(2).unsqueeze(3) : x.unsqueeze(3));
  return x.dim() == 2 ? y.squeeze(3).squeeze(2) : y.squeeze(3);
}

GroupNorm::GroupNorm(int64_t groups, int64_t channels, double eps_, bool affine_)
    : Module("GroupNorm"), num_groups(groups), num_channels(channels), eps(eps_), affine(affine_) {
  if (groups <= 0 || channels % groups != 0)
    throw std::invalid_argument(fmt::format(
        "GroupNorm: num_channels ({}) must be divisible by num_groups ({})", channels, groups));
  if (affine) {
    weight = register_parameter("weight", make_parameter({channels}));
    bias = register_parameter("bias", make_parameter({channels}));
  }
  reset_parameters();
}

void GroupNorm::reset_parameters() {
  if (!affine) return;
  init::ones_(weight);
  init::zeros_(bias);
}

Tensor GroupNorm::forward(const Tensor& x) {
  if (x.dim() >= 2 && x.size(1) != num_channels)
    throw std::invalid_argument(fmt::format("GroupNorm: input {} has {} channels, expected {}",
                                            x.shape_string(), x.size(1), num_channels));
  return functional::group_norm(x, num_groups, weight, bias, eps);
}

std::string GroupNorm::extra_repr() const {
  return fmt::format("{}, {}, eps={}, affine={}", num_groups, num_channels, eps,
                     affine ? "True" : "False");
}

RMSNorm::RMSNorm(Shape shape, std::optional<double> eps_, bool affine)
    : Module("RMSNorm"), normalized_shape(std::move(shape)), eps(eps_) {
  if (affine) weight = register_parameter("weight", make_parameter(normalized_shape));
  reset_parameters();
}

void RMSNorm::reset_parameters() {
  if (weight.defined()) init::ones_(weight);
}

Tensor RMSNorm::forward(const Tensor& x) {
  return rms_norm(x, normalized_shape, weight, eps, layer_norm_out_dtype(autocast_output, x));
}

std::pair<Tensor, Tensor> RMSNorm::forward_with_residual(const Tensor& x, const Tensor& residual,
                                                         const std::source_location& site) {
  return call(
      [&] {
        return add_rms_norm(x, residual, normalized_shape, weight, eps,
                            layer_norm_out_dtype(autocast_output, x));
      },
      site);
}

std::string RMSNorm::extra_repr() const {
  // PyTorch's tuple: (5,) or (2, 3).
  std::string shape = "(";
  for (size_t i = 0; i < normalized_shape.size(); ++i)
    shape += (i ? ", " : "") + std::to_string(normalized_shape[i]);
  shape += normalized_shape.size() == 1 ? ",)" : ")";
  return fmt::format("{}, eps={}, elementwise_affine={}", shape,
                     eps ? fmt::format("{}", *eps) : "None", weight.defined() ? "True" : "False");
}

}  // namespace tally::nn
