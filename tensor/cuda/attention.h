// CUDA kernels of the fused attention op (FlashAttention-2: mma.sync bf16/fp16 tensor-core
// instructions with float accumulators; TALLY_FLASH_LEGACY=1 selects the older WMMA kernels),
// twins of tensor/cpu/attention.h with
// the same signatures and [B, H, T, D] layouts. Inputs: float16/bfloat16, head dim
// E == Ev <= 128 and a multiple of 8 (padded to 64 or 128 inside the kernel), the last dim
// dense and the other strides multiples of 8 elements (tensor/attention.cpp ensures it).
// Launchers enqueue on Tally's stream and never synchronise with the host.
#pragma once

#include "tensor/ops/attention.h"

namespace tally::cuda {

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, bool causal, double scale);
// Backward: a preprocessing kernel (D = rowsum(dO * O)), one block per key tile that
// recomputes the probabilities tile by tile from lse and accumulates dK, dV in registers
// and dQ (float32, atomically, a temporary the size of q in float), and a final
// conversion of dQ.
void flash_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, bool causal, double scale);

}  // namespace tally::cuda
