// CPU reference kernels of the fused (flash) attention op: plain loops over [B, H, T, D]
// views with any strides, math in double, computing the same log-sum-exp the CUDA kernel
// saves. Called only through the dispatch point in tensor/attention.cpp.
#pragma once

#include "tensor/ops/attention.h"

namespace tally::cpu {

// q [B, H, L, E], k [B, H, S, E], v [B, H, S, Ev] (any strides); out [B, H, L, Ev] in q's
// dtype and lse [B, H, L] (float32, float64 for float64 inputs), both contiguous.
void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, bool causal, double scale);
// dq, dk, dv (contiguous, the inputs' shapes and dtype) <- the gradients from dout (out's
// shape) and what the forward saved (q, k, v, out, lse).
void flash_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, bool causal, double scale);

}  // namespace tally::cpu
