// A LLaMA-style decoder with HuggingFace LlamaForCausalLM's structure and parameter names
// (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ..., model.norm.weight,
// lm_head.weight), so its state dict loads into transformers' model: pre-RMSNorm blocks of
// causal grouped-query self-attention with rotary position embeddings (HF's rotate_half
// convention) and a SwiGLU MLP (down_proj(silu(gate_proj(x)) * up_proj(x))), no biases, a final
// RMSNorm and an lm_head, untied unless tie_word_embeddings. Initialisation as HF's
// _init_weights: N(0, initializer_range) for every Linear and the embedding, ones for the norms.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "nn/container.h"
#include "nn/layers.h"
#include "nn/models/causal_lm.h"
#include "nn/norm.h"
#include "tensor/softmax/autograd.h"

namespace tally::nn {

// HF LlamaConfig's names.
struct LlamaConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;        // divides num_attention_heads (grouped-query attention)
  int64_t max_position_embeddings = 4096;  // the rotary tables' length, the longest sequence
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;  // lm_head.weight IS model.embed_tokens.weight
  // With targets, the loss from linear_cross_entropy over the final norm's output and lm_head's
  // weight, chunk by chunk (GPTConfig::fused_classifier): forward returns undefined logits.
  bool fused_classifier = false;
  int64_t fused_classifier_chunk_bytes = kLinearCrossEntropyChunkBytes;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // "tiny" (byte-level vocab 256, 2 layers, 64 dims, 4 heads, 2 kv heads, context 64), "small"
  // (vocab 256, 4 layers, 128 dims, context 128), "1b" and "3b" (Llama-3.2-1B's and -3B's
  // layers with vocab 32000, context 2048), "7b" and "13b" (Llama-2-7B's and -13B's shapes).
  static LlamaConfig preset(const std::string& name);
  // Bad shapes (heads not dividing the width, kv heads not dividing the heads, an odd head
  // dimension, non-positive sizes): std::invalid_argument naming the fields.
  void validate() const;
};

// HF's LlamaRotaryEmbedding, precomputed: cos and sin of position * inv_freq, each frequency
// twice ([max_position_embeddings, head_dim], float32), as non-persistent buffers (they move with
// the model and stay out of the state dict).
class LlamaRotaryEmbedding : public Module {
 public:
  explicit LlamaRotaryEmbedding(const LlamaConfig& cfg);
  Tensor cos_cached, sin_cached;
};

// HF's rotate_half: cat(-x[..., d/2:], x[..., :d/2]) over the last dimension.
Tensor rotate_half(const Tensor& x);
// HF's apply_rotary_pos_emb for one tensor, in one pass (tally::rotary_embedding; docs/notes.md
// §31): x * cos + rotate_half(x) * sin, with cos and sin
// [T, head_dim] broadcast against x [..., T, head_dim] (pass cos.unsqueeze(1) for [B, T, H, D]).
Tensor apply_rotary_pos_emb(const Tensor& x, const Tensor& cos, const Tensor& sin);
// HF's repeat_kv on [B, T, n_kv, D] (heads in dim 2): each kv head repeated n_rep times in
// place, [B, T, n_kv * n_rep, D], head h reading kv head h / n_rep.
Tensor repeat_kv(const Tensor& x, int64_t n_rep);

class LlamaAttention : public Module {
 public:
  LlamaAttention(const LlamaConfig& cfg, const LlamaRotaryEmbedding* rope);
  Tensor forward(const Tensor& x) override;  // x [B, T, hidden]
  int64_t num_heads, num_key_value_heads, head_dim, hidden_size;
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  const LlamaRotaryEmbedding* rotary;  // the model's tables (owned by LlamaModel)
};

class LlamaMLP : public Module {
 public:
  explicit LlamaMLP(const LlamaConfig& cfg);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;
};

class LlamaDecoderLayer : public Module {
 public:
  LlamaDecoderLayer(const LlamaConfig& cfg, const LlamaRotaryEmbedding* rope);
  Tensor forward(const Tensor& x) override;
  bool is_checkpoint_block() const override { return true; }
  // The layer with its last residual add left to the next norm (GPT's Block::forward_deferred):
  // x_in + delta (the previous layer's MLP output; undefined: none) is this layer's input,
  // summed inside input_layernorm; returns {h, mlp output}, whose sum is the layer's output.
  std::pair<Tensor, Tensor> forward_deferred(const Tensor& x_in, const Tensor& delta);
  // Whether forward_deferred may stand in for operator(): neither the layer nor its norms are
  // checkpointed or offloaded on their own.
  bool can_defer() const;
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<LlamaMLP> mlp;
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;
};

// HF's LlamaModel: idx [B, T] -> final hidden states [B, T, hidden]; with checkpoint_segments
// > 0 the layers run under checkpoint_sequential.
class LlamaModel : public StagedModule {
 public:
  explicit LlamaModel(const LlamaConfig& cfg);
  Tensor forward(const Tensor& idx) override;
  LlamaConfig config;
  std::shared_ptr<Embedding> embed_tokens;
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<RMSNorm> norm;
  std::shared_ptr<LlamaRotaryEmbedding> rotary_emb;
};

class LlamaForCausalLM : public CausalLM {
 public:
  // `gen`: the generator for the initialisation (null: the default generator).
  explicit LlamaForCausalLM(const LlamaConfig& cfg, Generator* gen = nullptr);
  // CausalLM::forward.
  std::pair<Tensor, Tensor> forward(const Tensor& idx, const Tensor& targets = Tensor()) override;
  void init_weights(Generator* gen = nullptr);

  LlamaConfig config;
  std::shared_ptr<LlamaModel> model;
};

// The registry's "llama" entry (nn/models/registry.h).
ModelEntry llama_entry();

}  // namespace tally::nn
