// Activation layers (torch.nn): SiLU, Tanh, Sigmoid, Softmax, LogSoftmax, LeakyReLU, each a
// module over the differentiable op of the same name (ReLU and GELU are in nn/layers.h).
// PyTorch's `inplace` flags are not taken: these compute out of place.
#pragma once

#include <optional>
#include <string>
#include <utility>

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

// Softmax and LogSoftmax: a layer over one dim; dim nullopt: PyTorch's legacy choice (0 for
// 0-, 1- and 3-D inputs, else 1).
class SoftmaxOverDim : public Module {
 public:
  std::string extra_repr() const override;
  std::optional<int64_t> dim;

 protected:
  SoftmaxOverDim(std::string type_name, std::optional<int64_t> dim)
      : Module(std::move(type_name)), dim(dim) {}
  int64_t dim_for(const Tensor& x) const;  // dim, or the legacy choice for x
};

class Softmax : public SoftmaxOverDim {
 public:
  explicit Softmax(std::optional<int64_t> dim = std::nullopt) : SoftmaxOverDim("Softmax", dim) {}
  Tensor forward(const Tensor& x) override;
};

class LogSoftmax : public SoftmaxOverDim {
 public:
  explicit LogSoftmax(std::optional<int64_t> dim = std::nullopt)
      : SoftmaxOverDim("LogSoftmax", dim) {}
  Tensor forward(const Tensor& x) override;
};

class LeakyReLU : public Module {
 public:
  explicit LeakyReLU(double negative_slope = 0.01);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  double negative_slope;
};

}  // namespace tally::nn
