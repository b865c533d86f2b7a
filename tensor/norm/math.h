// The elementwise formulas of the normalization kernels, written once for the CPU reference
// (tensor/norm/cpu.cpp) and the CUDA kernels (tensor/norm/cuda.cu). All take and return the
// statistics dtype A (float for float32 and the 16-bit types, double for float64); the sums
// around them, and the dtype they run in, stay with each backend.
#pragma once

#include <cstdint>

#include "tensor/elementwise/math.h"

namespace tally::math {

// xhat = (x - mean) * rstd (rms_norm passes mean 0).
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A xhat(A x, A mean, A rstd) {
  return (x - mean) * rstd;
}

// layer_norm's output from xhat: y = xhat * weight[j] + bias[j], each where given (null: none).
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A scale_shift(A y, const A* weight, const A* bias, int64_t j) {
  if (weight) y = y * weight[j];
  if (bias) y = y + bias[j];
  return y;
}

// batch_norm's output: (x - mean) * scale + shift, scale = invstd * weight, shift = bias.
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A batch_norm_value(A x, A mean, A scale, A shift) {
  return (x - mean) * scale + shift;
}

// The input gradient of a normalization over a group of elements, with g the gradient of xhat
// and mean_g = mean(g) (0 without centering), mean_gx = mean(g * xhat):
//   dx = scale * (g - mean_g - xhat * mean_gx),  scale = rstd (times weight for batch_norm).
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A norm_input_grad(A scale, A g, A mean_g, A xhat, A mean_gx) {
  return scale * (g - mean_g - xhat * mean_gx);
}

// batch_norm's running statistics (PyTorch's momentum rule), in float64: the new running value
// from the old one and the batch's.
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE double running_stat(A running, double batch, double momentum) {
  return (1.0 - momentum) * static_cast<double>(running) + momentum * batch;
}

// The unbiased variance of `count` values from their biased one (count > 1; count 1 keeps it).
TALLY_HOST_DEVICE TALLY_FORCE_INLINE double unbiased(double var, int64_t count) {
  return count > 1 ? var * static_cast<double>(count) / static_cast<double>(count - 1) : var;
}

}  // namespace tally::math
