// CUDA 2-D convolution through cuDNN over NCHW tensors, or channels_last ones (NHWC in memory:
// input, filter and output all so; what cuDNN's tensor-core kernels read without transposing),
// groups too; the bias is added by a small kernel (cuda.cu), or by a broadcast add in NHWC.
// Algorithm choice (cached cuDNN plans, the legacy API), memory and precision: docs/notes.md §7.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "memory/caching_allocator.h"
#include "tensor/conv/cuda.h"
#include "tensor/conv/kernels.h"
#include "tensor/cuda/cudnn.h"
#include "tensor/cuda/cudnn_graph.h"
#include "tensor/cuda/runtime.h"
#include "tensor/elementwise/ops.h"
#include "tensor/op_alloc.h"

namespace tally::cuda {

// y [N, O, OH, OW] (contiguous) += bias [O] broadcast over batch and plane (same dtype;
// the sum is formed in float and rounded once). conv2d_forward's bias step; defined in
// tensor/conv/cuda.cu (the family's one hand-written kernel).
void conv2d_add_bias(const Tensor& y, const Tensor& bias);

namespace {

enum class Kind : int { forward = 0, backward_data = 1, backward_filter = 2 };

// Per Kind, indexed by its value: its name in messages and cuDNN's number of algorithms.
struct KindInfo {
  const char* name;
  int algo_count;
};
constexpr KindInfo kKinds[] = {
    {"forward", CUDNN_CONVOLUTION_FWD_ALGO_COUNT},
    {"backward data", CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT},
    {"backward filter", CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT},
};
const KindInfo& info(Kind k) {
  return kKinds[static_cast<int>(k)];
}

std::atomic<int64_t> g_max_call_elements{INT_MAX};

// ------------------------------------------------------------------ one cuDNN call

// The geometry of one cuDNN call: x [N, C, H, W], w [O, C/g, kH, kW], y [N, O, OH, OW],
// all three NCHW-contiguous, or all three channels_last (`nhwc`: NHWC in memory, the filter
// as [O, kH, kW, C/g]).
struct Problem {
  Kind kind = Kind::forward;
  int device = 0;
  DType dtype = DType::float32;
  int x[4] = {}, xs[4] = {}, w[4] = {}, y[4] = {}, ys[4] = {};
  int pad[2] = {}, stride[2] = {}, dilation[2] = {};
  int groups = 1;
  bool tf32 = false;  // float32 may use TF32 (cudnn_allow_tf32() when the call was made)
  bool nhwc = false;  // channels_last tensors (x's and y's strides say so too)

  std::string str() const {
    return fmt::format(
        "conv2d {} {}: input [{}, {}, {}, {}] strides [{}, {}, {}, {}], weight [{}, {}, {}, {}], "
        "output "
        "[{}, {}, {}, {}] strides [{}, {}, {}, {}], padding [{}, {}], stride [{}, {}], dilation "
        "[{}, {}], "
        "groups {}{}{}",
        info(kind).name, dtype_name(dtype), x[0], x[1], x[2], x[3], xs[0], xs[1], xs[2], xs[3],
        w[0], w[1], w[2], w[3], y[0], y[1], y[2], y[3], ys[0], ys[1], ys[2], ys[3], pad[0], pad[1],
        stride[0], stride[1], dilation[0], dilation[1], groups, tf32 ? ", tf32 allowed" : "",
        nhwc ? ", channels_last" : "");
  }

  std::vector<int64_t> key(bool benchmark) const {
    std::vector<int64_t> k{static_cast<int64_t>(kind),  device,
                           static_cast<int64_t>(dtype), groups,
                           benchmark ? 1 : 0,           tf32 ? 1 : 0};
    for (const int* a : {x, xs, w, y, ys}) k.insert(k.end(), a, a + 4);
    for (const int* a : {pad, stride, dilation}) k.insert(k.end(), a, a + 2);
    k.push_back(nhwc ? 1 : 0);
    return k;
  }
};

// The math type a call asks for (see the file comment).
cudnnMathType_t default_math(DType dt, bool tf32) {
  if (dt == DType::float32) return tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
  if (dt == DType::float64) return CUDNN_DEFAULT_MATH;
  return CUDNN_TENSOR_OP_MATH;
}

cudnnDataType_t compute_type(DType dt) {
  return dt == DType::float64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
}

struct Descriptors {
  TensorDescriptor x, y;
  FilterDescriptor w;
  ConvolutionDescriptor conv;

  explicit Descriptors(const Problem& pb) {
    const cudnnDataType_t dt = cudnn_data_type(pb.dtype);
    x.set(dt, pb.x, pb.xs);
    y.set(dt, pb.y, pb.ys);
    w.set(dt, pb.w, pb.nhwc);
    conv.set(pb.pad, pb.stride, pb.dilation, pb.groups, compute_type(pb.dtype),
             default_math(pb.dtype, pb.tf32));
  }
};

// Device pointers of a call: x is the forward input (dx for backward data), w the weight
// (dw for backward filter), y the output (dy for the backward directions).
struct Pointers {
  void* x;
  void* w;
  void* y;
};

cudnnStatus_t workspace_size(Kind k, cudnnHandle_t h, const Descriptors& d, int algo,
                             size_t* bytes) {
  switch (k) {
    case Kind::forward:
      return cudnnGetConvolutionForwardWorkspaceSize(
          h, d.x.get(), d.w.get(), d.conv.get(), d.y.get(),
          static_cast<cudnnConvolutionFwdAlgo_t>(algo), bytes);
    case Kind::backward_data:
      return cudnnGetConvolutionBackwardDataWorkspaceSize(
          h, d.w.get(), d.y.get(), d.conv.get(), d.x.get(),
          static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), bytes);
    case Kind::backward_filter:
      return cudnnGetConvolutionBackwardFilterWorkspaceSize(
          h, d.x.get(), d.y.get(), d.conv.get(), d.w.get(),
          static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), bytes);
  }
  return CUDNN_STATUS_BAD_PARAM;
}

cudnnStatus_t execute(Kind k, cudnnHandle_t h, const Descriptors& d, int algo, void* ws,
                      size_t ws_bytes, const void* alpha, const void* beta, const Pointers& p) {
  switch (k) {
    case Kind::forward:
      return cudnnConvolutionForward(h, alpha, d.x.get(), p.x, d.w.get(), p.w, d.conv.get(),
                                     static_cast<cudnnConvolutionFwdAlgo_t>(algo), ws, ws_bytes,
                                     beta, d.y.get(), p.y);
    case Kind::backward_data:
      return cudnnConvolutionBackwardData(h, alpha, d.w.get(), p.w, d.y.get(), p.y, d.conv.get(),
                                          static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), ws,
                                          ws_bytes, beta, d.x.get(), p.x);
    case Kind::backward_filter:
      return cudnnConvolutionBackwardFilter(h, alpha, d.x.get(), p.x, d.y.get(), p.y, d.conv.get(),
                                            static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), ws,
                                            ws_bytes, beta, d.w.get(), p.w);
  }
  return CUDNN_STATUS_BAD_PARAM;
}

// A ranked algorithm as cuDNN reports it (any of the three perf structs).
struct Ranked {
  int algo;
  cudnnStatus_t status;
  cudnnMathType_t math;
};

template <typename Perf>
std::vector<Ranked> to_ranked(const Perf* perf, int n) {
  std::vector<Ranked> out;
  for (int i = 0; i < n; ++i)
    out.push_back({static_cast<int>(perf[i].algo), perf[i].status, perf[i].mathType});
  return out;
}

// The ranking of one cuDNN call `what` (a Get*Algorithm_v7 or Find*AlgorithmEx):
// call(Count, &n, perf) fills up to Count entries of Perf.
template <typename Perf, int Count, typename Call>
std::vector<Ranked> ranked(const char* what, const std::string& ctx, Call&& call) {
  Perf perf[Count];
  int n = 0;
  check_cudnn(call(Count, &n, perf), what, ctx);
  return to_ranked(perf, n);
}

// cuDNN's heuristic ranking (no device work).
std::vector<Ranked> rank_by_heuristics(const Problem& pb, cudnnHandle_t h, const Descriptors& d) {
  const std::string ctx = pb.str();
  switch (pb.kind) {
    case Kind::forward:
      return ranked<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT>(
          "cudnnGetConvolutionForwardAlgorithm_v7", ctx, [&](int count, int* n, auto* perf) {
            return cudnnGetConvolutionForwardAlgorithm_v7(h, d.x.get(), d.w.get(), d.conv.get(),
                                                          d.y.get(), count, n, perf);
          });
    case Kind::backward_data:
      return ranked<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT>(
          "cudnnGetConvolutionBackwardDataAlgorithm_v7", ctx, [&](int count, int* n, auto* perf) {
            return cudnnGetConvolutionBackwardDataAlgorithm_v7(
                h, d.w.get(), d.y.get(), d.conv.get(), d.x.get(), count, n, perf);
          });
    case Kind::backward_filter:
      return ranked<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT>(
          "cudnnGetConvolutionBackwardFilterAlgorithm_v7", ctx, [&](int count, int* n, auto* perf) {
            return cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                h, d.x.get(), d.y.get(), d.conv.get(), d.w.get(), count, n, perf);
          });
  }
  return {};
}

// Timing every algorithm on the real tensors (benchmark mode). The algorithms write into a
// scratch output, so the caller's output (which backward filter may be accumulating into)
// is untouched. Host-blocking, once per key.
std::vector<Ranked> rank_by_timing(const Problem& pb, cudnnHandle_t h, const Descriptors& d,
                                   const Pointers& p) {
  const std::string ctx = pb.str();
  // The workspace: the largest any algorithm asks for, capped by what the device can give.
  size_t want = 0;
  for (int a = 0; a < info(pb.kind).algo_count; ++a) {
    size_t s = 0;
    if (workspace_size(pb.kind, h, d, a, &s) == CUDNN_STATUS_SUCCESS) want = std::max(want, s);
  }
  size_t free_bytes = 0, total_bytes = 0;
  check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  memory::CachingAllocator& alloc = memory::get_allocator(Device::cuda(pb.device));
  const size_t cached = alloc.memory_reserved() - alloc.memory_allocated();
  want = std::min(want, (free_bytes / 10) * 9 + cached);
  Storage ws;
  for (;;) {
    try {
      ws = alloc_scratch_bytes(want, Device::cuda(pb.device));
      break;
    } catch (const memory::OutOfMemoryError&) {
      if (want == 0) throw;
      want /= 2;
    }
  }
  // The scratch output the algorithms write.
  const Kind k = pb.kind;
  const int* out_dims = k == Kind::forward ? pb.y : k == Kind::backward_data ? pb.x : pb.w;
  size_t out_elems = 1;
  for (int i = 0; i < 4; ++i) out_elems *= static_cast<size_t>(out_dims[i]);
  const Storage scratch =
      alloc_scratch_bytes(out_elems * dtype_size(pb.dtype), Device::cuda(pb.device));
  Pointers q = p;
  (k == Kind::forward ? q.y : k == Kind::backward_data ? q.x : q.w) = scratch.data();
  // cudnnFind* times on the handle's stream (Tally's stream), after the inputs' producers.
  synchronize(pb.device);
  std::vector<Ranked> out;
  void* const w = ws.data();
  switch (k) {
    case Kind::forward:
      out = ranked<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT>(
          "cudnnFindConvolutionForwardAlgorithmEx", ctx, [&](int count, int* n, auto* perf) {
            return cudnnFindConvolutionForwardAlgorithmEx(h, d.x.get(), q.x, d.w.get(), q.w,
                                                          d.conv.get(), d.y.get(), q.y, count, n,
                                                          perf, w, want);
          });
      break;
    case Kind::backward_data:
      out = ranked<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT>(
          "cudnnFindConvolutionBackwardDataAlgorithmEx", ctx, [&](int count, int* n, auto* perf) {
            return cudnnFindConvolutionBackwardDataAlgorithmEx(h, d.w.get(), q.w, d.y.get(), q.y,
                                                               d.conv.get(), d.x.get(), q.x, count,
                                                               n, perf, w, want);
          });
      break;
    case Kind::backward_filter:
      out = ranked<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT>(
          "cudnnFindConvolutionBackwardFilterAlgorithmEx", ctx, [&](int count, int* n, auto* perf) {
            return cudnnFindConvolutionBackwardFilterAlgorithmEx(h, d.x.get(), q.x, d.y.get(), q.y,
                                                                 d.conv.get(), d.w.get(), q.w,
                                                                 count, n, perf, w, want);
          });
      break;
  }
  // The scratch blocks go back to the cache only after the timed work has finished.
  synchronize(pb.device);
  return out;
}

// An algorithm ready to run: the math type to set and the workspace it needs.
struct Candidate {
  int algo;
  cudnnMathType_t math;
  size_t workspace;
};

std::mutex g_cache_mu;
std::map<std::vector<int64_t>, std::vector<Candidate>> g_cache;

// The ranked candidates of a problem: successful entries, and for float32 only those
// running with FMA math (no TF32) when cuDNN offers any.
std::vector<Candidate> choose(const Problem& pb, cudnnHandle_t h, Descriptors& d, const Pointers& p,
                              bool benchmark) {
  // Sanity: cuDNN's idea of the output agrees with the op's.
  int on = 0, oc = 0, oh = 0, ow = 0;
  check_cudnn(
      cudnnGetConvolution2dForwardOutputDim(d.conv.get(), d.x.get(), d.w.get(), &on, &oc, &oh, &ow),
      "cudnnGetConvolution2dForwardOutputDim", pb.str());
  if (on != pb.y[0] || oc != pb.y[1] || oh != pb.y[2] || ow != pb.y[3])
    throw std::logic_error(fmt::format(
        "conv2d (cuDNN): cuDNN computes output [{}, {}, {}, {}] for {}", on, oc, oh, ow, pb.str()));

  const std::vector<Ranked> ranked =
      benchmark ? rank_by_timing(pb, h, d, p) : rank_by_heuristics(pb, h, d);
  const bool fp32 = pb.dtype == DType::float32 && !pb.tf32;  // exact float32: FMA math only
  bool any_fma = false;
  for (const Ranked& r : ranked)
    any_fma |= r.status == CUDNN_STATUS_SUCCESS && r.math == CUDNN_FMA_MATH;
  std::vector<Candidate> out;
  for (const Ranked& r : ranked) {
    if (r.status != CUDNN_STATUS_SUCCESS) continue;
    if (r.algo < 0 || r.algo >= info(pb.kind).algo_count) continue;
    if (fp32 && any_fma && r.math != CUDNN_FMA_MATH) continue;
    bool seen = false;
    for (const Candidate& c : out) seen |= c.algo == r.algo;
    if (seen) continue;
    const cudnnMathType_t math = fp32 ? CUDNN_FMA_MATH : r.math;
    d.conv.set_math(math);
    size_t bytes = 0;
    if (workspace_size(pb.kind, h, d, r.algo, &bytes) != CUDNN_STATUS_SUCCESS) continue;
    out.push_back({r.algo, math, bytes});
  }
  d.conv.set_math(default_math(pb.dtype, pb.tf32));
  if (out.empty())
    throw std::runtime_error(
        fmt::format("conv2d (cuDNN): no algorithm supports {} ({} ranked by {})", pb.str(),
                    ranked.size(), benchmark ? "timing" : "heuristics"));
  return out;
}

bool not_supported(cudnnStatus_t s) {
  return static_cast<int>(s) / 1000 == CUDNN_STATUS_NOT_SUPPORTED / 1000;
}

// ------------------------------------------------------------------ the backend route

// The strides of dims d [N, C, H, W]: row-major, or NHWC in memory when `nhwc`.
void strides4(const int d[4], int s[4], bool nhwc) {
  if (nhwc) {
    s[1] = 1;
    s[3] = d[1];
    s[2] = d[3] * d[1];
    s[0] = d[2] * d[3] * d[1];
    return;
  }
  s[3] = 1;
  s[2] = d[3];
  s[1] = d[2] * d[3];
  s[0] = d[1] * d[2] * d[3];
}

// TALLY_CUDNN_CONV_LEGACY=1: every call on the legacy API (read once; a malformed value
// throws from the first convolution).
bool legacy_only() {
  static const bool v = env_switch("TALLY_CUDNN_CONV_LEGACY", false);
  return v;
}

// One convolution as a cached cuDNN execution plan.
struct BackendPlan {
  cudnn_graph::Graph graph{"conv2d"};
  int64_t x = 0, w = 0, y = 0;
};

std::mutex g_plan_mu;
std::map<std::vector<int64_t>, std::shared_ptr<BackendPlan>> g_plans;  // null: declined

std::shared_ptr<BackendPlan> build_plan(const Problem& pb, cudnnHandle_t h, bool accumulate) {
  auto plan = std::make_shared<BackendPlan>();
  cudnn_graph::Graph& g = plan->graph;
  const cudnnDataType_t dt = cudnn_data_type(pb.dtype);
  auto dims = [](const int* a) { return std::vector<int64_t>(a, a + 4); };
  int ws[4];
  strides4(pb.w, ws, pb.nhwc);
  plan->x = g.tensor(dt, dims(pb.x), dims(pb.xs), false);
  plan->w = g.tensor(dt, dims(pb.w), dims(ws), false);
  plan->y = g.tensor(dt, dims(pb.y), dims(pb.ys), false);
  const cudnn_graph::ConvKind kind = pb.kind == Kind::forward ? cudnn_graph::ConvKind::forward
                                     : pb.kind == Kind::backward_data
                                         ? cudnn_graph::ConvKind::backward_data
                                         : cudnn_graph::ConvKind::backward_filter;
  g.convolution(kind, plan->x, plan->w, plan->y, {pb.pad[0], pb.pad[1]},
                {pb.stride[0], pb.stride[1]}, {pb.dilation[0], pb.dilation[1]},
                compute_type(pb.dtype), 1.0, accumulate ? 1.0 : 0.0);
  const bool exact = pb.dtype == DType::float32 && !pb.tf32;
  g.build(h, {CUDNN_HEUR_MODE_INSTANT, CUDNN_HEUR_MODE_FALLBACK},
          [exact](const std::vector<cudnnBackendNumericalNote_t>& notes) {
            for (const cudnnBackendNumericalNote_t n : notes) {
              if (n == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS) return true;
              if (exact && (n == CUDNN_NUMERICAL_NOTE_TENSOR_CORE ||
                            n == CUDNN_NUMERICAL_NOTE_FFT || n == CUDNN_NUMERICAL_NOTE_WINOGRAD ||
                            n == CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_4x4 ||
                            n == CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_6x6 ||
                            n == CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_13x13))
                return true;
            }
            return false;
          });
  return plan;
}

// Runs the call on its cached plan; false (nothing enqueued) when the backend declines the
// problem, a pointer is not 16-byte aligned or the workspace cannot be allocated.
bool run_backend(const Problem& pb, const Pointers& p, bool accumulate, cudnnHandle_t h) {
  // The plans promise cuDNN 16-byte aligned tensors; a batch slice may start elsewhere.
  for (const void* ptr : {p.x, p.w, p.y})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  std::vector<int64_t> key = pb.key(false);
  key.push_back(accumulate ? 1 : 0);
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(h)));
  std::shared_ptr<BackendPlan> plan;
  {
    std::lock_guard lock(g_plan_mu);
    auto it = g_plans.find(key);
    if (it != g_plans.end()) {
      plan = it->second;
      if (!plan) return false;
    }
  }
  if (!plan) {
    try {
      plan = build_plan(pb, h, accumulate);
    } catch (const cudnn_graph::CudnnGraphError&) {
      plan = nullptr;
    }
    std::lock_guard lock(g_plan_mu);
    g_plans.emplace(key, plan);
    if (!plan) return false;
  }
  Storage ws;
  const int64_t bytes = plan->graph.workspace_size();
  if (bytes > 0) {
    try {
      ws = alloc_scratch_bytes(static_cast<size_t>(bytes), Device::cuda(pb.device));
    } catch (const memory::OutOfMemoryError&) {
      return false;
    }
  }
  plan->graph.execute(h, {{plan->x, p.x}, {plan->w, p.w}, {plan->y, p.y}}, ws.data());
  return true;
}

// Runs one call: y = conv(x, w) (forward), x = dconv/dx (backward data) or w = dconv/dw
// (backward filter; accumulated into w when `accumulate`).
void run_call(const Problem& pb, const Pointers& p, bool accumulate) {
  cudnnHandle_t h = cudnn_handle(pb.device);
  const bool benchmark = cudnn_benchmark();
  if (!benchmark && !legacy_only() && run_backend(pb, p, accumulate, h)) return;
  Descriptors d(pb);
  const std::vector<int64_t> key = pb.key(benchmark);
  std::vector<Candidate> cands;
  {
    std::lock_guard lock(g_cache_mu);
    auto it = g_cache.find(key);
    if (it != g_cache.end()) cands = it->second;
  }
  if (cands.empty()) {
    cands = choose(pb, h, d, p, benchmark);
    std::lock_guard lock(g_cache_mu);
    g_cache.emplace(key, cands);
  }

  const float one_f = 1.0f, zero_f = 0.0f;
  const double one_d = 1.0, zero_d = 0.0;
  const bool dbl = pb.dtype == DType::float64;
  const void* alpha = dbl ? static_cast<const void*>(&one_d) : static_cast<const void*>(&one_f);
  const void* beta = accumulate ? alpha
                     : dbl      ? static_cast<const void*>(&zero_d)
                                : static_cast<const void*>(&zero_f);

  std::string failures;
  for (size_t i = 0; i < cands.size(); ++i) {
    const Candidate& c = cands[i];
    const bool last = i + 1 == cands.size();
    Storage ws;
    try {
      if (c.workspace > 0) ws = alloc_scratch_bytes(c.workspace, Device::cuda(pb.device));
    } catch (const memory::OutOfMemoryError&) {
      if (last) throw;
      failures += fmt::format(" algo {}: no memory for a {} B workspace;", c.algo, c.workspace);
      continue;
    }
    d.conv.set_math(c.math);
    const cudnnStatus_t st = execute(pb.kind, h, d, c.algo, ws.data(), c.workspace, alpha, beta, p);
    if (st == CUDNN_STATUS_SUCCESS) return;
    if (!not_supported(st) || last) {
      const char* call = pb.kind == Kind::forward         ? "cudnnConvolutionForward"
                         : pb.kind == Kind::backward_data ? "cudnnConvolutionBackwardData"
                                                          : "cudnnConvolutionBackwardFilter";
      check_cudnn(st, call,
                  fmt::format("{}, algo {}, math {}, workspace {} B{}{}", pb.str(), c.algo,
                              static_cast<int>(c.math), c.workspace,
                              failures.empty() ? "" : "; earlier:", failures));
    }
    failures += fmt::format(" algo {}: {};", c.algo, cudnnGetErrorString(st));
  }
}

// ------------------------------------------------------------------ tensors -> calls

int to_int(int64_t v, const char* what) {
  if (v > INT_MAX || v < 0)
    throw std::invalid_argument(
        fmt::format("conv2d (cuDNN): {} = {} does not fit cuDNN's int range", what, v));
  return static_cast<int>(v);
}

// The layout a call runs in: NHWC when any of its tensors is channels_last (ops::conv2d
// hands all three over in one layout; a caller of the kernel directly may mix them).
bool any_nhwc(std::initializer_list<const Tensor*> ts) {
  return conv_memory_format(ts) == MemoryFormat::channels_last;
}

MemoryFormat format_of(bool nhwc) {
  return nhwc ? MemoryFormat::channels_last : MemoryFormat::contiguous;
}

// Dense in the call's layout (NCHW, or NHWC when `nhwc`) with a pointer cuDNN's vectorised
// kernels accept (16-byte aligned).
bool dense(const Tensor& t, bool nhwc) {
  return t.is_contiguous(format_of(nhwc)) && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

Tensor make_dense(const Tensor& t, bool nhwc) {
  if (!t.defined() || dense(t, nhwc)) return t;
  Tensor out = alloc_output(t.sizes(), t.dtype(), t.device(), format_of(nhwc));
  ops::copy_(out, t);
  return out;
}

// The output to compute into: `out` itself when dense, else a dense buffer copied back.
class DenseOutput {
 public:
  DenseOutput(const Tensor& out, bool nhwc)
      : target_(out),
        buf_(dense(out, nhwc)
                 ? out
                 : alloc_output(out.sizes(), out.dtype(), out.device(), format_of(nhwc))) {}
  const Tensor& get() const { return buf_; }
  void finish() const {
    if (!buf_.storage().is_same(target_.storage())) ops::copy_(target_, buf_);
  }

 private:
  const Tensor& target_;
  Tensor buf_;
};

// Splits the batch into slices that cuDNN's int-sized tensors can hold and runs each.
// x [N, C, H, W], w [O, C/g, kH, kW], y [N, O, OH, OW] dense in one layout (NHWC when
// `nhwc`); the pointers are the tensors' data. For backward filter, slices after the first
// accumulate (a sample is a contiguous run of memory in either layout).
void run(Kind kind, const Tensor& x, const Tensor& w, const Tensor& y, const ops::Conv2dParams& prm,
         bool nhwc) {
  const int64_t N = x.size(0);
  const int64_t per_x = x.numel() / N, per_y = y.numel() / N;
  const int64_t limit = g_max_call_elements.load();
  if (per_x > limit || per_y > limit)
    throw std::invalid_argument(
        fmt::format("conv2d (cuDNN): one sample of input {} or output {} has more than {} "
                    "elements, beyond cuDNN's int-sized "
                    "tensors",
                    x.shape_string(), y.shape_string(), limit));
  const int64_t chunk = std::max<int64_t>(1, std::min(N, limit / std::max(per_x, per_y)));
  to_int(w.numel(), "the weight's element count");

  Problem pb;
  pb.kind = kind;
  pb.device = x.device().index;
  pb.dtype = x.dtype();
  pb.tf32 = pb.dtype == DType::float32 && cudnn_allow_tf32();
  pb.nhwc = nhwc;
  for (int i = 1; i < 4; ++i) {
    pb.x[i] = to_int(x.size(i), "an input dimension");
    pb.y[i] = to_int(y.size(i), "an output dimension");
  }
  for (int i = 0; i < 4; ++i) pb.w[i] = to_int(w.size(i), "a weight dimension");
  pb.pad[0] = to_int(prm.padding.h, "padding"), pb.pad[1] = to_int(prm.padding.w, "padding");
  pb.stride[0] = to_int(prm.stride.h, "stride"), pb.stride[1] = to_int(prm.stride.w, "stride");
  pb.dilation[0] = to_int(prm.dilation.h, "dilation"),
  pb.dilation[1] = to_int(prm.dilation.w, "dilation");
  pb.groups = to_int(prm.groups, "groups");

  const size_t es = dtype_size(pb.dtype);
  char* xp = static_cast<char*>(x.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int n = static_cast<int>(std::min(chunk, N - n0));
    pb.x[0] = pb.y[0] = n;
    strides4(pb.x, pb.xs, nhwc);
    strides4(pb.y, pb.ys, nhwc);
    const Pointers p{xp + static_cast<size_t>(n0 * per_x) * es, w.data_ptr(),
                     yp + static_cast<size_t>(n0 * per_y) * es};
    run_call(pb, p, kind == Kind::backward_filter && n0 > 0);
  }
}

void check_dtypes(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype())
    throw std::invalid_argument(fmt::format(
        "{} (cuDNN): tensors of different dtypes ({} {} and {} {})", op, dtype_name(a.dtype()),
        a.shape_string(), dtype_name(b.dtype()), b.shape_string()));
}

void conv2d_forward(const Tensor& out, const Tensor& input, const Tensor& weight,
                    const Tensor& bias, const ops::Conv2dParams& p) {
  NvtxRange range("conv2d (cuDNN)");
  DeviceGuard g(input.device().index);
  check_dtypes("conv2d", input, weight);
  check_dtypes("conv2d", input, out);
  if (out.numel() == 0) return;  // an empty batch
  const bool nhwc = any_nhwc({&out, &input, &weight});
  const DenseOutput y(out, nhwc);
  if (input.numel() == 0) {
    // An empty input plane with padding: every window lies in the padding.
    check(cudaMemsetAsync(y.get().data_ptr(), 0, y.get().nbytes(), stream(input.device().index)),
          "conv2d (zero)");
  } else {
    const Tensor x = make_dense(input, nhwc), w = make_dense(weight, nhwc);
    run(Kind::forward, x, w, y.get(), p, nhwc);
  }
  if (bias.defined()) {
    check_dtypes("conv2d", input, bias);
    if (nhwc)  // the bias over the last memory dimension: a broadcast add
      ops::add_(y.get(), ops::view(bias, {1, bias.numel(), 1, 1}));
    else
      conv2d_add_bias(y.get(), make_dense(bias, false));
  }
  y.finish();
}

void conv2d_backward_input(const Tensor& grad_input, const Tensor& grad_output,
                           const Tensor& weight, const ops::Conv2dParams& p) {
  NvtxRange range("conv2d_backward_input (cuDNN)");
  DeviceGuard g(grad_output.device().index);
  check_dtypes("conv2d_backward_input", grad_output, weight);
  check_dtypes("conv2d_backward_input", grad_output, grad_input);
  if (grad_input.numel() == 0) return;
  const bool nhwc = any_nhwc({&grad_input, &grad_output, &weight});
  const Tensor gy = make_dense(grad_output, nhwc), w = make_dense(weight, nhwc);
  const DenseOutput gx(grad_input, nhwc);
  run(Kind::backward_data, gx.get(), w, gy, p, nhwc);
  gx.finish();
}

void conv2d_backward_weight(const Tensor& grad_weight, const Tensor& grad_output,
                            const Tensor& input, const ops::Conv2dParams& p) {
  NvtxRange range("conv2d_backward_weight (cuDNN)");
  const int dev = grad_output.device().index;
  DeviceGuard g(dev);
  check_dtypes("conv2d_backward_weight", grad_output, input);
  check_dtypes("conv2d_backward_weight", grad_output, grad_weight);
  const bool nhwc = any_nhwc({&grad_weight, &grad_output, &input});
  const DenseOutput gw(grad_weight, nhwc);
  if (input.numel() == 0 || grad_output.numel() == 0) {  // an empty batch: the sum over no samples
    check(cudaMemsetAsync(gw.get().data_ptr(), 0, gw.get().nbytes(), stream(dev)),
          "conv2d_backward_weight (zero)");
  } else {
    const Tensor gy = make_dense(grad_output, nhwc), x = make_dense(input, nhwc);
    run(Kind::backward_filter, x, gw.get(), gy, p, nhwc);
  }
  gw.finish();
}

}  // namespace

const ConvKernels conv_kernels{TALLY_CONV_KERNELS};

std::vector<ConvWorkspace> conv_planned_workspaces() {
  std::vector<ConvWorkspace> out;
  std::lock_guard lock(g_plan_mu);
  for (const auto& [key, plan] : g_plans) {
    if (!plan) continue;
    // The key's layout: Problem::key(false) (32 numbers, then nhwc), then accumulate and the
    // handle.
    ConvWorkspace r{};
    r.kind = static_cast<int>(key[0]);
    r.dtype = static_cast<int>(key[2]);
    r.groups = static_cast<int>(key[3]);
    r.tf32 = static_cast<int>(key[5]);
    for (int i = 0; i < 4; ++i) {
      r.x[i] = static_cast<int>(key[6 + i]);
      r.w[i] = static_cast<int>(key[14 + i]);
      r.y[i] = static_cast<int>(key[18 + i]);
    }
    for (int i = 0; i < 2; ++i) {
      r.pad[i] = static_cast<int>(key[26 + i]);
      r.stride[i] = static_cast<int>(key[28 + i]);
      r.dilation[i] = static_cast<int>(key[30 + i]);
    }
    r.nhwc = static_cast<int>(key[32]);
    r.accumulate = static_cast<int>(key[33]);
    r.bytes = plan->graph.workspace_size();
    const bool seen =
        std::any_of(out.begin(), out.end(), [&](const ConvWorkspace& o) { return o.same_call(r); });
    if (!seen) out.push_back(r);
  }
  return out;
}

size_t conv_plan_cache_size() {
  std::lock_guard lock(g_plan_mu);
  size_t n = 0;
  for (const auto& [key, plan] : g_plans) n += plan != nullptr;
  return n;
}

size_t conv_algorithm_cache_size() {
  std::lock_guard lock(g_cache_mu);
  return g_cache.size();
}

void clear_conv_algorithm_cache() {
  {
    std::lock_guard lock(g_cache_mu);
    g_cache.clear();
  }
  std::lock_guard lock(g_plan_mu);
  g_plans.clear();
}

void set_conv_max_call_elements(int64_t n) {
  g_max_call_elements.store(n > 0 ? n : INT_MAX);
}

}  // namespace tally::cuda
