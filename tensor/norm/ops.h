// Raw normalization ops (namespace tally::ops, no autograd): layer_norm, rms_norm, batch_norm
// and group_norm, forward and backward, as PyTorch's native_layer_norm / native_batch_norm /
// native_group_norm.
// The forwards also return the per-row (per-channel) statistics the backwards take, so the
// differentiable ops save x and these small vectors, never the normalized output.
//
// Statistics (mean, rstd, invstd) are float32 for 16-bit inputs and the input's dtype
// otherwise (PyTorch's acc type); out and dx keep the input's dtype; the backwards return
// dweight and dbias in the statistics dtype (the caller converts them to the parameters'
// dtypes). weight and bias may be undefined tensors (no affine); weight may be any floating
// dtype (it is read in the statistics dtype).
//
// The backwards compute an entry of {dx, dweight, dbias} exactly where output_mask asks
// (undefined otherwise); their `weight` argument only scales dx and may be left undefined
// when dx is not asked for, even for an affine op.
#pragma once

#include <array>
#include <optional>
#include <tuple>

#include "tensor/tensor.h"

namespace tally::ops {

// The dtype normalization statistics are kept in for inputs of `dtype`.
DType norm_stat_dtype(DType dtype);

// Whether the row kernels (layer_norm, rms_norm) read and write `other` alongside an input of
// dtype x: x's own dtype, or a 16-bit dtype beside a float32 input (layer_norm's out under
// autocast, and the 16-bit gradient that comes back for it).
bool norm_writes_dtype(DType x, DType other);

// Whether the group_norm kernels read and write `other` alongside an input of dtype x: x's own
// dtype, or float32 beside a 16-bit x (autocast's float32 output, and the float32 gradient
// that comes back for it).
bool norm_widens_dtype(DType x, DType other);

// ---- layer_norm: normalizes over the trailing dims given by normalized_shape ----
// x [*, normalized_shape...]; weight, bias: normalized_shape or undefined.
// Returns {out (x's shape), mean, rstd}, mean and rstd of shape [*, 1, ..., 1] (x's
// leading dims, then one 1 per normalized dim), rstd = 1 / sqrt(biased var + eps).
// out_dtype (a floating dtype; nullopt: x's) gives out's dtype, exactly
// to(layer_norm(x), out_dtype): a float32 input with a 16-bit out_dtype is written in that
// dtype by the kernel itself (autocast's cast for the next matmul, fused: no float32 output
// is made); any other pair computes in x's dtype, then converts.
std::tuple<Tensor, Tensor, Tensor> layer_norm(const Tensor& x, const Shape& normalized_shape,
                                              const Tensor& weight = {}, const Tensor& bias = {},
                                              double eps = 1e-5,
                                              std::optional<DType> out_dtype = std::nullopt);

// A transformer block's residual add and the layer_norm after it, in one pass:
// sum = x + residual (x's shape, no broadcasting), out = layer_norm(sum) as above. Returns
// {sum, out, mean, rstd}. sum has add's dtype; when that is x's (a 16-bit residual beside a
// float32 x, or equal dtypes) the kernel adds, rounds the sum to x's dtype, writes it and
// normalizes it without reading it back; a wider residual takes add, then layer_norm.
std::tuple<Tensor, Tensor, Tensor, Tensor> add_layer_norm(
    const Tensor& x, const Tensor& residual, const Shape& normalized_shape,
    const Tensor& weight = {}, const Tensor& bias = {}, double eps = 1e-5,
    std::optional<DType> out_dtype = std::nullopt);

// Gradients of layer_norm w.r.t. {x, weight, bias}, all in one pass over the rows. mean
// and rstd are layer_norm's. grad_out may have any floating dtype: it is read as
// to(grad_out, x.dtype()) (a 16-bit grad_out of a float32 input is widened in the kernel,
// never converted into a float32 copy); dx has x's dtype. grad_residual (x's shape; undefined:
// none) is added to dx in the same pass, before dx is rounded: add_layer_norm's backward,
// where the sum's own gradient and the normalization's meet.
std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& grad_out, const Tensor& x,
                                                       const Shape& normalized_shape,
                                                       const Tensor& mean, const Tensor& rstd,
                                                       const Tensor& weight,
                                                       std::array<bool, 3> output_mask,
                                                       const Tensor& grad_residual = {});

// add_layer_norm's backward: {d_x, d_residual, d_weight, d_bias} for the mask {x, residual,
// weight, bias}. d(sum) = grad_sum (undefined: none) + layer_norm's gradient through grad_out,
// in one pass (layer_norm_backward with grad_residual); d_x is it in sum's dtype, d_residual
// the same values in residual_dtype. When that is grad_out's 16-bit dtype beside a float32 sum
// (a transformer's bfloat16 branch output beside its float32 residual stream under autocast),
// the same pass writes that copy too, equal to to(d_x, residual_dtype); otherwise it is
// converted. mean, rstd: add_layer_norm's; sum: its first output.
std::tuple<Tensor, Tensor, Tensor, Tensor> add_layer_norm_backward(
    const Tensor& grad_sum, const Tensor& grad_out, const Tensor& sum,
    const Shape& normalized_shape, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
    DType residual_dtype, std::array<bool, 4> output_mask);

// ---- rms_norm: x * rsqrt(mean(x^2) + eps) * weight over the trailing dims ----
// eps defaults (nullopt) to the machine epsilon of x's dtype, as PyTorch.
// Returns {out, rstd}; rstd of shape [*, 1, ..., 1] as in layer_norm. out_dtype as
// layer_norm's (a 16-bit out beside a float32 x written by the kernel).
std::tuple<Tensor, Tensor> rms_norm(const Tensor& x, const Shape& normalized_shape,
                                    const Tensor& weight = {},
                                    std::optional<double> eps = std::nullopt,
                                    std::optional<DType> out_dtype = std::nullopt);

// A pre-norm block's residual add and the rms_norm after it, in one pass, as add_layer_norm:
// returns {sum, out, rstd}.
std::tuple<Tensor, Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual,
                                                const Shape& normalized_shape,
                                                const Tensor& weight = {},
                                                std::optional<double> eps = std::nullopt,
                                                std::optional<DType> out_dtype = std::nullopt);

// Gradients of rms_norm w.r.t. {x, weight}.
std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& grad_out, const Tensor& x,
                                             const Shape& normalized_shape, const Tensor& rstd,
                                             const Tensor& weight, std::array<bool, 2> output_mask);

// add_rms_norm's backward: {d_x, d_residual, d_weight} for the mask {x, residual, weight}, as
// add_layer_norm_backward's (rstd: add_rms_norm's; sum: its first output).
std::tuple<Tensor, Tensor, Tensor> add_rms_norm_backward(const Tensor& grad_sum,
                                                         const Tensor& grad_out, const Tensor& sum,
                                                         const Shape& normalized_shape,
                                                         const Tensor& rstd, const Tensor& weight,
                                                         DType residual_dtype,
                                                         std::array<bool, 3> output_mask);

// ---- batch_norm: per channel (dim 1) of x [N, C] or [N, C, *] ----
// training: normalizes with the batch's mean and biased variance, and, when running_mean
// and running_var are defined, updates them in place (not a graph operation):
//   running_mean = (1 - momentum) * running_mean + momentum * mean
//   running_var  = (1 - momentum) * running_var  + momentum * unbiased var.
// eval: normalizes with running_mean and running_var (both required).
// Returns {out, mean, invstd}, [C] each: the statistics used (batch or running), with
// invstd = 1 / sqrt(var + eps). weight, bias, running stats: [C] or undefined.
std::tuple<Tensor, Tensor, Tensor> batch_norm(const Tensor& x, const Tensor& running_mean,
                                              const Tensor& running_var, const Tensor& weight,
                                              const Tensor& bias, bool training,
                                              double momentum = 0.1, double eps = 1e-5);

// Gradients of batch_norm w.r.t. {x, weight, bias}. mean and invstd are batch_norm's;
// `training` says whether they were batch statistics (their dependence on x is then part
// of dx) or running statistics (constants).
std::tuple<Tensor, Tensor, Tensor> batch_norm_backward(const Tensor& grad_out, const Tensor& x,
                                                       const Tensor& mean, const Tensor& invstd,
                                                       const Tensor& weight, bool training,
                                                       std::array<bool, 3> output_mask);

// ---- group_norm: per (sample, group of C / groups channels) of x [N, C, *] ----
// Whether the fused kernels take these operands (group_norm_forward / _backward): x floating,
// weight and bias undefined or of x's dtype or its statistics dtype (float32 beside a 16-bit x,
// PyTorch's mixed type). Any other pair (a float64 weight beside a float32 x) keeps the
// composite (layer_norm over the groups, then the per-channel affine, with type promotion).
bool group_norm_fast_path_applies(const Tensor& x, const Tensor& weight, const Tensor& bias);

// Returns {out (x's shape, contiguous), mean, rstd}: mean and rstd [N, groups] in the
// statistics dtype, rstd = 1 / sqrt(biased var + eps). weight, bias: [C] or undefined, of a
// dtype group_norm_fast_path_applies takes. out_dtype (nullopt: x's) gives out's dtype,
// exactly group_norm(to(x, out_dtype)) for float32 beside a 16-bit x (autocast's cast,
// fused: the kernel reads the 16-bit input, no float32 copy is made); any other pair computes
// in x's dtype, then converts.
std::tuple<Tensor, Tensor, Tensor> group_norm_forward(
    const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t groups, double eps = 1e-5,
    std::optional<DType> out_dtype = std::nullopt);

// Gradients of group_norm w.r.t. {x, weight, bias} as output_mask asks (PyTorch's
// native_group_norm_backward): dx in x's dtype, dweight and dbias [C] in the statistics dtype.
// grad_out (x's shape, any floating dtype) is read as to(grad_out, x.dtype()); a float32
// grad_out beside a 16-bit x is read as is (the gradient of the fused cast's float32 output:
// dx is to(the float32 gradient, x's dtype), rounded once).
std::tuple<Tensor, Tensor, Tensor> group_norm_backward(const Tensor& grad_out, const Tensor& x,
                                                       const Tensor& mean, const Tensor& rstd,
                                                       const Tensor& weight, int64_t groups,
                                                       std::array<bool, 3> output_mask);

}  // namespace tally::ops
