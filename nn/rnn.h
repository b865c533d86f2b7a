// Recurrent layers (torch.nn.LSTM, torch.nn.GRU) with PyTorch's constructor arguments,
// parameter names (weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k}, and the
// `_reverse` twins of a bidirectional layer), gate order (LSTM i, f, g, o; GRU r, z, n) and
// initialisation (every parameter U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))).
//
// On CUDA (float32, float16, bfloat16; no proj_size; no dropout while training) every layer
// runs through cuDNN's RNN in one autograd node, CudnnRnnBackward0, as PyTorch's does
// (tensor/rnn/autograd.h: cudnn_rnn; docs/cudnn_rnn.md says how a dry run replays it).
// Elsewhere, and where cuDNN declines a problem, each layer and direction projects the whole
// sequence at once (one linear over [T, B, I]); each step is one linear of the hidden state and one
// fused gate op (tensor/rnn/autograd.h: lstm_cell_gates, gru_cell_gates). LSTM's proj_size > 0 adds
// weight_hr_l{k} [proj_size, hidden_size] per layer and direction: h = weight_hr (o * tanh(c)), so
// h, h_0/h_n and the output carry proj_size features (c keeps hidden_size), as PyTorch's.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nn/module.h"

namespace tally::nn {

// The parameters and loop shared by LSTM and GRU; `gates` is 4 (LSTM) or 3 (GRU).
class RNNBase : public Module {
 public:
  RNNBase(const char* mode, int64_t gates, int64_t input_size, int64_t hidden_size,
          int64_t num_layers, bool bias, bool batch_first, double dropout, bool bidirectional,
          Generator* gen, int64_t proj_size = 0);
  // Every parameter U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)), in registration order.
  void reset_parameters(Generator* gen = nullptr);
  std::string extra_repr() const override;

  int64_t input_size, hidden_size, num_layers;
  bool bias, batch_first;
  double dropout;
  bool bidirectional;
  Generator* gen = nullptr;  // dropout's generator (null: the default one)
  int64_t proj_size = 0;     // LSTM only: 0, or h's size (< hidden_size)

 protected:
  struct Cell {
    Tensor w_ih, w_hh, b_ih, b_hh, w_hr;  // w_hr: LSTM's projection (proj_size > 0)
  };
  // (output [T, B, D * H] or batch-first, the final states per layer and direction): runs
  // every layer; `step` maps (gates_x, gates_h, state) to the new state, whose first tensor
  // is the output. state0: one list of [L * D, B, H] tensors (h, or h and c; h has
  // proj_size features when set).
  std::pair<Tensor, TensorList> run(const Tensor& input, const TensorList& state0,
                                    size_t state_count);
  virtual TensorList step(const Tensor& gates_x, const Tensor& gates_h,
                          const TensorList& state) = 0;
  // Whether the whole-layer cuDNN route (tensor/rnn/autograd.h: cudnn_rnn) applies to x
  // ([T, B, I] or batch-first, checked) with the given initial states (undefined: zeros): a
  // float32/float16/bfloat16 input on CUDA (or a meta device replaying it), states and parameters
  // all of its dtype, no proj_size, no dropout while training, no CUDA autocast. cuDNN may still
  // decline the problem (or the route be switched off): then run() takes the per-timestep path.
  bool fast_path_applies(const Tensor& x, const TensorList& state0) const;

  // h's size: proj_size when set, hidden_size otherwise.
  int64_t real_hidden_size() const { return proj_size > 0 ? proj_size : hidden_size; }

  const char* mode_;
  int64_t gates_;
  std::vector<Cell> cells_;  // layer * directions + direction
};

// torch.nn.LSTM. input [T, B, input_size] ([B, T, input_size] with batch_first, or unbatched
// [T, input_size]); hx (h_0, c_0), each [num_layers * D, B, hidden_size] (unbatched: without
// B), zeros when absent. Returns (output [T, B, D * hidden_size], (h_n, c_n)).
class LSTM : public RNNBase {
 public:
  LSTM(int64_t input_size, int64_t hidden_size, int64_t num_layers = 1, bool bias = true,
       bool batch_first = false, double dropout = 0.0, bool bidirectional = false,
       Generator* gen = nullptr);
  // PyTorch's argument order with proj_size (0: none; else in [1, hidden_size)).
  LSTM(int64_t input_size, int64_t hidden_size, int64_t num_layers, bool bias, bool batch_first,
       double dropout, bool bidirectional, int64_t proj_size, Generator* gen = nullptr);
  std::pair<Tensor, std::pair<Tensor, Tensor>> forward(
      const Tensor& input, const std::optional<std::pair<Tensor, Tensor>>& hx);
  // The output alone (Module's single-tensor forward, for containers).
  Tensor forward(const Tensor& input) override { return forward(input, std::nullopt).first; }
  std::pair<Tensor, std::pair<Tensor, Tensor>> operator()(
      const Tensor& input, const std::optional<std::pair<Tensor, Tensor>>& hx = std::nullopt,
      const std::source_location& site = std::source_location::current()) {
    return call([&] { return forward(input, hx); }, site);
  }

 protected:
  TensorList step(const Tensor& gates_x, const Tensor& gates_h, const TensorList& state) override;
};

// torch.nn.GRU: as LSTM with one state, h. Returns (output, h_n).
class GRU : public RNNBase {
 public:
  GRU(int64_t input_size, int64_t hidden_size, int64_t num_layers = 1, bool bias = true,
      bool batch_first = false, double dropout = 0.0, bool bidirectional = false,
      Generator* gen = nullptr);
  std::pair<Tensor, Tensor> forward(const Tensor& input, const Tensor& hx);
  Tensor forward(const Tensor& input) override { return forward(input, Tensor()).first; }
  std::pair<Tensor, Tensor> operator()(
      const Tensor& input, const Tensor& hx = Tensor(),
      const std::source_location& site = std::source_location::current()) {
    return call([&] { return forward(input, hx); }, site);
  }

 protected:
  TensorList step(const Tensor& gates_x, const Tensor& gates_h, const TensorList& state) override;
};

}  // namespace tally::nn
