// Differentiable softmax family: forward, what is saved, and backward, one function each.
// softmax/log_softmax save their output; cross_entropy saves the logits, the targets and
// each row's log-sum-exp (never the softmax: its backward recomputes it from one read of
// the logits, the fused classifier of llm.c);
// nll_loss saves the targets only.
#include "tensor/softmax/autograd.h"

#include "autograd/autocast.h"
#include "autograd/node.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

// softmax and log_softmax: float32 under autocast; the backward reads the output.
Tensor softmax_op(const char* name, const char* backward_name,
                  Tensor (*forward)(const Tensor&, int64_t),
                  Tensor (*backward)(const Tensor&, const Tensor&, int64_t), const Tensor& x_,
                  int64_t dim) {
  const auto [x] = autocast::fp32(name, x_);
  Tensor out = forward(x, dim);
  record(backward_name, {x}, {out}, {out},
         [dim, backward](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {backward(g[0], ctx.saved(0), dim)};
         });
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  return softmax_op("softmax", "SoftmaxBackward", &o::softmax, &o::softmax_backward, x, dim);
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  return softmax_op("log_softmax", "LogSoftmaxBackward", &o::log_softmax, &o::log_softmax_backward,
                    x, dim);
}

Tensor cross_entropy(const Tensor& input_, const Tensor& target, int64_t ignore_index,
                     double label_smoothing, const std::string& reduction) {
  // Under autocast, float16/bfloat16 logits are read as they are and the loss is float32
  // (PyTorch: log_softmax(x, dtype=float32) + nll_loss), so no float32 copy of the logits is
  // made or kept; the gradient comes back in the logits' dtype. Otherwise float32 policy.
  const bool low = input_.defined() && autocast::is_active(input_.device()) &&
                   (input_.dtype() == DType::float16 || input_.dtype() == DType::bfloat16);
  const Tensor input = low ? input_ : autocast::fp32("cross_entropy", input_)[0];
  const o::LossReduction red = o::parse_loss_reduction(reduction, "cross_entropy");
  o::CrossEntropyOutput r =
      o::cross_entropy_with_lse(input, target, ignore_index, label_smoothing, red,
                                low ? std::optional<DType>(DType::float32) : std::nullopt);
  // Saved: the logits, the targets and each row's log-sum-exp (the backward reads the logits
  // once: p = exp(x - lse)).
  record("CrossEntropyBackward", {input}, {r.loss}, {input, target, r.lse},
         [ignore_index, label_smoothing, red](BackwardContext& ctx,
                                              const TensorList& g) -> TensorList {
           return {o::cross_entropy_backward(g[0], ctx.saved(0), ctx.saved(1), ignore_index,
                                             label_smoothing, red, ctx.saved(2))};
         });
  return r.loss;
}

Tensor cross_entropy(const Tensor& input, const Tensor& target, int64_t ignore_index,
                     const std::string& reduction, double label_smoothing) {
  return cross_entropy(input, target, ignore_index, label_smoothing, reduction);
}

Tensor nll_loss(const Tensor& input_, const Tensor& target, int64_t ignore_index,
                const std::string& reduction) {
  const auto [input] = autocast::fp32("nll_loss", input_);
  const o::LossReduction red = o::parse_loss_reduction(reduction, "nll_loss");
  Tensor out = o::nll_loss(input, target, ignore_index, red);
  record("NllLossBackward", {input}, {out}, {target},
         [sizes = input.sizes(), ignore_index, red](BackwardContext& ctx,
                                                    const TensorList& g) -> TensorList {
           return {o::nll_loss_backward(g[0], sizes, ctx.saved(0), ignore_index, red)};
         });
  return out;
}

}  // namespace tally
