// The GPU tracer when CUPTI is not compiled in: nothing to record (see gpu_tracer.h).
#include "profiler/gpu_tracer.h"

#ifndef TALLY_WITH_CUPTI
namespace tally::profiler::gpu_tracer {

bool available() {
  return false;
}
void start(int64_t) {}
void stop(std::vector<GpuEvent>&, bool) {}
void push_external_id(uint64_t) {}
void pop_external_id() {}

}  // namespace tally::profiler::gpu_tracer
#endif
