// Raw ops of the index family: argument checks, output allocation and the dispatch into the
// kernels of tensor/index/cpu.cpp and tensor/index/cuda.cu (their table: IndexKernels,
// tensor/index/kernels.h).
#include "tensor/index/ops.h"

#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "tensor/dispatch.h"
#include "tensor/index/kernels.h"
#include "tensor/op_alloc.h"

namespace tally::ops {

namespace {

// index as int64 on x's device (int32 converted; anything else is an error naming the op).
Tensor int64_index(const Tensor& index, const Tensor& x, const char* op) {
  if (index.dtype() != DType::int64 && index.dtype() != DType::int32)
    throw std::invalid_argument(fmt::format("{}: index must be int64 or int32, got {} {}", op,
                                            dtype_name(index.dtype()), index.shape_string()));
  check_same_device(op, x.device(), index.device());
  return index.dtype() == DType::int64 ? index : to(index, DType::int64);
}

// A 0-D tensor as a 1-element 1-D view (gather/scatter treat 0-D operands as [1]).
Tensor as_1d(const Tensor& t) {
  return t.dim() == 0 ? as_strided(t, {1}, {1}, t.storage_offset()) : t;
}

// gather/scatter's shape rules: index has x's rank, index.size(d) <= other.size(d) for every
// d != dim (and <= src.size(d) for every d when src is given).
void check_index_shape(const char* op, const Tensor& x, const Tensor& index, int64_t dim,
                       const Tensor* src) {
  if (index.dim() != x.dim())
    throw std::invalid_argument(fmt::format("{}: index {} must have the input's rank ({})", op,
                                            index.shape_string(), x.shape_string()));
  for (int64_t d = 0; d < x.dim(); ++d) {
    const auto u = static_cast<size_t>(d);
    if (d != dim && index.sizes()[u] > x.sizes()[u])
      throw std::invalid_argument(fmt::format("{}: index {} is larger than the input {} at dim {}",
                                              op, index.shape_string(), x.shape_string(), d));
    if (src && index.sizes()[u] > src->sizes()[u])
      throw std::invalid_argument(fmt::format("{}: index {} is larger than src {} at dim {}", op,
                                              index.shape_string(), src->shape_string(), d));
  }
}

// A view of the 1-D `index` (stride s) with `shape`, varying only along dim (index_select's
// and index_add's index as gather/scatter take it).
Tensor index_along(const Tensor& index, const Shape& shape, int64_t dim) {
  Shape strides(shape.size(), 0);
  strides[static_cast<size_t>(dim)] = index.strides()[0];
  return as_strided(index, shape, strides, index.storage_offset());
}

Tensor index_1d(const Tensor& index, const Tensor& x, const char* op) {
  Tensor i = int64_index(index, x, op);
  if (i.dim() > 1)
    throw std::invalid_argument(
        fmt::format("{}: index must be 0-D or 1-D, got {}", op, i.shape_string()));
  return as_1d(i);
}

// PyTorch's scatter reduce argument: "" (replace), "add" or "sum", "multiply".
ScatterReduce scatter_reduce_of(const std::string& reduce, const char* op) {
  if (reduce.empty()) return ScatterReduce::none;
  if (reduce == "add" || reduce == "sum") return ScatterReduce::add;
  if (reduce == "multiply") return ScatterReduce::multiply;
  throw std::invalid_argument(
      fmt::format("{}: reduce must be 'add', 'sum' or 'multiply', got '{}'", op, reduce));
}

// A scatter's operands once checked: index (int64) and src as gather/scatter take them
// (0-D as [1]) and dim wrapped.
struct ScatterArgs {
  Tensor index, src;
  int64_t dim = 0;
};

ScatterArgs check_scatter(const OpInfo& info, const Tensor& x, int64_t dim, const Tensor& index,
                          const Tensor& src, ScatterReduce reduce) {
  ScatterArgs a{as_1d(int64_index(index, x, info.name)), as_1d(src), 0};
  const Tensor x1 = as_1d(x);
  a.dim = wrap_dim(dim, x1.dim(), info.name);
  check_same_device(info.name, x.device(), src.device());
  if (src.dtype() != x.dtype())
    throw std::invalid_argument(fmt::format("{}: src's dtype {} must be the input's ({})",
                                            info.name, dtype_name(src.dtype()),
                                            dtype_name(x.dtype())));
  if (reduce == ScatterReduce::add && x.dtype() == DType::bool_)
    throw std::invalid_argument(fmt::format("{}: bool tensors cannot be added", info.name));
  check_index_shape(info.name, x1, a.index, a.dim, &a.src);
  return a;
}

// Writes the checked scatter into out (x itself, or its copy).
void run_scatter(const OpInfo& info, const Tensor& out, const ScatterArgs& a, ScatterReduce reduce,
                 double alpha) {
  if (a.index.numel() == 0) return;
  index_backends.get(info, out.device(), &IndexKernels::scatter)(as_1d(out), a.src, a.index, a.dim,
                                                                 reduce, alpha);
}

Tensor scatter_impl(const OpInfo& info, const Tensor& x, int64_t dim, const Tensor& index,
                    const Tensor& src, ScatterReduce reduce) {
  DispatchScope scope(info, x, index, src);
  const ScatterArgs a = check_scatter(info, x, dim, index, src, reduce);
  Tensor out = clone(x);
  run_scatter(info, out, a, reduce, 1.0);
  return out;
}

void scatter_in_place(const OpInfo& info, const Tensor& x, int64_t dim, const Tensor& index,
                      const Tensor& src, ScatterReduce reduce) {
  DispatchScope scope(info, x, index, src);
  run_scatter(info, x, check_scatter(info, x, dim, index, src, reduce), reduce, 1.0);
  x.storage().bump_version();
}

// A scalar scatter's src: value in x's dtype, expanded to index's shape.
Tensor value_src(const Tensor& x, const Tensor& index, double value) {
  return expand(full({}, value, x.dtype(), x.device()), index.sizes());
}

// index_add / index_fill's operands once checked: the index as gather/scatter take it (a
// view of the 1-D index with `want`'s shape, varying along dim) and source's wanted shape.
struct IndexArgs {
  Tensor index;
  Shape want;
  int64_t dim = 0;
};

IndexArgs check_index_1d(const char* op, const Tensor& x, int64_t dim, const Tensor& index) {
  const Tensor x1 = as_1d(x), i1 = index_1d(index, x, op);
  IndexArgs a;
  a.dim = wrap_dim(dim, x1.dim(), op);
  a.want = x1.sizes();
  a.want[static_cast<size_t>(a.dim)] = i1.numel();
  a.index = index_along(i1, a.want, a.dim);
  return a;
}

IndexArgs check_index_add(const char* op, const Tensor& x, int64_t dim, const Tensor& index,
                          const Tensor& source) {
  IndexArgs a = check_index_1d(op, x, dim, index);
  check_same_device(op, x.device(), source.device());
  if (source.dtype() != x.dtype() || x.dtype() == DType::bool_)
    throw std::invalid_argument(
        fmt::format("{}: source's dtype {} must be the input's ({}), not bool", op,
                    dtype_name(source.dtype()), dtype_name(x.dtype())));
  if (as_1d(source).sizes() != a.want)
    throw std::invalid_argument(fmt::format(
        "{}: source {} must be {} (the input {} with index's {} entries at dim {})", op,
        source.shape_string(), shape_str(a.want), x.shape_string(), a.index.size(a.dim), a.dim));
  return a;
}

void run_index(const OpInfo& info, const Tensor& out, const IndexArgs& a, const Tensor& src,
               ScatterReduce reduce, double alpha) {
  if (shape_numel(a.want) == 0) return;
  index_backends.get(info, out.device(), &IndexKernels::scatter)(as_1d(out), as_1d(src), a.index,
                                                                 a.dim, reduce, alpha);
}

// The mask broadcast to `shape` and its inclusive running count (int64, contiguous).
struct MaskPlan {
  Tensor mask;
  Tensor positions;
  int64_t count = 0;
};

MaskPlan plan_mask(const char* op, const Tensor& mask, const Shape& shape, Device device,
                   bool need_count) {
  if (mask.dtype() != DType::bool_)
    throw std::invalid_argument(
        fmt::format("{}: mask must be bool, got {}", op, dtype_name(mask.dtype())));
  check_same_device(op, device, mask.device());
  if (need_count && device.type == DeviceType::meta)
    throw std::invalid_argument(fmt::format(
        "{}: the number of selected elements depends on the mask's values, which a meta "
        "tensor does not have (mask {})",
        op, mask.shape_string()));
  MaskPlan p;
  p.mask = expand(mask, shape);
  const Tensor flat = reshape(to(p.mask, DType::int64), {shape_numel(shape)});
  p.positions = cumsum(flat, 0);
  if (need_count && flat.numel() > 0)
    p.count = static_cast<int64_t>(item(select(p.positions, 0, flat.numel() - 1)));
  return p;
}

}  // namespace

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  static const OpInfo info("gather");
  DispatchScope scope(info, x, index);
  const Tensor x1 = as_1d(x), i1 = as_1d(int64_index(index, x, info.name));
  const int64_t d = wrap_dim(dim, x1.dim(), info.name);
  check_index_shape(info.name, x1, i1, d, nullptr);
  if (i1.numel() > 0 && x1.sizes()[static_cast<size_t>(d)] == 0)
    throw std::out_of_range(
        fmt::format("gather: index into dim {} of size 0 (input {})", d, x.shape_string()));
  Tensor out = alloc_output(i1.sizes(), x.dtype(), x.device());
  if (out.numel() > 0) index_backends.get(info, x.device(), &IndexKernels::gather)(out, x1, i1, d);
  return index.dim() == 0 ? view(out, {}) : out;
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
               const std::string& reduce) {
  static const OpInfo info("scatter");
  return scatter_impl(info, x, dim, index, src, scatter_reduce_of(reduce, info.name));
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, double value,
               const std::string& reduce) {
  return scatter(x, dim, index, value_src(x, index, value), reduce);
}

void scatter_(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
              const std::string& reduce) {
  static const OpInfo info("scatter_");
  scatter_in_place(info, x, dim, index, src, scatter_reduce_of(reduce, info.name));
}

void scatter_(const Tensor& x, int64_t dim, const Tensor& index, double value,
              const std::string& reduce) {
  scatter_(x, dim, index, value_src(x, index, value), reduce);
}

Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  static const OpInfo info("scatter_add");
  return scatter_impl(info, x, dim, index, src, ScatterReduce::add);
}

void scatter_add_(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  static const OpInfo info("scatter_add_");
  scatter_in_place(info, x, dim, index, src, ScatterReduce::add);
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  static const OpInfo info("index_select");
  DispatchScope scope(info, x, index);
  const IndexArgs a = check_index_1d(info.name, x, dim, index);
  const Tensor x1 = as_1d(x);
  if (a.index.size(a.dim) > 0 && x1.size(a.dim) == 0)
    throw std::out_of_range(fmt::format("index_select: index into dim {} of size 0 (input {})",
                                        a.dim, x.shape_string()));
  Tensor out = alloc_output(a.want, x.dtype(), x.device());
  if (out.numel() > 0)
    index_backends.get(info, x.device(), &IndexKernels::gather)(out, x1, a.index, a.dim);
  return x.dim() == 0 ? view(out, {}) : out;
}

Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& source,
                 double alpha) {
  static const OpInfo info("index_add");
  DispatchScope scope(info, x, index, source);
  const IndexArgs a = check_index_add(info.name, x, dim, index, source);
  Tensor out = clone(x);
  run_index(info, out, a, source, ScatterReduce::add, alpha);
  return out;
}

void index_add_(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& source,
                double alpha) {
  static const OpInfo info("index_add_");
  DispatchScope scope(info, x, index, source);
  run_index(info, x, check_index_add(info.name, x, dim, index, source), source, ScatterReduce::add,
            alpha);
  x.storage().bump_version();
}

Tensor index_fill(const Tensor& x, int64_t dim, const Tensor& index, double value) {
  static const OpInfo info("index_fill");
  DispatchScope scope(info, x, index);
  const IndexArgs a = check_index_1d(info.name, x, dim, index);
  Tensor out = clone(x);
  run_index(info, out, a, expand(full({}, value, x.dtype(), x.device()), a.want),
            ScatterReduce::none, 1.0);
  return out;
}

void index_fill_(const Tensor& x, int64_t dim, const Tensor& index, double value) {
  static const OpInfo info("index_fill_");
  DispatchScope scope(info, x, index);
  const IndexArgs a = check_index_1d(info.name, x, dim, index);
  run_index(info, x, a, expand(full({}, value, x.dtype(), x.device()), a.want), ScatterReduce::none,
            1.0);
  x.storage().bump_version();
}

namespace {

// cumsum / cumprod: x's dtype for floating x, int64 otherwise.
Tensor scan(const OpInfo& info, const Tensor& x, int64_t dim, bool reverse, bool prod) {
  DispatchScope scope(info, x);
  const Tensor x1 = as_1d(x);
  const int64_t d = wrap_dim(dim, x1.dim(), info.name);
  const DType dt = is_floating(x.dtype()) ? x.dtype() : DType::int64;
  Tensor out = alloc_output(x1.sizes(), dt, x.device());
  if (out.numel() > 0)
    index_backends.get(info, x.device(), &IndexKernels::scan)(out, x1, d, reverse, prod);
  return x.dim() == 0 ? view(out, {}) : out;
}

}  // namespace

Tensor cumsum(const Tensor& x, int64_t dim, bool reverse) {
  static const OpInfo info("cumsum");
  return scan(info, x, dim, reverse, false);
}

Tensor cumprod(const Tensor& x, int64_t dim) {
  static const OpInfo info("cumprod");
  return scan(info, x, dim, false, true);
}

ValuesIndices sort(const Tensor& x, int64_t dim, bool descending) {
  static const OpInfo info("sort");
  DispatchScope scope(info, x);
  const Tensor x1 = as_1d(x);
  const int64_t d = wrap_dim(dim, x1.dim(), info.name);
  ValuesIndices r{alloc_output(x1.sizes(), x.dtype(), x.device()),
                  alloc_output(x1.sizes(), DType::int64, x.device())};
  if (x1.numel() > 0)
    index_backends.get(info, x.device(), &IndexKernels::sort)(r.values, r.indices, x1, d,
                                                              descending);
  if (x.dim() == 0) r = {view(r.values, {}), view(r.indices, {})};
  return r;
}

ValuesIndices topk(const Tensor& x, int64_t k, int64_t dim, bool largest, bool sorted) {
  static const OpInfo info("topk");
  (void)sorted;  // always sorted: the order sort gives
  DispatchScope scope(info, x);
  const Tensor x1 = as_1d(x);
  const int64_t d = wrap_dim(dim, x1.dim(), info.name);
  const int64_t n = x1.sizes()[static_cast<size_t>(d)];
  if (k < 0 || k > n)
    throw std::out_of_range(fmt::format("topk: k ({}) is out of range for dim {} of size {} ({})",
                                        k, d, n, x.shape_string()));
  ValuesIndices s = sort(x1, d, largest);
  if (k == n) return x.dim() == 0 ? ValuesIndices{view(s.values, {}), view(s.indices, {})} : s;
  return {contiguous(narrow(s.values, d, 0, k)), contiguous(narrow(s.indices, d, 0, k))};
}

namespace {

Tensor remap(const OpInfo& info, const Tensor& x, const std::vector<bool>& flip,
             const std::vector<int64_t>& shift) {
  if (x.dim() > 10)
    throw std::invalid_argument(
        fmt::format("{}: at most 10 dims, got {}", info.name, x.shape_string()));
  Tensor out = alloc_output(x.sizes(), x.dtype(), x.device());
  if (out.numel() > 0)
    index_backends.get(info, x.device(), &IndexKernels::remap)(out, x, flip, shift);
  return out;
}

}  // namespace

Tensor flip(const Tensor& x, const Shape& dims) {
  static const OpInfo info("flip");
  DispatchScope scope(info, x);
  // A 0-D tensor takes dim 0 / -1 (itself, as wrap_dim allows): checked, then nothing flips.
  std::vector<bool> f(static_cast<size_t>(std::max<int64_t>(x.dim(), 1)), false);
  for (int64_t d : dims) {
    const auto w = static_cast<size_t>(wrap_dim(d, x.dim(), info.name));
    if (f[w])
      throw std::invalid_argument(
          fmt::format("flip: dim {} appears multiple times in dims {}", w, shape_str(dims)));
    f[w] = true;
  }
  f.resize(static_cast<size_t>(x.dim()));
  return remap(info, x, f, std::vector<int64_t>(f.size(), 0));
}

Tensor roll(const Tensor& x, const Shape& shifts, const Shape& dims) {
  static const OpInfo info("roll");
  DispatchScope scope(info, x);
  if (dims.empty()) {
    if (shifts.size() != 1)
      throw std::invalid_argument(
          fmt::format("roll: without dims, shifts must hold one value, got {}", shape_str(shifts)));
    const Tensor flat = reshape(x, {x.numel()});
    return view(roll(flat, shifts, {0}), x.sizes());
  }
  if (shifts.size() != dims.size())
    throw std::invalid_argument(fmt::format("roll: shifts {} and dims {} must have one length",
                                            shape_str(shifts), shape_str(dims)));
  std::vector<int64_t> s(static_cast<size_t>(x.dim()), 0);
  for (size_t i = 0; i < dims.size(); ++i) {
    const auto w = static_cast<size_t>(wrap_dim(dims[i], x.dim(), info.name));
    if (x.dim() == 0) continue;  // dim 0 / -1 of a 0-D tensor: itself, nothing to roll
    const int64_t n = x.sizes()[w];
    if (n > 0) s[w] = (((s[w] + shifts[i]) % n) + n) % n;
  }
  return remap(info, x, std::vector<bool>(s.size(), false), s);
}

Tensor masked_select(const Tensor& x, const Tensor& mask) {
  static const OpInfo info("masked_select");
  DispatchScope scope(info, x, mask);
  const Shape shape = broadcast_shapes(x.sizes(), mask.sizes(), info.name);
  MaskPlan p = plan_mask(info.name, mask, shape, x.device(), true);
  Tensor out = alloc_output({p.count}, x.dtype(), x.device());
  if (p.count > 0)
    index_backends.get(info, x.device(), &IndexKernels::masked_select)(out, expand(x, shape),
                                                                       p.mask, p.positions);
  return out;
}

void masked_scatter_(const Tensor& x, const Tensor& mask, const Tensor& source) {
  static const OpInfo info("masked_scatter_");
  DispatchScope scope(info, x, mask, source);
  check_same_device(info.name, x.device(), source.device());
  if (source.dtype() != x.dtype())
    throw std::invalid_argument(fmt::format("masked_scatter_: source's dtype {} must be x's ({})",
                                            dtype_name(source.dtype()), dtype_name(x.dtype())));
  if (broadcast_shapes(x.sizes(), mask.sizes(), info.name) != x.sizes())
    throw std::invalid_argument(fmt::format("masked_scatter_: mask {} must broadcast to x {}",
                                            mask.shape_string(), x.shape_string()));
  // A meta x has no mask values to count: the check and the kernel need none there.
  const bool meta = x.device().type == DeviceType::meta;
  MaskPlan p = plan_mask(info.name, mask, x.sizes(), x.device(), !meta);
  if (meta) return;
  if (source.numel() < p.count)
    throw std::invalid_argument(
        fmt::format("masked_scatter_: source {} has fewer elements than mask's {} true entries",
                    source.shape_string(), p.count));
  if (p.count == 0) return;
  const Tensor src = reshape(source, {source.numel()});
  index_backends.get(info, x.device(), &IndexKernels::masked_scatter)(x, src, p.mask, p.positions);
  x.storage().bump_version();
}

void masked_fill_(const Tensor& x, const Tensor& mask, double value) {
  static const OpInfo info("masked_fill_");
  DispatchScope scope(info, x, mask);
  if (broadcast_shapes(x.sizes(), mask.sizes(), info.name) != x.sizes())
    throw std::invalid_argument(fmt::format("masked_fill_: mask {} must broadcast to x {}",
                                            mask.shape_string(), x.shape_string()));
  MaskPlan p = plan_mask(info.name, mask, x.sizes(), x.device(), false);
  if (x.numel() == 0) return;
  const Tensor v = full({1}, value, x.dtype(), x.device());
  index_backends.get(info, x.device(), &IndexKernels::masked_scatter)(x, as_strided(v, {1}, {0}, 0),
                                                                      p.mask, p.positions);
  x.storage().bump_version();
}

}  // namespace tally::ops
