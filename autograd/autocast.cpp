// Autocast state (thread-local), the cast policies and the weight-cast cache.
#include "autograd/autocast.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "autograd/node.h"
#include "memory/context.h"
#include "tensor/op_alloc.h"
#include "tensor/ops.h"

namespace tally {
namespace {

struct CacheEntry {
  Tensor source;     // keeps the key's TensorImpl alive (and its address unique)
  uint64_t version;  // the source's storage version when cast
  Tensor cast;
};

struct ThreadState {
  autocast::State state;
  int nesting = 0;  // live autocast regions (guards and state scopes) on this thread
  // key: (source impl, target dtype)
  std::unordered_map<const TensorImpl*, CacheEntry> cache[2];  // by target: float16, bfloat16
  // Each cache's keys in insertion order: the cache is emptied in this order, so the casts
  // return to the allocator in the same order in every run (a dry run replays it exactly).
  std::vector<const TensorImpl*> order[2];
};

thread_local ThreadState tls;

int device_slot(DeviceType d) {
  return static_cast<int>(d);  // the order of AutocastState's arrays
}
int dtype_slot(DType d) {
  return d == DType::bfloat16 ? 1 : 0;
}

void check_dtype(DType dtype) {
  if (dtype != DType::float16 && dtype != DType::bfloat16)
    throw std::invalid_argument(
        fmt::format("autocast: dtype must be float16 or bfloat16, got {}", dtype_name(dtype)));
}

void enter_region() {
  ++tls.nesting;
}
void exit_region() {
  if (--tls.nesting == 0) clear_autocast_cache();
}

// A leaf float32 tensor that requires grad, cast to the region's dtype (PyTorch's
// can_try_cache).
bool cacheable(const Tensor& t, DType target) {
  return tls.state.cache_enabled && t.dtype() == DType::float32 && t.requires_grad() &&
         t.is_leaf() && (target == DType::float16 || target == DType::bfloat16);
}

// The graph of a cached weight cast `out` of the float32 leaf `src`: ToCopyBackward, as
// src.to(dtype) records, but declaring its gradient float32 (autograd::grad_dtype), so an op
// that can write the parameter's gradient in float32 (linear's GEMM) hands it over without a
// 16-bit copy and a conversion; a 16-bit gradient is converted by the engine, as before.
void record_weight_cast(const Tensor& src, const Tensor& out) {
  auto node =
      autograd::record("ToCopyBackward", {src}, {out}, {},
                       [d = src.device(), t = src.dtype()](autograd::BackwardContext&,
                                                           const TensorList& grad) -> TensorList {
                         return {ops::to(grad[0], d, t)};
                       });
  if (!node) return;
  node->outputs[0].dtype = src.dtype();
  // cache_casts records every weight's cast before the forward's first op, so by order of
  // creation these nodes would run last, each holding its weight's gradient until the end of
  // backward. The cast only hands the gradient to the leaf: run it as soon as it is ready.
  node->sequence_nr = autograd::kRunWhenReadySeq;
}

Tensor cached_cast(const Tensor& t, DType target) {
  auto& cache = tls.cache[dtype_slot(target)];
  const uint64_t version = t.storage().version();
  auto it = cache.find(t.unsafe_impl());
  // A cast made under no_grad has no graph; reuse it only while grad mode is off too.
  if (it != cache.end() && it->second.version == version &&
      (!GradMode::is_enabled() || it->second.cast.requires_grad()))
    return it->second.cast;
  Tensor out;
  {
    memory::CategoryScope category(memory::Category::autocast_cache);
    out = ops::to(t, target);
  }
  record_weight_cast(t, out);
  if (it == cache.end()) tls.order[dtype_slot(target)].push_back(t.unsafe_impl());
  cache[t.unsafe_impl()] = CacheEntry{t, version, out};
  return out;
}

}  // namespace

// ---------------------------------------------------------------- guard

AutocastGuard::AutocastGuard(DeviceType device, DType dtype, bool enabled, bool cache_enabled)
    : device_(device) {
  check_dtype(dtype);
  const int s = device_slot(device);
  prev_enabled_ = tls.state.enabled[s];
  prev_dtype_ = tls.state.dtype[s];
  prev_cache_enabled_ = tls.state.cache_enabled;
  tls.state.enabled[s] = enabled;
  tls.state.dtype[s] = dtype;
  tls.state.cache_enabled = cache_enabled;
  enter_region();
}

AutocastGuard::AutocastGuard(DeviceType device, bool enabled)
    : AutocastGuard(device, device == DeviceType::cuda ? DType::float16 : DType::bfloat16,
                    enabled) {}

AutocastGuard::~AutocastGuard() {
  const int s = device_slot(device_);
  tls.state.enabled[s] = prev_enabled_;
  tls.state.dtype[s] = prev_dtype_;
  tls.state.cache_enabled = prev_cache_enabled_;
  exit_region();
}

bool is_autocast_enabled(DeviceType device) {
  return tls.state.enabled[device_slot(device)];
}
DType autocast_dtype(DeviceType device) {
  return tls.state.dtype[device_slot(device)];
}
bool is_autocast_cache_enabled() {
  return tls.state.cache_enabled;
}

void clear_autocast_cache() {
  for (int k = 0; k < 2; ++k) {
    for (const TensorImpl* key : tls.order[k]) tls.cache[k].erase(key);
    tls.order[k].clear();
  }
}

size_t autocast_cache_size() {
  return tls.cache[0].size() + tls.cache[1].size();
}

namespace autocast {

State current_state() {
  return tls.state;
}

StateScope::StateScope(const State& state) : ScopeGuard(tls.state) {
  tls.state = state;
  enter_region();
}

StateScope::~StateScope() {
  tls.state = saved_;
  exit_region();
}

ExcludeScope::ExcludeScope() : ScopeGuard(tls.state.excluded) {
  tls.state.excluded = true;
}
ExcludeScope::~ExcludeScope() {
  tls.state.excluded = saved_;
}

bool is_active(Device device) {
  return !tls.state.excluded && tls.state.enabled[device_slot(device.type)];
}

Tensor cast(const char* /*op*/, const Tensor& t, CastPolicy policy, Device device) {
  if (!t.defined() || !is_floating(t.dtype()) || t.dtype() == DType::float64) return t;
  const DType target =
      policy == CastPolicy::fp32 ? DType::float32 : tls.state.dtype[device_slot(device.type)];
  if (t.dtype() == target) return t;
  if (policy == CastPolicy::lower_precision_fp && cacheable(t, target))
    return cached_cast(t, target);
  return t.to(target);
}

void cache_casts(const TensorList& params, const std::vector<std::string>& module_names) {
  if (!module_names.empty() && module_names.size() != params.size())
    throw std::invalid_argument(fmt::format(
        "autocast::cache_casts: {} module names for {} tensors (give one each, or none)",
        module_names.size(), params.size()));
  // What each lower-precision op's cached_cast would make and does not have yet, grouped by
  // (device, target dtype): one multi-tensor copy per group.
  struct Group {
    Device device;
    DType target;
    TensorList src, dst;
  };
  std::vector<Group> groups;
  std::unordered_set<const TensorImpl*> seen;  // a tied weight listed twice is cast once
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    if (!p.defined() || !is_active(p.device())) continue;
    const DType target = tls.state.dtype[device_slot(p.device().type)];
    if (!cacheable(p, target) || !seen.insert(p.unsafe_impl()).second) continue;
    const auto& cache = tls.cache[dtype_slot(target)];
    const auto it = cache.find(p.unsafe_impl());
    if (it != cache.end() && it->second.version == p.storage().version() &&
        (!GradMode::is_enabled() || it->second.cast.requires_grad()))
      continue;  // cached_cast would reuse it
    auto g = std::find_if(groups.begin(), groups.end(), [&](const Group& x) {
      return x.device == p.device() && x.target == target;
    });
    if (g == groups.end()) g = groups.insert(groups.end(), Group{p.device(), target, {}, {}});
    // Allocated as the lazy cast would be: category autocast_cache, op "to", in the module
    // whose op would have cast it.
    memory::ModuleScope module(module_names.empty() ? std::string_view() : module_names[i]);
    memory::CategoryScope category(memory::Category::autocast_cache);
    memory::OpScope op("to");
    g->src.push_back(p);
    Tensor dst = ops::empty(p.sizes(), target, p.device());
    if (p.suggest_memory_format() == MemoryFormat::channels_last)  // the cast keeps the layout
      dst = Tensor::make(dst.storage(), dst.sizes(), p.strides(), 0, dst.dtype());
    g->dst.push_back(dst);
  }
  for (Group& g : groups) {
    // A channels_last pair as its flat run of memory (the two share a layout), so that
    // foreach_copy_ takes it in its one launch like the row-major ones.
    TensorList dst_runs, src_runs;
    for (size_t i = 0; i < g.src.size(); ++i) {
      const bool cl = all_channels_last({&g.dst[i], &g.src[i]}, g.src[i].sizes());
      dst_runs.push_back(cl ? flat_view(g.dst[i]) : g.dst[i]);
      src_runs.push_back(cl ? flat_view(g.src[i]) : g.src[i]);
    }
    ops::foreach_copy_(dst_runs, src_runs);
    auto& cache = tls.cache[dtype_slot(g.target)];
    for (size_t i = 0; i < g.src.size(); ++i) {
      const Tensor& p = g.src[i];
      record_weight_cast(p, g.dst[i]);
      if (cache.find(p.unsafe_impl()) == cache.end())
        tls.order[dtype_slot(g.target)].push_back(p.unsafe_impl());
      cache[p.unsafe_impl()] = CacheEntry{p, p.storage().version(), g.dst[i]};
    }
  }
}

}  // namespace autocast
}  // namespace tally
