// GPT-2 (nanoGPT's structure and names) over nn layers and scaled_dot_product_attention.
#include "nn/models/gpt.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>

#include "autograd/autocast.h"
#include "nn/checkpoint.h"
#include "nn/init.h"
#include "nn/models/preset.h"

namespace tally::nn {

GPTConfig GPTConfig::preset(const std::string& name) {
  return preset_of<GPTConfig>(
      "GPTConfig::preset", name, "gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny, small",
      {{"gpt2", [](GPTConfig&) {}},
       {"gpt2-medium", [](GPTConfig& c) { c.n_layer = 24, c.n_head = 16, c.n_embd = 1024; }},
       {"gpt2-large",
        [](GPTConfig& c) { c.n_layer = 36, c.n_head = 20, c.n_embd = 1280; }},             // 774M
       {"gpt2-xl", [](GPTConfig& c) { c.n_layer = 48, c.n_head = 25, c.n_embd = 1600; }},  // 1.56B
       {"tiny",
        [](GPTConfig& c) {
          c.vocab_size = 256, c.block_size = 64, c.n_layer = 2, c.n_head = 2, c.n_embd = 64;
        }},
       {"small", [](GPTConfig& c) {
          c.vocab_size = 256, c.block_size = 128, c.n_layer = 4, c.n_head = 4, c.n_embd = 128;
        }}});
}

CausalSelfAttention::CausalSelfAttention(const GPTConfig& cfg)
    : Module("CausalSelfAttention"), n_head(cfg.n_head), n_embd(cfg.n_embd), dropout(cfg.dropout) {
  if (cfg.n_embd % cfg.n_head != 0)
    throw std::invalid_argument(fmt::format(
        "CausalSelfAttention: n_embd {} is not divisible by n_head {}", cfg.n_embd, cfg.n_head));
  c_attn =
      register_module("c_attn", std::make_shared<Linear>(cfg.n_embd, 3 * cfg.n_embd, cfg.bias));
  c_proj = register_module("c_proj", std::make_shared<Linear>(cfg.n_embd, cfg.n_embd, cfg.bias));
  resid_dropout = register_module("resid_dropout", std::make_shared<Dropout>(cfg.dropout));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  if (x.dim() != 3 || x.size(2) != n_embd)
    throw std::invalid_argument(
        fmt::format("CausalSelfAttention: expected [B, T, {}], got {}", n_embd, x.shape_string()));
  const int64_t B = x.size(0), T = x.size(1), C = n_embd, hs = C / n_head;
  TensorList qkv = split((*c_attn)(x), C, 2);
  auto heads = [&](const Tensor& t) { return t.reshape({B, T, n_head, hs}).transpose(1, 2); };
  const Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  Tensor y = scaled_dot_product_attention(q, k, v, Tensor(), is_training() ? dropout : 0.0, true);
  y = y.transpose(1, 2).contiguous().view({B, T, C});
  return (*resid_dropout)((*c_proj)(y));
}

MLP::MLP(const GPTConfig& cfg) : Module("MLP"), fused(cfg.fused_mlp) {
  c_fc = register_module("c_fc", std::make_shared<Linear>(cfg.n_embd, 4 * cfg.n_embd, cfg.bias));
  gelu = register_module("gelu", std::make_shared<GELU>("tanh"));
  c_proj =
      register_module("c_proj", std::make_shared<Linear>(4 * cfg.n_embd, cfg.n_embd, cfg.bias));
  dropout = register_module("dropout", std::make_shared<Dropout>(cfg.dropout));
}

Tensor MLP::forward(const Tensor& x) {
  const auto alone = [](const Module& m) { return m.is_checkpointed() || m.offloader(); };
  // A LoRA adapter on either Linear (nn/lora.h) runs in its own forward.
  const bool lora = c_fc->lora_A || c_proj->lora_A;
  if (fused && !lora && gelu->approximate == "tanh" && !alone(*c_fc) && !alone(*gelu) &&
      !alone(*c_proj))
    return (*dropout)(
        linear_gelu_linear(x, c_fc->weight, c_fc->bias, c_proj->weight, c_proj->bias));
  return (*dropout)((*c_proj)((*gelu)((*c_fc)(x))));
}

Block::Block(const GPTConfig& cfg) : Module("Block"), fused_add_norm(cfg.fused_add_norm) {
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(cfg.n_embd, 1e-5, true, cfg.bias));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(cfg));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(cfg.n_embd, 1e-5, true, cfg.bias));
  mlp = register_module("mlp", std::make_shared<MLP>(cfg));
  // Each feeds only a Linear (c_attn, c_fc), which autocast would give the 16-bit copy.
  ln_1->autocast_output = true;
  ln_2->autocast_output = true;
}

Tensor Block::forward(const Tensor& x) {
  const Tensor a = (*attn)((*ln_1)(x));
  if (fused_add_norm && !ln_2->is_checkpointed() && !ln_2->offloader()) {
    // y = x + a and ln_2(y) in one node (the residual add fused into the norm).
    auto [y, h] = ln_2->forward_with_residual(x, a);
    return add(y, (*mlp)(h));
  }
  const Tensor y = add(x, a);
  return add(y, (*mlp)((*ln_2)(y)));
}

bool Block::can_defer() const {
  const auto alone = [](const Module& m) { return m.is_checkpointed() || m.offloader(); };
  return fused_add_norm && !alone(*this) && !alone(*ln_1) && !alone(*ln_2);
}

std::pair<Tensor, Tensor> Block::forward_deferred(const Tensor& x_in, const Tensor& delta) {
  return call([&] {
    Tensor x = x_in, h1;
    if (delta.defined())
      std::tie(x, h1) = ln_1->forward_with_residual(x_in, delta);
    else
      h1 = (*ln_1)(x_in);
    auto [y, h2] = ln_2->forward_with_residual(x, (*attn)(h1));
    return std::pair<Tensor, Tensor>{y, (*mlp)(h2)};
  });
}

GPTTransformer::GPTTransformer(const GPTConfig& cfg) : StagedModule("ModuleDict"), config(cfg) {
  wte = register_module("wte", std::make_shared<Embedding>(cfg.vocab_size, cfg.n_embd));
  wpe = register_module("wpe", std::make_shared<Embedding>(cfg.block_size, cfg.n_embd));
  drop = register_module("drop", std::make_shared<Dropout>(cfg.dropout));
  h = register_module("h", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < cfg.n_layer; ++i) h->push_back(std::make_shared<Block>(cfg));
  ln_f = register_module("ln_f", std::make_shared<LayerNorm>(cfg.n_embd, 1e-5, true, cfg.bias));
}

Tensor GPTTransformer::forward(const Tensor& idx) {
  if (idx.dim() != 2)
    throw std::invalid_argument(
        fmt::format("GPT: expected idx [B, T], got {}", idx.shape_string()));
  const int64_t T = idx.size(1);
  if (T > config.block_size)
    throw std::invalid_argument(fmt::format(
        "GPT: cannot forward sequence of length {}, block size is only {}", T, config.block_size));
  Tensor pos;
  {
    memory::CategoryScope cat(memory::Category::input);
    pos = ops::arange(0, static_cast<double>(T), 1, DType::int64, idx.device());
  }
  Tensor x = (*drop)(add((*wte)(idx), (*wpe)(pos)));
  if (checkpoint_segments > 0) {
    x = checkpoint_sequential(*h, checkpoint_segments, x);
  } else {
    // Each block's last residual add rides in the next normalization (ln_1, then ln_f).
    Tensor out = forward_deferred_stack<Block>(*h, *ln_f, x);
    if (out.defined()) return out;
    // Under h's scope, so the blocks' allocations carry "transformer.h.0...", their names
    // in named_modules(), as in the checkpointed path above.
    for (const auto& block : *h) x = h->call([&] { return (*block)(x); });
  }
  return (*ln_f)(x);
}

GPT::GPT(const GPTConfig& cfg, Generator* gen) : CausalLM("GPT"), config(cfg) {
  const bool skip_init = SkipInitGuard::active();  // the caller wants uninitialised weights
  {
    SkipInitGuard skip;  // init_weights() below initialises every weight once
    transformer = register_module("transformer", std::make_shared<GPTTransformer>(cfg));
    lm_head =
        register_module("lm_head", std::make_shared<Linear>(cfg.n_embd, cfg.vocab_size, false));
  }
  // Weight tying: lm_head.weight is the token embedding (the same Tensor); its own fresh
  // allocation is released here.
  lm_head->weight = transformer->wte->weight;
  lm_head->register_parameter("weight", lm_head->weight);
  if (!skip_init) init_weights(gen);
}

void GPT::init_weights(Generator* gen) {
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config.n_layer));
  for (const auto& [name, m] : named_modules()) {
    if (auto* lin = dynamic_cast<Linear*>(m)) {
      if (lin == lm_head.get()) continue;  // tied to wte, initialised there
      const bool is_c_proj = name.size() >= 6 && name.compare(name.size() - 6, 6, "c_proj") == 0;
      init::normal_(lin->weight, 0.0, is_c_proj ? proj_std : 0.02, gen);
      if (lin->bias.defined()) init::zeros_(lin->bias);
    } else if (auto* emb = dynamic_cast<Embedding*>(m)) {
      init::normal_(emb->weight, 0.0, 0.02, gen);
    }
  }
}

int64_t GPT::get_num_params(bool non_embedding) const {
  int64_t n = num_parameters();
  if (non_embedding) n -= transformer->wpe->weight.numel();
  return n;
}

std::pair<Tensor, Tensor> GPT::forward(const Tensor& idx, const Tensor& targets) {
  check_targets(idx, targets);
  cache_autocast_casts(*this);  // under autocast: every layer's weight cast in one launch
  Tensor x = (*transformer)(idx);
  // The classifier's product dtype: autocast's where it applies (linear's rule), else the
  // weight's. Only a 16-bit product is padded (GPTConfig::classifier_pad_multiple), and not
  // the fused classifier's.
  const int64_t V = config.vocab_size, m = config.classifier_pad_multiple;
  const DType product =
      autocast::is_active(x.device()) ? autocast_dtype(x.device().type) : lm_head->weight.dtype();
  const bool low = product == DType::float16 || product == DType::bfloat16;
  if ((config.fused_classifier && targets.defined()) || m <= 1 || V % m == 0 || !low)
    return classify(x, targets, config.fused_classifier, config.fused_classifier_chunk_bytes);
  // The padded classifier (GPTConfig::classifier_pad_multiple), under lm_head's scope as its
  // call would be.
  const int64_t Vp = base::checked_add<int64_t>(V, m - V % m, "GPT classifier padding");
  Tensor full = lm_head->call([&] {
    // linear's autocast rule first, so that the padded copy is made in the product's dtype.
    const auto [xc, w] = autocast::lower("linear", x, lm_head->weight);
    Tensor pad, bias;
    {
      NoGradGuard no_grad;
      pad = ops::zeros({Vp - V, w.size(1)}, w.dtype(), w.device());
      bias = ops::cat({ops::zeros({V}, w.dtype(), w.device()),
                       ops::full({Vp - V}, -INFINITY, w.dtype(), w.device())},
                      0);
    }
    return linear(xc, cat({w, pad}, 0), bias);  // [B, T, Vp]; the padding's logits are -inf
  });
  Tensor loss;
  if (targets.defined()) loss = cross_entropy(full.reshape({-1, Vp}), targets.reshape({-1}), -1);
  return {full.narrow(-1, 0, V), loss};
}

}  // namespace tally::nn
