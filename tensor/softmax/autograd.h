// The differentiable softmax family (namespace tally): softmax, log_softmax, cross_entropy
// (one fused op: it saves the logits, the targets and each row's log-sum-exp, and its
// backward recomputes the softmax from them in one read of the logits), nll_loss, and
// linear_cross_entropy (a classifier's last linear layer and cross_entropy in one op that
// never holds the whole logits). Built from the raw ops of tensor/softmax/ops.h and
// tensor/linalg/ops.h.
#pragma once

#include <cstdint>
#include <string>

#include "tensor/elementwise/autograd.h"
#include "tensor/softmax/ops.h"

namespace tally {

// Along `dim` (negative counts from the end). Both save only their output for backward.
Tensor softmax(const Tensor& x, int64_t dim, CallSite site = CallSite::current());
Tensor log_softmax(const Tensor& x, int64_t dim, CallSite site = CallSite::current());

// torch.nn.functional.cross_entropy with class-index targets: input [N, C] and target [N],
// input [N, C, d1, ...] and target [N, d1, ...], or input [C] and a 0-D target; target
// int64. reduction "mean" (over non-ignored targets) | "sum" | "none"; label_smoothing in
// [0, 1] mixes (1 - eps) one-hot with eps / C uniform. Rows with target == ignore_index
// contribute nothing. An out-of-range target throws std::out_of_range. Under autocast,
// float16/bfloat16 input gives a float32 loss (computed in float32 from the 16-bit logits).
Tensor cross_entropy(const Tensor& input, const Tensor& target, int64_t ignore_index = -100,
                     double label_smoothing = 0.0, const std::string& reduction = "mean",
                     CallSite site = CallSite::current());
// The same in PyTorch's positional order (..., ignore_index, reduction, label_smoothing).
Tensor cross_entropy(const Tensor& input, const Tensor& target, int64_t ignore_index,
                     const std::string& reduction, double label_smoothing = 0.0,
                     CallSite site = CallSite::current());

// torch.nn.functional.nll_loss over log-probabilities, cross_entropy's shapes and rules.
// Saves only the target.
Tensor nll_loss(const Tensor& input, const Tensor& target, int64_t ignore_index = -100,
                const std::string& reduction = "mean", CallSite site = CallSite::current());

// linear_cross_entropy's default budget for the [rows, Vp] buffer of one chunk (below).
inline constexpr int64_t kLinearCrossEntropyChunkBytes = int64_t{256} << 20;  // 256 MiB

// cross_entropy(linear(hidden, weight), target, ignore_index, reduction) without the [N, V]
// logits: hidden [N, C], weight [V, C] (nn.Linear layout, no bias), target [N] int64;
// reduction "mean" (over the targets that are not ignore_index; NaN when all are) or "sum"
// ("none" is not supported: the per-row losses' gradient cannot be formed from what is
// saved). Returns the 0-D loss. Equal to the unfused pair up to rounding: the loss sums chunk
// by chunk, and the weight's gradient sums the chunks' products.
// How (chunks, the [rows, Vp] buffer, the chunk size), dtypes and errors: docs/notes.md §2.
Tensor linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                            int64_t ignore_index = -100, const std::string& reduction = "mean",
                            int64_t chunk_rows = 0,
                            int64_t max_chunk_bytes = kLinearCrossEntropyChunkBytes,
                            CallSite site = CallSite::current());

// The chunk size linear_cross_entropy uses for N rows of a V-class classifier whose logits
// have `element_size` bytes an element (the rule above). Throws std::invalid_argument for
// chunk_rows < 0 or max_chunk_bytes <= 0.
int64_t linear_cross_entropy_chunk_rows(int64_t N, int64_t V, int64_t element_size,
                                        int64_t chunk_rows = 0,
                                        int64_t max_chunk_bytes = kLinearCrossEntropyChunkBytes);

}  // namespace tally
