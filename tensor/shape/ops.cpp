// Raw shape ops: cat and stack allocate the result and copy each input into a slice of
// it (through copy_, so every device and dtype conversion is covered by the copy kernel);
// split and chunk are pure layout arithmetic (narrow views).
#include "tensor/shape/ops.h"

#include <fmt/format.h>

#include "memory/caching_allocator.h"
#include "memory/cpu_provider.h"
#include "tensor/dispatch.h"
#include "tensor/op_alloc.h"

namespace tally::ops {

namespace {

bool legacy_empty(const Tensor& t) {
  return t.dim() == 1 && t.size(0) == 0;
}

// Index of the tensor whose shape the result follows (the first not skipped).
size_t reference(const TensorList& ts) {
  for (size_t i = 0; i < ts.size(); ++i)
    if (!legacy_empty(ts[i])) return i;
  return 0;
}

void check_list(const char* op, const TensorList& ts) {
  if (ts.empty())
    throw std::invalid_argument(fmt::format("{}: expected a non-empty list of tensors", op));
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!ts[i].defined())
      throw std::invalid_argument(fmt::format("{}: tensor {} is undefined", op, i));
    check_same_device(op, ts[0].device(), ts[i].device());
  }
}

// cat without a dispatch scope of its own (cat and stack open theirs).
Tensor cat_impl(const char* op, const TensorList& ts, int64_t dim) {
  const size_t r = reference(ts);
  const Tensor& ref = ts[r];
  if (ref.dim() == 0)
    throw std::invalid_argument(
        fmt::format("{}: zero-dimensional tensor (at position {}) cannot "
                    "be concatenated",
                    op, r));
  const int64_t d = wrap_dim(dim, ref.dim(), op);
  DType dtype = ts[0].dtype();
  Shape shape = ref.sizes();
  shape[static_cast<size_t>(d)] = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    dtype = promote_types(dtype, t.dtype());
    if (cat_skips(ts, i)) continue;
    bool match = t.dim() == ref.dim();
    for (int64_t k = 0; match && k < t.dim(); ++k) match = k == d || t.size(k) == ref.size(k);
    if (!match)
      throw std::invalid_argument(
          fmt::format("{}: sizes of tensors must match except in dimension "
                      "{}: tensor {} has shape {} but tensor {} has shape {}",
                      op, d, i, t.shape_string(), r, ref.shape_string()));
    shape[static_cast<size_t>(d)] += t.size(d);
  }
  Tensor out = alloc_output(shape, dtype, ref.device());
  int64_t offset = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (cat_skips(ts, i)) continue;
    const int64_t n = ts[i].size(d);
    if (n > 0 && ts[i].numel() > 0) copy_(narrow(out, d, offset, n), ts[i]);
    offset += n;
  }
  return out;
}

}  // namespace

bool cat_skips(const TensorList& ts, size_t i) {
  return legacy_empty(ts[i]) && ts[reference(ts)].dim() != 1;
}

int64_t cat_dim(const TensorList& ts, int64_t dim) {
  check_list("cat", ts);
  return wrap_dim(dim, ts[reference(ts)].dim(), "cat");
}

Tensor cat(const TensorList& tensors, int64_t dim) {
  static const OpInfo info("cat");
  check_list(info.name, tensors);
  DispatchScope scope(info, tensors[0].device());
  return cat_impl(info.name, tensors, dim);
}

Tensor stack(const TensorList& tensors, int64_t dim) {
  static const OpInfo info("stack");
  check_list(info.name, tensors);
  const Tensor& first = tensors[0];
  for (size_t i = 1; i < tensors.size(); ++i)
    if (tensors[i].sizes() != first.sizes())
      throw std::invalid_argument(
          fmt::format("stack: expects each tensor to be equal size, but got "
                      "{} at entry 0 and {} at entry {}",
                      first.shape_string(), tensors[i].shape_string(), i));
  const int64_t d = wrap_dim(dim, first.dim() + 1, "stack");
  DispatchScope scope(info, first);
  TensorList parts;
  parts.reserve(tensors.size());
  for (const Tensor& t : tensors) parts.push_back(unsqueeze(t, d));
  return cat_impl(info.name, parts, d);
}

namespace {

// What one returned view holds on the host: the tensor with its sizes and strides, and the
// Python object around it where Python called (372 bytes a view measured from Python).
constexpr uint64_t kBytesPerView = 384;

// Refuses, before making any, more views than the system can hold: an op over a huge
// (expanded) or empty dimension can be asked for billions of pieces, which PyTorch makes
// until the kernel's out-of-memory killer ends the process.
void check_view_count(const char* op, uint64_t views, const Tensor& t, int64_t d) {
  if (views <= (uint64_t{1} << 16)) return;
  uint64_t bytes = 0, available = 0;
  if (memory::CpuProvider::host_can_hold(views, kBytesPerView, bytes, available)) return;
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  throw memory::OutOfMemoryError(
      fmt::format("{}: dimension {} of shape {} would give {} tensors, {:.2f} GiB of views, "
                  "and the system can give {:.2f} GiB",
                  op, d, t.shape_string(), views, static_cast<double>(views) * kBytesPerView / kGiB,
                  available / kGiB),
      bytes);
}

}  // namespace

TensorList split(const Tensor& t, int64_t split_size, int64_t dim) {
  if (t.dim() == 0) throw std::invalid_argument("split: cannot split a 0-D tensor");
  const int64_t d = wrap_dim(dim, t.dim(), "split");
  const int64_t n = t.size(d);
  if (split_size < 0 || (split_size == 0 && n != 0))
    throw std::invalid_argument(
        fmt::format("split: split_size must be positive (0 only for a "
                    "dimension of size 0), got {} for dimension {} of "
                    "shape {}",
                    split_size, d, t.shape_string()));
  // n / split_size rounded up, without the overflow of n + split_size - 1.
  const int64_t pieces =
      split_size == 0 ? 1 : std::max<int64_t>(n / split_size + (n % split_size != 0), 1);
  check_view_count("split", static_cast<uint64_t>(pieces), t, d);
  TensorList out;
  out.reserve(static_cast<size_t>(pieces));
  for (int64_t i = 0; i < pieces; ++i) {
    const int64_t start = i * split_size;
    out.push_back(narrow(t, d, start, std::min(split_size, n - start)));
  }
  return out;
}

TensorList split(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim) {
  if (t.dim() == 0) throw std::invalid_argument("split: cannot split a 0-D tensor");
  const int64_t d = wrap_dim(dim, t.dim(), "split");
  int64_t total = 0;
  for (int64_t s : sizes) {
    if (s < 0)
      throw std::invalid_argument(
          fmt::format("split: split sizes must be non-negative, got {}", shape_str(sizes)));
    if (__builtin_add_overflow(total, s, &total))
      throw std::invalid_argument(fmt::format(
          "split: split sizes {} sum past 2^63 but dimension {} of shape {} has size {}",
          shape_str(sizes), d, t.shape_string(), t.size(d)));
  }
  if (total != t.size(d))
    throw std::invalid_argument(
        fmt::format("split: split sizes {} sum to {} but dimension {} of "
                    "shape {} has size {}",
                    shape_str(sizes), total, d, t.shape_string(), t.size(d)));
  TensorList out;
  out.reserve(sizes.size());
  int64_t start = 0;
  for (int64_t s : sizes) {
    out.push_back(narrow(t, d, start, s));
    start += s;
  }
  return out;
}

TensorList chunk(const Tensor& t, int64_t chunks, int64_t dim) {
  if (chunks <= 0)
    throw std::invalid_argument(
        fmt::format("chunk: number of chunks must be greater than 0, got {}", chunks));
  if (t.dim() == 0) throw std::invalid_argument("chunk: cannot chunk a 0-D tensor");
  const int64_t d = wrap_dim(dim, t.dim(), "chunk");
  const int64_t n = t.size(d);
  if (n == 0) {  // `chunks` empty pieces, as PyTorch returns
    check_view_count("chunk", static_cast<uint64_t>(chunks), t, d);
    return split(t, std::vector<int64_t>(static_cast<size_t>(chunks), 0), d);
  }
  return split(t, n / chunks + (n % chunks != 0), d);
}

}  // namespace tally::ops
