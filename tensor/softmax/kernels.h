// The kernel table of the softmax family (softmax/log_softmax and their backwards, the fused
// cross_entropy and nll_loss with theirs): each kernel's signature, once. The CPU reference
// (tensor/softmax/cpu.cpp) and the CUDA kernels (tensor/softmax/cuda.cu) each define one
// SoftmaxKernels with the same layouts; tensor/backends.cpp registers them.
//
// Called only by the raw ops (tensor/softmax/ops.cpp), which normalise the layouts described
// here. Each CUDA launcher enqueues on Tally's stream for the tensor's device, opens an NVTX
// range and checks the launch; none synchronises with the host (the "mean" losses count
// their non-ignored targets on the device).
#pragma once

#include <cstdint>

#include "tensor/dispatch.h"
#include "tensor/softmax/ops.h"
#include "tensor/tensor.h"

namespace tally {

struct SoftmaxKernels {
  // out (x's shape and dtype) <- softmax (or log_softmax when `log`) of x along dim.
  void (*softmax)(const Tensor& out, const Tensor& x, int64_t dim, bool log);
  // grad_input <- the gradient w.r.t. x from grad and the forward output y (all one shape
  // and dtype).
  void (*softmax_backward)(const Tensor& grad_input, const Tensor& grad, const Tensor& y,
                           int64_t dim, bool log);

  // The loss kernels see input [N, C, S...] (rank >= 2, classes along dim 1) and target
  // [N, 1, S...] (int64). `out` is the per-row loss [N, 1, S...] for reduction none and 0-D
  // otherwise, in input's dtype (cross_entropy: or float32 for float16/bfloat16 input, as
  // under autocast). A target outside [0, C) that is not ignore_index throws
  // std::out_of_range("target T is out of bounds for C classes").
  // Difference of the CUDA kernels from the CPU: such a target cannot throw without reading
  // the targets back. On the device such a row gets a NaN loss (and counts towards "mean",
  // so the mean is NaN too), and cross_entropy_backward writes NaN across its gradient row;
  // nll_loss_backward writes NaN across that row of grad_input.
  //
  // cross_entropy's `lse`, when defined ([N, 1, S...], float32; float64 for float64 input),
  // receives each row's log-sum-exp (0 for an ignored row).
  void (*cross_entropy)(const Tensor& out, const Tensor& lse, const Tensor& input,
                        const Tensor& target, int64_t ignore_index, double label_smoothing,
                        ops::LossReduction reduction);
  // grad_input (input's shape and dtype) <- d(loss)/d(input); grad is [N, 1, S...] (none) or
  // 0-D, in input's dtype. With the forward's lse the softmax is exp(x - lse) (no statistics
  // pass over the row); undefined: recomputed.
  void (*cross_entropy_backward)(const Tensor& grad_input, const Tensor& grad, const Tensor& input,
                                 const Tensor& target, const Tensor& lse, int64_t ignore_index,
                                 double label_smoothing, ops::LossReduction reduction);
  // cross_entropy (out, lse: both defined) then cross_entropy_backward (grad_input, grad, with
  // that lse) in one call; grad_input may be input itself (in place). The CUDA kernel fuses
  // the two for contiguous aligned rows (see ops::cross_entropy_and_backward).
  void (*cross_entropy_and_backward)(const Tensor& out, const Tensor& lse, const Tensor& grad_input,
                                     const Tensor& grad, const Tensor& input, const Tensor& target,
                                     int64_t ignore_index, double label_smoothing,
                                     ops::LossReduction reduction);
  void (*nll_loss)(const Tensor& out, const Tensor& input, const Tensor& target,
                   int64_t ignore_index, ops::LossReduction reduction);
  // grad_input (zero-filled by the caller, grad's dtype) <- -g at each [r, target_r].
  void (*nll_loss_backward)(const Tensor& grad_input, const Tensor& grad, const Tensor& target,
                            int64_t ignore_index, ops::LossReduction reduction);
};

// cpu::softmax_kernels (tensor/softmax/cpu.cpp), cuda::softmax_kernels (tensor/softmax/cuda.cu),
// softmax_backends (tensor/backends.cpp).
TALLY_DECLARE_KERNELS(SoftmaxKernels, softmax_kernels, softmax_backends);

// The table's entries in member order, each the backend's kernel of the member's name: each
// backend defines its table as `const SoftmaxKernels softmax_kernels{TALLY_SOFTMAX_KERNELS};`, so
// the list of kernels is written once.
#define TALLY_SOFTMAX_KERNELS                                                                  \
  .softmax = &softmax, .softmax_backward = &softmax_backward, .cross_entropy = &cross_entropy, \
  .cross_entropy_backward = &cross_entropy_backward,                                           \
  .cross_entropy_and_backward = &cross_entropy_and_backward, .nll_loss = &nll_loss,            \
  .nll_loss_backward = &nll_loss_backward

}  // namespace tally
