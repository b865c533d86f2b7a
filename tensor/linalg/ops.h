// Raw linear-algebra ops (namespace tally::ops, no autograd): matrix products with
// PyTorch's matmul semantics (mm, bmm, batched broadcasting matmul), linear (x W^T + b),
// and the embedding lookup with its scatter-add backward. CPU products run through
// OpenBLAS's cblas; the differentiable versions live in tensor/linalg/autograd.h.
//
// Dtypes: the four floating types (float16/bfloat16 multiply in float32). Both operands
// of a product must have the same dtype and device.
#pragma once

#include <algorithm>
#include <array>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "tensor/elementwise/ops.h"

namespace tally::ops {

// PyTorch's torch.matmul: 1-D x 1-D is a dot product (0-D result); 2-D x 2-D is mm; a
// 1-D operand is promoted to a matrix ([K] -> [1, K] on the left, [K, 1] on the right)
// and the added dimension is removed from the result; operands with more than 2
// dimensions are batches of matrices whose batch dimensions broadcast.
Tensor matmul(const Tensor& a, const Tensor& b);
// [M, K] x [K, N] -> [M, N]; both must be 2-D.
Tensor mm(const Tensor& a, const Tensor& b);
// [B, M, K] x [B, K, N] -> [B, M, N]; both must be 3-D with the same B (no broadcasting).
Tensor bmm(const Tensor& a, const Tensor& b);
// mm into a given output: out [M, N] <- a [M, K] @ b [K, N], or out += a @ b when
// `accumulate` (BLAS beta = 1; no temporary). out must be 2-D on a's device with a's dtype,
// or float32 for float16/bfloat16 operands (torch.mm's out_dtype=torch.float32: the float32
// product, or the float32 sum it accumulates onto, is never rounded to 16 bits),
// unit column stride and rows at least N elements apart (out.stride(1) == 1,
// out.stride(0) >= N): a contiguous matrix, a row range of one, or the first N columns of a
// wider (padded) buffer, whose row stride the GEMM takes as its leading dimension (ldc). The
// elements between the rows (the padding) are neither read nor written. out must not share
// storage with a or b. Nothing is allocated for the output (cuBLASLt's workspace is, as for
// mm). Errors (std::invalid_argument naming mm_out and the shapes/strides): a or b not 2-D,
// inner dims, dtypes, devices, out's shape, strides or storage.
void mm_out(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate = false);
// y = x W^T + b: x [..., in] (any number of leading dims, 1-D allowed), weight [out, in],
// bias [out] or undefined -> [..., out].
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// The first half of a GELU MLP, fused: pre = x W^T + b (linear's shapes and checks; bias
// optional) and out = gelu(pre, approximate="tanh"), returned as {out, pre} (pre is what the
// GELU's backward needs). On CUDA the GELU runs in the product's epilogue (cuBLASLt's
// CUBLASLT_EPILOGUE_GELU_AUX_BIAS: one kernel writes both; float16/bfloat16 with
// out_features a multiple of 8); elsewhere, and where the epilogue does not apply, the product
// and then the GELU kernel. pre is allocated first, then out. Errors as linear's, naming
// linear_gelu.
std::pair<Tensor, Tensor> linear_gelu(const Tensor& x, const Tensor& weight,
                                      const Tensor& bias = Tensor());
// The GELU's backward fused into the product that produces its output's gradient:
// (a @ b) * gelu'(pre) with gelu the tanh approximation, a [M, K], b [K, N], pre [M, N] (the
// GELU's input; any layout) -> [M, N]. On CUDA one cuBLASLt GEMM with CUBLASLT_EPILOGUE_DGELU
// (under linear_gelu's conditions); elsewhere the product, then the GELU's backward in place.
// Errors (std::invalid_argument naming mm_dgelu and the shapes): operands not 2-D, shapes that
// do not fit, dtypes, devices.
Tensor mm_dgelu(const Tensor& a, const Tensor& b, const Tensor& pre);

// PyTorch's aten::linear_backward: the gradients of y = linear(input, weight, bias) given
// grad_output (y's shape: input [..., in], weight [out, in], grad_output [..., out]), as
// (grad_input [..., in], grad_weight [out, in], grad_bias [out]); each only where output_mask
// asks for it (undefined otherwise). grad_input = g W, grad_weight = g^T x and grad_bias = the
// sums of g over the rows (a reduction of its own: cuBLASLt's bias-gradient epilogue,
// CUBLASLT_EPILOGUE_BGRADB, measured slower than the product and the sum on the H200 in
// GPT-2's shapes), in grad_output's dtype. weight is read only for grad_input: it may be
// undefined when output_mask[0] is false (autograd saves it only when the input needs a
// gradient). Errors (std::invalid_argument naming linear_backward and the shapes): weight not
// 2-D or missing for grad_input, shapes that do not fit, dtypes, devices.
// weight_grad_dtype: grad_weight's dtype, grad_output's (the default) or float32 when
// grad_output is float16/bfloat16: the GEMM then writes the float32 product (cuBLAS's mixed
// GEMM), never rounded to 16 bits (autocast's float32 parameters: autograd::grad_dtype).
std::tuple<Tensor, Tensor, Tensor> linear_backward(const Tensor& input, const Tensor& grad_output,
                                                   const Tensor& weight,
                                                   std::array<bool, 3> output_mask,
                                                   std::optional<DType> weight_grad_dtype = {});

// Rows of weight [V, D] picked by integer `indices` (int64 or int32, any shape) ->
// [..., D]. An index outside [0, V) throws std::out_of_range naming it and V.
Tensor embedding(const Tensor& weight, const Tensor& indices);
// The weight gradient of embedding: zeros [num_weights, D] with each row of `grad`
// ([..., D], indices' shape + [D]) added into row indices[...]. Rows equal to
// `padding_idx` (>= 0) receive nothing; padding_idx = -1 means none.
Tensor embedding_backward(const Tensor& grad, const Tensor& indices, int64_t num_weights,
                          int64_t padding_idx = -1);

// How a BLAS reads the matrix held in t's last two dims (rows x cols): row-major directly
// (trans = false, rows ld elements apart, unit column stride) or as the transpose of a
// row-major matrix (trans = true, unit row stride, columns ld elements apart). nullopt
// when neither holds (then the operand needs a contiguous copy). Strides of size-1 dims
// are ignored.
struct MatrixLayout {
  bool trans = false;
  int64_t ld = 1;
};
std::optional<MatrixLayout> blas_layout(const Tensor& t);

// A GEMM operand as the kernels read it: blas_layout(t) and, aligned with the output's batch
// dims `batch`, the element stride between batch entries (0 where t broadcasts). Throws
// std::logic_error naming `kernel` and the operand `what` when t is not BLAS-readable (the
// ops make such operands contiguous before dispatching).
struct GemmOperand : MatrixLayout {
  Shape batch_strides;
};
GemmOperand gemm_operand(const Tensor& t, const Shape& batch, const char* kernel, const char* what);

// The row stride (BLAS ldc) of a product's output as the kernels write it: out's matrices
// have unit column stride and rows output_ld(out) elements apart, and its batch entries are
// M * output_ld(out) elements apart (outputs with a batch are contiguous, so ld = N; only a
// 2-D output of mm_out may have padded rows). max(N, 1) when out has at most one row.
inline int64_t output_ld(const Tensor& out) {
  const int64_t M = out.size(-2), N = out.size(-1);
  return M <= 1 ? std::max<int64_t>(N, 1) : out.stride(-2);
}

// One step of the odometer `idx` over the batch dims [0, ndim) (the last fastest), moving the
// element offsets of a's and b's matrices by their batch strides.
inline void advance_batch(std::vector<int64_t>& idx, const Shape& batch, size_t ndim,
                          const GemmOperand& a, const GemmOperand& b, int64_t& off_a,
                          int64_t& off_b) {
  for (size_t d = ndim; d-- > 0;) {
    off_a += a.batch_strides[d];
    off_b += b.batch_strides[d];
    if (++idx[d] < batch[d]) break;
    off_a -= a.batch_strides[d] * batch[d];
    off_b -= b.batch_strides[d] * batch[d];
    idx[d] = 0;
  }
}

}  // namespace tally::ops
