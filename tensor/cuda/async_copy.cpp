#include "tensor/cuda/async_copy.h"

#include "tensor/cuda/runtime.h"
#include "tensor/ops.h"

namespace tally::cuda {

Tensor copy_pinned_to_device(const Tensor& host, Device device) {
  NvtxRange range("to_device_async (H2D)");
  Tensor out = ops::empty(host.sizes(), host.dtype(), device);
  if (host.nbytes() == 0) return out;
  DeviceGuard g(device.index);
  check(cudaMemcpyAsync(out.data_ptr(), host.data_ptr(), host.nbytes(), cudaMemcpyHostToDevice,
                        stream(device.index)),
        "to_device_async (H2D from pinned memory)");
  // The pinned block is read by the stream until the copy completes: keep it out of reuse.
  host.storage().record_stream(stream_id(device.index));
  return out;
}

}  // namespace tally::cuda
