#include "ab/ab.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <unordered_set>

#include "ab/staged_dir.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "base/atomic_file.h"
#include "inspect/memdiff.h"
#include "memory/alloc_config.h"
#include "memory/estimate.h"
#include "memory/host_memory.h"
#include "memory/memory.h"
#include "memory/timeline.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/offload.h"
#include "nn/parameter_split.h"
#include "nn/plan.h"
#include "optim/cpu_offload.h"
#include "optim/plan_training.h"
#include "optim/precision.h"
#include "profiler/memory_timeline.h"
#include "tensor/meta/cost.h"
#include "tensor/pinned.h"

namespace tally::ab {

namespace {

// The trace entries each run keeps: the whole run's, from before its batches and model exist.
constexpr size_t kHistoryEntries = 2000000;

// The allocator settings of one configuration, on `alloc` while this lives, the previous
// ones after. The caller starts it with nothing cached (a fresh dry run, or after
// empty_cache), so the run's segments all follow the new settings.
class AllocConfScope {
 public:
  AllocConfScope(memory::CachingAllocator& alloc, const std::string& conf) : alloc_(alloc) {
    if (conf.empty()) return;
    saved_ = alloc.config();
    alloc.set_config(memory::AllocatorConfig::parse(conf));
  }
  ~AllocConfScope() {
    if (saved_) alloc_.set_config(*saved_);
  }
  AllocConfScope(const AllocConfScope&) = delete;
  AllocConfScope& operator=(const AllocConfScope&) = delete;

 private:
  memory::CachingAllocator& alloc_;
  std::optional<memory::AllocatorConfig> saved_;
};

// Values kept in host buffers outside the allocators (ops::from_blob), so that each run
// copies them into its device's allocator while its history records: a run's snapshot then
// shows its copy as allocated in its trace (not as blocks from before the recording,
// `unknown` in memory_viz), and a CPU run's allocator holds one copy, as the dry run's that
// predicts it does.
class HostCopies {
 public:
  Tensor keep(const Tensor& t) {
    if (!t.defined()) return t;
    const Tensor c = ops::contiguous(
        t.device().type == DeviceType::cpu ? t : ops::to(t, Device::cpu(), t.dtype()));
    std::vector<std::byte>& buf = bufs_.emplace_back(c.nbytes());
    if (c.nbytes()) std::memcpy(buf.data(), c.data_ptr(), c.nbytes());
    return ops::from_blob(buf.data(), c.sizes(), c.dtype());
  }

 private:
  std::vector<std::vector<std::byte>> bufs_;
};

std::string safe_name(std::string s) {
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') c = '_';
  return s;
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The snapshot diff (inspect/memdiff.h) of every configuration against the first:
// <out>/diff/<configuration>.{txt,html,json} (ConfigResult::diff_path is the page). Returns
// the HTML pages' paths. The diffs name each snapshot as `out` will (StagedOutputDir::shown).
std::vector<std::string> write_diffs(const StagedOutputDir& out,
                                     const std::vector<ConfigResult>& results) {
  std::vector<std::string> pages;
  if (results.size() < 2) return pages;
  std::filesystem::create_directories(out.path() + "/diff");
  auto read = [&](const std::string& path) {
    inspect::SnapshotSummary s = inspect::read_snapshot_summary(path);
    s.path = out.shown(path);
    return s;
  };
  const inspect::SnapshotSummary base = read(results[0].snapshot_path);
  for (size_t i = 1; i < results.size(); ++i) {
    // Every run is of the same device; a dry run's (estimate) is a meta device of its own.
    const inspect::SnapshotDiff d =
        inspect::diff_snapshots(base, read(results[i].snapshot_path), {.any_device = true});
    const std::string page = results[i].diff_path;
    const std::string stem = page.substr(0, page.size() - 5);  // less ".html"
    base::write_file_atomic(stem + ".txt", inspect::format_snapshot_diff(d), "ab::run");
    inspect::write_snapshot_diff_json(stem + ".json", d);
    inspect::write_snapshot_diff_html(page, d);
    pages.push_back(page);
  }
  return pages;
}

// The recorded step as the profiler's timeline page draws it (profiler/memory_timeline.h):
// bytes per column, allocated, and reserved replayed from the segment entries of `history`
// (ending at `reserved_now`), and the step's phases.
profiler::MemoryTimeline timeline_page(const memory::MemoryTimeline& t,
                                       const std::vector<memory::TraceEntry>& history,
                                       const std::vector<PhaseRun>& phases, memory::Device device,
                                       int64_t reserved_now) {
  profiler::MemoryTimeline p;
  p.device = device;
  const auto segment = [](const memory::TraceEntry& e) -> int64_t {
    switch (e.action) {
      case memory::TraceAction::segment_alloc:
      case memory::TraceAction::segment_map:
        return static_cast<int64_t>(e.size);
      case memory::TraceAction::segment_free:
      case memory::TraceAction::segment_unmap:
        return -static_cast<int64_t>(e.size);
      default:
        return 0;
    }
  };
  int64_t reserved = reserved_now;
  for (const memory::TraceEntry& e : history) reserved -= segment(e);
  std::vector<size_t> reserved_at;  // after each entry that changes a category
  reserved_at.push_back(static_cast<size_t>(std::max<int64_t>(0, reserved)));
  for (const memory::TraceEntry& e : history) {
    reserved += segment(e);
    if (e.action == memory::TraceAction::alloc || e.action == memory::TraceAction::free_completed ||
        e.action == memory::TraceAction::retag)
      reserved_at.push_back(static_cast<size_t>(std::max<int64_t>(0, reserved)));
  }
  for (size_t i = 0; i < t.size(); ++i) {
    p.times_us.push_back(t.times_us[i]);
    std::array<int64_t, profiler::kTimelineColumns> row{};
    for (memory::Category c : memory::kAllCategories)
      row[static_cast<size_t>(memory::timeline_column(c))] += t.bytes[i][static_cast<size_t>(c)];
    p.sizes.push_back(row);
    p.allocated.push_back(static_cast<size_t>(std::max<int64_t>(0, t.total(i))));
  }
  if (reserved_at.size() == t.size()) p.reserved = reserved_at;
  const int64_t t0 = t.size() ? t.times_us.front() : 0;
  for (const PhaseRun& r : phases)
    p.phases.push_back({r.name, t0 + static_cast<int64_t>(std::llround(r.start_ms * 1000.0)),
                        t0 + static_cast<int64_t>(std::llround(r.end_ms * 1000.0))});
  return p;
}

// The peak allocated bytes reached by each phase's allocations in the recorded step, in order
// of first use
// (forward.0, backward.0, forward.1, ... with micro-batches).
std::vector<std::pair<std::string, int64_t>> phase_peaks(const memory::MemoryTimeline& t) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (size_t s = 0; s < t.size(); ++s) {
    // Allocations only: a free carries the phase its block was allocated in (a gradient freed
    // by the next step's zero_grad is `backward`'s), and a peak is reached at an allocation.
    if (s > 0 && t.total(s) <= t.total(s - 1)) continue;
    const std::string phase = memory::interned(t.phase[s]);
    if (phase.empty()) continue;
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == phase; });
    if (it == out.end())
      out.emplace_back(phase, t.total(s));
    else
      it->second = std::max(it->second, t.total(s));
  }
  return out;
}

std::string fmt_mib(int64_t b) {
  return fmt::format("{:.1f} MiB", static_cast<double>(b) / (1024.0 * 1024.0));
}

// The run's parts that every configuration shares: the model's source, the loss and the
// batches (in host buffers).
struct Setup {
  const nn::ModelEntry* entry = nullptr;
  nn::ModelOptions model_options;
  HostCopies host;
  std::vector<data::Example> batches;
  // Options::module: its parameters and buffers (each once) with their values at the call.
  std::vector<std::pair<Tensor, Tensor>> module_state;
  Device module_device = Device::cpu();
  std::string model_type;  // the type of the model built (for the title)
  int64_t steps = 0;
};

// `t` now holds `values` (param.data = values); its gradient is dropped.
void assign(const Tensor& t, const Tensor& values) {
  nn::set_data(t, values);
  if (t.grad().defined()) t.set_grad(Tensor());
}

// The library planner's choice for a checkpoint "auto" row (Options::memory_budget) on
// `device`, a dry run's meta device: `model` (on a meta device) gives the checkpointing
// policies, `rows` the micro-batch counts that divide the batch.
nn::PlanCandidate plan_row(const Options& o, const Config& row, Device device, nn::Module& model,
                           int64_t rows, int64_t steps, const DrySteps& dry_steps) {
  nn::TrainingPlanOptions p;
  p.target = memory::meta_target_of(device).name;
  p.budget = o.memory_budget;
  p.steps = steps;
  if (row.precision != "auto") p.precisions = {optim::parse_amp(row.precision)};
  p.offloads = {nn::parse_offload_spec(row.offload)};
  p.optimizers = {row.optimizer};
  if (o.optimizer.empty() && row.optimizer == "adamw") p.optimizers.push_back("adamw8bit");
  if (row.step_in_backward || row.grad_accum > 1) {
    p.step_in_backward = {row.step_in_backward};
    p.micro_batches = {row.grad_accum};
  }
  try {
    const nn::MemoryPlan plan = nn::plan_memory(model, rows, dry_steps, p);
    if (o.verbose) {
      fmt::print("{}", plan.report());
      std::fflush(stdout);
    }
    return plan.chosen.candidate;
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("ab::run: checkpoint 'auto': {}", e.what()));
  }
}

}  // namespace

std::vector<Config> configurations(const Options& o) {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("ab::run: " + what);
  };
  need(!o.checkpoint.empty(), "checkpoint: empty list");
  need(!o.precision.empty(), "precision: empty list");
  need(!o.offload.empty(), "offload: empty list");
  need(!o.step_in_backward.empty(), "step_in_backward: empty list");
  need(!o.grad_accum.empty(), "grad_accum: empty list");
  for (const std::string& ck : o.checkpoint)
    if (ck != "auto") nn::parse_checkpoint_spec(ck);
  const bool ck_auto =
      std::find(o.checkpoint.begin(), o.checkpoint.end(), "auto") != o.checkpoint.end();
  need(!ck_auto || o.planner || o.memory_budget > 0,
       "checkpoint 'auto' needs memory_budget (the bytes the run may reserve, e.g. 40MiB) or a "
       "planner");
  for (const std::string& am : o.precision) {
    if (am == "auto")
      need(ck_auto, "precision 'auto' lets the planner choose: it needs checkpoint 'auto'");
    else
      optim::parse_amp(am);
  }
  for (const std::string& s : o.offload) nn::parse_offload_spec(s);
  std::vector<std::string> optimizers = o.optimizer;
  if (optimizers.empty()) {
    const bool images =
        !o.model.empty() && nn::model_entry(o.model).input == nn::ModelEntry::Input::images;
    optimizers = {images ? "sgd" : "adamw"};
  }
  for (const std::string& s : optimizers)
    optim::check_optimizer(s, {"sgd", "adam", "adamw", "adamw8bit", "adamw:cpu", "adamw8bit:cpu"});
  for (int64_t n : o.grad_accum)
    need(n >= 1, fmt::format("grad_accum {}: micro-batches per step must be at least 1", n));
  for (bool sib : o.step_in_backward)
    if (sib) {
      for (const std::string& am : o.precision) optim::check_step_in_backward(true, am, 0);
      for (int64_t n : o.grad_accum)
        need(n == 1, fmt::format("step_in_backward with grad_accum {}: each parameter would step "
                                 "at every micro-batch; use grad_accum 1",
                                 n));
    }
  std::vector<std::string> confs;
  for (const std::string& c : o.alloc_conf) {
    if (c == "default") {
      confs.push_back("");
      continue;
    }
    try {
      memory::AllocatorConfig::parse(c);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(fmt::format("--alloc-conf '{}': {}", c, e.what()));
    }
    confs.push_back(c);
  }
  if (confs.empty()) confs.push_back("");
  std::vector<Config> out;
  for (const std::string& ck : o.checkpoint)
    for (const std::string& am : o.precision) {
      if (am == "auto" && ck != "auto") continue;  // precision auto belongs to the planned rows
      for (const std::string& off : o.offload)
        for (const std::string& opt : optimizers)
          for (bool sib : o.step_in_backward)
            for (int64_t n : o.grad_accum)
              for (const std::string& c : confs)
                out.push_back({ck, am == "none" ? "off" : am, opt, off, sib, n, c});
    }
  return out;
}

Results run(const Options& o) {
  // ---- everything is checked before the first configuration runs ----
  const int sources = !o.model.empty() + static_cast<int>(bool(o.factory)) + (o.module != nullptr);
  if (sources != 1)
    throw std::invalid_argument(fmt::format(
        "ab::run: give exactly one of model (a registry name), factory and module (got {})",
        sources));
  const std::vector<Config> configs = configurations(o);
  const bool estimate_only = !o.estimate.empty();
  if (estimate_only && o.device.type != DeviceType::cpu)
    throw std::invalid_argument(
        "--estimate: it predicts a run on its target device (cpu, h100, h200, cuda): leave out "
        "--device");
  const Device dev = estimate_only ? Device::cpu() : o.device;
  const std::string target =
      estimate_only ? o.estimate : (dev.type == DeviceType::cuda ? "cuda" : "cpu");
  try {
    memory::meta_target(target);
  } catch (const std::exception& e) {
    throw std::invalid_argument(fmt::format("--estimate: {}", e.what()));
  }
  if (o.out.empty()) throw std::invalid_argument("ab::run: out: empty path");
  if (o.rounds < 0) throw std::invalid_argument("ab::run: rounds must be at least 0");

  Setup setup;
  if (!o.model.empty()) {
    setup.entry = &nn::model_entry(o.model);
    setup.model_options = nn::resolve_options(*setup.entry, o.model_options);
  }
  const bool user_data = !o.data.empty() || bool(o.batches);
  if (!user_data && !setup.entry)
    throw std::invalid_argument(
        "ab::run: data: a model of your own needs its batches (Options::data or batches)");
  setup.steps = o.steps > 0 ? o.steps : (!o.data.empty() ? static_cast<int64_t>(o.data.size()) : 3);
  if (setup.steps < 1) throw std::invalid_argument("ab::run: steps must be at least 1");
  if (!user_data && o.batch < 1) throw std::invalid_argument("ab::run: batch must be at least 1");
  {
    memory::CategoryScope input(memory::Category::input);  // the batches live through every run
    for (int64_t s = 0; s < setup.steps; ++s) {
      data::Example b = !o.data.empty() ? o.data[static_cast<size_t>(s) % o.data.size()]
                        : o.batches
                            ? o.batches(s)
                            : setup.entry->synthetic_batch(setup.model_options, o.batch, s, o.seed);
      if (!b.input.defined())
        throw std::invalid_argument(fmt::format("ab::run: data: batch {} has no input", s));
      setup.batches.push_back({setup.host.keep(b.input), setup.host.keep(b.target)});
    }
  }
  const int64_t rows = setup.batches.front().input.dim() ? setup.batches.front().input.size(0) : 0;
  for (const Config& c : configs)
    if (c.grad_accum > 1 && (rows < c.grad_accum || rows % c.grad_accum != 0))
      throw std::invalid_argument(fmt::format(
          "grad_accum {}: a batch of {} rows does not split into {} equal micro-batches",
          c.grad_accum, rows, c.grad_accum));
  if (o.module) {
    std::unordered_set<const TensorImpl*> seen;
    for (const auto& ts : {o.module->parameters(), o.module->buffers()})
      for (const Tensor& t : ts)
        if (t.defined() && seen.insert(t.unsafe_impl()).second) {
          setup.module_device = t.device();
          setup.module_state.emplace_back(t, setup.host.keep(t.detach()));
        }
  }
  const LossFn loss_fn = o.loss ? o.loss
                         : setup.entry != nullptr
                             ? LossFn(setup.entry->loss)
                             : LossFn([](nn::Module& m, const data::Example& b) {
                                 return cross_entropy(m(b.input), b.target);
                               });

  // Every file goes to a fresh folder beside `out`, swapped into place once the report is
  // complete: a run that fails leaves the previous report whole.
  {
    std::error_code ec;
    std::filesystem::create_directories(o.out, ec);
    if (ec)
      throw std::invalid_argument(
          fmt::format("--out {}: cannot create the folder: {}", o.out, ec.message()));
  }
  StagedOutputDir staged(o.out, [](const std::string& n) {
    return n == "results.json" || n == "report.html" || n == "diff" || n.ends_with(".pickle") ||
           n.ends_with(".timeline.json") || n.ends_with(".timeline.html");
  });
  const std::string& out = staged.path();

  // The model of every configuration on `on`, from the same initial values: built on
  // `build_on` (the CPU, as a real run does; a meta device for the dry runs) and moved, or
  // the caller's module given its values at the call.
  auto make_model = [&](Device on, Device build_on) -> std::shared_ptr<nn::Module> {
    if (o.module) {
      NoGradGuard ng;
      memory::CategoryScope cat(memory::Category::parameter);
      for (const auto& [t, values] : setup.module_state) {
        assign(t, ops::to(values, on, values.dtype(), /*copy=*/true));
      }
      return o.module;
    }
    std::shared_ptr<nn::Module> m;
    {
      nn::BuildOnDevice b(build_on);
      m = setup.entry ? setup.entry->build(setup.model_options) : o.factory(build_on);
    }
    if (!m) throw std::invalid_argument("ab::run: the model factory returned no module");
    setup.model_type = m->type_name();
    m->to(on);
    return m;
  };
  // The caller's module back on its device, with its values at the call, however run() ends.
  struct Restore {
    const std::function<void()> fn;
    ~Restore() {
      try {
        fn();
      } catch (...) {  // an error already on its way out says more
      }
    }
  } restore{[&] {
    if (o.module) make_model(setup.module_device, setup.module_device);
  }};
  // A CPU run's batches live in the device's own allocator from the start of the run (a
  // copy of the host buffers, made while its history records); a CUDA run copies each batch
  // when its step begins.
  auto resident_batches = [&](Device d) {
    std::vector<data::Example> resident;
    if (memory::behaves_as(d) != DeviceType::cpu) return setup.batches;
    memory::CategoryScope input(memory::Category::input);
    for (const data::Example& b : setup.batches)
      resident.push_back(
          {ops::to(b.input, d, b.input.dtype(), /*copy=*/true),
           b.target.defined() ? ops::to(b.target, d, b.target.dtype(), /*copy=*/true) : Tensor()});
    return resident;
  };

  // One configuration's steps on `on`: the real device, or a dry run's meta device (no
  // values to read there: no loss). `r` (when given) gets the last step's phases, the median
  // step time and the loss; `times` each step's time. Returns when its last step began.
  auto run_config = [&](Device on, const std::vector<data::Example>& items,
                        const nn::CheckpointSpec& spec, std::optional<DType> amp, const Config& c,
                        ConfigResult* r, std::vector<double>* times_out = nullptr,
                        Device build_on = Device::cpu()) -> int64_t {
    std::optional<PhaseRecorder> phases;  // the last step's phases, with their times
    const bool dry = on.is_meta();
    manual_seed(o.seed);
    std::shared_ptr<nn::Module> model = make_model(on, build_on);
    if (r) r->parameters = nn::parameter_split(*model, on);
    // The caller's module gives its device memory back when the configuration ends (its
    // tensors then view the host copies), so the next one starts with nothing of it.
    struct Release {
      const Setup& setup;
      bool on;
      ~Release() {
        if (!on) return;
        for (const auto& [t, values] : setup.module_state) {
          assign(t, values);
        }
      }
    } release{setup, o.module != nullptr};
    model->train();
    nn::enable_checkpointing(*model, spec);
    std::unique_ptr<optim::Optimizer> opt =
        optim::make_optimizer(c.optimizer, model->parameters(), optim::AdamOptions{.lr = o.lr},
                              optim::SGDOptions{.lr = o.lr, .momentum = 0.9});
    // A host optimizer under bf16 keeps bfloat16 weights on the device, float32 masters on the
    // host, as the training programs do (train_model --optimizer adamw:cpu --amp bf16).
    if (auto* host = dynamic_cast<optim::CpuOffload*>(opt.get()); host && amp == DType::bfloat16)
      host->keep_16bit_weights(*model);
    optim::Precision prec(amp, on);
    // `link` measures one forward of the first micro-batch (nn/offload.h).
    nn::offload_activations(*model, nn::parse_offload_spec(c.offload), {}, [&] {
      data::Example b;
      {
        memory::CategoryScope input(memory::Category::input);
        const data::Example& first = items.front();
        b = {ops::to_device_async(first.input, on),
             first.target.defined() ? ops::to_device_async(first.target, on) : Tensor()};
      }
      if (c.grad_accum > 1) {
        const int64_t len = b.input.size(0) / c.grad_accum;
        b.input = ops::narrow(b.input, 0, 0, len);
        if (b.target.defined() && b.target.dim() > 0) b.target = ops::narrow(b.target, 0, 0, len);
      }
      memory::PhaseScope phase("forward");
      auto guard = prec.autocast();
      (void)loss_fn(*model, b);
    });
    if (c.step_in_backward) prec.step_in_backward(*opt);

    std::vector<double> times;
    double loss_value = std::nan("");
    int64_t last_step_us = 0;
    for (int64_t s = 0; s < setup.steps; ++s) {
      memory::synchronize(on);
      if (s == setup.steps - 1 && r) {
        last_step_us = memory::now_us();
        phases.emplace();
      }
      const double t0 = now_ms();
      data::Example batch;
      {
        memory::CategoryScope input(memory::Category::input);
        const auto& b = items[static_cast<size_t>(s)];
        batch = {ops::to_device_async(b.input, on),
                 b.target.defined() ? ops::to_device_async(b.target, on) : Tensor()};
      }
      opt->zero_grad(true);
      const double scale = prec.scaler().get_scale();
      double step_loss = 0;
      const int64_t n = c.grad_accum;
      for (int64_t k = 0; k < n; ++k) {
        // Micro-batch k: rows [k*B/n, (k+1)*B/n), its loss scaled by 1/n so that the summed
        // gradients are the whole batch's mean.
        const std::string suffix = n > 1 ? fmt::format(".{}", k) : std::string();
        Tensor loss;
        {
          memory::PhaseScope phase("forward" + suffix);
          auto guard = prec.autocast();
          data::Example micro = batch;
          if (n > 1) {
            const int64_t len = batch.input.size(0) / n;
            micro.input = ops::narrow(batch.input, 0, k * len, len);
            if (batch.target.defined() && batch.target.dim() > 0)
              micro.target = ops::narrow(batch.target, 0, k * len, len);
          }
          loss = loss_fn(*model, micro);
          if (!loss.defined() || loss.numel() != 1)
            throw std::invalid_argument(
                "ab::run: the loss function must return a one-element tensor");
          if (n > 1) loss = mul(loss, 1.0 / static_cast<double>(n));
        }
        prec.backward(loss, "backward" + suffix);
        if (!dry) step_loss += loss.item();
      }
      prec.step(*opt);
      if (!dry && r && prec.scaler().get_scale() < scale) ++r->skipped_steps;  // inf: backed off
      loss_value = step_loss;
      batch = {};
      memory::synchronize(on);
      times.push_back(now_ms() - t0);
    }
    if (o.eval) {
      model->eval();
      NoGradGuard ng;
      memory::PhaseScope phase("eval");
      auto guard = prec.autocast();
      const auto& b = items.front();
      data::Example batch;
      {
        memory::CategoryScope input(memory::Category::input);
        batch = {ops::to_device_async(b.input, on),
                 b.target.defined() ? ops::to_device_async(b.target, on) : Tensor()};
      }
      o.eval(*model, batch);
      model->train();
    }
    if (phases && r) r->phases = phases->runs(0);  // µs since the epoch / 1000 until rebased
    phases.reset();
    if (r) {
      // The steps after the first (which builds the optimizer's state) when there are some.
      std::vector<double> warm(times.begin() + (times.size() > 1 ? 1 : 0), times.end());
      r->median_ms = dry ? std::nan("") : median(warm);
      r->final_loss = dry ? std::nan("") : loss_value;
    }
    if (times_out) *times_out = times;
    return last_step_us;
  };

  // The prediction of one configuration: the same steps on a dry run of `target` (its
  // history records from the start, as a real run's does). `last_step_us`: when its last
  // step began.
  auto predict = [&](const nn::CheckpointSpec& spec, std::optional<DType> amp, const Config& c,
                     ConfigResult& r, int64_t& last_step_us) {
    memory::DryRun dry(
        {.target = target, .max_history = kHistoryEntries, .host_memory = o.host_memory});
    // A GPU without recorded rates (an H100) times its steps with the planner's relative model,
    // so that its predicted step times rank as the planner's do.
    if (const memory::MetaTarget t = memory::meta_target(target); t.type == DeviceType::cuda)
      meta::set_rates(dry.device(), nn::calibrated_rates(t));
    AllocConfScope conf(memory::get_allocator(dry.device()), c.alloc_conf);
    std::string oom;
    try {
      // Built on the dry run's device: a model larger than this machine's memory is predicted
      // too (a 13B LLaMA's float32 weights are 52 GB).
      last_step_us = run_config(dry.device(), resident_batches(dry.device()), spec, amp, c, &r,
                                nullptr, dry.device());
    } catch (const memory::OutOfMemoryError& e) {
      oom = e.what();
    }
    r.predicted = true;
    r.estimate = dry.finish(oom);
    if (!r.estimate.fits() && o.verbose)
      fmt::print("   predicted: does not fit on {}: {}\n", target, oom);
    return r.estimate.device;
  };

  // Which axes the names show: those with more than one value, or a value off the default.
  auto several = [](const auto& v) { return v.size() > 1; };
  const bool name_alloc = !o.alloc_conf.empty();
  const bool name_accum =
      several(o.grad_accum) || std::any_of(configs.begin(), configs.end(),
                                           [](const Config& c) { return c.grad_accum != 1; });
  const bool name_offload = several(o.offload);
  const bool name_opt = several(o.optimizer);
  const bool name_sib = several(o.step_in_backward);

  Results res;
  std::vector<ConfigResult>& results = res.configs;
  std::vector<std::pair<nn::CheckpointSpec, std::optional<DType>>> resolved;  // for the rounds
  std::vector<Config> resolved_cfg;
  for (const Config& row : configs) {
    Config c = row;
    std::optional<DType> amp = c.precision == "auto" ? std::nullopt : optim::parse_amp(c.precision);
    nn::CheckpointSpec spec =
        c.checkpoint == "auto" ? nn::CheckpointSpec{} : nn::parse_checkpoint_spec(c.checkpoint);
    std::string ck_name = c.checkpoint, am_name = c.precision;
    if (c.checkpoint == "auto") {
      // The planner's choice for this row, planned for the prediction's target.
      memory::DryRun probe({.target = target, .host_memory = o.host_memory});
      const std::shared_ptr<nn::Module> meta_model = make_model(Device::meta(), Device::meta());
      // The row with a candidate's levers (those it sets).
      auto with = [](Config l, const nn::PlanCandidate& pc) {
        l.offload = pc.offload.str();
        if (!pc.optimizer.empty()) l.optimizer = pc.optimizer;
        l.step_in_backward = l.step_in_backward || pc.step_in_backward;
        if (pc.micro_batches > 1) l.grad_accum = pc.micro_batches;
        return l;
      };
      const DrySteps dry_steps = [&](Device d, const nn::PlanCandidate& pc) {
        run_config(d, resident_batches(d), pc.checkpoint, pc.amp, with(c, pc), nullptr, nullptr,
                   Device::meta());
      };
      const nn::PlanCandidate cand =
          o.planner
              ? o.planner(c, probe.device(), nn::checkpoint_block_count(*meta_model), dry_steps)
              : plan_row(o, c, probe.device(), *meta_model, rows, setup.steps, dry_steps);
      spec = cand.checkpoint;
      amp = cand.amp;
      c = with(c, cand);
      ck_name = fmt::format("auto({})", spec.str());
      am_name = !amp ? "off" : *amp == DType::float16 ? "fp16" : "bf16";
      if (c.precision == "auto") am_name = fmt::format("auto({})", am_name);
    }
    ConfigResult r;
    r.name = fmt::format("ckpt={} amp={}", ck_name, am_name);
    r.settings = {{"ckpt", ck_name},
                  {"amp", am_name},
                  {"offload", c.offload},
                  {"opt", c.optimizer},
                  {"sib", c.step_in_backward ? "on" : "off"}};
    if (name_accum) r.settings.push_back({"accum", std::to_string(c.grad_accum)});
    if (name_alloc) {
      const std::string conf = c.alloc_conf.empty() ? "default" : c.alloc_conf;
      r.settings.push_back({"alloc", conf});
      r.name += " alloc=" + conf;
    }
    if (name_offload || c.offload != "none") r.name += " offload=" + c.offload;
    // An "auto" row names the levers its planner changed.
    if (name_opt || c.optimizer != row.optimizer) r.name += " opt=" + c.optimizer;
    if (name_sib || c.step_in_backward)
      r.name += std::string(" sib=") + (c.step_in_backward ? "on" : "off");
    if (name_accum || c.grad_accum != row.grad_accum)
      r.name += fmt::format(" accum={}", c.grad_accum);
    if (o.verbose) {
      fmt::print("== {}\n", r.name);
      std::fflush(stdout);
    }

    // The prediction first (it needs no device), then the run it predicts. With `estimate`
    // there is no run: the dry run's allocator stands in for the device.
    int64_t last_step_us = 0;
    int64_t base_allocated = 0, base_reserved = 0;
    memory::CategoryBytes base_categories{};
    std::optional<AllocConfScope> run_conf;  // the real run's settings, to the snapshot
    Device recorded = predict(spec, amp, c, r, last_step_us);
    if (r.estimate.predicted_seconds > 0)
      r.predicted_step_ms =
          r.estimate.predicted_seconds * 1000.0 / static_cast<double>(setup.steps);
    r.device = estimate_only ? target : dev.str();
    if (estimate_only) {
      r.measured = false;
      r.peak_allocated = r.estimate.peak_allocated;
      r.peak_reserved = r.estimate.peak_reserved;
      r.at_peak = r.estimate.at_peak;
      if (!(r.estimate.host == r.estimate.device)) {
        r.host_peak_allocated = r.estimate.host_peak_allocated;
        r.host_peak_reserved = r.estimate.host_peak_reserved;
      }
    } else {
      memory::record_memory_history(false, 0, recorded);
      recorded = dev;
      memory::empty_cache(dev);
      run_conf.emplace(memory::get_allocator(dev), c.alloc_conf);
      memory::reset_peak_memory_stats(dev);
      memory::CachingAllocator* host = memory::host_allocator(dev);
      int64_t host_base_allocated = 0, host_base_reserved = 0;
      if (host) {
        host->reset_peak_memory_stats();
        const memory::DeviceStats h = host->stats();
        host_base_allocated = h.allocated_bytes[0].current;
        host_base_reserved = h.reserved_bytes[0].current;
      }
      // What the device holds before the run is not the run's (on the CPU: the caller's own
      // batches, say): the figures count from it, as the dry run's do from nothing.
      {
        const memory::DeviceStats before = memory::get_allocator(dev).stats();
        base_allocated = before.allocated_bytes[0].current;
        base_reserved = before.reserved_bytes[0].current;
        for (size_t k = 0; k < base_categories.size(); ++k)
          base_categories[k] = before.category_bytes[k].current;
      }
      // Recorded from before the batches' copies and the model: the snapshot has every
      // block's alloc (parameters, optimizer state, inputs), nothing `unknown`.
      memory::record_memory_history(true, kHistoryEntries, dev);
      last_step_us = run_config(dev, resident_batches(dev), spec, amp, c, &r);
      const memory::DeviceStats st = memory::get_allocator(dev).stats();
      r.peak_allocated = st.allocated_bytes[0].peak - base_allocated;
      r.peak_reserved = st.reserved_bytes[0].peak - base_reserved;
      r.at_peak = st.category_at_peak;
      for (size_t k = 0; k < r.at_peak.size(); ++k)
        r.at_peak[k] = std::max<int64_t>(0, r.at_peak[k] - base_categories[k]);
      if (host) {
        const memory::DeviceStats h = host->stats();
        r.host_peak_allocated = h.allocated_bytes[0].peak - host_base_allocated;
        r.host_peak_reserved = h.reserved_bytes[0].peak - host_base_reserved;
      }
    }
    auto& alloc = memory::get_allocator(recorded);
    const memory::DeviceStats st = alloc.stats();
    memory::CategoryBytes now{};
    for (size_t k = 0; k < now.size(); ++k)
      now[k] = st.category_bytes[k].current - (estimate_only ? 0 : base_categories[k]);
    // The snapshot holds the whole run; the report's timeline is its last step.
    std::vector<memory::TraceEntry> history = alloc.history();
    std::erase_if(history, [&](const memory::TraceEntry& e) { return e.time_us < last_step_us; });
    r.timeline = memory::timeline_from_history(history, &now);
    r.phase_peaks = phase_peaks(r.timeline);
    const int64_t t0 = r.timeline.size() ? r.timeline.times_us.front() : 0;
    for (PhaseRun& p : r.phases) {  // in ms from the recorded step's first sample
      p.start_ms = std::max(0.0, p.start_ms - static_cast<double>(t0) / 1000.0);
      p.end_ms = std::max(p.start_ms, p.end_ms - static_cast<double>(t0) / 1000.0);
    }
    const std::string stem = out + "/" + safe_name(r.name);
    r.snapshot_path = stem + ".pickle";
    r.timeline_path = stem + ".timeline.json";
    r.timeline_html_path = stem + ".timeline.html";
    if (!results.empty()) r.diff_path = out + "/diff/" + safe_name(r.name) + ".html";
    memory::dump_snapshot(r.snapshot_path, recorded);
    memory::write_timeline_json(r.timeline, r.timeline_path);
    {
      profiler::MemoryTimeline page =
          timeline_page(r.timeline, history, r.phases, recorded,
                        st.reserved_bytes[0].current - (estimate_only ? 0 : base_reserved));
      page.title = r.name;
      page.back_link = "report.html";
      base::write_file_atomic(
          r.timeline_html_path,
          [&](std::ostream& os) { profiler::write_memory_timeline_html(page, os); }, "ab::run");
    }
    memory::record_memory_history(false, 0, recorded);
    memory::empty_cache(recorded);
    run_conf.reset();
    if (!estimate_only) memory::empty_cache(dev);
    results.push_back(std::move(r));
    resolved.emplace_back(spec, amp);
    resolved_cfg.push_back(c);
  }

  // Step times from interleaved rounds: every configuration once per round, in order, so
  // that a load on the machine falls on all of them alike; each round's figure is the median
  // of its warm steps, the configuration's the median of its rounds, with their range.
  if (!estimate_only && o.rounds > 0) {
    std::vector<std::vector<double>> per(results.size());
    for (int round = 0; round < o.rounds; ++round)
      for (size_t i = 0; i < results.size(); ++i) {
        memory::empty_cache(dev);
        AllocConfScope conf(memory::get_allocator(dev), resolved_cfg[i].alloc_conf);
        std::vector<double> times;
        run_config(dev, resident_batches(dev), resolved[i].first, resolved[i].second,
                   resolved_cfg[i], nullptr, &times);
        memory::empty_cache(dev);
        per[i].push_back(median({times.begin() + (times.size() > 1 ? 1 : 0), times.end()}));
      }
    for (size_t i = 0; i < results.size(); ++i) {
      results[i].round_ms = per[i];
      results[i].median_ms = median(per[i]);
    }
  }
  for (ConfigResult& r : results) {
    std::vector<double> v = r.round_ms;
    if (v.empty() && std::isfinite(r.median_ms)) v = {r.median_ms};
    if (v.empty()) continue;
    r.min_ms = *std::min_element(v.begin(), v.end());
    r.max_ms = *std::max_element(v.begin(), v.end());
  }

  std::string where = estimate_only ? fmt::format("predicted for {}, dry runs", target) : dev.str();
  std::string title = o.title;
  if (title.empty()) {
    const std::string what =
        setup.entry ? fmt::format("{} {}", setup.entry->name, setup.model_options.preset)
        : o.module  ? o.module->type_name()
                    : setup.model_type;
    title = fmt::format("{} (batch {}, {} steps, {})", what, rows, setup.steps, where);
  }
  res.table = format_table(results);
  for (size_t i = 1; i < results.size(); ++i) res.headlines.push_back(headline(results, i));
  if (o.verbose) {
    std::cout << res.table << std::flush;
    for (const ConfigResult& r : results)
      if (r.phase_peaks.size() > 3 || name_accum) {
        std::string line;
        for (const auto& [phase, bytes] : r.phase_peaks)
          line += fmt::format("{}{} {}", line.empty() ? "" : ", ", phase, fmt_mib(bytes));
        fmt::print("peak by phase, {}: {}\n", r.name, line);
      }
    if (results.size() > 1) {
      fmt::print("what each option bought, against {}:\n", results.front().name);
      for (const std::string& h : res.headlines) fmt::print("  {}\n", h);
    }
    if (const std::string caveat = cpu_autocast_caveat(results); !caveat.empty())
      fmt::print("{}\n", caveat);
    if (estimate_only) {
      // What the table cannot show: where the activations at each predicted peak come from.
      fmt::print("largest activations at the predicted peak, by module:\n");
      for (const auto& r : results) {
        std::string top;
        for (size_t k = 0; k < r.estimate.activations_at_peak.size() && k < 4; ++k)
          top += fmt::format("{}{} {}", k ? ", " : "",
                             r.estimate.activations_at_peak[k].module.empty()
                                 ? std::string("(no module)")
                                 : r.estimate.activations_at_peak[k].module,
                             fmt_mib(r.estimate.activations_at_peak[k].bytes));
        fmt::print("  {}: {}\n", r.name, top.empty() ? std::string("none") : top);
      }
    }
  }
  {
    // results.json: the table's numbers for scripts (bytes; categories by Tally's names).
    using Json = nlohmann::ordered_json;
    // Times to the µs, losses to 6 decimals; a dry run has no step time and no loss: null.
    auto number = [](double v, int digits) {
      const double scale = std::pow(10.0, digits);
      return std::isfinite(v) ? Json(std::round(v * scale) / scale) : Json();
    };
    auto by_category = [](const memory::CategoryBytes& bytes) {
      Json j = Json::object();
      for (size_t c = 0; c < memory::kNumCategories; ++c)
        j[std::string(memory::category_name(memory::kAllCategories[c]))] = bytes[c];
      return j;
    };
    Json j = Json::array();
    for (const auto& r : results) {
      Json settings = Json::object();
      for (const auto& [axis, v] : r.settings) settings[axis] = v;
      Json rounds = Json::array();
      for (double v : r.round_ms) rounds.push_back(number(v, 3));
      Json phases = Json::object();
      for (const auto& [phase, bytes] : r.phase_peaks) phases[phase] = bytes;
      Json e = {{"name", r.name},
                {"settings", std::move(settings)},
                {"peak_allocated", r.peak_allocated},
                {"peak_reserved", r.peak_reserved},
                {"host_peak_allocated", r.host_peak_allocated},
                {"host_peak_reserved", r.host_peak_reserved},
                {"median_ms", number(r.measured ? r.median_ms : NAN, 3)},
                {"min_ms", number(r.measured ? r.min_ms : NAN, 3)},
                {"max_ms", number(r.measured ? r.max_ms : NAN, 3)},
                {"round_ms", std::move(rounds)},
                {"final_loss", number(r.final_loss, 6)},
                {"skipped_steps", r.skipped_steps},
                {"at_peak", by_category(r.at_peak)},
                {"parameters",
                 {{"trainable", r.parameters.trainable},
                  {"frozen", r.parameters.frozen},
                  {"trainable_bytes", r.parameters.trainable_bytes},
                  {"frozen_bytes", r.parameters.frozen_bytes}}},
                {"phase_peaks", std::move(phases)}};
      if (r.predicted) {
        e["estimate_target"] = r.estimate.target.name;
        e["estimated_peak_allocated"] = r.estimate.peak_allocated;
        e["estimated_peak_reserved"] = r.estimate.peak_reserved;
        e["estimated_at_peak"] = by_category(r.estimate.at_peak);
        e["estimated_host_peak_allocated"] = r.estimate.host_peak_allocated;
        e["estimated_host_peak_reserved"] = r.estimate.host_peak_reserved;
        // The dry run's step time (null where the target has no rates: the CPU's unplanned).
        e["predicted_ms"] = number(r.predicted_step_ms, 3);
      }
      e["measured"] = r.measured;
      e["snapshot"] = staged.shown(r.snapshot_path);
      e["timeline"] = staged.shown(r.timeline_path);
      e["timeline_html"] = staged.shown(r.timeline_html_path);
      e["diff"] = staged.shown(r.diff_path);
      j.push_back(std::move(e));
    }
    // A path that is not UTF-8 gets U+FFFD for its odd bytes rather than failing the run.
    base::write_file_atomic(out + "/results.json",
                            j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n",
                            "ab::run");
  }
  // The diffs first: the report links them.
  res.diffs = write_diffs(staged, results);
  write_report(out + "/report.html", title, results);
  staged.commit();
  res.out = o.out;
  res.report = o.out + "/report.html";
  for (std::string& d : res.diffs) d = staged.shown(d);
  for (ConfigResult& r : results)
    for (std::string* p : {&r.snapshot_path, &r.timeline_path, &r.timeline_html_path, &r.diff_path})
      *p = staged.shown(*p);
  if (o.verbose) {
    fmt::print(
        "report: {}\nper configuration: *.pickle (open at https://pytorch.org/memory_viz), "
        "*.timeline.json (PyTorch's memory-timeline layout), *.timeline.html (its chart)\n",
        res.report);
    if (!res.diffs.empty())
      fmt::print("snapshot diffs against {} (.html, .txt, .json; tally_memdiff A B):\n  {}\n",
                 results.front().name, fmt::join(res.diffs, "\n  "));
    std::fflush(stdout);
  }
  return res;
}

}  // namespace tally::ab
