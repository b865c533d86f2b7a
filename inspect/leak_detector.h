// LeakDetector: finds the allocations of a training loop that outlive their step and pile up
// from step to step, and names the line that makes them.
//
//   inspect::LeakDetector leaks(dev);
//   for (...) { ...forward, backward, step...; leaks.step(); }
//   std::cout << leaks.report();
// The rule, what a site is, and the cost: docs/notes.md §11.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "memory/category.h"
#include "memory/context.h"
#include "memory/memory.h"

namespace tally::inspect {

// The allocator's public records this detector reads.
using memory::AllocTag;
using memory::BlockInfo;
using memory::CachingAllocator;
using memory::Category;
using memory::default_device;
using memory::Device;
using memory::StrId;

struct LeakDetectorOptions {
  // Boundaries whose growth is not counted (the first steps build optimizer state and the
  // like once). >= 0.
  int64_t warmup_steps = 2;
  // A site is a leak once it grew at this many consecutive boundaries. >= 1.
  int64_t window = 3;
  // Growth slower than this (bytes per step) is not reported.
  size_t min_bytes_per_step = 1;
};

// Where a group of allocations came from.
struct AllocSite {
  Category category = Category::unknown;
  std::string module;    // dotted module path ("" at top level)
  std::string op;        // op name ("" when allocated outside an op)
  std::string phase;     // "forward", "backward", "optimizer", ... ("" when unset)
  std::string file;      // display_source_path ("examples/train_gpt.cpp"; "" when unknown)
  uint32_t line = 0;     // the user's line (AllocTag::loc)
  std::string function;  // the C++ function of that line

  // "examples/train_gpt.cpp:250" ("??" when unknown).
  std::string location() const;
  // "examples/train_gpt.cpp:250 activation module=h.0.attn op=linear phase=forward".
  std::string str() const;
};

struct Leak {
  AllocSite site;
  int64_t confirmed_step = 0;    // the boundary at which it was found
  int64_t growing_since = 0;     // the boundary its growth run starts from
  int64_t last_growth_step = 0;  // the last boundary at which it grew
  double bytes_per_step = 0;     // gained from growing_since to last_growth_step, per step
  int64_t live_bytes = 0;        // at the latest boundary
  int64_t live_blocks = 0;       // at the latest boundary
  bool growing = false;          // it grew at the latest boundary

  // "examples/train_gpt.cpp:250 leaks 12.0 KiB per step (activation, module h.0.attn, op
  // linear, phase forward; 60.0 KiB in 5 blocks live; since step 3)".
  std::string describe() const;
};

// Leaks summed by their line.
struct LeakingLine {
  std::string location;  // "examples/train_gpt.cpp:250"
  double bytes_per_step = 0;
  int64_t live_bytes = 0;
  int64_t sites = 0;
  int64_t since_step = 0;    // the earliest growing_since among its sites
  std::string largest_site;  // the site with the most bytes per step (AllocSite::str)

  // "examples/train_gpt.cpp:250 leaks 1.2 MiB per step (34 sites, 7.5 MiB live, since step 3;
  // largest: activation module=h.0.attn op=linear phase=forward)".
  std::string describe() const;
};

// `leaks` grouped by line, most bytes per step first.
std::vector<LeakingLine> group_by_line(const std::vector<Leak>& leaks);

class LeakDetector {
 public:
  explicit LeakDetector(Device device = default_device(), LeakDetectorOptions options = {});
  LeakDetector(const LeakDetector&) = delete;
  LeakDetector& operator=(const LeakDetector&) = delete;

  // A step boundary: call once per training step, after its optimizer step. Returns the
  // leaks found at this boundary (each site once, the first time it qualifies).
  std::vector<Leak> step();

  // Boundaries so far.
  int64_t steps() const { return step_; }
  bool found() const { return !confirmed_.empty(); }
  // Every leak found so far, with its numbers as of the latest boundary, most bytes per step
  // first.
  std::vector<Leak> leaks() const;
  std::vector<LeakingLine> leaking_lines() const { return group_by_line(leaks()); }
  // A readable report: the leaking lines, then their sites (at most `max_sites`); or that
  // none was found, with the rule.
  std::string report(size_t max_sites = 20) const;

  Device device() const { return device_; }
  const LeakDetectorOptions& options() const { return options_; }

 private:
  struct SiteKey {
    Category category;
    StrId module, op, phase, file;
    uint32_t line;
    bool operator==(const SiteKey&) const = default;
  };
  struct SiteKeyHash {
    size_t operator()(const SiteKey& k) const;
  };
  struct LiveBlock {
    uint64_t address;
    size_t size;
    SiteKey key;
  };
  struct Now {
    int64_t bytes = 0, blocks = 0, new_bytes = 0;
  };
  struct SiteState {
    int64_t bytes = 0, blocks = 0;
    const char* function = "";
    int64_t run = 0;              // consecutive counted boundaries with growth
    int64_t run_start_step = 0;   // the boundary before the run
    int64_t run_start_bytes = 0;  // its bytes then
    bool confirmed = false;
    Leak leak;  // when confirmed
  };

  SiteKey key_of(const AllocTag& tag);
  Leak leak_of(const SiteKey& key, const SiteState& s) const;

  Device device_;
  LeakDetectorOptions options_;
  CachingAllocator& allocator_;
  int64_t step_ = 0;
  std::vector<LiveBlock> previous_;  // the blocks alive at the previous boundary, by address
  std::vector<LiveBlock> current_;
  std::unordered_map<SiteKey, SiteState, SiteKeyHash> sites_;
  std::unordered_map<SiteKey, Now, SiteKeyHash> now_;
  std::unordered_map<const char*, StrId> files_;  // source_location file -> display path id
  std::vector<SiteKey> confirmed_;                // the leaking sites, in the order found
};

}  // namespace tally::inspect
