// The differentiable recurrent cells (namespace tally): the fused gate step of an LSTM and of
// a GRU over precomputed projections (tensor/rnn/ops.h says what each computes). nn::LSTM and
// nn::GRU (nn/rnn.h) run them once per timestep.
#pragma once

#include <optional>
#include <tuple>
#include <utility>

#include "tensor/elementwise/autograd.h"
#include "tensor/rnn/ops.h"

namespace tally {

// (h, c) of one LSTM step from gates_x, gates_h [B, 4H] and c_prev [B, H]. Saves c_prev, c
// and the activated gates [B, 4H].
std::pair<Tensor, Tensor> lstm_cell_gates(const Tensor& gates_x, const Tensor& gates_h,
                                          const Tensor& c_prev,
                                          CallSite site = CallSite::current());
// h of one GRU step from gates_x, gates_h [B, 3H] (gates_h with b_hh) and h_prev [B, H].
// Saves h_prev and the workspace [B, 4H] (r, z, n and the hidden projection of n).
Tensor gru_cell_gates(const Tensor& gates_x, const Tensor& gates_h, const Tensor& h_prev,
                      CallSite site = CallSite::current());

// A whole LSTM or GRU (every layer and direction) through cuDNN's RNN, PyTorch's _cudnn_rnn:
// (output, h_n, c_n) from x [T, B, I] ([B, T, I] with spec.batch_first), h_0 and (LSTM) c_0
// [L * D, B, H] (undefined: zeros) and the weights (per cell, layer * D + direction: w_ih,
// w_hh and with spec.bias b_ih, b_hh), all one dtype on one CUDA device. One autograd node,
// CudnnRnnBackward0, saves x, h_0, c_0, the output, cuDNN's reserve space and the weights;
// spec.training is set here (whether any input needs a gradient). std::nullopt, with nothing
// computed, where the route does not take the problem: a CPU build, the route switched off
// (tensor/rnn/cuda.h) or cuDNN declining it; the caller then runs its per-timestep path.
std::optional<std::tuple<Tensor, Tensor, Tensor>> cudnn_rnn(const CudnnRnnSpec& spec,
                                                            const Tensor& x, const Tensor& h0,
                                                            const Tensor& c0,
                                                            const TensorList& weights,
                                                            CallSite site = CallSite::current());

}  // namespace tally
