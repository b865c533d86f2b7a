// BatchNorm2d and LayerNorm over autograd's batch_norm / layer_norm.
#include "nn/norm.h"

#include <fmt/format.h>

#include "autograd/autocast.h"
#include "nn/init.h"
#include "nn/layers.h"

namespace tally::nn {

BatchNorm2d::BatchNorm2d(int64_t n, double eps_, std::optional<double> momentum_, bool affine_,
                         bool track)
    : Module("BatchNorm2d"),
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

void BatchNorm2d::reset_running_stats() {
  if (!track_running_stats) return;
  init::zeros_(running_mean);
  init::ones_(running_var);
  init::zeros_(num_batches_tracked);
}

void BatchNorm2d::reset_parameters() {
  reset_running_stats();
  if (affine) {
    init::ones_(weight);
    init::zeros_(bias);
  }
}

Tensor BatchNorm2d::forward(const Tensor& x) {
  if (x.dim() != 4)
    throw std::invalid_argument(fmt::format("BatchNorm2d: expected 4D input (got {}D input {})",
                                            x.dim(), x.shape_string()));
  if (x.size(1) != num_features)
    throw std::invalid_argument(
        fmt::format("BatchNorm2d: input {} has {} channels, expected num_features={}",
                    x.shape_string(), x.size(1), num_features));
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

std::string BatchNorm2d::extra_repr() const {
  return fmt::format("{}, eps={}, momentum={}, affine={}, track_running_stats={}", num_features,
                     eps, momentum ? fmt::format("{}", *momentum) : "None",
                     affine ? "True" : "False", track_running_stats ? "True" : "False");
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

}  // namespace tally::nn
