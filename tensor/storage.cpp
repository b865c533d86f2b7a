#include "tensor/storage.h"

#include "memory/context.h"

#ifdef TALLY_WITH_CUDA
#include "tensor/cuda/runtime.h"
#endif

namespace tally {

Storage::Impl::~Impl() {
  if (allocator && data) allocator->deallocate(data);
}

namespace {
// The stream a new block of `device` is allocated on: the device's current stream.
memory::StreamId current_stream(Device device) {
#ifdef TALLY_WITH_CUDA
  if (device.type == DeviceType::cuda) return cuda::stream_id(device.index);
#else
  (void)device;
#endif
  return 0;
}
}  // namespace

Storage Storage::allocate(size_t nbytes, Device device) {
  Storage s;
  s.impl_ = std::make_shared<Impl>();
  s.impl_->device = device;
  s.impl_->nbytes = nbytes;
  if (nbytes > 0) {
    memory::CachingAllocator& alloc = memory::get_allocator(device);
    s.impl_->data = alloc.allocate(nbytes, current_stream(device));
    s.impl_->allocator = &alloc;
  }
  return s;
}

Storage Storage::allocate(size_t nbytes, Device device, memory::CachingAllocator& allocator,
                          memory::StreamId stream) {
  Storage s;
  s.impl_ = std::make_shared<Impl>();
  s.impl_->device = device;
  s.impl_->nbytes = nbytes;
  if (nbytes > 0) {
    s.impl_->data = allocator.allocate(nbytes, stream);
    s.impl_->allocator = &allocator;
  }
  return s;
}

void Storage::record_stream(memory::StreamId stream) const {
  if (owned() && impl_->data) impl_->allocator->record_stream(impl_->data, stream);
}

Storage Storage::borrow(void* data, size_t nbytes, Device device) {
  Storage s;
  s.impl_ = std::make_shared<Impl>();
  s.impl_->data = data;
  s.impl_->nbytes = nbytes;
  s.impl_->device = device;
  return s;
}

bool Storage::reassign() const {
  if (!owned() || !impl_->data || impl_->allocator != &memory::get_allocator(impl_->device) ||
      !impl_->allocator->reassign(impl_->data, current_stream(impl_->device)))
    return false;
  ++impl_->version;
  return true;
}

void Storage::retag(memory::Category c) const {
  if (owned() && impl_->data) impl_->allocator->retag(impl_->data, c);
}

size_t Storage::block_bytes() const {
  if (!owned() || !impl_->data) return 0;
  return impl_->allocator->block_size(impl_->data);
}

memory::Category Storage::category() const {
  if (!owned() || !impl_->data) return memory::Category::unknown;
  return impl_->allocator->block_tag(impl_->data).category;
}

Storage alloc_scratch_bytes(size_t bytes, Device device) {
  if (bytes == 0) return {};
  memory::CategoryScope cat(memory::Category::workspace);
  return Storage::allocate(bytes, device);
}

}  // namespace tally
