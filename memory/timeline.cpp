#include "memory/timeline.h"

#include <fmt/format.h>

#include <stdexcept>

#include "base/atomic_file.h"
#include "base/enum_table.h"
#include "base/rank_path.h"

namespace tally::memory {

int timeline_column(Category c) {
  // By Category's order: parameter, gradient, optimizer_state, activation, input, temporary,
  // workspace, autocast_cache, communication, offloaded, unknown.
  static constexpr int kColumns[] = {1, 6, 2, 5, 3, 4, 9, 10, 11, 12, 8};
  return base::enum_table<Category::unknown>(c, kColumns, 8);
}

int64_t MemoryTimeline::total(size_t i) const {
  int64_t s = 0;
  for (int64_t b : bytes[i]) s += b;
  return s;
}

size_t MemoryTimeline::peak_index() const {
  size_t best = 0;
  int64_t best_total = -1;
  for (size_t i = 0; i < size(); ++i) {
    const int64_t t = total(i);
    if (t > best_total) {
      best_total = t;
      best = i;
    }
  }
  return best;
}

namespace {
size_t idx(Category c) {
  return static_cast<size_t>(c);
}

// Applies one history entry to the bytes per category; false for an entry that does not
// change them (segment events, requested frees, snapshots, OOMs).
bool apply(const TraceEntry& e, CategoryBytes& bytes) {
  const int64_t n = static_cast<int64_t>(e.size);
  switch (e.action) {
    case TraceAction::alloc:
      bytes[idx(e.tag.category)] += n;
      return true;
    case TraceAction::free_completed:
      bytes[idx(e.tag.category)] -= n;
      return true;
    case TraceAction::retag:
      bytes[idx(e.old_category)] -= n;
      bytes[idx(e.tag.category)] += n;
      return true;
    default:
      return false;
  }
}
}  // namespace

MemoryTimeline timeline_from_history(const std::vector<TraceEntry>& history,
                                     const CategoryBytes* final_bytes) {
  // Pass 1: the net change per category, to solve for the starting state.
  CategoryBytes net{};
  for (const TraceEntry& e : history) apply(e, net);
  CategoryBytes cur{};
  if (final_bytes)
    for (size_t c = 0; c < cur.size(); ++c) cur[c] = (*final_bytes)[c] - net[c];

  MemoryTimeline t;
  auto sample = [&](const TraceEntry& e) {
    t.times_us.push_back(e.time_us);
    t.bytes.push_back(cur);
    t.phase.push_back(e.tag.phase);
    t.module.push_back(e.tag.module);
    t.op.push_back(e.tag.op);
  };
  if (!history.empty()) {
    TraceEntry first = history.front();
    first.tag = AllocTag{};
    sample(first);  // the starting state
  }
  for (const TraceEntry& e : history)
    if (apply(e, cur)) sample(e);
  return t;
}

void write_timeline_json(const MemoryTimeline& t, const std::string& path_in) {
  const std::string path = base::per_rank_path(path_in);  // "x.rank1.json" in a multi-rank job
  std::string out = "[[";
  for (size_t i = 0; i < t.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(t.times_us[i]);
  }
  out += "], [";
  for (size_t i = 0; i < t.size(); ++i) {
    std::array<int64_t, kTimelineColumns> row{};
    for (Category c : kAllCategories)
      row[static_cast<size_t>(timeline_column(c))] += t.bytes[i][idx(c)];
    out += i ? ", [" : "[";
    for (size_t k = 0; k < row.size(); ++k) {
      if (k) out += ", ";
      out += std::to_string(row[k]);
    }
    out += "]";
  }
  out += "]]";
  base::write_file_atomic(path, out, "write_timeline_json");
}

}  // namespace tally::memory
