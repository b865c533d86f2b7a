#include "examples/ab_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <functional>
#include <stdexcept>

#include "memory/atomic_file.h"
#include "memory/context.h"

namespace tally::examples {

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

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        o += "\\\"";
        break;
      case '\\':
        o += "\\\\";
        break;
      case '\n':
        o += "\\n";
        break;
      case '<':
        o += "\\u003c";
        break;  // never close the <script> early
      case '>':
        o += "\\u003e";
        break;
      case '&':
        o += "\\u0026";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          o += fmt::format("\\u{:04x}", static_cast<int>(c));
        else
          o += c;
    }
  }
  return o + "\"";
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
  for (Category c : kOrder) {
    bool any = false;
    for (const auto& r : results) any = any || r.at_peak[static_cast<size_t>(c)] != 0;
    if (!any && c != Category::activation) continue;
    cols.push_back({std::string(memory::category_name(c)), [c](const ConfigResult& r) {
                      return static_cast<double>(r.at_peak[static_cast<size_t>(c)]);
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

void write_report(const std::string& path, const std::string& title,
                  const std::vector<ConfigResult>& results) {
  // ---- data ----
  std::string data = "{\"title\":" + json_str(title) + ",\"categories\":[";
  for (size_t k = 0; k < std::size(kOrder); ++k)
    data += (k ? "," : "") + json_str(std::string(memory::category_name(kOrder[k])));
  data += "],\"colors\":{";
  for (size_t k = 0; k < memory::kAllCategories.size(); ++k)
    data += fmt::format("{}{}:\"{}\"", k ? "," : "",
                        json_str(std::string(memory::category_name(memory::kAllCategories[k]))),
                        memory::category_color(memory::kAllCategories[k]));
  data += "},\"configs\":[";
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
    data += std::string(i ? "," : "") + "{\"name\":" + json_str(r.name);
    // A dry run (--estimate) has no step time and no loss: null. `predicted`: the dry run's
    // peak next to a measured run (the dashed line), else null.
    auto number = [](double v, int digits) {
      return std::isfinite(v) ? fmt::format("{:.{}f}", v, digits) : std::string("null");
    };
    data += fmt::format(
        ",\"peak_allocated\":{},\"peak_reserved\":{},\"median_ms\":{},\"final_loss\":{},"
        "\"predicted\":{}",
        r.peak_allocated, r.peak_reserved, number(r.median_ms, 3), number(r.final_loss, 6),
        r.measured && r.predicted ? std::to_string(r.estimate.peak_allocated) : "null");
    data += ",\"at_peak\":[";
    for (size_t k = 0; k < std::size(kOrder); ++k)
      data += fmt::format("{}{}", k ? "," : "", r.at_peak[static_cast<size_t>(kOrder[k])]);
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
    // Phase bands and the forward staircase, from every sample (not only the kept ones).
    data += "],\"phases\":[";
    std::string cur_phase;
    double band_start = 0;
    bool first_band = true;
    auto close_band = [&](double end) {
      if (!cur_phase.empty()) {
        data += fmt::format("{}[{},{:.3f},{:.3f}]", first_band ? "" : ",", json_str(cur_phase),
                            band_start, end);
        first_band = false;
      }
    };
    for (size_t s = 0; s < n; ++s) {
      const std::string& ph = memory::interned(t.phase[s]);
      const double ms = (t.times_us[s] - t0) / 1000.0;
      if (ph != cur_phase && !ph.empty()) {
        close_band(ms);
        cur_phase = ph;
        band_start = ms;
      }
    }
    close_band(n ? (t.times_us[n - 1] - t0) / 1000.0 : 0);
    data += "],\"stairs\":[";
    std::string cur_group;
    bool first_stair = true;
    for (size_t s = 0; s < n; ++s) {
      if (memory::interned(t.phase[s]) != "forward") continue;
      const std::string g = module_group(memory::interned(t.module[s]));
      if (g.empty() || g == cur_group) continue;
      cur_group = g;
      data += fmt::format("{}[{:.3f},{},{}]", first_stair ? "" : ",", (t.times_us[s] - t0) / 1000.0,
                          json_str(g), t.total(s));
      first_stair = false;
    }
    data += "],\"snapshot\":" + json_str(r.snapshot_path) +
            ",\"timeline\":" + json_str(r.timeline_path) + "}";
  }
  data += "]}";

  // ---- page ----
  std::string html = R"HTML(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Tally A/B memory report</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px} .sub{color:#666;margin-bottom:16px}
.charts{display:flex;flex-wrap:wrap;gap:16px}
.chart{border:1px solid #ddd;border-radius:6px;padding:8px}
.chart h2{font-size:14px;margin:0 0 4px}
.legend{display:flex;flex-wrap:wrap;gap:12px;margin:12px 0}
.legend span{display:inline-flex;align-items:center;gap:4px}
.legend i{width:12px;height:12px;display:inline-block;border-radius:2px}
table{border-collapse:collapse;margin-top:16px;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid #eee;padding:4px 8px;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}
.better{color:#1a7f37}.worse{color:#cf222e}
</style></head>
<body>
<h1>Tally A/B memory report</h1>
<div class="sub" id="title"></div>
<div class="legend" id="legend"></div>
<div class="charts" id="charts"></div>
<table id="table"></table>
<p class="sub">One training step per configuration (the last of the run), bytes allocated by category over
time on one scale. Bands: phases (forward, backward, optimizer, recompute). Labels on the forward ramp: the
module whose forward allocated there (the activation "staircase"). Table: bytes per category at the moment
allocated memory peaked; changes against the first row.</p>
<script id="data" type="application/json">)HTML";
  html += data;
  html += R"HTML(</script>
<script>
(function(){
const D = JSON.parse(document.getElementById('data').textContent);
const COLORS = D.colors;  // memory::category_color: one palette on every page
const BAND = {forward:'#e8f0fe',backward:'#fdf0e6',optimizer:'#e9f7ec',recompute:'#fbe9f0'};
const NS = 'http://www.w3.org/2000/svg';
function el(tag, attrs, parent){const e=document.createElementNS(NS,tag);for(const k in attrs)e.setAttribute(k,attrs[k]);if(parent)parent.appendChild(e);return e;}
function mib(b){return (b/1048576).toFixed(1);}
document.getElementById('title').textContent = D.title;
const used = D.categories.map((c,k)=>D.configs.some(cf=>cf.bytes.some(r=>r[k]>0)));
const legend = document.getElementById('legend');
D.categories.forEach((c,k)=>{ if(!used[k]) return; const s=document.createElement('span');
  s.innerHTML='<i style="background:'+COLORS[c]+'"></i>'+c; legend.appendChild(s); });
let ymax = 1;
D.configs.forEach(cf=>cf.bytes.forEach(r=>{ymax=Math.max(ymax, r.reduce((a,b)=>a+b,0));}));
D.configs.forEach(cf=>{ if(cf.predicted!==null) ymax=Math.max(ymax, cf.predicted); });
ymax *= 1.08;
const W=560,H=330,L=56,R=12,T=34,B=36;
const charts = document.getElementById('charts');
D.configs.forEach(cf=>{
  const box=document.createElement('div'); box.className='chart';
  const h=document.createElement('h2'); h.textContent=cf.name+' \u2014 peak '+mib(cf.peak_allocated)+' MiB';
  box.appendChild(h);
  const svg=el('svg',{width:W,height:H,viewBox:'0 0 '+W+' '+H,'class':'memchart'},box);
  const tmax=Math.max(cf.t.length?cf.t[cf.t.length-1]:1,1e-3);
  const x=t=>L+(W-L-R)*t/tmax, y=b=>H-B-(H-T-B)*b/ymax;
  cf.phases.forEach(p=>{ el('rect',{x:x(p[1]),y:T,width:Math.max(0,x(p[2])-x(p[1])),height:H-T-B,fill:BAND[p[0]]||'#f4f4f4'},svg);
    const tx=el('text',{x:x(p[1])+3,y:T+12,'font-size':10,fill:'#777'},svg); tx.textContent=p[0]; });
  for(let g=0;g<=4;g++){ const v=ymax*g/4; el('line',{x1:L,x2:W-R,y1:y(v),y2:y(v),stroke:'#eee'},svg);
    const tx=el('text',{x:L-4,y:y(v)+4,'font-size':10,'text-anchor':'end',fill:'#555'},svg); tx.textContent=mib(v); }
  const base=cf.t.map(()=>0);
  D.categories.forEach((c,k)=>{
    if(!used[k]) return;
    const top=base.map((b,i)=>b+cf.bytes[i][k]);
    let d='';
    cf.t.forEach((t,i)=>{ d+=(i?'L':'M')+x(t).toFixed(1)+' '+y(top[i]).toFixed(1); });
    for(let i=cf.t.length-1;i>=0;i--) d+='L'+x(cf.t[i]).toFixed(1)+' '+y(base[i]).toFixed(1);
    if(cf.t.length) el('path',{d:d+'Z',fill:COLORS[c],'fill-opacity':0.85,stroke:'none','data-category':c},svg);
    top.forEach((v,i)=>base[i]=v);
  });
  let lastx=-100;
  cf.stairs.forEach(s=>{ const px=x(s[0]); if(px-lastx<9) return; lastx=px;
    el('line',{x1:px,x2:px,y1:y(s[2]),y2:y(s[2])-8,stroke:'#333'},svg);
    const tx=el('text',{x:px,y:y(s[2])-10,'font-size':9,fill:'#333',transform:'rotate(-60 '+px+' '+(y(s[2])-10)+')'},svg);
    tx.textContent=s[1]; });
  if(cf.predicted!==null){ const py=y(cf.predicted);
    el('line',{x1:L,x2:W-R,y1:py,y2:py,stroke:'#222','stroke-width':1.2,'stroke-dasharray':'6 4','class':'predicted'},svg);
    const pt=el('text',{x:W-R-2,y:py-4,'font-size':10,'text-anchor':'end',fill:'#222'},svg);
    pt.textContent='predicted peak '+mib(cf.predicted)+' MiB'; }
  el('line',{x1:L,x2:W-R,y1:H-B,y2:H-B,stroke:'#999'},svg);
  el('line',{x1:L,x2:L,y1:T,y2:H-B,stroke:'#999'},svg);
  const xl=el('text',{x:(L+W-R)/2,y:H-8,'font-size':11,'text-anchor':'middle',fill:'#555'},svg);
  xl.textContent=cf.median_ms===null?'the dry run\u2019s allocations in order (no time: predicted)':
    'time in step (ms), '+cf.median_ms.toFixed(1)+' ms median';
  const yl=el('text',{x:12,y:(T+H-B)/2,'font-size':11,'text-anchor':'middle',fill:'#555',transform:'rotate(-90 12 '+((T+H-B)/2)+')'},svg);
  yl.textContent='MiB allocated';
  charts.appendChild(box);
});
const tab=document.getElementById('table');
const cols=[['peak alloc',c=>c.peak_allocated],['peak reserved',c=>c.peak_reserved]];
D.categories.forEach((c,k)=>{ if(D.configs.some(cf=>cf.at_peak[k]>0)) cols.push([c,cf=>cf.at_peak[k]]); });
cols.push(['reserved \u2212 allocated',c=>c.peak_reserved-c.peak_allocated]);
let hr='<tr><th>configuration</th>'+cols.map(c=>'<th>'+c[0]+' (MiB)</th>').join('')+'<th>step ms</th><th>final loss</th></tr>';
const b0=D.configs[0];
D.configs.forEach((cf,i)=>{
  const cell=(v,bv,unit)=>{ let s=unit(v); if(i&&bv!==undefined){ const d=v-bv; if(d!==0){ const p=bv?(' '+(d>0?'+':'\u2212')+Math.abs(100*d/bv).toFixed(0)+'%'):'';
     s+=' <span class="'+(d<0?'better':'worse')+'">('+(d>0?'+':'\u2212')+unit(Math.abs(d))+p+')</span>'; } } return '<td>'+s+'</td>'; };
  hr+='<tr><td>'+cf.name.replace(/</g,'&lt;')+'</td>'+cols.map(c=>cell(c[1](cf),c[1](b0),mib)).join('')+
      (cf.median_ms===null?'<td>\u2013</td><td>\u2013</td>':
       cell(cf.median_ms,b0.median_ms,v=>v.toFixed(1))+'<td>'+cf.final_loss.toFixed(4)+'</td>')+'</tr>';
});
tab.innerHTML=hr;
document.body.setAttribute('data-rendered','1');
document.body.setAttribute('data-charts', String(document.querySelectorAll('svg.memchart').length));
})();
</script>
</body></html>
)HTML";
  memory::write_file_atomic(path, html, "write_report");
}

}  // namespace tally::examples
