// Internal to the attention family's CUDA files, not an API: the CUDA kernels of the fused
// attention op for float32 (memory-efficient attention on the CUDA cores: FMA in float32
// throughout, no TF32), called by the launchers of cuda::attention_kernels
// (tensor/attention/cuda.cu) when q is float32. Same signatures and [B, H, T, E] layouts as
// AttentionKernels' fields (tensor/attention/kernels.h): out, dq, dk, dv contiguous,
// q/k/v/dout/out read through their strides (16-byte vector loads when every row starts
// 16-byte aligned, scalar loads otherwise). Head dim E == Ev, 1 <= E <= 128 (fast path
// E <= 64; E <= 32 and E <= 128 have their own instantiations). Launchers enqueue on Tally's
// stream and never synchronise.
#pragma once

#include <cstdint>

#include "tensor/attention/kernels.h"

namespace tally::cuda {

// Forward: one block of 128 threads per 64 query rows walks the 64-key tiles with an online
// softmax (S and O register-tiled 4 x 8 / 4 x 4*ceil(E/32) per thread); writes out and the
// float32 log-sum-exp [B, H, L].
AttentionForwardFn<void> flash_attention_forward_fp32;

// Backward: a preprocessing kernel (D = rowsum(dO * O), and dq zeroed), then one block per
// 64-key tile that walks the query tiles, recomputes P = exp(S - lse) from lse, keeps dK and
// dV in registers and adds each query tile's dQ = dS K into dq (float32, the output itself)
// with atomics. Results vary in the last bits from run to run (atomic order).
AttentionBackwardFn<void> flash_attention_backward_fp32;

// Whether the kernels' shared memory for head dim E fits a block on `device` (E > 64 needs
// 169 KB in the backward: Hopper yes, A100's 163 KB no). AttentionKernels'
// flash_attention_fp32_fits.
bool flash_attention_fp32_fits(int device, int64_t E);

}  // namespace tally::cuda
