// What the meta kernels (tensor/<family>/meta.cpp) share: the target a meta tensor's device
// replays (memory/meta.h), and the entry of a kernel that allocates nothing on the replayed
// backend, charged by the cost model (tensor/meta/cost.h). A meta kernel writes nothing; it asks
// the caching allocator, through alloc_scratch, for the scratch the replayed backend's kernel asks
// for, so a dry run's allocations are the real run's.
#pragma once

#include <algorithm>
#include <type_traits>
#include <utility>

#include "memory/meta.h"
#include "tensor/meta/cost.h"
#include "tensor/op_alloc.h"
#include "tensor/tensor.h"

namespace tally::meta {

inline const memory::MetaTarget& target(const Tensor& t) {
  return memory::meta_target_of(t.device());
}
inline bool replays_cuda(const Tensor& t) {
  return target(t).type == DeviceType::cuda;
}

// The bytes of a kernel's tensor arguments (each read or written once).
inline double tensor_bytes() {
  return 0;
}
template <typename A, typename... Rest>
double tensor_bytes(const A& a, const Rest&... rest) {
  double b = 0;
  if constexpr (std::is_same_v<A, Tensor>) b = a.defined() ? static_cast<double>(a.nbytes()) : 0;
  return b + tensor_bytes(rest...);
}
template <typename A, typename... Rest>
const Tensor* first_tensor(const A& a, const Rest&... rest) {
  if constexpr (std::is_same_v<A, Tensor>)
    if (a.defined()) return &a;
  if constexpr (sizeof...(Rest) > 0) return first_tensor(rest...);
  return nullptr;
}

// The kernel-table entry of a memory-bound kernel whose replayed backends allocate nothing
// (elementwise maps, reductions, pooling, norms' forwards): converts to any of the tables'
// function-pointer types returning void, and costs the bytes of its tensor arguments.
inline constexpr auto nothing = [](auto... args) {
  if constexpr (sizeof...(args) > 0)
    if (const Tensor* t = first_tensor(args...)) cost(*t, 0, tensor_bytes(args...));
};

// The table of a family none of whose kernels allocates on either backend: every entry
// `nothing` (a table is function pointers only, so its size counts them).
template <typename Table>
constexpr Table all_nothing() {
  constexpr size_t n = sizeof(Table) / sizeof(void (*)());
  static_assert(n * sizeof(void (*)()) == sizeof(Table), "a kernel table holds function pointers");
  return [&]<size_t... I>(std::index_sequence<I...>) {
    return Table{((void)I, nothing)...};
  }
  (std::make_index_sequence<n>{});
}

// cuBLASLt's workspace for one product on a CUDA target (tensor/linalg/cuda_matmul.cpp
// takes one per call and returns it when the call is enqueued).
inline void matmul_workspace(const Tensor& out) {
  if (replays_cuda(out)) alloc_scratch_bytes(target(out).matmul_workspace, out.device());
}

}  // namespace tally::meta
