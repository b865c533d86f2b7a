#include "tensor/cuda/async_copy.h"

#include <mutex>
#include <vector>

#include "tensor/cuda/graph.h"
#include "tensor/cuda/runtime.h"

namespace tally::cuda {
namespace {

// The copy stream waits for the work queued so far on Tally's stream. One reusable event
// per device: cudaStreamWaitEvent takes the event's state when it is called.
void copy_stream_after_compute(int device) {
  static std::mutex mu;
  static std::vector<cudaEvent_t> events;
  std::lock_guard lock(mu);
  cudaEvent_t e = per_device(events, device, "copy_stream_after_compute", [] {
    cudaEvent_t ev = nullptr;
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    return ev;
  });
  check(cudaEventRecord(e, stream(device)), "cudaEventRecord (offload copy)");
  check(cudaStreamWaitEvent(copy_stream(device), e, 0), "cudaStreamWaitEvent (offload copy)");
}

// dev -> host (to_host) or host -> dev on the copy stream, after the work queued so far on
// Tally's stream; both blocks are kept out of reuse until the copy stream has passed the copy.
void copy_on_copy_stream(const Tensor& dev, const Tensor& host, bool to_host, const char* what) {
  if (dev.nbytes() == 0) return;
  const int d = dev.device().index;
  check_not_capturing(d, "activation offload (copies on a second stream, fenced by the host)");
  DeviceGuard g(d);
  copy_stream_after_compute(d);
  check(cudaMemcpyAsync(to_host ? host.data_ptr() : dev.data_ptr(),
                        to_host ? dev.data_ptr() : host.data_ptr(), dev.nbytes(),
                        to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, copy_stream(d)),
        what);
  dev.storage().record_stream(copy_stream_id(d));
  host.storage().record_stream(copy_stream_id(d));
}

}  // namespace

void copy_pinned_to_device(const Tensor& host, const Tensor& dev) {
  NvtxRange range("to_device_async (H2D)");
  if (host.nbytes() == 0) return;
  const int d = dev.device().index;
  DeviceGuard g(d);
  check(cudaMemcpyAsync(dev.data_ptr(), host.data_ptr(), host.nbytes(), cudaMemcpyHostToDevice,
                        stream(d)),
        "to_device_async (H2D from pinned memory)");
  // The pinned block is read by the stream until the copy completes: keep it out of reuse.
  host.storage().record_stream(stream_id(d));
}

void copy_to_host_on_copy_stream(const Tensor& dev, const Tensor& host) {
  NvtxRange range("offload (D2H)");
  copy_on_copy_stream(dev, host, /*to_host=*/true, "offload (D2H to pinned memory)");
}

void copy_to_device_on_copy_stream(const Tensor& host, const Tensor& dev) {
  NvtxRange range("prefetch (H2D)");
  copy_on_copy_stream(dev, host, /*to_host=*/false, "prefetch (H2D from pinned memory)");
}

std::shared_ptr<void> record_copy_event(int device) {
  DeviceGuard g(device);
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate (copy fence)");
  check(cudaEventRecord(e, copy_stream(device)), "cudaEventRecord (copy fence)");
  return std::shared_ptr<void>(e, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
}

void synchronize_copy_event(int device, const std::shared_ptr<void>& event) {
  DeviceGuard g(device);
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event.get())),
        "cudaEventSynchronize (copy fence)");
}

bool query_copy_event(int device, const std::shared_ptr<void>& event) {
  DeviceGuard g(device);
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event.get()));
  if (e == cudaErrorNotReady) {
    cudaGetLastError();  // not an error: clear it
    return false;
  }
  check(e, "cudaEventQuery (copy fence)");
  return true;
}

void stream_wait_copy_event(int device, const std::shared_ptr<void>& event) {
  DeviceGuard g(device);
  check(cudaStreamWaitEvent(stream(device), static_cast<cudaEvent_t>(event.get()), 0),
        "cudaStreamWaitEvent (copy fence)");
}

}  // namespace tally::cuda
