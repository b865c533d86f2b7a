// Internal to memory/'s CUDA providers (CUDA builds only): makes a device current for a
// scope and restores the previous one on exit. memory/ is below tensor/, so it cannot use
// tensor/cuda/runtime.h's DeviceGuard; each provider passes its own error check, which
// words the message for that provider. Also RelaxedCapture (tensor/graph.cpp uses it too).
#pragma once

#include <cuda_runtime.h>

#include "base/scope_guard.h"

namespace tally::memory {

class CudaDeviceGuard : base::ScopeGuard<void> {
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

// For a scope, this thread's stream capture mode is relaxed: calls that enqueue nothing but
// that a capture in the default modes refuses (cudaMalloc, cudaHostAlloc, cudaFreeHost) go
// through. Used where such memory outlives the capture and its replays keep it alive: a
// graph-private pool's segments, the pinned host copies a graph keeps (as PyTorch does).
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace tally::memory
