// The basic layers (torch.nn): Linear, Conv2d, Embedding, Dropout, ReLU, GELU, MaxPool2d,
// AdaptiveAvgPool2d, Flatten, Identity, with PyTorch's constructor arguments, parameter
// names and default initialisations (drawn from tally's default Generator, or `gen`).
// Normalisation layers are in nn/norm.h, containers in nn/container.h, losses in nn/loss.h.
#pragma once

#include <optional>
#include <string>

#include "nn/module.h"

namespace tally::nn {

// A new parameter tensor (float32, uninitialised) on build_device(), allocated under
// Category::parameter. Every layer makes its parameters and buffers through it.
Tensor make_parameter(const Shape& shape, DType dtype = DType::float32);

// The device layers are built on: the CPU, or the device of the innermost BuildOnDevice on
// this thread. PyTorch's `with torch.device(d): model = GPT(cfg)`: a model built inside
// BuildOnDevice(d) allocates and initialises its parameters on d directly, so a dry run on
// a meta device (memory/estimate.h) never touches host memory and a CUDA model skips the
// host copy.
Device build_device();
class BuildOnDevice {
 public:
  explicit BuildOnDevice(Device device);
  ~BuildOnDevice();
  BuildOnDevice(const BuildOnDevice&) = delete;
  BuildOnDevice& operator=(const BuildOnDevice&) = delete;

 private:
  Device previous_;
};

// y = x W^T + b; weight [out, in] kaiming_uniform(a=sqrt(5)), bias U(-1/sqrt(in), 1/sqrt(in)).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  void reset_parameters(Generator* gen = nullptr);
  std::string extra_repr() const override;

  int64_t in_features, out_features;
  Tensor weight, bias;
  // A LoRA adapter (nn/lora.h, set by nn::lora::inject): when lora_A is set, forward adds
  // lora_scaling * lora_B(lora_A(lora_dropout(x))). The three are registered children.
  std::shared_ptr<Linear> lora_A, lora_B;
  std::shared_ptr<Module> lora_dropout;
  double lora_scaling = 0.0;
};

struct Conv2dOptions {
  Int2 stride = 1, padding = 0, dilation = 1;
  int64_t groups = 1;
  bool bias = true;
};

// weight [out, in/groups, kH, kW] kaiming_uniform(a=sqrt(5)), bias U(+-1/sqrt(fan_in)).
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, Int2 kernel_size, Conv2dOptions opts = {},
         Generator* gen = nullptr);
  // The torchvision spelling: Conv2d(in, out, k, stride, padding, bias).
  Conv2d(int64_t in_channels, int64_t out_channels, Int2 kernel_size, Int2 stride, Int2 padding,
         bool bias = true, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  void reset_parameters(Generator* gen = nullptr);
  std::string extra_repr() const override;

  int64_t in_channels, out_channels;
  Int2 kernel_size;
  Conv2dOptions options;
  Tensor weight, bias;
};

// Rows of weight [num_embeddings, embedding_dim] ~ N(0, 1) (padding_idx row zero).
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim,
            std::optional<int64_t> padding_idx = std::nullopt, Generator* gen = nullptr);
  Tensor forward(const Tensor& indices) override;
  void reset_parameters(Generator* gen = nullptr);
  std::string extra_repr() const override;

  int64_t num_embeddings, embedding_dim;
  int64_t padding_idx = -1;
  Tensor weight;
};

// Inverted dropout while training; identity in eval. `gen` null: the default generator.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  double p;
  Generator* gen;
};

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override;
};

// approximate "none" (erf) | "tanh".
class GELU : public Module {
 public:
  explicit GELU(std::string approximate = "none");
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  std::string approximate;
};

class MaxPool2d : public Module {
 public:
  MaxPool2d(Int2 kernel_size, Int2 stride = {}, Int2 padding = 0, Int2 dilation = 1,
            bool ceil_mode = false);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  Int2 kernel_size, stride, padding, dilation;
  bool ceil_mode;
};

class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(Int2 output_size);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  Int2 output_size;
};

class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1);
  Tensor forward(const Tensor& x) override;
  int64_t start_dim, end_dim;
};

class Identity : public Module {
 public:
  Identity() : Module("Identity") {}
  Tensor forward(const Tensor& x) override { return x; }
};

// Under autocast, casts the weights and biases of every Linear and Conv2d in `root` (root
// included) into autocast's weight cache now, in one multi-tensor copy
// (autocast::cache_casts), each under its layer's module path, instead of one cast per layer
// when the layer first runs: GPT and ResNet call it at the top of their forward. Outside an
// autocast region it does nothing and walks nothing.
void cache_autocast_casts(const Module& root);

}  // namespace tally::nn
