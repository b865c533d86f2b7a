// Normalisation layers (torch.nn.BatchNorm2d, BatchNorm1d, LayerNorm, GroupNorm, RMSNorm):
// weight ones, bias zeros; the batch norms' buffers running_mean (zeros), running_var (ones) and
// num_batches_tracked (int64, 0-D), allocated under Category::parameter like the weights.
#pragma once

#include <optional>

#include "nn/module.h"

namespace tally::nn {

// PyTorch's _BatchNorm: the parameters, buffers and running-stats rules both batch norms share.
// Training: batch statistics, running stats updated with `momentum` (nullopt: cumulative
// average over num_batches_tracked, as PyTorch's momentum=None); eval: running stats.
class BatchNormBase : public Module {
 public:
  void reset_running_stats();
  void reset_parameters();
  std::string extra_repr() const override;

  int64_t num_features;
  double eps;
  std::optional<double> momentum;
  bool affine, track_running_stats;
  Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 protected:
  BatchNormBase(const char* name, int64_t num_features, double eps, std::optional<double> momentum,
                bool affine, bool track_running_stats);
  // Checks x's channels (dim 1) against num_features, naming this module's type.
  void check_channels(const Tensor& x) const;
  // batch_norm over x [N, C, H, W] with this module's state (updating the running stats).
  Tensor normalize(const Tensor& x);
};

// torch.nn.BatchNorm1d (Dims 1: x [N, C] or [N, C, L], through the 2-D kernels at unit width)
// and torch.nn.BatchNorm2d (Dims 2: x [N, C, H, W]).
template <int Dims>
class BatchNormNd : public BatchNormBase {
 public:
  explicit BatchNormNd(int64_t num_features, double eps = 1e-5,
                       std::optional<double> momentum = 0.1, bool affine = true,
                       bool track_running_stats = true)
      : BatchNormBase(Dims == 1 ? "BatchNorm1d" : "BatchNorm2d", num_features, eps, momentum,
                      affine, track_running_stats) {}
  Tensor forward(const Tensor& x) override;
};
template <>
Tensor BatchNormNd<1>::forward(const Tensor& x);
template <>
Tensor BatchNormNd<2>::forward(const Tensor& x);
using BatchNorm1d = BatchNormNd<1>;
using BatchNorm2d = BatchNormNd<2>;

class LayerNorm : public Module {
 public:
  explicit LayerNorm(Shape normalized_shape, double eps = 1e-5, bool elementwise_affine = true,
                     bool bias = true);
  explicit LayerNorm(int64_t normalized_size, double eps = 1e-5, bool elementwise_affine = true,
                     bool bias = true)
      : LayerNorm(Shape{normalized_size}, eps, elementwise_affine, bias) {}
  Tensor forward(const Tensor& x) override;
  // {x + residual, this(x + residual)} as one node (tally::add_layer_norm): a pre-norm
  // transformer block's residual add and the normalization after it, under this module's scope.
  std::pair<Tensor, Tensor> forward_with_residual(
      const Tensor& x, const Tensor& residual,
      const std::source_location& site = std::source_location::current());
  void reset_parameters();
  std::string extra_repr() const override;

  Shape normalized_shape;
  double eps;
  Tensor weight, bias;
  // Inside an autocast region for the input's device, write the output in the autocast dtype:
  // the cast the next lower-precision op (a Linear) would make, fused into the normalization
  // (tally::layer_norm's out_dtype). The values are the same as without it, rounded once; a
  // float32 output and a conversion each way (forward and backward) are saved. Off by default
  // (PyTorch's LayerNorm returns float32 under autocast); GPT's blocks set it for ln_1 and
  // ln_2, whose outputs feed only their Linears.
  bool autocast_output = false;
};

// x [N, num_channels, *] normalized per group of num_channels / num_groups channels; weight
// and bias [num_channels] when affine.
class GroupNorm : public Module {
 public:
  GroupNorm(int64_t num_groups, int64_t num_channels, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& x) override;
  void reset_parameters();
  std::string extra_repr() const override;

  int64_t num_groups, num_channels;
  double eps;
  bool affine;
  Tensor weight, bias;
};

// torch.nn.RMSNorm: x / sqrt(mean(x^2) + eps) * weight over normalized_shape; eps nullopt is
// the machine epsilon of the input's dtype.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(Shape normalized_shape, std::optional<double> eps = std::nullopt,
                   bool elementwise_affine = true);
  explicit RMSNorm(int64_t normalized_size, std::optional<double> eps = std::nullopt,
                   bool elementwise_affine = true)
      : RMSNorm(Shape{normalized_size}, eps, elementwise_affine) {}
  Tensor forward(const Tensor& x) override;
  // {x + residual, this(x + residual)} as one node (tally::add_rms_norm), as LayerNorm's.
  std::pair<Tensor, Tensor> forward_with_residual(
      const Tensor& x, const Tensor& residual,
      const std::source_location& site = std::source_location::current());
  void reset_parameters();
  std::string extra_repr() const override;

  Shape normalized_shape;
  std::optional<double> eps;
  Tensor weight;
  // As LayerNorm's: under autocast, the output in the autocast dtype (the next Linear's cast
  // fused into the norm). Off by default (PyTorch's RMSNorm returns float32 under autocast).
  bool autocast_output = false;
};

}  // namespace tally::nn
