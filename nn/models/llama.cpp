// The LLaMA-style decoder (HF LlamaForCausalLM's structure and names) over nn layers and
// scaled_dot_product_attention.
#include "nn/models/llama.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <vector>

#include "autograd/autocast.h"
#include "nn/checkpoint.h"
#include "nn/init.h"
#include "nn/models/preset.h"
#include "nn/models/registry.h"

namespace tally::nn {

LlamaConfig LlamaConfig::preset(const std::string& name) {
  return preset_of<LlamaConfig>(
      "LlamaConfig::preset", name, "tiny, small, 1b, 3b, 7b, 13b",
      {{"7b", [](LlamaConfig&) {}},  // the default config is Llama-2-7B
       {"13b",
        [](LlamaConfig& c) {
          c.hidden_size = 5120, c.intermediate_size = 13824, c.num_hidden_layers = 40;
          c.num_attention_heads = c.num_key_value_heads = 40;
        }},
       {"1b",
        [](LlamaConfig& c) {  // Llama-3.2-1B's layers, a 32000-token vocabulary, untied
          c.hidden_size = 2048, c.intermediate_size = 8192, c.num_hidden_layers = 16;
          c.num_attention_heads = 32, c.num_key_value_heads = 8, c.max_position_embeddings = 2048;
        }},
       {"3b",
        [](LlamaConfig& c) {  // Llama-3.2-3B's layers, a 32000-token vocabulary, untied
          c.hidden_size = 3072, c.intermediate_size = 8192, c.num_hidden_layers = 28;
          c.num_attention_heads = 24, c.num_key_value_heads = 8, c.max_position_embeddings = 2048;
        }},
       {"tiny",
        [](LlamaConfig& c) {
          c.vocab_size = 256, c.hidden_size = 64, c.intermediate_size = 176,
          c.num_hidden_layers = 2;
          c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 64;
        }},
       {"small", [](LlamaConfig& c) {
          c.vocab_size = 256, c.hidden_size = 128, c.intermediate_size = 352,
          c.num_hidden_layers = 4;
          c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 128;
        }}});
}

void LlamaConfig::validate() const {
  for (const auto& [v, what] : {std::pair{vocab_size, "vocab_size"},
                                {hidden_size, "hidden_size"},
                                {intermediate_size, "intermediate_size"},
                                {num_hidden_layers, "num_hidden_layers"},
                                {num_attention_heads, "num_attention_heads"},
                                {num_key_value_heads, "num_key_value_heads"},
                                {max_position_embeddings, "max_position_embeddings"}})
    if (v < 1) throw std::invalid_argument(fmt::format("LlamaConfig: {} is {}", what, v));
  if (hidden_size % num_attention_heads != 0)
    throw std::invalid_argument(
        fmt::format("LlamaConfig: hidden_size {} is not divisible by num_attention_heads {}",
                    hidden_size, num_attention_heads));
  if (num_attention_heads % num_key_value_heads != 0)
    throw std::invalid_argument(fmt::format(
        "LlamaConfig: num_attention_heads {} is not divisible by num_key_value_heads {}",
        num_attention_heads, num_key_value_heads));
  if (head_dim() % 2 != 0)
    throw std::invalid_argument(
        fmt::format("LlamaConfig: the head dimension {} (hidden_size / num_attention_heads) is "
                    "odd; rotary embeddings rotate pairs",
                    head_dim()));
  if (!(rope_theta > 0) || !(rms_norm_eps > 0))
    throw std::invalid_argument(
        fmt::format("LlamaConfig: rope_theta {} and rms_norm_eps {} must be positive", rope_theta,
                    rms_norm_eps));
}

LlamaRotaryEmbedding::LlamaRotaryEmbedding(const LlamaConfig& cfg)
    : Module("LlamaRotaryEmbedding") {
  cfg.validate();
  // angle(t, i) = t * theta^(-2i / D) in float64, rounded to float32 once (the PyTorch side,
  // bench/models/llama.py, computes the same); columns i and i + D/2 share a frequency.
  const int64_t T = cfg.max_position_embeddings, D = cfg.head_dim(), half = D / 2;
  const Device dev = build_device();
  {
    // The same allocations on every device (a dry run's meta device replays them): the
    // tables are made empty, then filled from host memory Tally does not own.
    memory::CategoryScope cat(memory::Category::parameter);
    cos_cached = register_buffer("cos_cached", ops::empty({T, D}, DType::float32, dev), false);
    sin_cached = register_buffer("sin_cached", ops::empty({T, D}, DType::float32, dev), false);
  }
  if (dev.is_meta()) return;  // shapes only
  std::vector<float> c(static_cast<size_t>(T * D)), s(c.size());
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq =
        1.0 / std::pow(cfg.rope_theta, static_cast<double>(2 * i) / static_cast<double>(D));
    for (int64_t t = 0; t < T; ++t) {
      const double a = static_cast<double>(t) * inv_freq;
      for (const int64_t col : {i, i + half}) {
        c[static_cast<size_t>(t * D + col)] = static_cast<float>(std::cos(a));
        s[static_cast<size_t>(t * D + col)] = static_cast<float>(std::sin(a));
      }
    }
  }
  NoGradGuard no_grad;
  ops::copy_(cos_cached, ops::from_blob(c.data(), {T, D}, DType::float32, Device::cpu()));
  ops::copy_(sin_cached, ops::from_blob(s.data(), {T, D}, DType::float32, Device::cpu()));
}

Tensor rotate_half(const Tensor& x) {
  const int64_t d = x.size(-1), h = d / 2;
  return cat({neg(x.narrow(-1, h, d - h)), x.narrow(-1, 0, h)}, -1);
}

Tensor apply_rotary_pos_emb(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return rotary_embedding(x, cos, sin);  // one pass forward and backward
}

Tensor repeat_kv(const Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t B = x.size(0), T = x.size(1), kv = x.size(2), D = x.size(3);
  return x.unsqueeze(3).expand({B, T, kv, n_rep, D}).reshape({B, T, kv * n_rep, D});
}

LlamaAttention::LlamaAttention(const LlamaConfig& cfg, const LlamaRotaryEmbedding* rope)
    : Module("LlamaAttention"),
      num_heads(cfg.num_attention_heads),
      num_key_value_heads(cfg.num_key_value_heads),
      head_dim(cfg.head_dim()),
      hidden_size(cfg.hidden_size),
      rotary(rope) {
  cfg.validate();
  const int64_t C = cfg.hidden_size, D = head_dim;
  q_proj = register_module("q_proj", std::make_shared<Linear>(C, num_heads * D, false));
  k_proj = register_module("k_proj", std::make_shared<Linear>(C, num_key_value_heads * D, false));
  v_proj = register_module("v_proj", std::make_shared<Linear>(C, num_key_value_heads * D, false));
  o_proj = register_module("o_proj", std::make_shared<Linear>(num_heads * D, C, false));
}

Tensor LlamaAttention::forward(const Tensor& x) {
  if (x.dim() != 3 || x.size(2) != hidden_size)
    throw std::invalid_argument(
        fmt::format("LlamaAttention: expected [B, T, {}], got {}", hidden_size, x.shape_string()));
  const int64_t B = x.size(0), T = x.size(1), D = head_dim;
  const int64_t max_t = rotary->cos_cached.size(0);
  if (T > max_t)
    throw std::invalid_argument(fmt::format(
        "LlamaAttention: sequence length {} exceeds max_position_embeddings {}", T, max_t));
  // Heads stay in dim 2 ([B, T, H, D]) through the rotation; one transpose to [B, H, T, D]
  // views them for the attention, as GPT's heads are. The kv heads serve their query heads
  // through SDPA's enable_gqa (PyTorch's; the repeat is SDPA's, as HF's sdpa path does).
  const Tensor q = (*q_proj)(x).view({B, T, num_heads, D});
  const Tensor k = (*k_proj)(x).view({B, T, num_key_value_heads, D});
  const Tensor v = (*v_proj)(x).view({B, T, num_key_value_heads, D});
  // The tables in the projections' dtype (HF casts them to the query's), [T, 1, D].
  const Tensor cos = rotary->cos_cached.narrow(0, 0, T).to(q.dtype()).unsqueeze(1);
  const Tensor sin = rotary->sin_cached.narrow(0, 0, T).to(q.dtype()).unsqueeze(1);
  const Tensor qh = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2);
  const Tensor kh = apply_rotary_pos_emb(k, cos, sin).transpose(1, 2);
  const Tensor vh = v.transpose(1, 2);
  Tensor y = scaled_dot_product_attention(qh, kh, vh, Tensor(), 0.0, true, std::nullopt,
                                          /*enable_gqa=*/num_heads != num_key_value_heads);
  y = y.transpose(1, 2).contiguous().view({B, T, num_heads * D});
  return (*o_proj)(y);
}

LlamaMLP::LlamaMLP(const LlamaConfig& cfg) : Module("LlamaMLP") {
  const int64_t C = cfg.hidden_size, F = cfg.intermediate_size;
  gate_proj = register_module("gate_proj", std::make_shared<Linear>(C, F, false));
  up_proj = register_module("up_proj", std::make_shared<Linear>(C, F, false));
  down_proj = register_module("down_proj", std::make_shared<Linear>(F, C, false));
}

Tensor LlamaMLP::forward(const Tensor& x) {
  // silu(gate) * up in one pass: silu(gate) is neither written nor kept for the backward.
  return (*down_proj)(silu_mul((*gate_proj)(x), (*up_proj)(x)));
}

LlamaDecoderLayer::LlamaDecoderLayer(const LlamaConfig& cfg, const LlamaRotaryEmbedding* rope)
    : Module("LlamaDecoderLayer") {
  self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(cfg, rope));
  mlp = register_module("mlp", std::make_shared<LlamaMLP>(cfg));
  input_layernorm = register_module("input_layernorm",
                                    std::make_shared<RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps));
  post_attention_layernorm = register_module(
      "post_attention_layernorm", std::make_shared<RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps));
  // Each feeds only Linears (q/k/v_proj, gate/up_proj), which autocast would give the 16-bit
  // copy: the norms write it themselves. The Linears' 16-bit gradients then meet in the
  // autocast dtype rather than in float32 after three casts.
  input_layernorm->autocast_output = true;
  post_attention_layernorm->autocast_output = true;
}

Tensor LlamaDecoderLayer::forward(const Tensor& x) {
  const Tensor a = (*self_attn)((*input_layernorm)(x));
  const RMSNorm& ln = *post_attention_layernorm;
  if (!ln.is_checkpointed() && !ln.offloader()) {
    // h = x + a and its norm in one node (the residual add fused into the norm).
    auto [h, n] = post_attention_layernorm->forward_with_residual(x, a);
    return add(h, (*mlp)(n));
  }
  const Tensor h = add(x, a);
  return add(h, (*mlp)((*post_attention_layernorm)(h)));
}

bool LlamaDecoderLayer::can_defer() const {
  const auto alone = [](const Module& m) { return m.is_checkpointed() || m.offloader(); };
  return !alone(*this) && !alone(*input_layernorm) && !alone(*post_attention_layernorm);
}

std::pair<Tensor, Tensor> LlamaDecoderLayer::forward_deferred(const Tensor& x_in,
                                                              const Tensor& delta) {
  return call([&] {
    Tensor x = x_in, n1;
    if (delta.defined())
      std::tie(x, n1) = input_layernorm->forward_with_residual(x_in, delta);
    else
      n1 = (*input_layernorm)(x_in);
    auto [h, n2] = post_attention_layernorm->forward_with_residual(x, (*self_attn)(n1));
    return std::pair<Tensor, Tensor>{h, (*mlp)(n2)};
  });
}

LlamaModel::LlamaModel(const LlamaConfig& cfg) : StagedModule("LlamaModel"), config(cfg) {
  cfg.validate();
  embed_tokens =
      register_module("embed_tokens", std::make_shared<Embedding>(cfg.vocab_size, cfg.hidden_size));
  // Built before the layers (they keep a pointer to it), registered after them: HF's order.
  auto rope = std::make_shared<LlamaRotaryEmbedding>(cfg);
  layers = register_module("layers", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i)
    layers->push_back(std::make_shared<LlamaDecoderLayer>(cfg, rope.get()));
  norm = register_module("norm", std::make_shared<RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps));
  norm->autocast_output = true;  // it feeds only lm_head
  rotary_emb = register_module("rotary_emb", rope);
}

Tensor LlamaModel::forward(const Tensor& idx) {
  if (idx.dim() != 2)
    throw std::invalid_argument(
        fmt::format("LlamaModel: expected idx [B, T], got {}", idx.shape_string()));
  if (idx.size(1) > config.max_position_embeddings)
    throw std::invalid_argument(
        fmt::format("LlamaModel: sequence length {} exceeds max_position_embeddings {}",
                    idx.size(1), config.max_position_embeddings));
  Tensor x = (*embed_tokens)(idx);
  if (checkpoint_segments > 0) {
    x = checkpoint_sequential(*layers, checkpoint_segments, x);
  } else {
    // Each layer's last residual add rides in the next norm (input_layernorm, then norm).
    Tensor out = forward_deferred_stack<LlamaDecoderLayer>(*layers, *norm, x);
    if (out.defined()) return out;
    for (const auto& layer : *layers) x = layers->call([&] { return (*layer)(x); });
  }
  return (*norm)(x);
}

LlamaForCausalLM::LlamaForCausalLM(const LlamaConfig& cfg, Generator* gen)
    : CausalLM("LlamaForCausalLM"), config(cfg) {
  const bool skip_init = SkipInitGuard::active();  // the caller wants uninitialised weights
  {
    SkipInitGuard skip;  // init_weights() below initialises every weight once
    model = register_module("model", std::make_shared<LlamaModel>(cfg));
    lm_head = register_module("lm_head",
                              std::make_shared<Linear>(cfg.hidden_size, cfg.vocab_size, false));
  }
  if (cfg.tie_word_embeddings) {
    // lm_head.weight IS the token embedding; its own fresh allocation is released here.
    lm_head->weight = model->embed_tokens->weight;
    lm_head->register_parameter("weight", lm_head->weight);
  }
  if (!skip_init) init_weights(gen);
}

void LlamaForCausalLM::init_weights(Generator* gen) {
  const double sd = config.initializer_range;
  for (const auto& [name, m] : named_modules()) {
    if (auto* lin = dynamic_cast<Linear*>(m)) {
      if (lin == lm_head.get() && config.tie_word_embeddings) continue;  // initialised as wte
      init::normal_(lin->weight, 0.0, sd, gen);
    } else if (auto* emb = dynamic_cast<Embedding*>(m)) {
      init::normal_(emb->weight, 0.0, sd, gen);
    } else if (auto* rms = dynamic_cast<RMSNorm*>(m)) {
      rms->reset_parameters();
    }
  }
}

std::pair<Tensor, Tensor> LlamaForCausalLM::forward(const Tensor& idx, const Tensor& targets) {
  check_targets(idx, targets);
  cache_autocast_casts(*this);  // under autocast: every layer's weight cast in one launch
  return classify((*model)(idx), targets, config.fused_classifier,
                  config.fused_classifier_chunk_bytes);
}

ModelEntry llama_entry() {
  return causal_lm_entry<LlamaForCausalLM, LlamaConfig>(
      "llama", "a LLaMA-style decoder, HF LlamaForCausalLM's names",
      {"tiny", "small", "1b", "3b", "7b", "13b"}, &LlamaConfig::max_position_embeddings);
}

}  // namespace tally::nn
