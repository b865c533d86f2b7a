// The differentiable softmax family (namespace tally): softmax, log_softmax, cross_entropy
// (one fused op: it saves the logits, the targets and each row's log-sum-exp, and its
// backward recomputes the softmax from them in one read of the logits) and nll_loss. Built
// from the raw ops of tensor/softmax/ops.h.
#pragma once

#include <string>

#include "autograd/ops.h"
#include "tensor/softmax/ops.h"

namespace tally {

// Along `dim` (negative counts from the end). Both save only their output for backward.
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

// torch.nn.functional.cross_entropy with class-index targets: input [N, C] and target [N],
// input [N, C, d1, ...] and target [N, d1, ...], or input [C] and a 0-D target; target
// int64. reduction "mean" (over non-ignored targets) | "sum" | "none"; label_smoothing in
// [0, 1] mixes (1 - eps) one-hot with eps / C uniform. Rows with target == ignore_index
// contribute nothing. An out-of-range target throws std::out_of_range. Under autocast,
// float16/bfloat16 input gives a float32 loss (computed in float32 from the 16-bit logits).
Tensor cross_entropy(const Tensor& input, const Tensor& target, int64_t ignore_index = -100,
                     double label_smoothing = 0.0, const std::string& reduction = "mean");
// The same in PyTorch's positional order (..., ignore_index, reduction, label_smoothing).
Tensor cross_entropy(const Tensor& input, const Tensor& target, int64_t ignore_index,
                     const std::string& reduction, double label_smoothing = 0.0);

// torch.nn.functional.nll_loss over log-probabilities, cross_entropy's shapes and rules.
// Saves only the target.
Tensor nll_loss(const Tensor& input, const Tensor& target, int64_t ignore_index = -100,
                const std::string& reduction = "mean");

}  // namespace tally
