// memory_summary(): PyTorch's table layout (torch.cuda.memory_summary) followed by
// Tally's per-category table, the fragmentation lines and, from a live allocator, a short
// fragmentation diagnosis.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "memory/category.h"
#include "memory/stats.h"

namespace tally::memory {

// The last request the allocator could not satisfy, as it stood then.
struct OomRecord {
  size_t requested = 0;  // the caller's bytes; 0: no out-of-memory so far
  size_t size = 0;       // the rounded block size
  bool small_pool = false;
  Category category = Category::unknown;
  size_t largest_free = 0;  // the largest cached free block of its pool and stream
  size_t free_bytes = 0;    // the cached free bytes of its pool
};

// A segment holding cached free bytes.
struct FreeSegment {
  uint64_t address = 0;
  size_t size = 0;
  bool small = false;
  bool expandable = false;
  size_t free_bytes = 0;
  size_t largest_free = 0;
  int free_blocks = 0;
  int live_blocks = 0;                               // allocated or pending-free
  std::array<int64_t, kNumCategories> live_bytes{};  // its live blocks' bytes by category
};

// What the diagnosis is read from: the allocator's free blocks and what lies around them
// (CachingAllocator::fragmentation(), taken under its lock).
struct FragmentationInfo {
  std::array<size_t, 3> free_bytes{};    // by PoolIndex: cached free bytes
  std::array<size_t, 3> largest_free{};  // by PoolIndex: the largest free block
  std::array<int, 3> free_segments{};    // by PoolIndex: segments holding free bytes
  // Free bytes in segments without a live block (empty_cache() gives them back).
  std::array<size_t, 3> releasable{};
  // Live bytes by category in the segments that hold free blocks between live ones: what
  // the free memory is interleaved with.
  std::array<int64_t, kNumCategories> interleaved{};
  std::vector<FreeSegment> segments;   // the segments holding the most free bytes, most first
  size_t largest_request = 0;          // the largest rounded request since the peaks were reset
  bool largest_request_small = false;  // ... and its pool
  OomRecord last_oom;
  size_t max_split_size = std::numeric_limits<size_t>::max();  // unlimited
  bool expandable_segments = false;
};

// `device_label` is e.g. "cuda:0" or "cpu"; `device_id` the ordinal in the title line. With
// `fragmentation`, the fragmentation lines are followed by the diagnosis: the largest free
// block against the failed (or else the largest) request, the pools and segments holding the
// free bytes, the categories interleaved with them, and the TALLY_ALLOC_CONF setting that
// would help (docs/memory-formats.md §3).
std::string format_memory_summary(const DeviceStats& stats, int device_id,
                                  const std::string& device_label, bool abbreviated = false,
                                  const FragmentationInfo* fragmentation = nullptr);

// The diagnosis alone, one line each (no frame): what memory_summary() prints in its box.
std::vector<std::string> fragmentation_diagnosis(const FragmentationInfo& info);

}  // namespace tally::memory
