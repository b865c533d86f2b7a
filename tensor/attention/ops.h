// The fused, memory-efficient attention op (namespace tally::ops, no autograd), after
// FlashAttention-2: softmax(scale * q k^T [causal mask]) v computed tile by tile, keeping
// only the output and the per-row log-sum-exp; the backward recomputes the probabilities
// from the log-sum-exp, so no L x S matrix is ever allocated. The CPU kernel is the plain
// reference (any floating dtype, double math); the CUDA kernels take float16/bfloat16
// (tensor cores) with head dim <= 128 and a multiple of 8, and float32 (CUDA cores, float32
// FMA, no TF32) with head dim <= 128. The differentiable wrapper is
// tally::flash_attention (tensor/attention/autograd.h); scaled_dot_product_attention routes there
// on CUDA when flash_attention_supported() holds.
#pragma once

#include "tensor/elementwise/ops.h"

namespace tally::ops {

struct FlashAttentionOutput {
  // [..., L, Ev], q's dtype. 4-D q [B, H, L, E]: laid out token-major ([B, L, H, Ev] in
  // memory, so out.transpose(1, 2) is contiguous: a transformer's [B, T, C] without a copy);
  // otherwise contiguous.
  Tensor out;
  Tensor lse;  // [..., L]: log(sum_j exp(scale * q_i . k_j)) over allowed j; float32
               // (float64 for float64 inputs), contiguous
};

struct FlashAttentionGrads {
  // The inputs' shapes and dtype. When q, k, v are the three parts of one [B, T, 3, H, E]
  // tensor (a [B, T, 3C] projection split and viewed as heads), views of one new buffer of
  // that layout (the split's backward then needs no concatenation); otherwise contiguous.
  Tensor dq, dk, dv;
};

// q [..., L, E], k [..., S, E], v [..., S, Ev], the same leading dims and dtype on one
// device, except that k and v may have fewer heads (dim -3, the same for both) dividing q's:
// grouped-query attention, query head h reads key/value head h / (q heads / k heads).
// causal masks key j > query i (top-left aligned, PyTorch's is_causal). mask (optional):
// bool (true = take part) or floating (added to scale * q.k), broadcastable to
// [..., L, S] and read through its broadcast strides (a float mask is converted to lse's
// dtype at its own shape; nothing of [..., L, S] is allocated). A row with no allowed key
// gets out 0 and lse -inf (and zero gradients).
FlashAttentionOutput flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             bool causal, double scale,
                                             const Tensor& mask = Tensor());
// The gradients w.r.t. q, k, v from dout (out's shape) and what the forward returned (the
// same mask; none for the mask itself).
FlashAttentionGrads flash_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                             const Tensor& v, const Tensor& out, const Tensor& lse,
                                             bool causal, double scale,
                                             const Tensor& mask = Tensor());

// Whether the fused kernel exists for these inputs (and mask, if defined) on their device:
// CPU always (for floating inputs of matching shapes, a bool or floating mask that
// broadcasts); CUDA for float16/bfloat16 with E == Ev, E <= 128, E % 8 == 0, and for
// float32 with E == Ev, E <= 128.
bool flash_attention_supported(const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& mask = Tensor());

// Grouped-query attention's route where the fused kernels run (CUDA). Off (the default), the
// shared key/value heads are read in place: by cuDNN's kernels for 16-bit inputs (native GQA,
// dK and dV summed over each group inside its graph), else by Tally's. On, an unmasked
// float16/bfloat16 call first repeats the shared heads to q's count (a copy, and a sum in
// backward). On an H100, LLaMA-1B's step (B8 T2048 bf16) took 232.7 ms and 37,846 MiB in
// place against 242.9 ms and 39,382 MiB repeated. TALLY_GQA_REPEAT=1 starts the process with
// it on (read at the first call).
void set_gqa_repeat(bool repeat);
bool gqa_repeat();

// Rotary position embedding in the rotate-half layout, one pass (HF's apply_rotary_pos_emb for
// one tensor): x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., h:], x[..., :h]),
// h = D / 2 along x's last dim D (even). cos and sin broadcast to x's shape (not beyond it) and
// share its floating dtype and device; std::invalid_argument naming rotary_embedding otherwise.
// The result is contiguous. The backward is the gradient w.r.t. x from grad (x's shape), the
// same tables (the rotation's transpose), with the same checks.
Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin);
Tensor rotary_embedding_backward(const Tensor& grad, const Tensor& cos, const Tensor& sin);

}  // namespace tally::ops
