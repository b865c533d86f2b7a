// The profiler on CPU: a few training steps of a tiny raw-op CNN, profiled with memory,
// shapes and stacks; the Chrome trace (checked by check_trace.py), key_averages and its
// table, the schedule, the memory timeline (.json round trip, .html, headless Chromium),
// the window's memory snapshot and the observers' zero-cost-when-off property; ops of several
// threads recorded while reports run (also under ThreadSanitizer in .ci/run).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "memory/memory.h"
#include "optim/adam.h"
#include "optim/clip_grad.h"
#include "optim/grad_scaler.h"
#include "optim/sgd.h"
#include "profiler/memory_timeline.h"
#include "profiler/profiler.h"
#include "tensor/dispatch.h"
#include "tensor/ops.h"
#include "testing/files.h"
#include "tiny_cnn.h"

namespace tally {
namespace {

namespace fs = std::filesystem;
using profiler::Profiler;
using profiler::ProfilerOptions;
using tally::testing::read_file;

fs::path temp_dir() {
  fs::path d = fs::temp_directory_path() / fmt::format("tally_profiler_{}", ::getpid());
  fs::create_directories(d);
  return d;
}

ProfilerOptions full_options() {
  ProfilerOptions o;
  o.activities = {profiler::ProfilerActivity::cpu};
  o.profile_memory = true;
  o.record_shapes = true;
  o.with_stack = true;
  return o;
}

// One profiled window of `steps` training steps (after one unprofiled warm step).
struct Profiled {
  testing::TinyCnn net;
  Profiler prof{full_options()};
  size_t allocated_before = 0, allocated_after = 0;

  explicit Profiled(int steps) {
    net.train_step();
    allocated_before = memory::memory_allocated(memory::Device::cpu());
    prof.start();
    for (int i = 0; i < steps; ++i) {
      net.train_step();
      prof.step();
    }
    allocated_after = memory::memory_allocated(memory::Device::cpu());
    prof.stop();
  }
};

TEST(Profiler, ObserversAreOffOutsideAWindow) {
  EXPECT_EQ(dispatch_observer(), nullptr);
  EXPECT_EQ(memory::context_observer(), nullptr);
  EXPECT_EQ(memory::allocation_observer(), nullptr);
  { Profiled p(1); }
  EXPECT_EQ(dispatch_observer(), nullptr);
  EXPECT_EQ(memory::context_observer(), nullptr);
  EXPECT_EQ(memory::allocation_observer(), nullptr);
  // Nothing is recorded by record_function without a profiler.
  { profiler::record_function r("outside"); }
  Profiler idle;
  EXPECT_THROW(idle.data(), std::logic_error);
}

TEST(Profiler, OneAtATime) {
  Profiler a(full_options()), b(full_options());
  a.start();
  EXPECT_THROW(b.start(), std::logic_error);
  a.stop();
  b.start();
  b.stop();
}

TEST(Profiler, RecordsOpsModulesRangesPhasesAndShapes) {
  Profiled p(2);
  const profiler::ProfileData& d = p.prof.data();
  auto count = [&](profiler::SpanKind k, const std::string& name) {
    return std::count_if(d.spans.begin(), d.spans.end(),
                         [&](const auto& s) { return s.kind == k && s.name == name; });
  };
  using profiler::SpanKind;
  EXPECT_EQ(count(SpanKind::op, "conv2d"), 2);
  EXPECT_EQ(count(SpanKind::op, "linear"), 4);
  EXPECT_EQ(count(SpanKind::module, "net.fc1"), 2);
  EXPECT_EQ(count(SpanKind::module, "net.conv1"), 2);
  EXPECT_EQ(count(SpanKind::user, "## Forward Pass ##"), 2);
  EXPECT_EQ(count(SpanKind::user, "ProfilerStep#0"), 1);
  EXPECT_EQ(count(SpanKind::user, "ProfilerStep#1"), 1);
  EXPECT_EQ(count(SpanKind::phase, "backward"), 2);
  EXPECT_EQ(count(SpanKind::phase, "optimizer"), 2);
  for (const auto& s : d.spans) {
    EXPECT_LE(s.start_ns, s.end_ns) << s.name;
    if (s.kind == SpanKind::op && s.name == "linear") {
      EXPECT_TRUE(s.module == "net.fc1" || s.module == "net.fc2") << s.module;
      EXPECT_EQ(s.phase, "forward");
      ASSERT_EQ(s.input_shapes.size(), 3u);  // x, weight, bias
      EXPECT_EQ(s.input_shapes[0][0], testing::TinyCnn::kBatch);
      EXPECT_EQ(s.input_types[0], "float32");
    }
  }
  // Children lie inside their parents.
  std::map<uint64_t, const profiler::CpuSpan*> by_id;
  for (const auto& s : d.spans) by_id[s.id] = &s;
  for (const auto& s : d.spans) {
    if (!s.parent) continue;
    const auto* parent = by_id.at(s.parent);
    EXPECT_GE(s.start_ns, parent->start_ns) << s.name << " in " << parent->name;
    EXPECT_LE(s.end_ns, parent->end_ns) << s.name << " in " << parent->name;
    EXPECT_EQ(s.depth, parent->depth + 1);
  }
  // Memory events are tagged.
  ASSERT_FALSE(d.memory.empty());
  for (const auto& m : d.memory) EXPECT_NE(m.category, memory::Category::unknown) << m.op;
}

// The times are nanoseconds of the steady clock since the window's start, whatever the
// recording threads read (the time-stamp counter where it is invariant): a range around a
// sleep lasts the sleep (steady-clock times around it bound it), inside the window.
TEST(Profiler, SpanTimesAreSteadyClockNanoseconds) {
  using clock = std::chrono::steady_clock;
  auto ns = [](clock::duration d) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
  };
  Profiler prof(full_options());
  const auto before_start = clock::now();
  prof.start();
  int64_t inner = 0, outer = 0;
  {
    profiler::record_function outer_range("outer");
    const auto o0 = clock::now();
    {
      profiler::record_function range("sleep");
      const auto s0 = clock::now();
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      inner = ns(clock::now() - s0);
    }
    outer = ns(clock::now() - o0);
  }
  prof.stop();
  // The window lies between the clock reads around start() and stop(); how long those
  // calls take themselves varies (a sanitizer build slows them by milliseconds).
  const int64_t window = ns(clock::now() - before_start);
  const profiler::ProfileData& d = prof.data();
  const auto it = std::find_if(d.spans.begin(), d.spans.end(),
                               [](const profiler::CpuSpan& s) { return s.name == "sleep"; });
  ASSERT_NE(it, d.spans.end());
  // Recorded inside what the steady clock measured around it, to 50 us.
  EXPECT_GE(it->duration_ns(), inner - 50000) << "steady clock: " << inner << " ns";
  EXPECT_LE(it->duration_ns(), outer + 50000) << "steady clock: " << outer << " ns";
  EXPECT_GE(it->start_ns, 0);
  EXPECT_LE(it->end_ns, d.duration_ns);
  EXPECT_LE(d.duration_ns, window + 50000) << "steady clock around start and stop: " << window;
  EXPECT_GE(d.duration_ns, outer);
}

TEST(Profiler, ChromeTraceParsesAndNests) {
  Profiled p(2);
  const fs::path trace = temp_dir() / "tiny.trace.json";
  p.prof.export_chrome_trace(trace.string());
  const std::string cmd = fmt::format("{} {}/tests/profiler/check_trace.py {}", TALLY_PYTHON,
                                      TALLY_SOURCE_DIR, trace.string());
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::string text = read_file(trace);
  EXPECT_NE(text.find("\"Input Dims\""), std::string::npos);
  EXPECT_NE(text.find("\"Stack\""), std::string::npos);
}

TEST(Profiler, KeyAveragesAddUp) {
  Profiled p(3);
  const profiler::ProfileData& d = p.prof.data();
  const profiler::EventList rows = p.prof.key_averages();
  // Self times sum to the roots' total time.
  double roots = 0;
  for (const auto& s : d.spans)
    if ((s.kind == profiler::SpanKind::op || s.kind == profiler::SpanKind::user) && !s.parent_op)
      roots += s.duration_ns() / 1e3;
  EXPECT_NEAR(rows.self_cpu_time_total(), roots, 1e-6 * rows.size() + 1e-3);
  for (const auto& r : rows.rows()) {
    EXPECT_LE(r.self_cpu_time_total, r.cpu_time_total + 1e-9) << r.key;
    EXPECT_GE(r.self_cpu_time_total, -1e-9) << r.key;
  }
  EXPECT_EQ(rows.at("conv2d").count, 3);
  EXPECT_EQ(rows.at("linear").count, 6);
  EXPECT_EQ(rows.at("## Backward Pass ##").count, 3);
  // Self CPU Mem over all rows is the window's net allocation (every event is inside the
  // ProfilerStep range at least).
  int64_t self_mem = 0;
  for (const auto& r : rows.rows()) self_mem += r.self_cpu_memory_usage;
  EXPECT_EQ(self_mem,
            static_cast<int64_t>(p.allocated_after) - static_cast<int64_t>(p.allocated_before));
  // The steps enclose everything: their inclusive CPU Mem is the net allocation too.
  EXPECT_EQ(rows.at("ProfilerStep*").count, 4);  // #0..#3, the last opened by step()
  EXPECT_EQ(rows.at("ProfilerStep*").cpu_memory_usage, self_mem);
  EXPECT_GT(rows.at("linear").self_cpu_memory_usage, 0);  // its output

  const std::string table = rows.table("self_cpu_time_total", 10);
  for (const char* h : {"Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total",
                        "CPU time avg", "CPU Mem", "Self CPU Mem", "# of Calls"})
    EXPECT_NE(table.find(h), std::string::npos) << h;
  EXPECT_EQ(table.find("Input Shapes"), std::string::npos);
  EXPECT_NE(table.find("Self CPU time total: "), std::string::npos);
  // 10 rows between the rules: 3 rules + header + 10 rows + footer; on a machine with a GPU
  // the footer has a second line, the self CUDA time total.
  const bool cuda_footer = table.find("Self CUDA time total: ") != std::string::npos;
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 15 + cuda_footer) << table;
  EXPECT_THROW(rows.table("bogus"), std::invalid_argument);
  // Sorted descending by the key.
  std::vector<double> order;
  std::istringstream lines(table);
  std::string line;
  int rule = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("---", 0) == 0) {
      ++rule;
      continue;
    }
    if (rule == 2) {
      std::smatch m;
      std::string rest = line.substr(std::min(line.size(), size_t{20}));
      ASSERT_TRUE(std::regex_search(rest, m, std::regex(R"(%\s+([0-9.]+)(us|ms|s)\s)"))) << line;
      double v = std::stod(m[1]);
      if (m[2] == "ms") v *= 1e3;
      if (m[2] == "s") v *= 1e6;
      order.push_back(v);
    }
  }
  ASSERT_EQ(order.size(), 10u);
  for (size_t i = 1; i < order.size(); ++i) EXPECT_GE(order[i - 1] + 0.0011, order[i]) << table;

  const profiler::EventList by_shape = p.prof.key_averages(/*group_by_input_shape=*/true);
  int linear_rows = 0;
  for (const auto& r : by_shape.rows()) linear_rows += r.key == "linear";
  EXPECT_EQ(linear_rows, 2);  // fc1 and fc2 shapes
  EXPECT_NE(by_shape.table("count").find("Input Shapes"), std::string::npos);
  EXPECT_NE(by_shape.table("count").find("[[4, 64], [16, 64], [16]]"), std::string::npos);

  const profiler::EventList mods = p.prof.key_averages_by_module();
  EXPECT_EQ(mods.at("net.conv1").count, 3);
  EXPECT_EQ(mods.at("net").count, 3);
  EXPECT_GE(mods.at("net").cpu_time_total, mods.at("net.fc1").cpu_time_total);
  EXPECT_NEAR(mods.at("net").self_cpu_time_total + mods.at("net.conv1").cpu_time_total +
                  mods.at("net.fc1").cpu_time_total + mods.at("net.fc2").cpu_time_total,
              mods.at("net").cpu_time_total, 1e-3);
  EXPECT_GT(mods.at("net.conv1").self_cpu_memory_usage, 0);
}

// The optimizers' fused kernels enter the dispatch point as named ops (PyTorch's names), so
// the operator table and the trace show them: one row each for one call each.
TEST(Profiler, OptimizerKernelsAreNamedOps) {
  testing::TinyCnn net;
  net.train_step();  // leaves every parameter with a gradient
  std::vector<Tensor> ps;
  for (Tensor* p : net.params()) ps.push_back(*p);
  optim::AdamW adamw(ps);
  optim::SGD sgd(ps, optim::SGDOptions{.lr = 0.01, .momentum = 0.9});
  optim::GradScaler scaler;
  Profiler prof(full_options());
  prof.start();
  optim::clip_grad_norm_(ps, 1.0);
  scaler.unscale_(adamw);
  adamw.step();
  sgd.step();
  prof.stop();
  const profiler::EventList rows = prof.key_averages();
  for (const char* name :
       {"_foreach_norm", "_foreach_mul_", "_amp_foreach_non_finite_check_and_unscale_",
        "_fused_adamw_", "_fused_sgd_"})
    EXPECT_EQ(rows.at(name).count, 1) << name;
  EXPECT_THROW(rows.at("_fused_adam_"), std::out_of_range) << "AdamW is named as AdamW";
}

TEST(Profiler, ScheduleRecordsOnlyActiveSteps) {
  testing::TinyCnn net;
  ProfilerOptions o = full_options();
  o.schedule = profiler::schedule(/*wait=*/1, /*warmup=*/1, /*active=*/2, /*repeat=*/1,
                                  /*skip_first=*/1);
  std::vector<int> ready_at;
  std::vector<std::vector<int>> steps;
  std::vector<long> convs;
  std::vector<size_t> memory_events;
  o.on_trace_ready = [&](Profiler& p) {
    ready_at.push_back(p.step_num());
    steps.push_back(p.data().steps);
    const auto& s = p.data().spans;
    convs.push_back(std::count_if(s.begin(), s.end(), [](const auto& e) {
      return e.kind == profiler::SpanKind::op && e.name == "conv2d";
    }));
    memory_events.push_back(p.data().memory.size());
  };
  Profiler prof(o);
  {
    profiler::ProfilerGuard guard(prof);
    for (int i = 0; i < 8; ++i) {
      net.train_step();
      prof.step();
    }
  }
  EXPECT_FALSE(prof.running());
  ASSERT_EQ(ready_at.size(), 1u);
  EXPECT_EQ(ready_at[0], 5);  // as PyTorch 2.11 (docs/memory-formats.md §5.4)
  EXPECT_EQ(steps[0], (std::vector<int>{3, 4}));
  EXPECT_EQ(convs[0], 2);

  // repeat = 0: a trace per cycle until stop; stop() in an active step saves too.
  ready_at.clear();
  steps.clear();
  o.schedule = profiler::schedule(0, 0, 2);
  Profiler cyc(o);
  cyc.start();
  for (int i = 0; i < 5; ++i) {
    net.train_step();
    cyc.step();
  }
  cyc.stop();
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(steps[1], (std::vector<int>{2, 3}));
  EXPECT_EQ(steps[2], (std::vector<int>{4, 5}));  // step() opened ProfilerStep#5 before stop()
  // Each window holds its own steps' events only: a window's buffers reuse the storage of
  // the one before (emptied), and nothing of it carries over.
  ASSERT_EQ(convs.size(), 4u);  // the first profiler's window, then the three cycles
  EXPECT_EQ(convs[1], 2);
  EXPECT_EQ(convs[2], 2);
  EXPECT_EQ(convs[3], 1);
  EXPECT_GT(memory_events[1], 0u);
  EXPECT_EQ(memory_events[2], memory_events[1]);
  EXPECT_EQ(memory_events[3] * 2, memory_events[1]);
  EXPECT_THROW(profiler::schedule(1, 1, 0), std::invalid_argument);
}

// Reads back the integers of a memory timeline .json: [[t...], [[13 ints]...]].
std::pair<std::vector<int64_t>, std::vector<std::vector<int64_t>>> read_timeline(
    const std::string& text) {
  std::vector<int64_t> times;
  std::vector<std::vector<int64_t>> rows;
  size_t i = text.find('[', 1);  // start of times
  const size_t times_end = text.find(']', i);
  std::istringstream ts(text.substr(i + 1, times_end - i - 1));
  std::string tok;
  while (std::getline(ts, tok, ',')) times.push_back(std::stoll(tok));
  i = text.find('[', times_end);  // sizes list
  while ((i = text.find('[', i + 1)) != std::string::npos) {
    const size_t e = text.find(']', i);
    std::istringstream rs(text.substr(i + 1, e - i - 1));
    std::vector<int64_t> row;
    while (std::getline(rs, tok, ',')) row.push_back(std::stoll(tok));
    rows.push_back(row);
    i = e;
  }
  return {times, rows};
}

TEST(Profiler, MemoryTimelineJsonRoundTripsAndSumsToAllocated) {
  Profiled p(2);
  const profiler::ProfileData& d = p.prof.data();
  const profiler::MemoryTimeline t = profiler::build_memory_timeline(d, memory::Device::cpu());
  ASSERT_GT(t.times_us.size(), 10u);
  for (size_t i = 0; i < t.sizes.size(); ++i) {
    EXPECT_EQ(t.sizes[i][0], 0);
    EXPECT_EQ(t.sizes[i][7], 0);  // autograd_detail
    EXPECT_EQ(t.sizes[i][8], 0) << "unknown bytes at row " << i;
    const int64_t sum = std::accumulate(t.sizes[i].begin(), t.sizes[i].end(), int64_t{0});
    EXPECT_EQ(sum, static_cast<int64_t>(t.allocated[i])) << "row " << i;
    if (i) {
      EXPECT_GE(t.times_us[i], t.times_us[i - 1]);
    }
  }
  EXPECT_EQ(t.allocated.back(), p.allocated_after);
  EXPECT_GT(t.sizes.back()[1], 0);  // parameters
  const int64_t params = t.sizes.back()[1];
  int64_t expect_params = 0;
  for (Tensor* q : p.net.params())
    expect_params += static_cast<int64_t>(
        memory::get_allocator(memory::Device::cpu()).block_size(q->storage().data()));
  EXPECT_EQ(params, expect_params);
  EXPECT_EQ(t.phases.size(), 6u);  // forward, backward, optimizer per step

  const fs::path json = temp_dir() / "timeline.json";
  p.prof.export_memory_timeline(json.string());
  const auto [times, rows] = read_timeline(read_file(json));
  ASSERT_EQ(times, t.times_us);
  ASSERT_EQ(rows.size(), t.sizes.size());
  for (size_t i = 0; i < rows.size(); ++i)
    EXPECT_TRUE(std::equal(rows[i].begin(), rows[i].end(), t.sizes[i].begin()) &&
                rows[i].size() == profiler::kTimelineColumns)
        << i;
  const std::string py = fmt::format(
      "{} -c \"import json,sys; t,s=json.load(open(sys.argv[1])); "
      "assert len(t)==len(s) and all(len(r)==13 and r[0]==0 for r in s)\" {}",
      TALLY_PYTHON, json.string());
  EXPECT_EQ(std::system(py.c_str()), 0);
}

TEST(Profiler, MemoryTimelineHtmlIsSelfContained) {
  Profiled p(2);
  const fs::path html = temp_dir() / "timeline.html";
  p.prof.export_memory_timeline(html.string());
  const std::string text = read_file(html);
  size_t svgs = 0;
  for (size_t i = text.find("<svg"); i != std::string::npos; i = text.find("<svg", i + 1)) ++svgs;
  EXPECT_EQ(svgs, 1u);
  EXPECT_EQ(text.find("http://"), std::string::npos);
  EXPECT_EQ(text.find("https://"), std::string::npos);
  EXPECT_NE(text.find("<script>"), std::string::npos);
  EXPECT_NE(text.find("\"forward\""), std::string::npos);
}

TEST(Profiler, MemoryTimelineHtmlRendersInHeadlessChromium) {
  std::string browser;
  for (const char* c : {"/usr/bin/chromium", "/usr/bin/chromium-browser"})
    if (fs::exists(c)) browser = c;
  if (browser.empty())
    GTEST_SKIP() << "chromium is not installed (apt-get install chromium; see .ci/deps)";
  Profiled p(2);
  const fs::path dir = temp_dir();
  const fs::path html = dir / "render.html";
  p.prof.export_memory_timeline(html.string());
  const fs::path dom = dir / "render.dom.html";
  const std::string cmd = fmt::format(
      "timeout 60 {} --headless --disable-gpu --no-sandbox --user-data-dir={} --dump-dom "
      "file://{} > {} 2>/dev/null",
      browser, (dir / "chromium-profile").string(), html.string(), dom.string());
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::string out = read_file(dom);
  EXPECT_NE(out.find("data-rendered=\"1\""), std::string::npos) << out.substr(0, 2000);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("data-paths=\"([0-9]+)\"")));
  EXPECT_GE(std::stoi(m[1]), 4);  // parameter, input, temporary/activation, gradient
  EXPECT_NE(out.find("class=\"area\""), std::string::npos);
}

TEST(Profiler, MemorySnapshotOfTheWindow) {
  const bool had_history = memory::get_allocator(memory::Device::cpu()).history_enabled();
  Profiled p(1);
  EXPECT_EQ(memory::get_allocator(memory::Device::cpu()).history_enabled(), had_history);
  const profiler::ProfileData& d = p.prof.data();
  ASSERT_FALSE(d.snapshots.empty());
  EXPECT_FALSE(d.snapshots[0].second.device_traces.empty());
  const fs::path pickle = temp_dir() / "window.pickle";
  p.prof.export_memory_snapshot(pickle.string());
  const std::string py = fmt::format(
      "{} -c \"import pickle,sys; s=pickle.load(open(sys.argv[1],'rb')); "
      "assert s['segments'] and any(e['action']=='alloc' for t in s['device_traces'] for e in t)\" "
      "{}",
      TALLY_PYTHON, pickle.string());
  EXPECT_EQ(std::system(py.c_str()), 0);
}

// Three threads run ops (allocating from the CPU allocator) inside a window, each under its
// own range and module, while this thread takes the allocator's reports and empties its
// cache (the workers go on until it has done 3 rounds). Every op lands in its own thread's buffer,
// under its thread's range and module, and the memory events name the threads that allocated.
TEST(Profiler, RecordsOpsOfSeveralThreadsWhileReportsRun) {
  constexpr int kWorkers = 3, kRounds = 3;  // the workers run ops until 3 rounds of reports
  Profiler prof(full_options());
  std::atomic<int> running{kWorkers};
  std::atomic<int> reports{0};
  std::vector<std::thread> workers;
  int ops_run[kWorkers] = {};
  double sums[kWorkers] = {};
  prof.start();
  for (int t = 0; t < kWorkers; ++t) {
    workers.emplace_back([&, t] {
      profiler::record_function range(fmt::format("worker{}", t));
      memory::ModuleScope module(fmt::format("worker{}", t));
      for (; ops_run[t] < 20 || reports.load() < kRounds; ++ops_run[t]) {
        const Tensor a = ops::full({256 + 64 * t}, 1.0 + t);
        sums[t] += ops::to_vector(ops::add(a, a))[0];
      }
      --running;
    });
  }
  while (running.load() > 0) {
    const memory::Device cpu = memory::Device::cpu();
    EXPECT_NE(memory::memory_summary(cpu).find("Allocated memory"), std::string::npos);
    for (const memory::SegmentInfo& seg : memory::get_allocator(cpu).snapshot().segments) {
      size_t tiled = 0;
      for (const memory::BlockInfo& b : seg.blocks) tiled += b.size;
      EXPECT_EQ(tiled, seg.total_size);
    }
    EXPECT_FALSE(memory::memory_stats(cpu).empty());
    memory::empty_cache(cpu);
    ++reports;
  }
  for (auto& w : workers) w.join();
  prof.stop();
  EXPECT_GE(reports.load(), kRounds);
  for (int t = 0; t < kWorkers; ++t) EXPECT_EQ(sums[t], ops_run[t] * 2.0 * (1.0 + t));

  const profiler::ProfileData& d = prof.data();
  std::map<std::string, uint64_t> tid_of;  // worker range -> its thread
  for (const auto& s : d.spans)
    if (s.kind == profiler::SpanKind::user && s.name.rfind("worker", 0) == 0) {
      EXPECT_EQ(tid_of.count(s.name), 0u) << s.name << " recorded twice";
      tid_of[s.name] = s.tid;
    }
  ASSERT_EQ(tid_of.size(), static_cast<size_t>(kWorkers));
  std::set<uint64_t> tids;
  for (const auto& [name, tid] : tid_of) tids.insert(tid);
  EXPECT_EQ(tids.size(), static_cast<size_t>(kWorkers)) << "one OS thread per worker";
  std::map<std::string, int> adds;  // module -> add ops
  for (const auto& s : d.spans) {
    if (s.kind != profiler::SpanKind::op || s.name != "add") continue;
    ASSERT_EQ(tid_of.count(s.module), 1u) << "add outside a worker: '" << s.module << "'";
    EXPECT_EQ(s.tid, tid_of[s.module]) << s.module;
    ++adds[s.module];
  }
  for (int t = 0; t < kWorkers; ++t)
    EXPECT_EQ(adds[fmt::format("worker{}", t)], ops_run[t]) << "worker" << t;
  std::set<uint64_t> allocating;
  for (const auto& m : d.memory)
    if (m.bytes > 0 && !m.retag) allocating.insert(m.tid);
  for (uint64_t tid : tids) EXPECT_EQ(allocating.count(tid), 1u) << "no allocation on " << tid;
}

// Threads that already run ops (a data loader's workers) when the window opens, and still do
// when it closes: start() and stop() race with their allocations and dispatches. What the
// window holds is well formed, and each worker's ops in it are some of the ops it ran.
TEST(Profiler, ThreadsRunningAcrossStartAndStop) {
  constexpr int kWorkers = 2;
  std::atomic<bool> done{false};
  std::atomic<int> ops_run[kWorkers] = {};
  std::vector<std::thread> workers;
  for (int t = 0; t < kWorkers; ++t) {
    workers.emplace_back([&, t] {
      memory::ModuleScope module(fmt::format("loader{}", t));
      while (!done.load()) {
        const Tensor a = ops::full({128}, 1.0);
        EXPECT_EQ(ops::to_vector(ops::add(a, a))[0], 2.0);
        ++ops_run[t];
      }
    });
  }
  auto wait_for = [&](int more) {  // until every worker has run `more` ops more
    int target[kWorkers];
    for (int t = 0; t < kWorkers; ++t) target[t] = ops_run[t].load() + more;
    for (int t = 0; t < kWorkers; ++t)
      while (ops_run[t].load() < target[t]) std::this_thread::yield();
  };
  Profiler prof(full_options());
  for (int window = 0; window < 3; ++window) {
    wait_for(5);
    prof.start();
    wait_for(10);
    prof.stop();
    const profiler::ProfileData& d = prof.data();
    std::map<std::string, int> adds;
    for (const auto& s : d.spans) {
      EXPECT_LE(s.start_ns, s.end_ns) << s.name;
      if (s.kind == profiler::SpanKind::op && s.name == "add") ++adds[s.module];
    }
    for (int t = 0; t < kWorkers; ++t) {
      const int n = adds[fmt::format("loader{}", t)];
      EXPECT_GE(n, 9) << "loader" << t;  // the first may have begun before the window
      EXPECT_LE(n, ops_run[t].load()) << "loader" << t;
    }
  }
  done = true;
  for (auto& w : workers) w.join();
}

TEST(Profiler, TableFormatsLikePyTorch) {
  EXPECT_EQ(profiler::format_time_us(12.3456), "12.346us");
  EXPECT_EQ(profiler::format_time_us(1234.0), "1.234ms");
  EXPECT_EQ(profiler::format_time_us(2.5e6), "2.500s");
  EXPECT_EQ(profiler::format_memory(512), "512 B");
  EXPECT_EQ(profiler::format_memory(-2048), "-2.00 KB");
  EXPECT_EQ(profiler::format_memory(3 * 1024 * 1024), "3.00 MB");
}

}  // namespace
}  // namespace tally
