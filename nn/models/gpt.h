// GPT (nanoGPT's GPT-2): token and position embeddings, n_layer pre-LayerNorm blocks of
// causal self-attention and a GELU(tanh) MLP, a final LayerNorm and an lm_head whose weight
// IS the token embedding's (one Tensor, listed once by named_parameters). Parameter names
// follow nanoGPT / HuggingFace GPT-2 (transformer.h.0.attn.c_attn.weight, ...), weights in
// nn.Linear layout [out, in]. GPT-2 initialisation: N(0, 0.02) for Linear and Embedding
// weights, zero biases, c_proj weights N(0, 0.02 / sqrt(2 * n_layer)).
#pragma once

#include <string>
#include <utility>

#include "nn/container.h"
#include "nn/layers.h"
#include "nn/models/causal_lm.h"
#include "nn/norm.h"

namespace tally::nn {

struct GPTConfig {
  int64_t vocab_size = 50257;
  int64_t block_size = 1024;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;
  double dropout = 0.0;
  bool bias = true;  // biases in Linear layers and LayerNorms
  // With targets, compute the loss with linear_cross_entropy (tensor/softmax/autograd.h) over
  // ln_f's output and lm_head's (tied) weight, chunk by chunk, so the [B*T, vocab] logits
  // and their gradient never exist whole; forward then returns undefined logits. Without
  // targets the logits are computed as usual. Off: logits always, the loss from them.
  bool fused_classifier = false;
  // The fused classifier's budget for one chunk's logits, whose gradient overwrites them (its
  // max_chunk_bytes; the chunk's rows follow from it and the vocabulary).
  int64_t fused_classifier_chunk_bytes = kLinearCrossEntropyChunkBytes;
  // Each block's MLP (c_fc -> GELU(tanh) -> c_proj) as one autograd node,
  // linear_gelu_linear (tensor/linalg/autograd.h): the GELU's forward and backward inside the
  // two products (cuBLASLt epilogues on CUDA), and the gradient of the GELU's output never
  // made. Its allocations carry the MLP's module ("...mlp"), not c_fc's and c_proj's. The
  // separate modules run instead when off, or when c_fc, gelu or c_proj is checkpointed or
  // offloaded on its own.
  bool fused_mlp = true;
  // Every residual add fused into the layer norm that reads its sum (tally::add_layer_norm,
  // LayerNorm::forward_with_residual): a block's first add into its ln_2, and, without
  // checkpoint segments, a block's last add into the next block's ln_1 (the last block's into
  // ln_f; Block::forward_deferred). The sum is normalized as it is written and its two
  // gradients meet inside layer_norm's backward, so neither the add's kernel nor the
  // gradient accumulation runs. The sums' allocations carry the norm's module. The adds run
  // apart when off, or where a block or a norm is checkpointed or offloaded on its own.
  bool fused_add_norm = true;
  // A 16-bit unfused classifier (under fp16/bf16 autocast, or a 16-bit model) computes over
  // the vocabulary rounded up to a multiple of this (<= 1: never): lm_head's weight gets zero
  // rows and a bias of -inf there, so those logits are -inf and the loss, the softmax and every
  // gradient are the unpadded ones, while the products' dimensions are multiples of 64, which
  // cuBLAS's fast 16-bit kernels need (GPT-2's 50,257 otherwise takes 1.7x as long as 50,304).
  // The logits returned are a view of the first vocab_size columns; the parameters are
  // unchanged. float32 is not padded: its kernels gain 1% and the padded float32 copy of the
  // weight, saved for backward, would cost 150 MiB at GPT-2's peak.
  int64_t classifier_pad_multiple = 64;

  // "gpt2" (124M), "gpt2-medium" (350M), "gpt2-large" (774M: 36 layers, 20 heads, 1280),
  // "gpt2-xl" (1.56B: 48 layers, 25 heads, 1600), "tiny" (byte-level vocab 256, block 64, 2 layers,
  // 2 heads, 64 dims), "small" (byte-level, block 128, 4 layers, 4 heads, 128 dims).
  static GPTConfig preset(const std::string& name);
};

class CausalSelfAttention : public Module {
 public:
  explicit CausalSelfAttention(const GPTConfig& cfg);
  Tensor forward(const Tensor& x) override;  // x [B, T, C]
  int64_t n_head, n_embd;
  double dropout;
  std::shared_ptr<Linear> c_attn, c_proj;
  std::shared_ptr<Dropout> resid_dropout;
};

class MLP : public Module {
 public:
  explicit MLP(const GPTConfig& cfg);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Linear> c_fc, c_proj;
  std::shared_ptr<GELU> gelu;
  std::shared_ptr<Dropout> dropout;
  bool fused;  // GPTConfig::fused_mlp
};

class Block : public Module {
 public:
  explicit Block(const GPTConfig& cfg);
  Tensor forward(const Tensor& x) override;
  // The block with its last residual add left to the caller: returns {y, m}, the block's
  // output being y + m. A defined `delta` (the previous block's m) is added to x inside ln_1
  // (LayerNorm::forward_with_residual), so every residual add of the stack is fused into the
  // normalization after it. Under this block's module scope, as operator().
  std::pair<Tensor, Tensor> forward_deferred(const Tensor& x, const Tensor& delta);
  // Whether forward_deferred may stand in for operator(): fused_add_norm on, and neither the
  // block nor its layer norms checkpointed or offloaded on their own.
  bool can_defer() const;
  bool is_checkpoint_block() const override { return true; }
  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<MLP> mlp;
  bool fused_add_norm;  // GPTConfig::fused_add_norm
};

// nanoGPT's `transformer` ModuleDict: idx [B, T] -> final hidden states [B, T, C]; with
// checkpoint_segments > 0 the blocks run under checkpoint_sequential.
class GPTTransformer : public StagedModule {
 public:
  explicit GPTTransformer(const GPTConfig& cfg);
  Tensor forward(const Tensor& idx) override;
  GPTConfig config;
  std::shared_ptr<Embedding> wte, wpe;
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<ModuleList> h;
  std::shared_ptr<LayerNorm> ln_f;
};

class GPT : public CausalLM {
 public:
  // `gen`: the generator for the initialisation (null: the default generator).
  explicit GPT(const GPTConfig& cfg, Generator* gen = nullptr);
  // CausalLM::forward. Under autocast the Linear weights are cast at the top
  // (nn::cache_autocast_casts: one multi-tensor launch, not one per layer). With
  // config.fused_classifier the gradient reaches the tied weight as through lm_head.
  std::pair<Tensor, Tensor> forward(const Tensor& idx, const Tensor& targets = Tensor()) override;
  void init_weights(Generator* gen = nullptr);
  // Parameters, minus the position embeddings when non_embedding (nanoGPT's get_num_params).
  int64_t get_num_params(bool non_embedding = true) const;

  GPTConfig config;
  std::shared_ptr<GPTTransformer> transformer;
};

}  // namespace tally::nn
