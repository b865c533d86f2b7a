// ResNet-18/34/50/101 as torchvision builds them, and resnet_tiny.
#include "nn/models/resnet.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>

#include "nn/checkpoint.h"
#include "nn/init.h"

namespace tally::nn {

namespace {
std::shared_ptr<Conv2d> conv3x3(int64_t in, int64_t out, int64_t stride = 1) {
  return std::make_shared<Conv2d>(in, out, 3, Conv2dOptions{stride, 1, 1, 1, false});
}
std::shared_ptr<Conv2d> conv1x1(int64_t in, int64_t out, int64_t stride = 1) {
  return std::make_shared<Conv2d>(in, out, 1, Conv2dOptions{stride, 0, 1, 1, false});
}

// torchvision's init loop: convs kaiming_normal_(fan_out, relu), norms ones/zeros (done by
// their constructors), Linear keeps its default init; optionally zero the last BN of each
// residual branch.
void init_resnet(Module& model, bool zero_init_residual, Generator* gen) {
  if (SkipInitGuard::active()) return;  // the caller wants uninitialised weights
  for (const auto& [name, m] : model.named_modules()) {
    if (auto* conv = dynamic_cast<Conv2d*>(m)) {
      init::kaiming_normal_(conv->weight, 0.0, "fan_out", "relu", gen);
      if (conv->bias.defined()) init::zeros_(conv->bias);
    } else if (auto* lin = dynamic_cast<Linear*>(m)) {
      lin->reset_parameters(gen);
    } else if (auto* bn = dynamic_cast<BatchNorm2d*>(m)) {
      bn->reset_parameters();
    }
  }
  if (!zero_init_residual) return;
  for (const auto& [name, m] : model.named_modules()) {
    if (auto* b = dynamic_cast<Bottleneck*>(m)) init::zeros_(b->bn3->weight);
    if (auto* b = dynamic_cast<BasicBlock*>(m)) init::zeros_(b->bn2->weight);
  }
}
}  // namespace

Tensor ResidualBlock::add_identity_relu(Tensor out, const Tensor& x) {
  const Tensor identity = downsample ? (*downsample)(x) : x;
  // relu(out + identity) in one pass, under the relu module's name, written over bn's dying
  // output: the sum is never held, and the block ends holding one buffer where it held two.
  return relu->call([&] { return add_relu(std::move(out), identity); });
}

BasicBlock::BasicBlock(int64_t inplanes, int64_t planes, int64_t stride,
                       std::shared_ptr<Sequential> ds)
    : ResidualBlock("BasicBlock") {
  conv1 = register_module("conv1", conv3x3(inplanes, planes, stride));
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(planes));
  relu = register_module("relu", std::make_shared<ReLU>());
  conv2 = register_module("conv2", conv3x3(planes, planes));
  bn2 = register_module("bn2", std::make_shared<BatchNorm2d>(planes));
  if (ds) downsample = register_module("downsample", std::move(ds));
}

Tensor BasicBlock::forward(const Tensor& x) {
  Tensor out = (*relu)((*bn1)((*conv1)(x)));
  out = (*bn2)((*conv2)(out));
  return add_identity_relu(std::move(out), x);
}

Bottleneck::Bottleneck(int64_t inplanes, int64_t planes, int64_t stride,
                       std::shared_ptr<Sequential> ds)
    : ResidualBlock("Bottleneck") {
  const int64_t width = planes;  // base_width 64, groups 1
  conv1 = register_module("conv1", conv1x1(inplanes, width));
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(width));
  conv2 = register_module("conv2", conv3x3(width, width, stride));
  bn2 = register_module("bn2", std::make_shared<BatchNorm2d>(width));
  conv3 = register_module("conv3", conv1x1(width, planes * expansion));
  bn3 = register_module("bn3", std::make_shared<BatchNorm2d>(planes * expansion));
  relu = register_module("relu", std::make_shared<ReLU>());
  if (ds) downsample = register_module("downsample", std::move(ds));
}

Tensor Bottleneck::forward(const Tensor& x) {
  Tensor out = (*relu)((*bn1)((*conv1)(x)));
  out = (*relu)((*bn2)((*conv2)(out)));
  out = (*bn3)((*conv3)(out));
  return add_identity_relu(std::move(out), x);
}

ResNet::ResNet(BlockKind block, const std::vector<int64_t>& layers, ResNetOptions opts)
    : StagedModule("ResNet") {
  if (layers.size() != 4)
    throw std::invalid_argument(
        fmt::format("ResNet: expected 4 stage sizes, got {}", layers.size()));
  const int64_t expansion =
      block == BlockKind::basic ? BasicBlock::expansion : Bottleneck::expansion;
  {
    SkipInitGuard skip;  // init_resnet initialises every weight once
    conv1 = register_module("conv1", std::make_shared<Conv2d>(opts.in_channels, 64, 7,
                                                              Conv2dOptions{2, 3, 1, 1, false}));
    bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(64));
    relu = register_module("relu", std::make_shared<ReLU>());
    maxpool = register_module("maxpool", std::make_shared<MaxPool2d>(3, 2, 1));
    layer1 = register_module("layer1", make_layer(block, 64, layers[0], 1));
    layer2 = register_module("layer2", make_layer(block, 128, layers[1], 2));
    layer3 = register_module("layer3", make_layer(block, 256, layers[2], 2));
    layer4 = register_module("layer4", make_layer(block, 512, layers[3], 2));
    avgpool = register_module("avgpool", std::make_shared<AdaptiveAvgPool2d>(1));
    fc = register_module("fc", std::make_shared<Linear>(512 * expansion, opts.num_classes));
  }
  init_resnet(*this, opts.zero_init_residual, opts.gen);
}

std::shared_ptr<Sequential> ResNet::make_layer(BlockKind block, int64_t planes, int64_t blocks,
                                               int64_t stride) {
  const int64_t expansion =
      block == BlockKind::basic ? BasicBlock::expansion : Bottleneck::expansion;
  std::shared_ptr<Sequential> downsample;
  if (stride != 1 || inplanes_ != planes * expansion) {
    downsample = std::make_shared<Sequential>();
    downsample->push_back(conv1x1(inplanes_, planes * expansion, stride));
    downsample->push_back(std::make_shared<BatchNorm2d>(planes * expansion));
  }
  auto layer = std::make_shared<Sequential>();
  auto make = [&](int64_t s, std::shared_ptr<Sequential> ds) -> std::shared_ptr<Module> {
    if (block == BlockKind::basic)
      return std::make_shared<BasicBlock>(inplanes_, planes, s, std::move(ds));
    return std::make_shared<Bottleneck>(inplanes_, planes, s, std::move(ds));
  };
  layer->push_back(make(stride, downsample));
  inplanes_ = planes * expansion;
  for (int64_t i = 1; i < blocks; ++i) layer->push_back(make(1, nullptr));
  return layer;
}

namespace {
// checkpoint_sequential over the stages (when segments <= stages) or over their blocks.
Tensor run_stages_checkpointed(const std::vector<std::shared_ptr<Sequential>>& stages, int segments,
                               const Tensor& x) {
  std::vector<std::function<Tensor(const Tensor&)>> fns;
  if (segments <= static_cast<int>(stages.size())) {
    for (const auto& s : stages) fns.push_back([s](const Tensor& in) { return (*s)(in); });
  } else {
    for (const auto& s : stages)
      for (const auto& [name, block] : s->named_children()) {
        // Each block runs under its stage's module path, as without checkpointing.
        fns.push_back(
            [s, block = block](const Tensor& in) { return s->call([&] { return (*block)(in); }); });
      }
  }
  return checkpoint_sequential(fns, std::min<int>(segments, static_cast<int>(fns.size())), x);
}
}  // namespace

Tensor ResNet::forward(const Tensor& x) {
  cache_autocast_casts(*this);  // under autocast: every layer's weight cast in one launch
  Tensor y = (*maxpool)((*relu)((*bn1)((*conv1)(x))));
  if (checkpoint_segments > 0)
    y = run_stages_checkpointed({layer1, layer2, layer3, layer4}, checkpoint_segments, y);
  else
    y = (*layer4)((*layer3)((*layer2)((*layer1)(y))));
  y = (*avgpool)(y).flatten(1);
  return (*fc)(y);
}

std::shared_ptr<ResNet> resnet18(ResNetOptions o) {
  return std::make_shared<ResNet>(BlockKind::basic, std::vector<int64_t>{2, 2, 2, 2}, o);
}
std::shared_ptr<ResNet> resnet34(ResNetOptions o) {
  return std::make_shared<ResNet>(BlockKind::basic, std::vector<int64_t>{3, 4, 6, 3}, o);
}
std::shared_ptr<ResNet> resnet50(ResNetOptions o) {
  return std::make_shared<ResNet>(BlockKind::bottleneck, std::vector<int64_t>{3, 4, 6, 3}, o);
}
std::shared_ptr<ResNet> resnet101(ResNetOptions o) {
  return std::make_shared<ResNet>(BlockKind::bottleneck, std::vector<int64_t>{3, 4, 23, 3}, o);
}

ResNetTiny::ResNetTiny(ResNetOptions opts) : StagedModule("ResNetTiny") {
  {
    SkipInitGuard skip;
    conv1 = register_module("conv1", conv3x3(opts.in_channels, 16));
    bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(16));
    relu = register_module("relu", std::make_shared<ReLU>());
    layer1 = register_module("layer1", std::make_shared<Sequential>());
    layer1->push_back(std::make_shared<BasicBlock>(16, 16));
    auto down = [](int64_t in, int64_t out) {
      auto ds = std::make_shared<Sequential>();
      ds->push_back(conv1x1(in, out, 2));
      ds->push_back(std::make_shared<BatchNorm2d>(out));
      return ds;
    };
    layer2 = register_module("layer2", std::make_shared<Sequential>());
    layer2->push_back(std::make_shared<BasicBlock>(16, 32, 2, down(16, 32)));
    layer3 = register_module("layer3", std::make_shared<Sequential>());
    layer3->push_back(std::make_shared<BasicBlock>(32, 64, 2, down(32, 64)));
    avgpool = register_module("avgpool", std::make_shared<AdaptiveAvgPool2d>(1));
    fc = register_module("fc", std::make_shared<Linear>(64, opts.num_classes));
  }
  init_resnet(*this, opts.zero_init_residual, opts.gen);
}

Tensor ResNetTiny::forward(const Tensor& x) {
  Tensor y = (*relu)((*bn1)((*conv1)(x)));
  if (checkpoint_segments > 0)
    y = run_stages_checkpointed({layer1, layer2, layer3}, checkpoint_segments, y);
  else
    y = (*layer3)((*layer2)((*layer1)(y)));
  return (*fc)((*avgpool)(y).flatten(1));
}

std::shared_ptr<ResNetTiny> resnet_tiny(ResNetOptions o) {
  return std::make_shared<ResNetTiny>(o);
}

std::shared_ptr<Module> resnet_by_name(const std::string& arch, ResNetOptions opts) {
  if (arch == "tiny") return resnet_tiny(opts);
  if (arch == "resnet18") return resnet18(opts);
  if (arch == "resnet34") return resnet34(opts);
  if (arch == "resnet50") return resnet50(opts);
  if (arch == "resnet101") return resnet101(opts);
  throw std::invalid_argument(
      fmt::format("unknown ResNet '{}' (tiny, resnet18, resnet34, resnet50, resnet101)", arch));
}

}  // namespace tally::nn
