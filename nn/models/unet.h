// A diffusion U-Net in the shape of DDPM's (Ho et al. 2020; the PyTorch port
// pesser/pytorch_diffusion): a sinusoidal timestep embedding and its MLP, residual blocks
// (GroupNorm, SiLU, 3x3 convolutions, the time embedding added after the first), self-attention
// blocks at the chosen resolutions and in the middle, 3x3 stride-2 convolutions down, nearest
// upsampling and a 3x3 convolution up, and every down-path output concatenated into the up path.
// Parameter names match bench/models/unet.py (time_embed.linear_1, down.0.blocks.0.conv1,
// down.0.downsample.conv, mid.attn_1.qkv, up.0.blocks.2.shortcut, norm_out, conv_out, ...).
// Layers keep PyTorch's default initialisation.
//
// The training loss (unet_entry, registry.h) is DDPM's epsilon-prediction MSE; the schedule's
// tables are ddpm_schedule().
#pragma once

#include <string>
#include <vector>

#include "nn/activation.h"
#include "nn/container.h"
#include "nn/layers.h"
#include "nn/norm.h"
#include "nn/pooling.h"

namespace tally::nn {

struct ModelEntry;

struct UNetConfig {
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  int64_t resolution = 32;  // the input's height and width
  int64_t ch = 32;          // the base channel count (the time embedding has 4 * ch)
  std::vector<int64_t> ch_mult = {1, 2};
  int64_t num_res_blocks = 1;
  std::vector<int64_t> attn_resolutions = {16};  // attention at these resolutions (and mid)
  int64_t num_groups = 8;                        // GroupNorm's groups
  double dropout = 0.0;                          // in every ResBlock, before its conv2

  // "tiny" (32 channels, mults (1, 2), 1 block per level, attention at 16x16, 8 groups) or
  // "ddpm-cifar" (DDPM's CIFAR-10 model: 128 channels, mults (1, 2, 2, 2), 2 blocks, attention
  // at 16x16, 32 groups; dropout 0 where DDPM had 0.1, so that a step is deterministic).
  static UNetConfig preset(const std::string& name);
};

// DDPM's sinusoidal embedding of timesteps t [B] (any numeric dtype): [B, dim], sin of the
// first half, cos of the second, frequencies 10000^(-i / (dim/2 - 1)). Computed in float64
// and returned as `dtype`.
Tensor timestep_embedding(const Tensor& t, int64_t dim, DType dtype = DType::float32);

// temb = linear_2(silu(linear_1(timestep_embedding(t))))
class TimestepEmbedding : public Module {
 public:
  TimestepEmbedding(int64_t ch, int64_t temb_ch);
  Tensor forward(const Tensor& t) override;  // t [B] -> [B, temb_ch]
  int64_t ch;
  std::shared_ptr<Linear> linear_1, linear_2;
  std::shared_ptr<SiLU> act;
};

// h = conv1(silu(norm1(x))) + temb_proj(silu(temb)); out = shortcut(x) +
// conv2(dropout(silu(norm2(h)))), shortcut a 1x1 convolution when the channel count changes (else
// x).
class ResBlock : public Module {
 public:
  ResBlock(int64_t in_channels, int64_t out_channels, int64_t temb_channels, int64_t num_groups,
           double dropout);
  Tensor forward(const Tensor& x, const Tensor& temb);
  // Under nn::checkpoint when set_checkpoint is on (enable_checkpointing's "blocks").
  Tensor operator()(const Tensor& x, const Tensor& temb,
                    const std::source_location& site = std::source_location::current());
  bool is_checkpoint_block() const override { return true; }
  int64_t in_channels, out_channels;
  std::shared_ptr<GroupNorm> norm1, norm2;
  std::shared_ptr<Conv2d> conv1, conv2, shortcut;
  std::shared_ptr<Linear> temb_proj;
  std::shared_ptr<SiLU> act;
  std::shared_ptr<Dropout> dropout;
};

// Single-head self-attention over the H * W positions: x + proj_out(attention(qkv(norm(x)))),
// qkv a 1x1 convolution to 3C channels (q, k, v in that order), scale 1/sqrt(C).
class AttnBlock : public Module {
 public:
  AttnBlock(int64_t channels, int64_t num_groups);
  Tensor forward(const Tensor& x) override;
  bool is_checkpoint_block() const override { return true; }
  int64_t channels;
  std::shared_ptr<GroupNorm> norm;
  std::shared_ptr<Conv2d> qkv, proj_out;
};

// conv: 3x3, stride 2, padding 1 (halves H and W).
class UNetDownsample : public Module {
 public:
  explicit UNetDownsample(int64_t channels);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Conv2d> conv;
};

// up: nearest x2 (nn::Upsample), then conv: 3x3, padding 1.
class UNetUpsample : public Module {
 public:
  explicit UNetUpsample(int64_t channels);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Upsample> up;
  std::shared_ptr<Conv2d> conv;
};

// One resolution of the down or the up path: blocks (ResBlock), attns (one AttnBlock per block
// at an attention resolution, else empty), and the resampling (null at the last level).
class UNetLevel : public Module {
 public:
  UNetLevel() : Module("UNetLevel") {}
  std::shared_ptr<ModuleList> blocks, attns;
  std::shared_ptr<UNetDownsample> downsample;
  std::shared_ptr<UNetUpsample> upsample;
};

class UNetMid : public Module {
 public:
  UNetMid(int64_t channels, int64_t temb_channels, int64_t num_groups, double dropout);
  std::shared_ptr<ResBlock> block_1, block_2;
  std::shared_ptr<AttnBlock> attn_1;
};

class UNet : public Module {
 public:
  explicit UNet(UNetConfig cfg);
  // x [B, in_channels, resolution, resolution], t [B] (integer or floating timesteps) ->
  // the predicted noise [B, out_channels, resolution, resolution].
  Tensor forward(const Tensor& x, const Tensor& t);
  Tensor operator()(const Tensor& x, const Tensor& t,
                    const std::source_location& site = std::source_location::current()) {
    return call([&] { return forward(x, t); }, site);
  }

  UNetConfig config;
  std::shared_ptr<TimestepEmbedding> time_embed;
  std::shared_ptr<Conv2d> conv_in, conv_out;
  std::shared_ptr<ModuleList> down, up;  // up in forward order: the lowest resolution first
  std::shared_ptr<UNetMid> mid;
  std::shared_ptr<GroupNorm> norm_out;
  std::shared_ptr<SiLU> act;
};

// DDPM's linear schedule: betas linspace(beta_start, beta_end, steps), alphas_cumprod their
// running product of (1 - beta); returns {sqrt(alphas_cumprod), sqrt(1 - alphas_cumprod)}, each
// `steps` float64 values.
std::pair<std::vector<double>, std::vector<double>> ddpm_schedule(int64_t steps = 1000,
                                                                  double beta_start = 1e-4,
                                                                  double beta_end = 0.02);

// DDPM's training loss for x0 [B, C, H, W], noise eps of x0's shape and timesteps t [B] (int64
// in [0, 1000)): x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, mse_loss(model(x_t, t), eps).
Tensor ddpm_loss(UNet& model, const Tensor& x0, const Tensor& eps, const Tensor& t);

// The registry's "unet" (presets tiny | ddpm-cifar). Its batch carries the loss's three inputs:
// input [B, 2C, H, W] float32 is x0 (channels 0..C-1: SyntheticImages) and eps (channels
// C..2C-1: N(0, 1)) side by side, target [B] int64 the timesteps; the loss unpacks them.
ModelEntry unet_entry();

}  // namespace tally::nn
