// Raw normalization ops: argument checks, output allocation and the dispatch into the
// layer_norm / rms_norm / batch_norm kernels (tensor/norm/cpu.cpp, tensor/norm/cuda.cu).
// Device-generic: everything outside the kernels (conversions, the running-stat update,
// eval statistics) is ops on tensors of x's device; nothing reads device memory back.
#include "tensor/norm/ops.h"

#include <fmt/format.h>

#include <algorithm>

#include "tensor/dispatch.h"
#include "tensor/elementwise/ops.h"
#include "tensor/norm/kernels.h"
#include "tensor/op_alloc.h"

namespace tally::ops {

namespace {

void check_floating(const char* op, const char* what, const Tensor& t) {
  if (!is_floating(t.dtype()))
    throw std::invalid_argument(fmt::format("{}: expected a floating-point {}, got {} of shape {}",
                                            op, what, dtype_name(t.dtype()), t.shape_string()));
}

// An optional parameter (weight, bias, running stat): defined -> floating, on x's device.
void check_param(const char* op, const char* what, const Tensor& p, const Tensor& x) {
  if (!p.defined()) return;
  check_floating(op, what, p);
  check_same_device(op, x.device(), p.device());
}

// p converted to the statistics dtype, contiguous (undefined stays undefined).
Tensor as_stat(const Tensor& p, DType stat) {
  return p.defined() ? contiguous(to(p, stat)) : Tensor();
}

// out_dtype (nullopt: x's), which must be floating.
DType checked_out_dtype(const char* op, const Tensor& x, std::optional<DType> out_dtype) {
  const DType out_dt = out_dtype.value_or(x.dtype());
  if (!is_floating(out_dt))
    throw std::invalid_argument(fmt::format(
        "{}: out_dtype must be a floating dtype, got {} (input of shape {} and dtype {})", op,
        dtype_name(out_dt), x.shape_string(), dtype_name(x.dtype())));
  return out_dt;
}

// ---- layer_norm / rms_norm shared checks ----

struct RowShape {
  int64_t rows = 1, cols = 1;
  Shape stat_shape;  // x's leading dims, then a 1 per normalized dim
};

RowShape row_shape(const char* op, const Tensor& x, const Shape& normalized_shape) {
  if (normalized_shape.empty())
    throw std::invalid_argument(fmt::format(
        "{}: normalized_shape must have at least one dimension, got [] (input of shape {})", op,
        x.shape_string()));
  const auto k = static_cast<int64_t>(normalized_shape.size());
  bool ok = x.dim() >= k;
  for (int64_t i = 0; ok && i < k; ++i)
    ok =
        x.sizes()[static_cast<size_t>(x.dim() - k + i)] == normalized_shape[static_cast<size_t>(i)];
  if (!ok) {
    std::string expect = "[*";
    for (int64_t d : normalized_shape) expect += fmt::format(", {}", d);
    expect += "]";
    throw std::invalid_argument(fmt::format(
        "{}: normalized_shape {} expects an input of shape {}, but got input of shape {}", op,
        shape_str(normalized_shape), expect, x.shape_string()));
  }
  RowShape r;
  r.cols = shape_numel(normalized_shape);
  for (int64_t i = 0; i < x.dim() - k; ++i) {
    r.rows *= x.sizes()[static_cast<size_t>(i)];
    r.stat_shape.push_back(x.sizes()[static_cast<size_t>(i)]);
  }
  for (int64_t i = 0; i < k; ++i) r.stat_shape.push_back(1);
  return r;
}

void check_affine(const char* op, const char* what, const Tensor& p, const Tensor& x,
                  const Shape& normalized_shape) {
  if (!p.defined()) return;
  check_param(op, what, p, x);
  if (p.sizes() != normalized_shape)
    throw std::invalid_argument(
        fmt::format("{}: {} of shape {} does not match normalized_shape {} "
                    "(input of shape {})",
                    op, what, p.shape_string(), shape_str(normalized_shape), x.shape_string()));
}

void check_stat(const char* op, const char* what, const Tensor& s, int64_t expected,
                const Tensor& x) {
  if (!s.defined()) throw std::invalid_argument(fmt::format("{}: {} is undefined", op, what));
  check_same_device(op, x.device(), s.device());
  if (s.numel() != expected || s.dtype() != norm_stat_dtype(x.dtype()))
    throw std::invalid_argument(fmt::format(
        "{}: {} of shape {} and dtype {} does not fit input of shape {} (expected {} {} values)",
        op, what, s.shape_string(), dtype_name(s.dtype()), x.shape_string(), expected,
        dtype_name(norm_stat_dtype(x.dtype()))));
}

void check_grad_out(const char* op, const Tensor& grad_out, const Tensor& like) {
  check_floating(op, "grad_output", grad_out);
  check_same_device(op, like.device(), grad_out.device());
  if (grad_out.sizes() != like.sizes())
    throw std::invalid_argument(fmt::format("{}: grad_output of shape {} for an input of shape {}",
                                            op, grad_out.shape_string(), like.shape_string()));
}

double default_eps(DType dtype) {
  switch (dtype) {
    case DType::float64:
      return 2.220446049250313e-16;
    case DType::float16:
      return 0.0009765625;
    case DType::bfloat16:
      return 0.0078125;
    default:
      return 1.1920928955078125e-07;
  }
}

// ---- batch_norm shapes ----

void check_channels(const char* op, const char* what, const Tensor& p, const Tensor& x) {
  if (!p.defined()) return;
  check_param(op, what, p, x);
  const int64_t c = x.sizes()[1];
  if (p.dim() != 1 || p.sizes()[0] != c)
    throw std::invalid_argument(fmt::format(
        "{}: {} of shape {} does not match the {} channels of input of shape {} (expected [{}])",
        op, what, p.shape_string(), c, x.shape_string(), c));
}

void check_batch_input(const char* op, const Tensor& x) {
  check_floating(op, "input", x);
  if (x.dim() < 2)
    throw std::invalid_argument(
        fmt::format("{}: expected an input of shape [N, C] or [N, C, *], got input of shape {}", op,
                    x.shape_string()));
}

}  // namespace

DType norm_stat_dtype(DType dtype) {
  return dtype == DType::float16 || dtype == DType::bfloat16 ? DType::float32 : dtype;
}

bool norm_writes_dtype(DType x, DType other) {
  return other == x ||
         (x == DType::float32 && (other == DType::float16 || other == DType::bfloat16));
}

bool norm_widens_dtype(DType x, DType other) {
  return other == x || (other == DType::float32 && (x == DType::float16 || x == DType::bfloat16));
}

// ---------------------------------------------------------------- layer_norm

namespace {

// layer_norm, and add_layer_norm with a defined residual (x's shape, floating, add's dtype
// x's); rms_norm and add_rms_norm when not `centered` (no mean, no bias): the checks, the
// outputs and the kernel. Returns {sum (undefined without a residual), out, mean (undefined
// for rms_norm), rstd}.
std::tuple<Tensor, Tensor, Tensor, Tensor> row_layer_norm(
    const OpInfo& info, const Tensor& x, const Tensor& residual, const Shape& normalized_shape,
    const Tensor& weight, const Tensor& bias, double eps, std::optional<DType> out_dtype,
    bool centered = true) {
  DispatchScope scope(info, x, residual);
  check_floating(info.name, "input", x);
  const RowShape rs = row_shape(info.name, x, normalized_shape);
  check_affine(info.name, "weight", weight, x, normalized_shape);
  check_affine(info.name, "bias", bias, x, normalized_shape);
  const DType out_dt = checked_out_dtype(info.name, x, out_dtype);
  const bool fused = norm_writes_dtype(x.dtype(), out_dt);
  const DType o_dt = fused ? out_dt : x.dtype();
  const DType stat = norm_stat_dtype(x.dtype());
  Tensor rc, sum;
  if (residual.defined()) {
    // The kernel reads a residual of x's dtype or of out's.
    rc = contiguous(residual.dtype() == x.dtype() || residual.dtype() == o_dt
                        ? residual
                        : to(residual, x.dtype()));
    sum = alloc_output(x.sizes(), x.dtype(), x.device());
  }
  Tensor out = alloc_output(x.sizes(), o_dt, x.device());
  Tensor mean = centered ? alloc_output(rs.stat_shape, stat, x.device()) : Tensor();
  Tensor rstd = alloc_output(rs.stat_shape, stat, x.device());
  norm_backends.get(info, x.device(), &NormKernels::layer_norm)(
      out, mean, rstd, contiguous(x), as_stat(weight, stat), as_stat(bias, stat), rs.rows, rs.cols,
      eps, rc, sum);
  return {sum, fused ? out : to(out, out_dt), mean, rstd};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> layer_norm(const Tensor& x, const Shape& normalized_shape,
                                              const Tensor& weight, const Tensor& bias, double eps,
                                              std::optional<DType> out_dtype) {
  static const OpInfo info("layer_norm");
  auto [sum, out, mean, rstd] =
      row_layer_norm(info, x, Tensor(), normalized_shape, weight, bias, eps, out_dtype);
  return {out, mean, rstd};
}

namespace {

// add_layer_norm's and add_rms_norm's checks of the residual; whether the kernel can add it
// (add's dtype is x's), or the two ops must run.
bool residual_fuses(const OpInfo& info, const Tensor& x, const Tensor& residual) {
  check_floating(info.name, "input", x);
  check_floating(info.name, "residual", residual);
  check_same_device(info.name, x.device(), residual.device());
  if (residual.sizes() != x.sizes())
    throw std::invalid_argument(
        fmt::format("{}: residual of shape {} does not match input of shape {} (no broadcasting)",
                    info.name, residual.shape_string(), x.shape_string()));
  // The sum has add's dtype (type promotion); the kernel adds into x's dtype, so a wider
  // residual takes the two ops.
  return promote_types(x.dtype(), residual.dtype()) == x.dtype();
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual,
                                                          const Shape& normalized_shape,
                                                          const Tensor& weight, const Tensor& bias,
                                                          double eps,
                                                          std::optional<DType> out_dtype) {
  static const OpInfo info("add_layer_norm");
  if (!residual_fuses(info, x, residual)) {
    const Tensor s = add(x, residual);
    auto [out, mean, rstd] = layer_norm(s, normalized_shape, weight, bias, eps, out_dtype);
    return {s, out, mean, rstd};
  }
  return row_layer_norm(info, x, residual, normalized_shape, weight, bias, eps, out_dtype);
}

namespace {

// layer_norm_backward, and rms_norm_backward (centered false: no mean, no dbias): the checks,
// the gradients the mask asks for, and the kernel. Returns {dx, dx_low, dweight, dbias}: dx_low
// is dx in `low` (a 16-bit residual branch's dtype, add_layer_norm_backward), written by the
// kernel when that is grad_out's 16-bit dtype beside a float32 x, converted otherwise.
std::tuple<Tensor, Tensor, Tensor, Tensor> row_norm_backward(
    const OpInfo& info, bool centered, const Tensor& grad_out, const Tensor& x,
    const Shape& normalized_shape, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
    std::array<bool, 3> output_mask, const Tensor& grad_residual,
    std::optional<DType> low = std::nullopt) {
  DispatchScope scope(info, x);
  check_floating(info.name, "input", x);
  check_grad_out(info.name, grad_out, x);
  const RowShape rs = row_shape(info.name, x, normalized_shape);
  check_affine(info.name, "weight", weight, x, normalized_shape);
  if (centered) check_stat(info.name, "mean", mean, rs.rows, x);
  if (grad_residual.defined()) {
    check_floating(info.name, "grad_residual", grad_residual);
    check_same_device(info.name, x.device(), grad_residual.device());
    if (grad_residual.sizes() != x.sizes())
      throw std::invalid_argument(
          fmt::format("{}: grad_residual of shape {} for an input of shape {}", info.name,
                      grad_residual.shape_string(), x.shape_string()));
  }
  check_stat(info.name, "rstd", rstd, rs.rows, x);
  const DType stat = norm_stat_dtype(x.dtype());
  const bool widened = norm_writes_dtype(x.dtype(), grad_out.dtype());
  Tensor dx = output_mask[0] ? alloc_output(x.sizes(), x.dtype(), x.device()) : Tensor();
  Tensor dw = output_mask[1] ? alloc_output(normalized_shape, stat, x.device()) : Tensor();
  Tensor db = output_mask[2] ? alloc_output(normalized_shape, stat, x.device()) : Tensor();
  const bool low_in_kernel =
      dx.defined() && low && *low != x.dtype() && widened && *low == grad_out.dtype();
  Tensor dx_low = low_in_kernel ? alloc_output(x.sizes(), *low, x.device()) : Tensor();
  if (dx.defined() || dw.defined() || db.defined())
    norm_backends.get(info, x.device(), &NormKernels::layer_norm_backward)(
        dx, dw, db, contiguous(widened ? grad_out : to(grad_out, x.dtype())), contiguous(x),
        centered ? contiguous(mean) : Tensor(), contiguous(rstd), as_stat(weight, stat), rs.rows,
        rs.cols,
        dx.defined() && grad_residual.defined() ? contiguous(to(grad_residual, x.dtype()))
                                                : Tensor(),
        dx_low);
  if (dx.defined() && low && !low_in_kernel) dx_low = to(dx, *low);
  return {dx, dx_low, dw, db};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& grad_out, const Tensor& x,
                                                       const Shape& normalized_shape,
                                                       const Tensor& mean, const Tensor& rstd,
                                                       const Tensor& weight,
                                                       std::array<bool, 3> output_mask,
                                                       const Tensor& grad_residual) {
  static const OpInfo info("layer_norm_backward");
  const auto grads = row_norm_backward(info, true, grad_out, x, normalized_shape, mean, rstd,
                                       weight, output_mask, grad_residual);
  return {std::get<0>(grads), std::get<2>(grads), std::get<3>(grads)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> add_layer_norm_backward(
    const Tensor& grad_sum, const Tensor& grad_out, const Tensor& sum,
    const Shape& normalized_shape, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
    DType residual_dtype, std::array<bool, 4> output_mask) {
  static const OpInfo info("add_layer_norm_backward");
  if (!is_floating(residual_dtype))
    throw std::invalid_argument(fmt::format("{}: residual dtype {} is not a floating dtype",
                                            info.name, dtype_name(residual_dtype)));
  const bool md = output_mask[0] || output_mask[1];
  auto [d, d_low, dw, db] = row_norm_backward(
      info, true, grad_out, sum, normalized_shape, mean, rstd, weight,
      {md, output_mask[2], output_mask[3]}, grad_sum,
      output_mask[1] && residual_dtype != sum.dtype() ? std::optional<DType>(residual_dtype)
                                                      : std::nullopt);
  Tensor d_residual = output_mask[1] ? (d_low.defined() ? d_low : d) : Tensor();
  return {output_mask[0] ? d : Tensor(), d_residual, dw, db};
}

// ---------------------------------------------------------------- rms_norm

std::tuple<Tensor, Tensor> rms_norm(const Tensor& x, const Shape& normalized_shape,
                                    const Tensor& weight, std::optional<double> eps,
                                    std::optional<DType> out_dtype) {
  static const OpInfo info("rms_norm");
  check_floating(info.name, "input", x);
  auto [sum, out, mean, rstd] =
      row_layer_norm(info, x, Tensor(), normalized_shape, weight, Tensor(),
                     eps ? *eps : default_eps(x.dtype()), out_dtype, /*centered=*/false);
  return {out, rstd};
}

std::tuple<Tensor, Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual,
                                                const Shape& normalized_shape, const Tensor& weight,
                                                std::optional<double> eps,
                                                std::optional<DType> out_dtype) {
  static const OpInfo info("add_rms_norm");
  if (!residual_fuses(info, x, residual)) {
    const Tensor s = add(x, residual);
    auto [out, rstd] = rms_norm(s, normalized_shape, weight, eps, out_dtype);
    return {s, out, rstd};
  }
  auto [sum, out, mean, rstd] =
      row_layer_norm(info, x, residual, normalized_shape, weight, Tensor(),
                     eps ? *eps : default_eps(x.dtype()), out_dtype, /*centered=*/false);
  return {sum, out, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& grad_out, const Tensor& x,
                                             const Shape& normalized_shape, const Tensor& rstd,
                                             const Tensor& weight,
                                             std::array<bool, 2> output_mask) {
  static const OpInfo info("rms_norm_backward");
  const auto grads = row_norm_backward(info, false, grad_out, x, normalized_shape, Tensor(), rstd,
                                       weight, {output_mask[0], output_mask[1], false}, Tensor());
  return {std::get<0>(grads), std::get<2>(grads)};
}

std::tuple<Tensor, Tensor, Tensor> add_rms_norm_backward(const Tensor& grad_sum,
                                                         const Tensor& grad_out, const Tensor& sum,
                                                         const Shape& normalized_shape,
                                                         const Tensor& rstd, const Tensor& weight,
                                                         DType residual_dtype,
                                                         std::array<bool, 3> output_mask) {
  static const OpInfo info("add_rms_norm_backward");
  if (!is_floating(residual_dtype))
    throw std::invalid_argument(fmt::format("{}: residual dtype {} is not a floating dtype",
                                            info.name, dtype_name(residual_dtype)));
  const bool md = output_mask[0] || output_mask[1];
  auto [d, d_low, dw, db] = row_norm_backward(
      info, false, grad_out, sum, normalized_shape, Tensor(), rstd, weight,
      {md, output_mask[2], false}, grad_sum,
      output_mask[1] && residual_dtype != sum.dtype() ? std::optional<DType>(residual_dtype)
                                                      : std::nullopt);
  Tensor d_residual = output_mask[1] ? (d_low.defined() ? d_low : d) : Tensor();
  return {output_mask[0] ? d : Tensor(), d_residual, dw};
}

// ---------------------------------------------------------------- batch_norm

std::tuple<Tensor, Tensor, Tensor> batch_norm(const Tensor& x, const Tensor& running_mean,
                                              const Tensor& running_var, const Tensor& weight,
                                              const Tensor& bias, bool training, double momentum,
                                              double eps) {
  static const OpInfo info("batch_norm");
  DispatchScope scope(info, x);
  check_batch_input(info.name, x);
  check_channels(info.name, "weight", weight, x);
  check_channels(info.name, "bias", bias, x);
  check_channels(info.name, "running_mean", running_mean, x);
  check_channels(info.name, "running_var", running_var, x);
  if (running_mean.defined() != running_var.defined())
    throw std::invalid_argument(fmt::format(
        "{}: running_mean and running_var must be both defined or both undefined (input of "
        "shape {})",
        info.name, x.shape_string()));
  const int64_t c = x.sizes()[1];
  const int64_t count = x.numel() / std::max<int64_t>(c, 1);
  if (training && count == 1 && c > 0)
    throw std::invalid_argument(fmt::format(
        "{}: Expected more than 1 value per channel when training, got input of shape {}",
        info.name, x.shape_string()));
  if (!training && !running_mean.defined())
    throw std::invalid_argument(fmt::format(
        "{}: running_mean and running_var must be defined in evaluation mode (input of shape {})",
        info.name, x.shape_string()));
  const DType stat = norm_stat_dtype(x.dtype());
  const MemoryFormat f = x.suggest_memory_format();
  const MemoryFormat kf = kernel_memory_format(x.device(), f);
  const Tensor xc = contiguous(x, kf);
  Tensor mean, invstd;
  if (training) {
    mean = alloc_output({c}, stat, x.device());
    invstd = alloc_output({c}, stat, x.device());
    Tensor var = alloc_output({c}, stat, x.device());
    // The running statistics move inside the statistics kernel when they are contiguous
    // buffers of the stat dtype on x's device (as nn::BatchNorm2d's are); else in four ops.
    const bool fuse_running = running_mean.defined() && count > 0 && running_mean.dtype() == stat &&
                              running_var.dtype() == stat && running_mean.device() == x.device() &&
                              running_var.device() == x.device() && running_mean.is_contiguous() &&
                              running_var.is_contiguous();
    norm_backends.get(info, x.device(), &NormKernels::batch_norm_stats)(
        mean, var, invstd, xc, eps, fuse_running ? running_mean : Tensor(),
        fuse_running ? running_var : Tensor(), momentum);
    if (fuse_running) {
      running_mean.storage().bump_version();
      running_var.storage().bump_version();
    }
    if (running_mean.defined() && count > 0 && !fuse_running) {
      // running = (1 - momentum) * running + momentum * batch (variance unbiased)
      mul_(running_mean, 1.0 - momentum);
      add_(running_mean, mean, momentum);
      mul_(running_var, 1.0 - momentum);
      add_(running_var, var,
           momentum * static_cast<double>(count) / static_cast<double>(count - 1));
    }
  } else {
    mean = to(running_mean, x.device(), stat, /*copy=*/true);
    invstd = unary(UnaryOp::rsqrt, add(to(running_var, stat), eps));
  }
  Tensor out = alloc_output(x.sizes(), x.dtype(), x.device(), kf);
  norm_backends.get(info, x.device(), &NormKernels::batch_norm_elemt)(
      out, xc, contiguous(mean), contiguous(invstd), as_stat(weight, stat), as_stat(bias, stat));
  return {contiguous(out, f), mean, invstd};
}

std::tuple<Tensor, Tensor, Tensor> batch_norm_backward(const Tensor& grad_out, const Tensor& x,
                                                       const Tensor& mean, const Tensor& invstd,
                                                       const Tensor& weight, bool training,
                                                       std::array<bool, 3> output_mask) {
  static const OpInfo info("batch_norm_backward");
  DispatchScope scope(info, grad_out);
  check_batch_input(info.name, grad_out);
  const bool need_x = output_mask[1] || (output_mask[0] && training);
  if (need_x && !x.defined())
    throw std::invalid_argument(fmt::format(
        "{}: the input is needed for these gradients but is undefined (grad_output of shape {})",
        info.name, grad_out.shape_string()));
  if (x.defined()) {
    check_batch_input(info.name, x);
    check_grad_out(info.name, grad_out, x);
  }
  // dy in the input's dtype (when the input is known), like the gradient dx; all in the
  // input's layout (channels_last stays so).
  const MemoryFormat f = (x.defined() ? x : grad_out).suggest_memory_format();
  const MemoryFormat kf = kernel_memory_format(grad_out.device(), f);
  const Tensor dy = contiguous(x.defined() ? to(grad_out, x.dtype()) : grad_out, kf);
  const int64_t c = dy.sizes()[1];
  const DType stat = norm_stat_dtype(dy.dtype());
  if (need_x) check_stat(info.name, "mean", mean, c, dy);
  check_stat(info.name, "invstd", invstd, c, dy);
  check_channels(info.name, "weight", weight, dy);
  Tensor dx = output_mask[0] ? alloc_output(dy.sizes(), dy.dtype(), dy.device(), kf) : Tensor();
  Tensor dw = output_mask[1] ? alloc_output({c}, stat, dy.device()) : Tensor();
  Tensor db = output_mask[2] ? alloc_output({c}, stat, dy.device()) : Tensor();
  if (dx.defined() || dw.defined() || db.defined())
    norm_backends.get(info, dy.device(), &NormKernels::batch_norm_backward)(
        dx, dw, db, dy, need_x ? contiguous(x, kf) : Tensor(), need_x ? contiguous(mean) : Tensor(),
        contiguous(invstd), as_stat(weight, stat), training);
  return {dx.defined() ? contiguous(dx, f) : dx, dw, db};
}

// ---------------------------------------------------------------- group_norm

namespace {

// [N, C, *] with C divisible by groups > 0; weight and bias [C] when defined.
void check_group_norm(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias,
                      int64_t groups) {
  check_floating(op, "input", x);
  if (x.dim() < 2)
    throw std::invalid_argument(
        fmt::format("{}: expected an input of at least 2 dims [N, C, *], got input of shape {}", op,
                    x.shape_string()));
  const int64_t c = x.sizes()[1];
  if (groups <= 0 || c % groups != 0)
    throw std::invalid_argument(
        fmt::format("{}: num_channels {} of input of shape {} must be divisible by num_groups {}",
                    op, c, x.shape_string(), groups));
  check_channels(op, "weight", weight, x);
  check_channels(op, "bias", bias, x);
}

bool fast_param(const Tensor& p, DType x) {
  return !p.defined() || p.dtype() == x || p.dtype() == norm_stat_dtype(x);
}

}  // namespace

bool group_norm_fast_path_applies(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return is_floating(x.dtype()) && fast_param(weight, x.dtype()) && fast_param(bias, x.dtype());
}

std::tuple<Tensor, Tensor, Tensor> group_norm_forward(const Tensor& x, const Tensor& weight,
                                                      const Tensor& bias, int64_t groups,
                                                      double eps, std::optional<DType> out_dtype) {
  static const OpInfo info("group_norm");
  DispatchScope scope(info, x);
  check_group_norm(info.name, x, weight, bias, groups);
  if (!group_norm_fast_path_applies(x, weight, bias))
    throw std::invalid_argument(fmt::format(
        "{}: weight/bias of dtype {}/{} beside an input of dtype {} (expected {} or {})", info.name,
        weight.defined() ? dtype_name(weight.dtype()) : "none",
        bias.defined() ? dtype_name(bias.dtype()) : "none", dtype_name(x.dtype()),
        dtype_name(x.dtype()), dtype_name(norm_stat_dtype(x.dtype()))));
  const DType out_dt = checked_out_dtype(info.name, x, out_dtype);
  const bool fused = norm_widens_dtype(x.dtype(), out_dt);
  const DType stat = norm_stat_dtype(x.dtype());
  Tensor out = alloc_output(x.sizes(), fused ? out_dt : x.dtype(), x.device());
  Tensor mean = alloc_output({x.sizes()[0], groups}, stat, x.device());
  Tensor rstd = alloc_output({x.sizes()[0], groups}, stat, x.device());
  norm_backends.get(info, x.device(), &NormKernels::group_norm)(
      out, mean, rstd, contiguous(x), as_stat(weight, stat), as_stat(bias, stat), groups, eps);
  return {fused ? out : to(out, out_dt), mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> group_norm_backward(const Tensor& grad_out, const Tensor& x,
                                                       const Tensor& mean, const Tensor& rstd,
                                                       const Tensor& weight, int64_t groups,
                                                       std::array<bool, 3> output_mask) {
  static const OpInfo info("group_norm_backward");
  DispatchScope scope(info, x);
  check_group_norm(info.name, x, weight, Tensor(), groups);
  check_grad_out(info.name, grad_out, x);
  check_stat(info.name, "mean", mean, x.sizes()[0] * groups, x);
  check_stat(info.name, "rstd", rstd, x.sizes()[0] * groups, x);
  const DType stat = norm_stat_dtype(x.dtype());
  const int64_t c = x.sizes()[1];
  Tensor dx = output_mask[0] ? alloc_output(x.sizes(), x.dtype(), x.device()) : Tensor();
  Tensor dw = output_mask[1] ? alloc_output({c}, stat, x.device()) : Tensor();
  Tensor db = output_mask[2] ? alloc_output({c}, stat, x.device()) : Tensor();
  if (dx.defined() || dw.defined() || db.defined())
    norm_backends.get(info, x.device(), &NormKernels::group_norm_backward)(
        dx, dw, db,
        contiguous(norm_widens_dtype(x.dtype(), grad_out.dtype()) ? grad_out
                                                                  : to(grad_out, x.dtype())),
        contiguous(x), contiguous(mean), contiguous(rstd),
        dx.defined() ? as_stat(weight, stat) : Tensor(), groups);
  return {dx, dw, db};
}

}  // namespace tally::ops
