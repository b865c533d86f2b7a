// memory_summary(): a byte-compatible rendering of torch.cuda.memory_summary() (PyTorch's
// torch/cuda/memory.py) followed by Tally's per-category table.
//
// Layout rules (PyTorch's, see docs/memory-formats.md §3):
//   * every line is '|' + 75 characters + '|'; the text ends with a newline;
//   * a metric row is " " + name (left, 21) + " | " + four 10-character cells joined by
//     " | " + " ";
//   * byte cells: "{:6d} {unit}" with unit B/KiB/MiB/GiB/TiB/PiB; the value is floor-divided by
//     1024 while the *reference* value (the `all` row of the same column) is >= 768 KiB in the
//     current unit. Pool rows therefore share the unit of their `all` row;
//   * count cells: "{:7d} {unit} " with unit ' '/K/M; divided by 1000 while the reference is
//     >= 750 000 in the current unit;
//   * oversize rows have no pool rows and each cell is its own reference.
// The only deliberate difference from PyTorch is the title line, which names Tally and the
// device label. Tally's own table reuses the same row grammar and byte formatter; the
// diagnosis below it (from a live allocator) is free text, one sentence a line.
#include "memory/summary.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <span>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "memory/parameter_split.h"

namespace tally::memory {
namespace {

constexpr size_t kInnerWidth = 75;  // characters between the two '|'

// Python's `a // b` (rounds towards negative infinity), for b > 0.
int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if (a % b != 0 && a < 0) --q;
  return q;
}

// The loop PyTorch's _format_size and _format_count share: the unit is chosen from `ref`
// (the column's `all` value), dividing `value` by `base` for each unit up while `ref` is at
// least `threshold`. `ref` is tracked as a double after the first division, exactly like
// Python's `pref_sz /= 1024`.
std::string_view scale_to_unit(int64_t& value, int64_t ref, double threshold, int64_t base,
                               std::span<const std::string_view> units) {
  std::string_view unit = units[0];
  double pref = static_cast<double>(ref);
  for (size_t i = 1; i < units.size(); ++i) {
    if (pref < threshold) break;
    unit = units[i];
    value = floor_div(value, base);
    pref /= static_cast<double>(base);
  }
  return unit;
}

// PyTorch's _format_size.
std::string format_size(int64_t value, int64_t ref) {
  static constexpr std::string_view kUnits[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
  const std::string_view unit = scale_to_unit(value, ref, 768.0 * 1024.0, 1024, kUnits);
  return fmt::format("{:6d} {}", value, unit);
}

// PyTorch's _format_count.
std::string format_count(int64_t value, int64_t ref) {
  static constexpr std::string_view kUnits[] = {" ", "K", "M"};
  const std::string_view unit = scale_to_unit(value, ref, 750.0 * 1000.0, 1000, kUnits);
  return fmt::format("{:7d} {} ", value, unit);
}

using Formatter = std::string (*)(int64_t, int64_t);

// Pads (or, for Tally's own free-text lines, cuts) `s` to the inner width.
std::string fit(std::string s) {
  if (s.size() > kInnerWidth) s.resize(kInnerWidth);
  s.resize(kInnerWidth, ' ');
  return s;
}

// Centres `text` in the inner width, the odd space going to the left. For a one-digit device
// ID this reproduces PyTorch's " {_:16} PyTorch CUDA memory summary, device ID {device:<17d} "
// byte for byte (18 spaces left, 17 right).
std::string centered(std::string_view text) {
  constexpr size_t kMaxText = kInnerWidth - 2;  // keep at least one space on each side
  std::string t(text);
  if (t.size() > kMaxText) t = t.substr(0, kMaxText - 3) + "...";
  const size_t left = (kInnerWidth - t.size() + 1) / 2;
  return fit(std::string(left, ' ') + t);
}

std::string metric_row(std::string_view name, Formatter f, const Stat& s, const Stat& ref) {
  return fmt::format(" {:<21} | {} | {} | {} | {} ", name, f(s.current, ref.current),
                     f(s.peak, ref.peak), f(s.allocated, ref.allocated), f(s.freed, ref.freed));
}

struct PooledMetric {
  const StatArray DeviceStats::*stat;
  std::string_view name;
  Formatter format;
  std::string_view host_name = {};  // on the CPU, where PyTorch's says "GPU"
};

constexpr PooledMetric kPooledMetrics[] = {
    {&DeviceStats::allocated_bytes, "Allocated memory", format_size},
    {&DeviceStats::active_bytes, "Active memory", format_size},
    {&DeviceStats::requested_bytes, "Requested memory", format_size},
    {&DeviceStats::reserved_bytes, "GPU reserved memory", format_size, "Reserved memory"},
    {&DeviceStats::inactive_split_bytes, "Non-releasable memory", format_size},
    {&DeviceStats::allocation, "Allocations", format_count},
    {&DeviceStats::active, "Active allocs", format_count},
    {&DeviceStats::segment, "GPU reserved segments", format_count, "Reserved segments"},
    {&DeviceStats::inactive_split, "Non-releasable allocs", format_count},
};

void append_pytorch_table(std::vector<std::string>& lines, const DeviceStats& stats, int device_id,
                          const std::string& device_label, bool abbreviated) {
  lines.emplace_back(kInnerWidth, '=');
  lines.push_back(
      centered(fmt::format("Tally memory summary, device ID {} ({})", device_id, device_label)));
  lines.emplace_back(kInnerWidth, '-');
  // PyTorch's CUDA labels on CUDA (and on a meta device replaying a GPU); device-neutral
  // ones on the host ("cpu", "cpu (pinned)", a meta device replaying the CPU).
  const bool host = device_label.starts_with("cpu") || device_label.ends_with("(cpu)");
  if (host)
    lines.push_back(fmt::format("  {:9}      OOMs: {:<12d} | {:6}  allocator retries: {:<8d}  ", "",
                                stats.num_ooms, "", stats.num_alloc_retries));
  else
    lines.push_back(fmt::format("  {:9} CUDA OOMs: {:<12d} | {:6} cudaMalloc retries: {:<8d}  ", "",
                                stats.num_ooms, "", stats.num_alloc_retries));
  lines.emplace_back(kInnerWidth, '=');
  lines.emplace_back("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ");

  for (const PooledMetric& m : kPooledMetrics) {
    const StatArray& arr = stats.*(m.stat);
    const Stat& all = arr[kAllPools];
    lines.emplace_back(kInnerWidth, '-');
    lines.push_back(
        metric_row(host && !m.host_name.empty() ? m.host_name : m.name, m.format, all, all));
    if (!abbreviated) {
      lines.push_back(metric_row("      from large pool", m.format, arr[kLargePool], all));
      lines.push_back(metric_row("      from small pool", m.format, arr[kSmallPool], all));
    }
  }

  const std::pair<std::string_view, const Stat*> oversize[] = {
      {"Oversize allocations", &stats.oversize_allocations},
      {host ? "Oversize segments" : "Oversize GPU segments", &stats.oversize_segments},
  };
  for (const auto& [name, stat] : oversize) {
    lines.emplace_back(kInnerWidth, '-');
    lines.push_back(metric_row(name, format_count, *stat, *stat));
  }
  lines.emplace_back(kInnerWidth, '=');
}

// A share of the allocated peak (" 41.3%"), "-" when nothing was allocated.
std::string share_of_peak(int64_t bytes, int64_t allocated_peak) {
  if (allocated_peak <= 0) return "-";
  return fmt::format("{:5.1f}%",
                     100.0 * static_cast<double>(bytes) / static_cast<double>(allocated_peak));
}

// Per category: current, own peak, bytes held at the moment of the allocated peak, and
// that as a share of the peak (the "At peak" column sums to the allocated peak).
void append_category_table(std::vector<std::string>& lines, const DeviceStats& stats) {
  lines.push_back(centered("Memory by category"));
  lines.emplace_back(kInnerWidth, '=');
  lines.push_back(fit("        Category       | Cur Usage  | Peak Usage |  At peak   |  Share"));
  lines.emplace_back(kInnerWidth, '-');
  const int64_t allocated_peak = stats.allocated_bytes[kAllPools].peak;
  for (Category c : kAllCategories) {
    const Stat& s = stats.cat_bytes(c);
    const int64_t at_peak = stats.category_at_peak[static_cast<size_t>(c)];
    lines.push_back(
        fit(fmt::format(" {:<21} | {} | {} | {} | {:>7}", category_name(c),
                        format_size(s.current, s.current), format_size(s.peak, s.peak),
                        format_size(at_peak, at_peak), share_of_peak(at_peak, allocated_peak))));
  }
  lines.emplace_back(kInnerWidth, '-');

  const int64_t frag =
      stats.reserved_bytes[kAllPools].current - stats.allocated_bytes[kAllPools].current;
  const int64_t peak_frag =
      stats.reserved_bytes[kAllPools].peak - stats.allocated_bytes[kAllPools].peak;
  // The sentence does not fit in 75 characters, so it wraps; the two values line up.
  lines.push_back(
      fit(fmt::format(" Fragmentation (reserved - allocated): {}", format_size(frag, frag))));
  lines.push_back(fit(fmt::format("   (peak reserved - peak allocated:    {})",
                                  format_size(peak_frag, peak_frag))));
}

// "12.0 MiB": the diagnosis's sizes, one decimal.
std::string short_size(size_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  size_t u = 0;
  while (v >= 1024.0 && u + 1 < std::size(kUnits)) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", v, kUnits[u]);
}

std::string count_of(int n, std::string_view word) {
  return fmt::format("{} {}{}", n, word, n == 1 ? "" : "s");
}

constexpr size_t kMiBytes = size_t{1} << 20;
// max_split_size_mb's floor (alloc_config.cpp raises smaller values to it).
constexpr size_t kMinMaxSplitMiB = 20;

// What would help, given where the free bytes are: nothing when the request fits a free block
// (or nothing is cached), empty_cache() when the free bytes are whole segments, else the
// settings that keep free memory in one piece.
void append_advice(std::vector<std::string>& out, const FragmentationInfo& f, size_t request,
                   size_t largest, bool failed) {
  const size_t free_all = f.free_bytes[kAllPools];
  const size_t releasable = f.releasable[kAllPools];
  if (free_all == 0) {
    out.emplace_back(failed ? "  nothing cached: live blocks fill reserved memory; no setting helps"
                            : "  would help: nothing needed (nothing is cached)");
    return;
  }
  if (!failed && largest >= request) {
    out.push_back(releasable > 0 ? fmt::format("  would help: nothing needed; empty_cache() "
                                               "returns {}",
                                               short_size(releasable))
                                 : "  would help: nothing needed (the largest request fits)");
    return;
  }
  if (free_all == releasable) {
    out.emplace_back("  would help: empty_cache() (the free segments hold no live block)");
    return;
  }
  std::vector<std::string> settings;
  if (!f.expandable_segments) settings.emplace_back("expandable_segments:True");
  // Blocks at or above max_split_size stay whole for requests as large: worth it for large
  // requests only (smaller values are raised to 20 MiB).
  const size_t request_mib = request / kMiBytes;
  if (!f.expandable_segments && f.max_split_size == std::numeric_limits<size_t>::max() &&
      request_mib >= kMinMaxSplitMiB)
    settings.push_back(fmt::format("max_split_size_mb:{}", request_mib));
  if (settings.empty()) {
    out.emplace_back("  would help: no setting (expandable_segments is on): fewer live blocks");
    return;
  }
  out.push_back("  would help: TALLY_ALLOC_CONF=" + settings[0]);
  for (size_t i = 1; i < settings.size(); ++i)
    out.push_back(fmt::format("  or TALLY_ALLOC_CONF={} (blocks >= {} MiB stay whole)", settings[i],
                              request_mib));
}

}  // namespace

std::vector<std::string> fragmentation_diagnosis(const FragmentationInfo& f) {
  std::vector<std::string> out;
  const OomRecord& oom = f.last_oom;
  const bool failed = oom.requested > 0;
  const size_t request = failed ? oom.size : f.largest_request;
  if (request == 0 && f.free_bytes[kAllPools] == 0) {
    out.emplace_back("Diagnosis: nothing allocated and nothing cached");
    return out;
  }
  const bool small = failed ? oom.small_pool : f.largest_request_small;
  const PoolIndex pool = small ? kSmallPool : kLargePool;
  const size_t largest = failed ? oom.largest_free : f.largest_free[pool];
  if (request == 0) {
    out.push_back(fmt::format("Diagnosis: {} cached free, no request since the peaks were reset",
                              short_size(f.free_bytes[kAllPools])));
  } else {
    const std::string_view pool_name = small ? "small" : "large";
    out.push_back(fmt::format(
        "Diagnosis: largest free block {} {} {} request {}", short_size(largest),
        largest < request ? "<" : ">=", failed ? "failed" : "largest", short_size(request)));
    if (failed)
      out.push_back(fmt::format("  {} pool, {}: {} free in the pool when it failed", pool_name,
                                category_name(oom.category), short_size(oom.free_bytes)));
    else
      out.push_back(
          fmt::format("  {} pool: {} free in the pool", pool_name, short_size(f.free_bytes[pool])));
  }

  for (const PoolIndex p : {kLargePool, kSmallPool}) {
    if (f.free_bytes[p] == 0) continue;
    out.push_back(fmt::format("  free in the {} pool: {} in {}, {} releasable",
                              p == kSmallPool ? "small" : "large", short_size(f.free_bytes[p]),
                              count_of(f.free_segments[p], "segment"),
                              short_size(f.releasable[p])));
  }
  for (size_t i = 0; i < f.segments.size() && i < 2; ++i) {
    const FreeSegment& s = f.segments[i];
    out.push_back(fmt::format("  segment {:#x} ({}): {}, {} free", s.address, short_size(s.size),
                              count_of(s.free_blocks, "free block"), short_size(s.free_bytes)));
  }

  std::vector<std::pair<int64_t, Category>> cats;
  for (const Category c : kAllCategories)
    if (const int64_t b = f.interleaved[static_cast<size_t>(c)]; b > 0) cats.emplace_back(b, c);
  std::sort(cats.begin(), cats.end(), [](const auto& a, const auto& b) { return a > b; });
  if (!cats.empty()) {
    std::string line = "  interleaved with:";
    for (size_t i = 0; i < cats.size(); ++i) {
      const std::string item = fmt::format("{} {} {}", i ? "," : "", category_name(cats[i].second),
                                           short_size(static_cast<size_t>(cats[i].first)));
      if (line.size() + item.size() > kInnerWidth - 1) break;
      line += item;
    }
    out.push_back(line);
  }
  append_advice(out, f, request, largest, failed);
  return out;
}

namespace {

void append_diagnosis(std::vector<std::string>& lines, const FragmentationInfo& f) {
  for (const std::string& line : fragmentation_diagnosis(f)) lines.push_back(fit(" " + line));
}

}  // namespace

std::string with_parameter_split(const std::string& summary, const ParameterSplit& split) {
  const std::string row = "| " + std::string(category_name(Category::parameter)) + " ";
  size_t at = summary.find(row);
  if (at == std::string::npos) return summary;
  at = summary.find('\n', at);
  if (at == std::string::npos) return summary;
  std::string rows;
  for (const auto& [name, count, bytes] :
       {std::tuple{"trainable", split.trainable, split.trainable_bytes},
        std::tuple{"frozen", split.frozen, split.frozen_bytes}}) {
    std::string n = format_count(count, count);  // "    294 K ": "294K"
    std::erase(n, ' ');
    rows +=
        "|" +
        fit(fmt::format(" {:<21} | {} | {:>10} | {:>10} | {:>7}", fmt::format("  {} {}", name, n),
                        format_size(bytes, bytes), "", "", "")) +
        "|\n";
  }
  return summary.substr(0, at + 1) + rows + summary.substr(at + 1);
}

std::string format_memory_summary(const DeviceStats& stats, int device_id,
                                  const std::string& device_label, bool abbreviated,
                                  const FragmentationInfo* fragmentation) {
  std::vector<std::string> lines;
  lines.reserve(84);
  append_pytorch_table(lines, stats, device_id, device_label, abbreviated);
  append_category_table(lines, stats);
  if (fragmentation) append_diagnosis(lines, *fragmentation);
  lines.emplace_back(kInnerWidth, '=');

  std::string out;
  out.reserve(lines.size() * (kInnerWidth + 3));
  for (const std::string& line : lines) {
    out += '|';
    out += line;
    out += "|\n";
  }
  return out;
}

}  // namespace tally::memory
