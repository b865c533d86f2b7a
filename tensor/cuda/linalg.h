// CUDA kernels of the linear-algebra family, twins of tensor/cpu/linalg.h with the same
// signatures and contracts: matrix products through cuBLASLt (tensor/cuda/matmul.cpp over
// tensor/cuda/blas.h), the linear layer with cuBLASLt's bias epilogue, and the embedding
// gather / scatter-add (tensor/cuda/linalg.cu).
// Every launcher enqueues on Tally's stream for the tensor's device, opens an NVTX range
// and checks the launch; none synchronises with the host. cuBLASLt's workspace is taken
// from the caching allocator for each call, tagged Category::workspace (and with the op
// that asked for it: "matmul", "mm", "bmm", "linear").
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/ops/linalg.h"

namespace tally::cuda {

// out = a @ b (+ out when `accumulate`), batched, as cpu::matmul: out contiguous
// [batch..., M, N]; a [batch_a..., M, K] and b [batch_b..., K, N] with BLAS-readable
// matrices (ops::blas_layout) whose batch dims broadcast to out's. Batch dims that can be
// addressed with one stride per operand run as one strided-batched cuBLASLt call
// (broadcast dims with stride 0); the rest are looped over on the host. Problems cuBLASLt
// has no algorithm for go through classic cuBLAS (cublasGemmStridedBatchedEx).
void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate);

// out [M, N] (contiguous) = x [M, K] @ wt [K, N] + bias [N] (broadcast over rows); x and wt
// BLAS-readable, bias defined, all of out's dtype. Uses CUBLASLT_EPILOGUE_BIAS where
// cuBLASLt offers it for the problem; otherwise writes the bias into out and accumulates
// the product onto it (the CPU path's arithmetic).
void linear(const Tensor& out, const Tensor& x, const Tensor& wt, const Tensor& bias);

// out [rows, cols] (contiguous) = row [cols] (any stride) in every row: linear's bias
// when the epilogue is not used.
void broadcast_rows(const Tensor& out, const Tensor& row);

// out [N..., D] (contiguous) <- weight[indices[...], :]; weight any layout and dtype,
// indices int64/int32 in any layout. An index outside [0, V) cannot throw without a host
// synchronisation: its output row is filled with NaN (zero for integer/bool weights).
void embedding(const Tensor& out, const Tensor& weight, const Tensor& indices);

// grad_weight [V, D] (contiguous, zero-filled by the caller) += grad[e, :] for each index
// indices[e] != padding_idx, by atomicAdd (float32/float64 accumulation buffers as the raw
// op passes them; any floating grad dtype). Indices outside [0, V) are skipped.
void embedding_backward(const Tensor& grad_weight, const Tensor& grad, const Tensor& indices,
                        int64_t padding_idx);

// PyTorch's torch.backends.cuda.matmul.allow_tf32: whether float32 products may use TF32
// tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32). Off by default. Process-wide.
void set_allow_tf32(bool allow);
bool allow_tf32();

// Bytes of cuBLASLt workspace each product takes from the caching allocator (and the most
// the algorithm heuristic may ask for). Default 32 MiB, or CUBLASLT_WORKSPACE_SIZE (KiB,
// as PyTorch reads it) from the environment; 0 disables the workspace.
void set_matmul_workspace_bytes(size_t bytes);
size_t matmul_workspace_bytes();

// Counters (process-wide, monotonic) for tests and profiling.
struct MatmulStats {
  uint64_t lt_calls = 0;           // cublasLtMatmul calls enqueued
  uint64_t heuristic_queries = 0;  // algorithm heuristic calls (plan-cache misses)
  uint64_t bias_epilogue = 0;      // linear calls done with CUBLASLT_EPILOGUE_BIAS
  uint64_t bias_fallback = 0;      // linear calls done as bias copy + accumulate
  uint64_t classic_calls = 0;      // products cuBLASLt had no algorithm for (classic cuBLAS)
};
MatmulStats matmul_stats();

// Testing: treat every product as one cuBLASLt has no algorithm for, so that the
// fallbacks (classic cuBLAS, the bias kernel) run. Process-wide.
void set_force_cublas_fallback(bool force);

}  // namespace tally::cuda
