// What one profiling window recorded: CPU spans (ops, modules, user ranges, phases,
// steps), allocator events and GPU activity, merged from the per-thread buffers when the
// window closes. The exports (Chrome trace, key_averages, memory timeline) read this.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/memory.h"

namespace tally::profiler {

enum class SpanKind : uint8_t {
  op,      // one pass through the dispatch point ("linear", "relu", ...)
  module,  // a memory::ModuleScope: name = full module path ("features.0")
  user,    // record_function ("## Forward Pass ##") and "ProfilerStep#N"
  phase,   // a memory::PhaseScope ("forward", "backward", "optimizer")
};
const char* span_kind_name(SpanKind k);

// One CPU span. Times are nanoseconds since the window's start.
struct CpuSpan {
  SpanKind kind = SpanKind::op;
  std::string name;
  std::string module;  // module path open when the span started ("" at top level)
  std::string phase;   // phase open when the span started
  int64_t start_ns = 0;
  int64_t end_ns = 0;      // for a span still open when the window closed: the close time
  uint64_t id = 0;         // unique in the window; the external correlation id of GPU work
  uint64_t parent = 0;     // innermost enclosing span of any kind on the thread (0: none)
  uint64_t parent_op = 0;  // innermost enclosing op/user span (key_averages' tree)
  int depth = 0;           // nesting depth on its thread
  uint64_t tid = 0;        // OS thread id
  memory::Device device;   // ops: the device they dispatched to
  std::vector<std::vector<int64_t>> input_shapes;  // record_shapes
  std::vector<std::string> input_types;            // dtype names, one per shape
  std::string file;                                // record_function's call site (with_stack)
  uint32_t line = 0;

  int64_t duration_ns() const { return end_ns - start_ns; }
};

// One allocator event (alloc, free or re-tag) as seen by the profiler.
struct MemoryEvent {
  int64_t time_ns = 0;  // since the window's start
  uint64_t seq = 0;     // global order of allocator events
  uint64_t addr = 0;
  int64_t bytes = 0;  // + alloc, - free; re-tag: the block's size (moved old -> new)
  size_t total_allocated = 0;
  size_t total_reserved = 0;
  memory::Category category = memory::Category::unknown;
  memory::Category old_category = memory::Category::unknown;  // re-tags
  bool retag = false;
  memory::Device device;
  std::string module, op, phase;  // the block's tag (for a free: where it was allocated)
  std::string scope_module;       // module open on the thread when the event happened
  std::string file;               // the allocation's user line (with_stack; snapshot frames)
  uint32_t line = 0;
  uint64_t tid = 0;
  uint64_t op_id = 0;  // innermost op/user span open on the thread (0: outside any)
};

enum class GpuKind : uint8_t { kernel, memcpy, memset, runtime, driver };
const char* gpu_kind_name(GpuKind k);

// One GPU activity record from CUPTI (kernel, memcpy, memset) or a CUDA API call on the
// host (runtime, driver). Times in ns since the window's start.
struct GpuEvent {
  GpuKind kind = GpuKind::kernel;
  std::string name;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  int device = 0;
  uint64_t stream = 0;
  uint32_t correlation = 0;
  uint64_t external_id = 0;  // the CpuSpan id that launched it (0: unknown)
  uint64_t tid = 0;          // runtime/driver: the host thread
  uint32_t cbid = 0;
  int grid[3] = {0, 0, 0};
  int block[3] = {0, 0, 0};
  int registers_per_thread = 0;
  int shared_memory = 0;
  uint64_t bytes = 0;  // memcpy / memset

  int64_t duration_ns() const { return end_ns - start_ns; }
};

// Live bytes per category on one device when the window opened (pre-existing tensors).
struct InitialMemory {
  memory::Device device;
  int64_t category_bytes[memory::kNumCategories] = {};
  size_t total_allocated = 0;
  size_t total_reserved = 0;
};

struct ProfileData {
  int64_t base_time_ns = 0;  // Unix epoch ns of the window's start
  int64_t duration_ns = 0;   // window length
  int64_t pid = 0;
  bool profile_memory = false, record_shapes = false, with_stack = false;
  std::vector<CpuSpan> spans;          // ordered by start, then depth
  std::vector<MemoryEvent> memory;     // ordered by seq
  std::vector<GpuEvent> gpu;           // ordered by start
  std::vector<InitialMemory> initial;  // one per device with an allocator
  std::vector<int> steps;              // ProfilerStep numbers recorded
  // Allocator snapshot (history on during the window) per device, when profile_memory.
  std::vector<std::pair<memory::Device, memory::SnapshotData>> snapshots;
};

}  // namespace tally::profiler
