#include "ab/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <stdexcept>

#include "base/atomic_file.h"
#include "base/json.h"
#include "inspect/svg_chart.h"
#include "memory/context.h"

namespace tally::ab {

namespace {

using memory::Category;

// Table and chart order: the seven consumers first, then Tally's extras.
constexpr Category kOrder[] = {Category::parameter,       Category::gradient,
                               Category::optimizer_state, Category::input,
                               Category::activation,      Category::temporary,
                               Category::workspace,       Category::autocast_cache,
                               Category::communication,   Category::unknown};

std::string mib(double b) {
  return fmt::format("{:.1f}", b / (1024.0 * 1024.0));
}

std::string delta(double v, double base) {
  if (base == 0 && v == 0) return "";
  const double d = v - base;
  const std::string sign = d > 0 ? "+" : (d < 0 ? "-" : "±");
  if (base == 0) return fmt::format(" ({}{} MiB)", sign, mib(std::abs(d)));
  return fmt::format(" ({}{:.0f}%)", sign, std::abs(d) / base * 100.0);
}

}  // namespace

std::string module_group(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  if (!parts.empty() && parts[0] == "transformer") parts.erase(parts.begin());
  if (parts.empty()) return "";
  const bool numeric = parts.size() > 1 && !parts[1].empty() &&
                       std::all_of(parts[1].begin(), parts[1].end(), [](char c) {
                         return std::isdigit(static_cast<unsigned char>(c));
                       });
  return numeric ? parts[0] + "." + parts[1] : parts[0];
}

std::string format_table(const std::vector<ConfigResult>& results) {
  if (results.empty()) return "no configurations\n";
  std::vector<std::pair<std::string, std::function<double(const ConfigResult&)>>> cols;
  cols.push_back(
      {"peak alloc", [](const ConfigResult& r) { return static_cast<double>(r.peak_allocated); }});
  cols.push_back(
      {"peak resv", [](const ConfigResult& r) { return static_cast<double>(r.peak_reserved); }});
  if (std::any_of(results.begin(), results.end(),
                  [](const ConfigResult& r) { return r.host_peak_allocated > 0; }))
    cols.push_back({"host peak", [](const ConfigResult& r) {
                      return static_cast<double>(r.host_peak_allocated);
                    }});
  bool frozen = false;  // a fine-tune (LoRA): the frozen parameters' share of `parameter`
  for (const auto& r : results) frozen = frozen || r.parameters.frozen > 0;
  for (Category c : kOrder) {
    bool any = false;
    for (const auto& r : results) any = any || r.at_peak[static_cast<size_t>(c)] != 0;
    if (!any && c != Category::activation) continue;
    cols.push_back({std::string(memory::category_name(c)), [c](const ConfigResult& r) {
                      return static_cast<double>(r.at_peak[static_cast<size_t>(c)]);
                    }});
    if (c == Category::parameter && frozen)
      cols.push_back({"frozen param", [](const ConfigResult& r) {
                        return static_cast<double>(r.parameters.frozen_bytes);
                      }});
  }
  cols.push_back({"frag (resv-alloc)", [](const ConfigResult& r) {
                    return static_cast<double>(r.peak_reserved - r.peak_allocated);
                  }});
  // Measured runs with their predictions: the predicted peak, and its error against the
  // measured one. Dry runs only (--estimate): the table itself is the prediction.
  const bool measured = results.front().measured;
  bool predicted = false;
  for (const auto& r : results) predicted = predicted || (r.measured && r.predicted);
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> head = {"configuration"};
  for (auto& c : cols) head.push_back(c.first + " MiB");
  if (predicted) head.push_back("predicted alloc MiB");
  if (measured) {
    head.push_back("step ms");
    head.push_back("final loss");
  }
  rows.push_back(head);
  const ConfigResult& base = results.front();
  for (size_t i = 0; i < results.size(); ++i) {
    const ConfigResult& r = results[i];
    std::vector<std::string> row = {r.name};
    for (auto& c : cols)
      row.push_back(mib(c.second(r)) + (i ? delta(c.second(r), c.second(base)) : ""));
    if (predicted)
      row.push_back(
          !r.predicted
              ? std::string("-")
              : fmt::format("{} ({:+.2f}%)", mib(static_cast<double>(r.estimate.peak_allocated)),
                            r.peak_allocated ? 100.0 *
                                                   static_cast<double>(r.estimate.peak_allocated -
                                                                       r.peak_allocated) /
                                                   static_cast<double>(r.peak_allocated)
                                             : 0.0));
    if (measured) {
      row.push_back(fmt::format("{:.1f}", r.median_ms) +
                    (r.round_ms.size() > 1 ? fmt::format(" [{:.1f}-{:.1f}]", r.min_ms, r.max_ms)
                                           : std::string()) +
                    (i ? delta(r.median_ms, base.median_ms) : ""));
      row.push_back(fmt::format("{:.4f}", r.final_loss));
    }
    rows.push_back(row);
  }
  std::vector<size_t> w(head.size(), 0);
  for (auto& row : rows)
    for (size_t k = 0; k < row.size(); ++k) w[k] = std::max(w[k], row[k].size());
  std::string out;
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    for (size_t k = 0; k < rows[ri].size(); ++k) {
      out += k == 0 ? fmt::format("{:<{}}", rows[ri][k], w[k])
                    : fmt::format("  {:>{}}", rows[ri][k], w[k]);
    }
    out += "\n";
    if (ri == 0) out += std::string(out.size() - 1, '-') + "\n";
  }
  out +=
      "(bytes per category are taken at the moment allocated memory peaked; changes are against "
      "the first row)\n";
  if (!measured)
    out += fmt::format("(predicted by dry runs for {}: shapes only, no step was run)\n",
                       results.front().estimate.target.name);
  else if (predicted)
    out += fmt::format(
        "(predicted: the same steps dry-run beforehand for {}, and the error against the "
        "measured peak)\n",
        results.front().estimate.target.name);
  return out;
}

namespace {

constexpr const char* kMinus = "\xe2\x88\x92";  // U+2212

// "12345" -> "12,345" (the integer part of a number's text).
std::string grouped(std::string s) {
  size_t end = s.find('.');
  if (end == std::string::npos) end = s.size();
  for (size_t i = end; i > 3; i -= 3) s.insert(i - 3, ",");
  return s;
}

std::string signed_percent(double d, double base) {
  const double p = 100.0 * d / base;
  const std::string digits =
      std::abs(p) >= 1 ? fmt::format("{:.0f}", std::abs(p)) : fmt::format("{:.1f}", std::abs(p));
  if (digits == "0" || digits == "0.0")
    return "\xc2\xb1"
           "0%";
  return (p > 0 ? "+" : kMinus) + digits + "%";
}

std::string signed_size(double d) {
  const double m = std::abs(d) / (1024.0 * 1024.0);
  std::string s;
  if (m >= 100)
    s = grouped(fmt::format("{:.0f}", m)) + " MiB";
  else if (m >= 1)
    s = fmt::format("{:.1f} MiB", m);
  else
    s = fmt::format("{:.0f} KiB", std::abs(d) / 1024.0);
  if (d == 0)
    return "\xc2\xb1"
           "0 MiB";
  return (d > 0 ? "+" : kMinus) + s;
}

// "4-segments" -> {4, "segments"}; {0, ""} when the value is not N-word.
std::pair<int, std::string> count_word(const std::string& v) {
  const size_t dash = v.find('-');
  if (dash == std::string::npos || dash == 0) return {0, ""};
  for (size_t i = 0; i < dash; ++i)
    if (!std::isdigit(static_cast<unsigned char>(v[i]))) return {0, ""};
  return {std::stoi(v.substr(0, dash)), v.substr(dash + 1)};
}

std::string describe_setting(const std::string& axis, const std::string& v) {
  if (v.rfind("auto(", 0) == 0 && v.back() == ')')
    return "the planner's " + describe_setting(axis, v.substr(5, v.size() - 6));
  const auto [n, word] = count_word(v);
  if (axis == "ckpt") {
    if (v == "none") return "no checkpointing";
    if (v == "blocks") return "per-block checkpointing";
    if (v == "selective") return "selective checkpointing";
    if (n > 0 && word == "segments") return fmt::format("{}-segment checkpointing", n);
    if (n > 0 && word == "blocks") return fmt::format("checkpointing {} blocks", n);
    return "checkpointing " + v;
  }
  if (axis == "amp") {
    if (v == "off" || v == "none") return "fp32 (no autocast)";
    return v + " autocast";
  }
  if (axis == "offload") {
    if (v == "none") return "no offload";
    if (v == "activations") return "activation offload";
    if (n > 0 && word == "blocks") return fmt::format("offloading {} blocks", n);
    return "offload " + v;
  }
  if (axis == "opt") {
    if (v == "sgd") return "SGD";
    if (v == "adam") return "Adam";
    if (v == "adamw") return "AdamW";
    if (v == "adamw8bit") return "8-bit AdamW";
    return v;
  }
  if (axis == "sib") return v == "on" ? "step-in-backward" : "no step-in-backward";
  if (axis == "alloc") return v == "default" ? "default allocator settings" : v;
  if (axis == "accum") return v == "1" ? "no gradient accumulation" : v + " micro-batches";
  return axis + "=" + v;
}

bool is_16bit(const ConfigResult& r) {
  for (const auto& [axis, v] : r.settings)
    if (axis == "amp" &&
        (v.find("bf16") != std::string::npos || v.find("fp16") != std::string::npos))
      return true;
  return false;
}

double step_ms(const ConfigResult& r) {
  return r.measured ? r.median_ms : r.predicted_step_ms;
}

std::string number_or_null(double v, int digits) {
  return std::isfinite(v) ? fmt::format("{:.{}f}", v, digits) : std::string("null");
}

// `p` relative to the folder `dir` ("x.pickle", "diff/x.html").
std::string relative_to(const std::string& p, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const fs::path rel =
      fs::absolute(p).lexically_normal().lexically_relative(fs::absolute(dir).lexically_normal());
  return rel.empty() ? p : rel.generic_string();
}

}  // namespace

std::string describe_change(const std::vector<ConfigResult>& results, size_t i) {
  const ConfigResult& r = results.at(i);
  const ConfigResult& base = results.front();
  std::string out;
  for (const auto& [axis, v] : r.settings) {
    std::string bv;
    for (const auto& [ba, b] : base.settings)
      if (ba == axis) bv = b;
    if (bv == v) continue;
    out += (out.empty() ? "" : " + ") + describe_setting(axis, v);
  }
  return out.empty() ? r.name : out;
}

std::string headline(const std::vector<ConfigResult>& results, size_t i) {
  const ConfigResult& r = results.at(i);
  const ConfigResult& base = results.front();
  const auto change = [](int64_t v, int64_t b) {
    const double d = static_cast<double>(v - b);
    return b ? signed_percent(d, static_cast<double>(b)) + " (" + signed_size(d) + ")"
             : signed_size(d);
  };
  std::string out = describe_change(results, i) + ": " + (r.measured ? "" : "predicted ") +
                    "peak allocated " + change(r.peak_allocated, base.peak_allocated) +
                    ", reserved " + change(r.peak_reserved, base.peak_reserved);
  const double s = step_ms(r), s0 = step_ms(base);
  if (!std::isfinite(s) || !std::isfinite(s0) || s0 <= 0) return out;
  // The rounds' spread (max - min of either configuration): a difference inside it is noise.
  const double spread =
      r.measured
          ? std::max(std::isfinite(r.max_ms - r.min_ms) ? r.max_ms - r.min_ms : 0.0,
                     std::isfinite(base.max_ms - base.min_ms) ? base.max_ms - base.min_ms : 0.0)
          : 0.0;
  if (spread > 0 && std::abs(s - s0) <= spread)
    return out + fmt::format(", step within noise (difference {:.2f} ms, rounds' spread {:.2f} ms)",
                             std::abs(s - s0), spread);
  out +=
      std::string(", ") + (r.measured ? "step " : "predicted step ") + signed_percent(s - s0, s0);
  if (spread > 0) out += fmt::format(" (rounds' spread {:.2f} ms)", spread);
  return out;
}

std::string cpu_autocast_caveat(const std::vector<ConfigResult>& results) {
  std::vector<std::string> which;
  for (const ConfigResult& r : results) {
    if (!r.measured || r.device.rfind("cpu", 0) != 0 || !is_16bit(r)) continue;
    for (const char* p : {"bf16", "fp16"})
      if (r.name.find(p) != std::string::npos &&
          std::find(which.begin(), which.end(), p) == which.end())
        which.push_back(p);
  }
  if (which.empty()) return "";
  return fmt::format(
      "Caveat: these steps ran on the CPU, where 16-bit autocast ({}) saves memory but not "
      "time. Tally's CPU backend has no 16-bit matmul or convolution kernels: each one widens "
      "its 16-bit operands to float32, runs the float32 BLAS kernel and rounds the result back "
      "once, and the elementwise ops compute in float32 too, so autocast adds conversions and "
      "makes no kernel faster: expect a step somewhat slower than in float32 (the step column "
      "says by how much). The memory columns show what 16-bit saves; the speed-up needs a "
      "GPU's 16-bit tensor cores (--device cuda).",
      fmt::join(which, ", "));
}

PhaseRecorder::PhaseRecorder()
    : previous_(memory::context_observer()), thread_(std::this_thread::get_id()) {
  memory::set_context_observer(this);
}

PhaseRecorder::~PhaseRecorder() {
  memory::set_context_observer(previous_);
}

void PhaseRecorder::on_phase_enter(memory::StrId phase) {
  if (std::this_thread::get_id() != thread_) return;
  open_.push_back(spans_.size());
  spans_.push_back({phase, memory::now_us(), -1});
}

void PhaseRecorder::on_phase_exit(memory::StrId phase) {
  if (std::this_thread::get_id() != thread_ || open_.empty()) return;  // entered before us
  if (spans_[open_.back()].phase != phase) return;
  spans_[open_.back()].end_us = memory::now_us();
  open_.pop_back();
}

std::vector<PhaseRun> PhaseRecorder::runs(int64_t t0_us) const {
  std::vector<PhaseRun> out;
  const int64_t now = memory::now_us();
  for (const Span& s : spans_) {
    const auto ms = [&](int64_t us) {
      return std::max(0.0, static_cast<double>(us - t0_us) / 1000.0);
    };
    out.push_back({memory::interned(s.phase), ms(s.start_us), ms(s.end_us < 0 ? now : s.end_us)});
  }
  return out;
}

void write_report(const std::string& path, const std::string& title,
                  const std::vector<ConfigResult>& results) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::path(path).parent_path().empty() ? fs::path(".") : fs::path(path).parent_path();
  // ---- data ----
  std::string data = "{\"title\":" + base::json_quote(title) + ",\"categories\":[";
  for (size_t k = 0; k < std::size(kOrder); ++k)
    data += (k ? "," : "") + base::json_quote(memory::category_name(kOrder[k]));
  data += "],\"measured\":" +
          std::string(!results.empty() && results.front().measured ? "true" : "false");
  data += ",\"caveat\":" + base::json_quote(cpu_autocast_caveat(results));
  data += ",\"configs\":[";
  for (size_t i = 0; i < results.size(); ++i) {
    const ConfigResult& r = results[i];
    const memory::MemoryTimeline& t = r.timeline;
    // Keep at most ~1500 samples, always including the peak.
    const size_t n = t.size();
    const size_t stride = std::max<size_t>(1, n / 1500);
    const size_t peak = n ? t.peak_index() : 0;
    std::vector<size_t> keep;
    for (size_t s = 0; s < n; s += stride) keep.push_back(s);
    if (n && std::find(keep.begin(), keep.end(), peak) == keep.end()) keep.push_back(peak);
    if (n && keep.back() != n - 1) keep.push_back(n - 1);
    std::sort(keep.begin(), keep.end());
    const int64_t t0 = n ? t.times_us.front() : 0;
    data += std::string(i ? "," : "") + "{\"name\":" + base::json_quote(r.name);
    data += ",\"label\":" + base::json_quote(i ? describe_change(results, i) : "baseline");
    data += ",\"headline\":" + base::json_quote(i ? headline(results, i) : "");
    // A dry run (--estimate) has no step time and no loss: null. `predicted`: the dry run's
    // peak next to a measured run (the dashed line), else null.
    data += fmt::format(
        ",\"peak_allocated\":{},\"peak_reserved\":{},\"host_peak_allocated\":{},"
        "\"median_ms\":{},\"final_loss\":{},"
        "\"predicted\":{},\"predicted_ms\":{},\"min_ms\":{},\"max_ms\":{},\"rounds\":{}",
        r.peak_allocated, r.peak_reserved, r.host_peak_allocated,
        number_or_null(r.measured ? r.median_ms : NAN, 3),
        number_or_null(r.measured ? r.final_loss : NAN, 6),
        r.measured && r.predicted ? std::to_string(r.estimate.peak_allocated) : "null",
        number_or_null(r.predicted_step_ms, 3), number_or_null(r.measured ? r.min_ms : NAN, 3),
        number_or_null(r.measured ? r.max_ms : NAN, 3), r.round_ms.size());
    data += ",\"phase_peaks\":[";
    for (size_t k = 0; k < r.phase_peaks.size(); ++k)
      data += fmt::format("{}[{},{}]", k ? "," : "", base::json_quote(r.phase_peaks[k].first),
                          r.phase_peaks[k].second);
    data += "]";
    data += fmt::format(",\"params\":[{},{},{},{}]", r.parameters.trainable, r.parameters.frozen,
                        r.parameters.trainable_bytes, r.parameters.frozen_bytes);
    data += ",\"at_peak\":[";
    for (size_t k = 0; k < std::size(kOrder); ++k)
      data += fmt::format("{}{}", k ? "," : "", r.at_peak[static_cast<size_t>(kOrder[k])]);
    data += "],\"index\":[";
    for (size_t k = 0; k < keep.size(); ++k) data += fmt::format("{}{}", k ? "," : "", keep[k]);
    data += "],\"t\":[";
    for (size_t k = 0; k < keep.size(); ++k)
      data += fmt::format("{}{:.3f}", k ? "," : "", (t.times_us[keep[k]] - t0) / 1000.0);
    data += "],\"bytes\":[";
    for (size_t k = 0; k < keep.size(); ++k) {
      data += k ? ",[" : "[";
      for (size_t c = 0; c < std::size(kOrder); ++c)
        data += fmt::format("{}{}", c ? "," : "", t.bytes[keep[k]][static_cast<size_t>(kOrder[c])]);
      data += "]";
    }
    data += fmt::format("],\"samples\":{},\"phases\":[", n);
    for (size_t k = 0; k < r.phases.size(); ++k)
      data += fmt::format("{}[{},{:.3f},{:.3f}]", k ? "," : "", base::json_quote(r.phases[k].name),
                          r.phases[k].start_ms, r.phases[k].end_ms);
    // The forward staircase, from every sample (not only the kept ones).
    data += "],\"stairs\":[";
    std::string cur_group;
    bool first_stair = true;
    for (size_t s = 0; s < n; ++s) {
      if (memory::interned(t.phase[s]) != "forward") continue;
      const std::string g = module_group(memory::interned(t.module[s]));
      if (g.empty() || g == cur_group) continue;
      cur_group = g;
      data += fmt::format("{}[{:.3f},{},{},{}]", first_stair ? "" : ",",
                          (t.times_us[s] - t0) / 1000.0, base::json_quote(g), t.total(s), s);
      first_stair = false;
    }
    // Links to the files written for it, relative to the report's folder (those that exist).
    data += "],\"links\":[";
    bool first_link = true;
    for (const auto& [label, file] :
         {std::pair<const char*, const std::string*>{"snapshot", &r.snapshot_path},
          {"timeline", &r.timeline_html_path},
          {"timeline JSON", &r.timeline_path},
          {"diff against 1", &r.diff_path}}) {
      std::error_code ec;
      if (file->empty() || !fs::is_regular_file(*file, ec)) continue;
      data += fmt::format("{}[{},{}]", first_link ? "" : ",", base::json_quote(label),
                          base::json_quote(relative_to(*file, dir)));
      first_link = false;
    }
    data += "]}";
  }
  data += "]}";

  // ---- page ----
  std::string html = R"HTML(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Tally A/B memory report</title>
<style>
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:22px 0 8px} h3{font-size:14px;margin:0 0 2px}
.sub{color:#666;margin-bottom:10px}
.top{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}
.headlines{flex:1 1 440px;min-width:0}
.headlines ul{margin:6px 0;padding-left:20px} .headlines li{margin:4px 0;font-size:16px}
.caveat{background:#fff8e1;border-left:4px solid #f0b400;padding:8px 12px;max-width:900px}
div.scatter{flex:0 1 620px;min-width:0;border:1px solid #ddd;border-radius:6px;padding:8px}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:16px}
div.chart{border:1px solid #ddd;border-radius:6px;padding:8px;min-width:0}
div.chart .hl{font-size:13px;color:#444}
.links{font-size:13px;margin:2px 0 4px} .links a{margin-right:10px}
svg{display:block;width:100%;height:auto}
.readout{font-size:12px;color:#444;min-height:1.4em;font-variant-numeric:tabular-nums}
.legend{display:flex;flex-wrap:wrap;gap:6px 14px;margin:8px 0}
.legend span{display:inline-flex;align-items:center;gap:4px}
.legend i{width:12px;height:12px;display:inline-block;border-radius:2px}
.tables{max-width:100%}
table{border-collapse:collapse;margin:8px 0 16px;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid #eee;padding:4px 10px;text-align:right;vertical-align:top}
th{font-weight:600;min-width:90px;max-width:200px;white-space:normal;overflow-wrap:anywhere}
td{white-space:nowrap} td small{display:block;font-size:12px}
th:first-child,td:first-child{text-align:left;white-space:nowrap}
tr.key td{font-weight:600}
.better{color:#1a7f37}.worse{color:#cf222e}
</style></head>
<body>
<h1>Tally A/B memory report</h1>
<div class="sub" id="title"></div>
<div class="top">
<div class="headlines"><h2>What each option bought</h2><p id="base"></p><ul id="headlines"></ul>
<p class="caveat" id="caveat" hidden></p></div>
<div class="scatter"><h3 id="scatter-title">Peak memory against step time</h3>
<svg id="scatter" class="chart scatter-chart" viewBox="0 0 620 380"></svg></div>
</div>
<h2>Memory over one training step</h2>
<div class="legend" id="legend"></div>
<div class="charts" id="charts"></div>
<h2>The numbers</h2>
<div class="tables" id="tables"></div>
<p class="sub">One training step per configuration (the last of the run), bytes allocated by category over
time, every chart on one scale. Bands above each chart: the phases (forward, backward, optimizer; recompute
as marks inside backward). Labels on the forward ramp: the module whose forward allocated there (the
activation "staircase"). Dashed line: the dry run's predicted peak. Hover a chart for its values. Tables: bytes
per category at the moment allocated memory peaked; changes against the first configuration. Snapshots open
in PyTorch's memory_viz.</p>
<script id="data" type="application/json">)HTML";
  html += base::script_safe(data);  // never close the <script> early
  html += "</script>\n<script>\n";
  html += inspect::chart_script();
  html += R"HTML(</script>
<script>
(function(){
const D = JSON.parse(document.getElementById('data').textContent);
const C = TallyChart, COLORS = C.colors.categories;
const MIB = 1048576;
function mib(b){ return C.group((b/MIB).toFixed(1)); }
function esc(s){ return String(s).replace(/&/g,'&amp;').replace(/</g,'&lt;').replace(/>/g,'&gt;'); }
document.getElementById('title').textContent = D.title;
const base = D.configs[0];
function stepOf(cf){ return D.measured ? cf.median_ms : cf.predicted_ms; }

// ---- headlines ----
if (base) {
  document.getElementById('base').innerHTML = 'Against configuration 1, <b>' + esc(base.name) + '</b>: peak ' +
    mib(base.peak_allocated) + ' MiB' + (stepOf(base) !== null ? (D.measured ? ', step ' : ', predicted step ') +
    stepOf(base).toFixed(1) + ' ms' : '') + (base.final_loss !== null ? ', final loss ' + base.final_loss.toFixed(4) : '') + '.';
}
const ul = document.getElementById('headlines');
D.configs.forEach((cf, i) => { if (!i) return; const li = document.createElement('li');
  li.className = 'headline'; li.setAttribute('data-config', cf.name); li.textContent = cf.headline; ul.appendChild(li); });
if (D.caveat) { const cv = document.getElementById('caveat'); cv.textContent = D.caveat; cv.hidden = false; }

// ---- peak against step time ----
(function () {
  const svg = document.getElementById('scatter');
  const timed = D.configs.every(cf => stepOf(cf) !== null);
  if (!timed) { document.getElementById('scatter-title').textContent = 'Peak memory of each configuration (no step time: dry runs without a cost model)'; }
  const f = C.frame(620, 380, 70, 20, 16, 44);
  let ym = 1, xm = 1e-3;
  D.configs.forEach(cf => { ym = Math.max(ym, cf.peak_allocated); if (timed) xm = Math.max(xm, stepOf(cf)); });
  const ya = C.byteAxis(ym, 5);
  const xa = timed ? C.fitX(f, n => C.timeAxis(xm, n)) : C.fitX(f, n => C.countAxis(D.configs.length + 1, n));
  C.axes(svg, f, xa, ya, timed ? (D.measured ? 'median step time' : 'predicted step time (cost model)') + ' (' + xa.unit + ')'
                                 : 'configuration', 'peak allocated (' + ya.unit + ')');
  const placed = [];
  const plot = {l: f.L, r: f.W - f.R, t: f.T, b: f.H - f.B};
  function hits(bx){ return bx.l < plot.l || bx.r > plot.r || bx.t < plot.t || bx.b > plot.b ||
    placed.some(p => bx.l < p.r && p.l < bx.r && bx.t < p.b && p.t < bx.b); }
  const pts = D.configs.map((cf, i) => { const px = f.x(timed ? stepOf(cf) : i + 1, xa), py = f.y(cf.peak_allocated, ya);
    placed.push({l: px - 7, r: px + 7, t: py - 7, b: py + 7}); return [px, py]; });
  D.configs.forEach((cf, i) => {
    const [px, py] = pts[i];
    const g = C.el(svg, 'g', {'class': 'point', 'data-config': cf.name});
    C.el(g, 'circle', {cx: px, cy: py, r: 6, fill: i ? '#444' : '#fff', stroke: '#222', 'stroke-width': 2});
    C.tip(g, (i + 1) + '. ' + cf.name + '\npeak allocated ' + mib(cf.peak_allocated) + ' MiB (reserved ' + mib(cf.peak_reserved) +
      ' MiB)' + (stepOf(cf) !== null ? '\n' + (D.measured ? 'step ' : 'predicted step ') + stepOf(cf).toFixed(2) + ' ms' : '') +
      (cf.final_loss !== null ? '\nfinal loss ' + cf.final_loss.toFixed(4) : '') + (i ? '\n' + cf.headline : ''));
    for (const s of [(i + 1) + '. ' + cf.label, String(i + 1)]) {
      const t = C.text(svg, 0, 0, s, {'font-size': 12, fill: '#222', 'class': 'point-label'});
      const cands = [[px + 10, py + 4, 'start'], [px - 10, py + 4, 'end'], [px, py - 12, 'middle'], [px, py + 22, 'middle'],
                     [px + 8, py - 10, 'start'], [px + 8, py + 20, 'start'], [px - 8, py - 10, 'end'], [px - 8, py + 20, 'end']];
      // Each candidate is measured where it stands (getBBox: the font's real extent), 1 px apart.
      const ok = cands.find(([x, y, a]) => { t.setAttribute('x', x); t.setAttribute('y', y); t.setAttribute('text-anchor', a);
        const bb = t.getBBox(); return !hits({l: bb.x - 1, r: bb.x + bb.width + 1, t: bb.y - 1, b: bb.y + bb.height + 1}); });
      if (ok) { const bb = t.getBBox(); placed.push({l: bb.x - 1, r: bb.x + bb.width + 1, t: bb.y - 1, b: bb.y + bb.height + 1}); break; }
      t.remove();
    }
  });
})();

// ---- one timeline per configuration, on one scale ----
const used = D.categories.map((c,k)=>D.configs.some(cf=>cf.bytes.some(r=>r[k]>0)));
const legend = document.getElementById('legend');
D.categories.slice().reverse().forEach(c=>{ const k = D.categories.indexOf(c); if(!used[k]) return; const s=document.createElement('span');
  s.innerHTML='<i style="background:'+COLORS[c]+'"></i>'+esc(c); legend.appendChild(s); });
const phasesUsed = [];
D.configs.forEach(cf => cf.phases.forEach(p => { if (phasesUsed.indexOf(p[0]) < 0) phasesUsed.push(p[0]); }));
phasesUsed.forEach(p => { const s=document.createElement('span');
  s.innerHTML='<i style="background:'+C.phaseColor(p)+';outline:1px solid #ccc"></i>phase: '+esc(p); legend.appendChild(s); });
let ymax = 1;
D.configs.forEach(cf=>cf.bytes.forEach(r=>{ymax=Math.max(ymax, r.reduce((a,b)=>a+b,0));}));
D.configs.forEach(cf=>{ if(cf.predicted!==null) ymax=Math.max(ymax, cf.predicted); });
const ya = C.byteAxis(ymax, 5);
const W=640,H=340;
const charts = document.getElementById('charts');
// As many columns as fit at 520 px, balanced over the rows (4 charts: 2 x 2, not 3 + 1).
(function () {
  const w = charts.getBoundingClientRect().width, n = Math.max(1, D.configs.length);
  const fit = Math.max(1, Math.floor((w + 16) / (520 + 16)));
  const rows = Math.ceil(n / Math.min(fit, n));
  charts.style.gridTemplateColumns = 'repeat(' + Math.ceil(n / rows) + ', minmax(0, 1fr))';
})();
// Dry runs have no time: their x is the allocator event number.
function xsOf(cf){ return D.measured ? cf.t : cf.index; }
function xOfTime(cf, ms){ if (D.measured) return ms; let lo = 0; while (lo < cf.t.length - 1 && cf.t[lo] < ms) lo++; return cf.index[lo]; }
D.configs.forEach((cf, ci)=>{
  const box=document.createElement('div'); box.className='chart'; box.setAttribute('data-config', cf.name);
  const h=document.createElement('h3'); h.textContent=(ci+1)+'. '+cf.name+(ci?'':' (baseline)')+' \u2014 peak '+mib(cf.peak_allocated)+' MiB';
  box.appendChild(h);
  { const p=document.createElement('div'); p.className='hl';
    p.textContent=cf.headline || 'the configuration the others are compared with'; box.appendChild(p); }
  const links=document.createElement('div'); links.className='links';
  cf.links.forEach(l=>{ const a=document.createElement('a'); a.href=l[1]; a.textContent=l[0]; a.title=l[1]; links.appendChild(a); });
  box.appendChild(links);
  const svg=C.el(null,'svg',{viewBox:'0 0 '+W+' '+H,'class':'chart memchart'}); box.appendChild(svg);
  const readout=document.createElement('div'); readout.className='readout'; readout.innerHTML='&nbsp;'; box.appendChild(readout);
  charts.appendChild(box);
  const xs = xsOf(cf).slice(), by = cf.bytes.slice();
  let xmax = Math.max(xs.length ? xs[xs.length-1] : 1, D.measured ? 1e-3 : 1);
  if (D.measured) cf.phases.forEach(p => { xmax = Math.max(xmax, p[2]); });
  // The bytes stay at their last value until the step's last phase ends.
  if (xs.length && xmax > xs[xs.length-1]) { xs.push(xmax); by.push(by[by.length-1]); }
  const f = C.frame(W, H, 66, 14, 40, 42);
  const xa = D.measured ? C.fitX(f, n => C.timeAxis(xmax, n)) : C.fitX(f, n => C.countAxis(cf.samples, n));
  const runs = cf.phases.map(p => ({name: p[0], start: xOfTime(cf, p[1]), end: xOfTime(cf, p[2])}));
  C.phaseBands(svg, f, xa, runs);
  C.axes(svg, f, xa, ya, D.measured ? 'time in the step (' + xa.unit + '); median step ' + cf.median_ms.toFixed(1) + ' ms'
                                    : 'allocator events of the dry run (no time: predicted)', 'allocated (' + ya.unit + ')');
  const x = v => f.x(v, xa), y = b => f.y(b, ya);
  const base=xs.map(()=>0);
  D.categories.forEach((c,k)=>{
    if(!used[k]) return;
    const top=base.map((b,i)=>b+by[i][k]);
    let d='', peak=0;
    xs.forEach((t,i)=>{ d+=(i?'L':'M')+x(t).toFixed(1)+' '+y(top[i]).toFixed(1); peak=Math.max(peak, by[i][k]); });
    for(let i=xs.length-1;i>=0;i--) d+='L'+x(xs[i]).toFixed(1)+' '+y(base[i]).toFixed(1);
    if(xs.length) C.tip(C.el(svg,'path',{d:d+'Z',fill:COLORS[c],'fill-opacity':0.85,stroke:'none','class':'area','data-category':c}),
                        c + ': up to ' + C.human(peak) + ' in this step; ' + C.human(cf.at_peak[k]) + ' at the peak');
    top.forEach((v,i)=>base[i]=v);
  });
  const clip = 'clip' + ci;
  const cp = C.el(C.el(svg, 'defs', {}), 'clipPath', {id: clip});
  C.el(cp, 'rect', {x: f.L, y: f.T, width: f.W - f.L - f.R, height: f.H - f.T - f.B});
  const sg = C.el(svg, 'g', {'clip-path': 'url(#' + clip + ')', 'class': 'stairs'});
  let lastx=-100;
  cf.stairs.forEach(s=>{ const px=x(D.measured ? s[0] : s[3]); if(px-lastx<15) return; lastx=px;
    C.el(sg,'line',{x1:px,x2:px,y1:y(s[2]),y2:y(s[2])-8,stroke:'#333'});
    C.tip(C.text(sg,px,y(s[2])-10,s[1],{'font-size':10,fill:'#333','class':'stair',transform:'rotate(-60 '+px+' '+(y(s[2])-10)+')'}),
          s[1] + ': forward reached ' + C.human(s[2])); });
  if(cf.predicted!==null){ const py=y(cf.predicted);
    C.tip(C.el(svg,'line',{x1:f.L,x2:f.W-f.R,y1:py,y2:py,stroke:'#222','stroke-width':1.2,'stroke-dasharray':'6 4','class':'predicted'}),
          'predicted peak ' + C.human(cf.predicted));
    C.text(svg,f.W-f.R-2,py-4,'predicted peak '+mib(cf.predicted)+' MiB',{'font-size':11,'text-anchor':'end',fill:'#222'}); }
  const names = D.categories.filter((c,k)=>used[k]);
  C.hover(svg, f, xa, readout, v => {
    let lo = 0; while (lo < xs.length - 1 && xs[lo + 1] <= v) lo++;
    const row = by[lo] || [];
    const tot = row.reduce((a,b)=>a+b,0);
    let ph = ''; runs.forEach(r => { if (v >= r.start && v <= r.end) ph = r.name; });
    return (D.measured ? 't = ' + v.toFixed(2) + ' ms' : 'event ' + Math.round(v)) + (ph ? ' (' + ph + ')' : '') + ': ' + C.human(tot) +
      ' \u2014 ' + D.categories.map((c,k)=>[c,row[k]||0]).filter(p=>p[1]>0).sort((a,b)=>b[1]-a[1]).slice(0,4)
        .map(p=>p[0]+' '+C.human(p[1])).join(', ');
  });
});

// ---- the table, transposed: one column per configuration; split until it fits ----
const rows=[['peak allocated (MiB)',c=>c.peak_allocated,mib,true]];
if (D.configs.some(cf=>stepOf(cf)!==null)) rows.push([D.measured?'step time (ms)':'predicted step (ms)',c=>stepOf(c),v=>v.toFixed(1),true]);
if (D.measured && D.configs.some(cf=>cf.rounds>1)) rows.push(['step time, rounds\' range (ms)',c=>c.rounds>1?[c.min_ms,c.max_ms,c.rounds]:null,v=>v[0].toFixed(1)+'\u2013'+v[1].toFixed(1)+' ('+v[2]+' rounds)',false,true]);
if (D.measured) rows.push(['final loss',c=>c.final_loss,v=>v.toFixed(4),true,true]);
rows.push(['peak reserved (MiB)',c=>c.peak_reserved,mib]);
if (D.configs.some(cf=>cf.host_peak_allocated>0)) rows.push(['host peak allocated (MiB)',c=>c.host_peak_allocated,mib]);
if (D.configs.some(cf=>cf.predicted!==null)) rows.push(['predicted peak (MiB)',c=>c.predicted,mib]);
D.categories.forEach((c,k)=>{ if(D.configs.some(cf=>cf.at_peak[k]>0)) rows.push([c+' at the peak (MiB)',cf=>cf.at_peak[k],mib]); });
if (D.configs.some(cf=>cf.params[1]>0)) { const n=v=>v.toLocaleString('en-US'); rows.push(['trainable parameters',cf=>cf.params[0],n,false,true],['frozen parameters',cf=>cf.params[1],n,false,true],['frozen parameters (MiB)',cf=>cf.params[3],mib]); }
rows.push(['reserved \u2212 allocated (MiB)',c=>c.peak_reserved-c.peak_allocated,mib]);
// The peak within each phase of the recorded step (forward.0, backward.0, ... with micro-batches).
const phaseNames=[]; D.configs.forEach(cf=>cf.phase_peaks.forEach(p=>{ if(phaseNames.indexOf(p[0])<0) phaseNames.push(p[0]); }));
if (D.configs.some(cf=>cf.phase_peaks.some(p=>/\.\d+$/.test(p[0]))))
  phaseNames.forEach(n=>rows.push(['peak in '+esc(n)+' (MiB)',cf=>{ const p=cf.phase_peaks.find(q=>q[0]===n); return p?p[1]:null; },mib]));
function cell(row, cf, i){
  const v=row[1](cf), bv=row[1](base);
  if (v===null||v===undefined) return '<td>\u2013</td>';
  let s=row[2](v);
  if (i && bv!==null && !row[4]) { const d=v-bv; if (d!==0) { const p=bv?' '+(d>0?'+':'\u2212')+Math.abs(100*d/bv).toFixed(0)+'%':'';
    s+='<small class="'+(d<0?'better':'worse')+'">'+(d>0?'+':'\u2212')+row[2](Math.abs(d))+p+'</small>'; } }
  return '<td title="'+esc(cf.name+': '+row[0]+' '+v)+'">'+s+'</td>';
}
const tables=document.getElementById('tables');
function render(per){
  tables.innerHTML='';
  for (let s=0;s<D.configs.length;s+=per){
    const part=D.configs.slice(s,s+per);
    let h='<tr><th></th>'+part.map((cf,j)=>'<th>'+(s+j+1)+'. '+esc(cf.name)+'</th>').join('')+'</tr>';
    rows.forEach(r=>{ h+='<tr'+(r[3]?' class="key"':'')+'><td>'+r[0]+'</td>'+part.map((cf,j)=>cell(r,cf,s+j)).join('')+'</tr>'; });
    const t=document.createElement('table'); t.className='numbers'; t.innerHTML=h; tables.appendChild(t);
  }
}
let per=D.configs.length;
render(per);
const avail=()=>tables.getBoundingClientRect().width;
while (per>1 && Array.prototype.some.call(tables.querySelectorAll('table'),t=>t.getBoundingClientRect().width>avail()+0.5)) render(--per);
document.body.setAttribute('data-table-width', String(Math.max.apply(null, Array.prototype.map.call(tables.querySelectorAll('table'), t=>Math.ceil(t.getBoundingClientRect().width)))));
document.body.setAttribute('data-tables', String(tables.querySelectorAll('table').length));
document.body.setAttribute('data-charts', String(document.querySelectorAll('svg.memchart').length));
C.check();
document.body.setAttribute('data-rendered','1');
})();
</script>
</body></html>
)HTML";
  base::write_file_atomic(path, html, "write_report");
}

}  // namespace tally::ab
