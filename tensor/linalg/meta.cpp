// Meta kernels of the linalg family (tensor/meta/target.h): what the replayed backend's
// matmul allocates. CPU: 16-bit products widen their operands and output to float32
// (tensor/linalg/cpu.cpp; a float32 product of 16-bit operands widens the operands only). CUDA: one
// cuBLASLt workspace per product (tensor/linalg/cuda_matmul.cpp; the linear layer's bias epilogue
// is taken to apply). Each product costs 2 M N K FLOPs (tensor/meta/target.h: cost). ops::mm_out's
// output (a padded view, say) is the caller's: as on both backends, nothing is allocated for it.
#include "tensor/linalg/kernels.h"
#include "tensor/meta/target.h"

namespace tally::meta {

namespace {

void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate) {
  cost(out, 2.0 * static_cast<double>(out.numel()) * static_cast<double>(a.size(-1)),
       tensor_bytes(out, a, b));
  if (replays_cuda(out)) {
    if (out.numel() > 0 && a.size(-1) > 0) matmul_workspace(out);
    return;
  }
  if (a.dtype() != DType::float16 && a.dtype() != DType::bfloat16) return;
  const Tensor a32 = ops::to(a, DType::float32), b32 = ops::to(b, DType::float32);
  if (out.dtype() == DType::float32) return;  // a float32 product of 16-bit operands
  const Tensor o32 = accumulate ? ops::to(out, DType::float32)
                                : ops::empty(out.sizes(), DType::float32, out.device());
  ops::copy_(out, o32);
}

void linear(const Tensor& out, const Tensor& x, const Tensor& wt, const Tensor& bias) {
  if (replays_cuda(out)) {
    cost(out, 2.0 * static_cast<double>(out.numel()) * static_cast<double>(x.size(1)),
         tensor_bytes(out, x, wt, bias));
    if (out.numel() > 0) matmul_workspace(out);
    return;
  }
  ops::copy_(out, bias);
  matmul(out, x, wt, /*accumulate=*/true);
}

}  // namespace

const LinalgKernels linalg_kernels{
    .matmul = &matmul, .linear = &linear, .embedding = nothing, .embedding_backward = nothing};

}  // namespace tally::meta
