// Snapshot diff (memdiff.h): the snapshot reader (trace replay, keys, peak attribution), the
// diff, and its text, JSON and HTML outputs.
#include "inspect/memdiff.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "base/atomic_file.h"
#include "base/checked.h"
#include "base/json.h"
#include "inspect/svg_chart.h"
#include "memory/category.h"

namespace tally::inspect {

using memory::Category;
using memory::category_color;

namespace {

bool starts_with(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// ---- reading

enum class Action : uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_add,     // segment_alloc, segment_map
  segment_remove,  // segment_free, segment_unmap
  other,           // snapshot, oom, and actions this reader does not know
};

Action parse_action(std::string_view a) {
  if (a == "alloc") return Action::alloc;
  if (a == "free_requested") return Action::free_requested;
  if (a == "free_completed") return Action::free_completed;
  if (a == "segment_alloc" || a == "segment_map") return Action::segment_add;
  if (a == "segment_free" || a == "segment_unmap") return Action::segment_remove;
  return Action::other;
}

// One trace entry as read.
struct RawEntry {
  Action action = Action::other;
  bool tally = false;  // carried a category
  int64_t addr = 0;
  int64_t size = 0;
  int64_t time_us = 0;
  uint32_t key = 0;
};

enum class EventKind : uint8_t { alloc, free, retag, segment_add, segment_remove };

// The trace as the replay sees it: re-tag triples folded into one event.
struct Event {
  EventKind kind;
  int64_t addr;
  int64_t size;
  double t;
  uint32_t key;      // alloc, free: the block's key; retag: the new key
  uint32_t old_key;  // retag: the key before
};

struct LiveBlock {
  int64_t size;
  uint32_t key;
};

// Key fields longer than this are cut: a name is for reading, and a file cannot make the
// reader compare megabyte strings per entry.
constexpr size_t kMaxKeyField = 1024;

std::string clip(std::string_view s) {
  return std::string(s.substr(0, kMaxKeyField));
}

// The innermost frame that says where an allocation came from in PyTorch's snapshots.
bool torch_internal(std::string_view file) {
  return starts_with(file, "torch/") || file.find("/torch/") != std::string_view::npos;
}

class SnapshotReader {
 public:
  explicit SnapshotReader(std::string_view name)
      : name_(name), summing_(fmt::format("{}: summing the trace's bytes", name)) {}

  SnapshotSummary run(const PickleValue& snap, int device) {
    SnapshotSummary s;
    s.path = std::string(name_);
    if (!snap.is_dict())
      fail(fmt::format(
          "not a memory snapshot: the pickle holds {}, expected a dict with 'segments' and "
          "'device_traces'",
          snap.a_type_name()));
    const PickleDict& top = snap.as_dict();
    const PickleValue* segments = top.find("segments");
    const PickleValue* traces = top.find("device_traces");
    if (!segments || !traces) {
      std::string keys;
      for (size_t i = 0; i < top.items.size() && i < 8; ++i)
        keys += fmt::format("{}'{}'", i ? ", " : "", top.items[i].first);
      if (top.items.size() > 8) keys += ", ...";
      fail(fmt::format("not a memory snapshot: the dict has no '{}' (its keys: {})",
                       !segments ? "segments" : "device_traces", keys.empty() ? "none" : keys));
    }
    if (!segments->is_list())
      fail(fmt::format("'segments' is {}, expected a list", segments->a_type_name()));
    if (!traces->is_list())
      fail(fmt::format("'device_traces' is {}, expected a list", traces->a_type_name()));
    const std::vector<PickleValue>& per_device = traces->as_list();
    std::vector<int> with_history;
    for (size_t d = 0; d < per_device.size(); ++d) {
      if (!per_device[d].is_list())
        fail(fmt::format("device_traces[{}] is {}, expected a list", d,
                         per_device[d].a_type_name()));
      if (!per_device[d].as_list().empty()) with_history.push_back(static_cast<int>(d));
    }
    const std::string devices = fmt::format("{}", fmt::join(with_history, ", "));
    if (device < 0) {
      if (with_history.empty())
        fail(
            "no allocation history: every device trace is empty (record it with "
            "record_memory_history, or torch.cuda.memory._record_memory_history, before taking "
            "the snapshot)");
      if (with_history.size() > 1)
        fail(fmt::format("allocation history on devices {}: choose one (--device)", devices));
      device = with_history.front();
    } else if (static_cast<size_t>(device) >= per_device.size() ||
               per_device[static_cast<size_t>(device)].as_list().empty()) {
      fail(fmt::format("no allocation history on device {} ({})", device,
                       with_history.empty() ? std::string("no device has any")
                                            : "history on devices " + devices));
    }
    s.device = device;
    const std::vector<PickleValue>& trace = per_device[static_cast<size_t>(device)].as_list();
    s.entries = trace.size();

    // 1. The entries, then the events (re-tags folded).
    std::vector<RawEntry> raw(trace.size());
    bool has_time = true;
    for (size_t i = 0; i < trace.size(); ++i) raw[i] = read_entry(trace[i], device, i, &has_time);
    s.has_time = has_time;
    // Times in double: µs since the epoch are exact below 2^53, and garbage cannot overflow.
    const double t0 = has_time ? static_cast<double>(raw.front().time_us) : 0.0;
    auto time_of = [&](size_t i) {
      return has_time ? (static_cast<double>(raw[i].time_us) - t0) / 1000.0
                      : static_cast<double>(i);
    };
    std::vector<Event> events;
    events.reserve(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      const RawEntry& r = raw[i];
      switch (r.action) {
        case Action::free_requested:
          if (r.tally && i + 2 < raw.size() && is_retag(r, raw[i + 1], raw[i + 2])) {
            events.push_back(
                {EventKind::retag, r.addr, r.size, time_of(i), raw[i + 2].key, raw[i + 1].key});
            i += 2;
          }
          break;
        case Action::alloc:
          events.push_back({EventKind::alloc, r.addr, r.size, time_of(i), r.key, r.key});
          break;
        case Action::free_completed:
          events.push_back({EventKind::free, r.addr, r.size, time_of(i), r.key, r.key});
          break;
        case Action::segment_add:
          events.push_back({EventKind::segment_add, r.addr, r.size, time_of(i), 0, 0});
          break;
        case Action::segment_remove:
          events.push_back({EventKind::segment_remove, r.addr, r.size, time_of(i), 0, 0});
          break;
        case Action::other:
          break;
      }
      if (r.tally) s.tally = true;
    }

    // 2. What was live before the trace: freed or re-tagged without an alloc, or active in
    // the segments at the end without one.
    std::unordered_map<int64_t, LiveBlock> live, initial;
    for (const Event& e : events) {
      switch (e.kind) {
        case EventKind::alloc:
          live[e.addr] = {e.size, e.key};
          break;
        case EventKind::free:
          if (live.erase(e.addr) == 0) initial.try_emplace(e.addr, LiveBlock{e.size, e.key});
          break;
        case EventKind::retag:
          if (!live.count(e.addr)) initial.try_emplace(e.addr, LiveBlock{e.size, e.old_key});
          live[e.addr] = {e.size, e.key};
          break;
        default:
          break;
      }
    }
    int64_t reserved_end = 0;
    tally_layout_ = s.tally;  // the blocks' frames are Tally's too
    read_segments(segments->as_list(), device, live, initial, &reserved_end);

    // 3. The timeline and its peak.
    int64_t total = 0;
    for (const auto& [addr, b] : initial) total = base::checked_add(total, b.size, summing_);
    s.start_allocated = total;
    s.t.push_back(0);
    s.allocated.push_back(total);
    s.peak_allocated = total;
    ptrdiff_t peak_event = -1;
    live = initial;
    int64_t net_reserved = 0, reserved_max = 0;
    for (size_t i = 0; i < events.size(); ++i) {
      const Event& e = events[i];
      switch (e.kind) {
        case EventKind::alloc: {
          auto [it, fresh] = live.try_emplace(e.addr, LiveBlock{e.size, e.key});
          if (!fresh) {  // allocated again without a free: the old block is gone
            total -= it->second.size;
            it->second = {e.size, e.key};
          }
          total = base::checked_add(total, e.size, summing_);
          s.allocations += 1;
          KeyStats& k = s.keys[keys_[e.key]];
          k.allocations += 1;
          k.allocated_bytes = base::checked_add(k.allocated_bytes, e.size, summing_);
          break;
        }
        case EventKind::free: {
          auto it = live.find(e.addr);
          if (it == live.end()) continue;  // freed twice: counted once
          total -= it->second.size;
          live.erase(it);
          break;
        }
        case EventKind::retag:
          if (auto it = live.find(e.addr); it != live.end()) it->second.key = e.key;
          continue;
        case EventKind::segment_add:
          net_reserved = base::checked_add(net_reserved, e.size, summing_);
          reserved_max = std::max(reserved_max, net_reserved);
          continue;
        case EventKind::segment_remove:
          net_reserved = base::checked_add(net_reserved, -e.size, summing_);
          continue;
      }
      s.t.push_back(e.t);
      s.allocated.push_back(total);
      if (total >= s.peak_allocated) {
        s.peak_allocated = total;
        s.peak_t = e.t;
        peak_event = static_cast<ptrdiff_t>(i);
      }
    }
    // Reserved: the segments at the end less what the trace added gives the start.
    const int64_t reserved_start = std::max<int64_t>(0, reserved_end - net_reserved);
    s.peak_reserved = base::checked_add(reserved_start, reserved_max, summing_);
    s.peak_reserved = std::max(s.peak_reserved, s.peak_allocated);

    // 4. Who held the bytes at the peak.
    live = initial;
    for (ptrdiff_t i = 0; i <= peak_event; ++i) {
      const Event& e = events[static_cast<size_t>(i)];
      if (e.kind == EventKind::alloc)
        live[e.addr] = {e.size, e.key};
      else if (e.kind == EventKind::free)
        live.erase(e.addr);
      else if (e.kind == EventKind::retag)
        if (auto it = live.find(e.addr); it != live.end()) it->second.key = e.key;
    }
    for (const auto& [addr, b] : live) s.keys[keys_[b.key]].bytes_at_peak += b.size;
    s.peak_reached_by = peak_event < 0
                            ? std::string("(the start)")
                            : alloc_key_str(keys_[events[static_cast<size_t>(peak_event)].key]);
    return s;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(fmt::format("{}: {}", name_, what));
  }

  static bool is_retag(const RawEntry& req, const RawEntry& done, const RawEntry& alloc) {
    return done.action == Action::free_completed && alloc.action == Action::alloc && done.tally &&
           alloc.tally && req.addr == done.addr && req.addr == alloc.addr &&
           req.size == done.size && req.size == alloc.size && req.time_us == done.time_us &&
           req.time_us == alloc.time_us;
  }

  uint32_t intern(AllocKey k) {
    auto [it, fresh] = key_ids_.try_emplace(std::move(k), static_cast<uint32_t>(keys_.size()));
    if (fresh) keys_.push_back(it->first);
    return it->second;
  }

  // A required field of a dict; `where` is built only on error.
  template <class Where>
  const PickleValue& field(const PickleDict& d, std::string_view key, Where&& where) const {
    const PickleValue* v = d.find(key);
    if (!v) fail(fmt::format("{}: no '{}'", where(), key));
    return *v;
  }

  template <class Where>
  int64_t int_field(const PickleDict& d, std::string_view key, Where&& where,
                    bool non_negative) const {
    const PickleValue& v = field(d, key, where);
    if (!v.is_int())
      fail(fmt::format("{}: '{}' is {}, expected an int", where(), key, v.a_type_name()));
    if (non_negative && v.as_int() < 0)
      fail(fmt::format("{}: '{}' is negative ({})", where(), key, v.as_int()));
    return v.as_int();
  }

  RawEntry read_entry(const PickleValue& v, int device, size_t i, bool* has_time) {
    auto where = [&] { return fmt::format("device_traces[{}][{}]", device, i); };
    if (!v.is_dict()) fail(fmt::format("{}: {}, expected a dict", where(), v.a_type_name()));
    const PickleDict& e = v.as_dict();
    const PickleValue& action = field(e, "action", where);
    if (!action.is_string())
      fail(fmt::format("{}: 'action' is {}, expected a str", where(), action.a_type_name()));
    RawEntry r;
    r.action = parse_action(action.as_string());
    if (const PickleValue* t = e.find("time_us"); t && t->is_int())
      r.time_us = t->as_int();
    else
      *has_time = false;
    if (r.action == Action::other) return r;
    auto where_action = [&] { return fmt::format("{} ('{}')", where(), action.as_string()); };
    r.addr = int_field(e, "addr", where_action, false);
    r.size = int_field(e, "size", where_action, true);
    if (r.action == Action::segment_add || r.action == Action::segment_remove) return r;
    const PickleValue* category = e.find("category");
    if (category && category->is_string()) {
      r.tally = true;
      r.key = tally_key(category->as_string(), e.find("user_metadata"), e.find("frames"));
    } else {
      r.key = frame_key(e.find("frames"));
    }
    return r;
  }

  // Tally's key: the category, and module, op and phase from user_metadata
  // ("category=C module=M op=O phase=P"), or from the frames when that does not parse.
  // Cached by the identity of the (shared) strings and frames list.
  uint32_t tally_key(const std::string& category, const PickleValue* metadata,
                     const PickleValue* frames) {
    const std::string* m = metadata && metadata->is_string() ? &metadata->as_string() : nullptr;
    const void* source = m ? static_cast<const void*>(m) : frames ? frames->identity() : nullptr;
    const std::pair<const void*, const void*> memo{source, &category};
    if (source)
      if (auto it = entry_keys_.find(memo); it != entry_keys_.end()) return it->second;
    AllocKey k;
    bool parsed = false;
    if (m) {
      const size_t mod = m->find(" module="), op = m->find(" op=", mod == m->npos ? 0 : mod),
                   phase = m->find(" phase=", op == m->npos ? 0 : op);
      if (starts_with(*m, "category=") && mod != m->npos && op != m->npos && phase != m->npos) {
        k.module = clip(std::string_view(*m).substr(mod + 8, op - mod - 8));
        k.op = clip(std::string_view(*m).substr(op + 4, phase - op - 4));
        k.phase = clip(std::string_view(*m).substr(phase + 7));
        parsed = true;
      }
    }
    if (!parsed) k = tally_frames_key(frames);
    k.category = clip(category);
    const uint32_t id = intern(std::move(k));
    if (source) entry_keys_.emplace(memo, id);
    return id;
  }

  // Tally's frames (docs/memory-formats.md §1.6): the op (or C++ function) first, then
  // `module:0:<path>` and `category=C:0:phase P`.
  static AllocKey tally_frames_key(const PickleValue* frames) {
    AllocKey k;
    if (!frames || !frames->is_list()) return k;
    bool first = true;
    for (const PickleValue& f : frames->as_list()) {
      if (!f.is_dict()) continue;
      const PickleValue* name = f.as_dict().find("name");
      const PickleValue* file = f.as_dict().find("filename");
      if (!name || !file || !name->is_string() || !file->is_string()) continue;
      const std::string_view n = name->as_string();
      const std::string_view fn = file->as_string();
      if (fn == "module") {
        k.module = clip(n);
      } else if (starts_with(fn, "category=")) {
        k.category = clip(fn.substr(9));
        if (starts_with(n, "phase ")) k.phase = n.substr(6) == "none" ? "" : clip(n.substr(6));
      } else if (first && n != "<no op>" && n.find_first_of("(): ") == std::string::npos) {
        k.op = clip(n);  // without an op, frame 1 names the C++ function of the call site
      }
      first = false;
    }
    return k;
  }

  // A block's key from its frames (Tally's layout or PyTorch's), cached by the list's identity.
  uint32_t block_key(const PickleValue* frames) {
    if (!tally_layout_) return frame_key(frames);
    const void* id = frames ? frames->identity() : nullptr;
    if (id)
      if (auto it = block_keys_.find(id); it != block_keys_.end()) return it->second;
    const uint32_t key = intern(tally_frames_key(frames));
    if (id) block_keys_.emplace(id, key);
    return key;
  }

  // PyTorch's key: the frame that says where the allocation came from.
  uint32_t frame_key(const PickleValue* frames) {
    const void* id = frames ? frames->identity() : nullptr;
    if (id) {
      if (auto it = frame_keys_.find(id); it != frame_keys_.end()) return it->second;
    }
    AllocKey k;
    k.frame = clip(site(frames));
    const uint32_t key = intern(std::move(k));
    if (id) frame_keys_[id] = key;
    return key;
  }

  static std::string site(const PickleValue* frames) {
    if (!frames || !frames->is_list() || frames->as_list().empty()) return "(no frames)";
    const PickleDict* first_py = nullptr;
    const PickleDict* first_named = nullptr;
    const PickleDict* first = nullptr;
    std::string_view outer_op;  // the outermost ATen op: what a native-only stack ran
    for (const PickleValue& f : frames->as_list()) {
      if (!f.is_dict()) continue;
      const PickleDict& d = f.as_dict();
      const PickleValue* file = d.find("filename");
      if (!first) first = &d;
      if (const PickleValue* name = d.find("name"); name && name->is_string()) {
        const std::string_view n = name->as_string();
        if (starts_with(n, "at::_ops::")) outer_op = n.substr(0, n.find('('));
      }
      if (!file || !file->is_string()) continue;
      const std::string& fn = file->as_string();
      if (ends_with(fn, ".py")) {
        if (!torch_internal(fn)) return frame_str(d);
        if (!first_py) first_py = &d;
      } else if (!first_named && !fn.empty() && fn != "??") {
        first_named = &d;
      }
    }
    if (first_py) return frame_str(*first_py);
    if (!outer_op.empty()) return std::string(outer_op);
    const PickleDict* pick = first_named ? first_named : first;
    return pick ? frame_str(*pick) : "(no frames)";
  }

  static std::string frame_str(const PickleDict& d) {
    auto text = [&](std::string_view key) -> std::string {
      const PickleValue* v = d.find(key);
      if (!v) return "?";
      if (v->is_string()) return v->as_string();
      if (v->is_int()) return std::to_string(v->as_int());
      return "?";
    };
    return text("filename") + ":" + text("line") + ":" + text("name");
  }

  void read_segments(const std::vector<PickleValue>& segments, int device,
                     const std::unordered_map<int64_t, LiveBlock>& live,
                     std::unordered_map<int64_t, LiveBlock>& initial, int64_t* reserved) {
    for (size_t si = 0; si < segments.size(); ++si) {
      auto where = [&] { return fmt::format("segments[{}]", si); };
      const PickleValue& sv = segments[si];
      if (!sv.is_dict()) fail(fmt::format("{}: {}, expected a dict", where(), sv.a_type_name()));
      const PickleDict& seg = sv.as_dict();
      if (int_field(seg, "device", where, false) != device) continue;
      *reserved = base::checked_add(*reserved, int_field(seg, "total_size", where, true),
                                    fmt::format("{}: {}: total_size", name_, where()));
      const PickleValue& blocks = field(seg, "blocks", where);
      if (!blocks.is_list())
        fail(fmt::format("{}: 'blocks' is {}, expected a list", where(), blocks.a_type_name()));
      for (size_t bi = 0; bi < blocks.as_list().size(); ++bi) {
        auto bwhere = [&] { return fmt::format("segments[{}].blocks[{}]", si, bi); };
        const PickleValue& bv = blocks.as_list()[bi];
        if (!bv.is_dict()) fail(fmt::format("{}: {}, expected a dict", bwhere(), bv.a_type_name()));
        const PickleDict& b = bv.as_dict();
        const PickleValue& state = field(b, "state", bwhere);
        if (!state.is_string())
          fail(fmt::format("{}: 'state' is {}, expected a str", bwhere(), state.a_type_name()));
        if (state.as_string() == "inactive") continue;
        const int64_t addr = int_field(b, "address", bwhere, false);
        if (live.count(addr) || initial.count(addr)) continue;
        int64_t size = int_field(b, "size", bwhere, true);
        if (const PickleValue* req = b.find("requested_size");
            req && req->is_int() && req->as_int() > 0 && req->as_int() <= size)
          size = req->as_int();
        initial.emplace(addr, LiveBlock{size, block_key(b.find("frames"))});
      }
    }
  }

  std::string_view name_;
  std::string summing_;        // the context of checked sums: "<file>: summing the trace's bytes"
  bool tally_layout_ = false;  // Tally's snapshot: blocks' frames are read as Tally writes them
  std::vector<AllocKey> keys_;
  std::map<AllocKey, uint32_t> key_ids_;
  // Keys already derived, by the identity of what they were derived from.
  std::map<std::pair<const void*, const void*>, uint32_t> entry_keys_;  // (metadata, category)
  std::unordered_map<const void*, uint32_t> frame_keys_;                // PyTorch's frames
  std::unordered_map<const void*, uint32_t> block_keys_;                // Tally's blocks' frames
};

// ---- formatting

std::string human_bytes(int64_t b) {
  const double v = static_cast<double>(b < 0 ? -b : b);
  const char* sign = b < 0 ? "-" : "";
  if (v >= 1024.0 * 1024 * 1024 * 1024)
    return fmt::format("{}{:.2f} TiB", sign, v / (1024.0 * 1024 * 1024 * 1024));
  if (v >= 1024.0 * 1024 * 1024)
    return fmt::format("{}{:.2f} GiB", sign, v / (1024.0 * 1024 * 1024));
  if (v >= 1024.0 * 1024) return fmt::format("{}{:.2f} MiB", sign, v / (1024.0 * 1024));
  if (v >= 1024.0) return fmt::format("{}{:.2f} KiB", sign, v / 1024.0);
  return fmt::format("{}{} B", sign, b < 0 ? -b : b);
}

std::string signed_bytes(int64_t d) {
  return d > 0 ? "+" + human_bytes(d) : human_bytes(d);
}

std::string signed_count(int64_t d) {
  return d > 0 ? fmt::format("+{}", d) : fmt::format("{}", d);
}

std::string percent(int64_t delta, int64_t base) {
  if (base == 0) return "";
  return fmt::format(" ({:+.1f}%)", 100.0 * static_cast<double>(delta) / static_cast<double>(base));
}

// "layer1.10" after "layer1.9": digit runs compare as numbers.
bool natural_less(std::string_view a, std::string_view b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (std::isdigit(static_cast<unsigned char>(a[i])) &&
        std::isdigit(static_cast<unsigned char>(b[j]))) {
      size_t i2 = i, j2 = j;
      while (i2 < a.size() && a[i2] == '0') ++i2;
      while (j2 < b.size() && b[j2] == '0') ++j2;
      size_t ie = i2, je = j2;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) ++je;
      if (ie - i2 != je - j2) return ie - i2 < je - j2;
      if (const int c = a.substr(i2, ie - i2).compare(b.substr(j2, je - j2)); c != 0) return c < 0;
      i = ie;
      j = je;
      continue;
    }
    if (a[i] != b[j]) return a[i] < b[j];
    ++i;
    ++j;
  }
  return a.size() - i < b.size() - j;
}

std::string row_name(const std::string& n) {
  return n.empty() ? "(none)" : n;
}

std::string fit(const std::string& s, size_t width) {
  if (s.size() <= width) return s;
  return s.substr(0, width - 3) + "...";
}

std::string summary_json(const SnapshotSummary& s) {
  return fmt::format(
      "{{\"path\": {}, \"format\": \"{}\", \"device\": {}, \"entries\": {}, \"has_time\": {}, "
      "\"start_allocated\": {}, \"peak_allocated\": {}, \"peak_reserved\": {}, "
      "\"allocations\": {}, \"peak_t\": {:.3f}, \"peak_reached_by\": {}}}",
      base::json_quote(s.path), s.tally ? "tally" : "pytorch", s.device, s.entries,
      s.has_time ? "true" : "false", s.start_allocated, s.peak_allocated, s.peak_reserved,
      s.allocations, s.peak_t, base::json_quote(s.peak_reached_by));
}

// At most ~2 * kBuckets samples: the lowest and highest of each run of samples, in order, so
// that every peak and trough stays visible (the run's peak among them).
constexpr size_t kBuckets = 2000;

std::vector<size_t> thin(const SnapshotSummary& s) {
  const size_t n = s.t.size();
  std::vector<size_t> keep;
  if (n <= 2 * kBuckets) {
    for (size_t i = 0; i < n; ++i) keep.push_back(i);
    return keep;
  }
  const size_t per = (n + kBuckets - 1) / kBuckets;
  for (size_t start = 0; start < n; start += per) {
    const size_t end = std::min(n, start + per);
    size_t lo = start, hi = start;
    for (size_t i = start; i < end; ++i) {
      if (s.allocated[i] < s.allocated[lo]) lo = i;
      if (s.allocated[i] >= s.allocated[hi]) hi = i;
    }
    keep.push_back(std::min(lo, hi));
    if (lo != hi) keep.push_back(std::max(lo, hi));
  }
  if (keep.back() != n - 1) keep.push_back(n - 1);
  return keep;
}

std::string series_json(const SnapshotSummary& s) {
  std::string out = summary_json(s);
  out.pop_back();  // the closing brace
  const std::vector<size_t> keep = thin(s);
  out += ", \"t\": [";
  for (size_t k = 0; k < keep.size(); ++k)
    out += fmt::format("{}{:.3f}", k ? "," : "", s.t[keep[k]]);
  out += "], \"y\": [";
  for (size_t k = 0; k < keep.size(); ++k)
    out += fmt::format("{}{}", k ? "," : "", s.allocated[keep[k]]);
  out += "]}";
  return out;
}

// The page's drawing script (after inspect/svg_chart.h's TallyChart): reads
// <script id="data">, draws both timelines into <svg id="chart"> (round ticks, peak markers,
// hover readout), fills the tables, then marks the body with data-rendered and data-series.
constexpr const char* kScript = R"JS(
(function () {
  var C = TallyChart;
  var D = JSON.parse(document.getElementById('data').textContent);
  var svg = document.getElementById('chart');
  var W = 960, H = 380, L = 72, R = 24, T = 20, B = 46;
  var f = C.frame(W, H, L, R, T, B);
  function el(name, attrs, parent) { return C.el(parent || svg, name, attrs); }
  function esc(s) { return String(s).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;'); }
  var human = C.human;
  function signed(d) { return d === 0 ? '0 B' : (d > 0 ? '+' : '\u2212') + human(Math.abs(d)); }
  function signedCount(d) { return d === 0 ? '0' : (d > 0 ? '+' : '\u2212') + Math.abs(d); }
  var series = [{s: D.a, color: D.colors.a, label: 'A'}, {s: D.b, color: D.colors.b, label: 'B'}];

  // Files and totals.
  document.getElementById('files').innerHTML = series.map(function (x) {
    return '<span class="sw" style="background:' + x.color + '"></span><b>' + x.label + '</b> ' +
      esc(x.s.path) + ' (' + (x.s.format === 'tally' ? 'Tally' : 'PyTorch') + ', device ' + x.s.device +
      ', ' + x.s.entries + ' trace entries)';
  }).join('<br>');
  var rows = [['peak allocated', 'peak_allocated', human, signed], ['peak reserved', 'peak_reserved', human, signed],
              ['live at the start', 'start_allocated', human, signed], ['allocations', 'allocations', String, signedCount]];
  var th = '<tr><th></th><th>A</th><th>B</th><th>\u0394 (B \u2212 A)</th></tr>';
  rows.forEach(function (r) {
    var a = D.a[r[1]], b = D.b[r[1]], d = b - a;
    var pct = a ? ' (' + (d >= 0 ? '+' : '\u2212') + Math.abs(100 * d / a).toFixed(1) + '%)' : '';
    th += '<tr><td>' + r[0] + '</td><td>' + r[2](a) + '</td><td>' + r[2](b) + '</td><td class="' +
      (d < 0 ? 'better' : d > 0 ? 'worse' : '') + '">' + r[3](d) + (d ? pct : '') + '</td></tr>';
  });
  th += '<tr><td>peak reached by</td><td>' + esc(D.a.peak_reached_by) + '</td><td>' + esc(D.b.peak_reached_by) + '</td><td></td></tr>';
  document.getElementById('totals').innerHTML = th;

  // The chart: both timelines from each run's start, on one scale.
  var timed = D.a.has_time && D.b.has_time;
  var ymax = 1, xmax = 0;
  series.forEach(function (x) {
    x.s.y.forEach(function (v) { ymax = Math.max(ymax, v); });
    if (x.s.t.length) xmax = Math.max(xmax, x.s.t[x.s.t.length - 1]);
  });
  var ya = C.byteAxis(ymax, 5);
  var xa = C.fitX(f, function (n) { return timed ? C.timeAxis(xmax, n) : C.countAxis(xmax, n); });
  function x(t) { return f.x(t, xa); }
  function y(b) { return f.y(b, ya); }
  C.axes(svg, f, xa, ya, timed ? 'time from each run\u2019s first trace entry (' + xa.unit + ')' : 'trace entry (index)',
         'allocated (' + ya.unit + ')');
  var drawn = 0;
  series.forEach(function (x_) {
    var s = x_.s;
    if (!s.t.length) return;
    var d = 'M' + x(s.t[0]).toFixed(2) + ',' + y(s.y[0]).toFixed(2);
    for (var i = 1; i < s.t.length; i++) d += 'H' + x(s.t[i]).toFixed(2) + 'V' + y(s.y[i]).toFixed(2);
    var p = el('path', {d: d, fill: 'none', stroke: x_.color, 'stroke-width': 1.6, 'stroke-opacity': 0.9,
                        'class': 'series', 'data-run': x_.label});
    el('title', {}, p).textContent = x_.label + ': ' + s.path;
    var px = x(s.peak_t), py = y(s.peak_allocated);
    el('circle', {cx: px, cy: py, r: 4, fill: x_.color, 'class': 'peak'});
    var right = px > W - R - 150;  // a label near the right edge ends at its marker
    var lab = el('text', {x: right ? px - 6 : px + 6, y: py - 6 - 14 * drawn, 'font-size': 11,
                          'text-anchor': right ? 'end' : 'start', fill: x_.color});
    lab.textContent = x_.label + ' peak ' + human(s.peak_allocated);
    drawn++;
  });
  // Hover: a cursor and each run's allocated bytes at that time.
  var readout = document.getElementById('readout');
  function at(s, t) {
    var lo = 0, hi = s.t.length - 1;
    if (hi < 0 || t < s.t[0]) return null;
    if (t > s.t[hi]) return null;
    while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (s.t[mid] <= t) lo = mid; else hi = mid - 1; }
    return s.y[lo];
  }
  C.hover(svg, f, xa, readout, function (t) {
    return (timed ? 't = ' + xa.label(t) + ' ' + xa.unit : 'entry ' + Math.round(t)) + ':  ' +
      series.map(function (x_) { var v = at(x_.s, t); return x_.label + ' ' + (v === null ? '\u2013' : human(v)); }).join(',  ');
  });
  var legend = document.getElementById('legend');
  series.forEach(function (x_) {
    var item = document.createElement('span');
    item.innerHTML = '<span class="sw" style="background:' + x_.color + '"></span>' + x_.label;
    legend.appendChild(item);
  });

  // The tables.
  var out = document.getElementById('sections');
  D.sections.forEach(function (sec) {
    var h = document.createElement('h2');
    h.textContent = 'By ' + sec.dimension;
    out.appendChild(h);
    var tab = document.createElement('table');
    tab.className = 'diff';
    tab.setAttribute('data-dimension', sec.dimension);
    var html = '<tr><th>' + esc(sec.dimension) + '</th><th>A at its peak</th><th>B at its peak</th><th>\u0394 bytes</th>' +
      '<th>A allocations</th><th>B allocations</th><th>\u0394 allocations</th></tr>';
    sec.rows.forEach(function (r) {
      var d = r[2] - r[1], dn = r[4] - r[3];
      var sw = sec.dimension === 'category' && D.category_colors[r[0]] ?
        '<span class="sw" style="background:' + D.category_colors[r[0]] + '"></span>' : '';
      html += '<tr><td>' + sw + esc(r[0] === '' ? '(none)' : r[0]) + '</td><td>' + human(r[1]) + '</td><td>' + human(r[2]) +
        '</td><td class="' + (d < 0 ? 'better' : d > 0 ? 'worse' : '') + '">' + signed(d) + '</td><td>' + r[3] +
        '</td><td>' + r[4] + '</td><td>' + signedCount(dn) + '</td></tr>';
    });
    tab.innerHTML = html;
    out.appendChild(tab);
    if (sec.more > 0) {
      var p = document.createElement('p');
      p.className = 'sub';
      p.textContent = sec.more + ' more rows with smaller changes (all of them: tally_memdiff --json, or --top 0).';
      out.appendChild(p);
    }
  });
  C.check();
  document.body.setAttribute('data-series', String(drawn));
  document.body.setAttribute('data-rendered', '1');
})();
)JS";

}  // namespace

std::string alloc_key_str(const AllocKey& k) {
  std::string out;
  for (const std::string* f : {&k.category, &k.module, &k.op, &k.phase, &k.frame})
    if (!f->empty()) out += (out.empty() ? "" : " ") + *f;
  return out.empty() ? "(none)" : out;
}

SnapshotSummary summarize_snapshot(const PickleValue& snapshot, std::string_view name, int device) {
  return SnapshotReader(name).run(snapshot, device);
}

SnapshotSummary read_snapshot_summary(const std::string& path, int device) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw std::runtime_error(fmt::format("{}: is a folder, expected a snapshot file", path));
  return summarize_snapshot(unpickle_file(path), path, device);
}

const DiffSection* SnapshotDiff::section(std::string_view dimension) const {
  for (const DiffSection& s : sections)
    if (s.dimension == dimension) return &s;
  return nullptr;
}

SnapshotDiff diff_snapshots(const SnapshotSummary& a, const SnapshotSummary& b,
                            const DiffOptions& options) {
  if (a.device != b.device && !options.any_device)
    throw std::invalid_argument(fmt::format(
        "cannot diff {} and {}: they are snapshots of different devices ({} is of device {}, {} of "
        "device {}); choose one device for both (--device), or --any-device when they stand for "
        "the same one (dry runs)",
        a.path, b.path, a.path, a.device, b.path, b.device));
  SnapshotDiff d;
  d.a = a;
  d.b = b;
  using Proj = std::string (*)(const AllocKey&);
  const std::pair<const char*, Proj> dims[] = {
      {"category", [](const AllocKey& k) { return k.category; }},
      {"phase", [](const AllocKey& k) { return k.phase; }},
      {"module", [](const AllocKey& k) { return k.module; }},
      {"op", [](const AllocKey& k) { return k.op; }},
      {"frame", [](const AllocKey& k) { return k.frame; }},
      {"key", [](const AllocKey& k) { return alloc_key_str(k); }},
  };
  for (const auto& [dim, proj] : dims) {
    const bool whole_key = std::string_view(dim) == "key";
    if (whole_key && !a.tally && !b.tally) continue;  // PyTorch's key is the frame alone
    std::map<std::string, DiffRow> rows;
    bool any = false;
    for (const auto& [k, st] : a.keys) {
      DiffRow& r = rows[proj(k)];
      r.a_bytes += st.bytes_at_peak;
      r.a_allocations += st.allocations;
    }
    for (const auto& [k, st] : b.keys) {
      DiffRow& r = rows[proj(k)];
      r.b_bytes += st.bytes_at_peak;
      r.b_allocations += st.allocations;
    }
    DiffSection sec;
    sec.dimension = dim;
    for (auto& [name, r] : rows) {
      any = any || (!name.empty() && name != "(none)");
      r.name = name;
      sec.rows.push_back(r);
    }
    if (!any) continue;
    std::sort(sec.rows.begin(), sec.rows.end(), [](const DiffRow& x, const DiffRow& y) {
      const int64_t dx = std::abs(x.bytes_delta()), dy = std::abs(y.bytes_delta());
      if (dx != dy) return dx > dy;
      const int64_t nx = std::abs(x.allocations_delta()), ny = std::abs(y.allocations_delta());
      if (nx != ny) return nx > ny;
      const int64_t mx = std::max(x.a_bytes, x.b_bytes), my = std::max(y.a_bytes, y.b_bytes);
      if (mx != my) return mx > my;
      return natural_less(x.name, y.name);
    });
    d.sections.push_back(std::move(sec));
  }
  return d;
}

std::string format_snapshot_diff(const SnapshotDiff& d, size_t top) {
  std::string out;
  auto describe = [](const SnapshotSummary& s) {
    return fmt::format(
        "{} ({} snapshot, device {}, {} trace entries{})", s.path, s.tally ? "Tally" : "PyTorch",
        s.device, s.entries,
        s.has_time ? fmt::format(", {:.1f} ms", s.t.empty() ? 0.0 : s.t.back()) : std::string());
  };
  out += "A: " + describe(d.a) + "\n";
  out += "B: " + describe(d.b) + "\n\n";
  const std::vector<std::vector<std::string>> totals = {
      {"", "A", "B", "delta (B - A)"},
      {"peak allocated", human_bytes(d.a.peak_allocated), human_bytes(d.b.peak_allocated),
       signed_bytes(d.b.peak_allocated - d.a.peak_allocated) +
           percent(d.b.peak_allocated - d.a.peak_allocated, d.a.peak_allocated)},
      {"peak reserved", human_bytes(d.a.peak_reserved), human_bytes(d.b.peak_reserved),
       signed_bytes(d.b.peak_reserved - d.a.peak_reserved) +
           percent(d.b.peak_reserved - d.a.peak_reserved, d.a.peak_reserved)},
      {"live at the start", human_bytes(d.a.start_allocated), human_bytes(d.b.start_allocated),
       signed_bytes(d.b.start_allocated - d.a.start_allocated)},
      {"allocations", std::to_string(d.a.allocations), std::to_string(d.b.allocations),
       signed_count(d.b.allocations - d.a.allocations)},
  };
  for (const auto& row : totals)
    out += fmt::format("{:<18}  {:>12}  {:>12}  {:>22}\n", row[0], row[1], row[2], row[3]);
  out += fmt::format("peak reached by   A: {}\n                  B: {}\n",
                     fit(d.a.peak_reached_by, 90), fit(d.b.peak_reached_by, 90));
  for (const DiffSection& sec : d.sections) {
    const size_t n = top == 0 ? sec.rows.size() : std::min(top, sec.rows.size());
    size_t w = sec.dimension.size();
    for (size_t i = 0; i < n; ++i)
      w = std::max(w, std::min<size_t>(60, row_name(sec.rows[i].name).size()));
    out += fmt::format("\nby {} (bytes live at each run's peak; allocations over each trace)\n",
                       sec.dimension);
    const std::string head =
        fmt::format("{:<{}}  {:>12}  {:>12}  {:>13}  {:>9}  {:>9}  {:>9}", sec.dimension, w,
                    "A at peak", "B at peak", "delta", "A allocs", "B allocs", "delta");
    out += head + "\n" + std::string(head.size(), '-') + "\n";
    for (size_t i = 0; i < n; ++i) {
      const DiffRow& r = sec.rows[i];
      out += fmt::format("{:<{}}  {:>12}  {:>12}  {:>13}  {:>9}  {:>9}  {:>9}\n",
                         fit(row_name(r.name), 60), w, human_bytes(r.a_bytes),
                         human_bytes(r.b_bytes), signed_bytes(r.bytes_delta()), r.a_allocations,
                         r.b_allocations, signed_count(r.allocations_delta()));
    }
    if (n < sec.rows.size())
      out += fmt::format("({} more rows with smaller changes; --top 0 shows all)\n",
                         sec.rows.size() - n);
  }
  return out;
}

std::string snapshot_diff_json(const SnapshotDiff& d) {
  std::string out =
      "{\"a\": " + summary_json(d.a) + ",\n \"b\": " + summary_json(d.b) + ",\n \"sections\": [";
  for (size_t si = 0; si < d.sections.size(); ++si) {
    const DiffSection& sec = d.sections[si];
    out += fmt::format("{}\n  {{\"dimension\": {}, \"rows\": [", si ? "," : "",
                       base::json_quote(sec.dimension));
    for (size_t i = 0; i < sec.rows.size(); ++i) {
      const DiffRow& r = sec.rows[i];
      out += fmt::format(
          "{}\n   {{\"name\": {}, \"a_bytes\": {}, \"b_bytes\": {}, \"delta_bytes\": {}, "
          "\"a_allocations\": {}, \"b_allocations\": {}, \"delta_allocations\": {}}}",
          i ? "," : "", base::json_quote(r.name), r.a_bytes, r.b_bytes, r.bytes_delta(),
          r.a_allocations, r.b_allocations, r.allocations_delta());
    }
    out += "]}";
  }
  return out + "]}\n";
}

void write_snapshot_diff_json(const std::string& path, const SnapshotDiff& d) {
  base::write_file_atomic(path, snapshot_diff_json(d), "write_snapshot_diff_json");
}

void write_snapshot_diff_html(const std::string& path, const SnapshotDiff& d, size_t top) {
  std::string data =
      "{\"a\": " + series_json(d.a) + ",\n\"b\": " + series_json(d.b) +
      fmt::format(",\n\"colors\": {{\"a\": \"{}\", \"b\": \"{}\"}}",
                  category_color(Category::parameter), category_color(Category::gradient)) +
      ",\n\"category_colors\": " + category_colors_json() + ",\n\"sections\": [";
  for (size_t si = 0; si < d.sections.size(); ++si) {
    const DiffSection& sec = d.sections[si];
    const size_t n = top == 0 ? sec.rows.size() : std::min(top, sec.rows.size());
    data += fmt::format("{}\n{{\"dimension\": {}, \"more\": {}, \"rows\": [", si ? "," : "",
                        base::json_quote(sec.dimension), sec.rows.size() - n);
    for (size_t i = 0; i < n; ++i) {
      const DiffRow& r = sec.rows[i];
      data += fmt::format("{}[{}, {}, {}, {}, {}]", i ? "," : "", base::json_quote(r.name),
                          r.a_bytes, r.b_bytes, r.a_allocations, r.b_allocations);
    }
    data += "]}";
  }
  data += "]}";
  data = base::script_safe(data);
  std::string html = R"HTML(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Tally memory diff</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 8px} h2{font-size:15px;margin:20px 0 4px} .sub{color:#666;margin:6px 0}
div.chart{border:1px solid #ddd;border-radius:6px;padding:8px;display:inline-block;margin-top:12px}
.legend{display:flex;gap:16px;margin:8px 0}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;vertical-align:middle}
table{border-collapse:collapse;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid #eee;padding:3px 8px;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}
.better{color:#1a7f37}.worse{color:#cf222e}
</style></head>
<body>
<h1>Tally memory diff</h1>
<div class="sub" id="files"></div>
<table id="totals"></table>
<div class="chart"><div class="legend" id="legend"></div>
<svg id="chart" class="chart" width="960" height="380" viewBox="0 0 960 380"></svg>
<div class="sub" id="readout">&nbsp;</div></div>
<div id="sections"></div>
<p class="sub">Bytes are the trace's (requested) bytes. "At its peak": what each key held at the moment its
own run's allocated memory peaked; blocks live before the trace began (parameters, state) count from its
start. Allocations: alloc entries over each trace. Modules are matched by their dotted path; a row only one
run has shows 0 for the other. Green: B uses less than A.</p>
<script id="data" type="application/json">)HTML";
  html += data;
  html += "</script>\n<script>";
  html += chart_script();  // the renderer and palette of every page (inspect/svg_chart.h)
  html += "</script>\n<script>";
  html += kScript;
  html += "</script>\n</body></html>\n";
  base::write_file_atomic(path, html, "write_snapshot_diff_html");
}

}  // namespace tally::inspect
