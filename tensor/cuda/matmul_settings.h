// The process-wide switches of cuBLASLt products (TF32, workspace size, tuning): backend
// settings that tensor/cuda/blas.cpp reads and defines; users reach them through
// tensor/linalg/cuda.h. No CUDA header, so CPU builds may include it.
#pragma once

#include <cstddef>

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

}  // namespace tally::cuda
