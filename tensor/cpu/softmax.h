// CPU kernels of the softmax family (softmax/log_softmax and their backwards, the fused
// cross_entropy and nll_loss with theirs). Called only through the dispatch point in
// tensor/softmax.cpp, which normalises the layouts described here.
#pragma once

#include "tensor/ops/softmax.h"

namespace tally::cpu {

// out (x's shape and dtype) <- softmax (or log_softmax when `log`) of x along dim.
void softmax(const Tensor& out, const Tensor& x, int64_t dim, bool log);
// grad_input <- the gradient w.r.t. x from grad and the forward output y (all one shape
// and dtype).
void softmax_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& y, int64_t dim,
                      bool log);

// The loss kernels see input [N, C, S...] (rank >= 2, classes along dim 1) and target
// [N, 1, S...] (int64). `out` is the per-row loss [N, 1, S...] for reduction none and 0-D
// otherwise, in input's dtype (cross_entropy: or float32 for float16/bfloat16 input, as under
// autocast). A target outside [0, C) that is not ignore_index throws
// std::out_of_range("target T is out of bounds for C classes").
// cross_entropy's `lse`, when defined ([N, 1, S...], float32; float64 for float64 input),
// receives each row's log-sum-exp (0 for an ignored row).
void cross_entropy(const Tensor& out, const Tensor& lse, const Tensor& input,
                   const Tensor& target, int64_t ignore_index, double label_smoothing,
                   ops::LossReduction reduction);
// grad_input (input's shape and dtype) <- d(loss)/d(input); grad is [N, 1, S...] (none) or
// 0-D, in input's dtype. With the forward's lse the softmax is exp(x - lse) (no statistics
// pass over the row); undefined: recomputed.
void cross_entropy_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& input,
                            const Tensor& target, const Tensor& lse, int64_t ignore_index,
                            double label_smoothing, ops::LossReduction reduction);
void nll_loss(const Tensor& out, const Tensor& input, const Tensor& target, int64_t ignore_index,
              ops::LossReduction reduction);
// grad_input (zero-filled by the caller, grad's dtype) <- -g at each [r, target_r].
void nll_loss_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& target,
                       int64_t ignore_index, ops::LossReduction reduction);

}  // namespace tally::cpu
