// memory_patterns: the three memory bottleneck patterns of the profiler worked example
// (docs/patterns.md), each reproduced on a small model and diagnosed from the profiler's
// and the allocator's outputs:
//   staircase     - a deep GPT without checkpointing: the forward's activation staircase in
//                   the memory timeline, the modules that hold it (key_averages_by_module),
//                   then the same step with --checkpoint blocks (both peaks printed).
//   leak          - a loss history that keeps graph-holding tensors (history.push_back(loss)):
//                   memory_allocated grows every step by `activation` bytes, and the leak
//                   detector (inspect::LeakDetector) names the model call's line; the fix
//                   (loss.item()) keeps it flat.
//   fragmentation - an MLP fed random sequence lengths: reserved grows past allocated; the
//                   same run with max_split_size_mb and with padded (bucketed) lengths.
// Every pattern prints a diagnosis and writes its trace / timeline / snapshot files to
// --out; DIR/patterns.json holds the measured numbers (tests/examples/test_memory_patterns.py).
//
//   memory_patterns --pattern all --device cpu --out patterns_out
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <sstream>
#include <vector>

#include "base/atomic_file.h"
#include "base/json.h"
#include "examples/cli_common.h"
#include "examples/train_common.h"
#include "inspect/leak_detector.h"
#include "memory/alloc_config.h"
#include "memory/summary.h"
#include "nn/checkpoint.h"
#include "nn/models/gpt.h"
#include "optim/adam.h"
#include "profiler/profiler.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Args {
  std::string pattern = "all";
  std::string device = "cpu";
  std::string out = "memory_patterns_out";
  int64_t layers = 12;  // staircase: GPT blocks
  int64_t batch = 8;
  int64_t seq = 128;
  int64_t leak_steps = 6;
  int64_t frag_steps = 12;
  int64_t max_split_mb = 20;
  uint64_t seed = 0;
};

// A GPT small enough for a CPU: byte vocabulary, 64-dim embeddings, `layers` blocks.
nn::GPTConfig small_gpt(int64_t layers, int64_t block) {
  nn::GPTConfig c = nn::GPTConfig::preset("tiny");
  c.n_layer = layers;
  c.n_head = 4;
  c.n_embd = 64;
  c.block_size = block;
  return c;
}

int64_t cat_now(const memory::DeviceStats& st, memory::Category c) {
  return st.category_bytes[static_cast<size_t>(c)].current;
}
int64_t cat_peak(const memory::DeviceStats& st, memory::Category c) {
  return st.category_at_peak[static_cast<size_t>(c)];
}

std::string json_list(const std::vector<int64_t>& v) {
  return fmt::format("[{}]", fmt::join(v, ", "));
}

// ---------------------------------------------------------------- staircase
struct StairResult {
  int64_t peak_allocated = 0, peak_activation = 0, forward_rises = 0, forward_activation = 0;
};

StairResult staircase_run(const Args& a, Device dev, bool checkpoint, const std::string& stem,
                          std::string& module_table) {
  memory::empty_cache(dev);
  manual_seed(a.seed);
  auto gpt = std::make_shared<nn::GPT>(small_gpt(a.layers, a.seq));
  gpt->to(dev);
  gpt->train();
  nn::enable_checkpointing(*gpt, nn::parse_checkpoint_spec(checkpoint ? "blocks" : "none"));
  optim::AdamW opt(gpt->parameters(), optim::AdamOptions{.lr = 1e-3});
  Tensor idx, tgt;
  {
    memory::CategoryScope input(memory::Category::input);
    idx = randint(0, 256, {a.batch, a.seq}).to(dev);
    tgt = randint(0, 256, {a.batch, a.seq}).to(dev);
  }
  auto step = [&] {
    opt.zero_grad(true);
    Tensor loss;
    {
      profiler::record_function r("## Forward Pass ##");
      memory::PhaseScope phase("forward");
      loss = (*gpt)(idx, tgt).second;
    }
    {
      profiler::record_function r("## Backward Pass ##");
      memory::PhaseScope phase("backward");
      loss.backward();
    }
    profiler::record_function r("## Optimizer ##");
    memory::PhaseScope phase("optimizer");
    opt.step();
  };
  step();  // warm-up: optimizer state exists, the cache is filled
  memory::synchronize(dev);
  memory::reset_peak_memory_stats(dev);

  profiler::ProfilerOptions po;
  po.profile_memory = po.record_shapes = po.with_stack = true;
  profiler::Profiler prof(po);
  {
    profiler::ProfilerGuard guard(prof);
    step();
    memory::synchronize(dev);
  }
  prof.export_chrome_trace(stem + ".trace.json");
  prof.export_memory_timeline(stem + ".timeline.json", dev);
  prof.export_memory_timeline(stem + ".timeline.html", dev);
  prof.export_memory_snapshot(stem + ".pickle", dev);
  const char* mem_col =
      dev.type == DeviceType::cuda ? "self_cuda_memory_usage" : "self_cpu_memory_usage";
  module_table = prof.key_averages_by_module().table(mem_col, 8);

  const memory::DeviceStats st = memory::get_allocator(dev).stats();
  StairResult r;
  r.peak_allocated = st.allocated_bytes[0].peak;
  r.peak_activation = cat_peak(st, memory::Category::activation);
  // The staircase: how many times the live activation bytes rose during the forward,
  // and by how much in all (from the profiler's allocator events).
  const profiler::ProfileData& d = prof.data();
  int64_t fwd_start = 0, fwd_end = -1;
  for (const auto& sp : d.spans)
    if (sp.kind == profiler::SpanKind::phase && sp.name == "forward") {
      fwd_start = sp.start_ns;
      fwd_end = sp.end_ns;
      break;
    }
  int64_t act = 0;
  for (const auto& e : d.memory) {
    // a free carries the tag of its allocation: select the forward by time, not by tag
    if (!(e.device == dev) || e.time_ns < fwd_start || e.time_ns > fwd_end) continue;
    const bool to_act = e.category == memory::Category::activation;
    const bool from_act = e.retag && e.old_category == memory::Category::activation;
    if (!to_act && !from_act) continue;
    int64_t delta = e.retag ? (to_act ? e.bytes : -e.bytes) : e.bytes;
    if (e.retag && to_act && from_act) delta = 0;
    if (delta > 0) ++r.forward_rises;
    act += delta;
  }
  r.forward_activation = act;
  return r;
}

std::string staircase(const Args& a, Device dev) {
  fmt::print("==== staircase: GPT with {} blocks, batch {} x {} tokens, {} ====\n", a.layers,
             a.batch, a.seq, dev.str());
  std::string table_none, table_ckpt;
  const StairResult none = staircase_run(a, dev, false, a.out + "/staircase", table_none);
  fmt::print("-- modules by self memory, no checkpointing (what the forward left allocated):\n{}\n",
             table_none);
  const StairResult ckpt = staircase_run(a, dev, true, a.out + "/staircase_ckpt", table_ckpt);
  fmt::print("-- modules by self memory, --checkpoint blocks:\n{}\n", table_ckpt);
  fmt::print("{:<22} {:>14} {:>16} {:>16} {:>14}\n", "", "peak allocated", "activation@peak",
             "forward act +", "forward rises");
  for (auto [name, r] :
       {std::pair{"no checkpointing", none}, std::pair{"--checkpoint blocks", ckpt}})
    fmt::print("{:<22} {:>14} {:>16} {:>16} {:>14}\n", name, ex::fmt_bytes(r.peak_allocated),
               ex::fmt_bytes(r.peak_activation), ex::fmt_bytes(r.forward_activation),
               r.forward_rises);
  fmt::print(
      "diagnosis: the forward keeps every block's activations until the backward: {} of "
      "activations at "
      "the peak ({:.0f}% of the peak), rising in {} steps through the forward. Checkpointing the "
      "blocks "
      "keeps only their inputs: activation at the peak {} -> {} ({:+.0f}%), peak allocated {} -> "
      "{}.\n",
      ex::fmt_bytes(none.peak_activation),
      100.0 * none.peak_activation / std::max<int64_t>(1, none.peak_allocated), none.forward_rises,
      ex::fmt_bytes(none.peak_activation), ex::fmt_bytes(ckpt.peak_activation),
      100.0 * (double(ckpt.peak_activation) - none.peak_activation) /
          std::max<int64_t>(1, none.peak_activation),
      ex::fmt_bytes(none.peak_allocated), ex::fmt_bytes(ckpt.peak_allocated));
  fmt::print(
      "wrote {0}/staircase.{{trace.json,timeline.json,timeline.html,pickle}} and "
      "{0}/staircase_ckpt.* (open the .html in a browser, the .pickle at "
      "pytorch.org/memory_viz)\n\n",
      a.out);
  auto obj = [](const StairResult& r) {
    return fmt::format(
        R"({{"peak_allocated": {}, "peak_activation": {}, "forward_activation": {}, "forward_rises": {}}})",
        r.peak_allocated, r.peak_activation, r.forward_activation, r.forward_rises);
  };
  return fmt::format(R"({{"layers": {}, "no_checkpoint": {}, "checkpoint_blocks": {}}})", a.layers,
                     obj(none), obj(ckpt));
}

// ---------------------------------------------------------------- leak
struct LeakResult {
  std::vector<int64_t> allocated, activation;
  std::vector<inspect::LeakingLine> lines;  // the leak detector's finding, by line
  std::string report;                       // and its report
};

LeakResult leak_run(const Args& a, Device dev, bool leaky) {
  memory::empty_cache(dev);
  manual_seed(a.seed);
  LeakResult r;
  auto gpt = std::make_shared<nn::GPT>(small_gpt(4, 64));
  gpt->to(dev);
  gpt->train();
  optim::AdamW opt(gpt->parameters(), optim::AdamOptions{.lr = 1e-3});
  std::vector<Tensor> history;          // the bug: keeps every loss and, through it, its graph
  std::vector<double> history_fixed;    // the fix: plain numbers
  inspect::LeakDetector detector(dev);  // told each step's end: names the line that leaks
  const std::string stem = a.out + "/leak";
  std::unique_ptr<profiler::Profiler> prof;
  if (leaky) {
    memory::record_memory_history(true, 1000000, dev);
    profiler::ProfilerOptions po;
    po.profile_memory = true;
    prof = std::make_unique<profiler::Profiler>(po);
    prof->start();
  }
  for (int64_t s = 0; s < a.leak_steps; ++s) {
    Tensor idx, tgt;
    {
      memory::CategoryScope input(memory::Category::input);
      idx = randint(0, 256, {a.batch, 64}).to(dev);
      tgt = randint(0, 256, {a.batch, 64}).to(dev);
    }
    opt.zero_grad(true);
    Tensor loss;
    {
      memory::PhaseScope phase("forward");
      loss = (*gpt)(idx, tgt).second;
    }
    {
      memory::PhaseScope phase("backward");
      // retain_graph is what lets the kept losses hold their saved activations (a graph
      // whose backward already ran keeps nothing in Tally or PyTorch otherwise); a loss
      // kept for logging before the backward, or a metric computed from activations,
      // holds a live graph the same way.
      loss.backward(Tensor(), leaky);
    }
    {
      memory::PhaseScope phase("optimizer");
      opt.step();
    }
    if (leaky)
      history.push_back(loss);
    else
      history_fixed.push_back(loss.item());
    loss = Tensor();
    memory::synchronize(dev);
    detector.step();
    const memory::DeviceStats st = memory::get_allocator(dev).stats();
    r.allocated.push_back(st.allocated_bytes[0].current);
    r.activation.push_back(cat_now(st, memory::Category::activation));
    if (prof) prof->step();
  }
  r.lines = detector.leaking_lines();
  r.report = detector.report(8);
  if (leaky) {
    prof->stop();
    prof->export_memory_timeline(stem + ".timeline.json", dev);
    prof->export_memory_timeline(stem + ".timeline.html", dev);
    prof->export_chrome_trace(stem + ".trace.json");
    memory::dump_snapshot(stem + ".pickle", dev);
    memory::record_memory_history(false, 0, dev);
  }
  return r;
}

std::string leak(const Args& a, Device dev) {
  fmt::print("==== leak: a loss history that keeps the graphs, {} steps, {} ====\n", a.leak_steps,
             dev.str());
  const LeakResult bad = leak_run(a, dev, true);
  const LeakResult good = leak_run(a, dev, false);
  fmt::print("{:>5} {:>22} {:>22} {:>22} {:>22}\n", "step", "allocated (leaky)",
             "activation (leaky)", "allocated (item())", "activation (item())");
  for (size_t s = 0; s < bad.allocated.size(); ++s)
    fmt::print("{:>5} {:>22} {:>22} {:>22} {:>22}\n", s, ex::fmt_bytes(bad.allocated[s]),
               ex::fmt_bytes(bad.activation[s]), ex::fmt_bytes(good.allocated[s]),
               ex::fmt_bytes(good.activation[s]));
  const size_t n = bad.allocated.size();
  const double per_step =
      n > 1 ? double(bad.allocated[n - 1] - bad.allocated[0]) / double(n - 1) : 0;
  const double act_per_step =
      n > 1 ? double(bad.activation[n - 1] - bad.activation[0]) / double(n - 1) : 0;
  const double fixed_per_step =
      n > 1 ? double(good.allocated[n - 1] - good.allocated[0]) / double(n - 1) : 0;
  fmt::print(
      "diagnosis: with history.push_back(loss) the baseline rises {} per step, {} of it "
      "`activation` bytes "
      "(the kept graphs' saved tensors); with history.push_back(loss.item()) it moves {} per "
      "step.\n",
      ex::fmt_bytes(per_step), ex::fmt_bytes(act_per_step), ex::fmt_bytes(fixed_per_step));
  // The leak detector (inspect/leak_detector.h) on both runs: the leaky one's line is the
  // model call whose graphs the history keeps.
  fmt::print("leak detector, history.push_back(loss):\n{}", bad.report);
  fmt::print("leak detector, history.push_back(loss.item()):\n{}", good.report);
  if (!bad.lines.empty())
    fmt::print("diagnosis: the leaking line is {}\n", bad.lines.front().location);
  fmt::print(
      "wrote {0}/leak.pickle (memory_viz: the staircase of blocks that are never freed), "
      "{0}/leak.timeline.{{json,html}}, {0}/leak.trace.json\n\n",
      a.out);
  auto lines_json = [](const std::vector<inspect::LeakingLine>& lines) {
    std::string s;
    for (const inspect::LeakingLine& l : lines)
      s += fmt::format(R"({}{{"location": {}, "bytes_per_step": {:.1f}, "sites": {}}})",
                       s.empty() ? "" : ", ", base::json_quote(l.location), l.bytes_per_step,
                       l.sites);
    return "[" + s + "]";
  };
  return fmt::format(
      R"({{"leaky": {{"allocated": {}, "activation": {}, "leaking_lines": {}}}, "fixed": {{"allocated": {}, "activation": {}, "leaking_lines": {}}}}})",
      json_list(bad.allocated), json_list(bad.activation), lines_json(bad.lines),
      json_list(good.allocated), json_list(good.activation), lines_json(good.lines));
}

// ---------------------------------------------------------------- fragmentation
struct FragResult {
  std::vector<int64_t> allocated_peak,
      reserved;                  // per step: peak allocated in the step, reserved after it
  std::vector<int64_t> lengths;  // each step's T
  int64_t peak_allocated = 0, peak_reserved = 0;
  std::string summary_line;
};

FragResult frag_run(const Args& a, Device dev, const std::string& conf, bool pad,
                    const std::string& stem) {
  auto& alloc = memory::get_allocator(dev);
  memory::empty_cache(dev);
  alloc.set_config(memory::AllocatorConfig::parse(conf));
  memory::reset_peak_memory_stats(dev);
  manual_seed(a.seed);
  const int64_t d_in = 64, d_hidden = 256;
  auto param = [&](Shape s, double scale) {
    memory::CategoryScope cat(memory::Category::parameter);
    Tensor t = mul(randn(s), scale).to(dev).detach();
    t.requires_grad_(true);
    return t;
  };
  Tensor w1 = param({d_hidden, d_in}, 0.1), b1 = param({d_hidden}, 0.0);
  Tensor w2 = param({d_hidden, d_hidden}, 0.05), b2 = param({d_hidden}, 0.0);
  Tensor w3 = param({d_in, d_hidden}, 0.05), b3 = param({d_in}, 0.0);
  std::vector<Tensor*> params = {&w1, &b1, &w2, &b2, &w3, &b3};
  std::mt19937_64 rng(a.seed + 1);  // the same lengths for every variant
  std::uniform_int_distribution<int64_t> len(64, 2048);
  FragResult r;
  memory::record_memory_history(true, 1000000, dev);
  for (int64_t s = 0; s < a.frag_steps; ++s) {
    int64_t t = len(rng);
    if (pad) t = 2048;  // pad every batch to the longest length: one size, no fragments
    r.lengths.push_back(t);
    const int64_t rows = a.batch * t;
    memory::reset_peak_memory_stats(dev);
    Tensor x;
    {
      memory::CategoryScope input(memory::Category::input);
      x = randn({rows, d_in}).to(dev);
    }
    for (Tensor* p : params) p->set_grad(Tensor());
    Tensor loss;
    {
      memory::PhaseScope phase("forward");
      Tensor h = gelu(linear(x, w1, b1));
      h = gelu(linear(h, w2, b2));
      loss = mean(square(sub(linear(h, w3, b3), x)));
    }
    {
      memory::PhaseScope phase("backward");
      loss.backward();
    }
    {
      memory::PhaseScope phase("optimizer");
      NoGradGuard ng;
      for (Tensor* p : params) ops::add_(*p, p->grad(), -0.01);
    }
    loss = Tensor();
    x = Tensor();
    memory::synchronize(dev);
    const memory::DeviceStats st = alloc.stats();
    r.allocated_peak.push_back(st.allocated_bytes[0].peak);
    r.reserved.push_back(st.reserved_bytes[0].current);
  }
  r.peak_allocated = *std::max_element(r.allocated_peak.begin(), r.allocated_peak.end());
  r.peak_reserved = *std::max_element(r.reserved.begin(), r.reserved.end());
  memory::dump_snapshot(stem + ".pickle", dev);
  memory::record_memory_history(false, 0, dev);
  const std::string summary = memory::memory_summary(dev, true);
  if (!pad && conf.empty())
    fmt::print("-- memory_summary(abbreviated) after the last step:\n{}\n", summary);
  std::istringstream lines(summary);
  for (std::string line; std::getline(lines, line);)
    if (line.find("ragment") != std::string::npos) r.summary_line = line;
  for (Tensor* p : params) *p = Tensor();
  memory::empty_cache(dev);
  alloc.set_config(memory::AllocatorConfig::from_env());
  return r;
}

std::string fragmentation(const Args& a, Device dev) {
  fmt::print("==== fragmentation: an MLP on {} x random(64..2048) rows, {} steps, {} ====\n",
             a.batch, a.frag_steps, dev.str());
  const std::string split_conf = fmt::format("max_split_size_mb:{}", a.max_split_mb);
  struct Variant {
    std::string name, conf;
    bool pad;
    FragResult r;
  };
  // The fourth: one growing segment per stream (PyTorch's expandable_segments), so freed
  // ranges of any size are reused and reserved follows the largest step. The fifth: the
  // same, and a request that only scattered free pages could hold takes them back before
  // the segment grows (Tally's reclaim_on_growth).
  std::vector<Variant> vs = {
      {"default", "", false, {}},
      {split_conf, split_conf, false, {}},
      {"padded to 2048", "", true, {}},
      {"expandable_segments:True", "expandable_segments:True", false, {}},
      {"+ reclaim_on_growth:True", "expandable_segments:True,reclaim_on_growth:True", false, {}}};
  for (size_t i = 0; i < vs.size(); ++i) {
    fmt::print("-- variant: {}\n", vs[i].name);
    vs[i].r =
        frag_run(a, dev, vs[i].conf, vs[i].pad, a.out + "/fragmentation_" + std::to_string(i));
  }
  fmt::print("{:>5}", "step");
  for (const auto& v : vs) fmt::print(" {:>34}", v.name + " peak alloc / reserved");
  fmt::print("\n");
  for (size_t s = 0; s < vs[0].r.reserved.size(); ++s) {
    fmt::print("{:>5}", s);
    for (const auto& v : vs)
      fmt::print(" {:>34}",
                 ex::fmt_bytes(v.r.allocated_peak[s]) + " / " + ex::fmt_bytes(v.r.reserved[s]));
    fmt::print("\n");
  }
  for (const auto& v : vs)
    fmt::print(
        "{:<22} peak allocated {:>10}, peak reserved {:>10}, reserved - peak allocated {:>10} "
        "({:.0f}% "
        "of reserved unused at the peak){}\n",
        v.name, ex::fmt_bytes(v.r.peak_allocated), ex::fmt_bytes(v.r.peak_reserved),
        ex::fmt_bytes(v.r.peak_reserved - v.r.peak_allocated),
        100.0 * (v.r.peak_reserved - v.r.peak_allocated) / std::max<int64_t>(1, v.r.peak_reserved),
        v.r.summary_line.empty() ? "" : "\n    summary: " + v.r.summary_line);
  const FragResult &d = vs[0].r, &m = vs[1].r, &p = vs[2].r, &e = vs[3].r, &g = vs[4].r;
  const size_t last = d.reserved.size() - 1;
  fmt::print(
      "diagnosis: with random lengths the allocator keeps segments cut for earlier shapes: "
      "reserved "
      "ratchets up to {} ({:.1f}x the largest step's {}) and stays there (after the last step, "
      "whose peak was "
      "{}, reserved is still {}). Padding every batch to one length allocates more ({} at the "
      "peak) but "
      "leaves a smaller gap ({} vs {}). {} does not help here: blocks of >= {} MiB are never "
      "split, so each "
      "new large size takes a segment of its own (reserved {}); it pays off only under a memory "
      "cap, where "
      "those whole blocks are freed and retried instead of an OOM. expandable_segments:True "
      "grows one segment and reuses any free range of it: reserved {} for a peak of {} "
      "({:.3f}x); with reclaim_on_growth:True the free pages scattered between live blocks are "
      "unmapped before it grows (a device synchronisation each time): reserved {} for {} "
      "({:.3f}x).\n",
      ex::fmt_bytes(d.peak_reserved), double(d.peak_reserved) / double(d.peak_allocated),
      ex::fmt_bytes(d.peak_allocated), ex::fmt_bytes(d.allocated_peak[last]),
      ex::fmt_bytes(d.reserved[last]), ex::fmt_bytes(p.peak_allocated),
      ex::fmt_bytes(p.peak_reserved - p.peak_allocated),
      ex::fmt_bytes(d.peak_reserved - d.peak_allocated), vs[1].name, a.max_split_mb,
      ex::fmt_bytes(m.peak_reserved), ex::fmt_bytes(e.peak_reserved),
      ex::fmt_bytes(e.peak_allocated),
      double(e.peak_reserved) / double(std::max<int64_t>(1, e.peak_allocated)),
      ex::fmt_bytes(g.peak_reserved), ex::fmt_bytes(g.peak_allocated),
      double(g.peak_reserved) / double(std::max<int64_t>(1, g.peak_allocated)));
  fmt::print(
      "wrote {0}/fragmentation_{{0,1,2,3,4}}.pickle (memory_viz's Allocator State History shows "
      "the "
      "split segments)\n\n",
      a.out);
  std::string j = "{";
  for (size_t i = 0; i < vs.size(); ++i) {
    const auto& v = vs[i];
    j += fmt::format(
        R"({}{}: {{"conf": {}, "padded": {}, "batch": {}, "lengths": {}, "peak_allocated": {}, "peak_reserved": {}, "step_peak_allocated": {}, "reserved": {}}})",
        i ? ", " : "", base::json_quote(v.name), base::json_quote(v.conf), v.pad ? "true" : "false",
        a.batch, json_list(v.r.lengths), v.r.peak_allocated, v.r.peak_reserved,
        json_list(v.r.allocated_peak), json_list(v.r.reserved));
  }
  return j + "}";
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "The three memory bottleneck patterns (staircase, leak, fragmentation) and their diagnosis."};
  ex::add_checked_option(app, "--pattern", a.pattern, "staircase | leak | fragmentation | all",
                         CLI::IsMember({"staircase", "leak", "fragmentation", "all"}));
  app.add_option("--device", a.device, "cpu | cuda")->capture_default_str();
  app.add_option("--out", a.out, "output folder")->capture_default_str();
  ex::add_checked_option(app, "--layers", a.layers, "staircase: GPT blocks",
                         ex::int_range(1, 1024));
  ex::add_checked_option(app, "--batch", a.batch, "batch size", ex::int_range(1, 1 << 16));
  ex::add_checked_option(app, "--seq", a.seq, "staircase: tokens per sequence",
                         ex::int_range(1, 1 << 16));
  ex::add_checked_option(app, "--leak-steps", a.leak_steps,
                         "leak: steps (the growth per step needs 2)", ex::int_range(2, 10000));
  ex::add_checked_option(app, "--frag-steps", a.frag_steps, "fragmentation: steps",
                         ex::int_range(1, 10000));
  // TALLY_ALLOC_CONF's max_split_size_mb is at least 20 (PyTorch's rule): smaller values
  // would be raised silently, and the diagnosis would name the wrong size.
  ex::add_checked_option(app, "--max-split-mb", a.max_split_mb,
                         "fragmentation: max_split_size_mb of the second run",
                         ex::int_range(20, 1 << 20));
  ex::add_checked_option(app, "--seed", a.seed, "seed", ex::seed_value());

  return ex::run_cli("memory_patterns", app, argc, argv, [&] {
    const Device dev = ex::parse_device(a.device);
    ex::check_output_dir(a.out, "--out");
    std::vector<std::string> parts;
    if (a.pattern == "staircase" || a.pattern == "all")
      parts.push_back("\"staircase\": " + staircase(a, dev));
    if (a.pattern == "leak" || a.pattern == "all") parts.push_back("\"leak\": " + leak(a, dev));
    if (a.pattern == "fragmentation" || a.pattern == "all")
      parts.push_back("\"fragmentation\": " + fragmentation(a, dev));
    base::write_file_atomic(a.out + "/patterns.json",
                            fmt::format("{{\"device\": {}, {}}}\n", base::json_quote(dev.str()),
                                        fmt::join(parts, ", ")),
                            "memory_patterns");
    fmt::print("wrote {}/patterns.json\n", a.out);
    return 0;
  });
}
