#include "memory/history.h"

#include <chrono>

#include "memory/enum_table.h"

namespace tally::memory {

const char* trace_action_name(TraceAction a) {
  static constexpr const char* kNames[] = {
      "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "snapshot",
      "oom",   "retag",          "segment_map",    "segment_unmap"};
  return enum_table<TraceAction::segment_unmap>(a, kNames, "?");
}

int64_t now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}

void TraceRing::set_capacity(size_t max_entries) {
  std::vector<TraceEntry> old = entries();
  capacity_ = max_entries;
  buf_.assign(capacity_, TraceEntry{});
  head_ = count_ = 0;
  const size_t keep = old.size() > capacity_ ? capacity_ : old.size();
  for (size_t i = old.size() - keep; i < old.size(); ++i) {
    buf_[head_] = old[i];
    head_ = (head_ + 1) % (capacity_ ? capacity_ : 1);
    ++count_;
  }
}

void TraceRing::clear() {
  head_ = count_ = 0;
  pushed_ = 0;
}

void TraceRing::push(const TraceEntry& e) {
  ++pushed_;
  if (capacity_ == 0) return;
  buf_[head_] = e;
  head_ = head_ + 1 == capacity_ ? 0 : head_ + 1;
  if (count_ < capacity_) ++count_;
}

std::vector<TraceEntry> TraceRing::entries() const {
  std::vector<TraceEntry> out;
  out.reserve(count_);
  const size_t start = (head_ + capacity_ - count_) % (capacity_ ? capacity_ : 1);
  for (size_t i = 0; i < count_; ++i) out.push_back(buf_[(start + i) % capacity_]);
  return out;
}

}  // namespace tally::memory
