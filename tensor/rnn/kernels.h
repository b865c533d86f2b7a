// The kernel table of the recurrent-cell family (the fused LSTM and GRU gate steps and their
// gradients): each kernel's signature, once. The CPU reference (tensor/rnn/cpu.cpp) and the
// CUDA kernels (tensor/rnn/cuda.cu) each define one RnnKernels; tensor/backends.cpp registers
// them.
//
// Called only by the raw ops (tensor/rnn/ops.cpp): every tensor arrives contiguous, 2-D
// [B, k * H] or [B, H] as named, in one floating dtype (outputs included), shapes checked.
// Kernels compute in acc_t (float for the 16-bit types) and write every output element. An
// undefined grad_h or grad_c reads as zeros.
#pragma once

#include "tensor/dispatch.h"
#include "tensor/rnn/ops.h"
#include "tensor/tensor.h"

namespace tally {

struct RnnKernels {
  void (*lstm_cell_forward)(const Tensor& h, const Tensor& c, const Tensor& workspace,
                            const Tensor& gates_x, const Tensor& gates_h, const Tensor& c_prev);
  void (*lstm_cell_backward)(const Tensor& grad_gates, const Tensor& grad_c_prev,
                             const Tensor& grad_h, const Tensor& grad_c, const Tensor& c_prev,
                             const Tensor& c, const Tensor& workspace);
  void (*gru_cell_forward)(const Tensor& h, const Tensor& workspace, const Tensor& gates_x,
                           const Tensor& gates_h, const Tensor& h_prev);
  void (*gru_cell_backward)(const Tensor& grad_gates_x, const Tensor& grad_gates_h,
                            const Tensor& grad_h_prev, const Tensor& grad_h, const Tensor& h_prev,
                            const Tensor& workspace);
  // Whole layers (cuDNN's RNN; CUDA, and the meta device replaying it; null on the CPU):
  // ops::cudnn_rnn's contract, x, h0, c0 and the weights contiguous. The forward leaves
  // out->taken false, with nothing enqueued, when it does not take the problem.
  void (*cudnn_rnn_forward)(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0,
                            const Tensor& c0, const TensorList& weights, CudnnRnnOutputs* out);
  void (*cudnn_rnn_backward)(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0,
                             const Tensor& c0, const TensorList& weights, const Tensor& output,
                             const Tensor& reserve, const Tensor& grad_output,
                             const Tensor& grad_h_n, const Tensor& grad_c_n, CudnnRnnGrads* grads);
  // cuDNN's sizes for a problem on this machine's cuda:0 (CUDA only): what the meta device's
  // whole-layer entries allocate when they replay this GPU.
  void (*cudnn_rnn_sizes)(const CudnnRnnSpec& spec, DType dtype, int64_t T, int64_t B,
                          CudnnRnnSizes* sizes);
};

// cpu::rnn_kernels (tensor/rnn/cpu.cpp), cuda::rnn_kernels (tensor/rnn/cuda.cu), rnn_backends
// (tensor/backends.cpp).
TALLY_DECLARE_KERNELS(RnnKernels, rnn_kernels, rnn_backends);

// The table's entries in member order: each backend defines its table as
// `const RnnKernels rnn_kernels{TALLY_RNN_KERNELS};`.
#define TALLY_RNN_KERNELS                                                             \
  .lstm_cell_forward = &lstm_cell_forward, .lstm_cell_backward = &lstm_cell_backward, \
  .gru_cell_forward = &gru_cell_forward, .gru_cell_backward = &gru_cell_backward

}  // namespace tally
