#include "memory/history.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>

#include "base/enum_table.h"

namespace tally::memory {

const char* trace_action_name(TraceAction a) {
  static constexpr const char* kNames[] = {
      "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "snapshot",
      "oom",   "retag",          "segment_map",    "segment_unmap"};
  return base::enum_table<TraceAction::segment_unmap>(a, kNames, "?");
}

int64_t now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}

namespace {
// Room reserved when recording starts: address space only (pages are touched as entries
// come), so that the buffer does not grow by copying inside the allocations it records.
constexpr size_t kReserveEntries = size_t{1} << 17;
}  // namespace

void TraceRing::set_capacity(size_t max_entries) {
  // Everything that can throw (the copy) happens before the ring changes.
  std::vector<TraceEntry> kept = entries();
  if (kept.size() > max_entries)
    kept.erase(kept.begin(), kept.end() - static_cast<std::ptrdiff_t>(max_entries));
  kept.reserve(std::min(max_entries, kReserveEntries));
  buf_ = std::move(kept);
  capacity_ = max_entries;
  oldest_ = 0;
}

void TraceRing::clear() {
  buf_.clear();
  oldest_ = 0;
  pushed_ = 0;
}

void TraceRing::push(const TraceEntry& e) noexcept {
  ++pushed_;
  if (buf_.size() < capacity_) {
    try {
      buf_.push_back(e);
      return;
    } catch (const std::exception&) {  // bad_alloc
      // No host memory to grow into: the ring keeps the size it has and drops the oldest
      // from now on (the allocation being recorded must not fail for its history).
      capacity_ = buf_.size();
    }
  }
  if (capacity_ == 0) return;
  buf_[oldest_] = e;
  oldest_ = oldest_ + 1 == capacity_ ? 0 : oldest_ + 1;
}

std::vector<TraceEntry> TraceRing::entries() const {
  std::vector<TraceEntry> out;
  out.reserve(buf_.size());
  const auto split = buf_.begin() + static_cast<std::ptrdiff_t>(oldest_);
  out.insert(out.end(), split, buf_.end());
  out.insert(out.end(), buf_.begin(), split);
  return out;
}

}  // namespace tally::memory
