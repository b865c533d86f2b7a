// The GPU tracer over CUPTI's activity API (compiled only with the CUDA backend; see
// gpu_tracer.h). Records CONCURRENT_KERNEL, MEMCPY, MEMSET, RUNTIME, DRIVER and
// EXTERNAL_CORRELATION activity into buffers CUPTI fills asynchronously; stop() waits for
// the device once, flushes, and joins kernels to the ops that launched them through the
// external correlation id each op pushes while it runs, then detaches CUPTI (below).
#include "profiler/gpu_tracer.h"

#ifdef TALLY_WITH_CUPTI

#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <unordered_map>

namespace tally::profiler::gpu_tracer {
namespace {

constexpr size_t kBufferSize = 8 * 1024 * 1024;
constexpr size_t kAlign = 8;
constexpr CUpti_ExternalCorrelationKind kExternalKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  throw std::runtime_error(fmt::format("profiler (CUPTI): {} failed: {}", what, msg ? msg : "?"));
}

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                           std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

struct State {
  std::mutex mu;
  std::vector<GpuEvent> events;
  std::unordered_map<uint32_t, uint64_t> external;  // correlation id -> external id
  int64_t clock_offset = 0;                         // cupti timestamp - steady ns
  int64_t origin = 0;                               // steady ns of the profiler's time zero
  bool callbacks_registered = false;
  bool running = false;
};

State& state() {
  static State* s = new State();  // CUPTI may call back during exit
  return *s;
}

int64_t rel(uint64_t cupti_ts) {
  State& s = state();
  return static_cast<int64_t>(cupti_ts) - s.clock_offset - s.origin;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(::operator new (kBufferSize, std::align_val_t{kAlign}));
  *size = kBufferSize;
  *max_records = 0;
}

// The fields every device activity record (kernel, memcpy, memset) carries.
template <typename Record>
GpuEvent device_event(GpuKind kind, std::string name, const Record* r) {
  GpuEvent e;
  e.kind = kind;
  e.name = std::move(name);
  e.start_ns = rel(r->start);
  e.end_ns = rel(r->end);
  e.device = static_cast<int>(r->deviceId);
  e.stream = r->streamId;
  e.correlation = r->correlationId;
  return e;
}

void parse_record(const CUpti_Activity* rec, std::vector<GpuEvent>& out,
                  std::unordered_map<uint32_t, uint64_t>& external) {
  switch (rec->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      GpuEvent e = device_event(GpuKind::kernel, demangle(k->name), k);
      e.grid[0] = k->gridX, e.grid[1] = k->gridY, e.grid[2] = k->gridZ;
      e.block[0] = k->blockX, e.block[1] = k->blockY, e.block[2] = k->blockZ;
      e.registers_per_thread = k->registersPerThread;
      e.shared_memory = k->staticSharedMemory + k->dynamicSharedMemory;
      out.push_back(std::move(e));
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      GpuEvent e = device_event(GpuKind::memcpy,
                                fmt::format("Memcpy (kind {})", static_cast<int>(m->copyKind)), m);
      e.bytes = m->bytes;
      out.push_back(std::move(e));
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
      GpuEvent e = device_event(GpuKind::memset, "Memset", m);
      e.bytes = m->bytes;
      out.push_back(std::move(e));
      break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
      GpuEvent e;
      const bool runtime = rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
      e.kind = runtime ? GpuKind::runtime : GpuKind::driver;
      const char* name = nullptr;
      cuptiGetCallbackName(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API,
                           a->cbid, &name);
      e.name = name ? name : fmt::format("cbid {}", a->cbid);
      e.start_ns = rel(a->start);
      e.end_ns = rel(a->end);
      e.correlation = a->correlationId;
      e.tid = a->threadId;
      e.cbid = a->cbid;
      out.push_back(std::move(e));
      break;
    }
    case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
      const auto* x = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(rec);
      if (x->externalKind == kExternalKind) external[x->correlationId] = x->externalId;
      break;
    }
    default:
      break;
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<GpuEvent> events;
  std::unordered_map<uint32_t, uint64_t> external;
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS)
    parse_record(rec, events, external);
  ::operator delete (buffer, std::align_val_t{kAlign});
  State& s = state();
  std::lock_guard lock(s.mu);
  if (!s.running) return;  // records of an earlier window
  s.events.insert(s.events.end(), std::make_move_iterator(events.begin()),
                  std::make_move_iterator(events.end()));
  s.external.insert(external.begin(), external.end());
}

// Once attached, CUPTI stays between the program and the driver after its activities are
// disabled, and later CUDA calls can pay for it (Kineto tears CUPTI down for this reason;
// Tally's own before/after figure was taken on a noisy host and does not isolate it, see
// bench/results/profiler.md, session 17). stop() detaches CUPTI with
// cuptiFinalize, after the device synchronisation and forced flush that CUPTI's
// documentation asks for outside an API callback, with no op pushing correlation ids any
// more (the profiler uninstalls its observers before it stops the tracer). The next start()
// attaches it again. Between a schedule's warm-up and its active steps it stays attached:
// the warm-up is there to absorb what attaching costs.
void detach() {
  if (cuptiFinalize() == CUPTI_SUCCESS) state().callbacks_registered = false;
}

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                         CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET,
                                         CUPTI_ACTIVITY_KIND_RUNTIME,
                                         CUPTI_ACTIVITY_KIND_DRIVER,
                                         CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION};

// Runtime calls that only ask the runtime something: their records would outnumber the
// launches (every launch is followed by a cudaGetLastError), and each costs CUPTI a record.
// PyTorch's Kineto leaves cudaGetDevice and cudaGetLastError out of its traces for the same
// reason. Launches, copies, sets, syncs and event calls are still recorded, with every driver
// call: cuBLAS launches through the driver API, and its kernels are attributed to their ops
// through those records' correlation ids. On a ResNet-50 step this halves the records (38,177
// to 20,257 over 8 steps; bench/results/profiler.md, session 34).
constexpr CUpti_CallbackId kUnrecordedRuntimeCalls[] = {
    CUPTI_RUNTIME_TRACE_CBID_cudaGetLastError_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaPeekAtLastError_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDevice_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDeviceCount_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamIsCapturing_v10000,
};

}  // namespace

bool available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void start(int64_t steady_origin_ns) {
  State& s = state();
  if (!s.callbacks_registered) {
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
          "cuptiActivityRegisterCallbacks");
    s.callbacks_registered = true;
  }
  uint64_t cupti_now = 0;
  check(cuptiGetTimestamp(&cupti_now), "cuptiGetTimestamp");
  const int64_t steady_now = steady_ns();
  {
    std::lock_guard lock(s.mu);
    s.events.clear();
    s.external.clear();
    s.clock_offset = static_cast<int64_t>(cupti_now) - steady_now;
    s.origin = steady_origin_ns;
    s.running = true;
  }
  for (CUpti_ActivityKind k : kKinds) check(cuptiActivityEnable(k), "cuptiActivityEnable");
  // After the RUNTIME kind: enabling a kind resets its per-call choices.
  for (CUpti_CallbackId cbid : kUnrecordedRuntimeCalls)
    check(cuptiActivityEnableRuntimeApi(cbid, 0), "cuptiActivityEnableRuntimeApi");
}

void stop(std::vector<GpuEvent>& out, bool detach_after) {
  State& s = state();
  cudaDeviceSynchronize();  // once per window: the kernels must have finished
  check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  for (CUpti_ActivityKind k : kKinds) cuptiActivityDisable(k);
  if (detach_after) detach();  // not under s.mu: a last buffer may come to buffer_completed
  std::lock_guard lock(s.mu);
  s.running = false;
  for (GpuEvent& e : s.events) {
    auto it = s.external.find(e.correlation);
    if (it != s.external.end()) e.external_id = it->second;
  }
  out.insert(out.end(), std::make_move_iterator(s.events.begin()),
             std::make_move_iterator(s.events.end()));
  s.events.clear();
  s.external.clear();
}

void push_external_id(uint64_t id) {
  cuptiActivityPushExternalCorrelationId(kExternalKind, id);
}

void pop_external_id() {
  uint64_t last = 0;
  cuptiActivityPopExternalCorrelationId(kExternalKind, &last);
}

}  // namespace tally::profiler::gpu_tracer

#endif  // TALLY_WITH_CUPTI
