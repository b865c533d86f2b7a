// Memory timeline: per-category live bytes over the window, as PyTorch-layout JSON and as a
// self-contained HTML page (see memory_timeline.h).
#include "profiler/memory_timeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <ostream>
#include <stdexcept>

#include "base/atomic_file.h"
#include "base/bytes.h"
#include "base/json.h"
#include "base/rank_path.h"
#include "inspect/svg_chart.h"
#include "memory/timeline.h"
#include "profiler/chrome_trace.h"
#include "profiler/profiler.h"

namespace tally::profiler {

const std::array<const char*, kTimelineColumns>& timeline_column_names() {
  static const std::array<const char*, kTimelineColumns> names = {
      "",          "parameter",  "optimizer_state", "input",
      "temporary", "activation", "gradient",        "autograd_detail",
      "unknown",   "workspace",  "autocast_cache",  "communication",
      "offloaded"};
  return names;
}

MemoryTimeline build_memory_timeline(const ProfileData& data, memory::Device device) {
  MemoryTimeline t;
  t.device = device;
  const int64_t base_us = data.base_time_ns / 1000;
  std::array<int64_t, kTimelineColumns> row{};
  size_t allocated = 0, reserved = 0;
  for (const InitialMemory& im : data.initial) {
    if (!(im.device == device)) continue;
    for (memory::Category c : memory::kAllCategories)
      row[static_cast<size_t>(timeline_column(c))] += im.category_bytes[static_cast<int>(c)];
    allocated = im.total_allocated;
    reserved = im.total_reserved;
  }
  auto emit = [&](int64_t time_us) {
    t.times_us.push_back(time_us);
    t.sizes.push_back(row);
    t.allocated.push_back(allocated);
    t.reserved.push_back(reserved);
  };
  emit(base_us);
  for (const MemoryEvent& m : data.memory) {
    if (!(m.device == device)) continue;
    if (m.retag) {
      row[static_cast<size_t>(timeline_column(m.old_category))] -= m.bytes;
      row[static_cast<size_t>(timeline_column(m.category))] += m.bytes;
    } else {
      row[static_cast<size_t>(timeline_column(m.category))] += m.bytes;
    }
    allocated = m.total_allocated;
    reserved = m.total_reserved;
    emit(base_us + m.time_ns / 1000);
  }
  // Outermost phase spans, per thread.
  std::map<uint64_t, int64_t> covered_until;
  for (const CpuSpan& s : data.spans) {
    if (s.kind != SpanKind::phase) continue;
    auto [it, fresh] = covered_until.try_emplace(s.tid, -1);
    if (s.start_ns < it->second) continue;  // nested in the previous outer phase
    it->second = s.end_ns;
    t.phases.push_back({s.name, base_us + s.start_ns / 1000, base_us + s.end_ns / 1000});
  }
  return t;
}

void write_memory_timeline_json(const MemoryTimeline& t, std::ostream& out) {
  out << "[[";
  for (size_t i = 0; i < t.times_us.size(); ++i) out << (i ? ", " : "") << t.times_us[i];
  out << "], [";
  for (size_t i = 0; i < t.sizes.size(); ++i)
    out << (i ? ", " : "") << "[" << fmt::format("{}", fmt::join(t.sizes[i], ", ")) << "]";
  out << "]]";
}

namespace {

// The colour of a column: memory::category_color of its category (one palette on every page);
// autograd_detail (always 0 in Tally) grey.
std::string column_color(int column) {
  for (memory::Category c : memory::kAllCategories)
    if (timeline_column(c) == column) return std::string(memory::category_color(c));
  return "#bbbbbb";
}

// The page's drawing script (after inspect/svg_chart.h's TallyChart). It reads the JSON in
// <script id="data">, draws a step-wise stacked area per non-empty category into
// <svg id="chart">, one band per phase above it, round ticks on both axes, the reserved line
// and a legend, a hover readout, then marks the body with data-rendered / data-paths.
constexpr const char* kScript = R"JS(
(function () {
  var C = TallyChart;
  var d = JSON.parse(document.getElementById('data').textContent);
  var svg = document.getElementById('chart');
  var f = C.frame(1200, 560, 80, 20, 40, 50);
  var n = d.t.length;
  var t0 = n ? d.t[0] : 0, t1 = n ? Math.max(d.t[n - 1], t0 + 1) : 1;
  if (d.phases.length) t1 = Math.max(t1, d.phases[d.phases.length - 1].end);
  var hasReserved = d.reserved.length === n;
  var ymax = 1;
  for (var i = 0; i < n; i++) {
    var s = 0;
    for (var c = 1; c < d.sizes[i].length; c++) s += Math.max(0, d.sizes[i][c]);
    ymax = Math.max(ymax, s, hasReserved ? d.reserved[i] : 0);
  }
  var ya = C.byteAxis(ymax, 6);
  var xa = C.fitX(f, function (k) { return C.timeAxis((t1 - t0) / 1000, k); });
  function x(tu) { return f.x((tu - t0) / 1000, xa); }
  function y(b) { return f.y(b, ya); }
  C.phaseBands(svg, f, xa, d.phases.map(function (p) {
    return {name: p.name, start: (p.start - t0) / 1000, end: (p.end - t0) / 1000};
  }));
  C.axes(svg, f, xa, ya, 'Time (' + xa.unit + ')', 'Memory (' + ya.unit + ')');
  var base = new Array(n).fill(0), paths = 0, shown = [];
  for (var c = 1; c < d.names.length; c++) {
    var any = false, peak = 0;
    for (var i = 0; i < n; i++) { if (d.sizes[i][c] !== 0) any = true; peak = Math.max(peak, d.sizes[i][c]); }
    if (!any) continue;
    shown.push(c);
    var top = [], bottom = [];
    for (var i = 0; i < n; i++) {
      var xa_ = x(d.t[i]), xb = x(i + 1 < n ? d.t[i + 1] : t1);
      var lo = base[i], hi = base[i] + Math.max(0, d.sizes[i][c]);
      top.push(xa_.toFixed(2) + ',' + y(hi).toFixed(2), xb.toFixed(2) + ',' + y(hi).toFixed(2));
      bottom.unshift(xb.toFixed(2) + ',' + y(lo).toFixed(2), xa_.toFixed(2) + ',' + y(lo).toFixed(2));
      base[i] = hi;
    }
    var p = C.el(svg, 'path', {d: 'M' + top.join(' L') + ' L' + bottom.join(' L') + ' Z',
                               fill: d.colors[c], 'fill-opacity': 0.85, 'class': 'area',
                               'data-category': d.names[c]});
    C.tip(p, d.names[c] + ': up to ' + C.human(peak));
    paths++;
  }
  shown.slice().reverse().forEach(function (c) {
    var item = document.createElement('span');
    item.className = 'item';
    item.innerHTML = '<span class="sw" style="background:' + d.colors[c] + '"></span>' + d.names[c];
    document.getElementById('legend').appendChild(item);
  });
  if (hasReserved) {
    var rs = [];
    for (var i = 0; i < n; i++) {
      var xb = x(i + 1 < n ? d.t[i + 1] : t1);
      rs.push(x(d.t[i]).toFixed(2) + ',' + y(d.reserved[i]).toFixed(2), xb.toFixed(2) + ',' + y(d.reserved[i]).toFixed(2));
    }
    if (n) C.tip(C.el(svg, 'path', {d: 'M' + rs.join(' L'), fill: 'none', stroke: '#333', 'stroke-dasharray': '4 3', 'class': 'reserved'}), 'reserved');
    var item = document.createElement('span');
    item.className = 'item';
    item.innerHTML = '<span class="sw" style="border:1px dashed #333"></span>reserved';
    document.getElementById('legend').appendChild(item);
  }
  var seen = {};
  d.phases.forEach(function (p) {
    if (seen[p.name]) return;
    seen[p.name] = 1;
    var item = document.createElement('span');
    item.className = 'item';
    item.innerHTML = '<span class="sw" style="background:' + C.phaseColor(p.name) + ';outline:1px solid #ccc"></span>phase: ' + p.name;
    document.getElementById('legend').appendChild(item);
  });
  C.hover(svg, f, xa, document.getElementById('readout'), function (v) {
    var tu = t0 + v * 1000, lo = 0;
    while (lo < n - 1 && d.t[lo + 1] <= tu) lo++;
    if (!n) return '';
    var tot = 0, parts = [];
    shown.forEach(function (c) { tot += Math.max(0, d.sizes[lo][c]); if (d.sizes[lo][c] > 0) parts.push([d.names[c], d.sizes[lo][c]]); });
    parts.sort(function (a, b) { return b[1] - a[1]; });
    return 't = ' + v.toFixed(2) + ' ms: allocated ' + C.human(tot) + (hasReserved ? ', reserved ' + C.human(d.reserved[lo]) : '') +
      ' \u2014 ' + parts.slice(0, 5).map(function (p) { return p[0] + ' ' + C.human(p[1]); }).join(', ');
  });
  C.check();
  document.body.setAttribute('data-paths', String(paths));
  document.body.setAttribute('data-rendered', '1');
})();
)JS";

std::string human(size_t b) {
  return base::format_bytes(static_cast<double>(b), 2);
}

}  // namespace

void write_memory_timeline_html(const MemoryTimeline& t, std::ostream& out) {
  size_t max_alloc = 0, max_res = 0;
  for (size_t a : t.allocated) max_alloc = std::max(max_alloc, a);
  for (size_t r : t.reserved) max_res = std::max(max_res, r);
  std::string data = "{\"t\": [";
  for (size_t i = 0; i < t.times_us.size(); ++i)
    data += fmt::format("{}{}", i ? ", " : "", t.times_us[i]);
  data += "], \"sizes\": [";
  for (size_t i = 0; i < t.sizes.size(); ++i)
    data += fmt::format("{}[{}]", i ? ", " : "", fmt::join(t.sizes[i], ", "));
  data += "], \"reserved\": [";
  for (size_t i = 0; i < t.reserved.size(); ++i)
    data += fmt::format("{}{}", i ? ", " : "", t.reserved[i]);
  data += "], \"phases\": [";
  for (size_t i = 0; i < t.phases.size(); ++i)
    data += fmt::format("{}{{\"name\": {}, \"start\": {}, \"end\": {}}}", i ? ", " : "",
                        json_string(t.phases[i].phase), t.phases[i].start_us, t.phases[i].end_us);
  data += "], \"names\": [";
  for (int c = 0; c < kTimelineColumns; ++c)
    data += fmt::format("{}\"{}\"", c ? ", " : "", timeline_column_names()[static_cast<size_t>(c)]);
  data += "], \"colors\": [";
  for (int c = 0; c < kTimelineColumns; ++c)
    data += fmt::format("{}\"{}\"", c ? ", " : "", column_color(c));
  data += "]}";
  const std::string page_title =
      t.title.empty() ? fmt::format("Tally Memory Timeline ({})", t.device.str())
                      : fmt::format("{}: memory timeline ({})", t.title, t.device.str());
  out << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\" /><title>"
      << base::html_escape(page_title)
      << "</title>\n<style>body{font-family:sans-serif;margin:16px}"
      << ".item{margin-right:14px;display:inline-block}.sw{display:inline-block;width:12px;"
         "height:12px;margin-right:4px;vertical-align:middle}"
         "svg{max-width:100%;height:auto}.readout{font-size:12px;color:#444;min-height:1.4em}"
         "</style></head>\n<body>\n";
  if (!t.back_link.empty())
    out << "<p><a href=\"" << base::html_escape(t.back_link)
        << "\">&larr; back to the report</a></p>\n";
  if (!t.title.empty()) out << "<h2>" << base::html_escape(t.title) << "</h2>\n";
  if (t.reserved.empty())
    out << fmt::format("<h3>Max memory allocated: {} ({})</h3>\n", human(max_alloc),
                       t.device.str());
  else
    out << fmt::format("<h3>Max memory allocated/reserved: {} / {} ({})</h3>\n", human(max_alloc),
                       human(max_res), t.device.str());
  out << "<svg id=\"chart\" class=\"chart\" width=\"1200\" height=\"560\" "
         "viewBox=\"0 0 1200 560\"></svg>\n";
  out << "<div id=\"readout\" class=\"readout\">&nbsp;</div>\n";
  out << "<div id=\"legend\"></div>\n";
  out << "<script type=\"application/json\" id=\"data\">" << base::script_safe(data)
      << "</script>\n";
  out << "<script>" << inspect::chart_script() << "</script>\n";
  out << "<script>" << kScript << "</script>\n</body></html>\n";
}

void Profiler::export_memory_timeline(const std::string& path_in, memory::Device device) const {
  const std::string path = base::per_rank_path(path_in);  // "x.rank1.html" in a multi-rank job
  const ProfileData& d = data();
  if (!d.profile_memory)
    throw std::logic_error(fmt::format(
        "Profiler::export_memory_timeline({}): needs ProfilerOptions::profile_memory", path));
  const MemoryTimeline t = build_memory_timeline(d, device);
  const bool html = path.size() >= 5 && path.compare(path.size() - 5, 5, ".html") == 0;
  base::write_file_atomic(
      path,
      [&](std::ostream& out) {
        if (html)
          write_memory_timeline_html(t, out);
        else
          write_memory_timeline_json(t, out);
      },
      "export_memory_timeline");
}

}  // namespace tally::profiler
