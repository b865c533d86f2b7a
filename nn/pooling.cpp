// AvgPool2d and Upsample (nn/pooling.h).
#include "nn/pooling.h"

#include <fmt/format.h>

#include "nn/functional.h"

namespace tally::nn {

AvgPool2d::AvgPool2d(Int2 k, Int2 s, Int2 p, bool ceil, bool include_pad,
                     std::optional<int64_t> divisor)
    : Module("AvgPool2d"),
      kernel_size(k),
      stride(s.set ? s : k),
      padding(p),
      ceil_mode(ceil),
      count_include_pad(include_pad),
      divisor_override(divisor) {}

Tensor AvgPool2d::forward(const Tensor& x) {
  return avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                    divisor_override);
}

std::string AvgPool2d::extra_repr() const {
  return fmt::format("kernel_size={}, stride={}, padding={}", kernel_size.str(), stride.str(),
                     padding.str());
}

Upsample::Upsample(std::optional<std::array<int64_t, 2>> size_,
                   std::optional<std::array<double, 2>> scale, std::string mode_,
                   std::optional<bool> corners)
    : Module("Upsample"),
      size(size_),
      scale_factor(scale),
      mode(std::move(mode_)),
      align_corners(corners) {
  if (size.has_value() == scale_factor.has_value())
    throw std::invalid_argument("Upsample: exactly one of size or scale_factor must be given");
  if (mode != "nearest" && mode != "bilinear")
    throw std::invalid_argument(
        fmt::format("Upsample: mode '{}' is not supported (nearest or bilinear)", mode));
  if (mode == "nearest" && align_corners.has_value())
    throw std::invalid_argument(
        "Upsample: align_corners option can only be set with the interpolating modes");
}

Tensor Upsample::forward(const Tensor& x) {
  return functional::interpolate(x, size, scale_factor, mode, align_corners);
}

std::string Upsample::extra_repr() const {
  std::string s =
      size ? fmt::format("size=({}, {})", (*size)[0], (*size)[1])
           : fmt::format("scale_factor=({}, {})", (*scale_factor)[0], (*scale_factor)[1]);
  return s + fmt::format(", mode='{}'", mode);
}

}  // namespace tally::nn
