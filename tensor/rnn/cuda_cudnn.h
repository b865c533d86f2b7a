// Internal to the recurrent family, not an API: the cuDNN route of whole LSTM and GRU layers
// (tensor/rnn/cuda_cudnn.cpp): the whole-layer entries of cuda::rnn_kernels (tensor/rnn/cuda.cu),
// which ops::cudnn_rnn (tensor/rnn/ops.cpp) dispatches to. No cuDNN header here.
#pragma once

#include "tensor/rnn/ops.h"

namespace tally::cuda {

// The forward of every layer and direction at once. x: contiguous [T, B, I] ([B, T, I]
// batch-first); h0, c0: contiguous [L * D, B, H] or undefined (zeros); weights: for each
// cell (layer * D + direction) w_ih, w_hh and, with spec.bias, b_ih, b_hh, all of x's dtype
// and device. out->taken stays false, with nothing enqueued, when the route does not take the
// problem (off, or cuDNN declined it: a counted fallback). The entry of cuda::rnn_kernels.
void cudnn_rnn_forward(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0,
                       const Tensor& c0, const TensorList& weights, CudnnRnnOutputs* out);

// The backward of a training forward of the same problem: output and reserve are the
// forward's; grad_output, grad_h_n, grad_c_n may be undefined (zeros). Throws on a cuDNN error
// (the forward already ran on cuDNN, so there is no other path to take).
void cudnn_rnn_backward(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0,
                        const Tensor& c0, const TensorList& weights, const Tensor& output,
                        const Tensor& reserve, const Tensor& grad_output, const Tensor& grad_h_n,
                        const Tensor& grad_c_n, CudnnRnnGrads* grads);

// cuDNN's sizes for the problem on cuda:0 (building and caching its plan), ok false where the
// route would not take it (off, or cuDNN declines it); counts nothing. The meta device's
// whole-layer entries (tensor/rnn/meta.cpp) allocate these bytes when they replay this GPU.
void cudnn_rnn_sizes(const CudnnRnnSpec& spec, DType dtype, int64_t T, int64_t B,
                     CudnnRnnSizes* sizes);

// Fills n int32 values at `dst` (device memory) with `value` on the device's Tally stream
// (tensor/rnn/cuda.cu): cuDNN's device copy of the sequence lengths.
void fill_int32(int32_t* dst, int64_t n, int32_t value, int device);

}  // namespace tally::cuda
