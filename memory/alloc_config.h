// Allocator settings, parsed from TALLY_ALLOC_CONF with PYTORCH_CUDA_ALLOC_CONF's syntax:
//   max_split_size_mb:128,roundup_power2_divisions:4,garbage_collection_threshold:0.8
// roundup_power2_divisions also takes the per-interval form [64:8,256:4,>:1] (MiB).
// expandable_segments:True grows one segment per stream and pool instead of allocating new
// ones (PyTorch's meaning; memory/caching_allocator.h). reclaim_on_growth:True (Tally's own,
// with expandable segments only) unmaps free pages before mapping new ones for a request no
// free block holds: reserved stops growing from fragmentation, at the price of a device
// synchronisation whenever that happens.
#pragma once

#include <array>
#include <cstddef>
#include <limits>
#include <string>
#include <string_view>

namespace tally::memory {

inline constexpr size_t kMiB = size_t{1} << 20;
inline constexpr size_t kRoundupIntervals = 16;
inline constexpr size_t kMaxRoundupDivisions = size_t{1} << 30;  // roundup_power2_divisions

struct AllocatorConfig {
  size_t max_split_size = std::numeric_limits<size_t>::max();  // unlimited
  size_t max_non_split_rounding = 20 * kMiB;
  size_t large_segment_size = 20 * kMiB;
  double garbage_collection_threshold = 0.0;  // 0 = off
  bool expandable_segments = false;
  bool reclaim_on_growth = false;  // needs expandable_segments
  // Index i covers sizes in [2^(20+i), 2^(21+i)) bytes; 0 = no power-of-two rounding.
  std::array<size_t, kRoundupIntervals> roundup_power2_divisions{};
  std::string oom_snapshot_path;  // Tally: where to dump a snapshot on OOM ("" = no dump)
  std::string settings;           // the string this was parsed from

  bool max_split_size_set() const { return max_split_size != std::numeric_limits<size_t>::max(); }
  // Divisions for a request of `size` bytes.
  size_t divisions_for(size_t size) const;

  // Throws std::invalid_argument naming the key (and the value) on malformed input, and on a
  // key given twice.
  static AllocatorConfig parse(std::string_view conf);
  // TALLY_ALLOC_CONF from the environment, or defaults.
  static AllocatorConfig from_env();
};

}  // namespace tally::memory
