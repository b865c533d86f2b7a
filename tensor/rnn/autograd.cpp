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

}  // namespace tally
