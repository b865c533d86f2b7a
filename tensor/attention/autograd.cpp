// scaled_dot_product_attention as a composite of differentiable ops (the CPU reference and
// the plain path), with a branch to the fused flash_attention on CUDA when it applies.
#include "tensor/attention/autograd.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "memory/context.h"
#include "memory/meta.h"
#include "tensor/attention/ops.h"
#include "tensor/linalg/autograd.h"
#include "tensor/softmax/autograd.h"

namespace tally {

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask, double dropout_p, bool is_causal,
                                    std::optional<double> scale, Generator* gen, CallSite site) {
  memory::CallSiteScope call_site(site);
  if (autocast::is_active(q.device())) {  // cast once here; the body runs in that dtype
    const auto [q2, k2, v2, m2] =
        autocast::lower("scaled_dot_product_attention", q, k, v, attn_mask);
    autocast::ExcludeScope exclude;
    return scaled_dot_product_attention(q2, k2, v2, m2, dropout_p, is_causal, scale, gen);
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
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(E)));
  if (memory::behaves_as(q.device()) == DeviceType::cuda && !attn_mask.defined() &&
      dropout_p == 0.0 &&
      (q.dtype() == DType::bfloat16 || q.dtype() == DType::float16 ||
       q.dtype() == DType::float32) &&
      ops::flash_attention_supported(q, k, v))
    return flash_attention(q, k, v, is_causal, s);
  Tensor scores = mul(matmul(q, k.transpose(-2, -1)), s);
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
  Tensor attn = softmax(scores, -1);
  if (dropout_p > 0.0) attn = dropout(attn, dropout_p, true, gen);
  return matmul(attn, v);
}

Tensor flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal,
                       std::optional<double> scale, CallSite site) {
  memory::CallSiteScope call_site(site);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  ops::FlashAttentionOutput r = ops::flash_attention_forward(q, k, v, is_causal, s);
  autograd::record(
      "FlashAttentionBackward", {q, k, v}, {r.out}, {q, k, v, r.out, r.lse},
      [is_causal, s](autograd::BackwardContext& ctx, const TensorList& g) -> TensorList {
        ops::FlashAttentionGrads d =
            ops::flash_attention_backward(g[0], ctx.saved(0), ctx.saved(1), ctx.saved(2),
                                          ctx.saved(3), ctx.saved(4), is_causal, s);
        return {d.dq, d.dk, d.dv};
      });
  return r.out;
}

}  // namespace tally
