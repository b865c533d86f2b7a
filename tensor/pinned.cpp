#include "tensor/pinned.h"

#include <fmt/format.h>

#include "base/checked.h"
#include "memory/context.h"
#include "memory/meta.h"
#include "tensor/dispatch.h"
#include "tensor/elementwise/ops.h"
#include "tensor/meta/cost.h"
#ifdef TALLY_WITH_CUDA
#include "tensor/cuda/async_copy.h"
#endif

namespace tally::ops {

Tensor empty_pinned(const Shape& shape, DType dtype) {
  static const OpInfo info("empty_pinned");
  DispatchScope scope(info, Device::cpu());
  const size_t bytes = base::checked_nbytes(shape, dtype_size(dtype), "empty_pinned");
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
    Tensor out = empty(host.sizes(), host.dtype(), device);
    cuda::copy_pinned_to_device(host, out);
    return out;
  }
#endif
  return to(host, device, host.dtype());
}

namespace {
void check_contiguous(const Tensor& t, const char* what) {
  if (!t.defined() || !t.is_contiguous())
    throw std::invalid_argument(
        fmt::format("{}: expected a defined contiguous tensor, got {}", what,
                    t.defined() ? t.shape_string() + " (non-contiguous)" : "undefined"));
}

// A meta copy between `block` and pinned host memory on the copy stream of a meta device
// that replays a GPU: queued behind the copies before it, and `block` kept out of reuse until
// it ends, as the GPU's copy stream keeps it. On a CPU target the copy is synchronous: its
// time (none without a host link) goes on the clock.
void meta_copy(const Tensor& block, bool async) {
  const Device meta = block.device();
  const meta::Rates rates = meta::rates_of(meta);
  const double bw = rates.host_bandwidth;
  const double seconds = bw > 0 ? static_cast<double>(block.nbytes()) / bw : 0.0;
  if (async && memory::behaves_as(meta) == DeviceType::cuda) {
    memory::queue_meta_copy(meta, seconds);
    block.storage().record_stream(memory::kMetaCopyStream);
    return;
  }
  if (bw > 0) memory::add_meta_seconds(meta, seconds, rates.launch_seconds);
  memory::sync_meta_host(meta, memory::meta_seconds(meta));
}
}  // namespace

Device host_of(Device device) {
  if (device.is_meta())
    return memory::behaves_as(device) == DeviceType::cpu ? device : Device::meta(0);
  return Device::cpu();
}

Tensor empty_host(const Shape& shape, DType dtype, Device device) {
  const Device host = host_of(device);
  if (host.is_meta() || device.type != DeviceType::cuda) return empty(shape, dtype, host);
  return empty_pinned(shape, dtype);
}

void copy_on_copy_stream_(const Tensor& dst, const Tensor& src) {
  static const OpInfo info("copy_on_copy_stream_");
  check_contiguous(dst, "copy_on_copy_stream_");
  check_contiguous(src, "copy_on_copy_stream_");
  if (dst.sizes() != src.sizes() || dst.dtype() != src.dtype())
    throw std::invalid_argument(fmt::format(
        "copy_on_copy_stream_: destination {} {} and source {} {} differ in shape or dtype",
        dtype_name(dst.dtype()), dst.shape_string(), dtype_name(src.dtype()), src.shape_string()));
  const bool to_device = host_of(dst.device()) == src.device() && !(dst.device() == src.device());
  const Tensor& dev = to_device ? dst : src;
  const Tensor& host = to_device ? src : dst;
  if (!(dev.device() == host.device()) && !(host_of(dev.device()) == host.device()))
    throw std::invalid_argument(
        fmt::format("copy_on_copy_stream_: {} and {} are not a device and its host",
                    dst.device().str(), src.device().str()));
  DispatchScope scope(info, dev);
  if (dev.device().is_meta()) {
    meta_copy(dev, true);
    return;
  }
#ifdef TALLY_WITH_CUDA
  if (dev.is_cuda() && is_pinned(host)) {
    if (to_device)
      cuda::copy_to_device_on_copy_stream(host, dev);
    else
      cuda::copy_to_host_on_copy_stream(dev, host);
    return;
  }
#endif
  copy_(dst, src);
}

Tensor to_host_async(const Tensor& t, memory::Category category, bool pin_memory) {
  static const OpInfo info("to_host_async");
  check_contiguous(t, "to_host_async");
  DispatchScope scope(info, t);
  memory::CategoryScope cat(category);
  if (t.device().is_meta()) {
    Tensor h = empty(t.sizes(), t.dtype(), host_of(t.device()));
    meta_copy(t, pin_memory);
    return h;
  }
  // A CPU tensor's copy is ordinary CPU memory: there is nothing to pin it for.
  Tensor h = pin_memory && t.device().type != DeviceType::cpu
                 ? empty_pinned(t.sizes(), t.dtype())
                 : empty(t.sizes(), t.dtype(), Device::cpu());
#ifdef TALLY_WITH_CUDA
  if (t.is_cuda()) {
    if (is_pinned(h)) {
      cuda::copy_to_host_on_copy_stream(t, h);
      return h;
    }
  }
#endif
  copy_(h, t);  // CPU, or pageable memory: the driver copies synchronously
  return h;
}

Tensor to_device_on_copy_stream(const Tensor& host, Device device, memory::Category category) {
  static const OpInfo info("to_device_on_copy_stream");
  check_contiguous(host, "to_device_on_copy_stream");
  DispatchScope scope(info, device);
  memory::CategoryScope cat(category);
  Tensor out = empty(host.sizes(), host.dtype(), device);
  if (device.is_meta()) {
    meta_copy(out, true);
    return out;
  }
#ifdef TALLY_WITH_CUDA
  if (device.type == DeviceType::cuda && is_pinned(host)) {
    cuda::copy_to_device_on_copy_stream(host, out);
    return out;
  }
#endif
  copy_(out, host);
  return out;
}

CopyFence CopyFence::record([[maybe_unused]] Device device) {
  CopyFence f;
  if (device.is_meta() && memory::behaves_as(device) == DeviceType::cuda) {
    f.device_ = device.index;
    f.meta_seconds_ = memory::meta_copies_done(device);
    return f;
  }
#ifdef TALLY_WITH_CUDA
  if (device.type == DeviceType::cuda) {
    f.event_ = cuda::record_copy_event(device.index);
    f.device_ = device.index;
  }
#endif
  return f;
}

void CopyFence::synchronize() const {
  if (meta_seconds_ >= 0) memory::sync_meta_host(Device::meta(device_), meta_seconds_);
#ifdef TALLY_WITH_CUDA
  if (event_) cuda::synchronize_copy_event(device_, event_);
#endif
}

bool CopyFence::query() const {
  if (meta_seconds_ >= 0) return meta_seconds_ <= memory::meta_host_seconds(Device::meta(device_));
#ifdef TALLY_WITH_CUDA
  if (event_) return cuda::query_copy_event(device_, event_);
#endif
  return true;
}

void CopyFence::wait() const {
  if (meta_seconds_ >= 0) memory::wait_meta_clock(Device::meta(device_), meta_seconds_);
#ifdef TALLY_WITH_CUDA
  if (event_) cuda::stream_wait_copy_event(device_, event_);
#endif
}

}  // namespace tally::ops
