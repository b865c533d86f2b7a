// Internal to the attention family's CUDA files, not an API: the cuDNN route of the
// float16/bfloat16 fused attention (tensor/attention/cuda_cudnn.cpp), which the launchers of
// cuda::attention_kernels (tensor/attention/cuda.cu) try first. Same arguments and contracts
// as AttentionKernels' fields (tensor/attention/kernels.h).
#pragma once

#include "tensor/attention/kernels.h"

namespace tally::cuda {

// The cuDNN route itself (tensor/attention/cuda_cudnn.cpp): false, with nothing enqueued,
// when it does not take the problem.
AttentionForwardFn<bool> cudnn_flash_attention_forward;
AttentionBackwardFn<bool> cudnn_flash_attention_backward;

// The route's masks, as an additive bias in q's dtype (defined in tensor/attention/cuda.cu).
// "No key" becomes the dtype's stand-in `cudnn_mask_lowest` (float16 -65504, bfloat16 -1e30:
// finite, so a row without keys gives no NaN; its log-sum-exp lands near that value).
float cudnn_mask_lowest(DType dtype);
// bias (bias.numel() elements of its 16-bit dtype, contiguous) = the mask's own part (a
// [B, H, L, S] view, bool or float32; size 1 along its stride-0 dims) as a bias: true 0, false
// the lowest; float values clamped below at the lowest (-inf included).
void cudnn_mask_to_bias(const Tensor& bias, const Tensor& mask);
// After the forward: rows whose lse is below half the lowest (no key took part) get out 0 and
// lse -inf, the contract of AttentionKernels.
void cudnn_clear_dead_rows(const Tensor& out, const Tensor& lse);
// Before the backward: dst (lse.numel() floats) = lse with -inf as +inf, so that cuDNN's
// recomputed P = exp(s - stats) is 0 on a row without keys (and its gradients 0).
void cudnn_backward_stats(float* dst, const Tensor& lse);

}  // namespace tally::cuda
