// Conv1d and ConvTranspose2d (torch.nn), with PyTorch's constructor arguments, parameter
// shapes and default initialisation: weight kaiming_uniform(a=sqrt(5)), bias
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in from the weight (Conv2d is in nn/layers.h).
#pragma once

#include "nn/module.h"

namespace tally::nn {

// weight [out, in / groups, kernel_size]; input [N, in, L] or [in, L]. Runs conv2d's kernels
// at unit height.
class Conv1d : public Module {
 public:
  Conv1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride = 1,
         int64_t padding = 0, int64_t dilation = 1, int64_t groups = 1, bool bias = true,
         Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  void reset_parameters(Generator* gen = nullptr);
  std::string extra_repr() const override;

  int64_t in_channels, out_channels, kernel_size, stride, padding, dilation, groups;
  Tensor weight, bias;
};

// weight [in, out / groups, kH, kW]: conv2d's input gradient (tally::conv_transpose2d).
class ConvTranspose2d : public Module {
 public:
  ConvTranspose2d(int64_t in_channels, int64_t out_channels, Int2 kernel_size, Int2 stride = 1,
                  Int2 padding = 0, Int2 output_padding = 0, int64_t groups = 1, bool bias = true,
                  Int2 dilation = 1, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  void reset_parameters(Generator* gen = nullptr);
  std::string extra_repr() const override;

  int64_t in_channels, out_channels;
  Int2 kernel_size, stride, padding, output_padding;
  int64_t groups;
  Int2 dilation;
  Tensor weight, bias;
};

}  // namespace tally::nn
