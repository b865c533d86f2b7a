// A memory snapshot: the allocator's segments and blocks plus its trace history, and its
// export as the pickle PyTorch's memory_viz reads unchanged (see docs/memory-formats.md).
//
// Re-tags: Tally's history records a live block changing category (TraceAction::retag).
// In the pickle a re-tag is written as `free_requested` + `free_completed` + `alloc` at the
// same address, size and time, the alloc carrying the new category: PyTorch's viewer ends
// the old category's interval and starts the new one, and its Allocator State History
// (which replays backwards from the segments) never sees a completed free without its
// request. The live state it replays is the same as without re-tags.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "memory/alloc_config.h"
#include "memory/history.h"

namespace tally::memory {

enum class BlockState : uint8_t { active_allocated, active_pending_free, inactive };
const char* block_state_name(BlockState s);

struct BlockInfo {
  uint64_t address = 0;
  size_t size = 0;
  size_t requested_size = 0;
  BlockState state = BlockState::inactive;
  AllocTag tag;  // meaningful for active blocks
};

struct SegmentInfo {
  int device = 0;
  uint64_t address = 0;
  size_t total_size = 0;
  size_t allocated_size = 0;
  size_t active_size = 0;
  size_t requested_size = 0;
  StreamId stream = 0;
  bool small = false;    // segment_type "small" / "large"
  uint64_t pool_id = 0;  // segment_pool_id (0, pool_id): a graph-private pool's, else (0, 0)
  // is_expandable: one run of mapped pages of an expandable segment (PyTorch writes each
  // contiguous mapped range of one as a segment of its own).
  bool expandable = false;
  AllocTag tag;                   // context at segment creation
  std::vector<BlockInfo> blocks;  // address order, tiling the segment
};

struct SnapshotData {
  std::vector<SegmentInfo> segments;
  // Index = device ordinal; oldest first.
  std::vector<std::vector<TraceEntry>> device_traces;
  AllocatorConfig config;
};

// Encode as a protocol-2 pickle of dicts/lists (memoized strings and frame lists).
void write_snapshot_pickle(const SnapshotData& snap, std::ostream& out);
// Write to `path` (per_rank_path applied) atomically (base/atomic_file.h): a failed write
// leaves an existing file intact. Throws std::runtime_error naming the path on I/O failure.
void write_snapshot_file(const SnapshotData& snap, const std::string& path);

}  // namespace tally::memory
