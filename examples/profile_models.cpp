// profile_models: what the profiler costs and whether its GPU times add up, on ResNet-50
// (batch 64, 224x224, SGD with momentum), GPT-2 124M (B x 1024 tokens, AdamW) and the
// registry's other models by name (--models llama --preset 1b --batch 8: AdamW). For each
// model: the median step time without the profiler, the median with it (by default the CPU
// and, on a CUDA device, CUDA activities, profile_memory, record_shapes and with_stack;
// --activities and --options pick) and the overhead in %, and per step the sum of the GPU
// kernel times and the GPU busy time (union of kernel intervals) next to the step time
// measured with device synchronisation. With --rounds N the two measurements alternate N
// times (plain, profiled, plain, ...): the figures are the medians of the rounds' medians, and
// the overhead's spread over the rounds is printed beside them. Writes the Chrome trace, the
// memory timeline html (with profile_memory) and the key_averages tables (by op, by module)
// to --out, and the numbers to --out/profile_models.json (bench/profile_torch.py prints them
// next to torch.profiler's).
// Options in full: docs/notes.md §15.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <memory>
#include <ostream>
#include <set>
#include <sstream>

#include "autograd/autocast.h"
#include "base/atomic_file.h"
#include "base/json.h"
#include "examples/cli_common.h"
#include "examples/train_common.h"
#include "memory/meta.h"
#include "nn/models/gpt.h"
#include "nn/models/registry.h"
#include "nn/models/resnet.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "profiler/profiler.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Args {
  std::string device = memory::cuda_available() ? "cuda" : "cpu";
  std::string models = "resnet,gpt";
  std::string out = "profile_models_out";
  bool small = false;
  bool fused_classifier = false;  // GPT's lm_head + cross-entropy fused and chunked
  bool unfused_mlp = false;       // GPT's MLP as three modules (GPTConfig::fused_mlp off)
  bool channels_last = false;     // ResNet's weights and images channels_last
  int steps = 8;                  // timed steps per measurement
  int warmup = 3;                 // untimed steps first
  int64_t resnet_batch = 64;
  int64_t gpt_batch = 8;
  // The registry's other models (--models llama,vit,...: nn/models/registry.h): preset, batch
  // and, for token models, sequence length (0: the preset's context).
  std::string preset;
  int64_t batch = 8;
  int64_t seq = 0;
  std::string amp = "off";                      // off | fp16 | bf16: the forward under autocast
  int rounds = 1;                               // alternating plain / profiled measurements
  std::string activities = "cpu,cuda";          // ProfilerOptions::activities
  std::string options = "memory,shapes,stack";  // profile_memory, record_shapes, with_stack
};

// The comma list `text` of `flag`, each item one of `allowed`; "none" (when allowed_none) is the
// empty list. Throws std::invalid_argument naming the flag and the bad item.
std::set<std::string> parse_set(const std::string& text, const char* flag,
                                const std::vector<std::string>& allowed, bool allowed_none) {
  std::string expected;
  for (size_t i = 0; i < allowed.size(); ++i)
    expected += (i ? (i + 1 == allowed.size() && !allowed_none ? " or " : ", ") : "") + allowed[i];
  if (allowed_none) expected += " or none";
  if (allowed_none && text == "none") return {};
  std::set<std::string> out;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) {
    if (std::find(allowed.begin(), allowed.end(), item) == allowed.end())
      throw std::invalid_argument(
          fmt::format("{}: expected a comma list of {}, got '{}'", flag, expected, item));
    out.insert(item);
  }
  if (out.empty()) throw std::invalid_argument(fmt::format("{}: empty list", flag));
  return out;
}

// The profiler's options from --activities and --options.
profiler::ProfilerOptions profiler_options(const Args& a) {
  profiler::ProfilerOptions po;
  const std::set<std::string> act = parse_set(a.activities, "--activities", {"cpu", "cuda"}, false);
  if (!act.contains("cpu"))
    throw std::invalid_argument(fmt::format(
        "--activities: the profiler always records the CPU's ops (cpu or cpu,cuda), got '{}'",
        a.activities));
  po.activities = {profiler::ProfilerActivity::cpu};
  if (act.contains("cuda")) po.activities.insert(profiler::ProfilerActivity::cuda);
  const std::set<std::string> opt =
      parse_set(a.options, "--options", {"memory", "shapes", "stack"}, true);
  po.profile_memory = opt.contains("memory");
  po.record_shapes = opt.contains("shapes");
  po.with_stack = opt.contains("stack");
  return po;
}

struct Result {
  std::string model, desc, trace, timeline;
  double median_ms = 0, median_ms_profiled = 0, overhead_pct = 0;
  double overhead_min_pct = 0, overhead_max_pct = 0;  // over the rounds
  int rounds = 0;
  double kernel_ms_per_step = 0, gpu_busy_ms_per_step = 0, step_ms_in_window = 0;
  size_t kernels = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Sum and union of the kernel intervals of the recorded window.
void gpu_times(const profiler::ProfileData& d, double& sum_ms, double& busy_ms, size_t& n) {
  std::vector<std::pair<int64_t, int64_t>> iv;
  sum_ms = busy_ms = 0;
  for (const auto& g : d.gpu) {
    if (g.kind != profiler::GpuKind::kernel && g.kind != profiler::GpuKind::memcpy &&
        g.kind != profiler::GpuKind::memset)
      continue;
    if (g.kind == profiler::GpuKind::kernel) {
      sum_ms += g.duration_ns() / 1e6;
      ++n;
    }
    iv.emplace_back(g.start_ns, g.end_ns);
  }
  std::sort(iv.begin(), iv.end());
  int64_t cur_s = 0, cur_e = -1;
  for (auto [s, e] : iv) {
    if (s > cur_e) {
      if (cur_e > cur_s) busy_ms += (cur_e - cur_s) / 1e6;
      cur_s = s;
      cur_e = e;
    } else {
      cur_e = std::max(cur_e, e);
    }
  }
  if (cur_e > cur_s) busy_ms += (cur_e - cur_s) / 1e6;
}

Result profile_model(const Args& a, const std::string& which, Device dev) {
  Result r;
  r.model = which;
  manual_seed(0);
  std::shared_ptr<nn::Module> model;
  std::shared_ptr<nn::GPT> gpt;
  const nn::ModelEntry* entry = nullptr;
  std::unique_ptr<optim::Optimizer> opt;
  Tensor x, y;
  if (which == "resnet") {
    nn::ResNetOptions o;
    const int64_t b = a.small ? 8 : a.resnet_batch, s = a.small ? 32 : 224;
    o.num_classes = a.small ? 10 : 1000;
    model = a.small ? std::shared_ptr<nn::Module>(nn::resnet_tiny(o)) : nn::resnet50(o);
    r.desc = a.small ? fmt::format("resnet_tiny batch {} {}x{}", b, s, s)
                     : fmt::format("ResNet-50 batch {} {}x{}", b, s, s);
    memory::CategoryScope in(memory::Category::input);
    x = randn({b, 3, s, s}).to(dev);
    y = randint(0, o.num_classes, {b}).to(dev);
    if (a.channels_last) x = x.contiguous(MemoryFormat::channels_last);
  } else if (which == "gpt") {
    nn::GPTConfig c = nn::GPTConfig::preset(a.small ? "tiny" : "gpt2");
    c.fused_classifier = a.fused_classifier;
    c.fused_mlp = !a.unfused_mlp;
    const int64_t b = a.small ? 4 : a.gpt_batch, t = c.block_size;
    gpt = std::make_shared<nn::GPT>(c);
    model = gpt;
    r.desc = fmt::format("GPT {} B={} T={}{}{}", a.small ? "tiny" : "gpt2 (124M)", b, t,
                         a.fused_classifier ? ", fused classifier" : "",
                         a.unfused_mlp ? ", unfused MLP" : "");
    memory::CategoryScope in(memory::Category::input);
    x = randint(0, c.vocab_size, {b, t}).to(dev);
    y = randint(0, c.vocab_size, {b, t}).to(dev);
  } else {
    // A registry model (main checked the name): its preset, a synthetic batch, its loss.
    entry = &nn::model_entry(which);
    nn::ModelOptions o;
    o.preset = a.preset;
    o.seq = a.seq;
    o = nn::resolve_options(*entry, o);
    model = entry->build(o);
    const data::Example batch = entry->synthetic_batch(o, a.batch, 0, 0);
    r.desc = fmt::format("{} {} batch {}", which, o.preset, a.batch);
    memory::CategoryScope in(memory::Category::input);
    x = batch.input.to(dev);
    y = batch.target.to(dev);
  }
  model->to(dev);
  if (a.channels_last && !gpt) model->to(MemoryFormat::channels_last);
  model->train();
  if (gpt || entry)
    opt = std::make_unique<optim::AdamW>(model->parameters(), optim::AdamOptions{.lr = 1e-4});
  else
    opt = std::make_unique<optim::SGD>(model->parameters(),
                                       optim::SGDOptions{.lr = 0.01, .momentum = 0.9});

  auto step = [&] {
    opt->zero_grad(true);
    Tensor loss;
    {
      profiler::record_function rf("## Forward Pass ##");
      memory::PhaseScope phase("forward");
      const std::optional<DType> amp = ex::parse_amp(a.amp);
      AutocastGuard autocast(dev.type, amp.value_or(DType::float16), amp.has_value());
      loss = gpt     ? (*gpt)(x, y).second
             : entry ? entry->loss(*model, {x, y})
                     : cross_entropy((*model)(x), y);
    }
    {
      profiler::record_function rf("## Backward Pass ##");
      memory::PhaseScope phase("backward");
      loss.backward();
    }
    profiler::record_function rf("## Optimizer ##");
    memory::PhaseScope phase("optimizer");
    opt->step();
  };
  auto timed_step = [&] {
    memory::synchronize(dev);
    ex::Stopwatch sw;
    step();
    memory::synchronize(dev);
    return sw.ms();
  };

  fmt::print("== {} on {} (profiler: activities {}; options {})\n", r.desc, dev.str(), a.activities,
             a.options);
  std::fflush(stdout);
  for (int i = 0; i < a.warmup; ++i) timed_step();

  // Profiled: wait 1, warmup 1, then `steps` recorded steps. The first round's profile is
  // written out and accounted (after its timed steps: the window closes at the last
  // prof.step()).
  const std::string stem = a.out + "/" + which;
  bool saved = false;
  auto write_profile = [&](profiler::Profiler& p) {
    saved = true;
    r.trace = which + ".trace.json";
    p.export_chrome_trace(stem + ".trace.json");
    if (p.data().profile_memory) {  // the timeline is made of the memory events
      r.timeline = which + ".timeline.html";
      p.export_memory_timeline(stem + ".timeline.html", dev);
    }
    const bool cuda = dev.type == DeviceType::cuda;
    base::write_file_atomic(
        stem + ".key_averages.txt",
        [&](std::ostream& t) {
          t << p.key_averages().table(cuda ? "self_cuda_time_total" : "self_cpu_time_total", 30)
            << "\n"
            << p.key_averages(true).table(cuda ? "cuda_time_total" : "cpu_time_total", 20) << "\n"
            << p.key_averages_by_module().table(
                   cuda ? "self_cuda_memory_usage" : "self_cpu_memory_usage", 20)
            << "\n";
        },
        "profile_models");
    fmt::print("{}\n",
               p.key_averages().table(cuda ? "self_cuda_time_total" : "self_cpu_time_total", 12));
    double sum = 0, busy = 0;
    gpu_times(p.data(), sum, busy, r.kernels);
    const double n = static_cast<double>(std::max<size_t>(1, p.data().steps.size()));
    r.kernel_ms_per_step = sum / n;
    r.gpu_busy_ms_per_step = busy / n;
  };
  std::vector<double> plain_medians, profiled_medians, overheads;
  for (int round = 0; round < a.rounds; ++round) {
    std::vector<double> plain;
    for (int i = 0; i < a.steps; ++i) plain.push_back(timed_step());
    profiler::ProfilerOptions po = profiler_options(a);
    po.schedule = profiler::schedule(/*wait=*/1, /*warmup=*/1, /*active=*/a.steps, /*repeat=*/1);
    if (round == 0) po.on_trace_ready = write_profile;
    std::vector<double> profiled;
    {
      profiler::Profiler prof(po);
      profiler::ProfilerGuard guard(prof);
      for (int i = 0; i < a.steps + 2; ++i) {
        const double ms = timed_step();
        if (i >= 2) profiled.push_back(ms);
        prof.step();
      }
    }
    plain_medians.push_back(median(plain));
    profiled_medians.push_back(median(profiled));
    overheads.push_back(100.0 * (profiled_medians.back() - plain_medians.back()) /
                        plain_medians.back());
    if (a.rounds > 1)
      fmt::print("{} round {}: {:.2f} ms, profiled {:.2f} ms: {:+.1f}%\n", r.desc, round + 1,
                 plain_medians.back(), profiled_medians.back(), overheads.back());
  }
  if (!saved) throw std::logic_error("profile_models: the profiler's window never closed");
  r.rounds = a.rounds;
  r.median_ms = median(plain_medians);
  r.median_ms_profiled = median(profiled_medians);
  r.step_ms_in_window = r.median_ms_profiled;
  r.overhead_pct = 100.0 * (r.median_ms_profiled - r.median_ms) / r.median_ms;
  r.overhead_min_pct = *std::min_element(overheads.begin(), overheads.end());
  r.overhead_max_pct = *std::max_element(overheads.begin(), overheads.end());
  fmt::print(
      "{}: median step {:.2f} ms without the profiler, {:.2f} ms with it: overhead {:+.1f}% "
      "({} round{}: {:+.1f}% .. {:+.1f}%)\n",
      r.desc, r.median_ms, r.median_ms_profiled, r.overhead_pct, a.rounds, a.rounds == 1 ? "" : "s",
      r.overhead_min_pct, r.overhead_max_pct);
  if (dev.type == DeviceType::cuda) {
    fmt::print(
        "{}: per step: GPU kernels {:.2f} ms summed ({} kernels in the window), GPU busy {:.2f} "
        "ms, step "
        "time (synchronised, profiled) {:.2f} ms, unprofiled {:.2f} ms: kernels/step time = "
        "{:.1f}% "
        "(|diff| {:.1f}% of the unprofiled step)\n",
        r.desc, r.kernel_ms_per_step, r.kernels, r.gpu_busy_ms_per_step, r.median_ms_profiled,
        r.median_ms, 100.0 * r.kernel_ms_per_step / r.median_ms_profiled,
        100.0 * std::abs(r.kernel_ms_per_step - r.median_ms) / r.median_ms);
  }
  fmt::print("wrote {0}.trace.json, {1}{0}.key_averages.txt\n\n", stem,
             r.timeline.empty() ? "" : stem + ".timeline.html, ");
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "Profiler overhead and GPU time accounting on ResNet-50, GPT-2 and the registry's models."};
  app.add_option("--device", a.device,
                 "cpu | cuda | meta:TARGET (host time only; TARGET: cpu, h100, h200, cuda)")
      ->capture_default_str();
  app.add_option("--models", a.models,
                 "comma list of resnet (ResNet-50), gpt (GPT-2 124M) and the registry's other "
                 "models by name (llama, vit, bert, unet, lstm: --preset, --batch, --seq)")
      ->capture_default_str();
  app.add_option("--preset", a.preset,
                 "the registry models' preset (default: each one's first, the tiny one)");
  ex::add_checked_option(app, "--batch", a.batch, "the registry models' batch",
                         ex::int_range(1, 1 << 16));
  ex::add_checked_option(app, "--seq", a.seq,
                         "the registry's token models' sequence length (0: the preset's context)",
                         ex::int_range(0, 1 << 20));
  app.add_option("--out", a.out, "output folder")->capture_default_str();
  app.add_flag(
      "--small", a.small,
      "tiny models (resnet_tiny, GPT tiny); the default on the CPU unless a batch is given");
  ex::add_checked_option(app, "--steps", a.steps, "timed steps per measurement",
                         ex::int_range(1, 10000));
  ex::add_checked_option(app, "--warmup", a.warmup, "untimed steps first", ex::int_range(0, 10000));
  ex::add_checked_option(app, "--resnet-batch", a.resnet_batch,
                         "ResNet-50 batch (not with --small)", ex::int_range(1, 1 << 16));
  ex::add_checked_option(app, "--gpt-batch", a.gpt_batch,
                         "GPT-2 batch (x 1024 tokens; not with --small)",
                         ex::int_range(1, 1 << 16));
  ex::add_checked_option(app, "--rounds", a.rounds,
                         "alternating plain / profiled measurements (medians over the rounds)",
                         ex::int_range(1, 100));
  app.add_flag("--fused-classifier", a.fused_classifier,
               "GPT: lm_head and cross-entropy fused and chunked (GPTConfig::fused_classifier)");
  app.add_flag(
      "--channels-last", a.channels_last,
      "ResNet: weights and images in channels_last (NHWC) memory (Module::to(MemoryFormat))");
  app.add_flag("--unfused-mlp", a.unfused_mlp,
               "GPT: each MLP as c_fc, gelu and c_proj, not one fused node (GPTConfig::fused_mlp)");
  app.add_option("--amp", a.amp,
                 "off | fp16 | bf16 (forward under autocast; fp16 without a GradScaler)")
      ->capture_default_str();
  app.add_option("--activities", a.activities,
                 "the profiler's activities: cpu (no CUPTI) or cpu,cuda (kernels and CUDA calls; "
                 "the default on a CUDA device)");
  app.add_option("--options", a.options,
                 "what the profiler records besides the op spans: a comma list of memory "
                 "(profile_memory), shapes (record_shapes), stack (with_stack), or none")
      ->capture_default_str();

  return ex::run_cli("profile_models", app, argc, argv, [&] {
    auto meta_device = [&] {
      try {
        return memory::new_meta_device(memory::meta_target(a.device.substr(5)));
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(fmt::format("--device {}: {}", a.device, e.what()));
      }
    };
    const Device dev = a.device.starts_with("meta:") ? meta_device() : ex::parse_device(a.device);
    ex::parse_amp(a.amp);  // a bad --amp fails here, before any model is built
    // CUPTI has nothing to trace off a CUDA device (a meta device's steps launch no kernels).
    if (app.count("--activities") == 0 && dev.type != DeviceType::cuda) a.activities = "cpu";
    profiler_options(a);  // and a bad --activities or --options
    if (a.small && (app.count("--resnet-batch") > 0 || app.count("--gpt-batch") > 0))
      throw std::invalid_argument(
          "--resnet-batch and --gpt-batch do not apply with --small (its batches are fixed)");
    // A CPU-sized default: ResNet-50 at batch 64 takes about 27 s a step on a 2-core CPU.
    if (dev.type == DeviceType::cpu && !a.small && app.count("--resnet-batch") == 0 &&
        app.count("--gpt-batch") == 0) {
      a.small = true;
      fmt::print(
          "profile_models: on the CPU the tiny models are the default (--small); give "
          "--resnet-batch or --gpt-batch to profile ResNet-50 and GPT-2 there\n");
    }
    std::vector<std::string> models;
    std::stringstream list(a.models);
    for (std::string m; std::getline(list, m, ',');) {
      if (m.empty()) continue;
      if (m != "resnet" && m != "gpt") {
        try {
          nn::ModelOptions o;
          o.preset = a.preset;
          nn::resolve_options(nn::model_entry(m), o);  // the name and the preset, before any run
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument(fmt::format("--models {}: {}", m, e.what()));
        }
      }
      models.push_back(m);
    }
    if (models.empty()) throw std::invalid_argument("--models: empty list");
    const bool registry_model = std::any_of(models.begin(), models.end(), [](const std::string& m) {
      return m != "resnet" && m != "gpt";
    });
    for (const char* flag : {"--preset", "--batch", "--seq"})
      if (app.count(flag) > 0 && !registry_model)
        throw std::invalid_argument(
            fmt::format("{} applies to the registry's models ({}): add one to --models", flag,
                        nn::model_names()));
    if (a.fused_classifier && std::find(models.begin(), models.end(), "gpt") == models.end())
      throw std::invalid_argument("--fused-classifier applies to GPT: add gpt to --models");
    if (a.unfused_mlp && std::find(models.begin(), models.end(), "gpt") == models.end())
      throw std::invalid_argument("--unfused-mlp applies to GPT: add gpt to --models");
    ex::check_output_dir(a.out, "--out");
    std::vector<Result> rs;
    for (const std::string& m : models) rs.push_back(profile_model(a, m, dev));
    fmt::print("{:<32} {:>12} {:>14} {:>10} {:>17} {:>14} {:>12}\n", "model", "step ms",
               "profiled ms", "overhead", "spread (rounds)", "kernels ms/st", "GPU busy ms");
    std::string j = "[";
    for (size_t i = 0; i < rs.size(); ++i) {
      const Result& r = rs[i];
      fmt::print(
          "{:<32} {:>12.2f} {:>14.2f} {:>9.1f}% {:>17} {:>14.2f} {:>12.2f}\n", r.desc, r.median_ms,
          r.median_ms_profiled, r.overhead_pct,
          fmt::format("{:+.1f}..{:+.1f}% ({})", r.overhead_min_pct, r.overhead_max_pct, r.rounds),
          r.kernel_ms_per_step, r.gpu_busy_ms_per_step);
      j += fmt::format(
          R"({}{{"model": {}, "desc": {}, "device": {}, "median_ms": {}, "median_ms_profiled": {}, )"
          R"("overhead_pct": {}, "overhead_min_pct": {}, "overhead_max_pct": {}, "rounds": {}, )"
          R"("kernel_ms_per_step": {}, "gpu_busy_ms_per_step": {}, "kernels": {}, )"
          R"("activities": {}, "options": {}, "trace": {}, "timeline": {}}})",
          i ? ", " : "", base::json_quote(r.model), base::json_quote(r.desc),
          base::json_quote(dev.str()), r.median_ms, r.median_ms_profiled, r.overhead_pct,
          r.overhead_min_pct, r.overhead_max_pct, r.rounds, r.kernel_ms_per_step,
          r.gpu_busy_ms_per_step, r.kernels, base::json_quote(a.activities),
          base::json_quote(a.options), base::json_quote(r.trace), base::json_quote(r.timeline));
    }
    base::write_file_atomic(a.out + "/profile_models.json", j + "]\n", "profile_models");
    return 0;
  });
}
