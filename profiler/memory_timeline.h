// The memory timeline of a recorded window: live bytes per category on one device after
// each allocator event, in PyTorch's export_memory_timeline layout
// (docs/memory-formats.md §5.2 and §7):
//
//   .json  [times_us, sizes]: times in µs since the Unix epoch; sizes[i] one row of 13 ints:
//          col 0 always 0; 1 parameter, 2 optimizer_state, 3 input, 4 temporary,
//          5 activation, 6 gradient (PyTorch's order), 7 autograd_detail (always 0 in
//          Tally), 8 unknown; Tally's extras: 9 workspace, 10 autocast_cache,
//          11 communication, 12 offloaded. The first row is the state when the window opened.
//   .html  one self-contained page: an inline <svg> stacked-area chart drawn by an inline
//          script from embedded data (no network), phase bands (forward / backward /
//          optimizer ...), a legend; the script marks <body data-rendered="1"
//          data-paths="N"> when it has drawn.
#pragma once

#include <array>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "memory/timeline.h"
#include "profiler/events.h"

namespace tally::profiler {

inline constexpr int kTimelineColumns = memory::kTimelineColumns;  // memory/timeline.h

// The column of a Tally category in the timeline rows.
using memory::timeline_column;  // the JSON column of a category (memory/timeline.h)
// Names of columns 1..12 as the legend shows them ("parameter", ..., "offloaded").
const std::array<const char*, kTimelineColumns>& timeline_column_names();

struct PhaseBand {
  std::string phase;
  int64_t start_us = 0, end_us = 0;  // µs since the epoch
};

struct MemoryTimeline {
  memory::Device device;
  std::vector<int64_t> times_us;
  std::vector<std::array<int64_t, kTimelineColumns>> sizes;
  std::vector<size_t> allocated;  // memory_allocated() after each row's event
  std::vector<size_t> reserved;   // memory_reserved() after each row's event
  std::vector<PhaseBand> phases;  // outermost phase spans of the thread that had them
  // The HTML page's: a title (e.g. the A/B configuration) and a link back to the page that
  // lists it (relative), both left out when empty.
  std::string title;
  std::string back_link;
};

MemoryTimeline build_memory_timeline(const ProfileData& data, memory::Device device);
void write_memory_timeline_json(const MemoryTimeline& t, std::ostream& out);
void write_memory_timeline_html(const MemoryTimeline& t, std::ostream& out);

}  // namespace tally::profiler
