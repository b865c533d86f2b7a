// MultiheadAttention and the transformer encoder, after torch/nn/modules/activation.py,
// torch/nn/functional.py (multi_head_attention_forward) and torch/nn/modules/transformer.py.
#include "nn/transformer.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "base/check_arg.h"
#include "base/checked.h"
#include "nn/init.h"

namespace tally::nn {

namespace {

[[noreturn]] void mha_error(const std::string& msg) {
  throw std::invalid_argument("MultiheadAttention: " + msg);
}

}  // namespace

Tensor canonical_mask(const Tensor& mask, DType dtype, const char* what) {
  if (!mask.defined()) return mask;
  if (mask.dtype() == DType::bool_)
    return ops::masked_fill(ops::zeros(mask.sizes(), dtype, mask.device()), mask,
                            -std::numeric_limits<double>::infinity());
  if (!is_floating(mask.dtype()))
    throw std::invalid_argument(
        fmt::format("{}: only bool and floating types of masks are "
                    "supported, got {}",
                    what, dtype_name(mask.dtype())));
  return mask.dtype() == dtype ? mask : mask.to(dtype);
}

Tensor generate_square_subsequent_mask(int64_t sz, DType dtype, Device device) {
  if (sz < 0 || !is_floating(dtype))
    throw std::invalid_argument(fmt::format(
        "generate_square_subsequent_mask: needs sz >= 0 and a floating dtype, got sz {} and {}", sz,
        dtype_name(dtype)));
  // The [sz, sz] result first: a size too large for memory fails here, before anything else.
  const Tensor zero = ops::zeros({sz, sz}, dtype, device);
  const Tensor rows =
      ops::reshape(ops::arange(0, static_cast<double>(sz), 1, DType::int64, device), {sz, 1});
  const Tensor cols =
      ops::reshape(ops::arange(0, static_cast<double>(sz), 1, DType::int64, device), {1, sz});
  return ops::masked_fill(zero, ops::binary(ops::BinaryOp::gt, cols, rows),
                          -std::numeric_limits<double>::infinity());
}

// ---- MultiheadAttention ----
MultiheadAttention::MultiheadAttention(int64_t e, int64_t h, double p, bool bias, bool add_bias_kv,
                                       bool add_zero_attn, std::optional<int64_t> kd,
                                       std::optional<int64_t> vd, bool bf, Generator* gen)
    : Module("MultiheadAttention"),
      embed_dim(e),
      kdim(kd.value_or(e)),
      vdim(vd.value_or(e)),
      num_heads(h),
      head_dim(h > 0 ? e / h : 0),
      dropout(p),
      batch_first(bf) {
  if (e <= 0 || h <= 0)
    mha_error(
        fmt::format("embed_dim and num_heads must be greater than 0, got embed_dim={} "
                    "and num_heads={}",
                    e, h));
  if (e % h != 0)
    mha_error(fmt::format("embed_dim ({}) must be divisible by num_heads ({})", e, h));
  if (kdim <= 0 || vdim <= 0)
    mha_error(fmt::format("kdim ({}) and vdim ({}) must be positive", kdim, vdim));
  if (!(p >= 0.0 && p <= 1.0))
    mha_error(fmt::format("dropout probability has to be between 0 and 1, but got {}", p));
  if (add_bias_kv)
    mha_error("add_bias_kv=True is not supported (bias_k and bias_v are not implemented)");
  if (add_zero_attn) mha_error("add_zero_attn=True is not supported");
  if (kdim == e && vdim == e) {
    in_proj_weight = register_parameter("in_proj_weight", make_parameter({3 * e, e}));
  } else {
    q_proj_weight = register_parameter("q_proj_weight", make_parameter({e, e}));
    k_proj_weight = register_parameter("k_proj_weight", make_parameter({e, kdim}));
    v_proj_weight = register_parameter("v_proj_weight", make_parameter({e, vdim}));
  }
  if (bias) in_proj_bias = register_parameter("in_proj_bias", make_parameter({3 * e}));
  out_proj = register_module("out_proj", std::make_shared<Linear>(e, e, bias, gen));
  if (!SkipInitGuard::active()) reset_parameters(gen);
}

void MultiheadAttention::reset_parameters(Generator* gen) {
  if (in_proj_weight.defined()) {
    init::xavier_uniform_(in_proj_weight, 1.0, gen);
  } else {
    init::xavier_uniform_(q_proj_weight, 1.0, gen);
    init::xavier_uniform_(k_proj_weight, 1.0, gen);
    init::xavier_uniform_(v_proj_weight, 1.0, gen);
  }
  if (in_proj_bias.defined()) {
    init::constant_(in_proj_bias, 0.0);
    init::constant_(out_proj->bias, 0.0);
  }
}

std::string MultiheadAttention::extra_repr() const {
  std::string s = fmt::format("embed_dim={}, num_heads={}", embed_dim, num_heads);
  if (kdim != embed_dim || vdim != embed_dim) s += fmt::format(", kdim={}, vdim={}", kdim, vdim);
  if (dropout != 0.0) s += fmt::format(", dropout={}", dropout);
  if (batch_first) s += ", batch_first=True";
  return s;
}

Tensor MultiheadAttention::forward(const Tensor& x) {
  return forward(x, x, x, {}, false).first;
}

std::pair<Tensor, Tensor> MultiheadAttention::forward(const Tensor& query, const Tensor& key,
                                                      const Tensor& value,
                                                      const Tensor& key_padding_mask,
                                                      bool need_weights, const Tensor& attn_mask,
                                                      bool average_attn_weights, bool is_causal) {
  const int64_t E = embed_dim, H = num_heads, hd = head_dim;
  const auto shapes = [&] {
    return fmt::format("query {}, key {}, value {}", query.shape_string(), key.shape_string(),
                       value.shape_string());
  };
  // ---- checks, before any work ----
  if (query.dim() != 2 && query.dim() != 3)
    mha_error(fmt::format("query should be 2-D (unbatched) or 3-D (batched), got {}", shapes()));
  const bool batched = query.dim() == 3;
  if (key.dim() != query.dim() || value.dim() != query.dim())
    mha_error(
        fmt::format("query, key and value must have the same number of dims, got {}", shapes()));
  if (query.size(-1) != E || key.size(-1) != kdim || value.size(-1) != vdim)
    mha_error(
        fmt::format("expected the last dims of query, key and value to be embed_dim ({}), "
                    "kdim ({}) and vdim ({}), got {}",
                    E, kdim, vdim, shapes()));
  // Batch-first inputs ([N, T, C], and unbatched ones as [1, T, C]) keep their layout, so the
  // heads are views of the projections ([N, H, T, hd], as GPT's); sequence-first ones are
  // [T, N, C].
  const bool bf = batch_first || !batched;
  const auto in = [&](const Tensor& t) { return batched ? t : t.unsqueeze(0); };
  const Tensor q_in = in(query), k_in = in(key), v_in = in(value);
  const int64_t N = q_in.size(bf ? 0 : 1), L = q_in.size(bf ? 1 : 0), S = k_in.size(bf ? 1 : 0);
  if (k_in.size(bf ? 0 : 1) != N || v_in.size(bf ? 0 : 1) != N || v_in.size(bf ? 1 : 0) != S)
    mha_error(
        fmt::format("query, key and value must agree in batch size and key and value in "
                    "length, got {}{}",
                    shapes(), batch_first ? " (batch_first)" : ""));
  if (key_padding_mask.defined()) {
    const Shape want = batched ? Shape{N, S} : Shape{S};
    if (key_padding_mask.sizes() != want)
      mha_error(fmt::format("key_padding_mask should have shape {}, got {} ({})", shape_str(want),
                            key_padding_mask.shape_string(), shapes()));
  }
  if (attn_mask.defined()) {
    const bool ok2 = attn_mask.dim() == 2 && attn_mask.size(0) == L && attn_mask.size(1) == S;
    const bool ok3 = attn_mask.dim() == 3 && attn_mask.size(0) == N * H && attn_mask.size(1) == L &&
                     attn_mask.size(2) == S;
    if (!ok2 && !ok3)
      mha_error(
          fmt::format("attn_mask should have shape [{}, {}] or [{}, {}, {}] (batch * "
                      "num_heads, L, S), got {} ({})",
                      L, S, N * H, L, S, attn_mask.shape_string(), shapes()));
  }
  if (is_causal && !attn_mask.defined())
    mha_error(
        "Need attn_mask if specifying the is_causal hint. You may use "
        "generate_square_subsequent_mask to create this mask.");
  const DType dt = query.dtype();
  const Tensor kpm = canonical_mask(key_padding_mask, dt, "MultiheadAttention: key_padding_mask");
  Tensor mask;  // floating, broadcast to [N, H, L, S]
  bool causal = false;
  if (is_causal && !key_padding_mask.defined() && !need_weights) {
    causal = true;  // the hint stands for the mask: the causal kernel instead
  } else {
    mask = canonical_mask(attn_mask, dt, "MultiheadAttention: attn_mask");
    if (mask.defined() && mask.dim() == 3) mask = mask.view({N, H, L, S});
    if (kpm.defined()) {
      const Tensor k4 = kpm.view({N, 1, 1, S});
      mask = mask.defined() ? add(mask, k4) : k4;
    }
  }

  // ---- projections ----
  Tensor q, k, v;  // as the inputs: [N, T, E] or [T, N, E]
  const auto part = [](const Tensor& t, int64_t i, int64_t n) {
    return t.defined() ? t.narrow(0, i * n, n) : Tensor();
  };
  if (in_proj_weight.defined() && query.is_same(key) && key.is_same(value)) {
    // self-attention: one product, split (q, k, v stay views of it)
    const TensorList qkv = split(linear(q_in, in_proj_weight, in_proj_bias), E, -1);
    q = qkv[0];
    k = qkv[1];
    v = qkv[2];
  } else if (in_proj_weight.defined()) {
    q = linear(q_in, part(in_proj_weight, 0, E), part(in_proj_bias, 0, E));
    if (key.is_same(value)) {
      const TensorList kv =
          split(linear(k_in, in_proj_weight.narrow(0, E, 2 * E),
                       in_proj_bias.defined() ? in_proj_bias.narrow(0, E, 2 * E) : Tensor()),
                E, -1);
      k = kv[0];
      v = kv[1];
    } else {
      k = linear(k_in, part(in_proj_weight, 1, E), part(in_proj_bias, 1, E));
      v = linear(v_in, part(in_proj_weight, 2, E), part(in_proj_bias, 2, E));
    }
  } else {
    q = linear(q_in, q_proj_weight, part(in_proj_bias, 0, E));
    k = linear(k_in, k_proj_weight, part(in_proj_bias, 1, E));
    v = linear(v_in, v_proj_weight, part(in_proj_bias, 2, E));
  }
  // [N, T, E] or [T, N, E] -> [N, H, T, hd]
  const auto heads = [&](const Tensor& t) {
    if (bf) return t.reshape({N, t.size(1), H, hd}).transpose(1, 2);
    return t.reshape({t.size(0), N, H, hd}).permute({1, 2, 0, 3});
  };
  const Tensor qh = heads(q), kh = heads(k), vh = heads(v);
  const double p = is_training() ? dropout : 0.0;

  Tensor out, weights;  // out [N, H, L, hd]
  if (need_weights) {
    Tensor w = matmul(mul(qh, 1.0 / std::sqrt(static_cast<double>(hd))), kh.transpose(-2, -1));
    if (mask.defined()) w = add(w, mask);
    w = softmax(w, -1);
    if (p > 0.0) w = tally::dropout(w, p, true);
    out = matmul(w, vh);
    weights = average_attn_weights ? mean(w, {1}) : w;  // [N, L, S] or [N, H, L, S]
    if (!batched) weights = weights.squeeze(0);
  } else {
    out = scaled_dot_product_attention(qh, kh, vh, mask, p, causal);
  }
  // [N, H, L, hd] -> [N, L, E] or [L, N, E] -> out_proj
  Tensor y = (*out_proj)(bf ? out.transpose(1, 2).reshape({N, L, E})
                            : out.permute({2, 0, 1, 3}).reshape({L, N, E}));
  return {batched ? y : y.squeeze(0), weights};
}

// ---- TransformerEncoderLayer ----
TransformerEncoderLayer::TransformerEncoderLayer(int64_t dm, int64_t nh, int64_t ff, double p,
                                                 std::string act, double eps, bool bf, bool nf,
                                                 bool b, Generator* gen)
    : Module("TransformerEncoderLayer"),
      d_model(dm),
      nhead(nh),
      dim_feedforward(ff),
      dropout_p(p),
      layer_norm_eps(eps),
      activation(std::move(act)),
      batch_first(bf),
      norm_first(nf),
      bias(b) {
  if (activation != "relu" && activation != "gelu")
    throw std::invalid_argument(
        fmt::format("TransformerEncoderLayer: activation should be relu/gelu, not {}", activation));
  self_attn = register_module(
      "self_attn", std::make_shared<MultiheadAttention>(dm, nh, p, b, false, false, std::nullopt,
                                                        std::nullopt, bf, gen));
  linear1 = register_module("linear1", std::make_shared<Linear>(dm, ff, b, gen));
  dropout = register_module("dropout", std::make_shared<Dropout>(p));
  linear2 = register_module("linear2", std::make_shared<Linear>(ff, dm, b, gen));
  norm1 = register_module("norm1", std::make_shared<LayerNorm>(dm, eps, true, b));
  norm2 = register_module("norm2", std::make_shared<LayerNorm>(dm, eps, true, b));
  dropout1 = register_module("dropout1", std::make_shared<Dropout>(p));
  dropout2 = register_module("dropout2", std::make_shared<Dropout>(p));
}

std::string TransformerEncoderLayer::extra_repr() const {
  return fmt::format("d_model={}, nhead={}, dim_feedforward={}, activation={}{}", d_model, nhead,
                     dim_feedforward, activation, norm_first ? ", norm_first=True" : "");
}

Tensor TransformerEncoderLayer::forward(const Tensor& src, const Tensor& src_mask,
                                        const Tensor& src_key_padding_mask, bool is_causal) {
  const auto sa_block = [&](const Tensor& x) {
    return (*dropout1)(
        (*self_attn)(x, x, x, src_key_padding_mask, false, src_mask, true, is_causal).first);
  };
  const auto ff_block = [&](const Tensor& x) {
    Tensor h = (*linear1)(x);
    h = activation == "gelu" ? gelu(h) : relu(h);
    return (*dropout2)((*linear2)((*dropout)(h)));
  };
  Tensor x = src;
  if (norm_first) {
    x = add(x, sa_block((*norm1)(x)));
    x = add(x, ff_block((*norm2)(x)));
  } else {
    x = (*norm1)(add(x, sa_block(x)));
    x = (*norm2)(add(x, ff_block(x)));
  }
  return x;
}

std::shared_ptr<TransformerEncoderLayer> TransformerEncoderLayer::clone() const {
  std::shared_ptr<TransformerEncoderLayer> copy;
  const Tensor& w = linear1->weight;
  {
    BuildOnDevice on(w.device());
    SkipInitGuard skip;
    copy = std::make_shared<TransformerEncoderLayer>(d_model, nhead, dim_feedforward, dropout_p,
                                                     activation, layer_norm_eps, batch_first,
                                                     norm_first, bias);
  }
  if (w.dtype() != DType::float32) copy->to(w.dtype());
  copy->load_state_dict(state_dict());
  copy->train(is_training());
  return copy;
}

bool detect_is_causal_mask(const Tensor& mask, std::optional<bool> is_causal, int64_t size) {
  if (is_causal.has_value()) return *is_causal;
  if (!mask.defined() || mask.dim() != 2 || mask.size(0) != size || mask.size(1) != size ||
      mask.device().type == DeviceType::meta)
    return false;
  const bool is_bool = mask.dtype() == DType::bool_;
  const auto causal_at = [&](int64_t i, int64_t j, double v) {
    if (j > i) return is_bool ? v != 0 : v == -std::numeric_limits<double>::infinity();
    return v == 0;
  };
  if (mask.device().type == DeviceType::cpu) {  // read in place: nothing allocated
    bool ok = true;
    TALLY_DISPATCH_ALL(mask.dtype(), "detect_is_causal_mask", [&] {
      const auto* p = static_cast<const scalar_t*>(mask.storage().data()) + mask.storage_offset();
      for (int64_t i = 0; ok && i < size; ++i)
        for (int64_t j = 0; ok && j < size; ++j)
          ok = causal_at(i, j, static_cast<double>(p[i * mask.stride(0) + j * mask.stride(1)]));
    });
    return ok;
  }
  const std::vector<double> v = ops::to_vector(mask);
  for (int64_t i = 0; i < size; ++i)
    for (int64_t j = 0; j < size; ++j)
      if (!causal_at(i, j, v[static_cast<size_t>(i * size + j)])) return false;
  return true;
}

// ---- TransformerEncoder ----
TransformerEncoder::TransformerEncoder(const TransformerEncoderLayer& encoder_layer, int64_t n,
                                       std::shared_ptr<Module> norm_)
    : Module("TransformerEncoder"), num_layers(n) {
  base::check_at_least(n, 0, "TransformerEncoder: num_layers");
  layers = register_module("layers", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < n; ++i) layers->push_back(encoder_layer.clone());
  if (norm_) norm = register_module("norm", std::move(norm_));
}

TransformerEncoderLayer& TransformerEncoder::layer(size_t i) const {
  return dynamic_cast<TransformerEncoderLayer&>(*(*layers)[i]);
}

Tensor TransformerEncoder::forward(const Tensor& src, const Tensor& mask,
                                   const Tensor& src_key_padding_mask,
                                   std::optional<bool> is_causal_hint) {
  Tensor x = src;
  // The sequence length, as PyTorch's _get_seq_len: [S, E] unbatched, else dim 1 with batch_first.
  const bool batch_first = layers->size() > 0 && layer(0).batch_first;
  const int64_t seq_len = src.dim() == 2 ? src.size(0) : src.size(batch_first ? 1 : 0);
  const bool is_causal = detect_is_causal_mask(mask, is_causal_hint, seq_len);
  const bool plain = !mask.defined() && !src_key_padding_mask.defined() && !is_causal;
  for (size_t i = 0; i < layers->size(); ++i) {
    TransformerEncoderLayer& l = layer(i);
    x = plain ? l(x) : l(x, mask, src_key_padding_mask, is_causal);
  }
  if (norm) x = (*norm)(x);
  return x;
}

}  // namespace tally::nn
