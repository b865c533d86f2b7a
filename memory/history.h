// The allocator's history: a ring buffer of trace entries (PyTorch's TraceEntry actions
// plus Tally's re-tag), each with time, stream and the logical stack (category, module,
// op, phase, C++ source location). Recording copies a fixed-size struct: no unwinding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "memory/context.h"
#include "memory/provider.h"

namespace tally::memory {

enum class TraceAction : uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_alloc,
  segment_free,
  snapshot,
  oom,
  retag,          // Tally: a live block changed category (e.g. saved for backward -> activation)
  segment_map,    // pages mapped into an expandable segment (addr, size: the pages)
  segment_unmap,  // pages of an expandable segment given back
};

const char* trace_action_name(TraceAction a);

struct TraceEntry {
  TraceAction action = TraceAction::alloc;
  uint64_t addr = 0;
  size_t size = 0;
  StreamId stream = 0;
  int64_t time_us = 0;                        // microseconds since the Unix epoch
  AllocTag tag;                               // for retag: the new tag
  Category old_category = Category::unknown;  // retag only
  size_t device_free = 0;                     // oom only
};

// Microseconds since the Unix epoch.
int64_t now_us();

class TraceRing {
 public:
  void set_capacity(size_t max_entries);
  size_t capacity() const { return capacity_; }
  void clear();
  void push(const TraceEntry& e);
  size_t size() const { return count_; }
  // Entries oldest first.
  std::vector<TraceEntry> entries() const;
  // Total pushed since clear(), including those the ring dropped.
  uint64_t total_pushed() const { return pushed_; }

 private:
  std::vector<TraceEntry> buf_;
  size_t capacity_ = 0;
  size_t head_ = 0;  // next write position
  size_t count_ = 0;
  uint64_t pushed_ = 0;
};

}  // namespace tally::memory
