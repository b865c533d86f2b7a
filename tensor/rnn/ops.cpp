// Raw recurrent-cell ops: argument checks (every message names the op, the shapes and the
// dtypes), allocation, and the dispatch into the device's kernel.
#include "tensor/rnn/ops.h"

#include <fmt/format.h>

#include "memory/meta.h"
#include "tensor/dispatch.h"
#include "tensor/op_alloc.h"
#include "tensor/rnn/kernels.h"

namespace tally::ops {

namespace {

// Checks that `t` is a defined 2-D [rows, cols] tensor of `like`'s dtype and device.
void check_2d(const char* op, const char* name, const Tensor& t, int64_t rows, int64_t cols,
              const Tensor& like) {
  if (!t.defined()) throw std::invalid_argument(fmt::format("{}: {} is undefined", op, name));
  if (t.dim() != 2 || t.size(0) != rows || t.size(1) != cols)
    throw std::invalid_argument(
        fmt::format("{}: {} must be [{}, {}], got {}", op, name, rows, cols, t.shape_string()));
  if (t.dtype() != like.dtype())
    throw std::invalid_argument(fmt::format("{}: {} is {} but the gates are {}", op, name,
                                            dtype_name(t.dtype()), dtype_name(like.dtype())));
  check_same_device(op, like.device(), t.device());
}

// The hidden size of [B, k * H] gates (k = 4 for the LSTM, 3 for the GRU), checked floating.
int64_t hidden_of(const char* op, const Tensor& gates, int64_t k) {
  if (!gates.defined()) throw std::invalid_argument(fmt::format("{}: gates are undefined", op));
  if (gates.dim() != 2 || gates.size(1) % k != 0)
    throw std::invalid_argument(fmt::format("{}: gates must be 2-D [batch, {} * hidden], got {}",
                                            op, k, gates.shape_string()));
  if (!is_floating(gates.dtype()))
    throw std::invalid_argument(
        fmt::format("{}: gates must be floating, got {}", op, dtype_name(gates.dtype())));
  return gates.size(1) / k;
}

// The hidden size of a cell's forward: gates_x [B, k * H], gates_h [B, k * H] and the previous
// state `prev` [B, H], all of gates_x's dtype and device.
int64_t cell_hidden(const char* op, const Tensor& gates_x, const Tensor& gates_h, int64_t k,
                    const char* prev_name, const Tensor& prev) {
  const int64_t H = hidden_of(op, gates_x, k), B = gates_x.size(0);
  check_2d(op, "gates_h", gates_h, B, k * H, gates_x);
  check_2d(op, prev_name, prev, B, H, gates_x);
  return H;
}

// An optional gradient, checked like check_2d and made contiguous (undefined stays so).
Tensor optional_grad(const char* op, const char* name, const Tensor& g, int64_t rows, int64_t cols,
                     const Tensor& like) {
  if (!g.defined()) return g;
  check_2d(op, name, g, rows, cols, like);
  return contiguous(g);
}

// The arguments of the whole-layer op: x [T, B, I] (batch-first [B, T, I]) floating, the
// states [L * D, B, H] and the weights of every cell, all of x's dtype and device.
void check_cudnn_rnn(const char* op, const CudnnRnnSpec& s, const Tensor& x, const Tensor& h0,
                     const Tensor& c0, const TensorList& weights) {
  if (s.input_size <= 0 || s.hidden_size <= 0 || s.num_layers <= 0)
    throw std::invalid_argument(
        fmt::format("{}: input_size, hidden_size and num_layers must be positive, got {}, {}, {}",
                    op, s.input_size, s.hidden_size, s.num_layers));
  if (!x.defined() || x.dim() != 3 || x.size(2) != s.input_size)
    throw std::invalid_argument(fmt::format("{}: x must be [{}, input_size={}], got {}", op,
                                            s.batch_first ? "B, T" : "T, B", s.input_size,
                                            x.defined() ? x.shape_string() : "undefined"));
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(
        fmt::format("{}: x must be floating, got {}", op, dtype_name(x.dtype())));
  const int64_t D = s.directions(), H = s.hidden_size, G = s.lstm ? 4 : 3;
  const int64_t B = x.size(s.batch_first ? 0 : 1);
  auto same = [&](const char* name, const Tensor& t, const Shape& want) {
    if (t.sizes() != want)
      throw std::invalid_argument(
          fmt::format("{}: {} must be {}, got {}", op, name, shape_str(want), t.shape_string()));
    if (t.dtype() != x.dtype())
      throw std::invalid_argument(fmt::format("{}: {} is {} but x is {}", op, name,
                                              dtype_name(t.dtype()), dtype_name(x.dtype())));
    check_same_device(op, x.device(), t.device());
  };
  if (!s.lstm && c0.defined()) throw std::invalid_argument(fmt::format("{}: a GRU has no c0", op));
  if (h0.defined()) same("h0", h0, {s.num_layers * D, B, H});
  if (c0.defined()) same("c0", c0, {s.num_layers * D, B, H});
  const int64_t per = s.tensors_per_cell();
  if (static_cast<int64_t>(weights.size()) != s.num_layers * D * per)
    throw std::invalid_argument(
        fmt::format("{}: expected {} weights ({} layers x {} directions x {}), got {}", op,
                    s.num_layers * D * per, s.num_layers, D, per, weights.size()));
  static const char* const kNames[] = {"w_ih", "w_hh", "b_ih", "b_hh"};
  for (int64_t cell = 0; cell < s.num_layers * D; ++cell) {
    const int64_t in = cell < D ? s.input_size : D * H;
    const Shape want[] = {{G * H, in}, {G * H, H}, {G * H}, {G * H}};
    for (int64_t k = 0; k < per; ++k) {
      const Tensor& w = weights[static_cast<size_t>(cell * per + k)];
      const std::string name = fmt::format("{} of cell {}", kNames[k], cell);
      if (!w.defined()) throw std::invalid_argument(fmt::format("{}: {} is undefined", op, name));
      same(name.c_str(), w, want[k]);
    }
  }
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> lstm_cell_gates(const Tensor& gates_x, const Tensor& gates_h,
                                                   const Tensor& c_prev) {
  static const OpInfo info("lstm_cell_gates");
  DispatchScope scope(info, gates_x, gates_h, c_prev);
  const int64_t H = cell_hidden(info.name, gates_x, gates_h, 4, "c_prev", c_prev);
  const int64_t B = gates_x.size(0);
  const Tensor gx = contiguous(gates_x), gh = contiguous(gates_h), cp = contiguous(c_prev);
  const Device dev = gates_x.device();
  Tensor h = alloc_output({B, H}, gates_x.dtype(), dev);
  Tensor c = alloc_output({B, H}, gates_x.dtype(), dev);
  Tensor ws = alloc_output({B, 4 * H}, gates_x.dtype(), dev);
  if (B * H > 0) rnn_backends.get(info, dev, &RnnKernels::lstm_cell_forward)(h, c, ws, gx, gh, cp);
  return {h, c, ws};
}

std::pair<Tensor, Tensor> lstm_cell_gates_backward(const Tensor& grad_h, const Tensor& grad_c,
                                                   const Tensor& c_prev, const Tensor& c,
                                                   const Tensor& workspace) {
  static const OpInfo info("lstm_cell_gates_backward");
  DispatchScope scope(info, workspace, grad_h, grad_c, c_prev, c);
  const int64_t H = hidden_of(info.name, workspace, 4), B = workspace.size(0);
  check_2d(info.name, "c_prev", c_prev, B, H, workspace);
  check_2d(info.name, "c", c, B, H, workspace);
  const Tensor gh = optional_grad(info.name, "grad_h", grad_h, B, H, workspace);
  const Tensor gc = optional_grad(info.name, "grad_c", grad_c, B, H, workspace);
  const Device dev = workspace.device();
  Tensor grad_gates = alloc_output({B, 4 * H}, workspace.dtype(), dev);
  Tensor grad_c_prev = alloc_output({B, H}, workspace.dtype(), dev);
  if (B * H > 0)
    rnn_backends.get(info, dev, &RnnKernels::lstm_cell_backward)(
        grad_gates, grad_c_prev, gh, gc, contiguous(c_prev), contiguous(c), contiguous(workspace));
  return {grad_gates, grad_c_prev};
}

std::pair<Tensor, Tensor> gru_cell_gates(const Tensor& gates_x, const Tensor& gates_h,
                                         const Tensor& h_prev) {
  static const OpInfo info("gru_cell_gates");
  DispatchScope scope(info, gates_x, gates_h, h_prev);
  const int64_t H = cell_hidden(info.name, gates_x, gates_h, 3, "h_prev", h_prev);
  const int64_t B = gates_x.size(0);
  const Device dev = gates_x.device();
  Tensor h = alloc_output({B, H}, gates_x.dtype(), dev);
  Tensor ws = alloc_output({B, 4 * H}, gates_x.dtype(), dev);
  if (B * H > 0)
    rnn_backends.get(info, dev, &RnnKernels::gru_cell_forward)(
        h, ws, contiguous(gates_x), contiguous(gates_h), contiguous(h_prev));
  return {h, ws};
}

std::tuple<Tensor, Tensor, Tensor> gru_cell_gates_backward(const Tensor& grad_h,
                                                           const Tensor& h_prev,
                                                           const Tensor& workspace) {
  static const OpInfo info("gru_cell_gates_backward");
  DispatchScope scope(info, workspace, grad_h, h_prev);
  const int64_t H = hidden_of(info.name, workspace, 4), B = workspace.size(0);
  check_2d(info.name, "h_prev", h_prev, B, H, workspace);
  const Tensor gh = optional_grad(info.name, "grad_h", grad_h, B, H, workspace);
  const Device dev = workspace.device();
  Tensor gx = alloc_output({B, 3 * H}, workspace.dtype(), dev);
  Tensor ghh = alloc_output({B, 3 * H}, workspace.dtype(), dev);
  Tensor gh_prev = alloc_output({B, H}, workspace.dtype(), dev);
  if (B * H > 0)
    rnn_backends.get(info, dev, &RnnKernels::gru_cell_backward)(
        gx, ghh, gh_prev, gh, contiguous(h_prev), contiguous(workspace));
  return {gx, ghh, gh_prev};
}

bool cudnn_rnn(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0, const Tensor& c0,
               const TensorList& weights, CudnnRnnOutputs* out) {
  static const OpInfo info("cudnn_rnn");
  *out = {};
  check_cudnn_rnn(info.name, spec, x, h0, c0, weights);
  // CUDA, or a meta device replaying it (tensor/rnn/meta.cpp); the CPU has no such kernel.
  if (memory::behaves_as(x.device()) != DeviceType::cuda) return false;
  DispatchScope scope(info, x, h0, c0);
  auto dense = [](const Tensor& t) { return t.defined() ? contiguous(t) : t; };
  TensorList w;
  for (const Tensor& t : weights) w.push_back(dense(t));
  rnn_backends.get(info, x.device(), &RnnKernels::cudnn_rnn_forward)(
      spec, dense(x), dense(h0), spec.lstm ? dense(c0) : Tensor(), w, out);
  return out->taken;
}

CudnnRnnGrads cudnn_rnn_backward(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0,
                                 const Tensor& c0, const TensorList& weights, const Tensor& output,
                                 const Tensor& reserve, const Tensor& grad_output,
                                 const Tensor& grad_h_n, const Tensor& grad_c_n) {
  static const OpInfo info("cudnn_rnn_backward");
  DispatchScope scope(info, x, grad_output, grad_h_n, grad_c_n);
  auto dense = [](const Tensor& t) { return t.defined() ? contiguous(t) : t; };
  CudnnRnnGrads grads;
  rnn_backends.get(info, x.device(), &RnnKernels::cudnn_rnn_backward)(
      spec, x, h0, c0, weights, output, reserve, dense(grad_output), dense(grad_h_n),
      spec.lstm ? dense(grad_c_n) : Tensor(), &grads);
  return grads;
}

}  // namespace tally::ops
