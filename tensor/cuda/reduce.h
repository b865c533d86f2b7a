// CUDA kernels of the reduce family, twins of tensor/cpu/reduce.h with the same signatures
// and layouts (see there). Each launcher enqueues on Tally's stream for the tensor's device,
// opens an NVTX range and checks the launch; none synchronises with the host.
//
// Difference from the CPU: value_selecting_reduction_backward cannot throw for an index
// outside the dim without reading the indices back; such an entry is skipped (its
// gradient stays 0).
#pragma once

#include <vector>

#include "tensor/ops/reduce.h"

namespace tally::cuda {

void max_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim);
void min_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim);
void amax(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce);
void amin(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce);
void var(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce, double correction,
         bool take_sqrt);
void logsumexp(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce);
void value_selecting_reduction_backward(const Tensor& grad_input, const Tensor& grad,
                                        const Tensor& indices, int64_t dim);

}  // namespace tally::cuda
