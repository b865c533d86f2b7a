// cuBLASLt handles, the algorithm (plan) cache and the one GEMM entry point. See blas.h.
#include "tensor/cuda/blas.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <atomic>
#include <climits>
#include <compare>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "memory/meta.h"
#include "tensor/cuda/graph.h"
#include "tensor/cuda/matmul_settings.h"
#include "tensor/cuda/runtime.h"
#include "tensor/storage.h"

namespace tally::cuda {

namespace {
std::atomic<bool> g_allow_tf32{false};
std::atomic<bool> g_tunable{env_switch("TALLY_TUNABLEOP_ENABLED", false)};

std::atomic<size_t> g_workspace_bytes{memory::cublaslt_workspace_bytes_from_env()};
}  // namespace

void set_allow_tf32(bool allow) {
  g_allow_tf32.store(allow);
}
bool allow_tf32() {
  return g_allow_tf32.load();
}
void set_tunable_enabled(bool enabled) {
  g_tunable.store(enabled);
}
bool tunable_enabled() {
  return g_tunable.load();
}
void set_matmul_workspace_bytes(size_t bytes) {
  g_workspace_bytes.store(bytes);
}
size_t matmul_workspace_bytes() {
  return g_workspace_bytes.load();
}

namespace blas {

namespace {

std::atomic<uint64_t> g_lt_calls{0}, g_heuristic_queries{0}, g_bias_calls{0}, g_gelu_calls{0},
    g_classic_calls{0}, g_tuned{0};
std::atomic<bool> g_force_fallback{false};

[[noreturn]] void fail(cublasStatus_t s, const char* call, const char* op, const Gemm& g) {
  throw std::runtime_error(fmt::format("{}: {} failed: {} ({}) for {}", op, call,
                                       cublasLtGetStatusName(s), cublasLtGetStatusString(s),
                                       describe(g)));
}

#define TALLY_LT_CHECK(expr)                                           \
  do {                                                                 \
    const cublasStatus_t status_ = (expr);                             \
    if (status_ != CUBLAS_STATUS_SUCCESS) fail(status_, #expr, op, g); \
  } while (0)

cudaDataType data_type(DType d) {
  return floating_code(d, {CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUDA_R_64F}, "matmul (cuBLASLt)");
}

cublasComputeType_t compute_type(DType d, bool tf32) {
  if (d == DType::float64) return CUBLAS_COMPUTE_64F;
  if (d == DType::float32 && tf32) return CUBLAS_COMPUTE_32F_FAST_TF32;
  return CUBLAS_COMPUTE_32F;  // float32 exactly; float16/bfloat16 accumulate in float32
}

// The output dtype is the operands', or float32 for float16/bfloat16 operands.
void check_dtypes(const Gemm& g, const char* op) {
  const bool sixteen = g.dtype == DType::float16 || g.dtype == DType::bfloat16;
  if (g.out_dtype != g.dtype && !(sixteen && g.out_dtype == DType::float32))
    throw std::logic_error(fmt::format("{}: unsupported GEMM dtypes (operands {}, output {}): {}",
                                       op, dtype_name(g.dtype), dtype_name(g.out_dtype),
                                       describe(g)));
}

// The largest power of two (<= 256) dividing the address of every matrix of the batch.
uint32_t alignment(const void* p, int64_t stride_elems, size_t esize, int64_t batch) {
  uint64_t v = reinterpret_cast<uintptr_t>(p);
  if (batch > 1 && stride_elems != 0) v |= static_cast<uint64_t>(stride_elems) * esize;
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

// RAII owners of the cuBLASLt descriptors.
struct MatmulDesc {
  cublasLtMatmulDesc_t h = nullptr;
  ~MatmulDesc() {
    if (h) cublasLtMatmulDescDestroy(h);
  }
};
struct Layout {
  cublasLtMatrixLayout_t h = nullptr;
  ~Layout() {
    if (h) cublasLtMatrixLayoutDestroy(h);
  }
};
struct Preference {
  cublasLtMatmulPreference_t h = nullptr;
  ~Preference() {
    if (h) cublasLtMatmulPreferenceDestroy(h);
  }
};

struct PlanKey {
  int device = 0;
  int dtype = 0;
  int out_dtype = 0;
  int compute = 0;
  bool trans_a = false, trans_b = false, accumulate = false, bias = false;
  int act = 0;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldd = 0, ldaux = 0;
  int64_t stride_a = 0, stride_b = 0, stride_d = 0, batch = 0;
  uint32_t align_a = 0, align_b = 0, align_d = 0, align_bias = 0, align_aux = 0;
  uint64_t workspace = 0;
  bool tuned = false;  // the algorithm was picked by timing (tunable_enabled()), not the heuristic
  auto operator<=>(const PlanKey&) const = default;
};

struct Plan {
  cublasStatus_t status = CUBLAS_STATUS_NOT_SUPPORTED;  // SUCCESS: `algo` is usable
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
};

std::mutex g_plan_mu;
std::map<PlanKey, Plan>& plan_cache() {
  static auto* cache = new std::map<PlanKey, Plan>();  // never destroyed: used until exit
  return *cache;
}

// Asks the heuristic for the best algorithm; `mask_output_reduction` excludes split-K
// reductions in the (16-bit) output type.
// Asks for up to `want` algorithms, best first, into results; *returned gets their count.
cublasStatus_t query(cublasLtHandle_t lt, const MatmulDesc& desc, const Layout& la,
                     const Layout& lb, const Layout& ld, const PlanKey& key,
                     bool mask_output_reduction, cublasLtMatmulHeuristicResult_t* results, int want,
                     int* returned, const char* op, const Gemm& g) {
  ++g_heuristic_queries;
  Preference pref;
  TALLY_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref.h));
  const uint64_t ws = key.workspace;
  TALLY_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.h, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t aligns[4] = {key.align_a, key.align_b, key.align_d, key.align_d};
  const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    TALLY_LT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref.h, attrs[i], &aligns[i], sizeof(uint32_t)));
  if (mask_output_reduction) {
    const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_MASK & ~CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
    TALLY_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.h, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask)));
  }
  *returned = 0;
  const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, desc.h, la.h, lb.h, ld.h, ld.h,
                                                          pref.h, want, results, returned);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_INVALID_VALUE) return s;
  TALLY_LT_CHECK(s);
  if (*returned < 1) return CUBLAS_STATUS_NOT_SUPPORTED;
  return results[0].state;
}

// Tuning (tunable_enabled()): the heuristic's first kTuneCandidates algorithms each run
// kTuneRuns times on the real operands, after one warm-up run, into a scratch D (and a scratch
// aux for gelu_aux, whose aux is an output), so the caller's output (which an accumulating
// product reads) is untouched. The fastest by total time wins if it beats the heuristic's
// first choice by kTuneMargin: run back to back on operands that stay in L2, the timings
// favour some algorithms a little over a training step's order (on GPT-2 a 1% gain picked
// this way made its mm calls 2% slower in the step). Host-blocking (an event wait), once per
// problem. Returns the index of the winner in results.
constexpr int kTuneCandidates = 8, kTuneRuns = 5;
constexpr float kTuneMargin = 0.97f;

int time_candidates(int device, cublasLtHandle_t lt, const MatmulDesc& desc, const Layout& la,
                    const Layout& lb, const Layout& ld, const Gemm& g, const void* alpha,
                    const void* beta, void* workspace, size_t workspace_bytes,
                    const cublasLtMatmulHeuristicResult_t* results, int count, const char* op) {
  const size_t out_esize = dtype_size(g.out_dtype);
  const int64_t d_elems = g.ldd * g.n + (g.batch > 1 ? g.stride_d * (g.batch - 1) : 0);
  const Storage d_scratch =
      alloc_scratch_bytes(static_cast<size_t>(d_elems) * out_esize, Device::cuda(device));
  Storage aux_scratch;
  if (g.act == Gemm::Act::gelu_aux) {
    aux_scratch =
        alloc_scratch_bytes(static_cast<size_t>(g.ldaux * g.n) * out_esize, Device::cuda(device));
    void* aux = aux_scratch.data();
    TALLY_LT_CHECK(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                  &aux, sizeof(aux)));
  }
  struct Event {
    cudaEvent_t e = nullptr;
    Event() { check(cudaEventCreate(&e), "cudaEventCreate (GEMM tuning)"); }
    ~Event() { cudaEventDestroy(e); }
  } start_ev, stop_ev;
  const cudaEvent_t start = start_ev.e, stop = stop_ev.e;
  const cudaStream_t st = stream(device);
  int best = -1;
  float best_ms = 0, first_ms = -1;
  for (int i = 0; i < count; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS || results[i].workspaceSize > workspace_bytes)
      continue;
    auto run = [&] {
      return cublasLtMatmul(lt, desc.h, alpha, g.a, la.h, g.b, lb.h, beta, d_scratch.data(), ld.h,
                            d_scratch.data(), ld.h, &results[i].algo,
                            workspace_bytes ? workspace : nullptr, workspace_bytes, st);
    };
    if (run() != CUBLAS_STATUS_SUCCESS) continue;  // an algorithm that refuses the problem
    check(cudaEventRecord(start, st), "cudaEventRecord (GEMM tuning)");
    bool ok = true;
    for (int r = 0; r < kTuneRuns && ok; ++r) ok = run() == CUBLAS_STATUS_SUCCESS;
    check(cudaEventRecord(stop, st), "cudaEventRecord (GEMM tuning)");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize (GEMM tuning)");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime (GEMM tuning)");
    if (!ok) continue;
    if (i == 0) first_ms = ms;
    if (best < 0 || ms < best_ms) {
      best = i;
      best_ms = ms;
    }
  }
  if (g.act == Gemm::Act::gelu_aux)
    TALLY_LT_CHECK(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                  &g.aux, sizeof(g.aux)));
  ++g_tuned;
  if (best < 0 || (first_ms >= 0 && best_ms > kTuneMargin * first_ms)) return 0;
  return best;  // the scratch goes back to the cache after the timed work (waited)
}

}  // namespace

// The process-wide handle of a cuBLAS library (cuBLASLt or classic cuBLAS; `what` names it)
// for `device`: made on first use by create (`call`, whose failure is described through the
// library's status_name and status_string), never destroyed.
template <typename Handle, typename Create, typename StatusText>
Handle library_handle(int device, const char* what, const char* call, Create create,
                      StatusText status_name, StatusText status_string) {
  static std::mutex mu;
  static auto* handles = new std::vector<Handle>();  // never destroyed
  std::lock_guard lock(mu);
  return per_device(*handles, device, what, [&] {
    Handle h = nullptr;
    const cublasStatus_t s = create(&h);
    if (s != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error(fmt::format("{} on cuda:{} failed: {} ({})", call, device,
                                           status_name(s), status_string(s)));
    return h;
  });
}

cublasLtHandle_t handle(int device) {
  return library_handle<cublasLtHandle_t>(device, "cuBLASLt handle", "cublasLtCreate",
                                          cublasLtCreate, cublasLtGetStatusName,
                                          cublasLtGetStatusString);
}

std::string describe(const Gemm& g) {
  return fmt::format(
      "{}{}{} m={} n={} k={} opA={} lda={} strideA={} opB={} ldb={} strideB={} ldd={} "
      "strideD={} batch={} accumulate={} bias={}{}{} tf32={}",
      dtype_name(g.dtype), g.out_dtype != g.dtype ? " -> " : "",
      g.out_dtype != g.dtype ? dtype_name(g.out_dtype) : "", g.m, g.n, g.k, g.trans_a ? "T" : "N",
      g.lda, g.stride_a, g.trans_b ? "T" : "N", g.ldb, g.stride_b, g.ldd, g.stride_d, g.batch,
      g.accumulate, g.bias != nullptr,
      g.act == Gemm::Act::gelu_aux ? " epilogue=gelu_aux"
      : g.act == Gemm::Act::dgelu  ? " epilogue=dgelu"
                                   : "",
      g.act != Gemm::Act::none ? fmt::format(" ldaux={}", g.ldaux) : std::string(),
      g.dtype == DType::float32 && allow_tf32());
}

cublasStatus_t gemm(int device, const Gemm& g, void* workspace, size_t workspace_bytes,
                    const char* op) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.batch <= 0)
    throw std::logic_error(
        fmt::format("{}: degenerate GEMM reached cuBLASLt: {}", op, describe(g)));
  if (g.bias && g.batch != 1)
    throw std::logic_error(fmt::format("{}: bias epilogue with a batch: {}", op, describe(g)));
  if (g.act != Gemm::Act::none &&
      (g.batch != 1 || g.accumulate || !g.aux || g.ldaux < g.m || g.ldaux % 8 != 0 ||
       (g.act == Gemm::Act::dgelu && g.bias) || g.out_dtype != g.dtype))
    throw std::logic_error(
        fmt::format("{}: GELU epilogue needs batch 1, no accumulation, an "
                    "aux matrix with ldaux >= m and a multiple of 8, the "
                    "operands' output dtype (and no bias for dgelu): {}",
                    op, describe(g)));
  if (g.batch > INT32_MAX)
    throw std::invalid_argument(
        fmt::format("{}: batch too large for cuBLASLt: {}", op, describe(g)));
  check_dtypes(g, op);
  if (g_force_fallback.load()) return CUBLAS_STATUS_NOT_SUPPORTED;
  DeviceGuard guard(device);
  cublasLtHandle_t lt = handle(device);
  const cudaDataType type = data_type(g.dtype), out_type = data_type(g.out_dtype);
  const bool tf32 = g.dtype == DType::float32 && allow_tf32();
  const cublasComputeType_t compute = compute_type(g.dtype, tf32);
  const cudaDataType scale = g.dtype == DType::float64 ? CUDA_R_64F : CUDA_R_32F;
  const size_t esize = dtype_size(g.dtype), out_esize = dtype_size(g.out_dtype);

  MatmulDesc desc;
  TALLY_LT_CHECK(cublasLtMatmulDescCreate(&desc.h, compute, scale));
  const cublasOperation_t opa = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  TALLY_LT_CHECK(
      cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  TALLY_LT_CHECK(
      cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  cublasLtEpilogue_t epi = g.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  if (g.act == Gemm::Act::gelu_aux)
    epi = g.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  else if (g.act == Gemm::Act::dgelu)
    epi = CUBLASLT_EPILOGUE_DGELU;
  if (epi != CUBLASLT_EPILOGUE_DEFAULT)
    TALLY_LT_CHECK(
        cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (g.bias)
    TALLY_LT_CHECK(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &g.bias, sizeof(g.bias)));
  if (g.act != Gemm::Act::none) {
    TALLY_LT_CHECK(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                  &g.aux, sizeof(g.aux)));
    TALLY_LT_CHECK(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                  &g.ldaux, sizeof(g.ldaux)));
  }

  auto make_layout = [&](Layout& l, cudaDataType t, int64_t rows, int64_t cols, int64_t ld,
                         int64_t stride) {
    TALLY_LT_CHECK(cublasLtMatrixLayoutCreate(&l.h, t, static_cast<uint64_t>(rows),
                                              static_cast<uint64_t>(cols), ld));
    if (g.batch > 1) {
      const int32_t count = static_cast<int32_t>(g.batch);
      TALLY_LT_CHECK(cublasLtMatrixLayoutSetAttribute(l.h, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                      &count, sizeof(count)));
      TALLY_LT_CHECK(cublasLtMatrixLayoutSetAttribute(
          l.h, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    }
  };
  Layout la, lb, ld;
  make_layout(la, type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, g.stride_a);
  make_layout(lb, type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, g.stride_b);
  make_layout(ld, out_type, g.m, g.n, g.ldd, g.stride_d);

  const PlanKey key{
      .device = device,
      .dtype = static_cast<int>(g.dtype),
      .out_dtype = static_cast<int>(g.out_dtype),
      .compute = static_cast<int>(compute),
      .trans_a = g.trans_a,
      .trans_b = g.trans_b,
      .accumulate = g.accumulate,
      .bias = g.bias != nullptr,
      .act = static_cast<int>(g.act),
      .m = g.m,
      .n = g.n,
      .k = g.k,
      .lda = g.lda,
      .ldb = g.ldb,
      .ldd = g.ldd,
      .ldaux = g.ldaux,
      .stride_a = g.batch > 1 ? g.stride_a : 0,
      .stride_b = g.batch > 1 ? g.stride_b : 0,
      .stride_d = g.batch > 1 ? g.stride_d : 0,
      .batch = g.batch,
      .align_a = alignment(g.a, g.stride_a, esize, g.batch),
      .align_b = alignment(g.b, g.stride_b, esize, g.batch),
      .align_d = alignment(g.d, g.stride_d, out_esize, g.batch),
      .align_bias = g.bias ? alignment(g.bias, 0, esize, 1) : 0,
      .align_aux = g.aux ? alignment(g.aux, 0, out_esize, 1) : 0,
      .workspace = workspace ? workspace_bytes : 0,
  };
  const float alpha_f = 1.0f, beta_f = g.accumulate ? 1.0f : 0.0f;
  const double alpha_d = 1.0, beta_d = g.accumulate ? 1.0 : 0.0;
  const void* alpha = g.dtype == DType::float64 ? static_cast<const void*>(&alpha_d)
                                                : static_cast<const void*>(&alpha_f);
  const void* beta = g.dtype == DType::float64 ? static_cast<const void*>(&beta_d)
                                               : static_cast<const void*>(&beta_f);
  // With tuning on, the timed plan; inside a CUDA graph capture (where nothing may wait) a
  // problem not tuned before takes the heuristic's plan.
  const bool capturing = is_capturing(device);
  const bool tune = tunable_enabled();
  PlanKey tuned_key = key;
  tuned_key.tuned = true;

  Plan plan;
  bool cached = false;
  const PlanKey* use_key = &key;
  {
    std::lock_guard lock(g_plan_mu);
    auto it = tune ? plan_cache().find(tuned_key) : plan_cache().end();
    if (it != plan_cache().end()) {
      use_key = &tuned_key;
    } else {
      it = plan_cache().find(key);
      if (tune && !capturing) it = plan_cache().end();  // to be tuned now
    }
    if (it != plan_cache().end()) {
      plan = it->second;
      cached = true;
    }
  }
  if (!cached) {
    const bool tuning = tune && !capturing;
    cublasLtMatmulHeuristicResult_t results[kTuneCandidates] = {};
    const int want = tuning ? kTuneCandidates : 1;
    int returned = 0;
    const bool sixteen = g.out_dtype == DType::float16 || g.out_dtype == DType::bfloat16;
    // 16-bit outputs: keep split-K partial sums in float32 when an algorithm allows it.
    plan.status = query(lt, desc, la, lb, ld, key, sixteen, results, want, &returned, op, g);
    if (plan.status != CUBLAS_STATUS_SUCCESS && sixteen)
      plan.status = query(lt, desc, la, lb, ld, key, false, results, want, &returned, op, g);
    if (plan.status == CUBLAS_STATUS_SUCCESS) {
      const int pick = tuning && returned > 1
                           ? time_candidates(device, lt, desc, la, lb, ld, g, alpha, beta,
                                             workspace, key.workspace, results, returned, op)
                           : 0;
      plan.algo = results[pick].algo;
      plan.workspace = results[pick].workspaceSize;
    }
    if (tuning) use_key = &tuned_key;
    std::lock_guard lock(g_plan_mu);
    plan_cache().emplace(*use_key, plan);
  }
  if (plan.status != CUBLAS_STATUS_SUCCESS) return plan.status;
  if (plan.workspace > key.workspace)
    throw std::logic_error(
        fmt::format("{}: cuBLASLt algorithm wants {} bytes of workspace, {} "
                    "given, for {}",
                    op, plan.workspace, key.workspace, describe(g)));

  TALLY_LT_CHECK(cublasLtMatmul(lt, desc.h, alpha, g.a, la.h, g.b, lb.h, beta, g.d, ld.h, g.d, ld.h,
                                &plan.algo, key.workspace ? workspace : nullptr, key.workspace,
                                stream(device)));
  ++g_lt_calls;
  if (g.bias) ++g_bias_calls;
  if (g.act != Gemm::Act::none) ++g_gelu_calls;
  return CUBLAS_STATUS_SUCCESS;
}

namespace {
cublasHandle_t classic_handle(int device) {
  return library_handle<cublasHandle_t>(device, "cuBLAS handle", "cublasCreate", cublasCreate,
                                        cublasGetStatusName, cublasGetStatusString);
}
}  // namespace

void gemm_classic(int device, const Gemm& g, void* workspace, size_t workspace_bytes,
                  const char* op) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.batch <= 0 || g.bias || g.act != Gemm::Act::none)
    throw std::logic_error(fmt::format("{}: unsupported classic GEMM: {}", op, describe(g)));
  check_dtypes(g, op);
  for (int64_t v : {g.m, g.n, g.k, g.lda, g.ldb, g.ldd, g.batch})
    if (v > INT32_MAX)
      throw std::invalid_argument(
          fmt::format("{}: GEMM too large for cuBLAS: {}", op, describe(g)));
  DeviceGuard guard(device);
  cublasHandle_t h = classic_handle(device);
  auto ok = [&](cublasStatus_t s, const char* call) {
    if (s != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error(fmt::format("{}: {} failed: {} ({}) for {}", op, call,
                                           cublasGetStatusName(s), cublasGetStatusString(s),
                                           describe(g)));
  };
  // Tally's stream, our workspace (so cuBLAS never touches its own pool), and float32
  // partial sums for 16-bit types.
  ok(cublasSetStream(h, stream(device)), "cublasSetStream");
  ok(cublasSetWorkspace(h, workspace, workspace ? workspace_bytes : 0), "cublasSetWorkspace");
  const bool sixteen = g.out_dtype == DType::float16 || g.out_dtype == DType::bfloat16;
  ok(cublasSetMathMode(
         h, sixteen ? CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION : CUBLAS_DEFAULT_MATH),
     "cublasSetMathMode");
  const cudaDataType type = data_type(g.dtype), out_type = data_type(g.out_dtype);
  const cublasComputeType_t compute =
      compute_type(g.dtype, g.dtype == DType::float32 && allow_tf32());
  const float alpha_f = 1.0f, beta_f = g.accumulate ? 1.0f : 0.0f;
  const double alpha_d = 1.0, beta_d = g.accumulate ? 1.0 : 0.0;
  const bool f64 = g.dtype == DType::float64;
  const void* alpha = f64 ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = f64 ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
  const bool batched = g.batch > 1;
  ok(cublasGemmStridedBatchedEx(
         h, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
         static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k), alpha, g.a, type,
         static_cast<int>(g.lda), batched ? g.stride_a : 0, g.b, type, static_cast<int>(g.ldb),
         batched ? g.stride_b : 0, beta, g.d, out_type, static_cast<int>(g.ldd),
         batched ? g.stride_d : g.m * g.n, static_cast<int>(g.batch), compute, CUBLAS_GEMM_DEFAULT),
     "cublasGemmStridedBatchedEx");
  ++g_classic_calls;
}

void set_force_fallback(bool force) {
  g_force_fallback.store(force);
}

uint64_t classic_calls() {
  return g_classic_calls.load();
}
uint64_t lt_calls() {
  return g_lt_calls.load();
}
uint64_t tuned_problems() {
  return g_tuned.load();
}
uint64_t heuristic_queries() {
  return g_heuristic_queries.load();
}
uint64_t bias_epilogue_calls() {
  return g_bias_calls.load();
}
uint64_t gelu_epilogue_calls() {
  return g_gelu_calls.load();
}

}  // namespace blas
}  // namespace tally::cuda
