// Raw ops of the softmax family: argument checks, layout normalisation (0-D as [1], the
// loss shapes as [N, C, S...] with target [N, 1, S...]), output allocation and the dispatch
// into the kernels of tensor/softmax/cpu.cpp and tensor/softmax/cuda.cu
// (their table: SoftmaxKernels, tensor/softmax/kernels.h).
#include "tensor/softmax/ops.h"

#include <fmt/format.h>

#include "base/enum_table.h"
#include "tensor/dispatch.h"
#include "tensor/op_alloc.h"
#include "tensor/softmax/kernels.h"

namespace tally::ops {

namespace {

void check_floating(const char* op, const Tensor& x) {
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(fmt::format("{}: expected a floating input, got {} {}", op,
                                            dtype_name(x.dtype()), x.shape_string()));
}

// A 0-D tensor as [1] (same storage); others unchanged.
Tensor as_1d(const Tensor& t) {
  return t.dim() == 0 ? as_strided(t, {1}, {1}, t.storage_offset()) : t;
}

Tensor softmax_impl(const OpInfo& info, const Tensor& x, int64_t dim, bool log) {
  DispatchScope scope(info, x);
  check_floating(info.name, x);
  const int64_t d = wrap_dim(dim, x.dim(), info.name);
  const Tensor xv = as_1d(x);
  Tensor out = alloc_output(xv.sizes(), x.dtype(), x.device());
  softmax_backends.get(info, x.device(), &SoftmaxKernels::softmax)(out, xv, d, log);
  return x.dim() == 0 ? view(out, {}) : out;
}

Tensor softmax_backward_impl(const OpInfo& info, const Tensor& grad, const Tensor& y, int64_t dim,
                             bool log) {
  check_same_device(info.name, grad.device(), y.device());
  DispatchScope scope(info, y);
  check_floating(info.name, y);
  if (grad.sizes() != y.sizes())
    throw std::invalid_argument(fmt::format("{}: grad {} does not match output {}", info.name,
                                            grad.shape_string(), y.shape_string()));
  const int64_t d = wrap_dim(dim, y.dim(), info.name);
  const Tensor yv = as_1d(y);
  const Tensor gv = as_1d(to(grad, y.dtype()));
  Tensor out = alloc_output(yv.sizes(), y.dtype(), y.device());
  softmax_backends.get(info, y.device(), &SoftmaxKernels::softmax_backward)(out, gv, yv, d, log);
  return y.dim() == 0 ? view(out, {}) : out;
}

// The loss ops' layout: input as [N, C, S...] (an unbatched [C] as [1, C]), target as
// [N, 1, S...], and the shape of the unreduced loss (target's).
struct LossLayout {
  Shape input_sizes;  // normalised, rank >= 2
  Tensor target;      // normalised view
  Shape loss_shape;   // reduction none
};

LossLayout loss_layout(const char* op, const Shape& input_sizes, const Tensor& target) {
  if (input_sizes.empty())
    throw std::invalid_argument(
        fmt::format("{}: input must have a class dim, got a 0-D input", op));
  if (target.dtype() != DType::int64)
    throw std::invalid_argument(fmt::format(
        "{}: target must be int64 class indices, got {} {}{}", op, dtype_name(target.dtype()),
        target.shape_string(),
        is_floating(target.dtype()) ? " (class-probability targets are not supported)" : ""));
  Shape expected = input_sizes;
  expected.erase(expected.begin() + (input_sizes.size() == 1 ? 0 : 1));
  if (target.sizes() != expected)
    throw std::invalid_argument(fmt::format("{}: input {} expects target {}, got target {}", op,
                                            shape_str(input_sizes), shape_str(expected),
                                            target.shape_string()));
  LossLayout l;
  l.loss_shape = expected;
  if (input_sizes.size() == 1) {
    l.input_sizes = {1, input_sizes[0]};
    l.target = as_strided(target, {1, 1}, {1, 1}, target.storage_offset());
  } else {
    l.input_sizes = input_sizes;
    l.target = unsqueeze(target, 1);
  }
  return l;
}

// The input as the loss kernels take it: an unbatched [C] as [1, C] (same storage).
Tensor batched(const Tensor& input) {
  if (input.dim() != 1) return input;
  const int64_t n = input.sizes()[0], st = input.strides()[0];
  return as_strided(input, {1, n}, {n * st, st}, input.storage_offset());
}

// The reduced-form shape of a loss (size 1 at the class dim) for reduction none.
Shape row_shape(const Shape& input_sizes) {
  Shape s = input_sizes;
  s[1] = 1;
  return s;
}

// cross_entropy's logits (floating) and label_smoothing (in [0, 1]).
void check_cross_entropy_args(const char* op, const Tensor& input, double eps) {
  check_floating(op, input);
  if (!(eps >= 0.0 && eps <= 1.0))
    throw std::invalid_argument(
        fmt::format("{}: label_smoothing must be between 0.0 and 1.0, got {}", op, eps));
}

// The loss gradient as the kernels take it: [N, 1, S...] (none) or 0-D, in `dtype`.
Tensor loss_grad(const char* op, const Tensor& grad, const LossLayout& l, LossReduction reduction,
                 DType dtype) {
  const Shape want = reduction == LossReduction::none ? l.loss_shape : Shape{};
  if (grad.sizes() != want)
    throw std::invalid_argument(fmt::format("{}: grad {} does not match the loss {} (reduction {})",
                                            op, grad.shape_string(), shape_str(want),
                                            loss_reduction_name(reduction)));
  const Tensor g = to(grad, dtype);
  if (reduction != LossReduction::none) return g;
  return l.input_sizes.size() == 2 && l.loss_shape.empty()
             ? as_strided(g, {1, 1}, {1, 1}, g.storage_offset())
             : unsqueeze(g, 1);
}

// Runs a loss kernel, prefixing an out-of-range target error with the op and shapes.
template <typename F>
void with_target_context(const char* op, const Shape& input_sizes, const Tensor& target, F&& f) {
  try {
    f();
  } catch (const std::out_of_range& e) {
    throw std::out_of_range(fmt::format("{}: {} (input {}, target {})", op, e.what(),
                                        shape_str(input_sizes), target.shape_string()));
  }
}

// cross_entropy_backward's `out`: input's shape, dtype and device; no storage shared with
// input unless it is input itself and the forward's lse is given (in place).
void check_backward_out(const char* op, const Tensor& out, const Tensor& input, bool with_lse) {
  const std::string shapes =
      fmt::format("out {} {} strides {}, input {} {} strides {}", dtype_name(out.dtype()),
                  out.shape_string(), shape_str(out.strides()), dtype_name(input.dtype()),
                  input.shape_string(), shape_str(input.strides()));
  if (out.sizes() != input.sizes() || out.dtype() != input.dtype())
    throw std::invalid_argument(
        fmt::format("{}: out must have input's shape and dtype ({})", op, shapes));
  check_same_device(op, out.device(), input.device());
  if (out.numel() == 0 || input.numel() == 0 || out.storage().data() != input.storage().data())
    return;
  const bool same_view = out.data_ptr() == input.data_ptr() && out.strides() == input.strides();
  if (!same_view || !with_lse)
    throw std::invalid_argument(fmt::format(
        "{}: out shares storage with input; only out = input itself (the same view) with the "
        "forward's lse may overwrite the logits in place ({}, lse {})",
        op, shapes, with_lse ? "given" : "not given"));
}

}  // namespace

// ---------------------------------------------------------------- softmax

Tensor softmax(const Tensor& x, int64_t dim) {
  static const OpInfo info("softmax");
  return softmax_impl(info, x, dim, false);
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  static const OpInfo info("log_softmax");
  return softmax_impl(info, x, dim, true);
}

Tensor softmax_backward(const Tensor& grad, const Tensor& y, int64_t dim) {
  static const OpInfo info("softmax_backward");
  return softmax_backward_impl(info, grad, y, dim, false);
}

Tensor log_softmax_backward(const Tensor& grad, const Tensor& y, int64_t dim) {
  static const OpInfo info("log_softmax_backward");
  return softmax_backward_impl(info, grad, y, dim, true);
}

// ---------------------------------------------------------------- losses

LossReduction parse_loss_reduction(const std::string& reduction, const char* op) {
  if (reduction == "mean") return LossReduction::mean;
  if (reduction == "sum") return LossReduction::sum;
  if (reduction == "none") return LossReduction::none;
  throw std::invalid_argument(
      fmt::format("{}: reduction must be 'mean', 'sum' or 'none', got '{}'", op, reduction));
}

const char* loss_reduction_name(LossReduction r) {
  static constexpr const char* kNames[] = {"none", "mean", "sum"};
  return base::enum_table<LossReduction::sum>(r, kNames, "?");
}

namespace {

// The row statistics' dtype: float32, float64 for float64 logits.
DType lse_dtype(DType input) {
  return input == DType::float64 ? DType::float64 : DType::float32;
}

// The loss's dtype: loss_dtype (input's by default), which may be float32 for float16/bfloat16
// input (autocast) and must otherwise be input's.
DType loss_out_dtype(const char* op, const Tensor& input, std::optional<DType> loss_dtype) {
  const DType out_dtype = loss_dtype.value_or(input.dtype());
  if (out_dtype != input.dtype() &&
      !(out_dtype == DType::float32 &&
        (input.dtype() == DType::float16 || input.dtype() == DType::bfloat16)))
    throw std::invalid_argument(fmt::format(
        "{}: the loss dtype must be the input's ({}), or float32 for float16/bfloat16 input; "
        "got {}",
        op, dtype_name(input.dtype()), dtype_name(out_dtype)));
  return out_dtype;
}

// cross_entropy's forward; the row log-sum-exp too when with_lse.
CrossEntropyOutput cross_entropy_impl(const Tensor& input, const Tensor& target,
                                      int64_t ignore_index, double label_smoothing,
                                      LossReduction reduction, std::optional<DType> loss_dtype,
                                      bool with_lse) {
  static const OpInfo info("cross_entropy");
  check_same_device(info.name, input.device(), target.device());
  DispatchScope scope(info, input, target);
  check_cross_entropy_args(info.name, input, label_smoothing);
  const DType out_dtype = loss_out_dtype(info.name, input, loss_dtype);
  const LossLayout l = loss_layout(info.name, input.sizes(), target);
  const Tensor x = batched(input);
  const bool none = reduction == LossReduction::none;
  CrossEntropyOutput r;
  r.loss = alloc_output(none ? row_shape(l.input_sizes) : Shape{}, out_dtype, input.device());
  if (with_lse)
    r.lse = alloc_output(row_shape(l.input_sizes), lse_dtype(input.dtype()), input.device());
  with_target_context(info.name, input.sizes(), target, [&] {
    softmax_backends.get(info, input.device(), &SoftmaxKernels::cross_entropy)(
        r.loss, r.lse, x, l.target, ignore_index, label_smoothing, reduction);
  });
  if (none) r.loss = view(r.loss, l.loss_shape);
  if (with_lse) r.lse = view(r.lse, l.loss_shape);
  return r;
}

}  // namespace

CrossEntropyOutput cross_entropy_with_lse(const Tensor& input, const Tensor& target,
                                          int64_t ignore_index, double label_smoothing,
                                          LossReduction reduction,
                                          std::optional<DType> loss_dtype) {
  return cross_entropy_impl(input, target, ignore_index, label_smoothing, reduction, loss_dtype,
                            true);
}

Tensor cross_entropy(const Tensor& input, const Tensor& target, int64_t ignore_index,
                     double label_smoothing, LossReduction reduction) {
  return cross_entropy_impl(input, target, ignore_index, label_smoothing, reduction, std::nullopt,
                            false)
      .loss;
}

Tensor cross_entropy_backward(const Tensor& grad, const Tensor& input, const Tensor& target,
                              int64_t ignore_index, double label_smoothing, LossReduction reduction,
                              const Tensor& lse, const Tensor& out) {
  static const OpInfo info("cross_entropy_backward");
  check_same_device(info.name, input.device(), target.device());
  check_same_device(info.name, input.device(), grad.device());
  DispatchScope scope(info, input, grad, target);
  check_cross_entropy_args(info.name, input, label_smoothing);
  const LossLayout l = loss_layout(info.name, input.sizes(), target);
  const Tensor x = batched(input);
  const Tensor g = loss_grad(info.name, grad, l, reduction, input.dtype());
  Tensor lse4;
  if (lse.defined()) {
    const DType want = lse_dtype(input.dtype());
    if (lse.dtype() != want || lse.sizes() != l.loss_shape)
      throw std::invalid_argument(fmt::format("{}: lse must be the forward's {} {}, got {} {}",
                                              info.name, dtype_name(want), shape_str(l.loss_shape),
                                              dtype_name(lse.dtype()), lse.shape_string()));
    check_same_device(info.name, input.device(), lse.device());
    lse4 = reshape(lse, row_shape(l.input_sizes));
  }
  if (out.defined()) check_backward_out(info.name, out, input, lse.defined());
  Tensor result =
      out.defined() ? batched(out) : alloc_output(l.input_sizes, input.dtype(), input.device());
  with_target_context(info.name, input.sizes(), target, [&] {
    softmax_backends.get(info, input.device(), &SoftmaxKernels::cross_entropy_backward)(
        result, g, x, l.target, lse4, ignore_index, label_smoothing, reduction);
  });
  return out.defined() ? out : view(result, input.sizes());
}

CrossEntropyAndGrad cross_entropy_and_backward(const Tensor& input, const Tensor& target,
                                               const Tensor& grad, int64_t ignore_index,
                                               double label_smoothing, LossReduction reduction,
                                               std::optional<DType> loss_dtype, const Tensor& out) {
  static const OpInfo info("cross_entropy_and_backward");
  check_same_device(info.name, input.device(), target.device());
  check_same_device(info.name, input.device(), grad.device());
  DispatchScope scope(info, input, grad, target);
  check_cross_entropy_args(info.name, input, label_smoothing);
  const DType out_dtype = loss_out_dtype(info.name, input, loss_dtype);
  const LossLayout l = loss_layout(info.name, input.sizes(), target);
  const Tensor x = batched(input);
  const Tensor g = loss_grad(info.name, grad, l, reduction, input.dtype());
  if (out.defined()) check_backward_out(info.name, out, input, /*with_lse=*/true);
  const bool none = reduction == LossReduction::none;
  CrossEntropyAndGrad r;
  r.loss = alloc_output(none ? row_shape(l.input_sizes) : Shape{}, out_dtype, input.device());
  r.lse = alloc_output(row_shape(l.input_sizes), lse_dtype(input.dtype()), input.device());
  Tensor gi =
      out.defined() ? batched(out) : alloc_output(l.input_sizes, input.dtype(), input.device());
  with_target_context(info.name, input.sizes(), target, [&] {
    softmax_backends.get(info, input.device(), &SoftmaxKernels::cross_entropy_and_backward)(
        r.loss, r.lse, gi, g, x, l.target, ignore_index, label_smoothing, reduction);
  });
  if (none) r.loss = view(r.loss, l.loss_shape);
  r.lse = view(r.lse, l.loss_shape);
  r.grad_input = out.defined() ? out : view(gi, input.sizes());
  return r;
}

Tensor nll_loss(const Tensor& input, const Tensor& target, int64_t ignore_index,
                LossReduction reduction) {
  static const OpInfo info("nll_loss");
  check_same_device(info.name, input.device(), target.device());
  DispatchScope scope(info, input, target);
  check_floating(info.name, input);
  const LossLayout l = loss_layout(info.name, input.sizes(), target);
  const Tensor x = batched(input);
  const bool none = reduction == LossReduction::none;
  Tensor out =
      alloc_output(none ? row_shape(l.input_sizes) : Shape{}, input.dtype(), input.device());
  with_target_context(info.name, input.sizes(), target, [&] {
    softmax_backends.get(info, input.device(), &SoftmaxKernels::nll_loss)(out, x, l.target,
                                                                          ignore_index, reduction);
  });
  return none ? view(out, l.loss_shape) : out;
}

Tensor nll_loss_backward(const Tensor& grad, const Shape& input_sizes, const Tensor& target,
                         int64_t ignore_index, LossReduction reduction) {
  static const OpInfo info("nll_loss_backward");
  check_same_device(info.name, grad.device(), target.device());
  DispatchScope scope(info, grad);
  check_floating(info.name, grad);
  const LossLayout l = loss_layout(info.name, input_sizes, target);
  const Tensor g = loss_grad(info.name, grad, l, reduction, grad.dtype());
  Tensor out = alloc_output(l.input_sizes, grad.dtype(), grad.device());
  fill_(out, 0.0);
  with_target_context(info.name, input_sizes, target, [&] {
    softmax_backends.get(info, grad.device(), &SoftmaxKernels::nll_loss_backward)(
        out, g, l.target, ignore_index, reduction);
  });
  return view(out, input_sizes);
}

}  // namespace tally::ops
