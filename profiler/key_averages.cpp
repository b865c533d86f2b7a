// key_averages(): grouping of spans into rows and PyTorch's table layout.
#include "profiler/key_averages.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <stdexcept>
#include <unordered_map>

namespace tally::profiler {

std::string format_time_us(double us) {
  if (us >= 1e6 || us <= -1e6) return fmt::format("{:.3f}s", us / 1e6);
  if (us >= 1e3 || us <= -1e3) return fmt::format("{:.3f}ms", us / 1e3);
  return fmt::format("{:.3f}us", us);
}

std::string format_memory(int64_t bytes) {
  constexpr double KB = 1024.0, MB = KB * 1024, GB = MB * 1024;
  const double a = std::abs(static_cast<double>(bytes));
  if (a >= GB) return fmt::format("{:.2f} GB", static_cast<double>(bytes) / GB);
  if (a >= MB) return fmt::format("{:.2f} MB", static_cast<double>(bytes) / MB);
  if (a >= KB) return fmt::format("{:.2f} KB", static_cast<double>(bytes) / KB);
  return fmt::format("{} B", bytes);
}

std::string format_shapes(const std::vector<std::vector<int64_t>>& shapes) {
  std::string s = "[";
  for (size_t i = 0; i < shapes.size(); ++i) {
    if (i) s += ", ";
    s += fmt::format("[{}]", fmt::join(shapes[i], ", "));
  }
  return s + "]";
}

EventList::EventList(std::vector<FunctionEventAvg> rows, bool with_cuda, bool with_memory,
                     bool with_shapes)
    : rows_(std::move(rows)),
      with_cuda_(with_cuda),
      with_memory_(with_memory),
      with_shapes_(with_shapes) {}

const FunctionEventAvg& EventList::at(const std::string& key) const {
  for (const auto& r : rows_)
    if (r.key == key) return r;
  throw std::out_of_range(fmt::format("EventList::at: no row named '{}'", key));
}

double EventList::self_cpu_time_total() const {
  double t = 0;
  for (const auto& r : rows_) t += r.self_cpu_time_total;
  return t;
}

double EventList::self_cuda_time_total() const {
  double t = 0;
  for (const auto& r : rows_) t += r.self_cuda_time_total;
  return t;
}

namespace {

using Getter = std::function<double(const FunctionEventAvg&)>;

Getter sort_getter(std::string key) {
  for (const char* prefix : {"device_", "self_device_"}) {
    const std::string p(prefix);
    if (key.rfind(p, 0) == 0)
      key = (p == "device_" ? "cuda_" : "self_cuda_") + key.substr(p.size());
  }
  using R = const FunctionEventAvg&;
  static const std::map<std::string, Getter> getters = {
      {"cpu_time", [](R r) { return r.cpu_time(); }},
      {"cuda_time", [](R r) { return r.cuda_time(); }},
      {"cpu_time_total", [](R r) { return r.cpu_time_total; }},
      {"cuda_time_total", [](R r) { return r.cuda_time_total; }},
      {"self_cpu_time_total", [](R r) { return r.self_cpu_time_total; }},
      {"self_cuda_time_total", [](R r) { return r.self_cuda_time_total; }},
      {"cpu_memory_usage", [](R r) { return static_cast<double>(r.cpu_memory_usage); }},
      {"cuda_memory_usage", [](R r) { return static_cast<double>(r.cuda_memory_usage); }},
      {"self_cpu_memory_usage", [](R r) { return static_cast<double>(r.self_cpu_memory_usage); }},
      {"self_cuda_memory_usage", [](R r) { return static_cast<double>(r.self_cuda_memory_usage); }},
      {"count", [](R r) { return static_cast<double>(r.count); }},
  };
  auto it = getters.find(key);
  if (it == getters.end()) {
    std::string known;
    for (const auto& [k, g] : getters) known += (known.empty() ? "" : ", ") + k;
    throw std::invalid_argument(
        fmt::format("EventList::table: unknown sort_by '{}' (one of {})", key, known));
  }
  return it->second;
}

std::string truncate(const std::string& s, size_t width) {
  if (s.size() >= width && width > 3) return s.substr(0, width - 3) + "...";
  return s;
}

}  // namespace

std::string EventList::table(const std::string& sort_by, int row_limit, int max_name_column_width,
                             int max_shapes_column_width) const {
  std::vector<const FunctionEventAvg*> rows;
  for (const auto& r : rows_) rows.push_back(&r);
  if (!sort_by.empty()) {
    const Getter g = sort_getter(sort_by);
    std::stable_sort(
        rows.begin(), rows.end(),
        [&](const FunctionEventAvg* a, const FunctionEventAvg* b) { return g(*a) > g(*b); });
  }
  if (row_limit >= 0 && rows.size() > static_cast<size_t>(row_limit))
    rows.resize(static_cast<size_t>(row_limit));

  size_t name_w = 0, shapes_w = 0;
  for (const auto* r : rows) {
    name_w = std::max(name_w, r->key.size());
    shapes_w = std::max(shapes_w, r->input_shapes.size());
  }
  name_w = std::min(name_w + 4, static_cast<size_t>(max_name_column_width));
  shapes_w = std::min(shapes_w + 4, static_cast<size_t>(max_shapes_column_width));
  constexpr size_t kCol = 12;

  std::vector<std::string> headers = {"Name",        "Self CPU %", "Self CPU",
                                      "CPU total %", "CPU total",  "CPU time avg"};
  if (with_cuda_)
    for (const char* h : {"Self CUDA", "Self CUDA %", "CUDA total", "CUDA time avg"})
      headers.emplace_back(h);
  if (with_memory_) {
    headers.emplace_back("CPU Mem");
    headers.emplace_back("Self CPU Mem");
    if (with_cuda_) {
      headers.emplace_back("CUDA Mem");
      headers.emplace_back("Self CUDA Mem");
    }
  }
  headers.emplace_back("# of Calls");
  if (with_shapes_) headers.emplace_back("Input Shapes");

  auto width_of = [&](size_t i) {
    if (i == 0) return name_w;
    if (with_shapes_ && i == headers.size() - 1) return shapes_w;
    return kCol;
  };
  auto format_row = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (size_t i = 0; i < cells.size(); ++i) {
      const size_t w = width_of(i);
      line += i == 0 ? fmt::format("{:<{}}", cells[i], w) : fmt::format("{:>{}}", cells[i], w);
      line += "  ";
    }
    return line + "\n";
  };
  std::string sep;
  for (size_t i = 0; i < headers.size(); ++i) sep += std::string(width_of(i), '-') + "  ";
  sep += "\n";

  const double self_cpu_total = self_cpu_time_total();
  const double self_cuda_total = self_cuda_time_total();
  auto pct = [](double x, double total) {
    return fmt::format("{:.2f}%", total > 0 ? 100.0 * x / total : 0.0);
  };

  std::string out = sep + format_row(headers) + sep;
  for (const auto* r : rows) {
    std::vector<std::string> c = {truncate(r->key, name_w),
                                  pct(r->self_cpu_time_total, self_cpu_total),
                                  format_time_us(r->self_cpu_time_total),
                                  pct(r->cpu_time_total, self_cpu_total),
                                  format_time_us(r->cpu_time_total),
                                  format_time_us(r->cpu_time())};
    if (with_cuda_) {
      c.push_back(format_time_us(r->self_cuda_time_total));
      c.push_back(pct(r->self_cuda_time_total, self_cuda_total));
      c.push_back(format_time_us(r->cuda_time_total));
      c.push_back(format_time_us(r->cuda_time()));
    }
    if (with_memory_) {
      c.push_back(format_memory(r->cpu_memory_usage));
      c.push_back(format_memory(r->self_cpu_memory_usage));
      if (with_cuda_) {
        c.push_back(format_memory(r->cuda_memory_usage));
        c.push_back(format_memory(r->self_cuda_memory_usage));
      }
    }
    c.push_back(fmt::format("{}", r->count));
    if (with_shapes_) c.push_back(truncate(r->input_shapes, shapes_w));
    out += format_row(c);
  }
  out += sep;
  out += fmt::format("Self CPU time total: {}\n", format_time_us(self_cpu_total));
  if (with_cuda_) out += fmt::format("Self CUDA time total: {}\n", format_time_us(self_cuda_total));
  return out;
}

namespace {

bool is_device_work(const GpuEvent& g) {
  return g.kind == GpuKind::kernel || g.kind == GpuKind::memcpy || g.kind == GpuKind::memset;
}

struct Totals {
  double self_cuda = 0, cuda = 0;
  int64_t self_mem[2] = {0, 0};  // [cpu, cuda]
  int64_t mem[2] = {0, 0};
  double child_cpu = 0;
};

bool any_cuda(const ProfileData& d) {
  for (const auto& g : d.gpu)
    if (is_device_work(g)) return true;
  for (const auto& im : d.initial)
    if (im.device.type == memory::DeviceType::cuda) return true;
  return false;
}

}  // namespace

EventList build_key_averages(const ProfileData& data, bool group_by_input_shape) {
  std::unordered_map<uint64_t, Totals> t;
  for (const auto& g : data.gpu)
    if (is_device_work(g) && g.external_id) t[g.external_id].self_cuda += g.duration_ns() / 1e3;
  for (const auto& m : data.memory)
    if (!m.retag && m.op_id)
      t[m.op_id].self_mem[m.device.type == memory::DeviceType::cuda ? 1 : 0] += m.bytes;
  // Children start after their parents: walking backwards finishes each subtree first.
  for (auto it = data.spans.rbegin(); it != data.spans.rend(); ++it) {
    const CpuSpan& s = *it;
    if (s.kind != SpanKind::op && s.kind != SpanKind::user) continue;
    Totals& me = t[s.id];
    me.cuda += me.self_cuda;
    me.mem[0] += me.self_mem[0];
    me.mem[1] += me.self_mem[1];
    if (s.parent_op) {
      Totals& p = t[s.parent_op];
      p.cuda += me.cuda;
      p.mem[0] += me.mem[0];
      p.mem[1] += me.mem[1];
      p.child_cpu += s.duration_ns() / 1e3;
    }
  }
  std::vector<FunctionEventAvg> rows;
  std::map<std::pair<std::string, std::string>, size_t> index;
  for (const CpuSpan& s : data.spans) {
    if (s.kind != SpanKind::op && s.kind != SpanKind::user) continue;
    const std::string shapes = group_by_input_shape ? format_shapes(s.input_shapes) : "";
    // As PyTorch: all "ProfilerStep#N" ranges share the row "ProfilerStep*".
    const std::string name = s.name.rfind("ProfilerStep#", 0) == 0 ? "ProfilerStep*" : s.name;
    auto [it, fresh] = index.try_emplace({name, shapes}, rows.size());
    if (fresh) {
      rows.emplace_back();
      rows.back().key = name;
      rows.back().input_shapes = shapes;
    }
    FunctionEventAvg& r = rows[it->second];
    const Totals& me = t[s.id];
    const double dur = s.duration_ns() / 1e3;
    ++r.count;
    r.cpu_time_total += dur;
    r.self_cpu_time_total += dur - me.child_cpu;
    r.cuda_time_total += me.cuda;
    r.self_cuda_time_total += me.self_cuda;
    r.cpu_memory_usage += me.mem[0];
    r.self_cpu_memory_usage += me.self_mem[0];
    r.cuda_memory_usage += me.mem[1];
    r.self_cuda_memory_usage += me.self_mem[1];
  }
  return EventList(std::move(rows), any_cuda(data), data.profile_memory, group_by_input_shape);
}

EventList build_module_averages(const ProfileData& data) {
  std::unordered_map<uint64_t, const CpuSpan*> by_id;
  for (const CpuSpan& s : data.spans) by_id[s.id] = &s;
  std::vector<FunctionEventAvg> rows;
  std::map<std::string, size_t> index;
  auto row = [&](const std::string& path) -> FunctionEventAvg& {
    auto [it, fresh] = index.try_emplace(path, rows.size());
    if (fresh) {
      rows.emplace_back();
      rows.back().key = path;
    }
    return rows[it->second];
  };
  // CPU time: module spans; self excludes nested module spans (per thread, by containment).
  std::map<uint64_t, std::vector<const CpuSpan*>> stacks;  // tid -> open module spans
  std::unordered_map<const CpuSpan*, double> child;
  std::vector<const CpuSpan*> modules;
  for (const CpuSpan& s : data.spans) {
    if (s.kind != SpanKind::module) continue;
    auto& st = stacks[s.tid];
    while (!st.empty() && !(st.back()->start_ns <= s.start_ns && s.end_ns <= st.back()->end_ns &&
                            st.back()->depth < s.depth))
      st.pop_back();
    if (!st.empty()) child[st.back()] += s.duration_ns() / 1e3;
    st.push_back(&s);
    modules.push_back(&s);
  }
  for (const CpuSpan* s : modules) {
    FunctionEventAvg& r = row(s->name);
    ++r.count;
    r.cpu_time_total += s->duration_ns() / 1e3;
    r.self_cpu_time_total += s->duration_ns() / 1e3 - child[s];
  }
  auto for_prefixes = [&](const std::string& path,
                          const std::function<void(FunctionEventAvg&, bool)>& f) {
    if (path.empty() || !index.count(path)) return;
    f(rows[index[path]], true);
    for (size_t p = path.rfind('.'); p != std::string::npos; p = path.rfind('.', p - 1)) {
      auto it = index.find(path.substr(0, p));
      if (it != index.end()) f(rows[it->second], false);
      if (p == 0) break;
    }
  };
  for (const GpuEvent& g : data.gpu) {
    if (!is_device_work(g) || !g.external_id) continue;
    auto it = by_id.find(g.external_id);
    if (it == by_id.end()) continue;
    const double us = g.duration_ns() / 1e3;
    for_prefixes(it->second->module, [&](FunctionEventAvg& r, bool self) {
      r.cuda_time_total += us;
      if (self) r.self_cuda_time_total += us;
    });
  }
  for (const MemoryEvent& m : data.memory) {
    if (m.retag) continue;
    const bool cuda = m.device.type == memory::DeviceType::cuda;
    for_prefixes(m.scope_module, [&](FunctionEventAvg& r, bool self) {
      (cuda ? r.cuda_memory_usage : r.cpu_memory_usage) += m.bytes;
      if (self) (cuda ? r.self_cuda_memory_usage : r.self_cpu_memory_usage) += m.bytes;
    });
  }
  return EventList(std::move(rows), any_cuda(data), data.profile_memory, false);
}

}  // namespace tally::profiler
