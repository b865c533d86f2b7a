// The device behind the caching allocator. The allocator's policy is plain C++ over this
// interface (design rule 3): the CPU provider makes every feature testable without a GPU,
// the CUDA provider is the same policy over cudaMalloc/cudaFree.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tally::memory {

// A stream as the raw handle value (cudaStream_t as an integer); 0 is the default stream.
using StreamId = uint64_t;
// An opaque event handle recorded on a stream (for cross-stream frees).
using EventId = uint64_t;

// cpu and cuda run kernels on data; meta (memory/meta.h) has shapes and allocations but no
// data: the dry run that predicts a run's memory.
enum class DeviceType : uint8_t { cpu, cuda, meta };

class MemoryProvider {
 public:
  virtual ~MemoryProvider() = default;

  // Reserve `bytes` of device memory. Returns nullptr when the device is out of memory;
  // any other failure throws.
  virtual void* allocate(size_t bytes) = 0;
  // Return memory from allocate() to the device.
  virtual void deallocate(void* ptr, size_t bytes) = 0;

  virtual size_t total_memory() const = 0;
  virtual size_t free_memory() const = 0;

  virtual DeviceType device_type() const = 0;
  virtual int device_index() const = 0;
  // "cpu" or "cuda:0".
  virtual std::string device_name() const = 0;

  // Wait for all work on the device (before cached segments are released, as PyTorch does).
  virtual void synchronize() {}

  // Cross-stream use of a block: an event recorded on `stream` now; the block may be
  // reused once query_event says it completed. The CPU provider completes at once.
  virtual EventId record_event(StreamId /*stream*/) { return 0; }
  virtual bool query_event(EventId /*event*/) { return true; }
  virtual void destroy_event(EventId /*event*/) {}
};

}  // namespace tally::memory
