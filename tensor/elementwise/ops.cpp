// The core raw ops: argument checks, output allocation and the dispatch into kernels.
// Views are pure layout arithmetic and need no kernel.
#include "tensor/elementwise/ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "base/checked.h"
#include "tensor/cuda/graph.h"
#include "tensor/dispatch.h"
#include "tensor/elementwise/kernels.h"
#include "tensor/op_alloc.h"

namespace tally::ops {

// ---------------------------------------------------------------- factories

Tensor empty(const Shape& shape, DType dtype, Device device) {
  static const OpInfo info("empty");
  DispatchScope scope(info, device);
  return alloc_output(shape, dtype, device);
}

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  static const OpInfo info("full");
  DispatchScope scope(info, device);
  Tensor t = alloc_output(shape, dtype, device);
  elementwise_backends.get(info, device, &ElementwiseKernels::fill)(t, value);
  return t;
}

Tensor zeros(const Shape& shape, DType dtype, Device device) {
  return full(shape, 0.0, dtype, device);
}
Tensor ones(const Shape& shape, DType dtype, Device device) {
  return full(shape, 1.0, dtype, device);
}
Tensor empty_like(const Tensor& t) {
  return empty(t.sizes(), t.dtype(), t.device());
}
Tensor zeros_like(const Tensor& t) {
  return zeros(t.sizes(), t.dtype(), t.device());
}
Tensor ones_like(const Tensor& t) {
  return ones(t.sizes(), t.dtype(), t.device());
}

Tensor arange(double start, double end, double step, DType dtype, Device device) {
  if (step == 0 || (end - start) / step < 0)
    throw std::invalid_argument(
        fmt::format("arange: bad range [{}, {}) with step {}", start, end, step));
  const auto n = static_cast<int64_t>(std::ceil((end - start) / step));
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = start + static_cast<double>(i) * step;
  return from_vector(v, {n}, dtype, device);
}

namespace {

// rand / randn: a floating tensor that `fill` fills from the generator's next numel values.
using RandomFill = void (*ElementwiseKernels::*)(const Tensor&, PhiloxState);
Tensor random_floating(const OpInfo& info, RandomFill fill, const Shape& shape, DType dtype,
                       Device device, Generator* gen) {
  DispatchScope scope(info, device);
  if (device.type == DeviceType::cuda) cuda::check_not_capturing(device.index, info.name);
  if (!is_floating(dtype)) unsupported_dtype(info.name, dtype);
  Tensor t = alloc_output(shape, dtype, device);
  Generator& g = gen ? *gen : default_generator();
  elementwise_backends.get(info, device, fill)(t, g.reserve(static_cast<uint64_t>(t.numel())));
  return t;
}

}  // namespace

Tensor rand(const Shape& shape, DType dtype, Device device, Generator* gen) {
  static const OpInfo info("rand");
  return random_floating(info, &ElementwiseKernels::rand_uniform, shape, dtype, device, gen);
}

Tensor randn(const Shape& shape, DType dtype, Device device, Generator* gen) {
  static const OpInfo info("randn");
  return random_floating(info, &ElementwiseKernels::rand_normal, shape, dtype, device, gen);
}

Tensor randint(int64_t low, int64_t high, const Shape& shape, DType dtype, Device device,
               Generator* gen) {
  static const OpInfo info("randint");
  DispatchScope scope(info, device);
  if (device.type == DeviceType::cuda) cuda::check_not_capturing(device.index, info.name);
  if (high <= low)
    throw std::invalid_argument(fmt::format("randint: empty range [{}, {})", low, high));
  Tensor t = alloc_output(shape, dtype, device);
  Generator& g = gen ? *gen : default_generator();
  elementwise_backends.get(info, device, &ElementwiseKernels::rand_int)(
      t, low, high, g.reserve(static_cast<uint64_t>(t.numel())));
  return t;
}

Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype,
                   Device device) {
  static const OpInfo info("from_vector");
  DispatchScope scope(info, device);
  if (static_cast<int64_t>(values.size()) != shape_numel(shape))
    throw std::invalid_argument(fmt::format("from_vector: {} values for shape {} ({} elements)",
                                            values.size(), shape_str(shape), shape_numel(shape)));
  Tensor host = Tensor::make(Storage::borrow(const_cast<double*>(values.data()),
                                             values.size() * sizeof(double), Device::cpu()),
                             shape, contiguous_strides(shape), 0, DType::float64);
  Tensor t = alloc_output(shape, dtype, device);
  copy_(t, host);
  return t;
}

Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device) {
  const size_t bytes = base::checked_nbytes(shape, dtype_size(dtype), "from_blob");
  return Tensor::make(Storage::borrow(data, bytes, device), shape, contiguous_strides(shape), 0,
                      dtype);
}

// ---------------------------------------------------------------- copies

namespace {
// PyTorch's assert_no_internal_overlap: a destination with a dimension of size > 1 and stride
// 0 (what expand makes) holds several elements at one memory location, so an in-place write
// would race with itself, and over a huge expanded size it would run for hours. Refused before
// any work, as PyTorch refuses it.
void check_no_internal_overlap(const char* op, const Tensor& dst) {
  if (dst.numel() == 0) return;
  for (int64_t d = 0; d < dst.dim(); ++d)
    if (dst.sizes()[static_cast<size_t>(d)] > 1 && dst.strides()[static_cast<size_t>(d)] == 0)
      throw std::invalid_argument(fmt::format(
          "{}: the written-to tensor of shape {} has more than one element at a single memory "
          "location (dimension {} has stride 0, as expand makes): clone() it before writing "
          "in place",
          op, dst.shape_string(), d));
}
}  // namespace

void copy_(const Tensor& dst, const Tensor& src) {
  static const OpInfo info("copy_");
  check_no_internal_overlap(info.name, dst);
  Tensor s = src.sizes() == dst.sizes() ? src : expand(src, dst.sizes());
  if (dst.device() == s.device()) {
    DispatchScope scope(info, dst);
    const auto kernel = elementwise_backends.get(info, dst.device(), &ElementwiseKernels::copy);
    if (all_channels_last({&dst, &s}, dst.sizes()) && dst.strides() == s.strides())
      kernel(flat_view(dst), flat_view(s));  // one layout: a flat copy
    else
      kernel(dst, s);
  } else if (dst.device().is_meta()) {
    // Onto a meta tensor: shapes only; the meta kernel replays the staging a host-to-device
    // copy takes on the target.
    DispatchScope scope(info, dst);
    elementwise_backends.get(info, dst.device(), &ElementwiseKernels::copy)(dst, s);
  } else if (s.device().is_meta()) {
    throw std::invalid_argument(fmt::format(
        "copy_: cannot copy out of a meta tensor ({} {} on {}): it has shapes but no data",
        dtype_name(s.dtype()), s.shape_string(), s.device().str()));
  } else {
    // Across devices: the CUDA kernel handles host<->device (through a staging copy).
    DispatchScope scope(info, dst.is_cuda() ? dst.device() : s.device());
    const Device gpu = Device::cuda(dst.is_cuda() ? dst.device().index : s.device().index);
    elementwise_backends.get(info, gpu, &ElementwiseKernels::copy)(dst, s);
  }
  dst.storage().bump_version();
}

void foreach_copy_(const TensorList& dsts, const TensorList& srcs) {
  static const OpInfo info("_foreach_copy_");
  const char* op = info.name;
  if (dsts.size() != srcs.size())
    throw std::invalid_argument(
        fmt::format("{}: {} destinations for {} sources", op, dsts.size(), srcs.size()));
  if (dsts.empty()) return;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const Tensor &d = dsts[i], &s = srcs[i];
    if (!d.defined() || !s.defined())
      throw std::invalid_argument(fmt::format("{}: pair {} has an undefined tensor", op, i));
    if (d.sizes() != s.sizes())
      throw std::invalid_argument(fmt::format("{}: pair {}: destination {} and source {} differ",
                                              op, i, d.shape_string(), s.shape_string()));
    if (d.device() != dsts[0].device() || s.device() != dsts[0].device())
      throw std::invalid_argument(fmt::format(
          "{}: pair {}: destination on {} and source on {}, expected every tensor on {}", op, i,
          d.device().str(), s.device().str(), dsts[0].device().str()));
    if (d.dtype() != dsts[0].dtype() || s.dtype() != srcs[0].dtype())
      throw std::invalid_argument(
          fmt::format("{}: pair {}: destination {} and source {}, expected {} and {} as pair 0's",
                      op, i, dtype_name(d.dtype()), dtype_name(s.dtype()),
                      dtype_name(dsts[0].dtype()), dtype_name(srcs[0].dtype())));
    if (d.numel() > 0 && d.storage().data() == s.storage().data())
      throw std::invalid_argument(
          fmt::format("{}: pair {}: the destination shares the source's storage", op, i));
    check_no_internal_overlap(op, d);
  }
  DispatchScope scope(info, dsts[0], srcs[0]);
  elementwise_backends.get(info, dsts[0].device(), &ElementwiseKernels::copy_many)(dsts, srcs);
  for (const Tensor& d : dsts) d.storage().bump_version();
}

void fill_(const Tensor& dst, double value) {
  static const OpInfo info("fill_");
  check_no_internal_overlap(info.name, dst);
  DispatchScope scope(info, dst);
  elementwise_backends.get(info, dst.device(), &ElementwiseKernels::fill)(dst, value);
  dst.storage().bump_version();
}

void zero_(const Tensor& dst) {
  fill_(dst, 0.0);
}

Tensor contiguous(const Tensor& t) {
  if (t.is_contiguous()) return t;
  static const OpInfo info("clone");  // PyTorch's contiguous() runs aten::clone
  DispatchScope scope(info, t);
  Tensor out = alloc_output(t.sizes(), t.dtype(), t.device());
  copy_(out, t);
  return out;
}

Tensor contiguous(const Tensor& t, MemoryFormat f) {
  if (f == MemoryFormat::contiguous) return contiguous(t);
  static const OpInfo info("clone");
  DispatchScope scope(info, t);
  if (t.dim() != 4)
    throw std::invalid_argument(
        fmt::format("contiguous: channels_last needs a 4-D [N, C, H, W] tensor, got shape {}",
                    t.shape_string()));
  if (t.is_contiguous(f)) return t;
  Tensor out = alloc_output(t.sizes(), t.dtype(), t.device(), f);
  copy_(out, t);
  return out;
}

Tensor clone(const Tensor& t) {
  static const OpInfo info("clone");
  DispatchScope scope(info, t);
  Tensor out = alloc_output(t.sizes(), t.dtype(), t.device(), t.suggest_memory_format());
  copy_(out, t);
  return out;
}

Tensor to(const Tensor& t, Device device, DType dtype, bool copy) {
  if (!copy && t.device() == device && t.dtype() == dtype) return t;
  static const OpInfo info("to");
  DispatchScope scope(info, device);
  // A channels_last tensor stays so on its device (PyTorch's preserve_format); a copy to
  // another device is row-major.
  const MemoryFormat f =
      device == t.device() ? t.suggest_memory_format() : MemoryFormat::contiguous;
  Tensor out = alloc_output(t.sizes(), dtype, device, f);
  copy_(out, t);
  return out;
}

Tensor to(const Tensor& t, DType dtype) {
  return to(t, t.device(), dtype);
}

std::vector<double> to_vector(const Tensor& t) {
  Tensor host = contiguous(to(t, Device::cpu(), DType::float64, /*copy=*/true));
  const double* p = host.data<double>();
  return std::vector<double>(p, p + host.numel());
}

double item(const Tensor& t) {
  if (t.numel() != 1)
    throw std::invalid_argument(
        fmt::format("item: a tensor with {} elements (shape {}) cannot be "
                    "converted to a scalar",
                    t.numel(), t.shape_string()));
  if (t.device().type == DeviceType::cpu) {
    // The one element, read in place: no host copy (a device tensor's goes through one).
    double v = 0;
    TALLY_DISPATCH_ALL(t.dtype(), "item", [&] {
      v = static_cast<double>(static_cast<const scalar_t*>(t.storage().data())[t.storage_offset()]);
    });
    return v;
  }
  return to_vector(t)[0];
}

// ---------------------------------------------------------------- views

int64_t wrap_dim(int64_t dim, int64_t rank, const char* op) {
  const int64_t r = std::max<int64_t>(rank, 1);
  if (dim < -r || dim >= r)
    throw std::out_of_range(
        fmt::format("{}: dimension {} out of range for a {}-D tensor", op, dim, rank));
  return dim < 0 ? dim + r : dim;
}

Tensor as_strided(const Tensor& t, const Shape& sizes, const Shape& strides, int64_t offset) {
  Tensor v = Tensor::make(t.storage(), sizes, strides, offset, t.dtype());
  return v;
}

static Shape infer_shape(Shape shape, int64_t numel, const Tensor& t, const char* op) {
  int64_t known = 1, infer = -1;
  Shape known_dims = shape;  // the -1 as 1
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0)
        throw std::invalid_argument(fmt::format("{}: only one dimension can be -1", op));
      infer = static_cast<int64_t>(i);
      known_dims[i] = 1;
    } else if (shape[i] < 0) {
      throw std::invalid_argument(
          fmt::format("{}: invalid size {} in {}", op, shape[i], shape_str(shape)));
    }
  }
  if (!base::try_numel(known_dims, &known))
    throw std::length_error(
        fmt::format("{}: shape {} has more than 2^63 - 1 elements", op, shape_str(shape)));
  if (infer >= 0) {
    if (known == 0 || numel % known != 0)
      throw std::invalid_argument(fmt::format("{}: shape {} is invalid for input of shape {}", op,
                                              shape_str(shape), t.shape_string()));
    shape[static_cast<size_t>(infer)] = numel / known;
  } else if (known != numel) {
    throw std::invalid_argument(
        fmt::format("{}: shape {} is invalid for input of shape {} ({} elements)", op,
                    shape_str(shape), t.shape_string(), numel));
  }
  return shape;
}

// Strides for viewing t as `shape` without a copy, if possible (PyTorch's computeStride).
static std::optional<Shape> view_strides(const Tensor& t, const Shape& shape) {
  const Shape& old_sz = t.sizes();
  const Shape& old_st = t.strides();
  Shape st(shape.size());
  if (t.numel() == 0 || t.dim() == 0) return contiguous_strides(shape);
  int64_t view_d = static_cast<int64_t>(shape.size()) - 1;
  int64_t chunk_base = old_st.empty() ? 1 : old_st.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(old_sz.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_sz[static_cast<size_t>(d)];
    if (d == 0 || (old_sz[static_cast<size_t>(d - 1)] != 1 &&
                   old_st[static_cast<size_t>(d - 1)] != tensor_numel * chunk_base)) {
      while (view_d >= 0 &&
             (view_numel < tensor_numel || shape[static_cast<size_t>(view_d)] == 1)) {
        st[static_cast<size_t>(view_d)] = view_numel * chunk_base;
        view_numel *= shape[static_cast<size_t>(view_d)];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base = old_st[static_cast<size_t>(d - 1)];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return st;
}

Tensor view(const Tensor& t, Shape shape) {
  shape = infer_shape(std::move(shape), t.numel(), t, "view");
  auto st = view_strides(t, shape);
  if (!st)
    throw std::invalid_argument(fmt::format(
        "view: shape {} is not compatible with input of shape {} and strides {} (use reshape)",
        shape_str(shape), t.shape_string(), shape_str(t.strides())));
  return as_strided(t, shape, *st, t.storage_offset());
}

Tensor reshape(const Tensor& t, Shape shape) {
  shape = infer_shape(std::move(shape), t.numel(), t, "reshape");
  if (auto st = view_strides(t, shape)) return as_strided(t, shape, *st, t.storage_offset());
  return view(clone(t), shape);
}

Tensor permute(const Tensor& t, const Shape& dims) {
  if (static_cast<int64_t>(dims.size()) != t.dim())
    throw std::invalid_argument(
        fmt::format("permute: {} dims for a {}-D tensor", dims.size(), t.dim()));
  Shape sz(dims.size()), st(dims.size());
  std::vector<bool> used(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const auto d = static_cast<size_t>(wrap_dim(dims[i], t.dim(), "permute"));
    if (used[d])
      throw std::invalid_argument(fmt::format("permute: repeated dim in {}", shape_str(dims)));
    used[d] = true;
    sz[i] = t.sizes()[d];
    st[i] = t.strides()[d];
  }
  return as_strided(t, sz, st, t.storage_offset());
}

Tensor transpose(const Tensor& t, int64_t d0, int64_t d1) {
  if (t.dim() == 0) return t;
  const auto a = static_cast<size_t>(wrap_dim(d0, t.dim(), "transpose"));
  const auto b = static_cast<size_t>(wrap_dim(d1, t.dim(), "transpose"));
  Shape sz = t.sizes(), st = t.strides();
  std::swap(sz[a], sz[b]);
  std::swap(st[a], st[b]);
  return as_strided(t, sz, st, t.storage_offset());
}

// The dimension select, narrow and slice index: a 0-D tensor has none (wrap_dim lets a
// reduction take dim 0 or -1 of it).
static size_t indexed_dim(const Tensor& t, int64_t dim, const char* op) {
  if (t.dim() == 0)
    throw std::out_of_range(
        fmt::format("{}: cannot be applied to a 0-D tensor (dim {} asked)", op, dim));
  return static_cast<size_t>(wrap_dim(dim, t.dim(), op));
}

Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step) {
  const size_t d = indexed_dim(t, dim, "slice");
  if (step <= 0)
    throw std::invalid_argument(fmt::format("slice: step must be positive, got {}", step));
  const int64_t n = t.sizes()[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape sz = t.sizes(), st = t.strides();
  sz[d] = end == start ? 0 : (end - start - 1) / step + 1;  // no overflow for a huge step
  st[d] = t.strides()[d] * step;
  return as_strided(t, sz, st, t.storage_offset() + start * t.strides()[d]);
}

Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  const size_t d = indexed_dim(t, dim, "narrow");
  const int64_t n = t.sizes()[d];
  const int64_t asked = start;
  if (start < 0 && start >= -n) start += n;
  if (start < 0 || start > n || length < 0 || length > n - start)
    throw std::out_of_range(fmt::format(
        "narrow: start {} length {} out of range for dim {} of size {}", asked, length, dim, n));
  return slice(t, dim, start, start + length);
}

Tensor select(const Tensor& t, int64_t dim, int64_t index) {
  const size_t d = indexed_dim(t, dim, "select");
  const int64_t n = t.sizes()[d];
  if (index < -n || index >= n)
    throw std::out_of_range(
        fmt::format("select: index {} out of range for dim {} of size {}", index, dim, n));
  if (index < 0) index += n;
  Shape sz = t.sizes(), st = t.strides();
  sz.erase(sz.begin() + static_cast<int64_t>(d));
  st.erase(st.begin() + static_cast<int64_t>(d));
  return as_strided(t, sz, st, t.storage_offset() + index * t.strides()[d]);
}

Tensor expand(const Tensor& t, const Shape& shape) {
  if (static_cast<int64_t>(shape.size()) < t.dim())
    throw std::invalid_argument(
        fmt::format("expand: cannot expand shape {} to {}", t.shape_string(), shape_str(shape)));
  const int64_t off = static_cast<int64_t>(shape.size()) - t.dim();
  Shape sz(shape.size()), st(shape.size());
  for (int64_t i = static_cast<int64_t>(shape.size()) - 1; i >= 0; --i) {
    const auto ui = static_cast<size_t>(i);
    const int64_t j = i - off;
    const int64_t have = j >= 0 ? t.sizes()[static_cast<size_t>(j)] : 1;
    const int64_t want = shape[ui] == -1 ? have : shape[ui];
    if (j < 0 && shape[ui] == -1)
      throw std::invalid_argument("expand: -1 is not allowed for a new leading dimension");
    if (have == want) {
      sz[ui] = want;
      st[ui] = j >= 0 ? t.strides()[static_cast<size_t>(j)] : 0;
    } else if (have == 1) {
      sz[ui] = want;
      st[ui] = 0;
    } else {
      throw std::invalid_argument(
          fmt::format("expand: the expanded size {} must match the existing size {} "
                      "at dimension {} (shape {} to {})",
                      want, have, i, t.shape_string(), shape_str(shape)));
    }
  }
  return as_strided(t, sz, st, t.storage_offset());
}

Tensor squeeze(const Tensor& t) {
  Shape sz, st;
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.sizes()[static_cast<size_t>(i)] != 1) {
      sz.push_back(t.sizes()[static_cast<size_t>(i)]);
      st.push_back(t.strides()[static_cast<size_t>(i)]);
    }
  }
  return as_strided(t, sz, st, t.storage_offset());
}

Tensor squeeze(const Tensor& t, int64_t dim) {
  if (t.dim() == 0) return t;
  const auto d = static_cast<size_t>(wrap_dim(dim, t.dim(), "squeeze"));
  if (t.sizes()[d] != 1) return t;
  Shape sz = t.sizes(), st = t.strides();
  sz.erase(sz.begin() + static_cast<int64_t>(d));
  st.erase(st.begin() + static_cast<int64_t>(d));
  return as_strided(t, sz, st, t.storage_offset());
}

Tensor unsqueeze(const Tensor& t, int64_t dim) {
  const auto d = static_cast<size_t>(wrap_dim(dim, t.dim() + 1, "unsqueeze"));
  Shape sz = t.sizes(), st = t.strides();
  const int64_t stride = d < st.size() ? st[d] * sz[d] : 1;
  sz.insert(sz.begin() + static_cast<int64_t>(d), 1);
  st.insert(st.begin() + static_cast<int64_t>(d), stride);
  return as_strided(t, sz, st, t.storage_offset());
}

Tensor flatten(const Tensor& t, int64_t start_dim, int64_t end_dim) {
  if (t.dim() == 0) return reshape(t, {1});
  const int64_t s = wrap_dim(start_dim, t.dim(), "flatten");
  const int64_t e = wrap_dim(end_dim, t.dim(), "flatten");
  if (s > e) throw std::invalid_argument("flatten: start_dim cannot come after end_dim");
  Shape shape;
  for (int64_t i = 0; i < s; ++i) shape.push_back(t.sizes()[static_cast<size_t>(i)]);
  int64_t m = 1;
  for (int64_t i = s; i <= e; ++i) m *= t.sizes()[static_cast<size_t>(i)];
  shape.push_back(m);
  for (int64_t i = e + 1; i < t.dim(); ++i) shape.push_back(t.sizes()[static_cast<size_t>(i)]);
  return reshape(t, shape);
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (x != y && x != 1 && y != 1)
      throw std::invalid_argument(fmt::format("{}: shapes {} and {} cannot be broadcast together",
                                              op, shape_str(a), shape_str(b)));
    out[i] = x == 1 ? y : x;
  }
  return out;
}

// ---------------------------------------------------------------- elementwise

const char* binary_op_name(BinaryOp op) {
  static const char* names[] = {"add",
                                "sub",
                                "mul",
                                "div",
                                "pow",
                                "maximum",
                                "minimum",
                                "threshold_backward",
                                "gelu_backward",
                                "gelu_backward",
                                "add_relu",
                                "silu_backward",
                                "sigmoid_backward",
                                "tanh_backward",
                                "silu_mul",
                                "eq",
                                "ne",
                                "lt",
                                "le",
                                "gt",
                                "ge"};
  return names[static_cast<int>(op)];
}

const char* unary_op_name(UnaryOp op) {
  static const char* names[] = {"neg",  "exp",  "log",       "sqrt",       "rsqrt",
                                "abs",  "sign", "relu",      "sigmoid",    "tanh",
                                "silu", "gelu", "gelu_tanh", "reciprocal", "square",
                                "sin",  "cos",  "log1p",     "expm1",      "erf"};
  return names[static_cast<int>(op)];
}

static bool is_compare(BinaryOp op) {
  return op >= BinaryOp::eq;
}

// The op record of a binary op (its profiler/dispatch name), one per BinaryOp, shared by the
// tensor-tensor and tensor-scalar forms.
static const OpInfo& binary_info(BinaryOp op) {
  static const OpInfo infos[] = {OpInfo("add"),
                                 OpInfo("sub"),
                                 OpInfo("mul"),
                                 OpInfo("div"),
                                 OpInfo("pow"),
                                 OpInfo("maximum"),
                                 OpInfo("minimum"),
                                 OpInfo("threshold_backward"),
                                 OpInfo("gelu_backward"),
                                 OpInfo("gelu_backward"),
                                 OpInfo("add_relu"),
                                 OpInfo("silu_backward"),
                                 OpInfo("sigmoid_backward"),
                                 OpInfo("tanh_backward"),
                                 OpInfo("silu_mul"),
                                 OpInfo("eq"),
                                 OpInfo("ne"),
                                 OpInfo("lt"),
                                 OpInfo("le"),
                                 OpInfo("gt"),
                                 OpInfo("ge")};
  static_assert(sizeof(infos) / sizeof(infos[0]) == static_cast<size_t>(BinaryOp::ge) + 1);
  return infos[static_cast<int>(op)];
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  Tensor held = a;  // a second handle: `a` is never given up
  return binary_over(op, std::move(held), b);
}

static Tensor binary_scalar_impl(BinaryOp op, const Tensor& a, double b, bool reverse) {
  const OpInfo& info = binary_info(op);
  DispatchScope scope(info, a);
  DType dt = a.dtype();
  // A non-integral scalar with an integer tensor (or any division) computes in float32.
  if (!is_floating(dt) && !is_compare(op) && (op == BinaryOp::div || b != std::floor(b)))
    dt = DType::float32;
  const Tensor ca = to(a, dt);
  const bool cl = all_channels_last({&ca}, a.sizes());
  Tensor out = alloc_output(a.sizes(), is_compare(op) ? DType::bool_ : dt, a.device(),
                            cl ? MemoryFormat::channels_last : MemoryFormat::contiguous);
  const auto kernel =
      elementwise_backends.get(info, a.device(), &ElementwiseKernels::binary_scalar);
  if (cl)
    kernel(op, flat_view(out), flat_view(ca), b, reverse);
  else
    kernel(op, out, ca, b, reverse);
  return out;
}

Tensor binary_over(BinaryOp op, Tensor&& a, const Tensor& b) {
  const OpInfo& info = binary_info(op);
  check_same_device(info.name, a.device(), b.device());
  DispatchScope scope(info, a, b);
  const Shape shape = broadcast_shapes(a.sizes(), b.sizes(), info.name);
  DType dt = promote_types(a.dtype(), b.dtype());
  if (op == BinaryOp::div && !is_floating(dt)) dt = DType::float32;
  const DType out_dt = is_compare(op) ? DType::bool_ : dt;
  // A 16-bit operand beside a float32 one goes to the kernel as it is (binary_widens): b, or a
  // when the op commutes (a + b and a * b are b + a and b * a to the bit).
  // (float32 beside a 16-bit type promotes to float32: dt is the wide operand's dtype.)
  const bool widen_b = binary_widens(op, a.dtype(), b.dtype());
  const bool widen_a = !widen_b && (op == BinaryOp::add || op == BinaryOp::mul) &&
                       binary_widens(op, b.dtype(), a.dtype());
  // Donation first, while `a` is the only handle of its buffer; else the output comes after
  // the operands' conversions.
  Tensor out = out_dt == dt ? donated_output(a, shape, dt, a.device()) : Tensor();
  const Tensor ea = out.defined() ? out : expand(widen_a ? a : to(a, dt), shape);
  const Tensor eb = expand(widen_b ? b : to(b, dt), shape);
  // Channels-last operands of one layout give a channels_last result, computed flat.
  const bool cl = all_channels_last({&ea, &eb}, shape) && ea.strides() == eb.strides();
  if (!out.defined())
    out = alloc_output(shape, out_dt, a.device(),
                       cl ? MemoryFormat::channels_last : MemoryFormat::contiguous);
  const auto kernel = elementwise_backends.get(info, a.device(), &ElementwiseKernels::binary);
  const Tensor fo = cl ? flat_view(out) : out;
  const Tensor fa = cl ? flat_view(ea) : ea, fb = cl ? flat_view(eb) : eb;
  if (widen_a)
    kernel(op, fo, fb, fa);
  else
    kernel(op, fo, fa, fb);
  return out;
}

Tensor binary_scalar(BinaryOp op, const Tensor& a, double b) {
  return binary_scalar_impl(op, a, b, false);
}
Tensor scalar_binary(BinaryOp op, double a, const Tensor& b) {
  return binary_scalar_impl(op, b, a, true);
}

Tensor unary(UnaryOp op, const Tensor& a) {
  static OpInfo infos[] = {
      OpInfo("neg"),  OpInfo("exp"),  OpInfo("log"),       OpInfo("sqrt"),       OpInfo("rsqrt"),
      OpInfo("abs"),  OpInfo("sign"), OpInfo("relu"),      OpInfo("sigmoid"),    OpInfo("tanh"),
      OpInfo("silu"), OpInfo("gelu"), OpInfo("gelu_tanh"), OpInfo("reciprocal"), OpInfo("square"),
      OpInfo("sin"),  OpInfo("cos"),  OpInfo("log1p"),     OpInfo("expm1"),      OpInfo("erf")};
  const OpInfo& info = infos[static_cast<int>(op)];
  DispatchScope scope(info, a);
  // Integer inputs: neg/abs/sign/relu/square keep their dtype via float32 math.
  const Tensor ca = is_floating(a.dtype()) ? a : to(a, DType::float32);
  const bool cl = all_channels_last({&ca}, a.sizes());
  Tensor out = alloc_output(a.sizes(), ca.dtype(), a.device(),
                            cl ? MemoryFormat::channels_last : MemoryFormat::contiguous);
  const auto kernel = elementwise_backends.get(info, a.device(), &ElementwiseKernels::unary);
  if (cl)
    kernel(op, flat_view(out), flat_view(ca));
  else
    kernel(op, out, ca);
  if (!is_floating(a.dtype()) && (op == UnaryOp::neg || op == UnaryOp::abs || op == UnaryOp::sign ||
                                  op == UnaryOp::relu || op == UnaryOp::square))
    return to(out, a.dtype());
  return out;
}

void add_(const Tensor& a, const Tensor& b, double alpha) {
  static const OpInfo info("add_");
  check_same_device(info.name, a.device(), b.device());
  check_no_internal_overlap(info.name, a);
  DispatchScope scope(info, a, b);
  const Shape shape = broadcast_shapes(a.sizes(), b.sizes(), info.name);
  if (shape != a.sizes())
    throw std::invalid_argument(fmt::format("add_: cannot add shape {} into shape {} in place",
                                            b.shape_string(), a.shape_string()));
  Tensor eb = expand(to(b, a.dtype()), shape);
  if (alpha != 1.0) eb = binary_scalar(BinaryOp::mul, eb, alpha);
  const auto kernel = elementwise_backends.get(info, a.device(), &ElementwiseKernels::binary);
  if (all_channels_last({&a, &eb}, shape) && a.strides() == eb.strides())
    kernel(BinaryOp::add, flat_view(a), flat_view(a), flat_view(eb));
  else
    kernel(BinaryOp::add, a, a, eb);
  a.storage().bump_version();
}

// a (op)= b in place with a scalar b, one kernel; the scalar must keep an integer tensor
// integral (a bool one takes none).
static void binary_scalar_inplace(const OpInfo& info, BinaryOp op, const Tensor& a, double b) {
  check_no_internal_overlap(info.name, a);
  DispatchScope scope(info, a);
  if (a.dtype() == DType::bool_ || (!is_floating(a.dtype()) && b != std::floor(b)))
    throw std::invalid_argument(
        fmt::format("{}: the scalar {} cannot be applied in place to a {} "
                    "tensor of shape {} (the result would not be {})",
                    info.name, b, dtype_name(a.dtype()), a.shape_string(), dtype_name(a.dtype())));
  elementwise_backends.get(info, a.device(), &ElementwiseKernels::binary_scalar)(op, a, a, b,
                                                                                 false);
  a.storage().bump_version();
}

void add_(const Tensor& a, double b) {
  static const OpInfo info("add_");
  binary_scalar_inplace(info, BinaryOp::add, a, b);
}

void mul_(const Tensor& a, double b) {
  static const OpInfo info("mul_");
  binary_scalar_inplace(info, BinaryOp::mul, a, b);
}

Tensor affine(const Tensor& x, double a, double b) {
  static const OpInfo info("affine");
  DispatchScope scope(info, x);
  const Tensor cx = is_floating(x.dtype()) ? x : to(x, DType::float32);
  Tensor out = alloc_output(x.sizes(), cx.dtype(), x.device());
  elementwise_backends.get(info, x.device(), &ElementwiseKernels::affine)(out, cx, a, b);
  return out;
}

Tensor clamp(const Tensor& a, std::optional<double> lo, std::optional<double> hi) {
  static const OpInfo info("clamp");
  DispatchScope scope(info, a);
  Tensor out = alloc_output(a.sizes(), a.dtype(), a.device());
  elementwise_backends.get(info, a.device(), &ElementwiseKernels::clamp)(out, a, lo, hi);
  return out;
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  static const OpInfo info("where");
  check_same_device(info.name, a.device(), b.device());
  check_same_device(info.name, a.device(), cond.device());
  DispatchScope scope(info, cond, a, b);
  if (cond.dtype() != DType::bool_)
    throw std::invalid_argument(
        fmt::format("where: condition must be bool, got {}", dtype_name(cond.dtype())));
  const Shape shape =
      broadcast_shapes(broadcast_shapes(cond.sizes(), a.sizes(), "where"), b.sizes(), "where");
  const DType dt = promote_types(a.dtype(), b.dtype());
  Tensor out = alloc_output(shape, dt, a.device());
  elementwise_backends.get(info, a.device(), &ElementwiseKernels::where)(
      out, expand(cond, shape), expand(to(a, dt), shape), expand(to(b, dt), shape));
  return out;
}

namespace {
// torch.lerp with a tensor weight `w`, or the scalar `ws` when w is undefined.
Tensor lerp_impl(const Tensor& a, const Tensor& b, const Tensor& w, double ws) {
  static const OpInfo info("lerp");
  check_same_device(info.name, a.device(), b.device());
  if (w.defined()) check_same_device(info.name, a.device(), w.device());
  DispatchScope scope(info, a, b);
  if (!is_floating(a.dtype())) unsupported_dtype(info.name, a.dtype());
  if (b.dtype() != a.dtype() || (w.defined() && w.dtype() != a.dtype()))
    throw std::invalid_argument(
        fmt::format("lerp: expected input, end{} of one dtype, got {}, {}{}",
                    w.defined() ? " and weight" : "", dtype_name(a.dtype()), dtype_name(b.dtype()),
                    w.defined() ? fmt::format(", {}", dtype_name(w.dtype())) : std::string()));
  Shape shape = broadcast_shapes(a.sizes(), b.sizes(), "lerp");
  if (w.defined()) shape = broadcast_shapes(shape, w.sizes(), "lerp");
  Tensor out = alloc_output(shape, a.dtype(), a.device());
  elementwise_backends.get(info, a.device(), &ElementwiseKernels::lerp)(
      out, expand(a, shape), expand(b, shape), w.defined() ? expand(w, shape) : Tensor(), ws);
  return out;
}
}  // namespace

Tensor lerp(const Tensor& input, const Tensor& end, const Tensor& weight) {
  if (!weight.defined()) throw std::invalid_argument("lerp: weight is an undefined tensor");
  return lerp_impl(input, end, weight, 0.0);
}

Tensor lerp(const Tensor& input, const Tensor& end, double weight) {
  return lerp_impl(input, end, Tensor(), weight);
}

Tensor masked_fill(const Tensor& a, const Tensor& mask, double value) {
  static const OpInfo info("masked_fill");
  DispatchScope scope(info, a, mask);
  const Shape shape = broadcast_shapes(a.sizes(), mask.sizes(), "masked_fill");
  if (shape != a.sizes())
    throw std::invalid_argument(
        fmt::format("masked_fill: mask of shape {} does not broadcast to {}", mask.shape_string(),
                    a.shape_string()));
  return where(mask, full({}, value, a.dtype(), a.device()), a);
}

// ---------------------------------------------------------------- reductions

Tensor sum(const Tensor& t, const Shape& dims, bool keepdim, std::optional<DType> dtype) {
  static const OpInfo info("sum");
  const DType natural = is_floating(t.dtype()) ? t.dtype() : DType::int64;
  if (dtype && *dtype != natural && !(is_floating(t.dtype()) && is_floating(*dtype))) {
    // An integral side: the input cast first (torch.sum's dtype=), the result cast to dtype.
    Tensor r = sum(to(t, *dtype), dims, keepdim);
    return r.dtype() == *dtype ? r : to(r, *dtype);
  }
  DispatchScope scope(info, t);
  std::vector<bool> reduce(static_cast<size_t>(t.dim()), dims.empty());
  for (int64_t d : dims) {
    const int64_t w = wrap_dim(d, t.dim(), "sum");  // a 0-D tensor takes dim 0 / -1 (itself)
    if (t.dim() > 0) reduce[static_cast<size_t>(w)] = true;
  }
  Shape kept, squeezed;
  for (int64_t i = 0; i < t.dim(); ++i) {
    const auto ui = static_cast<size_t>(i);
    kept.push_back(reduce[ui] ? 1 : t.sizes()[ui]);
    if (!reduce[ui]) squeezed.push_back(t.sizes()[ui]);
  }
  Tensor out = alloc_output(kept, dtype.value_or(natural), t.device());
  elementwise_backends.get(info, t.device(), &ElementwiseKernels::sum)(out, t);
  return keepdim ? out : view(out, squeezed);
}

Tensor mean(const Tensor& t, const Shape& dims, bool keepdim) {
  int64_t count = 1;
  if (dims.empty()) {
    count = t.numel();
  } else {
    for (int64_t d : dims) {
      const int64_t w = wrap_dim(d, t.dim(), "mean");
      if (t.dim() > 0) count *= t.sizes()[static_cast<size_t>(w)];
    }
  }
  const Tensor s = sum(is_floating(t.dtype()) ? t : to(t, DType::float32), dims, keepdim);
  return binary_scalar(BinaryOp::mul, s, count ? 1.0 / static_cast<double>(count) : NAN);
}

Tensor sum_to(const Tensor& t, const Shape& shape) {
  if (t.sizes() == shape) return t;
  const int64_t lead = t.dim() - static_cast<int64_t>(shape.size());
  if (lead < 0)
    throw std::invalid_argument(
        fmt::format("sum_to: cannot reduce shape {} to {}", t.shape_string(), shape_str(shape)));
  Shape dims;
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i < lead) {
      dims.push_back(i);
    } else if (shape[static_cast<size_t>(i - lead)] == 1 &&
               t.sizes()[static_cast<size_t>(i)] != 1) {
      dims.push_back(i);
    }
  }
  Tensor r = dims.empty() ? t : sum(t, dims, /*keepdim=*/true);
  return reshape(r, shape);
}

}  // namespace tally::ops
