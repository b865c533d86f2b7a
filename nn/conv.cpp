// Conv1d and ConvTranspose2d (nn/conv.h).
#include "nn/conv.h"

#include <fmt/format.h>

#include <cmath>

#include "nn/functional.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "tensor/conv/transpose.h"

namespace tally::nn {

namespace {
// PyTorch's _ConvNd.reset_parameters.
void reset_conv(const Tensor& weight, const Tensor& bias, Generator* gen) {
  init::kaiming_uniform_(weight, std::sqrt(5.0), "fan_in", "leaky_relu", gen);
  if (bias.defined()) {
    const int64_t fan_in = init::calculate_fan_in_and_fan_out(weight).first;
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    init::uniform_(bias, -bound, bound, gen);
  }
}

void check_channels(const char* type, int64_t in, int64_t out, int64_t groups) {
  if (in <= 0 || out <= 0 || groups <= 0 || in % groups != 0 || out % groups != 0)
    throw std::invalid_argument(fmt::format(
        "{}: in_channels ({}) and out_channels ({}) must be positive and divisible by groups "
        "({})",
        type, in, out, groups));
}
}  // namespace

Conv1d::Conv1d(int64_t in, int64_t out, int64_t k, int64_t s, int64_t p, int64_t d, int64_t g,
               bool has_bias, Generator* gen)
    : Module("Conv1d"),
      in_channels(in),
      out_channels(out),
      kernel_size(k),
      stride(s),
      padding(p),
      dilation(d),
      groups(g) {
  check_channels("Conv1d", in, out, g);
  if (k <= 0 || s <= 0 || d <= 0 || p < 0)
    throw std::invalid_argument(fmt::format(
        "Conv1d: kernel_size ({}), stride ({}) and dilation ({}) must be positive, padding ({}) "
        "non-negative",
        k, s, d, p));
  weight = register_parameter("weight", make_parameter({out, in / g, k}));
  if (has_bias) bias = register_parameter("bias", make_parameter({out}));
  if (!SkipInitGuard::active()) reset_parameters(gen);
}

void Conv1d::reset_parameters(Generator* gen) {
  reset_conv(weight, bias, gen);
}

Tensor Conv1d::forward(const Tensor& x) {
  return functional::conv1d(x, weight, bias, stride, padding, dilation, groups);
}

std::string Conv1d::extra_repr() const {
  std::string s = fmt::format("{}, {}, kernel_size=({},), stride=({},)", in_channels, out_channels,
                              kernel_size, stride);
  if (padding) s += fmt::format(", padding=({},)", padding);
  if (dilation != 1) s += fmt::format(", dilation=({},)", dilation);
  if (groups != 1) s += fmt::format(", groups={}", groups);
  if (!bias.defined()) s += ", bias=False";
  return s;
}

ConvTranspose2d::ConvTranspose2d(int64_t in, int64_t out, Int2 k, Int2 s, Int2 p, Int2 op,
                                 int64_t g, bool has_bias, Int2 d, Generator* gen)
    : Module("ConvTranspose2d"),
      in_channels(in),
      out_channels(out),
      kernel_size(k),
      stride(s),
      padding(p),
      output_padding(op),
      groups(g),
      dilation(d) {
  check_channels("ConvTranspose2d", in, out, g);
  if (!k.set || k.h <= 0 || k.w <= 0)
    throw std::invalid_argument(fmt::format("ConvTranspose2d: bad kernel_size {}", k.str()));
  if (op.h >= s.h || op.w >= s.w)
    throw std::invalid_argument(fmt::format(
        "ConvTranspose2d: output_padding {} must be smaller than stride {}", op.str(), s.str()));
  weight = register_parameter("weight", make_parameter({in, out / g, k.h, k.w}));
  if (has_bias) bias = register_parameter("bias", make_parameter({out}));
  if (!SkipInitGuard::active()) reset_parameters(gen);
}

void ConvTranspose2d::reset_parameters(Generator* gen) {
  reset_conv(weight, bias, gen);
}

Tensor ConvTranspose2d::forward(const Tensor& x) {
  return conv_transpose2d(x, weight, bias, stride, padding, output_padding, groups, dilation);
}

std::string ConvTranspose2d::extra_repr() const {
  std::string s = fmt::format("{}, {}, kernel_size=({}, {}), stride=({}, {})", in_channels,
                              out_channels, kernel_size.h, kernel_size.w, stride.h, stride.w);
  if (padding.h || padding.w) s += fmt::format(", padding=({}, {})", padding.h, padding.w);
  if (output_padding.h || output_padding.w)
    s += fmt::format(", output_padding=({}, {})", output_padding.h, output_padding.w);
  if (dilation.h != 1 || dilation.w != 1)
    s += fmt::format(", dilation=({}, {})", dilation.h, dilation.w);
  if (groups != 1) s += fmt::format(", groups={}", groups);
  if (!bias.defined()) s += ", bias=False";
  return s;
}

}  // namespace tally::nn
