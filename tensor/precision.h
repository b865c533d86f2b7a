// Precision switches, in every build (no CUDA header needed): PyTorch's
// torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
// torch.backends.cudnn.benchmark, torch.backends.cuda.enable_cudnn_sdp and
// torch.cuda.tunable.enable. On a CUDA build
// they set the CUDA backend's switches (tensor/linalg/cuda.h, tensor/cuda/cudnn.h,
// tensor/attention/cuda.h, where their effects are documented); on a CPU-only build they are
// remembered and change nothing (the CPU computes float32 exactly and has no cuDNN).
// Process-wide.
#pragma once

namespace tally {

// float32 matmuls may use TF32 tensor cores. Off by default.
void set_allow_tf32(bool allow);
bool allow_tf32();
// float32 convolutions may use TF32 tensor cores. On by default, as in PyTorch.
void set_cudnn_allow_tf32(bool allow);
bool cudnn_allow_tf32();
// Convolutions measure cuDNN's algorithms once per shape and keep the fastest. Off by default.
void set_cudnn_benchmark(bool enabled);
bool cudnn_benchmark();
// Products time cuBLASLt's candidate algorithms once per problem and keep the fastest
// (torch.cuda.tunable.enable); 16-bit attention times cuDNN's engine configurations the same
// way (tensor/attention/cuda.h). Off by default (TALLY_TUNABLEOP_ENABLED=1 starts it on).
void set_tunable_enabled(bool enabled);
bool tunable_enabled();
// float16/bfloat16 attention may run cuDNN's fused kernels. On by default (TALLY_CUDNN_SDP=0
// in the environment starts it off on CUDA builds).
void set_cudnn_sdp_enabled(bool enabled);
bool cudnn_sdp_enabled();

}  // namespace tally
