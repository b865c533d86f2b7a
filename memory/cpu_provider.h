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
  // What the operating system can still give (bytes); SIZE_MAX where it does not say.
  using AvailableFn = size_t (*)();

  // capacity 0 = the machine's physical memory. A request of kOsCheckBytes or more must also
  // leave kOsReserve of what the system can still give (`available`, MemAvailable of
  // /proc/meminfo): past that it fails as out-of-memory, with the allocator's report, where
  // touching the memory would have brought the kernel's out-of-memory killer.
  explicit CpuProvider(size_t capacity = 0, AvailableFn available = os_available_memory);

  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) override;
  // The capacity left, or less when the system has less to give.
  size_t free_memory() const override;
  std::string device_name() const override { return "cpu"; }
  // Pages count against the capacity while mapped; page_size must be a multiple of the
  // system's page size.
  std::unique_ptr<ExpandableSegment> create_expandable_segment(StreamId stream, size_t page_size,
                                                               size_t pages) override;

  // MemAvailable of /proc/meminfo; SIZE_MAX where it cannot be read.
  static size_t os_available_memory();
  // Whether `count` items of `item_bytes` each, built outside the allocator (Python objects,
  // views, a numpy copy), leave kOsReserve of what the system can still give. Sets `bytes`
  // to their size (SIZE_MAX where count * item_bytes overflows) and `available` to what the
  // system can give.
  static bool host_can_hold(uint64_t count, uint64_t item_bytes, uint64_t& bytes,
                            uint64_t& available);

  static constexpr size_t kAlignment = 4096;
  static constexpr size_t kOsCheckBytes = size_t{1} << 20;
  static constexpr size_t kOsReserve = size_t{256} << 20;

 private:
  AvailableFn available_;
};

}  // namespace tally::memory
