#include "memory/cuda_pinned_provider.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <stdexcept>

#include "memory/cuda_device_guard.h"

namespace tally::memory {
namespace {

// `device` is unused: pinned memory belongs to no device (CudaDeviceGuard passes one).
void check(cudaError_t err, const char* what, int /*device*/ = 0) {
  if (err != cudaSuccess)
    throw std::runtime_error(fmt::format("{} (pinned host memory) failed: {} ({})", what,
                                         cudaGetErrorString(err), cudaGetErrorName(err)));
}

}  // namespace

CudaPinnedProvider::CudaPinnedProvider() : HostMemoryProvider(physical_memory()) {}

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

void CudaPinnedProvider::synchronize() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  for (int d = 0; d < n; ++d) {
    CudaDeviceGuard g(d, check);
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
  CudaDeviceGuard g(device, check);
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
