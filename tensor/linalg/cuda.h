// CUDA-only settings and counters of the linear-algebra family, for users and tests (the
// kernels themselves are entries of cuda::linalg_kernels, tensor/linalg/kernels.h): the TF32,
// workspace and tuning switches (tensor/cuda/matmul_settings.h, read by tensor/cuda/blas.cpp),
// the product counters and the fallback test hook (tensor/linalg/cuda_matmul.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/cuda/matmul_settings.h"

namespace tally::cuda {

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
