// AvgPool2d and Upsample (torch.nn), over avg_pool2d and nn::functional::interpolate
// (MaxPool2d and AdaptiveAvgPool2d are in nn/layers.h).
#pragma once

#include <array>
#include <optional>
#include <vector>

#include "nn/module.h"

namespace tally::nn {

// stride {} (unset) is the kernel size, as PyTorch's stride=None.
class AvgPool2d : public Module {
 public:
  AvgPool2d(Int2 kernel_size, Int2 stride = {}, Int2 padding = 0, bool ceil_mode = false,
            bool count_include_pad = true, std::optional<int64_t> divisor_override = std::nullopt);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  Int2 kernel_size, stride, padding;
  bool ceil_mode, count_include_pad;
  std::optional<int64_t> divisor_override;
};

// One of size or scale_factor (one value per spatial dim, or one for all); mode "nearest" |
// "linear" | "bilinear" | "trilinear" (for 3-D, 4-D, 5-D inputs); align_corners for the
// linear modes only. nn::functional::interpolate underneath.
class Upsample : public Module {
 public:
  Upsample(std::optional<std::vector<int64_t>> size,
           std::optional<std::vector<double>> scale_factor = std::nullopt,
           std::string mode = "nearest", std::optional<bool> align_corners = std::nullopt);
  Upsample(std::optional<std::array<int64_t, 2>> size,
           std::optional<std::array<double, 2>> scale_factor = std::nullopt,
           std::string mode = "nearest", std::optional<bool> align_corners = std::nullopt);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  std::optional<std::vector<int64_t>> size;
  std::optional<std::vector<double>> scale_factor;
  std::string mode;
  std::optional<bool> align_corners;
};

}  // namespace tally::nn
