// Raw recurrent-cell ops (namespace tally::ops, no autograd): the fused gate step of an LSTM
// and of a GRU, PyTorch's _thnn_fused_lstm_cell / _thnn_fused_gru_cell. The products
// (x W_ih^T + b_ih for every timestep, h W_hh^T + b_hh per step) are the caller's matmuls;
// these ops add the two projections, apply the gate nonlinearities and update the state in
// one kernel, and keep the activated gates (the workspace) for their backward ops.
// The differentiable versions live in tensor/rnn/autograd.h.
#pragma once

#include <tuple>
#include <utility>

#include "tensor/elementwise/ops.h"

namespace tally {

// A whole LSTM or GRU (every layer and direction) as cuDNN's RNN runs it (tensor/rnn/autograd.h:
// cudnn_rnn): the module's options and whether the forward keeps what a backward needs.
struct CudnnRnnSpec {
  bool lstm = true;  // false: GRU
  int64_t input_size = 0, hidden_size = 0, num_layers = 1;
  bool bias = true, bidirectional = false, batch_first = false;
  bool training = false;  // a gradient is needed: cuDNN's training mode, with a reserve space
  int64_t directions() const { return bidirectional ? 2 : 1; }
  // Tensors per cell in the weight list: w_ih, w_hh and, with bias, b_ih, b_hh.
  int64_t tensors_per_cell() const { return bias ? 4 : 2; }
};

// What the whole-layer forward writes: output [T, B, D * H] (or [B, T, D * H] batch-first), h_n
// and (LSTM) c_n [L * D, B, H], and with spec.training cuDNN's reserve space (uint8), which the
// backward reads and updates. taken: false when the route did not take the problem (nothing
// computed).
struct CudnnRnnOutputs {
  Tensor output, h_n, c_n, reserve;
  bool taken = false;
};

// cuDNN's byte counts for a problem (its flat weight space, workspace and, training, reserve
// space); ok false when the route would not take it.
struct CudnnRnnSizes {
  size_t weight = 0, work = 0, reserve = 0;
  bool ok = false;
};

// The gradients of the forward's inputs: dx, dh_0 and dc_0 (undefined when h_0, c_0 were), and
// one per weight (the weight list's order).
struct CudnnRnnGrads {
  Tensor dx, dh0, dc0;
  TensorList dweights;
};

}  // namespace tally

namespace tally::ops {

// LSTM, PyTorch's gate order (i, f, g, o): gates_x and gates_h are [B, 4H] (one row a batch
// element, the four gates' pre-activations side by side), c_prev [B, H], all one floating
// dtype and device. i = sigmoid(x_i + h_i), f = sigmoid(..), g = tanh(..), o = sigmoid(..),
// c = f * c_prev + i * g, h = o * tanh(c). Returns (h, c, workspace), the workspace [B, 4H]
// holding the activated gates (i, f, g, o).
std::tuple<Tensor, Tensor, Tensor> lstm_cell_gates(const Tensor& gates_x, const Tensor& gates_h,
                                                   const Tensor& c_prev);
// The gradients of lstm_cell_gates: (grad_gates [B, 4H], the gradient of both gates_x and
// gates_h; grad_c_prev [B, H]). grad_h or grad_c may be undefined (no gradient: zeros).
std::pair<Tensor, Tensor> lstm_cell_gates_backward(const Tensor& grad_h, const Tensor& grad_c,
                                                   const Tensor& c_prev, const Tensor& c,
                                                   const Tensor& workspace);

// GRU, PyTorch's gate order (r, z, n): gates_x and gates_h are [B, 3H] (gates_h includes
// b_hh), h_prev [B, H]. r = sigmoid(x_r + h_r), z = sigmoid(x_z + h_z),
// n = tanh(x_n + r * h_n), h = (1 - z) * n + z * h_prev. Returns (h, workspace), the workspace
// [B, 4H] holding (r, z, n, h_n).
std::pair<Tensor, Tensor> gru_cell_gates(const Tensor& gates_x, const Tensor& gates_h,
                                         const Tensor& h_prev);
// The gradients of gru_cell_gates: (grad_gates_x [B, 3H], grad_gates_h [B, 3H],
// grad_h_prev [B, H]); an undefined grad_h gives zeros.
std::tuple<Tensor, Tensor, Tensor> gru_cell_gates_backward(const Tensor& grad_h,
                                                           const Tensor& h_prev,
                                                           const Tensor& workspace);

// Whole LSTM / GRU layers (tensor/rnn/autograd.h: cudnn_rnn, which says what each tensor is).
// x, h0, c0 and the weights arrive as the caller has them (made contiguous here). False, with
// nothing computed, where the device has no whole-layer kernel (only CUDA has: cuDNN) or the
// route does not take the problem.
bool cudnn_rnn(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0, const Tensor& c0,
               const TensorList& weights, CudnnRnnOutputs* out);
// The backward of a training cudnn_rnn: x, h0, c0, weights, output and reserve as the forward
// used and made them; grad_output, grad_h_n, grad_c_n may be undefined (zeros).
CudnnRnnGrads cudnn_rnn_backward(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0,
                                 const Tensor& c0, const TensorList& weights, const Tensor& output,
                                 const Tensor& reserve, const Tensor& grad_output,
                                 const Tensor& grad_h_n, const Tensor& grad_c_n);

}  // namespace tally::ops
