// Snapshot export: SnapshotData as the pickle PyTorch's memory tools read
// (docs/memory-formats.md §1, Tally's choices in §7).
// Frames, expandable segments, categories and re-tags as written: docs/notes.md §6.
#include "memory/snapshot.h"

#include <fmt/format.h>

#include <cstring>
#include <ostream>
#include <stdexcept>
#include <string_view>

#include "base/atomic_file.h"
#include "base/enum_table.h"
#include "base/rank_path.h"
#include "memory/context.h"
#include "memory/host_memory.h"
#include "memory/pickle.h"

namespace tally::memory {

const char* block_state_name(BlockState s) {
  static constexpr const char* kNames[] = {"active_allocated", "active_pending_free", "inactive"};
  return base::enum_table<BlockState::inactive>(s, kNames, "inactive");
}

namespace {

// The frame's file name: the call site's path relative to the source root, or to the
// working directory (display_source_path); "??" when unknown.
std::string_view frame_source_path(const char* file) {
  const std::string_view p = display_source_path(file);
  return p.empty() ? "??" : p;
}

class SnapshotPickler {
 public:
  explicit SnapshotPickler(std::ostream& out) : w_(out) {}

  // `host`: the host allocator's snapshot, written as host_segments and host_traces.
  void write(const SnapshotData& snap, const SnapshotData* host = nullptr) {
    w_.begin_dict();
    w_.key("segments");
    w_.begin_list();
    for (const SegmentInfo& seg : snap.segments) segment(seg);
    w_.end_list();

    w_.key("device_traces");
    const int filler_device = unknown_filler_device(snap);
    w_.begin_list();
    for (size_t d = 0; d < snap.device_traces.size(); ++d) {
      const std::vector<TraceEntry>& trace = snap.device_traces[d];
      w_.begin_list();
      for (const TraceEntry& e : trace) trace_entry(e);
      if (static_cast<int>(d) == filler_device) {
        unknown_snapshot_entry(trace.back().time_us, active_bytes(snap, static_cast<int>(d)));
      }
      w_.end_list();
    }
    w_.end_list();

    if (host) {
      w_.key("host_segments");
      w_.begin_list();
      for (const SegmentInfo& seg : host->segments) segment(seg);
      w_.end_list();
      w_.key("host_traces");  // one flat list: the host is one allocator
      w_.begin_list();
      for (const std::vector<TraceEntry>& trace : host->device_traces)
        for (const TraceEntry& e : trace) trace_entry(e);
      w_.end_list();
    }

    w_.key("allocator_settings");
    allocator_settings(snap.config);

    w_.key("external_annotations");
    w_.begin_list();
    w_.end_list();
    w_.end_dict();
    w_.finish();
  }

 private:
  // The category a trace entry is written with.
  static Category entry_category(const TraceEntry& e) {
    switch (e.action) {
      case TraceAction::segment_alloc:
      case TraceAction::segment_free:
      case TraceAction::segment_map:
      case TraceAction::segment_unmap:
        return Category::unknown;
      default:
        return e.tag.category;
    }
  }

  // The device whose trace gets the `unknown` snapshot entry, or -1 if none is needed.
  static int unknown_filler_device(const SnapshotData& snap) {
    int first_nonempty = -1;
    for (size_t d = 0; d < snap.device_traces.size(); ++d) {
      for (const TraceEntry& e : snap.device_traces[d]) {
        if (e.action == TraceAction::retag && e.old_category == Category::unknown) return -1;
        if (entry_category(e) == Category::unknown) return -1;
      }
      if (first_nonempty < 0 && !snap.device_traces[d].empty())
        first_nonempty = static_cast<int>(d);
    }
    return first_nonempty;
  }

  static size_t active_bytes(const SnapshotData& snap, int device) {
    size_t total = 0;
    for (const SegmentInfo& s : snap.segments) {
      if (s.device == device) total += s.active_size;
    }
    return total;
  }

  void frames(const AllocTag& tag) {
    const std::string_view file = frame_source_path(tag.loc.file);
    std::string_view name = interned(tag.op);
    if (name.empty()) {
      name = tag.loc.function && *tag.loc.function ? tag.loc.function : "<no op>";
    }
    const std::string_view phase =
        tag.phase != 0 ? std::string_view(interned(tag.phase)) : std::string_view("none");
    // The key is what the frames show, so equal lists are always shared.
    const std::string memo =
        fmt::format("frames\x1f{}\x1f{}\x1f{}\x1f{}\x1f{}\x1f{}", static_cast<int>(tag.category),
                    tag.module, phase, tag.loc.line, file, name);
    if (w_.write_ref(memo)) return;

    w_.begin_list(memo);
    frame(name, file, tag.loc.line);
    if (tag.module != 0) frame(interned(tag.module), "module", 0);
    frame(fmt::format("phase {}", phase), fmt::format("category={}", category_name(tag.category)),
          0);
    w_.end_list();
  }

  // A dict entry with an integer value.
  template <std::integral T>
  void int_entry(std::string_view key, T value) {
    w_.key(key);
    w_.integer(value);
  }

  void empty_list() {
    w_.begin_list();
    w_.end_list();
  }

  void frame(std::string_view name, std::string_view filename, uint32_t line) {
    w_.begin_dict();
    w_.key("name");
    w_.memo_string(name);
    w_.key("filename");
    w_.memo_string(filename);
    int_entry("line", line);
    w_.end_dict();
  }

  void user_metadata(const AllocTag& tag, Category category) {
    w_.memo_string(fmt::format("category={} module={} op={} phase={}", category_name(category),
                               interned(tag.module), interned(tag.op), interned(tag.phase)));
  }

  void segment(const SegmentInfo& s) {
    w_.begin_dict();
    int_entry("device", s.device);
    int_entry("address", s.address);
    int_entry("total_size", s.total_size);
    int_entry("allocated_size", s.allocated_size);
    int_entry("active_size", s.active_size);
    int_entry("requested_size", s.requested_size);
    int_entry("stream", static_cast<int64_t>(s.stream));
    w_.key("segment_type");
    w_.memo_string(s.small ? "small" : "large");
    w_.key("segment_pool_id");
    w_.begin_tuple();
    w_.integer(0);
    w_.integer(static_cast<int64_t>(s.pool_id));
    w_.end_tuple();
    w_.key("is_expandable");
    w_.boolean(s.expandable);
    w_.key("frames");
    frames(s.tag);
    w_.key("blocks");
    w_.begin_list();
    for (const BlockInfo& b : s.blocks) block(b);
    w_.end_list();
    w_.end_dict();
  }

  void block(const BlockInfo& b) {
    w_.begin_dict();
    int_entry("address", b.address);
    int_entry("size", b.size);
    int_entry("requested_size", b.requested_size);
    w_.key("state");
    w_.memo_string(block_state_name(b.state));
    w_.key("frames");
    if (b.state == BlockState::inactive)
      empty_list();
    else
      frames(b.tag);
    w_.end_dict();
  }

  void trace_entry(const TraceEntry& e) {
    if (e.action == TraceAction::retag) {
      AllocTag old_tag = e.tag;
      old_tag.category = e.old_category;
      trace_entry_as(e, TraceAction::free_requested, old_tag, e.old_category);
      trace_entry_as(e, TraceAction::free_completed, old_tag, e.old_category);
      trace_entry_as(e, TraceAction::alloc, e.tag, e.tag.category);
      return;
    }
    trace_entry_as(e, e.action, e.tag, entry_category(e));
  }

  // One trace entry dict, keys in PyTorch's order plus `category`.
  void trace_entry_as(const TraceEntry& e, TraceAction action, const AllocTag& frames_tag,
                      Category category, bool with_frames = true) {
    w_.begin_dict();
    w_.key("action");
    w_.memo_string(trace_action_name(action));
    if (action == TraceAction::oom) {
      w_.key("device_free");
      w_.integer(e.device_free);
    } else {
      w_.key("addr");
      w_.integer(action == TraceAction::snapshot ? uint64_t{0} : e.addr);
    }
    int_entry("size", e.size);
    int_entry("stream", static_cast<int64_t>(e.stream));
    int_entry("time_us", e.time_us);
    w_.key("compile_context");
    w_.memo_string("N/A");
    w_.key("user_metadata");
    user_metadata(frames_tag, category);
    w_.key("frames");
    if (with_frames)
      frames(frames_tag);
    else
      empty_list();
    w_.key("category");
    w_.memo_string(category_name(category));
    w_.end_dict();
  }

  // The filler `snapshot` entry of category `unknown` (unknown_filler_device): no frames.
  void unknown_snapshot_entry(int64_t time_us, size_t size) {
    TraceEntry e;
    e.size = size;
    e.time_us = time_us;
    trace_entry_as(e, TraceAction::snapshot, AllocTag{}, Category::unknown, /*with_frames=*/false);
  }

  void allocator_settings(const AllocatorConfig& c) {
    w_.begin_dict();
    w_.key("PYTORCH_CUDA_ALLOC_CONF");
    w_.string(c.settings);
    w_.key("max_split_size");
    w_.integer(c.max_split_size_set() ? static_cast<int64_t>(c.max_split_size) : int64_t{-1});
    w_.key("garbage_collection_threshold");
    w_.floating(c.garbage_collection_threshold);
    w_.key("expandable_segments");
    w_.boolean(c.expandable_segments);
    w_.key("pinned_num_register_threads");
    w_.integer(1);
    w_.key("release_lock_on_cudamalloc");
    w_.boolean(false);
    w_.key("pinned_use_cuda_host_register");
    w_.boolean(false);
    w_.key("graph_capture_record_stream_reuse");
    w_.boolean(false);
    w_.key("roundup_power2_divisions");
    w_.begin_dict();
    for (size_t i = 0; i < kRoundupIntervals; ++i) {
      w_.key(fmt::format("{}", size_t{1} << i));  // interval start in MiB
      w_.integer(c.roundup_power2_divisions[i]);
    }
    w_.end_dict();
    w_.end_dict();
  }

  PickleWriter w_;
};

}  // namespace

void write_snapshot_pickle(const SnapshotData& snap, std::ostream& out) {
  SnapshotPickler(out).write(snap);
}

void write_snapshot_file(const SnapshotData& snap, const std::string& path_in) {
  write_snapshot_file(snap, nullptr, path_in);
}

void write_snapshot_file(const SnapshotData& snap, const SnapshotData* host,
                         const std::string& path_in) {
  const std::string path = base::per_rank_path(path_in);  // "x.rank1.pickle" in a multi-rank job
  base::write_file_atomic(
      path, [&](std::ostream& out) { SnapshotPickler(out).write(snap, host); },
      "write_snapshot_file");
}

}  // namespace tally::memory
