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
//
// How (llm.c's fused classifier, chunked): the rows go in chunks of `chunk_rows`; for each,
// logits = h W^T, the chunk's loss and, when a gradient is needed, the logits' gradient
// (softmax - onehot, scaled for the reduction over all N rows), from which the chunk's
// d(hidden) = dlogits W and d(weight) += dlogits^T h are formed at once; the chunk's logits
// and their gradient are dropped before the next chunk. Saved for backward: only d(hidden)
// [N, C] and d(weight) [V, C] (each only when that input requires grad; tagged `activation`
// as all saved tensors), which the backward scales by the incoming gradient. With 16-bit
// operands d(weight) is summed in float32 and kept so when the weight's gradient goes to a
// float32 parameter (autocast's cast; autograd::grad_dtype), else rounded to the operands' dtype.
// So the gradient is computed in the forward: under no_grad, or when neither input requires grad,
// only the loss is.
//
// The chunk size: chunk_rows > 0 is taken as given (at most N). chunk_rows = 0 chooses it
// so that the chunk's one [rows, Vp] buffer (below; Vp = V rounded up to 64) fits
// max_chunk_bytes:
//   rows = max_chunk_bytes / (Vp * element_size),
// rounded down to a multiple of 64 when at least 64 (GEMM-friendly), at least 1, at most N.
// element_size is the logits' dtype's (the computation dtype below). GPT-2's V = 50257 in
// bfloat16: 2,668 rows -> 2,624 a chunk.
//
// One buffer a chunk: the logits are written into a [rows, Vp] buffer by a GEMM (Vp = V when V
// is a multiple of 64; otherwise, GPT-2's V = 50257, whose rows would not be 16-byte aligned
// so that cuBLASLt would pick slow kernels, the weight is copied once per call into a [Vp, C]
// buffer with Vp - V zero rows, so the padding columns of the logits are 0 and the
// cross-entropy sees the first V columns); the logits' gradient overwrites them in place
// (ops::cross_entropy_backward with out = the logits, given the forward's lse), and d(hidden)
// and d(weight) read it with ld = Vp. d(hidden) is written straight into its rows
// (ops::mm_out) unless the float32 mean scale applies (then a float32 product is scaled and
// rounded once); d(weight) accumulates in place over the chunks (ops::mm_out with
// accumulate; for 16-bit operands into a float32 sum, the GEMM's float32 output, so no
// [Vp, C] temporary a chunk).
//
// Dtypes: hidden and weight of one floating dtype (after autocast). Under autocast both are
// cast like linear's operands (the region's 16-bit dtype, a parameter's cast cached) and the
// loss is float32 as cross_entropy's; without autocast everything is in the inputs' dtype.
// With 16-bit operands the logits and their gradient are 16-bit (as the unfused pair's),
// the mean's scale is applied in float32, and d(weight) accumulates over the chunks in
// float32 and is rounded to the weight's dtype once.
// Errors (std::invalid_argument naming linear_cross_entropy and the shapes): ranks, C or N
// mismatch, a non-int64 target, dtypes, devices, reduction, chunk_rows < 0,
// max_chunk_bytes <= 0; a target outside [0, V) that is not ignore_index throws
// std::out_of_range (cross_entropy's check; on CUDA that row's loss is NaN instead).
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
