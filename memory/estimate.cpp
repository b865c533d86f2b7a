#include "memory/estimate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "memory/caching_allocator.h"
#include "memory/cpu_provider.h"

namespace tally::memory {

// The allocator events of one meta device, and where its allocated bytes last reached their
// peak (the moment DeviceStats::category_at_peak describes). Chained in front of the
// observer installed before it (the profiler's), which still sees every event.
class PeakTracker final : public AllocationObserver {
 public:
  struct Event {
    uint64_t addr;
    int64_t bytes;
    StrId module;
    Category category;
    bool retag;
  };

  explicit PeakTracker(int index) : index_(index), next_(allocation_observer()) {
    set_allocation_observer(this);
  }
  ~PeakTracker() override { set_allocation_observer(next_); }
  PeakTracker(const PeakTracker&) = delete;
  PeakTracker& operator=(const PeakTracker&) = delete;

  void on_allocation_event(const AllocationEvent& e) override {
    if (next_) next_->on_allocation_event(e);
    if (e.device_type != DeviceType::meta || e.device_index != index_) return;
    events_.push_back({e.addr, e.bytes, e.tag.module, e.tag.category, e.retag});
    if (!e.retag && e.bytes > 0 && static_cast<int64_t>(e.total_allocated) >= peak_) {
      peak_ = static_cast<int64_t>(e.total_allocated);
      peak_events_ = events_.size();
    }
  }

  // Activation bytes by module among the blocks live at the peak, largest first.
  std::vector<ModuleBytes> activations_at_peak() const {
    struct Live {
      int64_t bytes;
      StrId module;
      Category category;
    };
    std::unordered_map<uint64_t, Live> live;
    for (size_t i = 0; i < peak_events_; ++i) {
      const Event& e = events_[i];
      if (e.retag) {
        if (auto it = live.find(e.addr); it != live.end()) it->second.category = e.category;
      } else if (e.bytes > 0) {
        live[e.addr] = {e.bytes, e.module, e.category};
      } else {
        live.erase(e.addr);
      }
    }
    std::map<StrId, int64_t> by_module;
    for (const auto& [addr, b] : live)
      if (b.category == Category::activation) by_module[b.module] += b.bytes;
    std::vector<ModuleBytes> out;
    for (const auto& [m, bytes] : by_module) out.push_back({interned(m), bytes});
    std::sort(out.begin(), out.end(), [](const ModuleBytes& a, const ModuleBytes& b) {
      return a.bytes != b.bytes ? a.bytes > b.bytes : a.module < b.module;
    });
    return out;
  }

 private:
  int index_;
  AllocationObserver* next_;
  std::vector<Event> events_;
  int64_t peak_ = -1;
  size_t peak_events_ = 0;
};

namespace {

// The running dry runs by meta device index (dry_run_phase).
std::mutex dry_runs_mu;
std::map<int, DryRun*>& dry_runs() {
  static std::map<int, DryRun*> m;
  return m;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string human(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

}  // namespace

DryRun::DryRun(const EstimateOptions& options)
    : target_(options.spec ? *options.spec : meta_target(options.target)) {
  if (options.capacity) target_.capacity = options.capacity;
  device_ = new_meta_device(target_);
  host_memory_ = options.host_memory ? options.host_memory : host_memory_total();
  // A GPU target's host memory is meta:0's, shared by every dry run: its figures are counted
  // from here (its cache of earlier runs emptied first).
  host_ = behaves_as(device_) == DeviceType::cpu ? device_ : Device::meta(0);
  if (!(host_ == device_)) {
    {  // the dry runs this one runs inside keep their host peaks before this one resets them
      std::lock_guard lock(dry_runs_mu);
      for (auto& [index, outer] : dry_runs())
        if (outer->host_ == host_ && !(outer->host_ == outer->device_)) outer->keep_host_peak();
    }
    // The replay's host has the larger of the two, so that a host peak over host_memory is
    // measured whole (and refused after, by host_memory_error) rather than cut short.
    set_meta_host_memory(std::max(host_memory_, host_memory_total()));
    CachingAllocator& h = get_allocator(host_);
    // dump_snapshot(path, device()) writes the host's segments and trace beside the device's.
    if (options.max_history && !h.history_enabled())
      h.record_memory_history(true, options.max_history);
    h.empty_cache();
    h.reset_peak_memory_stats();
    const DeviceStats st = h.stats();
    host_base_allocated_ = st.allocated_bytes[kAllPools].current;
    host_base_reserved_ = st.reserved_bytes[kAllPools].current;
    for (size_t c = 0; c < kNumCategories; ++c) host_base_[c] = st.category_bytes[c].current;
  }
  if (options.max_history) get_allocator(device_).record_memory_history(true, options.max_history);
  tracker_ = std::make_unique<PeakTracker>(device_.index);
  start_ = now_seconds();
  std::lock_guard lock(dry_runs_mu);
  dry_runs()[device_.index] = this;
}

DryRun::~DryRun() {
  std::lock_guard lock(dry_runs_mu);
  dry_runs().erase(device_.index);
  if (host_ == device_) return;
  // A dry run this one ran inside measures its host's peak from here on (what this one held
  // is not its own); its peak before this one began was kept (keep_host_peak).
  for (auto& [index, outer] : dry_runs())
    if (outer->host_ == host_) {
      CachingAllocator& h = get_allocator(host_);
      h.empty_cache();  // this one's cached segments are not the outer run's
      h.reset_peak_memory_stats();
      break;
    }
}

namespace {
// `highest` becomes `st` where st's allocated peak is higher; its reserved peak is the higher
// of the two either way (the phases' or the host's highest so far).
void keep_highest(std::optional<DeviceStats>& highest, const DeviceStats& st) {
  const int64_t reserved = highest ? highest->reserved_bytes[kAllPools].peak : 0;
  if (!highest || st.allocated_bytes[kAllPools].peak > highest->allocated_bytes[kAllPools].peak)
    highest = st;
  highest->reserved_bytes[kAllPools].peak = std::max(reserved, st.reserved_bytes[kAllPools].peak);
}
}  // namespace

void DryRun::keep_host_peak() {
  keep_highest(host_highest_, get_allocator(host_).stats());
}

void DryRun::close_phase() {
  CachingAllocator& a = get_allocator(device_);
  const DeviceStats st = a.stats();
  phases_.push_back(
      {phase_, st.allocated_bytes[kAllPools].peak, st.reserved_bytes[kAllPools].peak});
  keep_highest(highest_, st);
  a.reset_peak_memory_stats();
}

void DryRun::phase(const std::string& name) {
  close_phase();
  phase_ = name;
}

void dry_run_phase(Device device, const std::string& name) {
  if (!device.is_meta()) return;
  DryRun* dry = nullptr;
  {
    std::lock_guard lock(dry_runs_mu);
    const auto it = dry_runs().find(device.index);
    if (it != dry_runs().end()) dry = it->second;
  }
  if (dry) dry->phase(name);
}

Estimate DryRun::finish(const std::string& out_of_memory) {
  Estimate e;
  e.target = target_;
  e.device = device_;
  e.out_of_memory = out_of_memory;
  e.seconds = now_seconds() - start_;
  e.activations_at_peak = tracker_->activations_at_peak();
  DeviceStats st = get_allocator(device_).stats();
  if (!phases_.empty()) {  // the run named its phases: the highest of theirs and this one's
    close_phase();
    e.phases = phases_;
    const int64_t reserved = highest_->reserved_bytes[kAllPools].peak;
    st = *highest_;
    st.reserved_bytes[kAllPools].peak = reserved;
  }
  e.peak_allocated = st.allocated_bytes[kAllPools].peak;
  e.peak_reserved = st.reserved_bytes[kAllPools].peak;
  e.at_peak = st.category_at_peak;
  e.allocations = st.allocation[kAllPools].allocated;
  e.unreplayed = unreplayed(device_);
  e.host = host_;
  e.host_memory = host_memory_;
  if (host_ == device_) {
    e.host_peak_allocated = e.peak_allocated;
    e.host_peak_reserved = e.peak_reserved;
    e.host_at_peak = e.at_peak;
  } else {
    keep_host_peak();
    const DeviceStats h = *host_highest_;
    e.host_peak_allocated = h.allocated_bytes[kAllPools].peak - host_base_allocated_;
    e.host_peak_reserved = h.reserved_bytes[kAllPools].peak - host_base_reserved_;
    for (size_t c = 0; c < kNumCategories; ++c)
      e.host_at_peak[c] = h.category_at_peak[c] - host_base_[c];
    e.host_out_of_memory = host_memory_error(e.host_peak_reserved, host_memory_);
  }
  e.predicted_seconds = meta_seconds(device_);
  return e;
}

Estimate estimate(const std::function<void(Device)>& run, const EstimateOptions& options) {
  DryRun dry(options);
  try {
    run(dry.device());
  } catch (const OutOfMemoryError& oom) {
    return dry.finish(oom.what());
  }
  return dry.finish();
}

std::string Estimate::report(size_t top_modules) const {
  std::string s = fmt::format("Predicted memory on {} ({}), dry run of {:.2f} s on {}\n",
                              target.name, target.description, seconds, device.str());
  if (!fits())
    s += fmt::format("  DOES NOT FIT: the run would stop with out-of-memory:\n    {}\n",
                     out_of_memory);
  s += fmt::format("  peak allocated {:>12}   ({} B)\n", human(peak_allocated), peak_allocated);
  s += fmt::format("  peak reserved  {:>12}   ({} B; the device has {})\n", human(peak_reserved),
                   peak_reserved, human(static_cast<int64_t>(target.capacity)));
  if (!phases.empty()) {
    s += "  peak by phase (allocated / reserved):\n";
    for (const PhasePeak& p : phases)
      s += fmt::format("    {:<16}{:>12} / {}\n", p.phase, human(p.peak_allocated),
                       human(p.peak_reserved));
  }
  s += "  at the peak, by category:\n";
  for (const Category c : kAllCategories) {
    const int64_t b = at_peak[static_cast<size_t>(c)];
    if (b) s += fmt::format("    {:<16}{:>12}\n", category_name(c), human(b));
  }
  if (!activations_at_peak.empty()) {
    s += "  largest activations at the peak, by module:\n";
    for (size_t i = 0; i < activations_at_peak.size() && i < top_modules; ++i)
      s += fmt::format(
          "    {:<32}{:>12}\n",
          activations_at_peak[i].module.empty() ? "(no module)" : activations_at_peak[i].module,
          human(activations_at_peak[i].bytes));
  }
  if (!(host == device)) {
    if (!host_out_of_memory.empty())
      s += fmt::format("  DOES NOT FIT on the host: {}\n", host_out_of_memory);
    s += fmt::format("  host peak      {:>12}   ({} B reserved; the host has {})\n",
                     human(host_peak_reserved), host_peak_reserved,
                     human(static_cast<int64_t>(host_memory)));
    for (const Category c : kAllCategories) {
      const int64_t b = host_at_peak[static_cast<size_t>(c)];
      if (b) s += fmt::format("    {:<16}{:>12}   (host)\n", category_name(c), human(b));
    }
  }
  for (const auto& [what, count] : unreplayed)
    s +=
        fmt::format("  not replayed exactly ({} time{}): {}\n", count, count == 1 ? "" : "s", what);
  return s;
}

size_t host_memory_total() {
  return HostMemoryProvider::physical_memory();
}

std::string host_memory_error(int64_t host_peak, size_t host_memory) {
  if (host_peak <= static_cast<int64_t>(host_memory)) return "";
  return fmt::format(
      "the host's peak, {} ({} B: pinned optimizer state, offloaded activations), exceeds the "
      "host's memory, {} ({} B)",
      human(host_peak), host_peak, human(static_cast<int64_t>(host_memory)), host_memory);
}

size_t parse_bytes(std::string_view text, std::string_view what) {
  const std::string t(text);
  const char* begin = t.c_str();
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(begin, &end);
  if (end == begin || errno == ERANGE || !std::isfinite(v) || v < 0)
    throw std::invalid_argument(fmt::format(
        "{}: '{}' is not a size (expected e.g. 6GiB, 900MiB, 512KiB, 1.5GB or plain bytes)", what,
        text));
  std::string unit(end);
  // Each unit's bytes (all exact in a double and in 64 bits).
  static const std::map<std::string, uint64_t> units = {{"", 1},
                                                        {"B", 1},
                                                        {"KiB", uint64_t{1} << 10},
                                                        {"MiB", uint64_t{1} << 20},
                                                        {"GiB", uint64_t{1} << 30},
                                                        {"TiB", uint64_t{1} << 40},
                                                        {"KB", 1000},
                                                        {"MB", 1000000},
                                                        {"GB", 1000000000},
                                                        {"TB", 1000000000000},
                                                        {"K", uint64_t{1} << 10},
                                                        {"M", uint64_t{1} << 20},
                                                        {"G", uint64_t{1} << 30}};
  const auto it = units.find(unit);
  if (it == units.end())
    throw std::invalid_argument(fmt::format(
        "{}: unknown unit '{}' in '{}' (expected B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)", what,
        unit, text));
  const uint64_t limit = uint64_t{1} << 63;
  auto too_large = [&] {
    return std::invalid_argument(fmt::format("{}: '{}' is larger than 2^63 bytes", what, text));
  };
  // A whole number (digits only) counts exactly, past 2^53 too; a fraction or an exponent
  // goes through the double.
  const std::string_view number(begin, static_cast<size_t>(end - begin));
  if (number.find_first_not_of("0123456789") == std::string_view::npos) {
    uint64_t n = 0;
    if (std::from_chars(number.data(), number.data() + number.size(), n).ec != std::errc() ||
        n > (limit - 1) / it->second)
      throw too_large();
    return static_cast<size_t>(n * it->second);
  }
  const double bytes = std::floor(v * static_cast<double>(it->second));
  if (bytes >= 9.2233720368547758e18) throw too_large();
  return static_cast<size_t>(bytes);
}

}  // namespace tally::memory
