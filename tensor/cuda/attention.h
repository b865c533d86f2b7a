// CUDA kernels of the fused attention op, twins of tensor/cpu/attention.h with the same
// signatures and [B, H, T, D] layouts. float16/bfloat16 run cuDNN's fused flash attention
// (tensor/cuda/cudnn_sdpa.h; Hopper wgmma kernels, what PyTorch's SDPA runs there) where
// cuDNN takes the problem, else Tally's FlashAttention-2 kernels (mma.sync tensor-core
// // instructions with float accumulators, attention.cu); float32 runs attention_fp32.cu.
// Inputs: float16/bfloat16, head dim E == Ev <= 128 and a multiple of 8 (padded to 64 or 128
// inside Tally's kernel), the last dim dense and the other strides multiples of 8 elements
// (tensor/attention.cpp ensures it).
// Launchers enqueue on Tally's stream and never synchronise with the host.
#pragma once

#include <string>

#include "tensor/ops/attention.h"

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
// cudnn_sdp_supported).
struct CudnnSdpCounts {
  int64_t forward = 0, backward = 0, fallbacks = 0;
};
CudnnSdpCounts cudnn_sdp_counts();
// Whether cuDNN runs the forward of this [B, H, T, D] problem (building and caching its plan
// for a contiguous output); `why` gets cuDNN's reason when not.
bool cudnn_sdp_supported(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                         double scale, std::string* why = nullptr);
// The cuDNN route itself (attention_cudnn.cpp): false, with nothing enqueued, when it does
// not take the problem.
bool cudnn_flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                                   const Tensor& k, const Tensor& v, bool causal, double scale);
bool cudnn_flash_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                    const Tensor& dout, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& out, const Tensor& lse,
                                    bool causal, double scale);

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
