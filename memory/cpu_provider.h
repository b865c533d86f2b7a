// Aligned host memory as a device, with an optional capacity so that out-of-memory
// behaviour can be exercised on a machine without a GPU. Its expandable segments reserve
// addresses with mmap(PROT_NONE) and map pages with mprotect, so that the allocator's
// growing segments run (and are tested) without a GPU.
#pragma once

#include <atomic>

#include "memory/provider.h"

namespace tally::memory {

// Host memory with a byte budget: what CpuProvider and CudaPinnedProvider share.
class HostMemoryProvider : public MemoryProvider {
 public:
  size_t total_memory() const override { return capacity_; }
  size_t free_memory() const override { return capacity_ - used_.load(); }
  DeviceType device_type() const override { return DeviceType::cpu; }
  int device_index() const override { return 0; }

  // The machine's physical memory (16 GiB when the system does not say).
  static size_t physical_memory();

 protected:
  explicit HostMemoryProvider(size_t capacity) : capacity_(capacity) {}

  size_t capacity_;
  std::atomic<size_t> used_{0};
};

class CpuProvider final : public HostMemoryProvider {
 public:
  // capacity 0 = the machine's physical memory.
  explicit CpuProvider(size_t capacity = 0);

  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) override;
  std::string device_name() const override { return "cpu"; }
  // Pages count against the capacity while mapped; page_size must be a multiple of the
  // system's page size.
  std::unique_ptr<ExpandableSegment> create_expandable_segment(StreamId stream, size_t page_size,
                                                               size_t pages) override;

  static constexpr size_t kAlignment = 4096;
};

}  // namespace tally::memory
