// CPU kernels of the linear-algebra family (matrix products through OpenBLAS, embedding
// gather and scatter-add). Called only through the dispatch point in tensor/linalg.cpp.
#pragma once

#include "tensor/ops/linalg.h"

namespace tally::cpu {

// out = a @ b (+ out when `accumulate`), batched. out is contiguous [batch..., M, N]; a is
// [batch_a..., M, K] and b [batch_b..., K, N] whose batch dims broadcast (aligned right) to
// out's batch dims, both with a BLAS-readable matrix layout (ops::blas_layout) and
// out's dtype. float32/float64 call sgemm/dgemm once per batch entry (no copies);
// float16/bfloat16 convert to float32, multiply, convert back.
void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate);

// out [N..., D] (contiguous) <- weight[indices[...], :]. Throws std::out_of_range for an
// index outside [0, V).
void embedding(const Tensor& out, const Tensor& weight, const Tensor& indices);

// grad_weight [V, D] (contiguous, zero-filled by the caller, dtype of grad or wider)
// += grad[i, :] for each index i != padding_idx. grad is [indices.numel(), D].
void embedding_backward(const Tensor& grad_weight, const Tensor& grad, const Tensor& indices,
                        int64_t padding_idx);

}  // namespace tally::cpu
