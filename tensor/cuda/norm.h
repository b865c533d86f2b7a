// CUDA kernels of the normalization ops (layer_norm, rms_norm, batch_norm), forward and
// backward: twins of tensor/cpu/norm.h with the same signatures and conventions (x, out,
// dy, dx contiguous in x's dtype; statistics, weight, bias, dweight, dbias contiguous in the
// statistics dtype: float for float32/float16/bfloat16, double for float64).
//
// Every launcher enqueues on Tally's stream for the tensor's device, opens an NVTX range
// and checks its launches; none synchronises with the host. Scratch (per-block partial
// sums) comes from the caching allocator under the calling op's context.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace tally::cuda {

// One block per row (32 to 512 threads by row length): mean and rstd reduced in the
// statistics dtype, the row normalized in a second pass. mean undefined: rms_norm.
void layer_norm(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                double eps);

// dx per row (block per row); dweight/dbias as per-block partial sums over the rows a block
// visits (float32/float64 scratch), then a second kernel sums the partials per column.
void layer_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean,
                         const Tensor& rstd, const Tensor& weight, int64_t rows, int64_t cols);

// Per-channel sums over N and the spatial dims in double (blocks of a channel split the
// elements, shifted by the channel's first element), then a finalize kernel per channel.
void batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& invstd,
                      const Tensor& x, double eps);

// Elementwise normalization with per-channel statistics.
void batch_norm_elemt(const Tensor& out, const Tensor& x, const Tensor& mean,
                      const Tensor& invstd, const Tensor& weight, const Tensor& bias);

// Per-channel sums of dy and dy * xhat (as batch_norm_stats), then dx elementwise.
void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean,
                         const Tensor& invstd, const Tensor& weight, bool training);

}  // namespace tally::cuda
