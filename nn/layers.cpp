// The basic layers: construction with PyTorch's default initialisation, and forwards over
// the differentiable ops of autograd/.
#include "nn/layers.h"

#include <fmt/format.h>

#include <cmath>

#include "autograd/autocast.h"
#include "nn/init.h"

namespace tally::nn {

namespace {
thread_local Device t_build_device = Device::cpu();
}  // namespace

Device build_device() {
  return t_build_device;
}

BuildOnDevice::BuildOnDevice(Device device) : previous_(t_build_device) {
  t_build_device = device;
}

BuildOnDevice::~BuildOnDevice() {
  t_build_device = previous_;
}

Tensor make_parameter(const Shape& shape, DType dtype) {
  memory::CategoryScope cat(memory::Category::parameter);
  memory::CallSiteScope site;  // this line, unless a user's line is open (CallSiteScope)
  return ops::empty(shape, dtype, t_build_device);
}

// ---- Linear ----
Linear::Linear(int64_t in, int64_t out, bool has_bias, Generator* gen)
    : Module("Linear"), in_features(in), out_features(out) {
  if (in < 0 || out < 0)
    throw std::invalid_argument(fmt::format("Linear: negative size ({}, {})", in, out));
  weight = register_parameter("weight", make_parameter({out, in}));
  if (has_bias) bias = register_parameter("bias", make_parameter({out}));
  if (!SkipInitGuard::active()) reset_parameters(gen);
}

void Linear::reset_parameters(Generator* gen) {
  init::kaiming_uniform_(weight, std::sqrt(5.0), "fan_in", "leaky_relu", gen);
  if (bias.defined()) {
    const double bound = in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
    init::uniform_(bias, -bound, bound, gen);
  }
}

Tensor Linear::forward(const Tensor& x) {
  Tensor y = linear(x, weight, bias);
  if (!lora_A) return y;
  const Tensor d = lora_dropout ? (*lora_dropout)(x) : x;
  return add(y, mul((*lora_B)((*lora_A)(d)), lora_scaling));
}

std::string Linear::extra_repr() const {
  return fmt::format("in_features={}, out_features={}, bias={}", in_features, out_features,
                     bias.defined() ? "True" : "False");
}

// ---- Conv2d ----
Conv2d::Conv2d(int64_t in, int64_t out, Int2 k, Conv2dOptions opts, Generator* gen)
    : Module("Conv2d"), in_channels(in), out_channels(out), kernel_size(k), options(opts) {
  if (opts.groups <= 0 || in % opts.groups != 0 || out % opts.groups != 0)
    throw std::invalid_argument(fmt::format(
        "Conv2d: in_channels ({}) and out_channels ({}) must be divisible by groups ({})", in, out,
        opts.groups));
  if (!k.set || k.h <= 0 || k.w <= 0)
    throw std::invalid_argument(fmt::format("Conv2d: bad kernel_size {}", k.str()));
  weight = register_parameter("weight", make_parameter({out, in / opts.groups, k.h, k.w}));
  if (opts.bias) bias = register_parameter("bias", make_parameter({out}));
  if (!SkipInitGuard::active()) reset_parameters(gen);
}

Conv2d::Conv2d(int64_t in, int64_t out, Int2 k, Int2 stride, Int2 padding, bool has_bias,
               Generator* gen)
    : Conv2d(in, out, k, Conv2dOptions{stride, padding, 1, 1, has_bias}, gen) {}

void Conv2d::reset_parameters(Generator* gen) {
  init::kaiming_uniform_(weight, std::sqrt(5.0), "fan_in", "leaky_relu", gen);
  if (bias.defined()) {
    const int64_t fan_in = init::calculate_fan_in_and_fan_out(weight).first;
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    init::uniform_(bias, -bound, bound, gen);
  }
}

Tensor Conv2d::forward(const Tensor& x) {
  return conv2d(x, weight, bias, options.stride, options.padding, options.dilation, options.groups);
}

std::string Conv2d::extra_repr() const {
  std::string s =
      fmt::format("{}, {}, kernel_size=({}, {}), stride=({}, {})", in_channels, out_channels,
                  kernel_size.h, kernel_size.w, options.stride.h, options.stride.w);
  if (options.padding.h || options.padding.w)
    s += fmt::format(", padding=({}, {})", options.padding.h, options.padding.w);
  if (options.dilation.h != 1 || options.dilation.w != 1)
    s += fmt::format(", dilation=({}, {})", options.dilation.h, options.dilation.w);
  if (options.groups != 1) s += fmt::format(", groups={}", options.groups);
  if (!bias.defined()) s += ", bias=False";
  return s;
}

// ---- Embedding ----
Embedding::Embedding(int64_t n, int64_t d, std::optional<int64_t> pad, Generator* gen)
    : Module("Embedding"), num_embeddings(n), embedding_dim(d) {
  if (pad) {
    int64_t p = *pad < 0 ? *pad + n : *pad;
    if (p < 0 || p >= n)
      throw std::invalid_argument(
          fmt::format("Embedding: padding_idx {} out of range for {} embeddings", *pad, n));
    padding_idx = p;
  }
  weight = register_parameter("weight", make_parameter({n, d}));
  if (!SkipInitGuard::active()) reset_parameters(gen);
}

void Embedding::reset_parameters(Generator* gen) {
  init::normal_(weight, 0.0, 1.0, gen);
  if (padding_idx >= 0) {
    NoGradGuard ng;
    ops::zero_(ops::select(weight, 0, padding_idx));
  }
}

Tensor Embedding::forward(const Tensor& indices) {
  return embedding(weight, indices, padding_idx);
}

std::string Embedding::extra_repr() const {
  std::string s = fmt::format("{}, {}", num_embeddings, embedding_dim);
  if (padding_idx >= 0) s += fmt::format(", padding_idx={}", padding_idx);
  return s;
}

// ---- Dropout and activations ----
Dropout::Dropout(double p_, Generator* g) : Module("Dropout"), p(p_), gen(g) {
  if (p < 0.0 || p > 1.0)
    throw std::invalid_argument(
        fmt::format("Dropout: probability has to be between 0 and 1, but got {}", p));
}
Tensor Dropout::forward(const Tensor& x) {
  if (!is_training() || p == 0.0) return x;
  return dropout(x, p, true, gen);
}
std::string Dropout::extra_repr() const {
  return fmt::format("p={}", p);
}

Tensor ReLU::forward(const Tensor& x) {
  return relu(x);
}

GELU::GELU(std::string approx) : Module("GELU"), approximate(std::move(approx)) {
  if (approximate != "none" && approximate != "tanh")
    throw std::invalid_argument(
        fmt::format("GELU: approximate must be 'none' or 'tanh', got '{}'", approximate));
}
Tensor GELU::forward(const Tensor& x) {
  return gelu(x, approximate);
}
std::string GELU::extra_repr() const {
  return fmt::format("approximate='{}'", approximate);
}

// ---- pooling, flatten ----
MaxPool2d::MaxPool2d(Int2 k, Int2 s, Int2 p, Int2 d, bool ceil)
    : Module("MaxPool2d"),
      kernel_size(k),
      stride(s.set ? s : k),
      padding(p),
      dilation(d),
      ceil_mode(ceil) {}
Tensor MaxPool2d::forward(const Tensor& x) {
  return max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode);
}
std::string MaxPool2d::extra_repr() const {
  return fmt::format("kernel_size={}, stride={}, padding={}, dilation={}, ceil_mode={}",
                     kernel_size.str(), stride.str(), padding.str(), dilation.str(), ceil_mode);
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(Int2 out) : Module("AdaptiveAvgPool2d"), output_size(out) {}
Tensor AdaptiveAvgPool2d::forward(const Tensor& x) {
  return adaptive_avg_pool2d(x, output_size);
}
std::string AdaptiveAvgPool2d::extra_repr() const {
  return "output_size=" + output_size.str();
}

Flatten::Flatten(int64_t s, int64_t e) : Module("Flatten"), start_dim(s), end_dim(e) {}
Tensor Flatten::forward(const Tensor& x) {
  return x.flatten(start_dim, end_dim);
}

void cache_autocast_casts(const Module& root) {
  // Autocast's state is per device type: no region open on any, nothing to walk.
  if (!autocast::is_active(Device::cpu()) && !autocast::is_active(Device::cuda(0)) &&
      !autocast::is_active(Device::meta()))
    return;
  TensorList params;
  std::vector<std::string> names;
  for (const auto& [name, m] : root.named_modules()) {
    const Tensor *w = nullptr, *b = nullptr;
    if (const auto* l = dynamic_cast<const Linear*>(m)) {
      w = &l->weight;
      b = &l->bias;
    } else if (const auto* c = dynamic_cast<const Conv2d*>(m)) {
      w = &c->weight;
      b = &c->bias;
    }
    if (!w) continue;
    for (const Tensor* t : {w, b}) {
      if (!t->defined()) continue;
      params.push_back(*t);
      names.push_back(name);
    }
  }
  autocast::cache_casts(params, names);
}

}  // namespace tally::nn
