// LSTM and GRU: parameters, checks and the layer/direction/time loop (nn/rnn.h).
#include "nn/rnn.h"

#include <fmt/format.h>

#include <cmath>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "memory/meta.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "tensor/rnn/autograd.h"

namespace tally::nn {

RNNBase::RNNBase(const char* mode, int64_t gates, int64_t input_size_, int64_t hidden_size_,
                 int64_t num_layers_, bool bias_, bool batch_first_, double dropout_,
                 bool bidirectional_, Generator* gen_, int64_t proj_size_)
    : Module(mode),
      input_size(input_size_),
      hidden_size(hidden_size_),
      num_layers(num_layers_),
      bias(bias_),
      batch_first(batch_first_),
      dropout(dropout_),
      bidirectional(bidirectional_),
      gen(gen_),
      proj_size(proj_size_),
      mode_(mode),
      gates_(gates) {
  if (input_size < 0 || hidden_size <= 0 || num_layers <= 0)
    throw std::invalid_argument(fmt::format(
        "{}: input_size must be non-negative and hidden_size and num_layers positive, got "
        "input_size={}, hidden_size={}, num_layers={}",
        mode, input_size, hidden_size, num_layers));
  if (!(dropout >= 0.0 && dropout <= 1.0))
    throw std::invalid_argument(fmt::format(
        "{}: dropout should be a number in range [0, 1] representing the probability of an "
        "element being zeroed, got {}",
        mode, dropout));
  if (proj_size < 0 || proj_size >= hidden_size)
    throw std::invalid_argument(fmt::format(
        "{}: proj_size has to be a positive integer smaller than hidden_size (or 0), got "
        "proj_size={}, hidden_size={}",
        mode, proj_size, hidden_size));
  const int64_t D = bidirectional ? 2 : 1;
  const int64_t h_size = real_hidden_size();
  for (int64_t l = 0; l < num_layers; ++l)
    for (int64_t d = 0; d < D; ++d) {
      const std::string sfx = fmt::format("_l{}{}", l, d == 1 ? "_reverse" : "");
      const int64_t in = l == 0 ? input_size : h_size * D;
      Cell c;
      c.w_ih = register_parameter("weight_ih" + sfx, make_parameter({gates * hidden_size, in}));
      c.w_hh = register_parameter("weight_hh" + sfx, make_parameter({gates * hidden_size, h_size}));
      if (bias) {
        c.b_ih = register_parameter("bias_ih" + sfx, make_parameter({gates * hidden_size}));
        c.b_hh = register_parameter("bias_hh" + sfx, make_parameter({gates * hidden_size}));
      }
      if (proj_size > 0)
        c.w_hr = register_parameter("weight_hr" + sfx, make_parameter({proj_size, hidden_size}));
      cells_.push_back(c);
    }
  if (!SkipInitGuard::active()) reset_parameters(gen);
}

void RNNBase::reset_parameters(Generator* g) {
  const double stdv = 1.0 / std::sqrt(static_cast<double>(hidden_size));
  for (const Tensor& p : parameters(false)) init::uniform_(p, -stdv, stdv, g);
}

std::string RNNBase::extra_repr() const {
  std::string s = fmt::format("{}, {}", input_size, hidden_size);
  if (num_layers != 1) s += fmt::format(", num_layers={}", num_layers);
  if (!bias) s += ", bias=False";
  if (batch_first) s += ", batch_first=True";
  if (dropout != 0.0) s += fmt::format(", dropout={}", dropout);
  if (bidirectional) s += ", bidirectional=True";
  if (proj_size != 0) s += fmt::format(", proj_size={}", proj_size);
  return s;
}

std::pair<Tensor, TensorList> RNNBase::run(const Tensor& input, const TensorList& state0,
                                           size_t state_count) {
  if (!input.defined() || (input.dim() != 2 && input.dim() != 3))
    throw std::invalid_argument(fmt::format(
        "{}: Expected input to be 2D or 3D, got {}", mode_,
        input.defined() ? fmt::format("{}D tensor {}", input.dim(), input.shape_string())
                        : std::string("an undefined tensor")));
  if (input.size(-1) != input_size)
    throw std::invalid_argument(fmt::format(
        "{}: input.size(-1) must be equal to input_size. Expected {}, got {} (input {})", mode_,
        input_size, input.size(-1), input.shape_string()));
  const bool batched = input.dim() == 3;
  // [T, B, I] (batch-first: [B, T, I]), the unbatched input as a batch of one.
  const Tensor in3 = batched ? input : input.unsqueeze(1);
  const bool bf = batched && batch_first;
  const int64_t T = in3.size(bf ? 1 : 0), B = in3.size(bf ? 0 : 1), D = bidirectional ? 2 : 1;
  TensorList given(state_count);  // the initial states as [L * D, B, H]; undefined: zeros
  for (size_t k = 0; k < state_count; ++k) {
    const int64_t H = k == 0 ? real_hidden_size() : hidden_size;  // h, then c
    const Shape want = batched ? Shape{num_layers * D, B, H} : Shape{num_layers * D, H};
    const Tensor s0 = k < state0.size() ? state0[k] : Tensor();
    if (!s0.defined()) continue;
    if (s0.sizes() != want)
      throw std::invalid_argument(fmt::format("{}: Expected hidden{} size {}, got {}", mode_,
                                              state_count > 1 ? (k == 0 ? "[0]" : "[1]") : "",
                                              shape_str(want), s0.shape_string()));
    given[k] = batched ? s0 : s0.unsqueeze(1);
  }
  if (T == 0)
    throw std::invalid_argument(
        fmt::format("{}: the input has no timesteps (input {})", mode_, input.shape_string()));

  // Every layer at once through cuDNN where it applies (and cuDNN takes the problem).
  if (fast_path_applies(in3, given)) {
    CudnnRnnSpec spec;
    spec.lstm = state_count == 2;
    spec.input_size = input_size;
    spec.hidden_size = hidden_size;
    spec.num_layers = num_layers;
    spec.bias = bias;
    spec.bidirectional = bidirectional;
    spec.batch_first = bf;
    TensorList weights;
    for (const Cell& c : cells_) {
      weights.push_back(c.w_ih);
      weights.push_back(c.w_hh);
      if (bias) {
        weights.push_back(c.b_ih);
        weights.push_back(c.b_hh);
      }
    }
    if (auto r = cudnn_rnn(spec, in3, given[0], state_count > 1 ? given[1] : Tensor(), weights)) {
      Tensor output = std::get<0>(*r);
      TensorList finals_out = {std::get<1>(*r)};
      if (spec.lstm) finals_out.push_back(std::get<2>(*r));
      if (!batched) {
        output = output.squeeze(1);
        for (Tensor& f : finals_out) f = f.squeeze(1);
      }
      return {output, finals_out};
    }
  }

  // [T, B, I], contiguous so each step's projection is a contiguous slice.
  const Tensor x = (bf ? in3.transpose(0, 1) : in3).contiguous();
  TensorList state(state_count);
  for (size_t k = 0; k < state_count; ++k) {
    const int64_t H = k == 0 ? real_hidden_size() : hidden_size;
    state[k] = given[k].defined()
                   ? given[k]
                   : zeros({num_layers * D, B, H},
                           TensorOptions{}.with_dtype(x.dtype()).with_device(x.device()));
  }

  TensorList finals[2];
  Tensor layer_in = x;
  for (int64_t l = 0; l < num_layers; ++l) {
    TensorList dir_out;
    for (int64_t d = 0; d < D; ++d) {
      const Cell& c = cells_[static_cast<size_t>(l * D + d)];
      // The input projection of every timestep at once; views of it feed the steps.
      const Tensor gx = linear(layer_in, c.w_ih, c.b_ih);
      TensorList gx_t = split(gx, 1, 0);
      TensorList s(state_count);
      for (size_t k = 0; k < state_count; ++k) {
        s[k] = state[k].select(0, l * D + d);
        if (s[k].dtype() != gx.dtype()) s[k] = s[k].to(gx.dtype());  // autocast's 16-bit gates
      }
      TensorList out(static_cast<size_t>(T));
      for (int64_t i = 0; i < T; ++i) {
        const int64_t t = d == 0 ? i : T - 1 - i;
        s = step(gx_t[static_cast<size_t>(t)].squeeze(0), linear(s[0], c.w_hh, c.b_hh), s);
        if (c.w_hr.defined()) s[0] = linear(s[0], c.w_hr, Tensor());
        out[static_cast<size_t>(t)] = s[0];
      }
      dir_out.push_back(stack(out, 0));
      for (size_t k = 0; k < state_count; ++k) finals[k].push_back(s[k]);
    }
    layer_in = D == 2 ? cat(dir_out, 2) : dir_out[0];
    if (dropout > 0 && is_training() && l + 1 < num_layers)
      layer_in = tally::dropout(layer_in, dropout, true, gen);
  }
  Tensor output = layer_in;
  TensorList finals_out;
  for (size_t k = 0; k < state_count; ++k) {
    Tensor f = stack(finals[k], 0);
    finals_out.push_back(batched ? f : f.squeeze(1));
  }
  if (!batched)
    output = output.squeeze(1);
  else if (batch_first)
    output = output.transpose(0, 1);
  return {output, finals_out};
}

bool RNNBase::fast_path_applies(const Tensor& x, const TensorList& state0) const {
  // CUDA, or a meta device replaying it (a dry run takes the path the run takes).
  if (memory::behaves_as(x.device()) != DeviceType::cuda || proj_size > 0) return false;
  const DType dt = x.dtype();
  if (dt != DType::float32 && dt != DType::float16 && dt != DType::bfloat16) return false;
  if (dropout > 0 && is_training() && num_layers > 1) return false;  // no cuDNN dropout here
  if (is_autocast_enabled(DeviceType::cuda)) return false;
  for (const Tensor& s : state0)
    if (s.defined() && (s.dtype() != dt || s.device() != x.device())) return false;
  for (const Cell& c : cells_)
    for (const Tensor* p : {&c.w_ih, &c.w_hh, &c.b_ih, &c.b_hh})
      if (p->defined() && (p->dtype() != dt || p->device() != x.device())) return false;
  return true;
}

LSTM::LSTM(int64_t input_size, int64_t hidden_size, int64_t num_layers, bool bias, bool batch_first,
           double dropout, bool bidirectional, Generator* gen)
    : LSTM(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, 0, gen) {
}

LSTM::LSTM(int64_t input_size, int64_t hidden_size, int64_t num_layers, bool bias, bool batch_first,
           double dropout, bool bidirectional, int64_t proj_size, Generator* gen)
    : RNNBase("LSTM", 4, input_size, hidden_size, num_layers, bias, batch_first, dropout,
              bidirectional, gen, proj_size) {}

TensorList LSTM::step(const Tensor& gates_x, const Tensor& gates_h, const TensorList& state) {
  auto [h, c] = lstm_cell_gates(gates_x, gates_h, state[1]);
  return {h, c};
}

std::pair<Tensor, std::pair<Tensor, Tensor>> LSTM::forward(
    const Tensor& input, const std::optional<std::pair<Tensor, Tensor>>& hx) {
  TensorList state0;
  if (hx) {
    if (!hx->first.defined() || !hx->second.defined())
      throw std::invalid_argument("LSTM: hx must be (h_0, c_0), both defined");
    state0 = {hx->first, hx->second};
  }
  auto [out, finals] = run(input, state0, 2);
  return {out, {finals[0], finals[1]}};
}

GRU::GRU(int64_t input_size, int64_t hidden_size, int64_t num_layers, bool bias, bool batch_first,
         double dropout, bool bidirectional, Generator* gen)
    : RNNBase("GRU", 3, input_size, hidden_size, num_layers, bias, batch_first, dropout,
              bidirectional, gen) {}

TensorList GRU::step(const Tensor& gates_x, const Tensor& gates_h, const TensorList& state) {
  return {gru_cell_gates(gates_x, gates_h, state[0])};
}

std::pair<Tensor, Tensor> GRU::forward(const Tensor& input, const Tensor& hx) {
  auto [out, finals] = run(input, hx.defined() ? TensorList{hx} : TensorList{}, 1);
  return {out, finals[0]};
}

}  // namespace tally::nn
