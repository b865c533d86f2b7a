#include "tensor/cuda/runtime.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "memory/memory.h"
#include "tensor/cuda/graph.h"

namespace tally::cuda {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(fmt::format("{}: CUDA error {} ({})", what, cudaGetErrorName(err),
                                         cudaGetErrorString(err)));
}

void check_launch(const char* what) {
  check(cudaGetLastError(), what);
}

namespace {
// One non-blocking stream per device in `table` (guarded by `mu`), created on first use.
cudaStream_t stream_of(std::mutex& mu, std::vector<cudaStream_t>& table, int device,
                       const char* what) {
  std::lock_guard lock(mu);
  return per_device(table, device, what, [what] {
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), what);
    return s;
  });
}
}  // namespace

cudaStream_t stream(int device) {
  static std::mutex mu;
  static std::vector<cudaStream_t> streams;
  return stream_of(mu, streams, device, "cuda::stream");
}

cudaStream_t copy_stream(int device) {
  static std::mutex mu;
  static std::vector<cudaStream_t> streams;
  return stream_of(mu, streams, device, "cuda::copy_stream");
}

// With one visible device, device 0 is always current (cudaSetDevice cannot name another),
// so a guard for it has nothing to do. Most ops take a guard: this spares each of them two
// cudaGetDevice calls, which the profiler's CUPTI tracer records as runtime API activity.
DeviceGuard::DeviceGuard(int device) {
  static const int visible = memory::cuda_device_count();  // fixed once CUDA is initialised
  if (visible == 1 && device == 0) return;
  active_ = true;
  check(cudaGetDevice(&prev_), "cudaGetDevice");
  if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  if (!active_) return;
  int cur = 0;
  if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
}

void synchronize(int device) {
  check_not_capturing(device, "synchronize (a wait for the device)");
  DeviceGuard g(device);
  check(cudaStreamSynchronize(stream(device)), "cudaStreamSynchronize");
}

namespace {

// cudaDeviceGetAttribute(attr, device), looked up once per (attribute, device).
int cached_attribute(cudaDeviceAttr attr, int device, const char* what) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> cache;
  std::lock_guard lock(mu);
  const auto key = std::make_pair(static_cast<int>(attr), device);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  check(cudaDeviceGetAttribute(&n, attr, device), what);
  cache.emplace(key, n);
  return n;
}

}  // namespace

int sm_count(int device) {
  return std::max(1, cached_attribute(cudaDevAttrMultiProcessorCount, device,
                                      "cudaDeviceGetAttribute(multiProcessorCount)"));
}

size_t max_block_smem_optin(int device) {
  return static_cast<size_t>(
      cached_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device,
                       "cudaDeviceGetAttribute(maxSharedMemoryPerBlockOptin)"));
}

int compute_capability(int device) {
  return 10 * cached_attribute(cudaDevAttrComputeCapabilityMajor, device,
                               "cudaDeviceGetAttribute(computeCapabilityMajor)") +
         cached_attribute(cudaDevAttrComputeCapabilityMinor, device,
                          "cudaDeviceGetAttribute(computeCapabilityMinor)");
}

}  // namespace tally::cuda
