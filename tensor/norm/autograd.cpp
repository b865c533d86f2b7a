// Differentiable normalization ops: layer_norm, rms_norm, batch_norm, group_norm. Forward, what is
// saved and backward, one function each. What is saved is exactly what the wanted
// gradients need: the input and the per-row / per-channel statistics (and the weight
// for dx), never the normalized output.
#include "tensor/norm/autograd.h"

#include <tuple>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "memory/context.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

Tensor defined_if(bool keep, const Tensor& t) {
  return keep ? t : Tensor();
}

// A parameter's gradient in the parameter's dtype (undefined stays undefined).
Tensor as_param_grad(const Tensor& g, DType dtype) {
  return g.defined() ? o::to(g, dtype) : Tensor();
}

DType dtype_or(const Tensor& t, DType fallback) {
  return t.defined() ? t.dtype() : fallback;
}

// A per-channel bias's gradient: g [N, C, *] (of an input of xdim dims) summed over all but
// dim 1, in dtype.
Tensor channel_sum(const Tensor& g, int64_t xdim, DType dtype) {
  Shape dims{0};
  for (int64_t d = 2; d < xdim; ++d) dims.push_back(d);
  return o::to(o::sum(g, dims), dtype);
}

// Whether a fused residual add + norm runs as its two ops: under autocast with a 16-bit sum,
// where autocast casts the sum to float32 for the norm and the fused kernel would not.
bool autocast_splits_the_sum(const Tensor& x, const Tensor& residual) {
  if (!x.defined() || !residual.defined() || !is_floating(x.dtype()) ||
      !is_floating(residual.dtype()))
    return false;
  const DType sum = promote_types(x.dtype(), residual.dtype());
  return (sum == DType::float16 || sum == DType::bfloat16) && autocast::is_active(x.device());
}

}  // namespace

// ---------------------------------------------------------------- layer_norm

Tensor layer_norm(const Tensor& x_, const Shape& normalized_shape, const Tensor& weight_,
                  const Tensor& bias_, double eps, std::optional<DType> out_dtype, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [x, weight, bias] = autocast::fp32("layer_norm", x_, weight_, bias_);
  auto [out, mean, rstd] = o::layer_norm(x, normalized_shape, weight, bias, eps, out_dtype);
  const bool need_dx = x.requires_grad();
  const bool need_dw = weight.defined() && weight.requires_grad();
  // dbias = sum(dy) needs nothing saved; dx and dweight need x, mean, rstd; dx also weight.
  const bool save_stats = need_dx || need_dw;
  record(
      "LayerNormBackward", {x, weight, bias}, {out},
      {defined_if(save_stats, x), defined_if(save_stats, mean), defined_if(save_stats, rstd),
       defined_if(need_dx, weight)},
      [normalized_shape, xdt = x.dtype(), wdt = dtype_or(weight, x.dtype()),
       bdt = dtype_or(bias, x.dtype())](BackwardContext& ctx, const TensorList& g) -> TensorList {
        const bool mx = ctx.needs_input_grad(0), mw = ctx.needs_input_grad(1),
                   mb = ctx.needs_input_grad(2);
        if (!mx && !mw) return {Tensor(), Tensor(), o::to(o::sum_to(g[0], normalized_shape), bdt)};
        auto [dx, dw, db] =
            o::layer_norm_backward(g[0], ctx.saved(0), normalized_shape, ctx.saved(1), ctx.saved(2),
                                   ctx.saved(3), {mx, mw, mb});
        return {as_param_grad(dx, xdt), as_param_grad(dw, wdt), as_param_grad(db, bdt)};
      });
  return out;
}

std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual,
                                         const Shape& normalized_shape, const Tensor& weight_,
                                         const Tensor& bias_, double eps,
                                         std::optional<DType> out_dtype, CallSite site) {
  memory::CallSiteScope call_site(site);
  if (autocast_splits_the_sum(x, residual)) {  // the two ops, as autocast runs them
    Tensor s = add(x, residual);
    return {s, layer_norm(s, normalized_shape, weight_, bias_, eps, out_dtype)};
  }
  const auto [weight, bias] = autocast::fp32("layer_norm", weight_, bias_);
  auto [sum, out, mean, rstd] =
      o::add_layer_norm(x, residual, normalized_shape, weight, bias, eps, out_dtype);
  const bool need_d = x.requires_grad() || residual.requires_grad();
  const bool need_dw = weight.defined() && weight.requires_grad();
  const bool save_stats = need_d || need_dw;
  record(
      "AddLayerNormBackward", {x, residual, weight, bias}, {sum, out},
      {defined_if(save_stats, sum), defined_if(save_stats, mean), defined_if(save_stats, rstd),
       defined_if(need_d, weight)},
      [normalized_shape, xdt = x.dtype(), rdt = residual.dtype(), wdt = dtype_or(weight, x.dtype()),
       bdt = dtype_or(bias, x.dtype())](BackwardContext& ctx, const TensorList& g) -> TensorList {
        const bool mx = ctx.needs_input_grad(0), mr = ctx.needs_input_grad(1),
                   mw = ctx.needs_input_grad(2), mb = ctx.needs_input_grad(3);
        Tensor dx, dr, dw, db;
        if (!mx && !mr && !mw) {
          db = o::sum_to(g[1], normalized_shape);
        } else {
          // d(sum) = the normalization's gradient + the sum's own, in one pass; a 16-bit
          // residual's copy of it from the same pass.
          std::tie(dx, dr, dw, db) =
              o::add_layer_norm_backward(g[0], g[1], ctx.saved(0), normalized_shape, ctx.saved(1),
                                         ctx.saved(2), ctx.saved(3), rdt, {mx, mr, mw, mb});
        }
        return {as_param_grad(dx, xdt), as_param_grad(dr, rdt), as_param_grad(dw, wdt),
                as_param_grad(db, bdt)};
      });
  return {sum, out};
}

// ---------------------------------------------------------------- rms_norm

Tensor rms_norm(const Tensor& x_, const Shape& normalized_shape, const Tensor& weight_,
                std::optional<double> eps, std::optional<DType> out_dtype, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [x, weight] = autocast::fp32("rms_norm", x_, weight_);
  auto [out, rstd] = o::rms_norm(x, normalized_shape, weight, eps, out_dtype);
  const bool need_dx = x.requires_grad();
  record("RmsNormBackward", {x, weight}, {out}, {x, rstd, defined_if(need_dx, weight)},
         [normalized_shape, xdt = x.dtype(), wdt = dtype_or(weight, x.dtype())](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           auto [dx, dw] = o::rms_norm_backward(g[0], ctx.saved(0), normalized_shape, ctx.saved(1),
                                                ctx.saved(2),
                                                {ctx.needs_input_grad(0), ctx.needs_input_grad(1)});
           return {as_param_grad(dx, xdt), as_param_grad(dw, wdt)};
         });
  return out;
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual,
                                       const Shape& normalized_shape, const Tensor& weight_,
                                       std::optional<double> eps, std::optional<DType> out_dtype,
                                       CallSite site) {
  memory::CallSiteScope call_site(site);
  if (autocast_splits_the_sum(x, residual)) {  // the two ops, as autocast runs them
    Tensor s = add(x, residual);
    return {s, rms_norm(s, normalized_shape, weight_, eps, out_dtype)};
  }
  const Tensor weight = autocast::fp32("rms_norm", weight_)[0];
  auto [sum, out, rstd] = o::add_rms_norm(x, residual, normalized_shape, weight, eps, out_dtype);
  const bool need_d = x.requires_grad() || residual.requires_grad();
  const bool need_dw = weight.defined() && weight.requires_grad();
  const bool save_stats = need_d || need_dw;
  record(
      "AddRmsNormBackward", {x, residual, weight}, {sum, out},
      {defined_if(save_stats, sum), defined_if(save_stats, rstd), defined_if(need_d, weight)},
      [normalized_shape, xdt = x.dtype(), rdt = residual.dtype(),
       wdt = dtype_or(weight, x.dtype())](BackwardContext& ctx, const TensorList& g) -> TensorList {
        const bool mx = ctx.needs_input_grad(0), mr = ctx.needs_input_grad(1),
                   mw = ctx.needs_input_grad(2);
        Tensor dx, dr, dw;
        if (!g[1].defined()) {  // only the sum's gradient: it reaches both inputs as is
          if (mx) dx = g[0];
          if (mr) dr = g[0];
        } else {
          std::tie(dx, dr, dw) =
              o::add_rms_norm_backward(g[0], g[1], ctx.saved(0), normalized_shape, ctx.saved(1),
                                       ctx.saved(2), rdt, {mx, mr, mw});
        }
        return {as_param_grad(dx, xdt), as_param_grad(dr, rdt), as_param_grad(dw, wdt)};
      });
  return {sum, out};
}

// ---------------------------------------------------------------- batch_norm

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight, const Tensor& bias, bool training, double momentum,
                  double eps, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out, mean, invstd;
  {
    // The running-stat update inside is buffer bookkeeping, never part of the graph.
    NoGradGuard no_grad;
    std::tie(out, mean, invstd) =
        o::batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps);
  }
  const bool need_dx = x.requires_grad();
  const bool need_dw = weight.defined() && weight.requires_grad();
  // x and mean: for dweight, and for dx in training (the batch statistics depend on x).
  // Eval-mode dx = dy * weight * invstd needs only invstd and weight.
  const bool save_x = need_dw || (need_dx && training);
  record(
      "BatchNormBackward", {x, weight, bias}, {out},
      {defined_if(save_x, x), defined_if(save_x, mean), defined_if(need_dx || need_dw, invstd),
       defined_if(need_dx, weight)},
      [training, xdim = x.dim(), xdt = x.dtype(), wdt = dtype_or(weight, x.dtype()),
       bdt = dtype_or(bias, x.dtype())](BackwardContext& ctx, const TensorList& g) -> TensorList {
        const bool mx = ctx.needs_input_grad(0), mw = ctx.needs_input_grad(1),
                   mb = ctx.needs_input_grad(2);
        if (!mx && !mw) return {Tensor(), Tensor(), channel_sum(g[0], xdim, bdt)};
        auto [dx, dw, db] = o::batch_norm_backward(g[0], ctx.saved(0), ctx.saved(1), ctx.saved(2),
                                                   ctx.saved(3), training, {mx, mw, mb});
        return {as_param_grad(dx, xdt), as_param_grad(dw, wdt), as_param_grad(db, bdt)};
      });
  return out;
}

// ---------------------------------------------------------------- group_norm

Tensor group_norm(const Tensor& x_, int64_t num_groups, const Tensor& weight_, const Tensor& bias_,
                  double eps, CallSite site) {
  memory::CallSiteScope call_site(site);
  // Autocast's float32 policy for a 16-bit input is fused: the kernel reads it and writes a
  // float32 output (the same values as group_norm(to(x, float32))), and its gradient comes
  // back in the input's dtype, rounded once, without a float32 copy either way.
  const bool widen = x_.defined() && autocast::is_active(x_.device()) &&
                     (x_.dtype() == DType::bfloat16 || x_.dtype() == DType::float16);
  const auto [weight, bias] = autocast::fp32("group_norm", weight_, bias_);
  const Tensor x = widen ? x_ : autocast::fp32("group_norm", x_)[0];
  auto [out, mean, rstd] =
      o::group_norm_forward(x, weight, bias, num_groups, eps,
                            widen ? std::optional<DType>(DType::float32) : std::nullopt);
  const bool need_dx = x.requires_grad();
  const bool need_dw = weight.defined() && weight.requires_grad();
  // dbias = sum(dy) over all but the channels needs nothing saved.
  const bool save_stats = need_dx || need_dw;
  record(
      "NativeGroupNormBackward0", {x, weight, bias}, {out},
      {defined_if(save_stats, x), defined_if(save_stats, mean), defined_if(save_stats, rstd),
       defined_if(need_dx, weight)},
      [num_groups, xdim = x.dim(), xdt = x.dtype(), wdt = dtype_or(weight, x.dtype()),
       bdt = dtype_or(bias, x.dtype())](BackwardContext& ctx, const TensorList& g) -> TensorList {
        const bool mx = ctx.needs_input_grad(0), mw = ctx.needs_input_grad(1),
                   mb = ctx.needs_input_grad(2);
        if (!mx && !mw) return {Tensor(), Tensor(), channel_sum(g[0], xdim, bdt)};
        auto [dx, dw, db] = o::group_norm_backward(g[0], ctx.saved(0), ctx.saved(1), ctx.saved(2),
                                                   ctx.saved(3), num_groups, {mx, mw, mb});
        return {as_param_grad(dx, xdt), as_param_grad(dw, wdt), as_param_grad(db, bdt)};
      });
  return out;
}

}  // namespace tally
