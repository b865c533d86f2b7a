// cudaMalloc/cudaFree as a MemoryProvider, one per device. Only built with the CUDA
// backend (TALLY_WITH_CUDA).
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

  // Number of visible devices; 0 when there is no driver or no device.
  static int device_count();
  // The device's multiprocessor count.
  static int multiprocessor_count(int device);
  // The device's product name ("NVIDIA H200").
  static std::string product_name(int device);

 private:
  int device_;
};

}  // namespace tally::memory
