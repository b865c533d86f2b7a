#include "inspect/svg_chart.h"

#include <fmt/format.h>

#include <utility>

#include "memory/category.h"

namespace tally::inspect {

using memory::category_color;
using memory::category_name;
using memory::kAllCategories;

namespace {

// Phase band colours (light, so the stacked areas stay readable in front of them).
// examples/plot_snapshot.py uses the same table (tests/memory/test_plot_snapshot.py checks).
constexpr std::pair<std::string_view, std::string_view> kPhaseColors[] = {
    {"forward", "#c6dbef"},   {"backward", "#fdd0a2"}, {"optimizer", "#c7e9c0"},
    {"recompute", "#e7a9c8"}, {"data", "#dadaeb"},     {"other", "#e5e5e5"},
};

constexpr const char* kLibrary = R"JS(
  // The SVG namespace, from the page's first svg element (every page has one in its markup).
  var NS = document.querySelector('svg').namespaceURI;
  var SHORT = {forward: 'fwd', backward: 'bwd', optimizer: 'opt', recompute: 'rcp', data: 'data'};
  function el(parent, tag, attrs) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function text(parent, x, y, s, attrs) {
    var a = {x: x, y: y, 'font-size': 12, fill: '#444'};
    for (var k in attrs || {}) a[k] = attrs[k];
    var t = el(parent, 'text', a);
    t.textContent = s;
    return t;
  }
  function tip(node, s) { el(node, 'title', {}).textContent = s; return node; }
  function group(s) {
    var p = String(s).split('.');
    p[0] = p[0].replace(/\B(?=(\d{3})+(?!\d))/g, ',');
    return p.join('.');
  }
  var BYTES = [['B', 1], ['KiB', 1024], ['MiB', 1048576], ['GiB', 1073741824], ['TiB', 1099511627776]];
  function byteUnit(v) {
    var u = BYTES[0];
    BYTES.forEach(function (x) { if (Math.abs(v) >= x[1]) u = x; });
    return u;
  }
  function human(b, digits) {
    var u = byteUnit(b);
    if (u[1] === 1) return group(String(Math.round(b))) + ' B';
    return group((b / u[1]).toFixed(digits === undefined ? 2 : digits)) + ' ' + u[0];
  }
  // 1, 2 or 5 times a power of ten: about n intervals over span.
  function niceStep(span, n) {
    var raw = Math.max(span, 1e-12) / Math.max(n, 1);
    var p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
    return (m <= 1 + 1e-9 ? 1 : m <= 2 + 1e-9 ? 2 : m <= 5 + 1e-9 ? 5 : 10) * p;
  }
  function decimals(step) { return step >= 1 ? 0 : Math.min(6, Math.ceil(-Math.log10(step) - 1e-9)); }
  function fmtTick(v, step) {
    var s = group(v.toFixed(decimals(step)));
    return /^-?[0.,]+$/.test(s) ? '0' : s;
  }
  // A round axis over [0, max] in `unit` (`scale` data units each); `room`: the top is at
  // least max * room.
  function axis(max, n, unit, scale, minStep, room) {
    var m = Math.max(max, 0) / scale;
    if (!(m > 0)) m = 1;
    var step = Math.max(niceStep(m, n || 5), minStep || 0);
    var top = Math.ceil(m / step - 1e-9) * step;
    if (top < m * (room || 1)) top += step;
    var ticks = [];
    for (var k = 0; k * step <= top + step * 1e-6; k++) ticks.push(k * step * scale);
    return {unit: unit, scale: scale, step: step * scale, top: top * scale, ticks: ticks,
            label: function (v) { return fmtTick(v / scale, step); }};
  }
  function byteAxis(max, n) { var u = byteUnit(Math.max(max, 1)); return axis(max, n || 5, u[0], u[1], 0, 1.03); }
  function timeAxis(maxMs, n) {
    if (maxMs >= 10000) return axis(maxMs, n || 6, 's', 1000);
    if (maxMs > 0 && maxMs < 1) return axis(maxMs, n || 6, '\u00b5s', 0.001);
    return axis(maxMs, n || 6, 'ms', 1);
  }
  function countAxis(max, n) { return axis(max, n || 6, '', 1, 1); }
  function frame(W, H, L, R, T, B) {
    return {W: W, H: H, L: L, R: R, T: T, B: B,
            x: function (v, a) { return L + (W - L - R) * v / a.top; },
            y: function (v, a) { return H - B - (H - T - B) * v / a.top; },
            inv: function (px, a) { return (px - L) / (W - L - R) * a.top; }};
  }
  function textWidth(s, size) { return String(s).length * size * 0.6; }
  // The axis make(n) with the most ticks (n from 8 down) whose labels keep 12 px apart.
  function fitX(f, make, size) {
    var a = null;
    for (var n = 8; n >= 2; n--) {
      a = make(n);
      var px = (f.W - f.L - f.R) * a.step / a.top, widest = 0;
      a.ticks.forEach(function (v) { widest = Math.max(widest, textWidth(a.label(v), size || 11)); });
      if (px >= widest + 12) return a;
    }
    return a;
  }
  function axes(svg, f, xa, ya, xTitle, yTitle) {
    var g = el(svg, 'g', {'class': 'axes'});
    ya.ticks.forEach(function (v) {
      var y = f.y(v, ya);
      el(g, 'line', {x1: f.L, x2: f.W - f.R, y1: y, y2: y, stroke: v ? '#e6e6e6' : '#999'});
      text(g, f.L - 6, y + 4, ya.label(v), {'text-anchor': 'end', 'font-size': 11, fill: '#555',
                                           'class': 'tick ytick', 'data-value': v / ya.scale});
    });
    xa.ticks.forEach(function (v) {
      var x = f.x(v, xa);
      el(g, 'line', {x1: x, x2: x, y1: f.H - f.B, y2: f.H - f.B + 4, stroke: '#999'});
      text(g, x, f.H - f.B + 16, xa.label(v), {'text-anchor': 'middle', 'font-size': 11, fill: '#555',
                                               'class': 'tick xtick', 'data-value': v / xa.scale});
    });
    el(g, 'line', {x1: f.L, x2: f.W - f.R, y1: f.H - f.B, y2: f.H - f.B, stroke: '#999'});
    el(g, 'line', {x1: f.L, x2: f.L, y1: f.T, y2: f.H - f.B, stroke: '#999'});
    if (xTitle) text(g, (f.L + f.W - f.R) / 2, f.H - 6, xTitle, {'text-anchor': 'middle', 'font-size': 12, fill: '#333', 'class': 'xlabel'});
    if (yTitle) {
      var cy = (f.T + f.H - f.B) / 2;
      text(g, 14, cy, yTitle, {'text-anchor': 'middle', 'font-size': 12, fill: '#333', 'class': 'ylabel',
                               transform: 'rotate(-90 14 ' + cy + ')'});
    }
    return g;
  }
  function phaseColor(name) {
    return COLORS.phases[name] || COLORS.phases[String(name).replace(/\.\d+$/, '')] || COLORS.phases.other;
  }
  // Runs [{name, start, end}] in time order -> one band per phase: `outer` (in order, each
  // ending where the next begins at the latest) and `inner` (the runs of a phase that lies
  // mostly inside another one's span, as recompute inside backward).
  function layoutPhases(runs) {
    var spans = {}, order = [];
    runs.forEach(function (r) {
      if (!r.name || !(r.end >= r.start)) return;
      var s = spans[r.name];
      if (!s) { s = spans[r.name] = {name: r.name, start: r.start, end: r.end, runs: []}; order.push(s); }
      s.start = Math.min(s.start, r.start);
      s.end = Math.max(s.end, r.end);
      s.runs.push(r);
    });
    order.sort(function (a, b) { return a.start - b.start || (b.end - b.start) - (a.end - a.start); });
    var outer = [], inner = [];
    order.forEach(function (s) {
      var host = null;
      outer.forEach(function (o) {
        var ov = Math.min(o.end, s.end) - Math.max(o.start, s.start);
        if (ov > 0 && ov >= 0.5 * (s.end - s.start) && (o.end - o.start) > (s.end - s.start)) host = o;
      });
      if (host) s.runs.forEach(function (r) { inner.push({name: s.name, start: r.start, end: r.end}); });
      else outer.push({name: s.name, start: s.start, end: s.end});
    });
    for (var i = 0; i + 1 < outer.length; i++) outer[i].end = Math.min(outer[i].end, outer[i + 1].start);
    return {outer: outer, inner: inner};
  }
  // The bands behind the plot and a labelled strip of height 16 just above it (f.T - 20).
  function phaseBands(svg, f, xa, runs) {
    var lay = layoutPhases(runs), g = el(svg, 'g', {'class': 'phases'});
    var sy = f.T - 20, lastRight = -1e9;
    lay.outer.forEach(function (b) {
      var x0 = f.x(b.start, xa), x1 = f.x(b.end, xa), w = Math.max(2, x1 - x0);
      el(g, 'rect', {x: x0, y: f.T, width: w, height: f.H - f.T - f.B, fill: phaseColor(b.name), 'fill-opacity': 0.35});
      tip(el(g, 'rect', {x: x0, y: sy, width: w, height: 16, fill: phaseColor(b.name), stroke: '#fff',
                        'class': 'phase', 'data-phase': b.name}), b.name);
    });
    lay.inner.forEach(function (b) {
      var x0 = f.x(b.start, xa), x1 = f.x(b.end, xa);
      tip(el(g, 'rect', {x: x0, y: sy + 10, width: Math.max(1, x1 - x0), height: 6, fill: phaseColor(b.name),
                        'class': 'phase-inner', 'data-phase': b.name}), b.name);
    });
    // Labels: the full name inside its band, else the short one, else (a band too narrow
    // for either, as a fast optimizer step) the short one just right of it; never touching.
    var right = f.W - f.R;
    lay.outer.forEach(function (b, i) {
      var x0 = f.x(b.start, xa), x1 = Math.max(f.x(b.end, xa), x0 + 1);
      var next = i + 1 < lay.outer.length ? f.x(lay.outer[i + 1].start, xa) : right;
      var shortName = SHORT[b.name] || b.name.slice(0, 3);
      var tries = [[b.name, (x0 + x1) / 2, x1 - x0], [shortName, (x0 + x1) / 2, x1 - x0]];
      var w = textWidth(shortName, 11);
      tries.push([shortName, x1 + 3 + w / 2, Math.min(next, right) - x1 - 3]);
      tries.some(function (t) {
        var tw = textWidth(t[0], 11);
        if (tw + 4 > t[2] || t[1] - tw / 2 < lastRight + 4) return false;
        text(g, t[1], sy + 11, t[0], {'text-anchor': 'middle', 'font-size': 11, fill: '#333', 'class': 'phase-label'});
        lastRight = t[1] + tw / 2;
        return true;
      });
    });
    return lay;
  }
  // A cursor line over the plot and readout.textContent = fn(x value) under the mouse.
  function hover(svg, f, xa, readout, fn) {
    var cursor = el(svg, 'line', {x1: 0, x2: 0, y1: f.T, y2: f.H - f.B, stroke: '#444',
                                  'stroke-dasharray': '3 3', visibility: 'hidden', 'class': 'cursor'});
    svg.addEventListener('mousemove', function (ev) {
      var r = svg.getBoundingClientRect(), px = (ev.clientX - r.left) * f.W / r.width;
      if (px < f.L || px > f.W - f.R) { cursor.setAttribute('visibility', 'hidden'); return; }
      cursor.setAttribute('x1', px); cursor.setAttribute('x2', px);
      cursor.setAttribute('visibility', 'visible');
      readout.textContent = fn(f.inv(px, xa));
    });
    svg.addEventListener('mouseleave', function () { cursor.setAttribute('visibility', 'hidden'); });
  }
  function check() {
    var overlaps = 0, untick = 0, overflow = 0, width = document.documentElement.clientWidth, touching = [];
    Array.prototype.forEach.call(document.querySelectorAll('svg'), function (svg) {
      if (svg.classList.contains('chart') &&
          (svg.querySelectorAll('.xtick').length < 2 || svg.querySelectorAll('.ytick').length < 2)) untick++;
      var texts = svg.querySelectorAll('text.tick, text.phase-label, text.point-label');
      var boxes = Array.prototype.map.call(texts, function (t) { return t.getBoundingClientRect(); });
      for (var i = 0; i < boxes.length; i++)
        for (var j = i + 1; j < boxes.length; j++) {
          var a = boxes[i], b = boxes[j];
          if (a.left < b.right - 0.5 && b.left < a.right - 0.5 && a.top < b.bottom - 0.5 && b.top < a.bottom - 0.5) {
            overlaps++;
            touching.push(texts[i].textContent + ' / ' + texts[j].textContent);
          }
        }
    });
    Array.prototype.forEach.call(document.querySelectorAll('svg, table, h1, p, li, .chart'), function (e) {
      if (e.getBoundingClientRect().right > width + 0.5) overflow++;
    });
    if (document.documentElement.scrollWidth > width) overflow++;
    document.body.setAttribute('data-overlaps', String(overlaps));
    if (touching.length) document.body.setAttribute('data-touching', touching.slice(0, 5).join('; '));
    document.body.setAttribute('data-overflow', String(overflow));
    document.body.setAttribute('data-untick', String(untick));
    document.body.setAttribute('data-viewport', String(width));
  }
  return {el: el, text: text, tip: tip, group: group, human: human, byteUnit: byteUnit,
          niceStep: niceStep, fmtTick: fmtTick, byteAxis: byteAxis, timeAxis: timeAxis,
          countAxis: countAxis, fitX: fitX, frame: frame, axes: axes, phaseColor: phaseColor,
          layoutPhases: layoutPhases, phaseBands: phaseBands, hover: hover, check: check,
          colors: COLORS};
})();
)JS";

}  // namespace

std::string_view phase_color(std::string_view phase) {
  for (const auto& [name, color] : kPhaseColors)
    if (name == phase) return color;
  // A micro-batch's phase ("forward.0", "backward.1") has its phase's colour.
  const size_t dot = phase.rfind('.');
  if (dot != std::string_view::npos && dot + 1 < phase.size() &&
      phase.find_first_not_of("0123456789", dot + 1) == std::string_view::npos)
    return phase_color(phase.substr(0, dot));
  return kPhaseColors[std::size(kPhaseColors) - 1].second;
}

std::string category_colors_json() {
  std::string out = "{";
  for (size_t i = 0; i < kAllCategories.size(); ++i)
    out += fmt::format("{}\"{}\": \"{}\"", i ? ", " : "", category_name(kAllCategories[i]),
                       category_color(kAllCategories[i]));
  return out + "}";
}

std::string phase_colors_json() {
  std::string out = "{";
  for (size_t i = 0; i < std::size(kPhaseColors); ++i)
    out += fmt::format("{}\"{}\": \"{}\"", i ? ", " : "", kPhaseColors[i].first,
                       kPhaseColors[i].second);
  return out + "}";
}

const std::string& chart_script() {
  static const std::string script =
      "var TallyChart = (function () {\n  var COLORS = {categories: " + category_colors_json() +
      ", phases: " + phase_colors_json() + "};" + kLibrary;
  return script;
}

}  // namespace tally::inspect
