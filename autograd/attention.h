// scaled_dot_product_attention, PyTorch's semantics. This is the plain path: it builds the
// L x S score matrix and keeps the softmax for backward (that matrix is the attention
// activation memory). The CUDA backend adds a fused, memory-efficient path for causal
// bf16/fp16 attention that keeps only the output and the log-sum-exp.
#pragma once

#include <optional>

#include "autograd/ops.h"

namespace tally {

// q [..., L, E], k [..., S, E], v [..., S, Ev] -> [..., L, Ev]. attn_mask: bool (true =
// attend) or floating (added to the scores), broadcast to [..., L, S]. is_causal masks
// j > i (top-left aligned) and cannot be combined with attn_mask. scale defaults to
// 1/sqrt(E).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask = Tensor(), double dropout_p = 0.0,
                                    bool is_causal = false,
                                    std::optional<double> scale = std::nullopt,
                                    Generator* gen = nullptr);

}  // namespace tally
