// CPU kernels of the normalization ops (layer_norm, rms_norm, batch_norm), forward and
// backward. Called only through the dispatch point in tensor/norm.cpp, which makes the
// operands contiguous and converts weight/bias to the statistics dtype first.
//
// Conventions: x, out, dy, dx are contiguous in x's dtype T; statistics (mean, rstd, var,
// invstd), weight, bias, dweight and dbias are contiguous in acc_t<T> (float for the 16-bit
// types). Row sums run in double. Any tensor argument may be undefined where noted.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace tally::cpu {

// Normalizes each row of x viewed as [rows, cols]: writes out, rstd [rows] and, when mean
// is defined, mean [rows] (layer_norm). An undefined mean means rms_norm: no centering.
// weight, bias: [cols] or undefined.
void layer_norm(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                double eps);

// One pass over the rows computing whichever of dx, dweight, dbias is defined (dweight and
// dbias [cols] are overwritten, not accumulated into). mean undefined: rms_norm.
void layer_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean,
                         const Tensor& rstd, const Tensor& weight, int64_t rows, int64_t cols);

// Per channel c of x [N, C, *]: mean, biased var and invstd = 1 / sqrt(var + eps), [C]
// each. An empty batch gives mean 0 and var 0.
void batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& invstd,
                      const Tensor& x, double eps);

// out = (x - mean[c]) * invstd[c] * weight[c] + bias[c] (weight, bias may be undefined).
void batch_norm_elemt(const Tensor& out, const Tensor& x, const Tensor& mean,
                      const Tensor& invstd, const Tensor& weight, const Tensor& bias);

// Gradients of batch_norm: whichever of dx, dweight, dbias ([C]) is defined. training:
// mean and invstd were batch statistics (their dependence on x enters dx). dy gives the
// shape; x and mean may be undefined when neither training nor dweight needs them.
void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean,
                         const Tensor& invstd, const Tensor& weight, bool training);

}  // namespace tally::cpu
