// AvgPool2d and Upsample (nn/pooling.h).
#include "nn/pooling.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

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

Upsample::Upsample(std::optional<std::vector<int64_t>> size_,
                   std::optional<std::vector<double>> scale, std::string mode_,
                   std::optional<bool> corners)
    : Module("Upsample"),
      size(std::move(size_)),
      scale_factor(std::move(scale)),
      mode(std::move(mode_)),
      align_corners(corners) {
  if (size.has_value() == scale_factor.has_value())
    throw std::invalid_argument("Upsample: exactly one of size or scale_factor must be given");
  if (mode != "nearest" && mode != "linear" && mode != "bilinear" && mode != "trilinear")
    throw std::invalid_argument(fmt::format(
        "Upsample: mode '{}' is not supported (nearest, linear, bilinear or trilinear)", mode));
  if (mode == "nearest" && align_corners.has_value())
    throw std::invalid_argument(
        "Upsample: align_corners option can only be set with the interpolating modes");
}

namespace {

template <typename V, size_t N>
std::optional<std::vector<V>> as_vector(const std::optional<std::array<V, N>>& a) {
  if (!a) return std::nullopt;
  return std::vector<V>(a->begin(), a->end());
}

}  // namespace

Upsample::Upsample(std::optional<std::array<int64_t, 2>> size_,
                   std::optional<std::array<double, 2>> scale, std::string mode_,
                   std::optional<bool> corners)
    : Upsample(as_vector(size_), as_vector(scale), std::move(mode_), corners) {}

Tensor Upsample::forward(const Tensor& x) {
  return functional::interpolate(x, size, scale_factor, mode, align_corners);
}

std::string Upsample::extra_repr() const {
  std::string s = size ? fmt::format("size=({})", fmt::join(*size, ", "))
                       : fmt::format("scale_factor=({})", fmt::join(*scale_factor, ", "));
  return s + fmt::format(", mode='{}'", mode);
}

}  // namespace tally::nn
