// Chrome trace export (see chrome_trace.h and docs/memory-formats.md §5.1).
#include "profiler/chrome_trace.h"

#include <fmt/format.h>

#include <array>
#include <map>
#include <ostream>
#include <set>
#include <stdexcept>
#include <unordered_map>

#include "base/atomic_file.h"
#include "base/json.h"
#include "profiler/key_averages.h"
#include "profiler/profiler.h"

namespace tally::profiler {

std::string json_string(const std::string& s) {
  return base::json_quote(s);
}

namespace {

std::string ts(int64_t ns) {
  return fmt::format("{:.3f}", static_cast<double>(ns) / 1e3);
}

std::string shapes_json(const std::vector<std::vector<int64_t>>& shapes) {
  std::string s = "[";
  for (size_t i = 0; i < shapes.size(); ++i)
    s += fmt::format("{}[{}]", i ? ", " : "", fmt::join(shapes[i], ", "));
  return s + "]";
}

class Writer {
 public:
  explicit Writer(std::ostream& out) : out_(out) {}
  void event(const std::string& body) {
    out_ << (first_ ? "\n  " : ",\n  ") << "{" << body << "}";
    first_ = false;
  }

 private:
  std::ostream& out_;
  bool first_ = true;
};

// The logical stack of a span, outermost first: phase, module path, record_function
// call site, op.
std::string stack_json(const CpuSpan& s) {
  std::vector<std::string> frames;
  if (!s.phase.empty()) frames.push_back("phase: " + s.phase);
  if (!s.module.empty()) frames.push_back("module: " + s.module);
  if (!s.file.empty())
    frames.push_back(fmt::format("{}({}): {}", s.file, s.line, s.name));
  else
    frames.push_back(s.name);
  std::string o = "[";
  for (size_t i = 0; i < frames.size(); ++i) o += (i ? ", " : "") + json_string(frames[i]);
  return o + "]";
}

}  // namespace

void write_chrome_trace(const ProfileData& d, std::ostream& out) {
  const int64_t pid = d.pid;
  out << "{\n\"schemaVersion\": 1,\n\"deviceProperties\": [],\n";
  out << fmt::format("\"with_stack\": {},\n\"profile_memory\": {},\n\"record_shapes\": {},\n",
                     d.with_stack ? 1 : 0, d.profile_memory ? 1 : 0, d.record_shapes ? 1 : 0);
  out << "\"displayTimeUnit\": \"ms\",\n";
  out << fmt::format("\"baseTimeNanoseconds\": {},\n", d.base_time_ns);
  out << "\"traceEvents\": [";
  Writer w(out);

  // Metadata: process and thread names.
  std::set<uint64_t> tids;
  for (const CpuSpan& s : d.spans) tids.insert(s.tid);
  for (const MemoryEvent& m : d.memory) tids.insert(m.tid);
  std::set<std::pair<int, uint64_t>> gpu_tracks;
  for (const GpuEvent& g : d.gpu)
    if (g.kind == GpuKind::runtime || g.kind == GpuKind::driver)
      tids.insert(g.tid);
    else
      gpu_tracks.insert({g.device, g.stream});
  w.event(fmt::format(
      R"("name": "process_name", "ph": "M", "ts": 0, "pid": {}, "tid": 0, "args": {{"name": "tally"}})",
      pid));
  w.event(fmt::format(
      R"("name": "process_labels", "ph": "M", "ts": 0, "pid": {}, "tid": 0, "args": {{"labels": "CPU"}})",
      pid));
  w.event(fmt::format(
      R"("name": "process_sort_index", "ph": "M", "ts": 0, "pid": {}, "tid": 0, "args": {{"sort_index": 0}})",
      pid));
  for (uint64_t tid : tids)
    w.event(fmt::format(
        R"("name": "thread_name", "ph": "M", "ts": 0, "pid": {}, "tid": {}, "args": {{"name": "thread {}"}})",
        pid, tid, tid));
  std::set<int> gpu_pids;
  for (const auto& [dev, stream] : gpu_tracks) {
    if (gpu_pids.insert(dev).second) {
      w.event(fmt::format(
          R"("name": "process_name", "ph": "M", "ts": 0, "pid": {}, "tid": 0, "args": {{"name": "tally"}})",
          dev));
      w.event(fmt::format(
          R"("name": "process_labels", "ph": "M", "ts": 0, "pid": {}, "tid": 0, "args": {{"labels": "GPU {}"}})",
          dev, dev));
      w.event(fmt::format(
          R"("name": "process_sort_index", "ph": "M", "ts": 0, "pid": {}, "tid": 0, "args": {{"sort_index": {}}})",
          dev, dev + 1));
    }
    w.event(fmt::format(
        R"("name": "thread_name", "ph": "M", "ts": 0, "pid": {}, "tid": {}, "args": {{"name": "stream {}"}})",
        dev, stream, stream));
  }

  // CPU spans.
  for (const CpuSpan& s : d.spans) {
    std::string args = fmt::format(R"("External id": {}, "Record function id": 0)", s.id);
    if (!s.module.empty()) args += R"(, "Module": )" + json_string(s.module);
    if (!s.phase.empty()) args += R"(, "Phase": )" + json_string(s.phase);
    if (s.kind == SpanKind::op) args += R"(, "Device": )" + json_string(s.device.str());
    if (d.record_shapes && s.kind == SpanKind::op) {
      args += R"(, "Input Dims": )" + shapes_json(s.input_shapes);
      std::string types = "[";
      for (size_t i = 0; i < s.input_types.size(); ++i)
        types += (i ? ", " : "") + json_string(s.input_types[i]);
      args += R"(, "Input type": )" + types + "]";
    }
    if (d.with_stack) args += R"(, "Stack": )" + stack_json(s);
    w.event(fmt::format(
        R"("ph": "X", "cat": "{}", "name": {}, "pid": {}, "tid": {}, "ts": {}, "dur": {}, "args": {{{}}})",
        span_kind_name(s.kind), json_string(s.name), pid, s.tid, ts(s.start_ns),
        ts(s.duration_ns()), args));
  }

  // GPU activity and launch flows.
  std::unordered_map<uint32_t, const GpuEvent*> launches;
  for (const GpuEvent& g : d.gpu)
    if (g.kind == GpuKind::runtime || g.kind == GpuKind::driver) launches[g.correlation] = &g;
  for (const GpuEvent& g : d.gpu) {
    const bool host = g.kind == GpuKind::runtime || g.kind == GpuKind::driver;
    std::string args =
        fmt::format(R"("External id": {}, "correlation": {})", g.external_id, g.correlation);
    if (host) {
      args += fmt::format(R"(, "cbid": {})", g.cbid);
    } else {
      args += fmt::format(R"(, "device": {}, "stream": {})", g.device, g.stream);
      if (g.kind == GpuKind::kernel)
        args += fmt::format(
            R"(, "registers per thread": {}, "shared memory": {}, "grid": [{}, {}, {}], "block": [{}, {}, {}])",
            g.registers_per_thread, g.shared_memory, g.grid[0], g.grid[1], g.grid[2], g.block[0],
            g.block[1], g.block[2]);
      else
        args +=
            fmt::format(R"J(, "bytes": {}, "memory bandwidth (GB/s)": {:.3f})J", g.bytes,
                        g.duration_ns() > 0 ? static_cast<double>(g.bytes) / g.duration_ns() : 0.0);
    }
    const int64_t p = host ? pid : g.device;
    const uint64_t t = host ? g.tid : g.stream;
    w.event(fmt::format(
        R"("ph": "X", "cat": "{}", "name": {}, "pid": {}, "tid": {}, "ts": {}, "dur": {}, "args": {{{}}})",
        gpu_kind_name(g.kind), json_string(g.name), p, t, ts(g.start_ns), ts(g.duration_ns()),
        args));
    if (!host) {
      auto it = launches.find(g.correlation);
      if (it != launches.end()) {
        const GpuEvent& l = *it->second;
        w.event(fmt::format(
            R"("ph": "s", "id": {}, "pid": {}, "tid": {}, "ts": {}, "cat": "ac2g", "name": "ac2g")",
            g.correlation, pid, l.tid, ts(l.start_ns)));
        w.event(fmt::format(
            R"("ph": "f", "id": {}, "pid": {}, "tid": {}, "ts": {}, "cat": "ac2g", "name": "ac2g", "bp": "e")",
            g.correlation, g.device, g.stream, ts(g.start_ns)));
      }
    }
  }

  // Memory: instant events and per-category counters.
  std::map<std::pair<int, int>, std::array<int64_t, memory::kNumCategories>> live;  // device
  auto counter_pid = [&](const memory::Device& dev) {
    return dev.type == memory::DeviceType::cuda ? static_cast<int64_t>(dev.index) : pid;
  };
  auto counter = [&](const memory::Device& dev, memory::Category c, int64_t time_ns, int64_t v) {
    w.event(fmt::format(
        R"("ph": "C", "name": "Memory {}: {}", "pid": {}, "tid": 0, "ts": {}, "args": {{"bytes": {}}})",
        dev.str(), memory::category_name(c), counter_pid(dev), ts(time_ns), v));
  };
  for (const InitialMemory& im : d.initial) {
    auto& l = live[{static_cast<int>(im.device.type), im.device.index}];
    for (memory::Category c : memory::kAllCategories) {
      l[static_cast<int>(c)] = im.category_bytes[static_cast<int>(c)];
      counter(im.device, c, 0, l[static_cast<int>(c)]);
    }
  }
  for (const MemoryEvent& m : d.memory) {
    auto& l = live.try_emplace({static_cast<int>(m.device.type), m.device.index}).first->second;
    if (m.retag) {  // the block moves between category counters
      l[static_cast<int>(m.old_category)] -= m.bytes;
      l[static_cast<int>(m.category)] += m.bytes;
      counter(m.device, m.old_category, m.time_ns, l[static_cast<int>(m.old_category)]);
      counter(m.device, m.category, m.time_ns, l[static_cast<int>(m.category)]);
      continue;
    }
    std::string args = fmt::format(
        R"("Total Reserved": {}, "Total Allocated": {}, "Bytes": {}, "Device Id": {}, "Device Type": {}, "Addr": {}, "finished": false, "Category": {})",
        m.total_reserved, m.total_allocated, m.bytes, m.device.index,
        m.device.type == memory::DeviceType::cuda ? 1 : 0, m.addr,
        json_string(std::string(memory::category_name(m.category))));
    if (!m.module.empty()) args += R"(, "Module": )" + json_string(m.module);
    if (!m.op.empty()) args += R"(, "Op": )" + json_string(m.op);
    if (!m.phase.empty()) args += R"(, "Phase": )" + json_string(m.phase);
    if (!m.file.empty())
      args += R"(, "Source": )" + json_string(fmt::format("{}:{}", m.file, m.line));
    w.event(fmt::format(
        R"("ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": {}, "tid": {}, "ts": {}, "args": {{{}}})",
        pid, m.tid, ts(m.time_ns), args));
    l[static_cast<int>(m.category)] += m.bytes;
    counter(m.device, m.category, m.time_ns, l[static_cast<int>(m.category)]);
  }
  out << "\n],\n\"traceName\": \"tally\"\n}\n";
}

void write_chrome_trace_file(const ProfileData& data, const std::string& path) {
  base::write_file_atomic(
      path, [&](std::ostream& out) { write_chrome_trace(data, out); }, "export_chrome_trace");
}

void Profiler::export_chrome_trace(const std::string& path) const {
  write_chrome_trace_file(data(), path);
}

}  // namespace tally::profiler
