// What the meta kernels (tensor/<family>/meta.cpp) share: the target a meta tensor's device
// replays (memory/meta.h), and the entry of a kernel that allocates nothing on the replayed
// backend. A meta kernel writes nothing; it asks the caching allocator, through
// alloc_scratch, for the scratch the replayed backend's kernel asks for, so a dry run's
// allocations are the real run's.
#pragma once

#include "memory/meta.h"
#include "tensor/op_alloc.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace tally::meta {

inline const memory::MetaTarget& target(const Tensor& t) {
  return memory::meta_target_of(t.device());
}
inline bool replays_cuda(const Tensor& t) {
  return target(t).type == DeviceType::cuda;
}

// The kernel-table entry of a kernel whose replayed backends allocate nothing: converts to
// any of the tables' function-pointer types returning void.
inline constexpr auto nothing = [](auto...) {};

// cuBLASLt's workspace for one product on a CUDA target (tensor/linalg/cuda_matmul.cpp
// takes one per call and returns it when the call is enqueued).
inline void matmul_workspace(const Tensor& out) {
  if (replays_cuda(out)) alloc_scratch_bytes(target(out).matmul_workspace, out.device());
}

}  // namespace tally::meta
