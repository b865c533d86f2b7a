// The one chart renderer and palette of Tally's HTML pages (the A/B report, the profiler's
// memory timeline, the snapshot diff): a small JavaScript library each page inlines, with the
// palette (memory::category_color for categories, phase_color for phase bands) built in.
//
// `TallyChart` (what chart_script() defines):
//   el(parent, tag, attrs), text(parent, x, y, s, attrs), tip(node, s)   SVG building
//   human(bytes), group("12345.6")                                     "1.2 MiB", "12,345.6"
//   niceStep(span, n)          1, 2 or 5 x 10^k: the step giving about n intervals over span
//   byteAxis(max, n), timeAxis(maxMs, n), countAxis(max, n)
//                              a round axis from 0: {unit, scale, step, top, ticks, label(v)}
//                              (bytes in B/KiB/MiB/GiB, time in µs/ms/s)
//   fitX(frame, make)          the axis make(n) with the most ticks whose labels do not touch
//   frame(W, H, L, R, T, B)    a plot area with x(v, axis) / y(v, axis) mappings
//   axes(svg, f, xa, ya, xTitle, yTitle)   grid, tick marks and labels (class xtick / ytick)
//   layoutPhases(runs)         one band per phase: {outer, inner} (a phase nested in another,
//                              as recompute in backward, is drawn as marks inside it)
//   phaseBands(svg, f, xa, runs)   the bands: a labelled strip above the plot (labels full,
//                              short or left out, never overlapping) and light backgrounds
//   hover(svg, f, xa, readout, fn)   a cursor line and a readout of fn(value) under the mouse
//   check()                    marks <body> with data-overlaps (touching labels; data-touching
//                              names some), data-overflow
//                              (elements past the viewport's right edge) and data-untick
//                              (charts without x or y ticks): what the tests read
//   colors.categories, colors.phases   the palette, as JSON objects
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
