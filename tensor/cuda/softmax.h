// CUDA kernels of the softmax family, twins of tensor/cpu/softmax.h with the same signatures
// and layouts (see there). Each launcher enqueues on Tally's stream for the tensor's device,
// opens an NVTX range and checks the launch; none synchronises with the host (the "mean"
// losses count their non-ignored targets on the device).
//
// Difference from the CPU: a target outside [0, C) that is not ignore_index cannot throw
// without reading the targets back. On the device such a row gets a NaN loss (and counts
// towards "mean", so the mean is NaN too), and cross_entropy_backward writes NaN across
// its gradient row; nll_loss_backward writes NaN across that row of grad_input.
#pragma once

#include "tensor/ops/softmax.h"

namespace tally::cuda {

void softmax(const Tensor& out, const Tensor& x, int64_t dim, bool log);
void softmax_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& y, int64_t dim,
                      bool log);
void cross_entropy(const Tensor& out, const Tensor& lse, const Tensor& input,
                   const Tensor& target, int64_t ignore_index, double label_smoothing,
                   ops::LossReduction reduction);
void cross_entropy_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& input,
                            const Tensor& target, const Tensor& lse, int64_t ignore_index,
                            double label_smoothing, ops::LossReduction reduction);
void nll_loss(const Tensor& out, const Tensor& input, const Tensor& target, int64_t ignore_index,
              ops::LossReduction reduction);
void nll_loss_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& target,
                       int64_t ignore_index, ops::LossReduction reduction);

}  // namespace tally::cuda
