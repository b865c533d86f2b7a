// Meta kernels of the softmax family (tensor/meta/target.h). The CPU kernels allocate
// nothing. The CUDA loss kernels (tensor/softmax/cuda.cu) reduce through per-row partial
// sums (2 doubles a row, and a second level of 2 a chunk of 8,192 rows past one chunk), and
// a mean's backward counts the targets into one int64.
#include "tensor/meta/target.h"
#include "tensor/softmax/kernels.h"

namespace tally::meta {

namespace {

constexpr int64_t kSumChunk = 8192;  // tensor/softmax/cuda.cu's first summing level

int64_t loss_rows(const Tensor& input) {
  return input.size(1) == 0 ? 0 : input.numel() / input.size(1);
}

// The forward's partial sums (reductions other than none).
void loss_partials(const Tensor& input, ops::LossReduction reduction) {
  if (!replays_cuda(input) || reduction == ops::LossReduction::none) return;
  const int64_t nrows = loss_rows(input);
  const Tensor partial = alloc_scratch(2 * nrows, DType::float64, input.device());
  if (nrows > kSumChunk)
    alloc_scratch(2 * ((nrows + kSumChunk - 1) / kSumChunk), DType::float64, input.device());
}

// The backward's target count (mean only).
void mean_count(const Tensor& like, ops::LossReduction reduction) {
  if (replays_cuda(like) && reduction == ops::LossReduction::mean)
    alloc_scratch(1, DType::int64, like.device());
}

void cross_entropy(const Tensor& out, const Tensor& lse, const Tensor& input, const Tensor& target,
                   int64_t /*ignore_index*/, double /*label_smoothing*/,
                   ops::LossReduction reduction) {
  cost(input, 0, tensor_bytes(out, lse, input, target));
  loss_partials(input, reduction);
}

void cross_entropy_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& input,
                            const Tensor& target, const Tensor& lse, int64_t /*ignore_index*/,
                            double /*label_smoothing*/, ops::LossReduction reduction) {
  cost(input, 0, tensor_bytes(grad_input, grad, input, target, lse));
  mean_count(grad_input, reduction);
}

// One read of the logits and one write of the gradient (the CUDA kernel's fused path; its
// two-kernel fallback allocates the same scratch).
void cross_entropy_and_backward(const Tensor& out, const Tensor& lse, const Tensor& grad_input,
                                const Tensor& grad, const Tensor& input, const Tensor& target,
                                int64_t /*ignore_index*/, double /*label_smoothing*/,
                                ops::LossReduction reduction) {
  cost(input, 0, tensor_bytes(out, lse, grad_input, grad, input, target));
  // The fused path holds the target count (mean) while the partials are summed.
  Tensor count;
  if (replays_cuda(input) && reduction == ops::LossReduction::mean)
    count = alloc_scratch(1, DType::int64, input.device());
  loss_partials(input, reduction);
}

void nll_loss(const Tensor& out, const Tensor& input, const Tensor& target,
              int64_t /*ignore_index*/, ops::LossReduction reduction) {
  cost(input, 0, tensor_bytes(out, target) + 8.0 * static_cast<double>(target.numel()));
  loss_partials(input, reduction);
}

void nll_loss_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& target,
                       int64_t /*ignore_index*/, ops::LossReduction reduction) {
  cost(grad_input, 0, tensor_bytes(grad_input, grad, target));
  mean_count(grad_input, reduction);
}

}  // namespace

const SoftmaxKernels softmax_kernels{.softmax = nothing,
                                     .softmax_backward = nothing,
                                     .cross_entropy = &cross_entropy,
                                     .cross_entropy_backward = &cross_entropy_backward,
                                     .cross_entropy_and_backward = &cross_entropy_and_backward,
                                     .nll_loss = &nll_loss,
                                     .nll_loss_backward = &nll_loss_backward};

}  // namespace tally::meta
