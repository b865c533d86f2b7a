#include "memory/alloc_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstdlib>
#include <stdexcept>
#include <vector>

namespace tally::memory {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

[[noreturn]] void bad(std::string_view key, std::string_view value, std::string_view why) {
  throw std::invalid_argument(
      fmt::format("TALLY_ALLOC_CONF: bad value '{}' for key '{}': {}", value, key, why));
}

size_t parse_uint(std::string_view key, std::string_view v) {
  v = trim(v);
  size_t out = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (v.empty() || ec != std::errc() || p != v.data() + v.size())
    bad(key, v, "expected a non-negative integer");
  return out;
}

double parse_double(std::string_view key, std::string_view v) {
  v = trim(v);
  std::string s(v);
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) bad(key, v, "expected a number");
  return d;
}

bool parse_bool(std::string_view key, std::string_view v) {
  v = trim(v);
  if (v == "True" || v == "true" || v == "1") return true;
  if (v == "False" || v == "false" || v == "0") return false;
  bad(key, v, "expected True or False");
}

size_t checked_mib(std::string_view key, std::string_view v) {
  const size_t mb = parse_uint(key, v);
  if (mb > (std::numeric_limits<size_t>::max() >> 20)) bad(key, v, "too large");
  return mb;
}

void parse_divisions(std::string_view key, std::string_view v, AllocatorConfig& cfg) {
  v = trim(v);
  // PyTorch's rule: 0 (no rounding) or a power of 2. Bounded by 2^30 (PyTorch read the value
  // as an int for years, and 2^30 steps cut even a 1 GiB interval to single bytes): a value
  // like 2^63 would disable rounding silently and leave int64's range in the snapshot.
  auto check_pow2 = [&](size_t d, std::string_view text) {
    if (d != 0 && !std::has_single_bit(d)) bad(key, text, "divisions must be a power of 2");
    if (d > kMaxRoundupDivisions)
      bad(key, text,
          fmt::format("divisions must be at most 2^30 ({}), a power of 2 or 0",
                      kMaxRoundupDivisions));
  };
  if (v.empty()) bad(key, v, "empty value");
  if (v.front() != '[') {
    const size_t d = parse_uint(key, v);
    check_pow2(d, v);
    cfg.roundup_power2_divisions.fill(d);
    return;
  }
  if (v.back() != ']') bad(key, v, "missing ']'");
  std::string_view body = v.substr(1, v.size() - 2);
  size_t last_index = 0;
  bool first = true;
  std::vector<std::string_view> intervals;  // as written: an interval given twice is an error
  while (!body.empty()) {
    const size_t comma = body.find(',');
    std::string_view item = trim(body.substr(0, comma));
    body = comma == std::string_view::npos ? std::string_view() : body.substr(comma + 1);
    const size_t colon = item.find(':');
    if (colon == std::string_view::npos) bad(key, item, "expected interval:divisions");
    const std::string_view interval = trim(item.substr(0, colon));
    if (std::find(intervals.begin(), intervals.end(), interval) != intervals.end())
      bad(key, v, fmt::format("interval '{}' is given twice", interval));
    intervals.push_back(interval);
    const size_t d = parse_uint(key, item.substr(colon + 1));
    check_pow2(d, item);
    if (interval == ">") {
      const size_t from = first ? 0 : last_index + 1;
      for (size_t i = from; i < kRoundupIntervals; ++i) cfg.roundup_power2_divisions[i] = d;
      continue;
    }
    const size_t mb = parse_uint(key, interval);
    if (!std::has_single_bit(mb)) bad(key, item, "intervals must be a power of 2 (MiB)");
    size_t index = static_cast<size_t>(std::bit_width(mb) - 1);
    index = std::min(index, kRoundupIntervals - 1);
    if (first) {
      for (size_t i = 0; i < index; ++i) cfg.roundup_power2_divisions[i] = d;
    }
    cfg.roundup_power2_divisions[index] = d;
    last_index = index;
    first = false;
  }
}

// Split on commas that are not inside [...].
std::vector<std::string_view> split_top_level(std::string_view s) {
  std::vector<std::string_view> out;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || (s[i] == ',' && depth == 0)) {
      out.push_back(s.substr(start, i - start));
      start = i + 1;
    } else if (s[i] == '[') {
      ++depth;
    } else if (s[i] == ']') {
      --depth;
    }
  }
  return out;
}

}  // namespace

size_t AllocatorConfig::divisions_for(size_t size) const {
  const int log_size = std::bit_width(size) - 1;
  int index = log_size - 20;
  index = std::clamp(index, 0, static_cast<int>(kRoundupIntervals) - 1);
  return roundup_power2_divisions[static_cast<size_t>(index)];
}

AllocatorConfig AllocatorConfig::parse(std::string_view conf) {
  AllocatorConfig cfg;
  cfg.settings = std::string(conf);
  if (trim(conf).empty()) return cfg;
  std::vector<std::string_view> keys;  // a key given twice is refused, not "the last one wins"
  for (std::string_view item : split_top_level(conf)) {
    item = trim(item);
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    if (colon == std::string_view::npos)
      throw std::invalid_argument(
          fmt::format("TALLY_ALLOC_CONF: expected key:value, got '{}'", item));
    const std::string_view key = trim(item.substr(0, colon));
    const std::string_view value = item.substr(colon + 1);
    if (std::find(keys.begin(), keys.end(), key) != keys.end())
      throw std::invalid_argument(fmt::format(
          "TALLY_ALLOC_CONF: key '{}' is given twice (in '{}'); give each key once", key, conf));
    keys.push_back(key);
    if (key == "max_split_size_mb") {
      const size_t mb = std::max<size_t>(checked_mib(key, value), 20);
      cfg.max_split_size = mb * kMiB;
    } else if (key == "max_non_split_rounding_mb") {
      cfg.max_non_split_rounding = checked_mib(key, value) * kMiB;
    } else if (key == "large_segment_size_mb") {
      const size_t mb = checked_mib(key, value);
      if (mb < 2 || mb % 2 != 0) bad(key, value, "must be an even number of MiB >= 2");
      cfg.large_segment_size = mb * kMiB;
    } else if (key == "roundup_power2_divisions") {
      parse_divisions(key, value, cfg);
    } else if (key == "garbage_collection_threshold") {
      const double t = parse_double(key, value);
      if (!(t > 0.0 && t < 1.0)) bad(key, value, "must be in (0, 1)");
      cfg.garbage_collection_threshold = t;
    } else if (key == "expandable_segments") {
      cfg.expandable_segments = parse_bool(key, value);
    } else if (key == "reclaim_on_growth") {
      cfg.reclaim_on_growth = parse_bool(key, value);
    } else if (key == "release_lock_on_cudamalloc" || key == "pinned_use_cuda_host_register") {
      parse_bool(key, value);  // accepted for compatibility; no effect
    } else if (key == "backend") {
      if (trim(value) != "native") bad(key, value, "only the native backend exists");
    } else if (key == "oom_snapshot") {
      cfg.oom_snapshot_path = std::string(trim(value));
    } else {
      throw std::invalid_argument(fmt::format("TALLY_ALLOC_CONF: unknown key '{}'", key));
    }
  }
  if (cfg.reclaim_on_growth && !cfg.expandable_segments)
    throw std::invalid_argument(
        "TALLY_ALLOC_CONF: reclaim_on_growth:True needs expandable_segments:True (it unmaps the "
        "free pages of expandable segments)");
  return cfg;
}

AllocatorConfig AllocatorConfig::from_env() {
  const char* env = std::getenv("TALLY_ALLOC_CONF");
  return parse(env ? env : "");
}

}  // namespace tally::memory
