// cudaMalloc/cudaFree as a MemoryProvider, one per device. Only built with the CUDA
// backend (TALLY_WITH_CUDA). Its expandable segments use the driver's virtual memory API
// (cuMemAddressReserve; cuMemCreate + cuMemMap + cuMemSetAccess per page; cuMemUnmap +
// cuMemRelease), found through the runtime (cudaGetDriverEntryPointByVersion), so Tally
// still links only the runtime.
#pragma once

#include "memory/provider.h"

namespace tally::memory {

class CudaProvider final : public MemoryProvider {
 public:
  explicit CudaProvider(int device);

  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) override;
  size_t total_memory() const override;
  size_t free_memory() const override;
  DeviceType device_type() const override { return DeviceType::cuda; }
  int device_index() const override { return device_; }
  std::string device_name() const override;
  void synchronize() override;
  EventId record_event(StreamId stream) override;
  bool query_event(EventId event) override;
  void destroy_event(EventId event) override;
  // Throws std::runtime_error naming the call when the driver lacks the virtual memory API
  // (or the device does not support it: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  // is 0) or reserving fails; std::invalid_argument when page_size is not a multiple of the
  // device's allocation granularity.
  std::unique_ptr<ExpandableSegment> create_expandable_segment(StreamId stream, size_t page_size,
                                                               size_t pages) override;

  // Number of visible devices; 0 when there is no driver or no device.
  static int device_count();
  // The device's multiprocessor count.
  static int multiprocessor_count(int device);
  // The device's product name ("NVIDIA H200").
  static std::string product_name(int device);
  // Whether expandable segments can work on the device: the driver has the virtual memory
  // API and the device supports it.
  static bool virtual_memory_supported(int device);

 private:
  int device_;
};

}  // namespace tally::memory
