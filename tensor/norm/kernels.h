// The kernel table of the normalization family (layer_norm, rms_norm, batch_norm, group_norm): each
// kernel's signature, once. The CPU reference (tensor/norm/cpu.cpp) and the CUDA kernels
// (tensor/norm/cuda.cu) each define one NormKernels; tensor/backends.cpp registers them.
//
// Called only by the raw ops (tensor/norm/ops.cpp), which check the arguments, make the
// operands contiguous and convert weight/bias to the statistics dtype first. Conventions:
// x, out, dy, dx are contiguous in x's dtype (the row kernels' out and dy: see below; the
// batch_norm CUDA kernels also take them all channels_last, bn_channels_last);
// statistics (mean, rstd, var, invstd), weight, bias, dweight and dbias are contiguous in the
// statistics dtype (ops::norm_stat_dtype: float for the 16-bit types, else x's dtype). A tensor
// argument may be undefined where noted. No kernel synchronises with the host; scratch comes from
// alloc_scratch.
#pragma once

#include <cstdint>

#include "tensor/dispatch.h"
#include "tensor/tensor.h"

namespace tally {

// Sizes of x [N, C, *] as (N, C, S), S the product of the spatial dims (batch_norm's view).
struct NCS {
  int64_t n, c, s;
};
inline NCS ncs(const Tensor& x) {
  int64_t s = 1;
  for (int64_t d = 2; d < x.dim(); ++d) s *= x.sizes()[static_cast<size_t>(d)];
  return {x.sizes()[0], x.sizes()[1], s};
}

// True when a batch_norm tensor is laid out channels_last (and not also row-major): the CUDA
// kernels then read it as [N * H * W, C] rows.
inline bool bn_channels_last(const Tensor& x) {
  return x.dim() == 4 && x.suggest_memory_format() == MemoryFormat::channels_last;
}

struct NormKernels {
  // Normalizes each row of x viewed as [rows, cols]: writes out, rstd [rows] and, when mean
  // is defined, mean [rows] (layer_norm). An undefined mean means rms_norm: no centering.
  // weight, bias: [cols] or undefined. out may also be float16 or bfloat16 beside a float32 x
  // (ops::norm_writes_dtype): each value rounded once, from the statistics dtype.
  // With `residual` defined (x's shape, contiguous, x's dtype or out's), the rows normalized
  // are x + residual, each sum rounded to x's dtype and written to `sum` (x's dtype and
  // shape) first: ops::add_layer_norm, the residual add of a transformer block fused.
  void (*layer_norm)(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                     const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                     double eps, const Tensor& residual, const Tensor& sum);

  // One pass over the rows computing whichever of dx, dweight, dbias is defined (dweight and
  // dbias [cols] are overwritten, not accumulated into). mean undefined: rms_norm. dy may
  // also be float16 or bfloat16 beside a float32 x (ops::norm_writes_dtype), read widened.
  // dx_add (x's dtype and shape, contiguous; undefined: none) is added to dx before it is
  // rounded: the gradient a residual connection brings to the same tensor. dx_low (undefined:
  // none; otherwise dx defined, dy's dtype, x's shape, contiguous) receives each value of dx
  // once more, converted from its x-dtype value: the gradient of a 16-bit residual branch
  // beside a float32 sum (ops::add_layer_norm_backward), equal to to(dx, dy's dtype).
  void (*layer_norm_backward)(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                              const Tensor& dy, const Tensor& x, const Tensor& mean,
                              const Tensor& rstd, const Tensor& weight, int64_t rows, int64_t cols,
                              const Tensor& dx_add, const Tensor& dx_low);

  // Per channel c of x [N, C, *]: mean, biased var and invstd = 1 / sqrt(var + eps), [C]
  // each. An empty batch gives mean 0 and var 0. When running_mean is defined (then
  // running_var too: contiguous [C] of the stat dtype on x's device) and the batch is not
  // empty, the running statistics move in the same pass: running = (1 - momentum) * running +
  // momentum * batch, the variance unbiased (var * count / (count - 1)), in float64, rounded
  // once.
  void (*batch_norm_stats)(const Tensor& mean, const Tensor& var, const Tensor& invstd,
                           const Tensor& x, double eps, const Tensor& running_mean,
                           const Tensor& running_var, double momentum);

  // out = (x - mean[c]) * invstd[c] * weight[c] + bias[c] (weight, bias may be undefined).
  void (*batch_norm_elemt)(const Tensor& out, const Tensor& x, const Tensor& mean,
                           const Tensor& invstd, const Tensor& weight, const Tensor& bias);

  // Gradients of batch_norm: whichever of dx, dweight, dbias ([C]) is defined. training:
  // mean and invstd were batch statistics (their dependence on x enters dx). dy gives the
  // shape; x and mean may be undefined when neither training nor dweight needs them.
  void (*batch_norm_backward)(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                              const Tensor& dy, const Tensor& x, const Tensor& mean,
                              const Tensor& invstd, const Tensor& weight, bool training);

  // group_norm of x [N, C, *] (contiguous) over `groups` groups of C / groups channels: writes
  // out (x's shape; x's dtype, or float32 beside a 16-bit x: ops::norm_widens_dtype), mean and
  // rstd ([N, groups]); weight, bias: [C] or undefined.
  void (*group_norm)(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                     const Tensor& weight, const Tensor& bias, int64_t groups, double eps);

  // Gradients of group_norm: whichever of dx (x's dtype and shape), dweight, dbias ([C],
  // overwritten) is defined. dy contiguous, in x's dtype or float32 beside a 16-bit x
  // (ops::norm_widens_dtype); weight only scales dx.
  void (*group_norm_backward)(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                              const Tensor& dy, const Tensor& x, const Tensor& mean,
                              const Tensor& rstd, const Tensor& weight, int64_t groups);
};

// Runs f.template operator()<T, O>() with T the C++ type of x_dtype and O that of other_dtype,
// for the pairs the row kernels take (ops::norm_writes_dtype): O = T, or a 16-bit O beside a
// float32 T. Any other pair is unsupported_dtype(op, other_dtype).
template <typename F>
void dispatch_row_pair(DType x_dtype, DType other_dtype, const char* op, F&& f) {
  if (x_dtype == other_dtype) {
    TALLY_DISPATCH_FLOAT(x_dtype, op, [&] { f.template operator()<scalar_t, scalar_t>(); });
  } else if (x_dtype == DType::float32 && other_dtype == DType::bfloat16) {
    f.template operator()<float, BFloat16>();
  } else if (x_dtype == DType::float32 && other_dtype == DType::float16) {
    f.template operator()<float, Half>();
  } else {
    unsupported_dtype(op, other_dtype);
  }
}

// Runs f.template operator()<T, O>() with T the C++ type of x_dtype and O that of other_dtype,
// for the pairs the group_norm kernels take (ops::norm_widens_dtype): O = T, or float beside a
// 16-bit T (autocast's float32 cast of the input, fused). Any other pair is
// unsupported_dtype(op, other_dtype).
template <typename F>
void dispatch_widened_pair(DType x_dtype, DType other_dtype, const char* op, F&& f) {
  if (x_dtype == other_dtype) {
    TALLY_DISPATCH_FLOAT(x_dtype, op, [&] { f.template operator()<scalar_t, scalar_t>(); });
  } else if (x_dtype == DType::bfloat16 && other_dtype == DType::float32) {
    f.template operator()<BFloat16, float>();
  } else if (x_dtype == DType::float16 && other_dtype == DType::float32) {
    f.template operator()<Half, float>();
  } else {
    unsupported_dtype(op, other_dtype);
  }
}

// cpu::norm_kernels (tensor/norm/cpu.cpp), cuda::norm_kernels (tensor/norm/cuda.cu), norm_backends
// (tensor/backends.cpp).
TALLY_DECLARE_KERNELS(NormKernels, norm_kernels, norm_backends);

// The table's entries in member order, each the backend's kernel of the member's name: each
// backend defines its table as `const NormKernels norm_kernels{TALLY_NORM_KERNELS};`, so the list
// of kernels is written once.
#define TALLY_NORM_KERNELS                                                      \
  .layer_norm = &layer_norm, .layer_norm_backward = &layer_norm_backward,       \
  .batch_norm_stats = &batch_norm_stats, .batch_norm_elemt = &batch_norm_elemt, \
  .batch_norm_backward = &batch_norm_backward, .group_norm = &group_norm,       \
  .group_norm_backward = &group_norm_backward

}  // namespace tally
