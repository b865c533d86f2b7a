// ResNet (torchvision.models.resnet, v1.5): the exact structure and parameter/buffer names
// (conv1, bn1, relu, maxpool, layer1..layer4 of BasicBlock / Bottleneck with
// downsample.0 / downsample.1, avgpool, fc), stride on the Bottleneck's 3x3 conv2,
// kaiming_normal_(fan_out, relu) convolutions, BatchNorm ones/zeros, fc with Linear's
// default init, zero_init_residual=false. `in_channels` (1 for Fashion-MNIST) changes only
// conv1. Also `resnet_tiny`, a small ResNet-style net for CPU runs.
#pragma once

#include <vector>

#include "nn/container.h"
#include "nn/layers.h"
#include "nn/norm.h"

namespace tally::nn {

// What both ResNet blocks share: relu, the optional downsample, and forward's end.
class ResidualBlock : public Module {
 public:
  bool is_checkpoint_block() const override { return true; }
  std::shared_ptr<ReLU> relu;
  std::shared_ptr<Sequential> downsample;

 protected:
  using Module::Module;
  // relu(out + identity), identity being x or downsample(x).
  Tensor add_identity_relu(Tensor out, const Tensor& x);
};

class BasicBlock : public ResidualBlock {
 public:
  static constexpr int64_t expansion = 1;
  BasicBlock(int64_t inplanes, int64_t planes, int64_t stride = 1,
             std::shared_ptr<Sequential> downsample = nullptr);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Conv2d> conv1, conv2;
  std::shared_ptr<BatchNorm2d> bn1, bn2;
};

class Bottleneck : public ResidualBlock {
 public:
  static constexpr int64_t expansion = 4;
  Bottleneck(int64_t inplanes, int64_t planes, int64_t stride = 1,
             std::shared_ptr<Sequential> downsample = nullptr);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Conv2d> conv1, conv2, conv3;
  std::shared_ptr<BatchNorm2d> bn1, bn2, bn3;
};

enum class BlockKind { basic, bottleneck };

struct ResNetOptions {
  int64_t num_classes = 1000;
  int64_t in_channels = 3;
  bool zero_init_residual = false;
  Generator* gen = nullptr;  // null: the default generator
};

// checkpoint_segments: layer1..layer4 as the stages when <= 4, else the blocks.
class ResNet : public StagedModule {
 public:
  ResNet(BlockKind block, const std::vector<int64_t>& layers, ResNetOptions opts = {});
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<Conv2d> conv1;
  std::shared_ptr<BatchNorm2d> bn1;
  std::shared_ptr<ReLU> relu;
  std::shared_ptr<MaxPool2d> maxpool;
  std::shared_ptr<Sequential> layer1, layer2, layer3, layer4;
  std::shared_ptr<AdaptiveAvgPool2d> avgpool;
  std::shared_ptr<Linear> fc;

 private:
  std::shared_ptr<Sequential> make_layer(BlockKind block, int64_t planes, int64_t blocks,
                                         int64_t stride);
  int64_t inplanes_ = 64;
};

std::shared_ptr<ResNet> resnet18(ResNetOptions opts = {});
std::shared_ptr<ResNet> resnet34(ResNetOptions opts = {});
std::shared_ptr<ResNet> resnet50(ResNetOptions opts = {});
std::shared_ptr<ResNet> resnet101(ResNetOptions opts = {});

// A small ResNet-style net for CPU CI (28x28 inputs such as Fashion-MNIST): a 3x3
// conv-bn-relu stem of 16 channels, layer1 = BasicBlock(16), layer2 = BasicBlock(16->32,
// stride 2), layer3 = BasicBlock(32->64, stride 2), avgpool, fc. ~78K parameters.
// checkpoint_segments as ResNet's (layer1..layer3 when <= 3, else the blocks).
class ResNetTiny : public StagedModule {
 public:
  explicit ResNetTiny(ResNetOptions opts = {});
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Conv2d> conv1;
  std::shared_ptr<BatchNorm2d> bn1;
  std::shared_ptr<ReLU> relu;
  std::shared_ptr<Sequential> layer1, layer2, layer3;
  std::shared_ptr<AdaptiveAvgPool2d> avgpool;
  std::shared_ptr<Linear> fc;
};

std::shared_ptr<ResNetTiny> resnet_tiny(ResNetOptions opts = {});

// The architecture named `arch`: "tiny", "resnet18", "resnet34", "resnet50" or "resnet101";
// std::invalid_argument naming them for anything else.
std::shared_ptr<Module> resnet_by_name(const std::string& arch, ResNetOptions opts = {});

}  // namespace tally::nn
