// The cuDNN route of the bfloat16/float16 fused attention (tensor/attention/cuda_cudnn_sdpa.h): one
// forward and one backward execution plan per problem (device, handle, dtype, shapes,
// strides, causal, scale), built on first use and cached for the process; problems cuDNN
// cannot run are remembered too and go to Tally's own kernels (tensor/attention/cuda.cu).
// Workspaces come from the caching allocator on Tally's stream under Category::workspace
// (alloc_scratch_bytes).
#include "tensor/attention/cuda_cudnn.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "tensor/attention/cuda.h"
#include "tensor/attention/cuda_cudnn_sdpa.h"
#include "tensor/cuda/cudnn.h"
#include "tensor/cuda/runtime.h"
#include "tensor/op_alloc.h"
#include "tensor/storage.h"

namespace tally::cuda {

namespace {

// -1 until first read: then TALLY_CUDNN_SDP (0 starts the process with the route off; a
// malformed value throws from the first attention call, not at load time) or the setter.
std::atomic<int> g_enabled{-1};

bool enabled() {
  int v = g_enabled.load();
  if (v < 0) {
    const int from_env = env_switch("TALLY_CUDNN_SDP", true) ? 1 : 0;
    g_enabled.compare_exchange_strong(v, from_env);
    v = g_enabled.load();
  }
  return v == 1;
}
std::atomic<int64_t> g_forward{0}, g_backward{0}, g_fallback{0};

cudnn_sdpa::Strides strides_of(const Tensor& t) {
  return {t.strides()[0], t.strides()[1], t.strides()[2], t.strides()[3]};
}

// Everything a plan depends on, as one ordered key.
using Key = std::tuple<int, cudnnHandle_t, bool, int, std::array<int64_t, 5>, bool, uint32_t,
                       std::array<cudnn_sdpa::Strides, 8>>;

Key key_of(bool backward, int device, cudnnHandle_t h, const cudnn_sdpa::Problem& p) {
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &p.scale, sizeof(scale_bits));
  return {device,
          h,
          backward,
          static_cast<int>(p.dtype),
          {p.b, p.h, p.s_q, p.s_kv, p.d},
          p.causal,
          scale_bits,
          {p.q, p.k, p.v, p.o, p.dout, p.dq, p.dk, p.dv}};
}

template <typename Plan>
struct Entry {
  std::unique_ptr<Plan> plan;  // null: cuDNN cannot run this problem
  std::string why;
};

template <typename Plan>
struct Cache {
  std::mutex mu;
  std::map<Key, std::shared_ptr<Entry<Plan>>> entries;

  // The cached plan, building it on first use; null when cuDNN cannot run the problem.
  std::shared_ptr<Entry<Plan>> get(const Key& key, cudnnHandle_t h, const cudnn_sdpa::Problem& p) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = entries.find(key);
    if (it != entries.end()) return it->second;
    auto e = std::make_shared<Entry<Plan>>();
    try {
      e->plan = std::make_unique<Plan>(h, p);
    } catch (const cudnn_graph::CudnnGraphError& err) {
      e->why = err.what();
    }
    entries.emplace(key, e);
    return e;
  }
};

Cache<cudnn_sdpa::Forward>& forward_cache() {
  static Cache<cudnn_sdpa::Forward> c;
  return c;
}
Cache<cudnn_sdpa::Backward>& backward_cache() {
  static Cache<cudnn_sdpa::Backward> c;
  return c;
}

// Problems this route takes at all (cuDNN may still decline one when building its plan).
bool eligible(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (!enabled() || q.dim() != 4) return false;
  if (q.dtype() != DType::bfloat16 && q.dtype() != DType::float16) return false;
  const int64_t d = q.size(3);
  return v.size(3) == d && k.size(3) == d && d % 8 == 0 && d <= 128 &&
         compute_capability(q.device().index) >= 80;
}

// The problem of q, k, v with the output's strides `o`.
cudnn_sdpa::Problem problem(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                            double scale, const cudnn_sdpa::Strides& o) {
  cudnn_sdpa::Problem p;
  p.dtype = cudnn_data_type(q.dtype());
  p.b = q.size(0);
  p.h = q.size(1);
  p.s_q = q.size(2);
  p.s_kv = k.size(2);
  p.d = q.size(3);
  p.causal = causal;
  p.scale = static_cast<float>(scale);
  p.q = strides_of(q);
  p.k = strides_of(k);
  p.v = strides_of(v);
  p.o = o;
  return p;
}

// The plan's workspace size in bytes for alloc_scratch_bytes (none, an empty Storage, for
// a size <= 0).
template <typename Plan>
size_t plan_workspace_bytes(const Plan& plan) {
  return static_cast<size_t>(std::max<int64_t>(plan.workspace_size(), 0));
}

template <typename T = void>
T* ptr(const Tensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.storage().data()) +
                              t.storage_offset() * static_cast<int64_t>(dtype_size(t.dtype())));
}

// The plans promise cuDNN 16-byte aligned tensors.
bool aligned(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (reinterpret_cast<uintptr_t>(ptr(*t)) % 16 != 0) return false;
  return true;
}

// A call cuDNN does not serve although the route was asked: counted; Tally's kernels run.
bool fall_back() {
  g_fallback.fetch_add(1);
  return false;
}

// Whether a call may try the route: an eligible problem (else false, not counted) whose
// tensors `ts` are all aligned (else a fallback).
bool may_take(const Tensor& q, const Tensor& k, const Tensor& v,
              std::initializer_list<const Tensor*> ts) {
  if (!eligible(q, k, v)) return false;
  return aligned(ts) || fall_back();
}

}  // namespace

void set_cudnn_sdp_enabled(bool on) {
  g_enabled.store(on ? 1 : 0);
}
bool cudnn_sdp_enabled() {
  return enabled();
}

CudnnSdpCounts cudnn_sdp_counts() {
  return {g_forward.load(), g_backward.load(), g_fallback.load()};
}

bool cudnn_sdp_supported(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                         double scale, std::string* why) {
  if (!eligible(q, k, v)) {
    if (why)
      *why =
          "not a float16/bfloat16 [B, H, T, D] problem with D % 8 == 0 and D <= 128 on "
          "sm_80+, or the cuDNN route is off";
    return false;
  }
  const int device = q.device().index;
  DeviceGuard g(device);
  cudnnHandle_t h = cudnn_handle(device);
  const cudnn_sdpa::Problem p =
      problem(q, k, v, causal, scale,
              {q.size(1) * q.size(2) * v.size(3), q.size(2) * v.size(3), v.size(3), 1});
  const auto e = forward_cache().get(key_of(false, device, h, p), h, p);
  if (why) *why = e->why;
  return e->plan != nullptr;
}

bool cudnn_flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                                   const Tensor& k, const Tensor& v, bool causal, double scale) {
  if (!may_take(q, k, v, {&out, &lse, &q, &k, &v})) return false;
  const int device = q.device().index;
  DeviceGuard g(device);
  cudnnHandle_t h = cudnn_handle(device);
  const cudnn_sdpa::Problem p = problem(q, k, v, causal, scale, strides_of(out));
  const auto e = forward_cache().get(key_of(false, device, h, p), h, p);
  if (!e->plan) return fall_back();
  NvtxRange range("flash_attention_forward (cuDNN)");
  const Storage ws = alloc_scratch_bytes(plan_workspace_bytes(*e->plan), Device::cuda(device));
  e->plan->run(h, ptr(q), ptr(k), ptr(v), ptr(out), ptr<float>(lse), ws.data());
  g_forward.fetch_add(1);
  return true;
}

bool cudnn_flash_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                    const Tensor& dout, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& out, const Tensor& lse,
                                    bool causal, double scale) {
  if (!may_take(q, k, v, {&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse})) return false;
  const int device = q.device().index;
  DeviceGuard g(device);
  cudnnHandle_t h = cudnn_handle(device);
  cudnn_sdpa::Problem p = problem(q, k, v, causal, scale, strides_of(out));
  p.dout = strides_of(dout);
  p.dq = strides_of(dq);
  p.dk = strides_of(dk);
  p.dv = strides_of(dv);
  const auto e = backward_cache().get(key_of(true, device, h, p), h, p);
  if (!e->plan) return fall_back();
  NvtxRange range("flash_attention_backward (cuDNN)");
  const Storage ws = alloc_scratch_bytes(plan_workspace_bytes(*e->plan), Device::cuda(device));
  e->plan->run(h, ptr(q), ptr(k), ptr(v), ptr(out), ptr(dout), ptr<float>(lse), ptr(dq), ptr(dk),
               ptr(dv), ws.data());
  g_backward.fetch_add(1);
  return true;
}

}  // namespace tally::cuda
