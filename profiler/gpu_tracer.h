// GPU activity tracing for the profiler. With CUPTI (TALLY_WITH_CUPTI, profiler/cupti_tracer.cpp)
// it records kernels, memcpys, memsets and CUDA runtime/driver calls through CUPTI's
// activity API, each tagged with the external correlation id of the op that launched it;
// buffers are flushed at stop(), never per op. Without CUPTI (CPU builds) every call is
// a no-op and available() is false (profiler/gpu_tracer.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "profiler/events.h"

namespace tally::profiler::gpu_tracer {

// CUPTI is compiled in and a CUDA device is present.
bool available();
// Begin recording. `steady_origin_ns` is the profiler's time zero on
// std::chrono::steady_clock; GpuEvent times are reported relative to it.
void start(int64_t steady_origin_ns);
// Flush CUPTI's buffers, stop recording and append what was recorded. With `detach`, CUPTI
// then leaves the process (cuptiFinalize: CUDA calls stop paying for it; the next start()
// attaches it again); without, it stays attached for a window that opens right away (a
// schedule's warm-up followed by its active steps).
void stop(std::vector<GpuEvent>& out, bool detach = true);
// Op entry / exit: GPU work launched in between carries `id` as its external id.
void push_external_id(uint64_t id);
void pop_external_id();

}  // namespace tally::profiler::gpu_tracer
