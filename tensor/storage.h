// Storage: a ref-counted block of device memory from the caching allocator. Tensors are
// layouts over a Storage; views share it, so a block lives as long as any view of it.
#pragma once

#include <cstddef>
#include <memory>

#include "memory/memory.h"

namespace tally {

using memory::Device;
using memory::DeviceType;

class Storage {
 public:
  Storage() = default;
  // nbytes from the device's caching allocator, under the current allocation context.
  static Storage allocate(size_t nbytes, Device device);
  // nbytes from a given allocator whose blocks are `device` memory (the pinned host
  // allocator: memory::get_pinned_allocator(), device cpu), on `stream`.
  static Storage allocate(size_t nbytes, Device device, memory::CachingAllocator& allocator,
                          memory::StreamId stream = 0);
  // Memory Tally does not own (from_blob): never freed by Tally.
  static Storage borrow(void* data, size_t nbytes, Device device);

  void* data() const { return impl_ ? impl_->data : nullptr; }
  size_t nbytes() const { return impl_ ? impl_->nbytes : 0; }
  Device device() const { return impl_ ? impl_->device : Device::cpu(); }
  bool defined() const { return impl_ != nullptr; }
  bool owned() const { return impl_ && impl_->allocator != nullptr; }
  long use_count() const { return impl_.use_count(); }
  // Same underlying block.
  bool is_same(const Storage& o) const { return impl_ == o.impl_; }
  const void* key() const { return impl_.get(); }
  // Observes the block without keeping it: expired once the last Storage of it is gone
  // (a key() compared after that may name a new block at the same address).
  std::weak_ptr<const void> watch() const { return impl_; }

  // In-place modifications bump the version; saved tensors check it at unpack.
  uint64_t version() const { return impl_ ? impl_->version : 0; }
  void bump_version() const {
    if (impl_) ++impl_->version;
  }

  // The allocator that owns the block; null for borrowed memory.
  memory::CachingAllocator* allocator() const { return impl_ ? impl_->allocator : nullptr; }
  // Work queued on `stream` uses the block: once freed, it is reused only after that work
  // completes (CachingAllocator::record_stream). No-op for borrowed memory.
  void record_stream(memory::StreamId stream) const;

  // Hand the block to the op now running (CachingAllocator::reassign: it takes the current
  // allocation context's tag) when it sits on the stream that op allocates on; false, changing
  // nothing, otherwise or for borrowed memory. Bumps the version: the old contents are gone.
  bool reassign() const;
  // Re-tag the block's category (autograd: saved -> activation; .grad -> gradient).
  void retag(memory::Category c) const;
  memory::Category category() const;
  // Block size as the allocator rounded it (0 for borrowed memory).
  size_t block_bytes() const;

  // How many saved-for-backward references hold this storage (autograd's accounting).
  int saved_refs() const { return impl_ ? impl_->saved_refs : 0; }
  int add_saved_ref() const { return impl_ ? ++impl_->saved_refs : 0; }
  int drop_saved_ref() const { return impl_ ? --impl_->saved_refs : 0; }

 private:
  struct Impl {
    void* data = nullptr;
    size_t nbytes = 0;
    Device device;
    memory::CachingAllocator* allocator = nullptr;  // null: borrowed
    uint64_t version = 0;
    int saved_refs = 0;
    ~Impl();
  };
  std::shared_ptr<Impl> impl_;
};

// `bytes` of untyped scratch, tagged `workspace`; an empty Storage for 0 bytes. Here rather
// than beside alloc_scratch (tensor/op_alloc.h) so that backend code (tensor/cuda/) takes
// its library workspaces without reaching up to the op layer.
Storage alloc_scratch_bytes(size_t bytes, Device device);

}  // namespace tally
