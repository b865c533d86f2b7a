// The CUDA runtime side of the tensor layer: one non-default stream per device (every op
// enqueues there and returns: no hidden synchronisation), error checks that name the
// op, and the NVTX range every launcher opens.
#pragma once

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/env.h"
#include "memory/provider.h"

namespace tally::cuda {

// The stream Tally's ops use on `device` (created on first use, non-blocking).
cudaStream_t stream(int device);
inline memory::StreamId stream_id(int device) {
  return reinterpret_cast<memory::StreamId>(stream(device));
}
// A second stream per device for host<->device copies that overlap with the ops
// (activation offload, tensor/pinned.h): created on first use, non-blocking.
cudaStream_t copy_stream(int device);
inline memory::StreamId copy_stream_id(int device) {
  return reinterpret_cast<memory::StreamId>(copy_stream(device));
}
// Sets the current device for the scope. With one visible device it makes no CUDA call.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool active_ = false;  // false: the device was the only one, nothing to restore
};

// The object for `device` in a per-device table (a stream, a library handle): `create()` makes
// it on first use, with `device` current, and the table keeps it (never destroyed). The
// caller owns the table (thread-local, or behind its lock); `what` names it in the error for
// a negative device.
template <typename T, typename Create>
T per_device(std::vector<T>& table, int device, const char* what, Create create) {
  if (device < 0) throw std::invalid_argument(std::string(what) + ": negative device");
  if (table.size() <= static_cast<size_t>(device))
    table.resize(static_cast<size_t>(device) + 1, T{});
  T& h = table[static_cast<size_t>(device)];
  if (!h) {
    DeviceGuard g(device);
    h = create();
  }
  return h;
}

// Throws std::runtime_error naming `what` when err is not cudaSuccess.
void check(cudaError_t err, const char* what);
// After a launch: the launch error, named.
void check_launch(const char* what);
// Wait for Tally's stream on `device` (an explicit measurement/readback point).
void synchronize(int device);
// The device's multiprocessor count, looked up once per device (grid sizing).
int sm_count(int device);
// The shared memory one block may opt into (cudaFuncSetAttribute's ceiling), looked up once
// per device.
size_t max_block_smem_optin(int device);
// base::env_switch (base/env.h), as the CUDA switches (TALLY_CUDNN_SDP, ...) call it.
using base::env_switch;
// The compute capability as major * 10 + minor (90 on an H200), looked up once per device.
int compute_capability(int device);
// Lets `kernel` take `bytes` of dynamic shared memory (above the 48 KB default).
template <typename Kernel>
void set_max_dynamic_smem(Kernel kernel, size_t bytes, const char* what) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes)),
        what);
}

// An NVTX range for the lifetime of the scope.
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace tally::cuda
