// cuBLASLt for the tensor layer: one handle per device (created on first use, kept for
// the life of the process), a cache of the algorithm cublasLtMatmulAlgoGetHeuristic picked
// per problem (shape, layout, dtype, pointer alignment, epilogue, workspace size), and one
// column-major GEMM entry point that enqueues on Tally's stream for the device. The
// workspace is the caller's (taken from the caching allocator under Category::workspace,
// see tensor/linalg/cuda_matmul.cpp); nothing here allocates tensor memory or synchronises (the
// libraries' handles keep a little device memory of their own, made at creation), except
// tuning (tunable_enabled(), tensor/cuda/matmul_settings.h): the first product of a problem then
// times the candidates into scratch outputs (Category::workspace) and waits for them.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "tensor/dtype.h"

namespace tally::cuda::blas {

// The cuBLASLt handle for `device` (thread-safe; created once).
cublasLtHandle_t handle(int device);

// One (strided-batched) column-major product, cuBLAS notation:
//   D[i] (m x n, ldd) = op(A[i]) (m x k) * op(B[i]) (k x n)  [+ D[i] when accumulate]
//                       [+ bias (length m, broadcast over the n columns)]
// for i < batch, with X[i] = X + i * stride_x elements (a stride of 0 broadcasts). A is
// stored k x m when trans_a, else m x k (likewise B), column-major with its ld. A and B have
// `dtype`; D (and C, the same matrix) has `out_dtype`: the same, or float32 for float16/
// bfloat16 operands (the product and the sum it accumulates onto stay in float32: no 16-bit
// rounding). float32 multiplies in float32 (TF32 only when allow_tf32()), float16/bfloat16
// accumulate in float32, float64 in float64.
struct Gemm {
  DType dtype = DType::float32;
  DType out_dtype = DType::float32;
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 1, stride_a = 0;
  const void* b = nullptr;
  int64_t ldb = 1, stride_b = 0;
  void* d = nullptr;
  int64_t ldd = 1, stride_d = 0;
  int64_t batch = 1;
  bool accumulate = false;     // beta = 1, C = D in place
  const void* bias = nullptr;  // CUBLASLT_EPILOGUE_BIAS when set (batch must be 1)
  // A GELU epilogue (cuBLASLt's GELU is the tanh approximation, GPT-2's), batch 1, no
  // accumulate; `aux` is an m x n column-major matrix of D's dtype, its leading dimension
  // `ldaux` a multiple of 8 and at least m:
  //   gelu_aux: D = gelu(product [+ bias]) and aux = product [+ bias] (the GELU's input,
  //             kept for backward): CUBLASLT_EPILOGUE_GELU_AUX[_BIAS];
  //   dgelu:    D = product * gelu'(aux): CUBLASLT_EPILOGUE_DGELU (no bias).
  enum class Act : uint8_t { none, gelu_aux, dgelu };
  Act act = Act::none;
  void* aux = nullptr;
  int64_t ldaux = 0;
};

// Enqueues the product on Tally's stream for `device` with the given workspace and
// returns CUBLAS_STATUS_SUCCESS. When cuBLASLt's heuristic offers no algorithm for this
// exact problem it enqueues nothing and returns the heuristic's status (NOT_SUPPORTED or
// INVALID_VALUE), so the caller can use gemm_classic or drop the epilogue. Throws
// std::runtime_error naming `op` and the problem on any other cuBLASLt failure.
cublasStatus_t gemm(int device, const Gemm& g, void* workspace, size_t workspace_bytes,
                    const char* op);

// The same product (no bias, no GELU) through classic cuBLAS, cublasGemmStridedBatchedEx, which
// takes any element-aligned pointers and batch strides: the fallback when cuBLASLt offers
// no algorithm. One cublasHandle_t per device, its workspace set to ours before each
// call (never cuBLAS's own pool). Throws std::runtime_error naming `op` on failure.
void gemm_classic(int device, const Gemm& g, void* workspace, size_t workspace_bytes,
                  const char* op);

// Testing: make gemm() report "no algorithm" for every problem, so that callers take
// their fallbacks (classic cuBLAS, bias kernel).
void set_force_fallback(bool force);

// "float32 m=.. n=.. k=.. opA=T lda=.. ..." for messages.
std::string describe(const Gemm& g);

// Counters for tests and profiling (process-wide, monotonic).
uint64_t lt_calls();             // cublasLtMatmul calls enqueued
uint64_t heuristic_queries();    // cublasLtMatmulAlgoGetHeuristic calls (plan-cache misses)
uint64_t tuned_problems();       // problems whose algorithm was picked by timing (tunable)
uint64_t bias_epilogue_calls();  // of lt_calls, those with the bias epilogue
uint64_t gelu_epilogue_calls();  // of lt_calls, those with a GELU epilogue (gelu_aux or dgelu)
uint64_t classic_calls();        // cublasGemmStridedBatchedEx calls enqueued

}  // namespace tally::cuda::blas
