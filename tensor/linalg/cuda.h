// CUDA-only settings and counters of the linear-algebra family, for users and tests (the
// kernels themselves are entries of cuda::linalg_kernels, tensor/linalg/kernels.h): the TF32
// switch and the cuBLASLt workspace size (both defined in tensor/cuda/blas.cpp, which reads
// them), the product counters and the fallback test hook (tensor/linalg/cuda_matmul.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tally::cuda {

// PyTorch's torch.backends.cuda.matmul.allow_tf32: whether float32 products may use TF32
// tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32). Off by default. Process-wide.
void set_allow_tf32(bool allow);
bool allow_tf32();

// Bytes of cuBLASLt workspace each product takes from the caching allocator (and the most
// the algorithm heuristic may ask for). Default 32 MiB, or CUBLASLT_WORKSPACE_SIZE (KiB,
// as PyTorch reads it) from the environment; 0 disables the workspace.
void set_matmul_workspace_bytes(size_t bytes);

// PyTorch's torch.cuda.tunable.enable (PYTORCH_TUNABLEOP_ENABLED): the first product of each
// problem (shapes, layouts, dtypes, alignments, epilogue) times cuBLASLt's first 8 heuristic
// algorithms on its own operands (5 runs each into scratch outputs, one host wait) and keeps
// the fastest, when it beats the heuristic's first choice by 3%, for the rest of the process;
// later products of the problem run it with no wait. A problem first met inside a CUDA graph
// capture takes the heuristic's algorithm. Which algorithm wins can differ between processes, and
// with it the last bits of results. Off by default; TALLY_TUNABLEOP_ENABLED=1 in the environment
// starts it on. Process-wide.
void set_tunable_enabled(bool enabled);
bool tunable_enabled();
size_t matmul_workspace_bytes();

// Counters (process-wide, monotonic) for tests and profiling.
struct MatmulStats {
  uint64_t lt_calls = 0;           // cublasLtMatmul calls enqueued
  uint64_t heuristic_queries = 0;  // algorithm heuristic calls (plan-cache misses)
  uint64_t bias_epilogue = 0;      // linear calls done with CUBLASLT_EPILOGUE_BIAS
  uint64_t bias_fallback = 0;      // linear calls done as bias copy + accumulate
  uint64_t classic_calls = 0;      // products cuBLASLt had no algorithm for (classic cuBLAS)
  uint64_t gelu_epilogue = 0;      // linear_gelu / mm_dgelu calls done with a GELU epilogue
  uint64_t gelu_fallback = 0;      // those done as the product and a separate GELU kernel
  uint64_t tuned = 0;              // problems whose algorithm was picked by timing
};
MatmulStats matmul_stats();

// Testing: treat every product as one cuBLASLt has no algorithm for, so that the
// fallbacks (classic cuBLAS, the bias kernel) run. Process-wide.
void set_force_cublas_fallback(bool force);

}  // namespace tally::cuda
