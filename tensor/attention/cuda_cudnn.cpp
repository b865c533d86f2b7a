// The cuDNN route of the bfloat16/float16 fused attention (tensor/attention/cuda_cudnn_sdpa.h): one
// forward and one backward execution plan per problem (device, handle, dtype, shapes,
// strides, causal, scale), built on first use and cached for the process; problems cuDNN
// cannot run are remembered too and go to Tally's own kernels (tensor/attention/cuda.cu).
// Workspaces come from the caching allocator on Tally's stream under Category::workspace
// (alloc_scratch_bytes). With tunable ops on (set_tunable_enabled, PyTorch's TunableOp) the
// first call of a problem outside a graph capture times cuDNN's usable engine configurations
// on the call's own tensors and keeps the fastest (pick_fastest below).
#include "tensor/attention/cuda_cudnn.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "tensor/attention/cuda.h"
#include "tensor/attention/cuda_cudnn_sdpa.h"
#include "tensor/cuda/cudnn.h"
#include "tensor/cuda/graph.h"
#include "tensor/cuda/matmul_settings.h"  // tunable_enabled
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
std::atomic<int64_t> g_forward{0}, g_backward{0}, g_fallback{0}, g_tuned{0};

// Tuning: up to kTuneConfigs configurations (the heuristics' first included), each run once
// to warm up and then kTuneRuns times between two events (one host wait a candidate); the
// fastest is kept when it beats the heuristics' first by kTuneMargin (GEMM tuning's rule,
// tensor/cuda/blas.cpp: back-to-back runs on L2-warm operands flatter some kernels).
constexpr int kTuneConfigs = 8, kTuneRuns = 3;
constexpr float kTuneMargin = 0.97f;

cudnn_sdpa::Strides strides_of(const Tensor& t) {
  return {t.strides()[0], t.strides()[1], t.strides()[2], t.strides()[3]};
}

// Everything a plan depends on, as one ordered key; the last field: the plan was tuned.
using Key = std::tuple<int, cudnnHandle_t, bool, int, std::array<int64_t, 8>, bool, uint32_t,
                       std::array<cudnn_sdpa::Strides, 9>, bool>;

Key key_of(bool backward, int device, cudnnHandle_t h, const cudnn_sdpa::Problem& p) {
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &p.scale, sizeof(scale_bits));
  return {device,
          h,
          backward,
          static_cast<int>(p.dtype),
          {p.b, p.h, p.h_kv, p.s_q, p.s_kv, p.d, p.bias_b, p.bias_h},
          p.causal,
          scale_bits,
          {p.q, p.k, p.v, p.o, p.dout, p.dq, p.dk, p.dv, p.bias},
          false};
}

template <typename Plan>
struct Entry {
  std::unique_ptr<Plan> plan;  // null: cuDNN cannot run this problem
  std::string why;
};

// The plan's workspace size in bytes for alloc_scratch_bytes (none, an empty Storage, for
// a size <= 0).
template <typename Plan>
size_t plan_workspace_bytes(const Plan& plan) {
  return static_cast<size_t>(std::max<int64_t>(plan.workspace_size(), 0));
}

// Replaces e.plan by the fastest of cuDNN's first kTuneConfigs usable configurations for p,
// timed through run(plan, workspace) (one call of the plan on the caller's tensors; every
// run writes the outputs, the caller's own run writes them last).
template <typename Plan>
void pick_fastest(Entry<Plan>& e, cudnnHandle_t h, const cudnn_sdpa::Problem& p, int device,
                  const std::function<void(const Plan&, void*)>& run) {
  std::vector<std::unique_ptr<Plan>> cands;
  cands.push_back(std::move(e.plan));
  for (int c = 1; c < kTuneConfigs; ++c) {
    try {
      cands.push_back(std::make_unique<Plan>(h, p, c));
    } catch (const cudnn_graph::CudnnGraphError&) {
      break;  // no more configurations
    }
  }
  g_tuned.fetch_add(1);
  size_t best = 0;
  if (cands.size() > 1) {
    struct Event {
      cudaEvent_t e = nullptr;
      Event() { check(cudaEventCreate(&e), "cudaEventCreate (cuDNN attention tuning)"); }
      ~Event() { cudaEventDestroy(e); }
    } start, stop;
    const cudaStream_t st = stream(device);
    float best_ms = 0, first_ms = 0;
    for (size_t i = 0; i < cands.size(); ++i) {
      const Storage ws = alloc_scratch_bytes(plan_workspace_bytes(*cands[i]), Device::cuda(device));
      run(*cands[i], ws.data());
      check(cudaEventRecord(start.e, st), "cudaEventRecord (cuDNN attention tuning)");
      for (int r = 0; r < kTuneRuns; ++r) run(*cands[i], ws.data());
      check(cudaEventRecord(stop.e, st), "cudaEventRecord (cuDNN attention tuning)");
      check(cudaEventSynchronize(stop.e), "cudaEventSynchronize (cuDNN attention tuning)");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start.e, stop.e), "cudaEventElapsedTime");
      if (i == 0) first_ms = best_ms = ms;
      if (ms < best_ms) {
        best = i;
        best_ms = ms;
      }
    }
    if (best_ms > kTuneMargin * first_ms) best = 0;
  }
  e.plan = std::move(cands[best]);
}

template <typename Plan>
struct Cache {
  std::mutex mu;
  std::map<Key, std::shared_ptr<Entry<Plan>>> entries;

  // The cached plan of p, building it on first use; null when cuDNN cannot run the problem.
  // With tunable ops on, a problem met outside a graph capture is tuned (pick_fastest, through
  // run) and cached as such; inside a capture the tuned plan is used when there is one, else
  // the heuristics' first (no host wait may happen there).
  // An empty run: never tuned (a support query, no tensors to time on).
  std::shared_ptr<Entry<Plan>> get(Key key, int device, cudnnHandle_t h,
                                   const cudnn_sdpa::Problem& p,
                                   const std::function<void(const Plan&, void*)>& run) {
    std::lock_guard<std::mutex> lock(mu);
    bool tune = run && tunable_enabled();
    if (tune) {
      std::get<8>(key) = true;
      auto it = entries.find(key);
      if (it != entries.end()) return it->second;
      if (is_capturing(device)) {
        tune = false;
        std::get<8>(key) = false;
      }
    }
    auto it = entries.find(key);
    if (it != entries.end()) return it->second;
    auto e = std::make_shared<Entry<Plan>>();
    try {
      e->plan = std::make_unique<Plan>(h, p);
    } catch (const cudnn_graph::CudnnGraphError& err) {
      e->why = err.what();
    }
    if (tune && e->plan) pick_fastest(*e, h, p, device, run);
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

// Problems this route takes at all (cuDNN may still decline one when building its plan):
// k and v with q's heads, or the same fewer heads dividing them (grouped-query attention).
bool eligible(const Tensor& q, const Tensor& k, const Tensor& v) {
  return enabled() && cudnn_sdp_shapes(q, k, v) && compute_capability(q.device().index) >= 80;
}

// The problem of q, k, v with the output's strides `o`.
cudnn_sdpa::Problem problem(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                            double scale, const cudnn_sdpa::Strides& o) {
  cudnn_sdpa::Problem p;
  p.dtype = cudnn_data_type(q.dtype());
  p.b = q.size(0);
  p.h = q.size(1);
  p.h_kv = k.size(1);
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

// The mask's own part (mask_own_sizes) as p's bias (cuda_cudnn_sdpa.h): contiguous over those
// sizes, stride 0 along broadcast rows or columns; its element count. Nothing for an undefined
// mask (0).
int64_t set_bias(cudnn_sdpa::Problem& p, const Tensor& mask) {
  if (!mask.defined()) return 0;
  const std::array<int64_t, 4> own = mask_own_sizes(mask);
  p.bias_b = own[0];
  p.bias_h = own[1];
  p.bias = {own[1] * own[2] * own[3], own[2] * own[3], own[2] == 1 ? 0 : own[3],
            own[3] == 1 ? 0 : 1};
  return own[0] * own[1] * own[2] * own[3];
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

// Runs p's cached plan from `cache` (built, and tuned through run, on first use) with a
// workspace of its size, counted in `runs`; false (a fallback) where cuDNN has no plan for p.
template <typename Plan, typename Run>
bool run_cached(Cache<Plan>& cache, bool backward, int device, cudnnHandle_t h,
                const cudnn_sdpa::Problem& p, const Run& run, const char* range_name,
                std::atomic<int64_t>& runs) {
  const auto e = cache.get(key_of(backward, device, h, p), device, h, p, run);
  if (!e->plan) return fall_back();
  NvtxRange range(range_name);
  const Storage ws = alloc_scratch_bytes(plan_workspace_bytes(*e->plan), Device::cuda(device));
  run(*e->plan, ws.data());
  runs.fetch_add(1);
  return true;
}

// A masked call's bias in q's dtype (cudnn_mask_to_bias), made only once `cache` has a plan
// for p (set_bias has given p its shape): true with `bias` set; false where cuDNN has no plan.
// Without a mask: true, `bias` undefined.
template <typename Plan>
bool prepare_bias(Cache<Plan>& cache, bool backward, int device, cudnnHandle_t h,
                  cudnn_sdpa::Problem& p, const Tensor& q, const Tensor& mask, Tensor& bias) {
  const int64_t numel = set_bias(p, mask);
  if (!mask.defined()) return true;
  if (!cache.get(key_of(backward, device, h, p), device, h, p, {})->plan) return false;
  bias = alloc_scratch(numel, q.dtype(), q.device());
  cudnn_mask_to_bias(bias, mask);
  return true;
}

}  // namespace

void set_cudnn_sdp_enabled(bool on) {
  g_enabled.store(on ? 1 : 0);
}
bool cudnn_sdp_enabled() {
  return enabled();
}

CudnnSdpCounts cudnn_sdp_counts() {
  return {g_forward.load(), g_backward.load(), g_fallback.load(), g_tuned.load()};
}

bool cudnn_sdp_supported(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                         double scale, std::string* why, const Tensor& mask) {
  if (!eligible(q, k, v)) {
    if (why)
      *why =
          "not a float16/bfloat16 [B, H, T, D] problem with D % 8 == 0 and D <= 128 on "
          "sm_80+ (k and v with heads dividing q's), or the cuDNN route is off";
    return false;
  }
  const int device = q.device().index;
  DeviceGuard g(device);
  cudnnHandle_t h = cudnn_handle(device);
  cudnn_sdpa::Problem p =
      problem(q, k, v, causal, scale,
              {q.size(1) * q.size(2) * v.size(3), q.size(2) * v.size(3), v.size(3), 1});
  set_bias(p, mask);
  const auto e = forward_cache().get(key_of(false, device, h, p), device, h, p, {});
  if (why) *why = e->why;
  return e->plan != nullptr;
}

bool cudnn_flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q,
                                   const Tensor& k, const Tensor& v, bool causal, double scale,
                                   const Tensor& mask) {
  if (!may_take(q, k, v, {&out, &lse, &q, &k, &v})) return false;
  const int device = q.device().index;
  DeviceGuard g(device);
  cudnnHandle_t h = cudnn_handle(device);
  cudnn_sdpa::Problem p = problem(q, k, v, causal, scale, strides_of(out));
  Tensor bias;
  if (!prepare_bias(forward_cache(), false, device, h, p, q, mask, bias)) return fall_back();
  const void* b = bias.defined() ? ptr(bias) : nullptr;
  const auto run = [&](const cudnn_sdpa::Forward& plan, void* ws) {
    plan.run(h, ptr(q), ptr(k), ptr(v), b, ptr(out), ptr<float>(lse), ws);
  };
  if (!run_cached(forward_cache(), false, device, h, p, run, "flash_attention_forward (cuDNN)",
                  g_forward))
    return false;
  if (mask.defined()) cudnn_clear_dead_rows(out, lse);
  return true;
}

bool cudnn_flash_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                    const Tensor& dout, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& out, const Tensor& lse,
                                    bool causal, double scale, const Tensor& mask) {
  if (!may_take(q, k, v, {&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse})) return false;
  const int device = q.device().index;
  DeviceGuard g(device);
  cudnnHandle_t h = cudnn_handle(device);
  cudnn_sdpa::Problem p = problem(q, k, v, causal, scale, strides_of(out));
  p.dout = strides_of(dout);
  p.dq = strides_of(dq);
  p.dk = strides_of(dk);
  p.dv = strides_of(dv);
  // With a mask: its bias, and the statistics with a row without keys at +inf.
  Tensor bias, stats;
  if (!prepare_bias(backward_cache(), true, device, h, p, q, mask, bias)) return fall_back();
  if (mask.defined()) {
    stats = alloc_scratch(lse.numel(), DType::float32, q.device());
    cudnn_backward_stats(ptr<float>(stats), lse);
  }
  const void* b = bias.defined() ? ptr(bias) : nullptr;
  const float* st = stats.defined() ? ptr<float>(stats) : ptr<float>(lse);
  const auto run = [&](const cudnn_sdpa::Backward& plan, void* ws) {
    plan.run(h, ptr(q), ptr(k), ptr(v), b, ptr(out), ptr(dout), st, ptr(dq), ptr(dk), ptr(dv), ws);
  };
  return run_cached(backward_cache(), true, device, h, p, run, "flash_attention_backward (cuDNN)",
                    g_backward);
}

}  // namespace tally::cuda
