// Raw softmax-family ops (namespace tally::ops, no autograd): softmax and log_softmax along
// any dim with their backwards (from the saved output only), the fused cross_entropy
// (log-softmax + negative log-likelihood + label smoothing + reduction in one op, whose
// backward recomputes the softmax from the logits, as llm.c's fused classifier), and
// nll_loss with its backward. Also LossReduction, PyTorch's reduction="none"|"mean"|"sum".
// The differentiable versions live in tensor/softmax/autograd.h.
//
// Dtypes: the four floating types; math runs in acc_t (float for float16/bfloat16), loss
// sums over rows in double; outputs keep the input's dtype. Targets are int64 class indices.
#pragma once

#include <optional>
#include <string>

#include "tensor/elementwise/ops.h"

namespace tally::ops {

// softmax(x)_i = exp(x_i - max) / sum_j exp(x_j - max) along `dim` (negative counts from
// the end; a 0-D x takes 0 or -1); log_softmax(x)_i = x_i - max - log(sum_j exp(x_j - max)).
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
// Gradients w.r.t. x from the forward's output y alone:
//   softmax:      g * y - y * sum(g * y)       log_softmax:  g - exp(y) * sum(g)
// (sums along `dim`). grad has y's shape; the result has y's dtype.
Tensor softmax_backward(const Tensor& grad, const Tensor& y, int64_t dim);
Tensor log_softmax_backward(const Tensor& grad, const Tensor& y, int64_t dim);

// How a loss reduces its per-element values: keep them, average over the counted
// (non-ignored) elements, or add them up.
enum class LossReduction : uint8_t { none, mean, sum };
// "none" | "mean" | "sum"; anything else throws std::invalid_argument naming `op`.
LossReduction parse_loss_reduction(const std::string& reduction, const char* op);
const char* loss_reduction_name(LossReduction r);

// PyTorch's cross_entropy with class-index targets, fused. Shapes: input [N, C] with
// target [N]; input [N, C, d1, ...] with target [N, d1, ...] (classes along dim 1); or an
// unbatched input [C] with a 0-D target. Per element (row r, target t = target[r]):
//   loss_r = (1 - eps) * (lse_r - x_r[t]) + (eps / C) * sum_c (lse_r - x_r[c])
// with lse_r = log(sum_c exp(x_r[c])), eps = label_smoothing in [0, 1]; a row whose target
// equals ignore_index has loss 0 and is not counted. Reduction none returns the per-element
// losses (target's shape), sum their sum (0-D), mean their sum divided by the number of
// counted rows (NaN when every row is ignored). A target outside [0, C) that is not
// ignore_index throws std::out_of_range naming the value and C.
Tensor cross_entropy(const Tensor& input, const Tensor& target, int64_t ignore_index = -100,
                     double label_smoothing = 0.0, LossReduction reduction = LossReduction::mean);
// cross_entropy that also returns each row's log-sum-exp, the one statistic its backward
// needs: lse has the target's shape, float32 (float64 for float64 input), 0 for an ignored
// row. loss_dtype: the loss's dtype, input's by default; float32 is allowed for float16 /
// bfloat16 logits (autocast: PyTorch's log_softmax(dtype=float32) + nll_loss, without a
// float32 copy of the logits).
struct CrossEntropyOutput {
  Tensor loss;
  Tensor lse;
};
CrossEntropyOutput cross_entropy_with_lse(const Tensor& input, const Tensor& target,
                                          int64_t ignore_index = -100, double label_smoothing = 0.0,
                                          LossReduction reduction = LossReduction::mean,
                                          std::optional<DType> loss_dtype = std::nullopt);
// d(cross_entropy)/d(input):
//   grad_r[c] = (p_r[c] - (1 - eps) * [c == t] - eps / C) * g_r
// g_r = grad[r] (none), grad (sum) or grad / count (mean); ignored rows get 0. The softmax p
// is exp(x - lse) with the forward's lse (one read of the logits), or recomputed from
// `input` when lse is undefined (a statistics pass first).
// `out`, when defined, receives the gradient instead of a new tensor and is returned: input's
// shape, dtype and device, any strides (say the first C columns of a padded [N, Cp] buffer;
// nothing outside the view is written). It must not share storage with input, except that
// with the forward's lse it may be input itself (the same view: same data pointer and
// strides), overwriting the logits in place (each element is read before it is written, by
// the same thread on CUDA). Errors name cross_entropy_backward and the shapes.
Tensor cross_entropy_backward(const Tensor& grad, const Tensor& input, const Tensor& target,
                              int64_t ignore_index, double label_smoothing, LossReduction reduction,
                              const Tensor& lse = Tensor(), const Tensor& out = Tensor());

// cross_entropy_with_lse and cross_entropy_backward in one call, for a gradient known at the
// forward (the fused classifier, which forms its inputs' gradients chunk by chunk in the
// forward): the loss and lse as cross_entropy_with_lse's, and d(loss)/d(input) for the
// incoming gradient `grad` as cross_entropy_backward's (same arguments, same `out` rules: out
// may be input itself, overwriting the logits in place; undefined: a new tensor). On CUDA,
// rows of contiguous, 16-byte aligned classes with a 0-D grad (reductions sum and mean, no
// label smoothing, 16-bit or float32 logits) take one kernel that reads each row once into
// shared memory and writes its gradient from there: one read and one write of the logits
// instead of two reads and a write. Other layouts run the two kernels. Errors name
// cross_entropy_and_backward and the shapes.
struct CrossEntropyAndGrad {
  Tensor loss;
  Tensor lse;
  Tensor grad_input;
};
CrossEntropyAndGrad cross_entropy_and_backward(const Tensor& input, const Tensor& target,
                                               const Tensor& grad, int64_t ignore_index = -100,
                                               double label_smoothing = 0.0,
                                               LossReduction reduction = LossReduction::mean,
                                               std::optional<DType> loss_dtype = std::nullopt,
                                               const Tensor& out = Tensor());

// PyTorch's nll_loss: loss_r = -input_r[target_r] over log-probabilities `input`, with
// cross_entropy's shapes, ignore_index, reduction and out-of-range error.
Tensor nll_loss(const Tensor& input, const Tensor& target, int64_t ignore_index = -100,
                LossReduction reduction = LossReduction::mean);
// d(nll_loss)/d(input): zeros of `input_sizes` (grad's dtype) with -g_r at [r, target_r].
Tensor nll_loss_backward(const Tensor& grad, const Shape& input_sizes, const Tensor& target,
                         int64_t ignore_index, LossReduction reduction);

}  // namespace tally::ops
