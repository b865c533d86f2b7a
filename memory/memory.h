// The process-wide allocators, one per device, and PyTorch-named functions over them
// (torch.cuda.memory_allocated, memory_summary, record_memory_history, ...). Everything
// Tally allocates for tensor data or library workspace goes through get_allocator().
#pragma once

#include <map>
#include <memory>
#include <string>

#include "memory/caching_allocator.h"

namespace tally::memory {

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::cuda, index}; }
  // A meta device (memory/meta.h): meta:0 replays the CPU backend; new_meta_device() makes
  // others, each replaying a target device.
  static Device meta(int index = 0) { return {DeviceType::meta, index}; }
  bool is_meta() const { return type == DeviceType::meta; }
  std::string str() const;
  bool operator==(const Device&) const = default;
};

// Whether this build has the CUDA backend and a device is present.
bool cuda_available();
int cuda_device_count();
// cuda:0 when available, else cpu.
Device default_device();

// The allocator for `device`, created on first use with TALLY_ALLOC_CONF's settings.
// Throws std::invalid_argument for a device that does not exist.
CachingAllocator& get_allocator(Device device = default_device());

// While alive, on this thread, get_allocator(Device::cpu()) is an allocator of this scope's own
// (its stats, cache and history; released at the end): work that must leave no trace in the
// CPU's allocator, such as the memory planner's timing of the CPU. Tensors made inside must not
// outlive the scope. Scopes do not nest.
class PrivateCpuAllocatorScope {
 public:
  PrivateCpuAllocatorScope();
  ~PrivateCpuAllocatorScope();
  PrivateCpuAllocatorScope(const PrivateCpuAllocatorScope&) = delete;
  PrivateCpuAllocatorScope& operator=(const PrivateCpuAllocatorScope&) = delete;

 private:
  std::unique_ptr<CachingAllocator> allocator_;
};

size_t memory_allocated(Device device = default_device());
size_t max_memory_allocated(Device device = default_device());
size_t memory_reserved(Device device = default_device());
size_t max_memory_reserved(Device device = default_device());
void reset_peak_memory_stats(Device device = default_device());
void empty_cache(Device device = default_device());
// Waits until all work queued on the device has finished (torch.cuda.synchronize); a no-op
// on the CPU.
void synchronize(Device device = default_device());
void set_per_process_memory_fraction(double fraction, Device device = default_device());
std::map<std::string, int64_t> memory_stats(Device device = default_device());
std::string memory_summary(Device device = default_device(), bool abbreviated = false);
void record_memory_history(bool enabled, size_t max_entries = 100000,
                           Device device = default_device());
void dump_snapshot(const std::string& path, Device device = default_device());

// Page-locked host memory (cudaHostAlloc) for fast asynchronous host-to-device copies:
// a process-wide caching allocator of its own, so its stats, summary and snapshot are
// separate from the CPU allocator's (its provider is named "cpu (pinned)"). Its blocks are
// CPU-device memory. Without CUDA or without a GPU there is nothing to pin: this returns
// the ordinary CPU allocator, so code that asks for pinned buffers runs everywhere.
CachingAllocator& get_pinned_allocator();
// Whether get_pinned_allocator() hands out real page-locked memory.
bool pinned_memory_available();

}  // namespace tally::memory
