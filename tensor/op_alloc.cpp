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
}  // namespace

size_t checked_nbytes(const Shape& shape, size_t element_size, const char* what) {
  constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t n = element_size;
  for (int64_t d : shape) {
    if (d < 0)
      throw std::invalid_argument(
          fmt::format("{}: negative dimension in shape {}", what, shape_str(shape)));
    if (d != 0 && n > kMax / static_cast<uint64_t>(d))
      throw std::length_error(
          fmt::format("{}: a tensor of shape {} with {}-byte elements is larger than 2^63 bytes",
                      what, shape_str(shape), element_size));
    n *= static_cast<uint64_t>(d);
  }
  return static_cast<size_t>(n);
}

Tensor alloc_output(const Shape& shape, DType dtype, Device device) {
  const size_t bytes = checked_nbytes(shape, dtype_size(dtype), op_name());
  return Tensor::make(Storage::allocate(bytes, device), shape, contiguous_strides(shape), 0, dtype);
}

Tensor alloc_scratch(int64_t numel, DType dtype, Device device) {
  const Shape shape{numel};
  const size_t bytes = checked_nbytes(shape, dtype_size(dtype), op_name());
  memory::CategoryScope cat(memory::Category::workspace);
  return Tensor::make(Storage::allocate(bytes, device), shape, Shape{1}, 0, dtype);
}

Storage alloc_scratch_bytes(size_t bytes, Device device) {
  if (bytes == 0) return {};
  memory::CategoryScope cat(memory::Category::workspace);
  return Storage::allocate(bytes, device);
}

}  // namespace tally
