// CUDA-only settings and queries of whole recurrent layers, for users and tests: the switch of
// the cuDNN route of nn::LSTM / nn::GRU and its counters. Defined in
// tensor/rnn/cuda_cudnn.cpp.
#pragma once

#include <cstdint>

namespace tally::cuda {

// Whether nn::LSTM and nn::GRU on CUDA (float32, float16, bfloat16; no proj_size; no
// dropout while training) may run every layer through cuDNN's RNN (cudnnRNNForward and its
// backwards), as PyTorch does (off: one product and one fused gate kernel per timestep). On
// by default; TALLY_CUDNN_RNN=0 in the environment starts it off (read at the first call; a
// value other than 0 or 1 is an error). float32 uses TF32 tensor cores only when
// cudnn_allow_tf32 (tensor/cuda/cudnn.h) is on, like PyTorch's cuDNN RNN.
void set_cudnn_rnn_enabled(bool enabled);
bool cudnn_rnn_enabled();
// Forwards and backwards served by cuDNN, and forwards that asked for it but took the
// per-timestep path because cuDNN declined the problem (remembered per problem).
struct CudnnRnnCounts {
  int64_t forward = 0, backward = 0, fallbacks = 0;
};
CudnnRnnCounts cudnn_rnn_counts();

}  // namespace tally::cuda
