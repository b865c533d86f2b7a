// ViT (torchvision.models.VisionTransformer): a patchifying convolution, a class token, learned
// position embeddings, pre-LayerNorm encoder blocks of nn::MultiheadAttention and a GELU MLP,
// a final LayerNorm and a linear head on the class token. torchvision's structure, parameter
// names (conv_proj, class_token, encoder.pos_embedding, encoder.layers.encoder_layer_N.{ln_1,
// self_attention, ln_2, mlp.0, mlp.3}, encoder.ln, heads.head) and initialisation, so its
// state dicts load both ways.
#pragma once

#include <memory>
#include <string>

#include "nn/container.h"
#include "nn/layers.h"
#include "nn/models/registry.h"
#include "nn/norm.h"
#include "nn/transformer.h"

namespace tally::nn {

struct ViTConfig {
  int64_t image_size = 224;
  int64_t patch_size = 16;
  int64_t num_layers = 12;
  int64_t num_heads = 12;
  int64_t hidden_dim = 768;
  int64_t mlp_dim = 3072;
  double dropout = 0.0;
  double attention_dropout = 0.0;
  int64_t num_classes = 1000;
  int64_t in_channels = 3;  // torchvision's conv_proj takes 3

  // "tiny" (image 32, patch 8, 2 layers, 2 heads, hidden 64, mlp 128, 10 classes), "vit_b_16",
  // "vit_b_32", "vit_l_16" (torchvision's shapes, 1000 classes).
  static ViTConfig preset(const std::string& name);
};

// torchvision's MLPBlock: 0 Linear(hidden, mlp), 1 GELU, 2 Dropout, 3 Linear(mlp, hidden),
// 4 Dropout; Linear weights xavier_uniform_, biases N(0, 1e-6).
class ViTMLPBlock : public Sequential {
 public:
  ViTMLPBlock(int64_t in_dim, int64_t mlp_dim, double dropout);
};

// x + dropout(self_attention(ln_1(x))), then + mlp(ln_2(.)); LayerNorm eps 1e-6.
class ViTEncoderBlock : public Module {
 public:
  ViTEncoderBlock(int64_t num_heads, int64_t hidden_dim, int64_t mlp_dim, double dropout,
                  double attention_dropout);
  Tensor forward(const Tensor& x) override;  // [N, T, hidden]
  bool is_checkpoint_block() const override { return true; }
  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<MultiheadAttention> self_attention;
  std::shared_ptr<Dropout> dropout;
  std::shared_ptr<ViTMLPBlock> mlp;
};

// pos_embedding [1, seq_length, hidden] N(0, 0.02); ln(layers(dropout(x + pos_embedding))).
class ViTEncoder : public Module {
 public:
  ViTEncoder(int64_t seq_length, int64_t num_layers, int64_t num_heads, int64_t hidden_dim,
             int64_t mlp_dim, double dropout, double attention_dropout);
  Tensor forward(const Tensor& x) override;
  Tensor pos_embedding;
  std::shared_ptr<Dropout> dropout;
  std::shared_ptr<Sequential> layers;  // encoder_layer_0, encoder_layer_1, ...
  std::shared_ptr<LayerNorm> ln;
};

class VisionTransformer : public Module {
 public:
  explicit VisionTransformer(const ViTConfig& cfg);
  Tensor forward(const Tensor& x) override;  // [N, C, image, image] -> logits [N, classes]
  ViTConfig config;
  std::shared_ptr<Conv2d> conv_proj;
  Tensor class_token;  // [1, 1, hidden], zeros
  std::shared_ptr<ViTEncoder> encoder;
  std::shared_ptr<Sequential> heads;  // head: Linear(hidden, classes), zero-initialised
};

// The registry's "vit" (nn/models/registry.h): presets tiny | vit_b_16 | vit_b_32 | vit_l_16;
// the image size defaults to the preset's; cross-entropy on the logits.
ModelEntry vit_entry();

}  // namespace tally::nn
