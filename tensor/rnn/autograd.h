// The differentiable recurrent cells (namespace tally): the fused gate step of an LSTM and of
// a GRU over precomputed projections (tensor/rnn/ops.h says what each computes). nn::LSTM and
// nn::GRU (nn/rnn.h) run them once per timestep.
#pragma once

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

}  // namespace tally
