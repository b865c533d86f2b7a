// torchvision's VisionTransformer (torchvision/models/vision_transformer.py) over nn layers.
#include "nn/models/vit.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "nn/init.h"
#include "nn/models/preset.h"
#include "tensor/softmax/autograd.h"

namespace tally::nn {

ViTConfig ViTConfig::preset(const std::string& name) {
  return preset_of<ViTConfig>(
      "ViTConfig::preset", name, "tiny, vit_b_16, vit_b_32, vit_l_16",
      {{"vit_b_16", [](ViTConfig&) {}},
       {"vit_b_32", [](ViTConfig& c) { c.patch_size = 32; }},
       {"vit_l_16",
        [](ViTConfig& c) {
          c.num_layers = 24, c.num_heads = 16, c.hidden_dim = 1024, c.mlp_dim = 4096;
        }},
       {"tiny", [](ViTConfig& c) {
          c.image_size = 32, c.patch_size = 8, c.num_layers = 2, c.num_heads = 2, c.hidden_dim = 64;
          c.mlp_dim = 128, c.num_classes = 10;
        }}});
}

ViTMLPBlock::ViTMLPBlock(int64_t in_dim, int64_t mlp_dim, double dropout) {
  auto fc1 = push_back(std::make_shared<Linear>(in_dim, mlp_dim));
  push_back(std::make_shared<GELU>());
  push_back(std::make_shared<Dropout>(dropout));
  auto fc2 = push_back(std::make_shared<Linear>(mlp_dim, in_dim));
  push_back(std::make_shared<Dropout>(dropout));
  if (!SkipInitGuard::active())
    for (const auto& l : {fc1, fc2}) {
      init::xavier_uniform_(l->weight);
      init::normal_(l->bias, 0.0, 1e-6);
    }
}

ViTEncoderBlock::ViTEncoderBlock(int64_t num_heads, int64_t hidden_dim, int64_t mlp_dim,
                                 double dropout_p, double attention_dropout)
    : Module("EncoderBlock") {
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(hidden_dim, 1e-6));
  self_attention = register_module(
      "self_attention",
      std::make_shared<MultiheadAttention>(hidden_dim, num_heads, attention_dropout, true, false,
                                           false, std::nullopt, std::nullopt, true));
  dropout = register_module("dropout", std::make_shared<Dropout>(dropout_p));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(hidden_dim, 1e-6));
  mlp = register_module("mlp", std::make_shared<ViTMLPBlock>(hidden_dim, mlp_dim, dropout_p));
}

Tensor ViTEncoderBlock::forward(const Tensor& input) {
  if (input.dim() != 3)
    throw std::invalid_argument(
        fmt::format("EncoderBlock: expected (batch_size, seq_length, hidden_dim), got {}",
                    input.shape_string()));
  Tensor x = (*ln_1)(input);
  x = (*self_attention)(x, x, x, {}, false).first;
  x = add((*dropout)(x), input);
  return add(x, (*mlp)((*ln_2)(x)));
}

ViTEncoder::ViTEncoder(int64_t seq_length, int64_t num_layers, int64_t num_heads,
                       int64_t hidden_dim, int64_t mlp_dim, double dropout_p,
                       double attention_dropout)
    : Module("Encoder") {
  pos_embedding = register_parameter("pos_embedding", make_parameter({1, seq_length, hidden_dim}));
  if (!SkipInitGuard::active()) init::normal_(pos_embedding, 0.0, 0.02);
  dropout = register_module("dropout", std::make_shared<Dropout>(dropout_p));
  layers = register_module("layers", std::make_shared<Sequential>());
  for (int64_t i = 0; i < num_layers; ++i)
    layers->register_module(fmt::format("encoder_layer_{}", i),
                            std::make_shared<ViTEncoderBlock>(num_heads, hidden_dim, mlp_dim,
                                                              dropout_p, attention_dropout));
  ln = register_module("ln", std::make_shared<LayerNorm>(hidden_dim, 1e-6));
}

Tensor ViTEncoder::forward(const Tensor& x) {
  if (x.dim() != 3 || x.size(1) != pos_embedding.size(1) || x.size(2) != pos_embedding.size(2))
    throw std::invalid_argument(fmt::format("Encoder: expected (batch_size, {}, {}), got {}",
                                            pos_embedding.size(1), pos_embedding.size(2),
                                            x.shape_string()));
  return (*ln)((*layers)((*dropout)(add(x, pos_embedding))));
}

VisionTransformer::VisionTransformer(const ViTConfig& cfg)
    : Module("VisionTransformer"), config(cfg) {
  if (cfg.patch_size <= 0 || cfg.image_size <= 0 || cfg.image_size % cfg.patch_size != 0)
    throw std::invalid_argument(
        fmt::format("VisionTransformer: input shape indivisible by patch size (image_size {}, "
                    "patch_size {})",
                    cfg.image_size, cfg.patch_size));
  const int64_t hidden = cfg.hidden_dim;
  conv_proj = register_module(
      "conv_proj", std::make_shared<Conv2d>(cfg.in_channels, hidden, Int2(cfg.patch_size),
                                            Int2(cfg.patch_size), Int2(0)));
  class_token = register_parameter("class_token", make_parameter({1, 1, hidden}));
  const int64_t n = cfg.image_size / cfg.patch_size;
  encoder = register_module(
      "encoder", std::make_shared<ViTEncoder>(n * n + 1, cfg.num_layers, cfg.num_heads, hidden,
                                              cfg.mlp_dim, cfg.dropout, cfg.attention_dropout));
  heads = register_module("heads", std::make_shared<Sequential>());
  auto head = heads->register_module("head", std::make_shared<Linear>(hidden, cfg.num_classes));
  init::zeros_(class_token);
  if (!SkipInitGuard::active()) {
    const int64_t fan_in = cfg.in_channels * cfg.patch_size * cfg.patch_size;
    init::trunc_normal_(conv_proj->weight, 0.0, std::sqrt(1.0 / static_cast<double>(fan_in)));
    init::zeros_(conv_proj->bias);
    init::zeros_(head->weight);
    init::zeros_(head->bias);
  }
}

Tensor VisionTransformer::forward(const Tensor& x) {
  const int64_t s = config.image_size, p = config.patch_size, hidden = config.hidden_dim;
  if (x.dim() != 4 || x.size(1) != config.in_channels || x.size(2) != s || x.size(3) != s)
    throw std::invalid_argument(
        fmt::format("VisionTransformer: expected [N, {}, {}, {}] images, got {}",
                    config.in_channels, s, s, x.shape_string()));
  const int64_t n = x.size(0), patches = (s / p) * (s / p);
  // [N, hidden, n_h, n_w] -> [N, n_h * n_w, hidden]
  Tensor t = (*conv_proj)(x).reshape({n, hidden, patches}).permute({0, 2, 1});
  t = cat({class_token.expand({n, 1, hidden}), t}, 1);
  t = (*encoder)(t);
  return (*heads)(t.select(1, 0));
}

ModelEntry vit_entry() {
  ModelEntry e;
  e.name = "vit";
  set_presets(e, "torchvision's VisionTransformer", {"tiny", "vit_b_16", "vit_b_32", "vit_l_16"});
  e.input = ModelEntry::Input::images;
  e.context = [](const std::string& p) { return ViTConfig::preset(p).image_size; };
  e.build = [](const ModelOptions& o) -> std::shared_ptr<Module> {
    ViTConfig cfg = ViTConfig::preset(o.preset);
    cfg.num_classes = o.num_classes;
    cfg.in_channels = o.in_channels;
    cfg.image_size = o.image_size;
    return std::make_shared<VisionTransformer>(cfg);
  };
  e.synthetic_batch = [](const ModelOptions& o, int64_t batch, int64_t step, uint64_t seed) {
    return synthetic_image_batch(o.num_classes, o, batch, step, seed);
  };
  e.loss = [](Module& m, const data::Example& b) { return cross_entropy(m(b.input), b.target); };
  return e;
}

}  // namespace tally::nn
