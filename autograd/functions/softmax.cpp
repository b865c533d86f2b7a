// Differentiable softmax family: forward, what is saved, and backward, one function each.
// softmax/log_softmax save their output; cross_entropy saves the logits and the targets
// (never the softmax: its backward recomputes it, the fused classifier of llm.c);
// nll_loss saves the targets only.
#include "autograd/softmax.h"

#include "autograd/autocast.h"
#include "autograd/node.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

Tensor softmax(const Tensor& x_, int64_t dim) {
  const auto [x] = autocast::fp32("softmax", x_);
  Tensor out = o::softmax(x, dim);
  record("SoftmaxBackward", {x}, {out}, {out},
         [dim](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {o::softmax_backward(g[0], ctx.saved(0), dim)};
         });
  return out;
}

Tensor log_softmax(const Tensor& x_, int64_t dim) {
  const auto [x] = autocast::fp32("log_softmax", x_);
  Tensor out = o::log_softmax(x, dim);
  record("LogSoftmaxBackward", {x}, {out}, {out},
         [dim](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {o::log_softmax_backward(g[0], ctx.saved(0), dim)};
         });
  return out;
}

Tensor cross_entropy(const Tensor& input_, const Tensor& target, int64_t ignore_index,
                     double label_smoothing, const std::string& reduction) {
  const auto [input] = autocast::fp32("cross_entropy", input_);
  const o::LossReduction red = o::parse_loss_reduction(reduction, "cross_entropy");
  Tensor out = o::cross_entropy(input, target, ignore_index, label_smoothing, red);
  record("CrossEntropyBackward", {input}, {out}, {input, target},
         [ignore_index, label_smoothing, red](BackwardContext& ctx,
                                              const TensorList& g) -> TensorList {
           return {o::cross_entropy_backward(g[0], ctx.saved(0), ctx.saved(1), ignore_index,
                                             label_smoothing, red)};
         });
  return out;
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
