// The kernel table of the linear-algebra family (matmul / mm / bmm, linear with bias,
// embedding gather and scatter-add): each kernel's signature, once. The CPU kernels
// (tensor/linalg/cpu.cpp: matrix products through OpenBLAS) and the CUDA kernels (matrix
// products through cuBLASLt in tensor/linalg/cuda_matmul.cpp over tensor/cuda/blas.h, the
// linear layer with cuBLASLt's bias epilogue, the embedding kernels in tensor/linalg/cuda.cu)
// each define one LinalgKernels; tensor/backends.cpp registers them.
//
// Called only by the raw ops (tensor/linalg/ops.cpp), which hand the operands over in a
// BLAS-readable layout (ops::blas_layout). Every CUDA launcher enqueues on Tally's stream
// for the tensor's device, opens an NVTX range and checks the launch; none synchronises
// with the host. cuBLASLt's workspace is taken from the caching allocator for each call
// (alloc_scratch_bytes), tagged Category::workspace (and with the op that asked for it:
// "matmul", "mm", "bmm", "linear"). The CUDA-only settings (TF32, the workspace size, the
// counters) are in tensor/linalg/cuda.h.
#pragma once

#include <cstdint>

#include "tensor/dispatch.h"
#include "tensor/tensor.h"

namespace tally {

struct LinalgKernels {
  // out = a @ b (+ out when `accumulate`), batched. out is [batch..., M, N], contiguous, or
  // 2-D with unit column stride and rows out.stride(0) >= N apart (ops::mm_out: a padded
  // buffer's first N columns; ops::output_ld is the ldc; the padding is not touched); a is
  // [batch_a..., M, K] and b [batch_b..., K, N] whose batch dims broadcast (aligned right) to
  // out's batch dims, both with a BLAS-readable matrix layout (ops::blas_layout) and
  // out's dtype, or both float16/bfloat16 with a float32 out (ops::mm_out: the product and
  // the sum it accumulates onto are never rounded to 16 bits).
  // CPU: float32/float64 call sgemm/dgemm once per batch entry (no copies); float16/bfloat16
  // convert to float32, multiply, convert back (a float32 out is written directly).
  // CUDA: batch dims that can be addressed with one stride per operand run as one
  // strided-batched cuBLASLt call (broadcast dims with stride 0); the rest are looped over
  // on the host. Problems cuBLASLt has no algorithm for go through classic cuBLAS
  // (cublasGemmStridedBatchedEx). A float32 out of 16-bit operands is cuBLAS's mixed GEMM
  // (A/B 16-bit, C/D float32, float32 compute).
  void (*matmul)(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate);

  // out [M, N] (contiguous) = x [M, K] @ wt [K, N] + bias [N] (broadcast over rows); x and wt
  // BLAS-readable, bias defined, all of out's dtype.
  // CPU: the bias broadcast into out, then the GEMM accumulates x W^T.
  // CUDA: uses CUBLASLT_EPILOGUE_BIAS where cuBLASLt offers it for the problem; otherwise
  // writes the bias into out and accumulates the product onto it (the CPU path's arithmetic).
  void (*linear)(const Tensor& out, const Tensor& x, const Tensor& wt, const Tensor& bias);

  // The GELU(tanh) epilogues of ops::linear_gelu and ops::mm_dgelu. Each returns false, having
  // written nothing, where the backend has no fused kernel for the problem; the raw op then
  // runs the family's product and the elementwise family's GELU kernel one after the other.
  // All matrices are 2-D and of out's dtype, out and pre contiguous, the operands BLAS-readable.
  //   linear_gelu:  pre [M, N] = x [M, K] @ wt [K, N] (+ bias [N] when defined) and
  //                 out [M, N] = gelu_tanh(pre);
  //   matmul_dgelu: out [M, N] = (a [M, K] @ b [K, N]) * gelu_tanh'(pre [M, N]).
  // CPU: none (false). CUDA: cuBLASLt's CUBLASLT_EPILOGUE_GELU_AUX[_BIAS] / _DGELU for
  // float16/bfloat16 when N is a multiple of 8, M, N, K > 1 and cuBLASLt has an
  // algorithm; false otherwise.
  bool (*linear_gelu)(const Tensor& out, const Tensor& pre, const Tensor& x, const Tensor& wt,
                      const Tensor& bias);
  bool (*matmul_dgelu)(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& pre);

  // out [N..., D] (contiguous) <- weight[indices[...], :]; weight any layout and dtype,
  // indices int64/int32 in any layout.
  // CPU: throws std::out_of_range for an index outside [0, V).
  // CUDA: an index outside [0, V) cannot throw without a host synchronisation: its output
  // row is filled with NaN (zero for integer/bool weights).
  void (*embedding)(const Tensor& out, const Tensor& weight, const Tensor& indices);

  // grad_weight [V, D] (contiguous, zero-filled by the caller, dtype of grad or wider:
  // float32/float64 accumulation buffers as the raw op passes them) += grad[i, :] for each
  // index i != padding_idx. grad is [indices.numel(), D].
  // CPU: throws std::out_of_range for an index outside [0, V).
  // CUDA: by atomicAdd (any floating grad dtype); indices outside [0, V) are skipped.
  void (*embedding_backward)(const Tensor& grad_weight, const Tensor& grad, const Tensor& indices,
                             int64_t padding_idx);
};

// cpu::linalg_kernels (tensor/linalg/cpu.cpp), cuda::linalg_kernels (tensor/linalg/cuda.cu),
// linalg_backends (tensor/backends.cpp).
TALLY_DECLARE_KERNELS(LinalgKernels, linalg_kernels, linalg_backends);

}  // namespace tally
