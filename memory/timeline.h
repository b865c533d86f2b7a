// Memory timeline: live bytes per category over time, rebuilt from the allocator's history
// (alloc, free_completed and re-tag entries), and written as PyTorch's memory-timeline JSON
// (`export_memory_timeline`'s `[times, sizes]`; see docs: column 0 is always 0, columns
// 1..8 are PyTorch's categories PARAMETER, OPTIMIZER_STATE, INPUT, TEMPORARY, ACTIVATION,
// GRADIENT, AUTOGRAD_DETAIL (always 0 in Tally), unknown, and Tally appends workspace,
// autocast_cache, communication and offloaded as columns 9..12).
//
// Blocks that were already live when the history started (parameters built before
// record_memory_history) are counted from the first sample: pass the allocator's current
// per-category bytes as `final_bytes` and the timeline solves for the starting state.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "memory/category.h"
#include "memory/history.h"

namespace tally::memory {

using CategoryBytes = std::array<int64_t, kNumCategories>;

struct MemoryTimeline {
  std::vector<int64_t> times_us;     // one sample per history entry that changed a category
  std::vector<CategoryBytes> bytes;  // live bytes per Tally category after that entry
  std::vector<StrId> phase;          // the phase of the entry ("forward", "backward", ...)
  std::vector<StrId> module;         // the module path of the entry
  std::vector<StrId> op;             // the op of the entry

  size_t size() const { return times_us.size(); }
  int64_t total(size_t i) const;  // all categories at sample i
  size_t peak_index() const;      // the sample with the largest total
};

// Rebuilds the timeline from `history` (oldest first). `final_bytes`: the allocator's live
// bytes per category now (DeviceStats::category_bytes[c].current); the starting state is
// final_bytes minus what the history adds up to. Without it, the start is all zero.
MemoryTimeline timeline_from_history(const std::vector<TraceEntry>& history,
                                     const CategoryBytes* final_bytes = nullptr);

// Writes PyTorch's `[times, sizes]` JSON (12 columns per row, see above). Throws
// std::runtime_error naming the path when it cannot be written.
void write_timeline_json(const MemoryTimeline& t, const std::string& path);

// The column of `c` in the JSON rows (1-based, PyTorch's order, Tally's extras last).
int timeline_column(Category c);
inline constexpr int kTimelineColumns = 13;

}  // namespace tally::memory
