// The two ways an op gets memory, used by every op family and backend:
//   alloc_output  - an op's result: contiguous, tagged with the op's allocation context
//                   (`temporary` unless a more specific category is set, see DispatchScope);
//   alloc_scratch - memory a kernel needs only while it runs (partial sums, library
//                   workspaces), tagged `workspace`.
// Both take the device's caching allocator on the current stream, check the byte count for
// overflow, and name the op (the context's op) and the shape when the size cannot be
// represented.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/tensor.h"

namespace tally {

// A contiguous tensor of `shape` for an op's result.
Tensor alloc_output(const Shape& shape, DType dtype, Device device);
// The same laid out as `f` (channels_last: `shape` must be 4-D).
Tensor alloc_output(const Shape& shape, DType dtype, Device device, MemoryFormat f);

// Channels-last operands. True when every tensor in `ts` is laid out channels_last (and not
// also row-major: Tensor::suggest_memory_format) with `shape` as its sizes: an elementwise
// op over them then gives a channels_last result and runs on their flat views.
bool all_channels_last(std::initializer_list<const Tensor*> ts, const Shape& shape);
// The layout a family's kernels on `device` take for a tensor whose format is `f`: the CUDA
// kernels of conv2d, batch_norm, max_pool2d and adaptive_avg_pool2d (and the meta device,
// which stands for them) read channels_last as it is; the CPU kernels read NCHW, so their ops
// convert a channels_last operand first and the result back.
MemoryFormat kernel_memory_format(Device device, MemoryFormat f);
// A dense tensor's elements in memory order as a 1-D view [numel] (stride 1, same storage
// and offset). `t` must be contiguous in some memory format (std::logic_error otherwise).
Tensor flat_view(const Tensor& t);

// An op's result written over `donor`, an input the caller gave up (buffer donation, as
// PyTorch's in-place ops do): donor's block, handed to the running op (Storage::reassign),
// when nothing else holds it (no other handle, view or saved reference) and it is a contiguous
// or channels_last `shape` of `dtype` on `device` at offset 0 on the current stream (the result
// keeps the donor's layout); otherwise an undefined
// tensor, and the op allocates (alloc_output). The caller must not read donor's values after a
// donation.
Tensor donated_output(const Tensor& donor, const Shape& shape, DType dtype, Device device);

// A contiguous 1-D tensor of `numel` elements of scratch, tagged `workspace`.
Tensor alloc_scratch(int64_t numel, DType dtype, Device device);

// alloc_scratch_bytes (untyped scratch) is declared in tensor/storage.h.

// shape's element count times `element_size`; std::invalid_argument naming `what` and the
// shape for a negative size, std::length_error when the product does not fit in 63 bits
// (base::checked_nbytes).
size_t checked_nbytes(const Shape& shape, size_t element_size, const char* what);

}  // namespace tally
