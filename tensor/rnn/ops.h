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

}  // namespace tally::ops
