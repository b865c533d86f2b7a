// Meta kernels of the linalg family (tensor/meta/target.h): what the replayed backend's
// matmul allocates. CPU: 16-bit products widen their operands and output to float32
// (tensor/linalg/cpu.cpp; a float32 product of 16-bit operands widens the operands only). CUDA: one
// cuBLASLt workspace per product (tensor/linalg/cuda_matmul.cpp; the linear layer's bias epilogue
// is taken to apply). Each product costs 2 M N K FLOPs (tensor/meta/target.h: cost). ops::mm_out's
// output (a padded view, say) is the caller's: as on both backends, nothing is allocated for it.
// linear_gelu / mm_dgelu: CUDA's GELU epilogue where it applies (one workspace), else false.
#include "tensor/elementwise/ops.h"
#include "tensor/linalg/kernels.h"
#include "tensor/meta/target.h"

namespace tally::meta {

namespace {

void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate) {
  // The operands' dtype sets the rate: 16-bit operands with a float32 output (a weight's
  // gradient accumulated in float32) still run on the tensor cores.
  cost(out.device(), a.dtype(),
       2.0 * static_cast<double>(out.numel()) * static_cast<double>(a.size(-1)),
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
    cost(out.device(), x.dtype(),
         2.0 * static_cast<double>(out.numel()) * static_cast<double>(x.size(1)),
         tensor_bytes(out, x, wt, bias));
    if (out.numel() > 0) matmul_workspace(out);
    return;
  }
  ops::copy_(out, bias);
  matmul(out, x, wt, /*accumulate=*/true);
}

// The GELU epilogues: fused where CUDA's would be (tensor/linalg/cuda_matmul.cpp: gelu_gemm's
// conditions, an algorithm taken to exist), one workspace; otherwise false, and the raw op
// replays the product and the GELU kernel.
bool gelu_gemm(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& c,
               const Tensor& d) {
  const int64_t M = out.size(0), N = out.size(1), K = a.size(1);
  constexpr int64_t kMaxDim = 65535LL * 32;
  const bool sixteen = out.dtype() == DType::float16 || out.dtype() == DType::bfloat16;
  if (!replays_cuda(out) || !sixteen || N % 8 != 0 || M <= 1 || N <= 1 || K <= 1 || M >= kMaxDim ||
      N >= kMaxDim || K >= kMaxDim)
    return false;
  cost(out.device(), a.dtype(), 2.0 * static_cast<double>(out.numel()) * static_cast<double>(K),
       tensor_bytes(out, a, b, c, d));
  matmul_workspace(out);
  return true;
}

bool linear_gelu(const Tensor& out, const Tensor& pre, const Tensor& x, const Tensor& wt,
                 const Tensor& bias) {
  if (bias.defined() && bias.stride(0) != 1) return false;
  return gelu_gemm(out, x, pre, wt, bias);
}

bool matmul_dgelu(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& pre) {
  return gelu_gemm(out, a, b, pre, Tensor());
}

}  // namespace

const LinalgKernels linalg_kernels{.matmul = &matmul,
                                   .linear = &linear,
                                   .linear_gelu = &linear_gelu,
                                   .matmul_dgelu = &matmul_dgelu,
                                   .embedding = nothing,
                                   .embedding_backward = nothing};

}  // namespace tally::meta
