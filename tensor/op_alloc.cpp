#include "tensor/op_alloc.h"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

#include "memory/context.h"

namespace tally {

namespace {
// The op being run (the allocation context's), for error messages.
const char* op_name() {
  const memory::StrId op = memory::current_tag().op;
  return op ? memory::interned(op).c_str() : "alloc";
}

constexpr uint64_t kMaxBytes = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
}  // namespace

size_t checked_nbytes(const Shape& shape, size_t element_size, const char* what) {
  uint64_t n = element_size;
  for (int64_t d : shape) {
    if (d < 0)
      throw std::invalid_argument(
          fmt::format("{}: negative dimension in shape {}", what, shape_str(shape)));
    if (d != 0 && n > kMaxBytes / static_cast<uint64_t>(d))
      throw std::length_error(
          fmt::format("{}: a tensor of shape {} with {}-byte elements is larger than 2^63 bytes",
                      what, shape_str(shape), element_size));
    n *= static_cast<uint64_t>(d);
  }
  return static_cast<size_t>(n);
}

namespace {
// The byte count of a contiguous tensor, checked; the op's name is looked up only for the
// error (the hot path takes no lock).
size_t output_nbytes(const Shape& shape, DType dtype) {
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) {
    if (d < 0 || (d != 0 && n > kMaxBytes / static_cast<uint64_t>(d)))
      return checked_nbytes(shape, dtype_size(dtype), op_name());  // throws
    n *= static_cast<uint64_t>(d);
  }
  return static_cast<size_t>(n);
}

}  // namespace

Tensor alloc_output(const Shape& shape, DType dtype, Device device) {
  return Tensor::make(Storage::allocate(output_nbytes(shape, dtype), device), shape,
                      contiguous_strides(shape), 0, dtype);
}

Tensor alloc_scratch(int64_t numel, DType dtype, Device device) {
  const Shape shape{numel};
  const size_t bytes = output_nbytes(shape, dtype);
  memory::CategoryScope cat(memory::Category::workspace);
  return Tensor::make(Storage::allocate(bytes, device), shape, Shape{1}, 0, dtype);
}

Storage alloc_scratch_bytes(size_t bytes, Device device) {
  if (bytes == 0) return {};
  memory::CategoryScope cat(memory::Category::workspace);
  return Storage::allocate(bytes, device);
}

}  // namespace tally
