// Internal to memory/'s CUDA providers (CUDA builds only): makes a device current for a
// scope and restores the previous one on exit. memory/ is below tensor/, so it cannot use
// tensor/cuda/runtime.h's DeviceGuard; each provider passes its own error check, which
// words the message for that provider.
#pragma once

#include <cuda_runtime.h>

#include "memory/scope_guard.h"

namespace tally::memory {

class CudaDeviceGuard : ScopeGuard<void> {
 public:
  // A failed cudaSetDevice is reported through check(err, "cudaSetDevice", device).
  template <typename Check>
  CudaDeviceGuard(int device, Check&& check) {
    cudaGetDevice(&prev_);
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice", device);
    set_ = prev_ != device;
  }
  ~CudaDeviceGuard() {
    if (set_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool set_ = false;
};

}  // namespace tally::memory
