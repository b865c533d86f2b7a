// torch.nn.init's initialisers over ops:: kernels (no graph recorded).
#include "nn/init.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "memory/context.h"

namespace tally::nn::init {

std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& t) {
  if (t.dim() < 2)
    throw std::invalid_argument(
        fmt::format("init: fan in and fan out can not be computed for a tensor with fewer than 2 "
                    "dimensions ({})",
                    t.shape_string()));
  int64_t receptive = 1;
  for (int64_t d = 2; d < t.dim(); ++d) receptive *= t.size(d);
  return {t.size(1) * receptive, t.size(0) * receptive};
}

double calculate_gain(const std::string& nl, double param) {
  if (nl == "linear" || nl == "conv1d" || nl == "conv2d" || nl == "conv3d" || nl == "sigmoid")
    return 1.0;
  if (nl == "tanh") return 5.0 / 3.0;
  if (nl == "relu") return std::sqrt(2.0);
  if (nl == "leaky_relu") return std::sqrt(2.0 / (1.0 + param * param));
  if (nl == "selu") return 3.0 / 4.0;
  throw std::invalid_argument(fmt::format("init: unsupported nonlinearity '{}'", nl));
}

void uniform_(const Tensor& t, double a, double b, Generator* gen) {
  NoGradGuard ng;
  Tensor r;
  {
    memory::CategoryScope cat(memory::Category::temporary);
    r = ops::affine(ops::rand(t.sizes(), DType::float32, t.device(), gen), b - a, a);
  }
  ops::copy_(t, r);
}

void normal_(const Tensor& t, double mean, double std, Generator* gen) {
  NoGradGuard ng;
  Tensor r;
  {
    memory::CategoryScope cat(memory::Category::temporary);
    r = ops::affine(ops::randn(t.sizes(), DType::float32, t.device(), gen), std, mean);
  }
  ops::copy_(t, r);
}

void constant_(const Tensor& t, double value) {
  NoGradGuard ng;
  ops::fill_(t, value);
}
void zeros_(const Tensor& t) {
  constant_(t, 0.0);
}
void ones_(const Tensor& t) {
  constant_(t, 1.0);
}

static double kaiming_std(const Tensor& t, double a, const std::string& mode,
                          const std::string& nl) {
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  int64_t fan;
  if (mode == "fan_in")
    fan = fan_in;
  else if (mode == "fan_out")
    fan = fan_out;
  else
    throw std::invalid_argument(fmt::format("init: mode '{}' is not fan_in or fan_out", mode));
  if (fan == 0)
    throw std::invalid_argument("init: kaiming initialisation of a zero-element tensor");
  return calculate_gain(nl, a) / std::sqrt(static_cast<double>(fan));
}

void kaiming_uniform_(const Tensor& t, double a, const std::string& mode, const std::string& nl,
                      Generator* gen) {
  const double bound = std::sqrt(3.0) * kaiming_std(t, a, mode, nl);
  uniform_(t, -bound, bound, gen);
}

void kaiming_normal_(const Tensor& t, double a, const std::string& mode, const std::string& nl,
                     Generator* gen) {
  normal_(t, 0.0, kaiming_std(t, a, mode, nl), gen);
}

}  // namespace tally::nn::init
