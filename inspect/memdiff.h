// Snapshot diff: what changed in memory between two runs, read from their memory snapshots
// (Tally's, docs/memory-formats.md §1, or PyTorch's own `_dump_snapshot` pickles).
//
// Reading. read_snapshot_summary() unpickles a snapshot (inspect/unpickle.h) and replays one
// device's trace (device_traces: alloc, free_completed, segment events) into the allocated-bytes
// timeline and its peak. Blocks live before the trace began count from its start: those the
// trace frees without having allocated them, and the active blocks of the snapshot's segments
// the trace never allocated (a model's parameters when history was turned on after building
// it). Bytes are the entries' `size` (requested bytes, as the trace records them). Every
// allocation gets a key:
//   - Tally's snapshots: category, module path, op and phase, from the entry's `category` and
//     `user_metadata` ("category=… module=… op=… phase=…"; for blocks, from their frames);
//   - PyTorch's (no categories): the innermost frame outside torch, "file.py:line:function"
//     (the first Python frame not under torch/, else the first Python frame; a native-only
//     stack, as autograd's thread has, by its outermost ATen op, "at::_ops::mm::call"; else
//     the first named native frame).
// Tally writes a re-tag as free_requested + free_completed + alloc of one block at one time
// (snapshot.h); the summary takes that triple as a re-tag: the block changes key, no
// allocation is counted and the timeline does not dip.
//
// Diffing. diff_snapshots() aligns the keys of both runs by name, per dimension: category,
// phase, module (by dotted path), op, frame, and the whole key; each row has the bytes live at
// each run's own peak, the allocations over each trace, and the deltas (B - A). Rows are sorted
// by the size of the bytes delta. Two snapshots of different devices are an error naming both.
//
// Outputs: a text table (format_snapshot_diff), JSON (snapshot_diff_json) and a self-contained
// HTML page (write_snapshot_diff_html: both allocated-memory timelines overlaid in inline SVG,
// hover readout, then the tables; no network requests).
//
// Errors: std::runtime_error naming the file and what is wrong ("b.pickle: not a memory
// snapshot: the pickle holds an int, expected a dict with 'segments' and 'device_traces'",
// "a.pickle: device_traces[0][17]: an 'alloc' entry without 'addr'"); unpickling errors name
// the byte offset and the opcode (UnpickleError).
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
