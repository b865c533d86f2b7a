// Page-locked (pinned) host memory as a MemoryProvider: cudaHostAlloc/cudaFreeHost. Its
// blocks are CPU memory that the GPU's copy engines read directly, so a host-to-device
// cudaMemcpyAsync from them is truly asynchronous. Events are recorded on whatever
// device's stream used the block, so the caching allocator's record_stream machinery
// keeps a pinned buffer out of reuse until the copies reading it have finished. Only
// built with the CUDA backend (TALLY_WITH_CUDA).
#pragma once

#include "memory/cpu_provider.h"

namespace tally::memory {

// Its capacity is the machine's physical memory; pinned memory is a part of it.
class CudaPinnedProvider final : public HostMemoryProvider {
 public:
  CudaPinnedProvider();

  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) override;
  std::string device_name() const override { return "cpu (pinned)"; }
  // Waits for every device (a cached pinned segment may still be read by any of them).
  void synchronize() override;
  EventId record_event(StreamId stream) override;
  bool query_event(EventId event) override;
  void destroy_event(EventId event) override;
};

}  // namespace tally::memory
