// Differentiable recurrent cells: forward, what is saved, and backward. Both gate inputs of
// the LSTM cell get one gradient tensor (their sum feeds the gates); the GRU's differ in the
// n gate, whose hidden part is scaled by r.
#include "tensor/rnn/autograd.h"

#include "autograd/node.h"
#include "memory/context.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

std::pair<Tensor, Tensor> lstm_cell_gates(const Tensor& gates_x, const Tensor& gates_h,
                                          const Tensor& c_prev, CallSite site) {
  memory::CallSiteScope call_site(site);
  auto [h, c, ws] = o::lstm_cell_gates(gates_x, gates_h, c_prev);
  if (!autograd::needs_grad({gates_x, gates_h, c_prev})) return {h, c};
  record("LstmCellGatesBackward", {gates_x, gates_h, c_prev}, {h, c}, {c_prev, c, ws},
         [](BackwardContext& ctx, const TensorList& g) -> TensorList {
           auto [grad_gates, grad_c_prev] =
               o::lstm_cell_gates_backward(g[0], g[1], ctx.saved(0), ctx.saved(1), ctx.saved(2));
           return {grad_gates, grad_gates, grad_c_prev};
         });
  return {h, c};
}

Tensor gru_cell_gates(const Tensor& gates_x, const Tensor& gates_h, const Tensor& h_prev,
                      CallSite site) {
  memory::CallSiteScope call_site(site);
  auto [h, ws] = o::gru_cell_gates(gates_x, gates_h, h_prev);
  if (!autograd::needs_grad({gates_x, gates_h, h_prev})) return h;
  record("GruCellGatesBackward", {gates_x, gates_h, h_prev}, {h}, {h_prev, ws},
         [](BackwardContext& ctx, const TensorList& g) -> TensorList {
           auto [gx, gh, gh_prev] = o::gru_cell_gates_backward(g[0], ctx.saved(0), ctx.saved(1));
           return {gx, gh, gh_prev};
         });
  return h;
}

std::optional<std::tuple<Tensor, Tensor, Tensor>> cudnn_rnn(const CudnnRnnSpec& spec_in,
                                                            const Tensor& x, const Tensor& h0,
                                                            const Tensor& c0,
                                                            const TensorList& weights,
                                                            CallSite site) {
  memory::CallSiteScope call_site(site);
  TensorList inputs = {x, h0, c0};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  CudnnRnnSpec spec = spec_in;
  spec.training = autograd::needs_grad(inputs);
  CudnnRnnOutputs out;
  if (!o::cudnn_rnn(spec, x, h0, c0, weights, &out)) return std::nullopt;
  if (spec.training) {
    // The raw op ran on contiguous copies where an input was not; the backward reads the
    // tensors as the forward did (the parameters and states are contiguous in practice).
    auto dense = [](const Tensor& t) { return t.defined() ? o::contiguous(t) : t; };
    TensorList saved = {dense(x), dense(h0), spec.lstm ? dense(c0) : Tensor(), out.output,
                        out.reserve};
    for (const Tensor& t : weights) saved.push_back(dense(t));
    const TensorList outputs =
        spec.lstm ? TensorList{out.output, out.h_n, out.c_n} : TensorList{out.output, out.h_n};
    record("CudnnRnnBackward0", inputs, outputs, saved,
           [spec, n = weights.size()](BackwardContext& ctx, const TensorList& g) -> TensorList {
             TensorList ws;
             for (size_t i = 0; i < n; ++i) ws.push_back(ctx.saved(5 + i));
             auto grad = [&g](size_t i) { return i < g.size() ? g[i] : Tensor(); };
             CudnnRnnGrads r =
                 o::cudnn_rnn_backward(spec, ctx.saved(0), ctx.saved(1), ctx.saved(2), ws,
                                       ctx.saved(3), ctx.saved(4), grad(0), grad(1), grad(2));
             TensorList result = {r.dx, r.dh0, r.dc0};
             result.insert(result.end(), r.dweights.begin(), r.dweights.end());
             return result;
           });
  }
  return std::make_tuple(out.output, out.h_n, out.c_n);
}

}  // namespace tally
