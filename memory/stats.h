// Allocator statistics with PyTorch's memory_stats() names and meanings
// (c10 DeviceStats): every counter has current, peak, allocated (cumulative +) and
// freed (cumulative -), per pool (all, small_pool, large_pool). Tally adds current and
// peak bytes per category.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "memory/category.h"

namespace tally::memory {

struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;

  void increase(int64_t n) {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void decrease(int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_accumulated() { allocated = freed = 0; }
  void reset_peak() { peak = current; }
};

enum PoolIndex : int { kAllPools = 0, kSmallPool = 1, kLargePool = 2 };
using StatArray = std::array<Stat, 3>;

inline void stat_increase(StatArray& s, bool small, int64_t n) {
  s[kAllPools].increase(n);
  s[small ? kSmallPool : kLargePool].increase(n);
}
inline void stat_decrease(StatArray& s, bool small, int64_t n) {
  s[kAllPools].decrease(n);
  s[small ? kSmallPool : kLargePool].decrease(n);
}

struct DeviceStats {
  // counts
  StatArray allocation, segment, active, inactive_split;
  // bytes
  StatArray allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;
  int64_t num_alloc_retries = 0;
  int64_t num_ooms = 0;
  int64_t num_sync_all_streams = 0;
  int64_t num_device_alloc = 0;
  int64_t num_device_free = 0;
  Stat oversize_allocations;
  Stat oversize_segments;
  int64_t max_split_size = -1;  // -1 = unlimited

  // Tally: allocated (rounded) bytes and block counts by category.
  std::array<Stat, kNumCategories> category_bytes;
  std::array<Stat, kNumCategories> category_blocks;
  // Bytes per category at the moment allocated_bytes.all reached its peak.
  std::array<int64_t, kNumCategories> category_at_peak{};

  Stat& cat_bytes(Category c) { return category_bytes[static_cast<size_t>(c)]; }
  const Stat& cat_bytes(Category c) const { return category_bytes[static_cast<size_t>(c)]; }

  void reset_peak();
  void reset_accumulated();

  // Call after an allocation: remembers the category split when a new peak is reached.
  void note_peak() {
    if (allocated_bytes[0].current == allocated_bytes[0].peak)
      for (size_t i = 0; i < category_at_peak.size(); ++i)
        category_at_peak[i] = category_bytes[i].current;
  }

  // Flat dict sorted by key, PyTorch's key names ("allocated_bytes.all.current", ...),
  // followed by Tally's "category.<name>.{current,peak,at_peak}" keys.
  std::map<std::string, int64_t> to_map() const;
};

}  // namespace tally::memory
