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

// The newest `capacity` entries. The buffer grows as entries come, up to the capacity, and
// then overwrites the oldest (PyTorch's alloc_trace): a capacity is a bound, not memory set
// aside, so record_memory_history(true, SIZE_MAX) keeps everything. set_capacity reserves
// room for up to 131,072 entries (12 MiB of address space; pages are touched as entries come)
// so that a recording does not copy the buffer as it grows.
class TraceRing {
 public:
  // Keeps the newest min(size(), max_entries) entries. Strong exception guarantee.
  void set_capacity(size_t max_entries);
  size_t capacity() const { return capacity_; }
  void clear();
  // Never throws: where the buffer cannot grow, its size becomes the capacity.
  void push(const TraceEntry& e) noexcept;
  size_t size() const { return buf_.size(); }
  // Entries oldest first.
  std::vector<TraceEntry> entries() const;
  // Total pushed since clear(), including those the ring dropped.
  uint64_t total_pushed() const { return pushed_; }

 private:
  std::vector<TraceEntry> buf_;  // size() <= capacity_
  size_t capacity_ = 0;
  size_t oldest_ = 0;  // once full: the oldest entry, which the next push overwrites
  uint64_t pushed_ = 0;
};

}  // namespace tally::memory
