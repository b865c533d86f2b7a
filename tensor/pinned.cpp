#include "tensor/pinned.h"

#include <fmt/format.h>

#include "memory/checked.h"
#include "memory/context.h"
#include "tensor/dispatch.h"
#include "tensor/ops.h"
#ifdef TALLY_WITH_CUDA
#include "tensor/cuda/async_copy.h"
#endif

namespace tally::ops {

Tensor empty_pinned(const Shape& shape, DType dtype) {
  static const OpInfo info("empty_pinned");
  DispatchScope scope(info, Device::cpu());
  const size_t bytes = memory::checked_nbytes(shape, dtype_size(dtype), "empty_pinned");
  Storage s = Storage::allocate(bytes, Device::cpu(), memory::get_pinned_allocator());
  return Tensor::make(std::move(s), shape, contiguous_strides(shape), 0, dtype);
}

bool is_pinned(const Tensor& t) {
  if (!t.defined() || t.is_cuda() || !memory::pinned_memory_available()) return false;
  const memory::CachingAllocator* a = t.storage().allocator();
  return a != nullptr && a == &memory::get_pinned_allocator();
}

Tensor pin_memory(const Tensor& t) {
  if (t.is_cuda())
    throw std::invalid_argument(fmt::format(
        "pin_memory: cannot pin a {} tensor of shape {}: only CPU tensors can be pinned",
        t.device().str(), t.shape_string()));
  if (is_pinned(t)) return t;
  Tensor out = empty_pinned(t.sizes(), t.dtype());
  copy_(out, t);
  return out;
}

Tensor to_device_async(const Tensor& host, Device device, memory::Category category) {
  memory::CategoryScope cat(category);
  if (host.device() == device) return host;
#ifdef TALLY_WITH_CUDA
  if (device.type == DeviceType::cuda && !host.is_cuda() && host.is_contiguous() &&
      is_pinned(host)) {
    static const OpInfo info("to_device_async");
    DispatchScope scope(info, device);
    return cuda::copy_pinned_to_device(host, device);
  }
#endif
  return to(host, device, host.dtype());
}

}  // namespace tally::ops
