#include "tensor/op_alloc.h"

#include <stdexcept>

#include "base/checked.h"
#include "memory/context.h"
#include "memory/meta.h"

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
  if (base::try_nbytes(shape, dtype_size(dtype), &n)) [[likely]]
    return n;
  return base::checked_nbytes(shape, dtype_size(dtype), op_name());  // throws
}

}  // namespace

size_t checked_nbytes(const Shape& shape, size_t element_size, const char* what) {
  return base::checked_nbytes(shape, element_size, what);
}

Tensor alloc_output(const Shape& shape, DType dtype, Device device) {
  const size_t bytes = output_nbytes(shape, dtype);  // first: its error names the op
  return Tensor::make(Storage::allocate(bytes, device), shape, contiguous_strides(shape), 0, dtype);
}

Tensor alloc_output(const Shape& shape, DType dtype, Device device, MemoryFormat f) {
  if (f == MemoryFormat::contiguous) return alloc_output(shape, dtype, device);
  const Shape strides = memory_format_strides(shape, f, "alloc_output");
  const size_t bytes = output_nbytes(shape, dtype);
  return Tensor::make(Storage::allocate(bytes, device), shape, strides, 0, dtype);
}

bool all_channels_last(std::initializer_list<const Tensor*> ts, const Shape& shape) {
  for (const Tensor* t : ts)
    if (!t->defined() || t->sizes() != shape ||
        t->suggest_memory_format() != MemoryFormat::channels_last)
      return false;
  return ts.size() > 0;
}

MemoryFormat kernel_memory_format(Device device, MemoryFormat f) {
  return memory::behaves_as(device) == DeviceType::cuda ? f : MemoryFormat::contiguous;
}

Tensor flat_view(const Tensor& t) {
  if (!t.is_contiguous() && !t.is_contiguous(MemoryFormat::channels_last))
    throw std::logic_error("flat_view: tensor of shape " + t.shape_string() +
                           " is not dense in a memory format");
  return Tensor::make(t.storage(), {t.numel()}, {1}, t.storage_offset(), t.dtype());
}

Tensor donated_output(const Tensor& donor, const Shape& shape, DType dtype, Device device) {
  if (!donor.defined() || donor.use_count() != 1 || donor.device() != device ||
      donor.dtype() != dtype || donor.sizes() != shape || donor.storage_offset() != 0 ||
      (!donor.is_contiguous() && !donor.is_contiguous(MemoryFormat::channels_last)))
    return {};
  const size_t bytes = output_nbytes(shape, dtype);
  const Storage& s = donor.storage();
  if (bytes == 0 || s.use_count() != 1 || s.saved_refs() != 0 || s.nbytes() != bytes ||
      !s.reassign())
    return {};
  return Tensor::make(s, shape, donor.strides(), 0, dtype);  // the donor's layout
}

Tensor alloc_scratch(int64_t numel, DType dtype, Device device) {
  const Shape shape{numel};
  const size_t bytes = output_nbytes(shape, dtype);
  memory::CategoryScope cat(memory::Category::workspace);
  return Tensor::make(Storage::allocate(bytes, device), shape, Shape{1}, 0, dtype);
}

}  // namespace tally
