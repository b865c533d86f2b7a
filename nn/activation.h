// Activation layers (torch.nn): SiLU, Tanh, Sigmoid, Softmax, LogSoftmax, LeakyReLU, each a
// module over the differentiable op of the same name (ReLU and GELU are in nn/layers.h).
// PyTorch's `inplace` flags are not taken: these compute out of place.
#pragma once

#include <optional>
#include <string>

#include "nn/module.h"

namespace tally::nn {

class SiLU : public Module {
 public:
  SiLU() : Module("SiLU") {}
  Tensor forward(const Tensor& x) override;
};

class Tanh : public Module {
 public:
  Tanh() : Module("Tanh") {}
  Tensor forward(const Tensor& x) override;
};

class Sigmoid : public Module {
 public:
  Sigmoid() : Module("Sigmoid") {}
  Tensor forward(const Tensor& x) override;
};

// dim nullopt: PyTorch's legacy choice (0 for 0-, 1- and 3-D inputs, else 1).
class Softmax : public Module {
 public:
  explicit Softmax(std::optional<int64_t> dim = std::nullopt);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  std::optional<int64_t> dim;
};

class LogSoftmax : public Module {
 public:
  explicit LogSoftmax(std::optional<int64_t> dim = std::nullopt);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  std::optional<int64_t> dim;
};

class LeakyReLU : public Module {
 public:
  explicit LeakyReLU(double negative_slope = 0.01);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  double negative_slope;
};

}  // namespace tally::nn
