#include "tensor/op_alloc.h"

#include "memory/checked.h"
#include "memory/context.h"

namespace tally {

namespace {
// The op being run (the allocation context's), for error messages.
const char* op_name() {
  const memory::StrId op = memory::current_tag().op;
  return op ? memory::interned(op).c_str() : "alloc";
}

// The byte count of a contiguous tensor, checked; the op's name is looked up only for the
// error (the hot path takes no lock).
size_t output_nbytes(const Shape& shape, DType dtype) {
  uint64_t n;
  if (memory::try_nbytes(shape, dtype_size(dtype), &n)) [[likely]]
    return n;
  return memory::checked_nbytes(shape, dtype_size(dtype), op_name());  // throws
}

}  // namespace

size_t checked_nbytes(const Shape& shape, size_t element_size, const char* what) {
  return memory::checked_nbytes(shape, element_size, what);
}

Tensor alloc_output(const Shape& shape, DType dtype, Device device) {
  const size_t bytes = output_nbytes(shape, dtype);  // first: its error names the op
  return Tensor::make(Storage::allocate(bytes, device), shape, contiguous_strides(shape), 0, dtype);
}

Tensor donated_output(const Tensor& donor, const Shape& shape, DType dtype, Device device) {
  if (!donor.defined() || donor.use_count() != 1 || donor.device() != device ||
      donor.dtype() != dtype || donor.sizes() != shape || donor.storage_offset() != 0 ||
      !donor.is_contiguous())
    return {};
  const size_t bytes = output_nbytes(shape, dtype);
  const Storage& s = donor.storage();
  if (bytes == 0 || s.use_count() != 1 || s.saved_refs() != 0 || s.nbytes() != bytes ||
      !s.reassign())
    return {};
  return Tensor::make(s, shape, contiguous_strides(shape), 0, dtype);
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
