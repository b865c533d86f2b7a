// scaled_dot_product_attention, PyTorch's semantics. This is the plain path: it builds the
// L x S score matrix and keeps the softmax for backward (that matrix is the attention
// activation memory). On CUDA, float16/bfloat16/float32 attention without dropout (with or
// without a mask, grouped-query heads read in place) takes the fused, memory-efficient path
// (flash_attention) that keeps only the output and the log-sum-exp.
#pragma once

#include <optional>

#include "tensor/elementwise/autograd.h"

namespace tally {

// q [..., L, E], k [..., S, E], v [..., S, Ev] -> [..., L, Ev]; the leading dims broadcast.
// attn_mask: bool (true = take part) or floating (added to the scores), broadcast to the
// weights' [..., L, S]; a row that a mask leaves without any key gives zeros (PyTorch's
// _safe_softmax). is_causal masks j > i (top-left aligned) and cannot be combined with
// attn_mask. scale defaults to 1/sqrt(E). enable_gqa: k and v may have fewer heads (dim -3)
// than q, dividing them; key/value head h serves query heads h*G .. h*G+G-1 (G the ratio).
// The fused path (flash_attention) runs on CUDA without dropout, with or without a mask (a
// float mask that requires grad excepted), GQA's heads read in place; everything else is the
// composite of matmul, masked_fill, softmax, dropout (GQA's heads repeated for it).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask = Tensor(), double dropout_p = 0.0,
                                    bool is_causal = false,
                                    std::optional<double> scale = std::nullopt,
                                    bool enable_gqa = false, Generator* gen = nullptr,
                                    CallSite site = CallSite::current());

// The fused, memory-efficient attention (tensor/attention/ops.h) as a differentiable op:
// softmax(scale * q k^T [causal] [+ mask]) v without dropout, saving only q, k, v, the output,
// the per-row log-sum-exp and the mask (no L x S matrix); the backward recomputes the
// probabilities. q, k, v share their leading dims, except that k and v may have fewer heads
// (grouped-query attention). attn_mask: bool (true = take part) or floating, broadcast to
// [..., L, S]; it gets no gradient. scaled_dot_product_attention takes this path on CUDA for
// float16/bfloat16/float32 without dropout when ops::flash_attention_supported holds.
Tensor flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal = false,
                       std::optional<double> scale = std::nullopt,
                       const Tensor& attn_mask = Tensor(), CallSite site = CallSite::current());

// HF's apply_rotary_pos_emb for one tensor in one pass: x * cos + rotate_half(x) * sin along
// x's last dim (ops::rotary_embedding). It saves only the tables and its backward is one pass
// too. Tables of another dtype than x's, or that require grad, take the composite of neg, cat,
// mul and add (PyTorch's type promotion and the tables' gradients).
Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin,
                        CallSite site = CallSite::current());

}  // namespace tally
