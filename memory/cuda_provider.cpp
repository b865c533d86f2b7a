#include "memory/cuda_provider.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <stdexcept>

#include "memory/cuda_device_guard.h"

namespace tally::memory {
namespace {

void check(cudaError_t err, const char* what, int device) {
  if (err != cudaSuccess)
    throw std::runtime_error(fmt::format("{} on cuda:{} failed: {} ({})", what, device,
                                         cudaGetErrorString(err), cudaGetErrorName(err)));
}

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

int CudaProvider::multiprocessor_count(int device) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(
        fmt::format("cudaDeviceGetAttribute(multiProcessorCount) failed for cuda:{}", device));
  }
  return n;
}

std::string CudaProvider::product_name(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(fmt::format("cudaGetDeviceProperties failed for cuda:{}", device));
  }
  return prop.name;
}

std::string CudaProvider::device_name() const {
  return fmt::format("cuda:{}", device_);
}

void* CudaProvider::allocate(size_t bytes) {
  CudaDeviceGuard g(device_, check);
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
  CudaDeviceGuard g(device_, check);
  check(cudaFree(ptr), "cudaFree", device_);
}

size_t CudaProvider::total_memory() const {
  CudaDeviceGuard g(device_, check);
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo", device_);
  return total;
}

size_t CudaProvider::free_memory() const {
  CudaDeviceGuard g(device_, check);
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo", device_);
  return free;
}

void CudaProvider::synchronize() {
  CudaDeviceGuard g(device_, check);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", device_);
}

EventId CudaProvider::record_event(StreamId stream) {
  CudaDeviceGuard g(device_, check);
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate", device_);
  check(cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord", device_);
  return reinterpret_cast<EventId>(ev);
}

bool CudaProvider::query_event(EventId event) {
  CudaDeviceGuard g(device_, check);
  const cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery", device_);
  return true;
}

void CudaProvider::destroy_event(EventId event) {
  CudaDeviceGuard g(device_, check);
  cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event));
}

}  // namespace tally::memory
