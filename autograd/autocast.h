// Autocast (mixed precision), PyTorch's torch.autocast: inside an AutocastGuard region the
// differentiable ops that profit from 16-bit math (matmul, mm, bmm, linear, conv2d,
// scaled_dot_product_attention) cast their floating inputs to the region's dtype, and the
// ops that need range or precision (softmax, log_softmax, cross_entropy, nll_loss,
// layer_norm, rms_norm, exp, log, pow, rsqrt, logsumexp, sum) cast them to float32.
// cross_entropy is the one exception in form, not in numbers: float16/bfloat16 logits are
// read as they are and the arithmetic and the loss are float32 (PyTorch reaches the same
// through log_softmax(dtype=float32)), so no float32 copy of the logits is made.
// How it hooks into the ops, the policies and the weight cache: docs/notes.md §3.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "base/scope_guard.h"
#include "tensor/tensor.h"

namespace tally {

// RAII, like `with torch.autocast(device_type, dtype, enabled, cache_enabled)`: nestable
// and thread-local; restores the previous settings on exit. dtype must be float16 or
// bfloat16.
class AutocastGuard : base::ScopeGuard<void> {
 public:
  AutocastGuard(DeviceType device, DType dtype, bool enabled = true, bool cache_enabled = true);
  // The device's default dtype (float16 for CUDA, bfloat16 for CPU, as PyTorch).
  explicit AutocastGuard(DeviceType device, bool enabled = true);
  ~AutocastGuard();

 private:
  DeviceType device_;
  bool prev_enabled_;
  DType prev_dtype_;
  bool prev_cache_enabled_;
};

bool is_autocast_enabled(DeviceType device);
DType autocast_dtype(DeviceType device);
bool is_autocast_cache_enabled();
// torch.clear_autocast_cache(): drop the cached weight casts now.
void clear_autocast_cache();
// Number of cached weight casts (tests, reports).
size_t autocast_cache_size();

namespace autocast {

// This thread's whole autocast state, to replay a region later (checkpoint recompute).
struct State {
  bool enabled[3] = {false, false, false};  // by DeviceType (cpu, cuda, meta)
  DType dtype[3] = {DType::bfloat16, DType::float16, DType::bfloat16};
  bool cache_enabled = true;
  bool excluded = false;
};
State current_state();

// RAII: this thread's autocast state set to `state`; the previous state restored on exit.
// Counts as an autocast region for the cache (cleared when the outermost one exits).
class StateScope : base::ScopeGuard<State> {
 public:
  explicit StateScope(const State& state);
  ~StateScope();
};

// RAII: autocast off for the ops inside (PyTorch excludes the Autocast dispatch key while
// an autocast wrapper runs). A composite op that made its own casts wraps its body in one,
// so its inner ops run in the dtype it chose.
class ExcludeScope : base::ScopeGuard<bool> {
 public:
  ExcludeScope();
  ~ExcludeScope();
};

// Whether ops on `device` are autocast now (enabled and not excluded).
bool is_active(Device device);

enum class CastPolicy { lower_precision_fp, fp32 };

// `t` as the policy wants it for an op on `device` (t itself when nothing changes).
Tensor cast(const char* op, const Tensor& t, CastPolicy policy, Device device);

// Fills the weight cache now, as the lower-precision ops would fill it one cast at a time on
// first use: every tensor of `params` that such an op would cast and cache (a leaf float32
// tensor that requires grad, on a device where autocast is active, with the cache enabled)
// and that is not cached yet is cast in one multi-tensor copy per device and dtype
// (ops::foreach_copy_: one CUDA launch for up to 80 tensors) instead of one copy each. Each
// cast is allocated as the lazy one would be (category autocast_cache, op "to") under
// memory::ModuleScope(module_names[i]) (a path relative to the current module; no names: the
// current module), and has the lazy cast's value and graph (ToCopyBackward). A model calls it
// at the top of its forward with the weights of its Linear and Conv2d layers (nn/models);
// nothing else changes. Does nothing outside an autocast region.
void cache_casts(const TensorList& params, const std::vector<std::string>& module_names = {});

namespace detail {
template <typename... Ts>
Device first_device(const Ts&... ts) {
  Device d = Device::cpu();
  bool found = false;
  ((found || !ts.defined() ? void() : (d = ts.device(), found = true, void())), ...);
  return d;
}

template <typename... Ts>
std::array<Tensor, sizeof...(Ts)> apply(const char* op, CastPolicy policy, const Ts&... ts) {
  const Device d = first_device(ts...);
  if (!is_active(d)) return {ts...};
  return {cast(op, ts, policy, d)...};
}
}  // namespace detail

// The inputs of a lower-precision op (matmul, linear, conv2d, ...), cast for the region.
// Undefined tensors stay undefined; non-floating and float64 tensors are left alone.
template <typename... Ts>
std::array<Tensor, sizeof...(Ts)> lower(const char* op, const Ts&... ts) {
  return detail::apply(op, CastPolicy::lower_precision_fp, ts...);
}

// The inputs of a float32 op (softmax, layer_norm, cross_entropy, ...), cast to float32
// inside an autocast region.
template <typename... Ts>
std::array<Tensor, sizeof...(Ts)> fp32(const char* op, const Ts&... ts) {
  return detail::apply(op, CastPolicy::fp32, ts...);
}

}  // namespace autocast
}  // namespace tally
