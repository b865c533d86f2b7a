#include "memory/cuda_pinned_provider.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <stdexcept>

namespace tally::memory {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(fmt::format("{} (pinned host memory) failed: {} ({})", what,
                                         cudaGetErrorString(err), cudaGetErrorName(err)));
}

size_t physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page)
                               : (size_t{1} << 34);
}

// Makes `device` current for the scope (events must be created on the stream's device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
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

CudaPinnedProvider::CudaPinnedProvider() : capacity_(physical_memory()) {}

void* CudaPinnedProvider::allocate(size_t bytes) {
  if (bytes > capacity_ - used_.load()) return nullptr;
  void* p = nullptr;
  // Portable: usable from every device's streams, not only the current one's.
  const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return nullptr;
  }
  check(err, "cudaHostAlloc");
  used_ += bytes;
  return p;
}

void CudaPinnedProvider::deallocate(void* ptr, size_t bytes) {
  check(cudaFreeHost(ptr), "cudaFreeHost");
  used_ -= bytes;
}

size_t CudaPinnedProvider::free_memory() const {
  return capacity_ - used_.load();
}

void CudaPinnedProvider::synchronize() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  for (int d = 0; d < n; ++d) {
    DeviceGuard g(d);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
}

EventId CudaPinnedProvider::record_event(StreamId stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  int device = 0;
  if (s != nullptr) {
    check(cudaStreamGetDevice(s, &device), "cudaStreamGetDevice");
  } else {
    check(cudaGetDevice(&device), "cudaGetDevice");
  }
  DeviceGuard g(device);
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaEventRecord(ev, s), "cudaEventRecord");
  return reinterpret_cast<EventId>(ev);
}

bool CudaPinnedProvider::query_event(EventId event) {
  const cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery");
  return true;
}

void CudaPinnedProvider::destroy_event(EventId event) {
  cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event));
}

}  // namespace tally::memory
