// scaled_dot_product_attention as a composite of differentiable ops (the CPU reference and
// the plain path), with a branch to the fused flash_attention on CUDA when it applies.
#include "tensor/attention/autograd.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "autograd/autocast.h"
#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "memory/context.h"
#include "memory/meta.h"
#include "tensor/attention/ops.h"
#include "tensor/linalg/autograd.h"
#include "tensor/reduce/ops.h"
#include "tensor/shape/autograd.h"
#include "tensor/softmax/autograd.h"

namespace tally {

namespace {

// k or v [..., Hkv, S, D] with each head repeated `groups` times in a row ([..., Hkv * groups,
// S, D], torch.repeat_interleave on dim -3): the heads grouped-query attention gives each
// query head. One copy, differentiable (the expand's backward sums the group's gradients).
Tensor repeat_heads(const Tensor& t, int64_t groups) {
  if (groups == 1) return t;
  Shape grouped = t.sizes();
  grouped.insert(grouped.end() - 2, groups);
  Shape merged = t.sizes();
  merged[merged.size() - 3] *= groups;
  return t.unsqueeze(-3).expand(grouped).reshape(merged);
}

// The checks PyTorch makes before any work: the mask's dtype and that it broadcasts to the
// attention weights' shape [batch..., L, S] (batch: q's, k's and v's leading dims broadcast).
void check_mask(const Tensor& mask, const Shape& weights, const Tensor& q, const Tensor& k) {
  if (mask.dtype() != DType::bool_ && !is_floating(mask.dtype()))
    throw std::invalid_argument(fmt::format(
        "scaled_dot_product_attention: attn_mask must be bool (True = take part) or floating "
        "(added to the scores), got {}",
        dtype_name(mask.dtype())));
  bool ok = mask.dim() <= static_cast<int64_t>(weights.size());
  for (int64_t i = 1; ok && i <= mask.dim(); ++i) {
    const int64_t m = mask.size(-i), w = weights[weights.size() - static_cast<size_t>(i)];
    ok = m == w || m == 1;
  }
  if (!ok)
    throw std::invalid_argument(fmt::format(
        "scaled_dot_product_attention: attn_mask of shape {} does not broadcast to the attention "
        "weights' shape {} (q {}, k {})",
        mask.shape_string(), shape_str(weights), q.shape_string(), k.shape_string()));
}

// Whether the fused kernel (flash_attention) takes this call rather than the composite: on
// CUDA, without dropout (dropout_p > 0 keeps the composite), float16/bfloat16/float32, a mask
// that needs no gradient (a float mask that requires grad keeps the composite, whose add
// differentiates it), and shapes the kernel takes (ops::flash_attention_supported: k and v
// with q's heads, or fewer dividing them, read in place as grouped-query heads; one key/value
// head broadcast to all query heads is the same map).
bool fast_path_applies(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                       double dropout_p) {
  if (memory::behaves_as(q.device()) != DeviceType::cuda || dropout_p != 0.0) return false;
  if (q.dtype() != DType::bfloat16 && q.dtype() != DType::float16 && q.dtype() != DType::float32)
    return false;
  if (attn_mask.defined() && attn_mask.requires_grad() && GradMode::is_enabled()) return false;
  return ops::flash_attention_supported(q, k, v, attn_mask);
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask, double dropout_p, bool is_causal,
                                    std::optional<double> scale, bool enable_gqa, Generator* gen,
                                    CallSite site) {
  memory::CallSiteScope call_site(site);
  if (autocast::is_active(q.device())) {  // cast once here; the body runs in that dtype
    const auto [q2, k2, v2, m2] =
        autocast::lower("scaled_dot_product_attention", q, k, v, attn_mask);
    autocast::ExcludeScope exclude;
    return scaled_dot_product_attention(q2, k2, v2, m2, dropout_p, is_causal, scale, enable_gqa,
                                        gen);
  }
  if (q.dim() < 2 || k.dim() < 2 || v.dim() < 2)
    throw std::invalid_argument(
        fmt::format("scaled_dot_product_attention: q, k, v need at least 2 dims, got {}, {}, {}",
                    q.shape_string(), k.shape_string(), v.shape_string()));
  const int64_t L = q.size(-2), E = q.size(-1), S = k.size(-2);
  if (k.size(-1) != E || v.size(-2) != S)
    throw std::invalid_argument(fmt::format(
        "scaled_dot_product_attention: shapes q {}, k {}, v {} do not agree (need k [..., S, E] "
        "and v [..., S, Ev] for q [..., L, E])",
        q.shape_string(), k.shape_string(), v.shape_string()));
  if (is_causal && attn_mask.defined())
    throw std::invalid_argument(
        "scaled_dot_product_attention: is_causal cannot be combined with an explicit attn_mask");
  if (!(dropout_p >= 0.0 && dropout_p <= 1.0))
    throw std::invalid_argument(fmt::format(
        "scaled_dot_product_attention: dropout_p must be in [0, 1], got {}", dropout_p));
  // Grouped-query attention: each key/value head serves q.size(-3) / k.size(-3) query heads.
  // The fused kernel reads the shared heads in place; the composite repeats them.
  const bool gqa = enable_gqa && q.dim() >= 3 && k.dim() >= 3 && v.dim() >= 3;
  if (gqa) {
    const int64_t hq = q.size(-3), hk = k.size(-3), hv = v.size(-3);
    if (hk <= 0 || hv <= 0 || hq % hk != 0 || hq % hv != 0)
      throw std::invalid_argument(fmt::format(
          "scaled_dot_product_attention: enable_gqa needs the query heads ({}) to be a multiple "
          "of the key heads ({}) and the value heads ({}) (dim -3 of q {}, k {}, v {})",
          hq, hk, hv, q.shape_string(), k.shape_string(), v.shape_string()));
  }
  const auto repeated = [&](const Tensor& t) {
    return gqa ? repeat_heads(t, q.size(-3) / t.size(-3)) : t;
  };
  Shape weights;  // the attention weights' shape: the batch dims broadcast, then [L, S]
  try {
    const auto lead = [](const Tensor& t) { return Shape(t.sizes().begin(), t.sizes().end() - 2); };
    Shape lk = lead(k), lv = lead(v);
    if (gqa) lk[lk.size() - 1] = lv[lv.size() - 1] = q.size(-3);
    weights = ops::broadcast_shapes(ops::broadcast_shapes(lead(q), lk, "sdpa"), lv, "sdpa");
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument(fmt::format(
        "scaled_dot_product_attention: the batch dims of q {}, k {}, v {} do not broadcast{}",
        q.shape_string(), k.shape_string(), v.shape_string(),
        enable_gqa ? "" : " (different head counts need enable_gqa=True)"));
  }
  weights.push_back(L);
  weights.push_back(S);
  if (attn_mask.defined()) check_mask(attn_mask, weights, q, k);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(E)));
  // Shared key/value heads are read in place, except where the repeat route is on
  // (ops::gqa_repeat, off by default: unmasked 16-bit calls repeat them first).
  const bool shared_heads = gqa && (k.size(-3) != q.size(-3) || v.size(-3) != q.size(-3));
  const bool repeat = shared_heads && ops::gqa_repeat() && !attn_mask.defined() &&
                      (q.dtype() == DType::bfloat16 || q.dtype() == DType::float16);
  if (!repeat && fast_path_applies(q, k, v, attn_mask, dropout_p))
    return flash_attention(q, k, v, is_causal, s, attn_mask);
  const Tensor key = repeated(k), value = repeated(v);  // e.g. key and value head counts differ
  if (gqa && fast_path_applies(q, key, value, attn_mask, dropout_p))
    return flash_attention(q, key, value, is_causal, s, attn_mask);
  Tensor scores = mul(matmul(q, key.transpose(-2, -1)), s);
  const double ninf = -std::numeric_limits<double>::infinity();
  if (is_causal) {
    // keep j <= i: mask out j > i
    const Tensor rows =
        ops::reshape(ops::arange(0, static_cast<double>(L), 1, DType::int64, q.device()), {L, 1});
    const Tensor cols =
        ops::reshape(ops::arange(0, static_cast<double>(S), 1, DType::int64, q.device()), {1, S});
    scores = masked_fill(scores, ops::binary(ops::BinaryOp::gt, cols, rows), ninf);
  } else if (attn_mask.defined()) {
    if (attn_mask.dtype() == DType::bool_) {
      scores = masked_fill(scores, ops::binary_scalar(ops::BinaryOp::eq, attn_mask, 0.0), ninf);
    } else {
      scores = add(scores, attn_mask.to(scores.dtype()));
    }
  }
  Tensor attn;
  if (attn_mask.defined() && S > 0) {
    // PyTorch's _safe_softmax: a row with no key left (all -inf) attends to nothing (zeros,
    // and zero gradients) instead of NaN. The row is set finite before the softmax so that
    // no NaN reaches the backward either.
    const Tensor dead =
        ops::binary_scalar(ops::BinaryOp::eq, ops::amax(scores.detach(), {-1}, true), ninf);
    attn = masked_fill(softmax(masked_fill(scores, dead, 0.0), -1), dead, 0.0);
  } else {
    attn = softmax(scores, -1);
  }
  if (dropout_p > 0.0) attn = dropout(attn, dropout_p, true, gen);
  return matmul(attn, value);
}

Tensor flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal,
                       std::optional<double> scale, const Tensor& attn_mask, CallSite site) {
  memory::CallSiteScope call_site(site);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  ops::FlashAttentionOutput r = ops::flash_attention_forward(q, k, v, is_causal, s, attn_mask);
  // The mask is saved (no gradient) only when there is one.
  TensorList saved{q, k, v, r.out, r.lse};
  const bool masked = attn_mask.defined();
  if (masked) saved.push_back(attn_mask.detach());
  autograd::record(
      "FlashAttentionBackward", {q, k, v}, {r.out}, saved,
      [is_causal, s, masked](autograd::BackwardContext& ctx, const TensorList& g) -> TensorList {
        ops::FlashAttentionGrads d = ops::flash_attention_backward(
            g[0], ctx.saved(0), ctx.saved(1), ctx.saved(2), ctx.saved(3), ctx.saved(4), is_causal,
            s, masked ? ctx.saved(5) : Tensor());
        return {d.dq, d.dk, d.dv};
      });
  return r.out;
}

Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin, CallSite site) {
  memory::CallSiteScope call_site(site);
  if (!x.defined() || !cos.defined() || !sin.defined())
    throw std::invalid_argument("rotary_embedding: x, cos and sin must be defined");
  const bool fused = is_floating(x.dtype()) && cos.dtype() == x.dtype() &&
                     sin.dtype() == x.dtype() && !cos.requires_grad() && !sin.requires_grad();
  if (!fused) {
    if (x.dim() == 0 || x.size(-1) % 2 != 0)
      throw std::invalid_argument(
          fmt::format("rotary_embedding: x {} needs a last dim of even size", x.shape_string()));
    const int64_t h = x.size(-1) / 2;
    const Tensor rotated = cat({neg(x.narrow(-1, h, h)), x.narrow(-1, 0, h)}, -1);
    return add(mul(x, cos), mul(rotated, sin));
  }
  Tensor out = ops::rotary_embedding(x, cos, sin);
  autograd::record("RotaryEmbeddingBackward", {x}, {out}, {cos, sin},
                   [](autograd::BackwardContext& ctx, const TensorList& g) -> TensorList {
                     return {ops::rotary_embedding_backward(g[0], ctx.saved(0), ctx.saved(1))};
                   });
  return out;
}

}  // namespace tally
