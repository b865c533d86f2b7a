// torch.nn.init: in-place, no-grad initialisers drawing from tally's Philox Generator (the
// default generator unless one is given), so a seed gives reproducible weights. Scratch
// tensors are tagged `temporary`; the tensor written keeps its own block and tag.
#pragma once

#include <string>

#include "autograd/ops.h"

namespace tally::nn::init {

// fan_in and fan_out of a weight ([out, in] or [out, in/groups, kH, kW]), PyTorch's rule.
std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& t);
// torch.nn.init.calculate_gain for "linear", "conv2d", "sigmoid", "tanh", "relu",
// "leaky_relu" (param = negative slope, default 0.01).
double calculate_gain(const std::string& nonlinearity, double param = 0.01);

void uniform_(const Tensor& t, double a = 0.0, double b = 1.0, Generator* gen = nullptr);
void normal_(const Tensor& t, double mean = 0.0, double std = 1.0, Generator* gen = nullptr);
void constant_(const Tensor& t, double value);
void zeros_(const Tensor& t);
void ones_(const Tensor& t);
// mode "fan_in" | "fan_out"; nonlinearity "leaky_relu" (with slope a) | "relu" | ...
void kaiming_uniform_(const Tensor& t, double a = 0.0, const std::string& mode = "fan_in",
                      const std::string& nonlinearity = "leaky_relu", Generator* gen = nullptr);
void kaiming_normal_(const Tensor& t, double a = 0.0, const std::string& mode = "fan_in",
                     const std::string& nonlinearity = "leaky_relu", Generator* gen = nullptr);

// U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)).
void xavier_uniform_(const Tensor& t, double gain = 1.0, Generator* gen = nullptr);
// N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out)).
void xavier_normal_(const Tensor& t, double gain = 1.0, Generator* gen = nullptr);
// N(mean, std^2) conditioned on [a, b] (a < b): out-of-range draws are drawn again, on the
// tensor's device, until none is left, so the values follow the truncated law exactly. [a, b]
// must hold at least 5% of N(mean, std^2) (std::invalid_argument otherwise).
void trunc_normal_(const Tensor& t, double mean = 0.0, double std = 1.0, double a = -2.0,
                   double b = 2.0, Generator* gen = nullptr);

}  // namespace tally::nn::init
