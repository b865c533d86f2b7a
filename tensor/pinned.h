// Pinned (page-locked) host tensors and asynchronous host-to-device copies, PyTorch's
// tensor.pin_memory(), tensor.is_pinned() and tensor.to(device, non_blocking=True).
//
// Pinned tensors come from memory::get_pinned_allocator() (its own stats, device cpu).
// A copy from a pinned tensor is enqueued on Tally's stream for the device and returns at
// once; the pinned block is marked as used by that stream (record_stream), so that once
// the host tensor is dropped its memory is not handed out again before the copy has read
// it. Without a GPU, "pinned" tensors are ordinary CPU tensors (is_pinned() is false).
//
// Offload copies (autograd/offload.h builds activation offload on them) run on a second
// stream per device, ordered after the work queued so far on Tally's stream, so that they
// overlap with the ops that follow; a CopyFence is how Tally's stream later waits for them
// without the host waiting. On the CPU they are plain copies made at once; on a meta device
// (dry runs) they allocate what the real copies allocate and copy nothing.
#pragma once

#include <memory>

#include "memory/category.h"
#include "tensor/tensor.h"

namespace tally::ops {

// An uninitialised contiguous tensor in pinned host memory (CPU memory without a GPU).
Tensor empty_pinned(const Shape& shape, DType dtype = DType::float32);
// `t` itself when already pinned, else a contiguous pinned copy. `t` must be on the CPU.
Tensor pin_memory(const Tensor& t);
// Whether t's storage is page-locked memory from the pinned allocator.
bool is_pinned(const Tensor& t);

// `host` on `device`, allocated there under `category` (input batches by default). A
// pinned, contiguous CPU source to a CUDA device is copied with cudaMemcpyAsync on Tally's
// stream and the call returns before the copy completes; any other source goes through
// ops::to (a pageable host buffer is staged synchronously by the driver). Same device:
// returns `host` itself.
Tensor to_device_async(const Tensor& host, Device device,
                       memory::Category category = memory::Category::input);

// A host copy of the contiguous tensor `t`, allocated under `category`: for a CUDA `t`
// from the pinned allocator when `pin_memory` (else pageable CPU memory, and the copy into
// it is synchronous, as in PyTorch); for a CPU `t` from the CPU allocator; filled on the copy
// stream for a CUDA `t`. t's block is kept out of reuse until the copy has read it. For a meta `t`
// the copy is allocated on the host the meta device's target has: the meta device itself for a CPU
// target, meta:0 otherwise.
Tensor to_host_async(const Tensor& t, memory::Category category, bool pin_memory = true);
// A new contiguous tensor on `device`, allocated now under `category`, filled from the
// contiguous host tensor `host` on the copy stream (CUDA). Before Tally's stream reads it,
// wait for a fence recorded after this call.
Tensor to_device_on_copy_stream(const Tensor& host, Device device, memory::Category category);

// dst.copy_(src) between a tensor on a device and one on its host (host_of), both contiguous,
// of one shape and dtype: on the copy stream for a CUDA device with a pinned host side, after
// the work queued so far on Tally's stream, both blocks kept out of reuse until the copy is
// done (wait for a fence recorded after this call before reading the result); a plain copy_ on
// the CPU; on a meta device, timed on its copy stream (nothing copied). The offloaded
// optimizer's gradients and weights (optim/cpu_offload.h) move this way.
void copy_on_copy_stream_(const Tensor& dst, const Tensor& src);
// The host memory of `device`: the CPU for the CPU and CUDA; for a meta device, the meta
// device itself when it replays the CPU, meta:0 (the host of every dry run) otherwise.
Device host_of(Device device);
// An uninitialised contiguous tensor in the host memory of `device` (host_of), pinned when
// the device is a GPU (empty_pinned), allocated under the current allocation context.
Tensor empty_host(const Shape& shape, DType dtype, Device device);

// A point on a device's copy stream. wait() makes Tally's stream wait until the copies
// issued before the fence have finished (no host synchronisation); empty for the CPU, where
// copies are done when they return. On a meta device that replays a GPU, the point's time on
// its copy stream (memory::meta_copies_done): waiting moves the dry run's clock on to it.
class CopyFence {
 public:
  CopyFence() = default;
  static CopyFence record(Device device);
  void wait() const;
  // The calling thread waits until the copies issued before the fence have finished (the
  // offloader's bound on copies in flight); nothing for an empty fence.
  void synchronize() const;
  // Whether those copies have finished, without waiting (torch.cuda.Event.query): always for an
  // empty fence; on a meta device, whether they end by the host's clock.
  bool query() const;
  bool empty() const { return event_ == nullptr && meta_seconds_ < 0; }

 private:
  std::shared_ptr<void> event_;
  int device_ = 0;
  double meta_seconds_ = -1;  // a meta device's fence: when its copies end
};

}  // namespace tally::ops
