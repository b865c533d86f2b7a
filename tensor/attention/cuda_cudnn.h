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

}  // namespace tally::cuda
