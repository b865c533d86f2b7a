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

static double xavier_std(const Tensor& t, double gain) {
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  if (fan_in + fan_out == 0)
    throw std::invalid_argument(
        fmt::format("init: xavier initialisation of a zero-element tensor {}", t.shape_string()));
  return gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
}

void xavier_uniform_(const Tensor& t, double gain, Generator* gen) {
  const double a = std::sqrt(3.0) * xavier_std(t, gain);
  uniform_(t, -a, a, gen);
}

void xavier_normal_(const Tensor& t, double gain, Generator* gen) {
  normal_(t, 0.0, xavier_std(t, gain), gen);
}

void trunc_normal_(const Tensor& t, double mean, double std, double a, double b, Generator* gen) {
  if (!(a < b) || !(std > 0.0) || !std::isfinite(mean) || !std::isfinite(std))
    throw std::invalid_argument(fmt::format(
        "trunc_normal_: needs a < b, a finite mean and a finite std > 0, got mean={}, std={}, "
        "a={}, b={}",
        mean, std, a, b));
  const double lo = (a - mean) / std, hi = (b - mean) / std;
  // The chance one draw lands in [lo, hi]: below 5% the redraws would take too many rounds.
  const double p_in = 0.5 * (std::erf(hi / std::sqrt(2.0)) - std::erf(lo / std::sqrt(2.0)));
  if (p_in < 0.05)
    throw std::invalid_argument(fmt::format(
        "trunc_normal_: [{}, {}] holds only {:.3g} of N({}, {}^2); trunc_normal_ draws again "
        "until every value is inside, which needs at least 5%",
        a, b, p_in, mean, std));
  NoGradGuard ng;
  memory::CategoryScope cat(memory::Category::temporary);
  const Tensor lo_t = ops::full({}, lo, DType::float32, t.device());
  const Tensor hi_t = ops::full({}, hi, DType::float32, t.device());
  const Tensor zero = ops::full({}, 0.0, DType::float32, t.device());
  Tensor r = ops::randn(t.sizes(), DType::float32, t.device(), gen);
  // Each round redraws every element and keeps the new value only where the old was out of
  // range; about log(numel) / -log(1 - p_in) rounds (6 for a 2-std cut of 10^8 values).
  for (int round = 0; t.device().type != DeviceType::meta; ++round) {
    const Tensor outside =
        ops::add(ops::to(ops::binary(ops::BinaryOp::lt, r, lo_t), DType::float32),
                 ops::to(ops::binary(ops::BinaryOp::gt, r, hi_t), DType::float32));
    if (ops::item(ops::sum(outside)) == 0.0) break;
    if (round >= 10000) throw std::runtime_error("trunc_normal_: redraws did not converge");
    r = ops::where(ops::binary(ops::BinaryOp::gt, outside, zero),
                   ops::randn(t.sizes(), DType::float32, t.device(), gen), r);
  }
  ops::copy_(t, ops::affine(r, std, mean));
}

}  // namespace tally::nn::init
