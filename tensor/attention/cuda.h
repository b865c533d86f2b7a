// CUDA-only settings and queries of the fused attention op, for users and tests (the kernels
// themselves are entries of cuda::attention_kernels, tensor/attention/kernels.h): the switch
// of the cuDNN route for float16/bfloat16, its counters, and whether cuDNN takes a problem.
// Defined in tensor/attention/cuda_cudnn.cpp.
#pragma once

#include <cstdint>
#include <string>

#include "tensor/tensor.h"

namespace tally::cuda {

// PyTorch's torch.backends.cuda.enable_cudnn_sdp: whether float16/bfloat16 attention may run
// cuDNN's fused kernels (off: always Tally's own). On by default; TALLY_CUDNN_SDP=0 in the
// environment starts it off (read at the first call; a value other than 0 or 1 is an error).
// Either forward's log-sum-exp feeds either backward, so the switch may change between a
// forward and its backward.
void set_cudnn_sdp_enabled(bool enabled);
bool cudnn_sdp_enabled();
// Calls served by cuDNN, and calls that asked for it but fell back to Tally's kernels
// because cuDNN declined the problem (remembered per problem; the reason via
// cudnn_sdp_supported). tuned: forward and backward problems whose engine configurations were
// timed: with tunable ops on (set_tunable_enabled, tensor/precision.h) the first call of a
// problem outside a CUDA graph capture runs each of cuDNN's first 8 usable configurations
// 4 times on its own tensors (one host wait each) and keeps the fastest when it is 3% faster
// than the heuristics' first; the choice is cached per problem for the process (a capture
// takes the tuned plan when there is one, else the heuristics' first).
struct CudnnSdpCounts {
  int64_t forward = 0, backward = 0, fallbacks = 0, tuned = 0;
};
CudnnSdpCounts cudnn_sdp_counts();
// Whether cuDNN runs the forward of this [B, H, T, D] problem (building and caching its plan
// for a contiguous output); `why` gets cuDNN's reason when not. mask (optional): as the
// kernels take it, a [B, H, L, S] view with stride 0 along broadcast dims.
bool cudnn_sdp_supported(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                         double scale, std::string* why = nullptr, const Tensor& mask = Tensor());

}  // namespace tally::cuda
