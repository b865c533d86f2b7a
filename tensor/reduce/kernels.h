// The kernel table of the reduce family (max/min with indices, amax/amin, var/std,
// logsumexp, the max/min backward scatter): each kernel's signature, once. The CPU
// reference (tensor/reduce/cpu.cpp) and the CUDA kernels (tensor/reduce/cuda.cu) each define
// one ReduceKernels with the same layouts; tensor/backends.cpp registers them.
//
// Called only by the raw ops (tensor/reduce/ops.cpp). Each CUDA launcher enqueues on Tally's
// stream for the tensor's device, opens an NVTX range and checks the launch; none
// synchronises with the host.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/dispatch.h"
#include "tensor/tensor.h"

namespace tally {

struct ReduceKernels {
  // values/indices have x's rank with size 1 at `dim` (indices int64; values x's dtype or
  // undefined when only the index is wanted). x's size at `dim` is non-zero.
  void (*max_dim)(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim);
  void (*min_dim)(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim);

  // out has x's rank with size 1 at the reduced dims (non-empty); x's dtype.
  void (*amax)(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce);
  void (*amin)(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce);

  // out (x's floating dtype) has x's rank with size 1 at the reduced dims.
  void (*var)(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce,
              double correction, bool take_sqrt);
  void (*logsumexp)(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce);

  // grad_input (zero-filled by the caller; grad's dtype) [..., n at dim, ...]
  // <- grad[...] at indices[...] along dim. grad and indices have size 1 at dim.
  // Difference of the CUDA kernel from the CPU: it cannot throw for an index outside the dim
  // without reading the indices back; such an entry is skipped (its gradient stays 0).
  void (*value_selecting_reduction_backward)(const Tensor& grad_input, const Tensor& grad,
                                             const Tensor& indices, int64_t dim);
};

// cpu::reduce_kernels (tensor/reduce/cpu.cpp), cuda::reduce_kernels (tensor/reduce/cuda.cu),
// reduce_backends (tensor/backends.cpp).
TALLY_DECLARE_KERNELS(ReduceKernels, reduce_kernels, reduce_backends);

// The table's entries in member order, each the backend's kernel of the member's name: each
// backend defines its table as `const ReduceKernels reduce_kernels{TALLY_REDUCE_KERNELS};`, so the
// list of kernels is written once.
#define TALLY_REDUCE_KERNELS                                                           \
  .max_dim = &max_dim, .min_dim = &min_dim, .amax = &amax, .amin = &amin, .var = &var, \
  .logsumexp = &logsumexp,                                                             \
  .value_selecting_reduction_backward = &value_selecting_reduction_backward

}  // namespace tally
