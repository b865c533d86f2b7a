// Internal to the linear-algebra family's CUDA files, not an API: what its two CUDA
// translation units call of each other. The cuBLASLt products (tensor/linalg/cuda_matmul.cpp)
// are entries of cuda::linalg_kernels, which tensor/linalg/cuda.cu defines; their contracts
// are on LinalgKernels' fields (tensor/linalg/kernels.h). linear's fallback path uses the
// row broadcast kernel of tensor/linalg/cuda.cu.
#pragma once

#include "tensor/tensor.h"

namespace tally::cuda {

// LinalgKernels::matmul and LinalgKernels::linear (tensor/linalg/cuda_matmul.cpp).
void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate);
void linear(const Tensor& out, const Tensor& x, const Tensor& wt, const Tensor& bias);
// LinalgKernels::linear_gelu and LinalgKernels::matmul_dgelu (tensor/linalg/cuda_matmul.cpp).
bool linear_gelu(const Tensor& out, const Tensor& pre, const Tensor& x, const Tensor& wt,
                 const Tensor& bias);
bool matmul_dgelu(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& pre);

// out [rows, cols] (contiguous) = row [cols] (any stride) in every row: linear's bias
// when the epilogue is not used (tensor/linalg/cuda.cu).
void broadcast_rows(const Tensor& out, const Tensor& row);

}  // namespace tally::cuda
