// Page-locked (pinned) host memory as a MemoryProvider: cudaHostAlloc/cudaFreeHost. Its
// blocks are CPU memory that the GPU's copy engines read directly, so a host-to-device
// cudaMemcpyAsync from them is truly asynchronous. Events are recorded on whatever
// device's stream used the block, so the caching allocator's record_stream machinery
// keeps a pinned buffer out of reuse until the copies reading it have finished. Only
// built with the CUDA backend (TALLY_WITH_CUDA).
#pragma once

#include <atomic>

#include "memory/provider.h"

namespace tally::memory {

class CudaPinnedProvider final : public MemoryProvider {
 public:
  CudaPinnedProvider();

  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) override;
  // The machine's physical memory; pinned memory is a part of it.
  size_t total_memory() const override { return capacity_; }
  size_t free_memory() const override;
  DeviceType device_type() const override { return DeviceType::cpu; }
  int device_index() const override { return 0; }
  std::string device_name() const override { return "cpu (pinned)"; }
  // Waits for every device (a cached pinned segment may still be read by any of them).
  void synchronize() override;
  EventId record_event(StreamId stream) override;
  bool query_event(EventId event) override;
  void destroy_event(EventId event) override;

 private:
  size_t capacity_;
  std::atomic<size_t> used_{0};
};

}  // namespace tally::memory
