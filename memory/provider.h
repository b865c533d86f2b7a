// The device behind the caching allocator. The allocator's policy is plain C++ over this
// interface (design rule 3): the CPU provider makes every feature testable without a GPU,
// the CUDA provider is the same policy over cudaMalloc/cudaFree.
//
// Expandable segments (TALLY_ALLOC_CONF=expandable_segments:True, PyTorch's
// ExpandableSegment): a provider that supports them reserves a range of addresses without
// memory and maps whole pages of memory into it, and out again, as the allocator says. The
// allocator decides which pages (caching_allocator.cpp); the provider only maps them:
// CUDA with the driver's virtual memory API (cuMemAddressReserve, cuMemCreate + cuMemMap +
// cuMemSetAccess, cuMemUnmap + cuMemRelease), the CPU with mmap(PROT_NONE) + mprotect, the
// meta device by counting.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace tally::memory {

// A stream as the raw handle value (cudaStream_t as an integer); 0 is the default stream.
using StreamId = uint64_t;
// An opaque event handle recorded on a stream (for cross-stream frees).
using EventId = uint64_t;

// cpu and cuda run kernels on data; meta (memory/meta.h) has shapes and allocations but no
// data: the dry run that predicts a run's memory.
enum class DeviceType : uint8_t { cpu, cuda, meta };

// A reserved range of `pages` pages of `page_size` bytes at base(), none of them mapped at
// first. Offsets and sizes passed in are multiples of page_size() inside the range; the
// allocator never maps a mapped page nor unmaps an unmapped one. The destructor unmaps what
// is still mapped and gives the addresses back (errors there are ignored: it may run at
// process exit).
class ExpandableSegment {
 public:
  virtual ~ExpandableSegment() = default;
  ExpandableSegment(const ExpandableSegment&) = delete;
  ExpandableSegment& operator=(const ExpandableSegment&) = delete;

  uintptr_t base() const { return base_; }
  size_t page_size() const { return page_size_; }
  size_t pages() const { return pages_; }
  size_t size() const { return page_size_ * pages_; }  // the provider checked the product

  // Map memory at [offset, offset + bytes). false when the device is out of memory; any
  // other failure throws, naming the call. Either way nothing is mapped afterwards.
  virtual bool map(size_t offset, size_t bytes) = 0;
  // Unmap [offset, offset + bytes) and give its memory back, from `offset` upwards. `done`
  // counts the bytes unmapped so far, also when it throws (naming the call): the allocator
  // then forgets exactly those.
  virtual void unmap(size_t offset, size_t bytes, size_t& done) = 0;

 protected:
  ExpandableSegment(uintptr_t base, size_t page_size, size_t pages)
      : base_(base), page_size_(page_size), pages_(pages) {}

  uintptr_t base_;
  size_t page_size_;
  size_t pages_;
};

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

  // An expandable segment for blocks of `stream`: `pages` pages of `page_size` bytes of
  // addresses (page_size a multiple of the device's granularity). Throws
  // std::invalid_argument naming the device when it has no such memory (this default) or
  // the page size does not suit it, std::runtime_error naming the call when reserving the
  // addresses fails.
  virtual std::unique_ptr<ExpandableSegment> create_expandable_segment(StreamId /*stream*/,
                                                                       size_t /*page_size*/,
                                                                       size_t /*pages*/) {
    throw std::invalid_argument(
        "expandable_segments is supported on CUDA, the CPU and meta devices only; device " +
        device_name() + " has none");
  }
};

}  // namespace tally::memory
