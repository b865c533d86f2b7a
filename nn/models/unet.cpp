// DDPM's U-Net (nn/models/unet.h), its loss and its registry entry.
#include "nn/models/unet.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "nn/functional.h"
#include "nn/models/preset.h"
#include "nn/models/registry.h"

namespace tally::nn {

UNetConfig UNetConfig::preset(const std::string& name) {
  return preset_of<UNetConfig>("UNetConfig", name, "expected tiny, ddpm-cifar",
                               {{"tiny", [](UNetConfig&) {}}, {"ddpm-cifar", [](UNetConfig& c) {
                                                                 c.ch = 128;
                                                                 c.ch_mult = {1, 2, 2, 2};
                                                                 c.num_res_blocks = 2;
                                                                 c.attn_resolutions = {16};
                                                                 c.num_groups = 32;
                                                               }}});
}

Tensor timestep_embedding(const Tensor& t, int64_t dim, DType dtype) {
  if (t.dim() != 1)
    throw std::invalid_argument(
        fmt::format("timestep_embedding: timesteps must be 1-D [B], got {}", t.shape_string()));
  if (dim < 4 || dim % 2 != 0)
    throw std::invalid_argument(
        fmt::format("timestep_embedding: dim must be even and >= 4, got {}", dim));
  const int64_t half = dim / 2;
  std::vector<double> freqs(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    freqs[static_cast<size_t>(i)] =
        std::exp(-std::log(10000.0) * static_cast<double>(i) / static_cast<double>(half - 1));
  const Tensor f = from_vector(freqs, {1, half},
                               TensorOptions{}.with_dtype(DType::float64).with_device(t.device()));
  const Tensor args = t.to(DType::float64).unsqueeze(1) * f;  // [B, half]
  return cat({sin(args), cos(args)}, 1).to(dtype);
}

TimestepEmbedding::TimestepEmbedding(int64_t ch_, int64_t temb_ch)
    : Module("TimestepEmbedding"), ch(ch_) {
  linear_1 = register_module("linear_1", std::make_shared<Linear>(ch, temb_ch));
  act = register_module("act", std::make_shared<SiLU>());
  linear_2 = register_module("linear_2", std::make_shared<Linear>(temb_ch, temb_ch));
}

Tensor TimestepEmbedding::forward(const Tensor& t) {
  const Tensor emb = timestep_embedding(t, ch, linear_1->weight.dtype());
  return (*linear_2)((*act)((*linear_1)(emb)));
}

namespace {
std::shared_ptr<Conv2d> conv3x3(int64_t in, int64_t out, int64_t stride = 1) {
  return std::make_shared<Conv2d>(in, out, 3, Conv2dOptions{.stride = stride, .padding = 1});
}
std::shared_ptr<Conv2d> conv1x1(int64_t in, int64_t out) {
  return std::make_shared<Conv2d>(in, out, 1);
}
}  // namespace

ResBlock::ResBlock(int64_t in, int64_t out, int64_t temb_channels, int64_t num_groups, double p)
    : Module("ResBlock"), in_channels(in), out_channels(out) {
  norm1 = register_module("norm1", std::make_shared<GroupNorm>(num_groups, in));
  act = register_module("act", std::make_shared<SiLU>());
  conv1 = register_module("conv1", conv3x3(in, out));
  temb_proj = register_module("temb_proj", std::make_shared<Linear>(temb_channels, out));
  norm2 = register_module("norm2", std::make_shared<GroupNorm>(num_groups, out));
  dropout = register_module("dropout", std::make_shared<Dropout>(p));
  conv2 = register_module("conv2", conv3x3(out, out));
  if (in != out) shortcut = register_module("shortcut", conv1x1(in, out));
}

Tensor ResBlock::forward(const Tensor& x, const Tensor& temb) {
  Tensor h = (*conv1)((*act)((*norm1)(x)));
  h = h + (*temb_proj)((*act)(temb)).unsqueeze(2).unsqueeze(3);
  h = (*conv2)((*dropout)((*act)((*norm2)(h))));
  return (shortcut ? (*shortcut)(x) : x) + h;
}

Tensor ResBlock::operator()(const Tensor& x, const Tensor& temb, const std::source_location& site) {
  return call(
      [&] {
        return checkpointed_call([this](const TensorList& in) { return forward(in[0], in[1]); },
                                 {x, temb});
      },
      site);
}

AttnBlock::AttnBlock(int64_t c, int64_t num_groups) : Module("AttnBlock"), channels(c) {
  norm = register_module("norm", std::make_shared<GroupNorm>(num_groups, c));
  qkv = register_module("qkv", conv1x1(c, 3 * c));
  proj_out = register_module("proj_out", conv1x1(c, c));
}

Tensor AttnBlock::forward(const Tensor& x) {
  if (x.dim() != 4 || x.size(1) != channels)
    throw std::invalid_argument(
        fmt::format("AttnBlock: expected [B, {}, H, W], got {}", channels, x.shape_string()));
  const int64_t B = x.size(0), C = channels, H = x.size(2), W = x.size(3);
  // [B, 3C, H, W] -> [B, 3, C, HW] -> [3, B, HW, C]: q, k, v as [B, HW, C] views.
  const Tensor qkv_t = (*qkv)((*norm)(x)).reshape({B, 3, C, H * W}).permute({1, 0, 3, 2});
  Tensor h = scaled_dot_product_attention(qkv_t.select(0, 0), qkv_t.select(0, 1),
                                          qkv_t.select(0, 2));  // [B, HW, C]
  h = h.transpose(1, 2).reshape({B, C, H, W});
  return x + (*proj_out)(h);
}

UNetDownsample::UNetDownsample(int64_t channels) : Module("UNetDownsample") {
  conv = register_module("conv", conv3x3(channels, channels, 2));
}

Tensor UNetDownsample::forward(const Tensor& x) {
  return (*conv)(x);
}

UNetUpsample::UNetUpsample(int64_t channels) : Module("UNetUpsample") {
  up = register_module("up",
                       std::make_shared<Upsample>(std::nullopt, std::array<double, 2>{2.0, 2.0}));
  conv = register_module("conv", conv3x3(channels, channels));
}

Tensor UNetUpsample::forward(const Tensor& x) {
  return (*conv)((*up)(x));
}

UNetMid::UNetMid(int64_t c, int64_t temb_channels, int64_t num_groups, double dropout)
    : Module("UNetMid") {
  block_1 = register_module("block_1",
                            std::make_shared<ResBlock>(c, c, temb_channels, num_groups, dropout));
  attn_1 = register_module("attn_1", std::make_shared<AttnBlock>(c, num_groups));
  block_2 = register_module("block_2",
                            std::make_shared<ResBlock>(c, c, temb_channels, num_groups, dropout));
}

UNet::UNet(UNetConfig cfg) : Module("UNet"), config(std::move(cfg)) {
  const UNetConfig& c = config;
  const auto levels = static_cast<int64_t>(c.ch_mult.size());
  if (levels < 1 || c.num_res_blocks < 1 || c.ch < 4)
    throw std::invalid_argument(fmt::format(
        "UNet: needs at least one level (ch_mult), one res block and ch >= 4 (got {} levels, {} "
        "blocks, ch {})",
        levels, c.num_res_blocks, c.ch));
  if (c.resolution % (int64_t{1} << (levels - 1)) != 0)
    throw std::invalid_argument(
        fmt::format("UNet: resolution {} is not divisible by 2^{} ({} levels)", c.resolution,
                    levels - 1, levels));
  for (int64_t m : c.ch_mult)
    if (m < 1 || (c.ch * m) % c.num_groups != 0)
      throw std::invalid_argument(
          fmt::format("UNet: channel count {} (ch {} x mult {}) is not a multiple of num_groups {}",
                      c.ch * m, c.ch, m, c.num_groups));
  const auto attn_at = [&](int64_t res) {
    for (int64_t r : c.attn_resolutions)
      if (r == res) return true;
    return false;
  };
  const int64_t temb_ch = 4 * c.ch;
  const auto mult_in = [&](int64_t level) {
    return level == 0 ? int64_t{1} : c.ch_mult[static_cast<size_t>(level - 1)];
  };

  time_embed = register_module("time_embed", std::make_shared<TimestepEmbedding>(c.ch, temb_ch));
  conv_in = register_module("conv_in", conv3x3(c.in_channels, c.ch));

  down = register_module("down", std::make_shared<ModuleList>());
  int64_t res = c.resolution;
  int64_t block_in = c.ch;
  for (int64_t l = 0; l < levels; ++l) {
    auto level = std::make_shared<UNetLevel>();
    level->blocks = level->register_module("blocks", std::make_shared<ModuleList>());
    level->attns = level->register_module("attns", std::make_shared<ModuleList>());
    const int64_t block_out = c.ch * c.ch_mult[static_cast<size_t>(l)];
    for (int64_t b = 0; b < c.num_res_blocks; ++b) {
      level->blocks->push_back(
          std::make_shared<ResBlock>(block_in, block_out, temb_ch, c.num_groups, c.dropout));
      block_in = block_out;
      if (attn_at(res))
        level->attns->push_back(std::make_shared<AttnBlock>(block_in, c.num_groups));
    }
    if (l != levels - 1) {
      level->downsample =
          level->register_module("downsample", std::make_shared<UNetDownsample>(block_in));
      res /= 2;
    }
    down->push_back(level);
  }

  mid =
      register_module("mid", std::make_shared<UNetMid>(block_in, temb_ch, c.num_groups, c.dropout));

  up = register_module("up", std::make_shared<ModuleList>());
  for (int64_t l = levels - 1; l >= 0; --l) {
    auto level = std::make_shared<UNetLevel>();
    level->blocks = level->register_module("blocks", std::make_shared<ModuleList>());
    level->attns = level->register_module("attns", std::make_shared<ModuleList>());
    const int64_t block_out = c.ch * c.ch_mult[static_cast<size_t>(l)];
    for (int64_t b = 0; b <= c.num_res_blocks; ++b) {
      // The skip popped here: a block output of this level, or (last) what entered the level.
      const int64_t skip_in = b == c.num_res_blocks ? c.ch * mult_in(l) : block_out;
      level->blocks->push_back(std::make_shared<ResBlock>(block_in + skip_in, block_out, temb_ch,
                                                          c.num_groups, c.dropout));
      block_in = block_out;
      if (attn_at(res))
        level->attns->push_back(std::make_shared<AttnBlock>(block_in, c.num_groups));
    }
    if (l != 0) {
      level->upsample =
          level->register_module("upsample", std::make_shared<UNetUpsample>(block_in));
      res *= 2;
    }
    up->push_back(level);
  }

  norm_out = register_module("norm_out", std::make_shared<GroupNorm>(c.num_groups, block_in));
  act = register_module("act", std::make_shared<SiLU>());
  conv_out = register_module("conv_out", conv3x3(block_in, c.out_channels));
}

Tensor UNet::forward(const Tensor& x, const Tensor& t) {
  const UNetConfig& c = config;
  if (x.dim() != 4 || x.size(1) != c.in_channels || x.size(2) != c.resolution ||
      x.size(3) != c.resolution)
    throw std::invalid_argument(fmt::format("UNet: expected x [B, {}, {}, {}], got {}",
                                            c.in_channels, c.resolution, c.resolution,
                                            x.shape_string()));
  if (t.dim() != 1 || t.size(0) != x.size(0))
    throw std::invalid_argument(fmt::format("UNet: expected timesteps t [{}] for x {}, got {}",
                                            x.size(0), x.shape_string(), t.shape_string()));
  const Tensor temb = (*time_embed)(t);
  std::vector<Tensor> hs{(*conv_in)(x)};
  for (const auto& m : *down) {
    auto& level = static_cast<UNetLevel&>(*m);
    level.call([&] {
      for (size_t b = 0; b < level.blocks->size(); ++b) {
        Tensor h = level.blocks->call(
            [&] { return static_cast<ResBlock&>(*(*level.blocks)[b])(hs.back(), temb); });
        if (level.attns->size() > 0) h = level.attns->call([&] { return (*(*level.attns)[b])(h); });
        hs.push_back(std::move(h));
      }
      if (level.downsample) hs.push_back((*level.downsample)(hs.back()));
      return 0;
    });
  }
  Tensor h = mid->call([&] {
    Tensor y = (*mid->block_1)(hs.back(), temb);
    y = (*mid->attn_1)(y);
    return (*mid->block_2)(y, temb);
  });
  for (const auto& m : *up) {
    auto& level = static_cast<UNetLevel&>(*m);
    h = level.call([&] {
      Tensor y = h;
      for (size_t b = 0; b < level.blocks->size(); ++b) {
        const Tensor in = cat({y, hs.back()}, 1);
        hs.pop_back();
        y = level.blocks->call(
            [&] { return static_cast<ResBlock&>(*(*level.blocks)[b])(in, temb); });
        if (level.attns->size() > 0) y = level.attns->call([&] { return (*(*level.attns)[b])(y); });
      }
      if (level.upsample) y = (*level.upsample)(y);
      return y;
    });
  }
  return (*conv_out)((*act)((*norm_out)(h)));
}

std::pair<std::vector<double>, std::vector<double>> ddpm_schedule(int64_t steps, double beta_start,
                                                                  double beta_end) {
  if (steps < 2)
    throw std::invalid_argument(fmt::format("ddpm_schedule: steps must be >= 2, got {}", steps));
  // torch.linspace's float64 values: from the start below the halfway index, from the end above.
  const double step = (beta_end - beta_start) / static_cast<double>(steps - 1);
  const int64_t halfway = steps / 2;
  std::vector<double> a(static_cast<size_t>(steps)), b(static_cast<size_t>(steps));
  double abar = 1.0;
  for (int64_t i = 0; i < steps; ++i) {
    const double beta = i < halfway ? beta_start + step * static_cast<double>(i)
                                    : beta_end - step * static_cast<double>(steps - i - 1);
    abar *= 1.0 - beta;
    a[static_cast<size_t>(i)] = std::sqrt(abar);
    b[static_cast<size_t>(i)] = std::sqrt(1.0 - abar);
  }
  return {a, b};
}

Tensor ddpm_loss(UNet& model, const Tensor& x0, const Tensor& eps, const Tensor& t) {
  if (x0.dim() != 4 || eps.sizes() != x0.sizes() || t.dim() != 1 || t.size(0) != x0.size(0))
    throw std::invalid_argument(fmt::format(
        "ddpm_loss: expected x0 [B, C, H, W], eps of its shape and t [B], got {}, {}, {}",
        x0.shape_string(), eps.shape_string(), t.shape_string()));
  constexpr int64_t kSteps = 1000;
  const auto [sa, s1a] = ddpm_schedule(kSteps);
  const TensorOptions f64 = TensorOptions{}.with_dtype(DType::float64).with_device(x0.device());
  const Shape per_sample{x0.size(0), 1, 1, 1};
  const Tensor a = index_select(from_vector(sa, {kSteps}, f64), 0, t).to(x0.dtype());
  const Tensor b = index_select(from_vector(s1a, {kSteps}, f64), 0, t).to(x0.dtype());
  const Tensor x_t = x0 * a.view(per_sample) + eps * b.view(per_sample);
  return functional::mse_loss(model(x_t, t), eps);
}

ModelEntry unet_entry() {
  ModelEntry e;
  e.name = "unet";
  set_presets(e, "DDPM's diffusion U-Net, epsilon-prediction loss", {"tiny", "ddpm-cifar"});
  e.input = ModelEntry::Input::images;
  e.build = [](const ModelOptions& o) -> std::shared_ptr<Module> {
    UNetConfig cfg = UNetConfig::preset(o.preset);
    cfg.in_channels = cfg.out_channels = o.in_channels;
    cfg.resolution = o.image_size;
    return std::make_shared<UNet>(cfg);
  };
  e.synthetic_batch = [](const ModelOptions& o, int64_t batch, int64_t step, uint64_t seed) {
    // x0 and t: SyntheticImages' images and labels (1000 classes: a timestep each); eps: N(0, 1)
    // from a generator keyed by (seed, step).
    data::Example ex = synthetic_image_batch(1000, o, batch, step, seed);
    Generator gen(seed ^ (0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(step + 1)));
    const Tensor eps = ops::randn(ex.input.sizes(), DType::float32, Device::cpu(), &gen);
    ex.input = ops::cat({ex.input, eps}, 1);
    return ex;
  };
  e.loss = [](Module& m, const data::Example& b) {
    const int64_t C = b.input.size(1) / 2;
    return ddpm_loss(dynamic_cast<UNet&>(m), b.input.narrow(1, 0, C), b.input.narrow(1, C, C),
                     b.target);
  };
  return e;
}

}  // namespace tally::nn
