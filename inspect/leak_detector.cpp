// LeakDetector: surviving allocations grouped by site, growth counted per step boundary (see
// leak_detector.h for the rule).
#include "inspect/leak_detector.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string_view>

#include "base/bytes.h"
#include "base/check_arg.h"

namespace tally::inspect {

using memory::category_name;
using memory::display_source_path;
using memory::intern;
using memory::interned;
namespace {

std::string fmt_bytes(double b) {
  return base::format_bytes(b);
}

bool by_address(uint64_t a_addr, size_t a_size, uint64_t b_addr, size_t b_size) {
  return a_addr != b_addr ? a_addr < b_addr : a_size < b_size;
}

}  // namespace

// ---------------------------------------------------------------- sites and leaks

std::string AllocSite::location() const {
  if (file.empty()) return "??";
  return line ? fmt::format("{}:{}", file, line) : file;
}

std::string AllocSite::str() const {
  std::string s = fmt::format("{} {}", location(), category_name(category));
  if (!module.empty()) s += " module=" + module;
  s += " op=" + (op.empty() ? (function.empty() ? std::string("<no op>") : function) : op);
  if (!phase.empty()) s += " phase=" + phase;
  return s;
}

std::string Leak::describe() const {
  std::string what(category_name(site.category));
  if (!site.module.empty()) what += ", module " + site.module;
  if (!site.op.empty()) what += ", op " + site.op;
  if (!site.phase.empty()) what += ", phase " + site.phase;
  return fmt::format("{} leaks {} per step ({}; {} in {} block{} live; since step {})",
                     site.location(), fmt_bytes(bytes_per_step), what,
                     fmt_bytes(static_cast<double>(live_bytes)), live_blocks,
                     live_blocks == 1 ? "" : "s", growing_since);
}

std::string LeakingLine::describe() const {
  return fmt::format("{} leaks {} per step ({} site{}, {} live, since step {}; largest: {})",
                     location, fmt_bytes(bytes_per_step), sites, sites == 1 ? "" : "s",
                     fmt_bytes(static_cast<double>(live_bytes)), since_step, largest_site);
}

std::vector<LeakingLine> group_by_line(const std::vector<Leak>& leaks) {
  std::map<std::string, LeakingLine> lines;
  std::map<std::string, double> largest;
  for (const Leak& l : leaks) {
    const std::string loc = l.site.location();
    auto [it, inserted] = lines.try_emplace(loc);
    LeakingLine& line = it->second;
    if (inserted) {
      line.location = loc;
      line.since_step = l.growing_since;
    }
    line.bytes_per_step += l.bytes_per_step;
    line.live_bytes += l.live_bytes;
    ++line.sites;
    line.since_step = std::min(line.since_step, l.growing_since);
    double& top = largest[loc];
    if (inserted || l.bytes_per_step > top) {
      top = l.bytes_per_step;
      line.largest_site = l.site.str().substr(loc.size() + 1);  // without the location
    }
  }
  std::vector<LeakingLine> out;
  for (auto& [loc, line] : lines) out.push_back(std::move(line));
  std::stable_sort(out.begin(), out.end(), [](const LeakingLine& a, const LeakingLine& b) {
    return a.bytes_per_step > b.bytes_per_step;
  });
  return out;
}

// ---------------------------------------------------------------- the detector

size_t LeakDetector::SiteKeyHash::operator()(const SiteKey& k) const {
  uint64_t h = static_cast<uint64_t>(k.category);
  for (uint64_t v :
       {uint64_t{k.module}, uint64_t{k.op}, uint64_t{k.phase}, uint64_t{k.file}, uint64_t{k.line}})
    h = (h ^ v) * 0x100000001b3ULL + (h >> 29);
  return static_cast<size_t>(h);
}

LeakDetector::LeakDetector(Device device, LeakDetectorOptions options)
    : device_(device), options_(options), allocator_(get_allocator(device)) {
  base::check_at_least(options_.warmup_steps, 0, "LeakDetector: warmup_steps");
  base::check_at_least(options_.window, 1, "LeakDetector: window");
}

LeakDetector::SiteKey LeakDetector::key_of(const AllocTag& tag) {
  auto [it, inserted] = files_.try_emplace(tag.loc.file, 0);
  if (inserted) it->second = intern(display_source_path(tag.loc.file));
  return SiteKey{tag.category, tag.module, tag.op, tag.phase, it->second, tag.loc.line};
}

std::vector<Leak> LeakDetector::step() {
  ++step_;
  const bool counted = step_ > options_.warmup_steps;

  // The live blocks, by address, each with its site.
  current_.clear();
  now_.clear();
  for (const BlockInfo& b : allocator_.allocated_blocks()) {
    const SiteKey key = key_of(b.tag);
    current_.push_back(LiveBlock{b.address, b.size, key});
    SiteState& s = sites_[key];
    if (s.blocks == 0 && !s.confirmed && s.run == 0 && b.tag.loc.function)
      s.function = b.tag.loc.function;
  }
  std::sort(current_.begin(), current_.end(), [](const LiveBlock& a, const LiveBlock& b) {
    return by_address(a.address, a.size, b.address, b.size);
  });

  // Bytes per site, and those of blocks that were not alive at the previous boundary.
  for (const LiveBlock& b : current_) {
    Now& n = now_[b.key];
    n.bytes += static_cast<int64_t>(b.size);
    ++n.blocks;
    auto it = std::lower_bound(previous_.begin(), previous_.end(), b,
                               [](const LiveBlock& x, const LiveBlock& y) {
                                 return by_address(x.address, x.size, y.address, y.size);
                               });
    const bool survived_before =
        it != previous_.end() && it->address == b.address && it->size == b.size && it->key == b.key;
    if (!survived_before) n.new_bytes += static_cast<int64_t>(b.size);
  }
  previous_.swap(current_);

  std::vector<Leak> found;
  for (auto it = sites_.begin(); it != sites_.end();) {
    const SiteKey& key = it->first;
    SiteState& s = it->second;
    const auto n_it = now_.find(key);
    const Now n = n_it == now_.end() ? Now{} : n_it->second;
    const bool grew = n.bytes > s.bytes && n.new_bytes > 0;
    if (counted && grew) {
      if (s.run == 0 && !s.confirmed) {
        s.run_start_step = step_ - 1;
        s.run_start_bytes = s.bytes;
      }
      ++s.run;
    } else {
      s.run = 0;
    }
    s.bytes = n.bytes;
    s.blocks = n.blocks;
    if (s.confirmed) {
      // A leak keeps its start; its rate is over everything gained until its last growth.
      s.leak.live_bytes = s.bytes;
      s.leak.live_blocks = s.blocks;
      s.leak.growing = s.run > 0;
      if (s.run > 0) {
        s.leak.last_growth_step = step_;
        s.leak.bytes_per_step = static_cast<double>(s.bytes - s.run_start_bytes) /
                                static_cast<double>(step_ - s.run_start_step);
      }
    } else if (s.run >= options_.window) {
      const double rate = static_cast<double>(s.bytes - s.run_start_bytes) /
                          static_cast<double>(step_ - s.run_start_step);
      if (rate >= static_cast<double>(options_.min_bytes_per_step)) {
        s.confirmed = true;
        s.leak = leak_of(key, s);
        s.leak.confirmed_step = step_;
        s.leak.growing_since = s.run_start_step;
        s.leak.last_growth_step = step_;
        s.leak.bytes_per_step = rate;
        s.leak.growing = true;
        confirmed_.push_back(key);
        found.push_back(s.leak);
      }
    }
    // A site with nothing alive and no growth run starts from zero when it comes back: the
    // same as keeping it, without the map filling with every temporary site ever seen.
    if (s.bytes == 0 && s.run == 0 && !s.confirmed)
      it = sites_.erase(it);
    else
      ++it;
  }
  return found;
}

Leak LeakDetector::leak_of(const SiteKey& key, const SiteState& s) const {
  Leak l;
  l.site.category = key.category;
  l.site.module = interned(key.module);
  l.site.op = interned(key.op);
  l.site.phase = interned(key.phase);
  l.site.file = interned(key.file);
  l.site.line = key.line;
  l.site.function = s.function ? s.function : "";
  l.live_bytes = s.bytes;
  l.live_blocks = s.blocks;
  return l;
}

std::vector<Leak> LeakDetector::leaks() const {
  std::vector<Leak> out;
  for (const SiteKey& k : confirmed_) out.push_back(sites_.at(k).leak);
  std::stable_sort(out.begin(), out.end(), [](const Leak& a, const Leak& b) {
    return a.bytes_per_step > b.bytes_per_step;
  });
  return out;
}

std::string LeakDetector::report(size_t max_sites) const {
  std::string out = fmt::format(
      "Leak detector ({}, {} step{}): a site leaks when the bytes it keeps alive across steps "
      "grow at {} consecutive step boundaries after {} warm-up step{}.\n",
      device_.str(), step_, step_ == 1 ? "" : "s", options_.window, options_.warmup_steps,
      options_.warmup_steps == 1 ? "" : "s");
  const std::vector<Leak> all = leaks();
  if (all.empty()) {
    if (step_ < options_.warmup_steps + options_.window)
      out += fmt::format("No leak found, but {} steps cannot show one (it takes {}).\n", step_,
                         options_.warmup_steps + options_.window);
    else
      out += "No leak found.\n";
    return out;
  }
  double total = 0;
  for (const Leak& l : all) total += l.bytes_per_step;
  const std::vector<LeakingLine> lines = group_by_line(all);
  out +=
      fmt::format("LEAK: {} per step at {} line{} ({} site{}):\n", fmt_bytes(total), lines.size(),
                  lines.size() == 1 ? "" : "s", all.size(), all.size() == 1 ? "" : "s");
  for (const LeakingLine& l : lines) out += "  " + l.describe() + "\n";
  out += fmt::format("{:>14} {:>12} {:>7} {:>6} {:>8}  site\n", "per step", "live", "blocks",
                     "since", "growing");
  for (size_t i = 0; i < all.size() && i < max_sites; ++i) {
    const Leak& l = all[i];
    out += fmt::format("{:>14} {:>12} {:>7} {:>6} {:>8}  {}\n", fmt_bytes(l.bytes_per_step),
                       fmt_bytes(static_cast<double>(l.live_bytes)), l.live_blocks, l.growing_since,
                       l.growing ? "yes" : "stopped", l.site.str());
  }
  if (all.size() > max_sites) out += fmt::format("  ... {} more sites\n", all.size() - max_sites);
  return out;
}

}  // namespace tally::inspect
