#include "memory/cuda_provider.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <stdexcept>

namespace tally::memory {
namespace {

void check(cudaError_t err, const char* what, int device) {
  if (err != cudaSuccess)
    throw std::runtime_error(fmt::format("{} on cuda:{} failed: {} ({})", what, device,
                                         cudaGetErrorString(err), cudaGetErrorName(err)));
}

// Sets the current device for the scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice", device);
    set_ = prev_ != device;
  }
  ~DeviceGuard() {
    if (set_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool set_ = false;
};

}  // namespace

CudaProvider::CudaProvider(int device) : device_(device) {}

int CudaProvider::device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

std::string CudaProvider::device_name() const {
  return fmt::format("cuda:{}", device_);
}

void* CudaProvider::allocate(size_t bytes) {
  DeviceGuard g(device_);
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it so later launches do not see it
    return nullptr;
  }
  check(err, "cudaMalloc", device_);
  return p;
}

void CudaProvider::deallocate(void* ptr, size_t /*bytes*/) {
  DeviceGuard g(device_);
  check(cudaFree(ptr), "cudaFree", device_);
}

size_t CudaProvider::total_memory() const {
  DeviceGuard g(device_);
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo", device_);
  return total;
}

size_t CudaProvider::free_memory() const {
  DeviceGuard g(device_);
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo", device_);
  return free;
}

void CudaProvider::synchronize() {
  DeviceGuard g(device_);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", device_);
}

EventId CudaProvider::record_event(StreamId stream) {
  DeviceGuard g(device_);
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate", device_);
  check(cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord", device_);
  return reinterpret_cast<EventId>(ev);
}

bool CudaProvider::query_event(EventId event) {
  DeviceGuard g(device_);
  const cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery", device_);
  return true;
}

void CudaProvider::destroy_event(EventId event) {
  DeviceGuard g(device_);
  cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event));
}

}  // namespace tally::memory
