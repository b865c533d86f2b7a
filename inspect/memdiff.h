// Snapshot diff: what changed in memory between two runs, read from their memory snapshots
// (Tally's, docs/memory-formats.md §1, or PyTorch's own `_dump_snapshot` pickles).
// What is compared and how runs are matched: docs/notes.md §10.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "inspect/unpickle.h"

namespace tally::inspect {

// What an allocation is attributed to. Empty fields are unknown (PyTorch's snapshots have no
// category, module, op or phase; Tally's have no frame).
struct AllocKey {
  std::string category;
  std::string module;  // dotted module path, "layer1.0.conv1"
  std::string op;
  std::string phase;
  std::string frame;  // "file.py:line:function" or "at::_ops::mm::call" (PyTorch's snapshots)
  auto operator<=>(const AllocKey&) const = default;
};

struct KeyStats {
  int64_t bytes_at_peak = 0;    // live when allocated memory peaked
  int64_t allocations = 0;      // alloc entries in the trace (re-tags excluded)
  int64_t allocated_bytes = 0;  // their bytes
};

struct SnapshotSummary {
  std::string path;             // the file (or the name given to summarize_snapshot)
  bool tally = false;           // Tally's snapshot (entries carry categories), else PyTorch's
  int device = 0;               // the device ordinal summarised
  size_t entries = 0;           // trace entries of that device
  bool has_time = true;         // entries carry time_us; else the timeline's x is the entry index
  int64_t start_allocated = 0;  // live when the trace starts
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;  // segments replayed the same way
  int64_t allocations = 0;
  double peak_t = 0;            // when the peak was (last) reached: ms since the first entry
  std::string peak_reached_by;  // the key of the entry that reached the peak, as text
  // The allocated-bytes timeline: one sample at the start, then one per alloc / free.
  std::vector<double> t;  // ms since the first entry (has_time) or entry index
  std::vector<int64_t> allocated;
  std::map<AllocKey, KeyStats> keys;
};

// Reads a snapshot file and summarises `device` (-1: the one device with a trace; an error
// when several have one). Throws as described above.
SnapshotSummary read_snapshot_summary(const std::string& path, int device = -1);
// The same for an unpickled snapshot; `name` stands for the file in errors.
SnapshotSummary summarize_snapshot(const PickleValue& snapshot, std::string_view name,
                                   int device = -1);

struct DiffRow {
  std::string name;                  // "" when the key has no value in this dimension
  int64_t a_bytes = 0, b_bytes = 0;  // at each run's peak
  int64_t a_allocations = 0, b_allocations = 0;
  int64_t bytes_delta() const { return b_bytes - a_bytes; }
  int64_t allocations_delta() const { return b_allocations - a_allocations; }
};

struct DiffSection {
  std::string dimension;      // "category", "phase", "module", "op", "frame" or "key"
  std::vector<DiffRow> rows;  // largest |bytes delta| first
};

struct SnapshotDiff {
  SnapshotSummary a, b;
  // The dimensions either snapshot has values in, in the order above ("key" for Tally's).
  std::vector<DiffSection> sections;
  const DiffSection* section(std::string_view dimension) const;
};

struct DiffOptions {
  // Snapshots of different device ordinals are an error unless this is set: for runs known to
  // stand for the same device, such as dry runs (each replays on a meta device of its own).
  bool any_device = false;
};

// A vs B. Throws std::invalid_argument naming both files when they are of different devices.
SnapshotDiff diff_snapshots(const SnapshotSummary& a, const SnapshotSummary& b,
                            const DiffOptions& options = {});

// The text table: totals, then each section's `top` rows (0: all).
std::string format_snapshot_diff(const SnapshotDiff& d, size_t top = 20);
// Every number of the diff as JSON (all rows; bytes as integers).
std::string snapshot_diff_json(const SnapshotDiff& d);
// The HTML page (each section's `top` rows; 0: all). Written atomically; throws
// std::runtime_error naming the path when it cannot be written.
void write_snapshot_diff_html(const std::string& path, const SnapshotDiff& d, size_t top = 50);
// snapshot_diff_json written atomically to `path`.
void write_snapshot_diff_json(const std::string& path, const SnapshotDiff& d);

// "activation layer1.0.conv1 conv2d forward": the key's non-empty fields, for tables.
std::string alloc_key_str(const AllocKey& k);

}  // namespace tally::inspect
