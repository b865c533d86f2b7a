// Raw ops of the reduce family: argument checks, output allocation and the dispatch into
// the kernels of tensor/reduce/cpu.cpp and tensor/reduce/cuda.cu
// (their table: ReduceKernels, tensor/reduce/kernels.h).
#include "tensor/reduce/ops.h"

#include <fmt/format.h>

#include "tensor/dispatch.h"
#include "tensor/op_alloc.h"
#include "tensor/reduce/kernels.h"

namespace tally::ops {

namespace {

// The table fields the shared helpers below pick from (max_dim/min_dim, amax/amin).
using SelectDimKernel = decltype(&ReduceKernels::max_dim);
using MaskReduceKernel = decltype(&ReduceKernels::amax);

// A reduction's layout: the input as the kernel sees it (a 0-D input viewed as [1]), the
// reduced dims, the kernel's output shape (keepdim form) and the shape returned.
struct Plan {
  Tensor x;
  std::vector<bool> reduce;
  Shape kept;
  Shape out_shape;
};

Plan plan(const Tensor& x, const Shape& dims, bool keepdim, const char* op) {
  Plan p;
  if (x.dim() == 0) {
    for (int64_t d : dims) wrap_dim(d, 0, op);
    p.x = as_strided(x, {1}, {1}, x.storage_offset());
    p.reduce = {true};
    p.kept = {1};
    return p;  // out_shape {}
  }
  p.x = x;
  p.reduce.assign(static_cast<size_t>(x.dim()), dims.empty());
  for (int64_t d : dims) {
    const auto w = static_cast<size_t>(wrap_dim(d, x.dim(), op));
    if (p.reduce[w])
      throw std::invalid_argument(fmt::format(
          "{}: dim {} appears multiple times in the list of dims {}", op, w, shape_str(dims)));
    p.reduce[w] = true;
  }
  for (size_t i = 0; i < p.reduce.size(); ++i) {
    p.kept.push_back(p.reduce[i] ? 1 : x.sizes()[i]);
    if (keepdim || !p.reduce[i]) p.out_shape.push_back(p.kept.back());
  }
  return p;
}

// max/min/amax/amin cannot reduce an empty dim (there is no identity to return).
void check_nonempty_reduction(const Plan& p, const Tensor& x, const char* op) {
  for (size_t i = 0; i < p.reduce.size(); ++i)
    if (p.reduce[i] && p.x.sizes()[i] == 0)
      throw std::out_of_range(fmt::format("{}: cannot reduce over dim {} of size 0 (input {})", op,
                                          i, x.shape_string()));
}

// A reduced dim of stride 0 (an expanded one) holds one value over and over: its first element
// is the extreme and the first index of it, so the selections read that element alone. Exact,
// and ones(1).expand(2**62).amin() is one read rather than 2^62.
void read_repeated_values_once(Plan& p) {
  Shape sizes = p.x.sizes();
  bool narrowed = false;
  for (size_t i = 0; i < p.reduce.size(); ++i)
    if (p.reduce[i] && p.x.strides()[i] == 0 && sizes[i] > 1) {
      sizes[i] = 1;
      narrowed = true;
    }
  if (narrowed) p.x = as_strided(p.x, sizes, p.x.strides(), p.x.storage_offset());
}

ValuesIndices select_dim(const OpInfo& info, SelectDimKernel kernel, const Tensor& x, int64_t dim,
                         bool keepdim, bool want_values) {
  DispatchScope scope(info, x);
  Plan p = plan(x, {dim}, keepdim, info.name);
  check_nonempty_reduction(p, x, info.name);
  read_repeated_values_once(p);
  const int64_t d = x.dim() == 0 ? 0 : wrap_dim(dim, x.dim(), info.name);
  ValuesIndices r;
  if (want_values) r.values = alloc_output(p.kept, x.dtype(), x.device());
  r.indices = alloc_output(p.kept, DType::int64, x.device());
  reduce_backends.get(info, x.device(), kernel)(r.values, r.indices, p.x, d);
  if (p.out_shape != p.kept) {
    if (want_values) r.values = view(r.values, p.out_shape);
    r.indices = view(r.indices, p.out_shape);
  }
  return r;
}

Tensor extreme(const OpInfo& info, MaskReduceKernel kernel, const Tensor& x, const Shape& dims,
               bool keepdim) {
  DispatchScope scope(info, x);
  Plan p = plan(x, dims, keepdim, info.name);
  check_nonempty_reduction(p, x, info.name);
  read_repeated_values_once(p);
  Tensor out = alloc_output(p.kept, x.dtype(), x.device());
  reduce_backends.get(info, x.device(), kernel)(out, p.x, p.reduce);
  return p.out_shape == p.kept ? out : view(out, p.out_shape);
}

// max / min / argmax / argmin without a dim reduce every element: x must not be empty.
void check_not_empty(const OpInfo& info, const Tensor& x) {
  if (x.numel() == 0)
    throw std::invalid_argument(fmt::format("{}: expected a non-empty input without a dim, got {}",
                                            info.name, x.shape_string()));
}

Tensor flat(const Tensor& x) {
  return reshape(x, {x.numel()});
}

Tensor var_std(const OpInfo& info, const Tensor& x, const Shape& dims, double correction,
               bool keepdim, bool take_sqrt) {
  DispatchScope scope(info, x);
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(
        fmt::format("{}: only floating dtypes are supported, got {} (input {})", info.name,
                    dtype_name(x.dtype()), x.shape_string()));
  const Plan p = plan(x, dims, keepdim, info.name);
  Tensor out = alloc_output(p.kept, x.dtype(), x.device());
  reduce_backends.get(info, x.device(), &ReduceKernels::var)(out, p.x, p.reduce, correction,
                                                             take_sqrt);
  return p.out_shape == p.kept ? out : view(out, p.out_shape);
}

}  // namespace

// ---------------------------------------------------------------- selections

ValuesIndices max(const Tensor& x, int64_t dim, bool keepdim) {
  static const OpInfo info("max");
  return select_dim(info, &ReduceKernels::max_dim, x, dim, keepdim, true);
}

ValuesIndices min(const Tensor& x, int64_t dim, bool keepdim) {
  static const OpInfo info("min");
  return select_dim(info, &ReduceKernels::min_dim, x, dim, keepdim, true);
}

Tensor max(const Tensor& x) {
  static const OpInfo info("max");
  check_not_empty(info, x);
  return extreme(info, &ReduceKernels::amax, x, {}, false);
}

Tensor min(const Tensor& x) {
  static const OpInfo info("min");
  check_not_empty(info, x);
  return extreme(info, &ReduceKernels::amin, x, {}, false);
}

Tensor amax(const Tensor& x, const Shape& dims, bool keepdim) {
  static const OpInfo info("amax");
  return extreme(info, &ReduceKernels::amax, x, dims, keepdim);
}

Tensor amin(const Tensor& x, const Shape& dims, bool keepdim) {
  static const OpInfo info("amin");
  return extreme(info, &ReduceKernels::amin, x, dims, keepdim);
}

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  static const OpInfo info("argmax");
  return select_dim(info, &ReduceKernels::max_dim, x, dim, keepdim, false).indices;
}

Tensor argmin(const Tensor& x, int64_t dim, bool keepdim) {
  static const OpInfo info("argmin");
  return select_dim(info, &ReduceKernels::min_dim, x, dim, keepdim, false).indices;
}

Tensor argmax(const Tensor& x) {
  static const OpInfo info("argmax");
  check_not_empty(info, x);
  return select_dim(info, &ReduceKernels::max_dim, flat(x), 0, false, false).indices;
}

Tensor argmin(const Tensor& x) {
  static const OpInfo info("argmin");
  check_not_empty(info, x);
  return select_dim(info, &ReduceKernels::min_dim, flat(x), 0, false, false).indices;
}

// ---------------------------------------------------------------- statistics

Tensor var(const Tensor& x, const Shape& dims, double correction, bool keepdim) {
  static const OpInfo info("var");
  return var_std(info, x, dims, correction, keepdim, false);
}

Tensor std(const Tensor& x, const Shape& dims, double correction, bool keepdim) {
  static const OpInfo info("std");
  return var_std(info, x, dims, correction, keepdim, true);
}

Tensor logsumexp(const Tensor& x, const Shape& dims, bool keepdim) {
  static const OpInfo info("logsumexp");
  DispatchScope scope(info, x);
  const Tensor xf = is_floating(x.dtype()) ? x : to(x, DType::float32);
  const Plan p = plan(xf, dims, keepdim, info.name);
  Tensor out = alloc_output(p.kept, xf.dtype(), x.device());
  reduce_backends.get(info, x.device(), &ReduceKernels::logsumexp)(out, p.x, p.reduce);
  return p.out_shape == p.kept ? out : view(out, p.out_shape);
}

// ---------------------------------------------------------------- backward

Tensor value_selecting_reduction_backward(const Tensor& grad, const Tensor& indices,
                                          const Shape& input_sizes, int64_t dim, bool keepdim) {
  static const OpInfo info("value_selecting_reduction_backward");
  check_same_device(info.name, grad.device(), indices.device());
  DispatchScope scope(info, grad);
  if (indices.dtype() != DType::int64)
    throw std::invalid_argument(
        fmt::format("{}: indices must be int64, got {}", info.name, dtype_name(indices.dtype())));
  if (!is_floating(grad.dtype()))
    throw std::invalid_argument(
        fmt::format("{}: grad must be floating, got {}", info.name, dtype_name(grad.dtype())));
  const auto rank = static_cast<int64_t>(input_sizes.size());
  const int64_t d = wrap_dim(dim, rank, info.name);
  // Work in the rank-preserving form: a 0-D input as [1], reduced dim of size 1.
  const Shape in_sizes = rank == 0 ? Shape{1} : input_sizes;
  Shape kept = in_sizes;
  kept[static_cast<size_t>(d)] = 1;
  Shape expected = kept;
  if (rank == 0) {
    expected = {};
  } else if (!keepdim) {
    expected.erase(expected.begin() + d);
  }
  if (grad.sizes() != expected || indices.sizes() != expected)
    throw std::invalid_argument(fmt::format(
        "{}: grad {} and indices {} do not match input {} reduced over dim {} (keepdim={})",
        info.name, grad.shape_string(), indices.shape_string(), shape_str(input_sizes), d,
        keepdim));
  const Tensor g = expected == kept ? grad : reshape(grad, kept);
  const Tensor idx = expected == kept ? indices : reshape(indices, kept);
  Tensor out = alloc_output(in_sizes, grad.dtype(), grad.device());
  fill_(out, 0.0);
  reduce_backends.get(info, grad.device(), &ReduceKernels::value_selecting_reduction_backward)(
      out, g, idx, d);
  return rank == 0 ? view(out, {}) : out;
}

}  // namespace tally::ops
