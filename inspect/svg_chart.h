// The one chart renderer and palette of Tally's HTML pages (the A/B report, the profiler's
// memory timeline, the snapshot diff): a small JavaScript library each page inlines, with the
// palette (memory::category_color for categories, phase_color for phase bands) built in.
// The chart's API and layout: docs/notes.md §16.
#pragma once

#include <string>
#include <string_view>

namespace tally::inspect {

// The colour of a phase band ("forward", "backward", "optimizer", "recompute", "data"; any
// other phase: a light grey), as CSS "#rrggbb".
std::string_view phase_color(std::string_view phase);

// {"parameter": "#1f77b4", ...}: category_color of every category.
std::string category_colors_json();
// {"forward": "#...", ..., "other": "#..."}: phase_color of every named phase.
std::string phase_colors_json();

// The library's source (plain JavaScript, no network, defines `TallyChart`), to inline in a
// page's <script> after the page's first <svg> element (its namespace is read from there) and
// before the page's own drawing code.
const std::string& chart_script();

}  // namespace tally::inspect
