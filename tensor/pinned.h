// Pinned (page-locked) host tensors and asynchronous host-to-device copies, PyTorch's
// tensor.pin_memory(), tensor.is_pinned() and tensor.to(device, non_blocking=True).
//
// Pinned tensors come from memory::get_pinned_allocator() (its own stats, device cpu).
// A copy from a pinned tensor is enqueued on Tally's stream for the device and returns at
// once; the pinned block is marked as used by that stream (record_stream), so that once
// the host tensor is dropped its memory is not handed out again before the copy has read
// it. Without a GPU, "pinned" tensors are ordinary CPU tensors (is_pinned() is false).
#pragma once

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

}  // namespace tally::ops
