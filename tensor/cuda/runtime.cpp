#include "tensor/cuda/runtime.h"

#include <fmt/format.h>

#include <mutex>
#include <stdexcept>
#include <vector>

namespace tally::cuda {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(fmt::format("{}: CUDA error {} ({})", what, cudaGetErrorName(err),
                                         cudaGetErrorString(err)));
}

void check_launch(const char* what) { check(cudaGetLastError(), what); }

cudaStream_t stream(int device) {
  static std::mutex mu;
  static std::vector<cudaStream_t> streams;
  std::lock_guard lock(mu);
  if (device < 0) throw std::invalid_argument("cuda::stream: negative device");
  if (streams.size() <= static_cast<size_t>(device)) streams.resize(static_cast<size_t>(device) + 1, nullptr);
  cudaStream_t& s = streams[static_cast<size_t>(device)];
  if (!s) {
    DeviceGuard g(device);
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  return s;
}

DeviceGuard::DeviceGuard(int device) {
  check(cudaGetDevice(&prev_), "cudaGetDevice");
  if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  int cur = 0;
  if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
}

void synchronize(int device) {
  DeviceGuard g(device);
  check(cudaStreamSynchronize(stream(device)), "cudaStreamSynchronize");
}

int sm_count(int device) {
  static std::mutex mu;
  static std::vector<int> cache;
  std::lock_guard lock(mu);
  if (cache.size() <= static_cast<size_t>(device)) cache.resize(static_cast<size_t>(device) + 1, 0);
  int& n = cache[static_cast<size_t>(device)];
  if (n == 0) {
    check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
          "cudaDeviceGetAttribute(multiProcessorCount)");
    if (n <= 0) n = 1;
  }
  return n;
}

}  // namespace tally::cuda
