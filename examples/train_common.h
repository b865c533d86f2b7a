// What the training programs share: the --checkpoint / --amp / --offload / --device flags, a
// training step that applies them (autocast region, GradScaler for fp16, phases for the history),
// the --detect-leaks check (LeakCheck), --memory-limit and the out-of-memory report (what would
// fit), --cuda-graphs (GraphedStep), a one-line progress bar, and byte formatting.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <source_location>
#include <stdexcept>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "inspect/leak_detector.h"
#include "memory/estimate.h"
#include "memory/memory.h"
#include "nn/norm.h"
#include "nn/offload.h"
#include "nn/plan.h"
#include "optim/adam.h"
#include "optim/adamw8bit.h"
#include "optim/clip_grad.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"
#include "optim/plan_training.h"
#include "optim/precision.h"
#include "optim/sgd.h"
#include "optim/step_in_backward.h"
#include "tensor/cuda/graph.h"

namespace tally::examples {

// The precision and optimizer levers live in the library (optim/precision.h).
using optim::check_optimizer;
using optim::check_step_in_backward;
using optim::make_optimizer;
using optim::parse_amp;
using optim::Precision;

inline Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda" || s == "cuda:0") {
    if (!memory::cuda_available())
      throw std::invalid_argument(
          "--device cuda: this build has no CUDA backend or no GPU is present");
    return Device::cuda(0);
  }
  throw std::invalid_argument(fmt::format("--device: expected cpu or cuda, got '{}'", s));
}

// --estimate TARGET: the training programs run their own loop on a dry run's meta device
// (memory/estimate.h) for this many steps, print the prediction and stop; the planner and the
// out-of-memory report dry-run this many too. The peak allocated is reached by the second
// step, once the optimizer state exists; the peak reserved can take the third (GPT-2 B16 with
// every block checkpointed: 3,230 MiB after two steps, 3,380 MiB from the third on).
inline constexpr int64_t kEstimateSteps = 3;
// The exit status of a run that ran out of memory, and of a dry run predicted not to fit.
inline constexpr int kExitOutOfMemory = 3;

// The dry run for --estimate (none when the flag is empty). --device names where a real run
// goes, so the two together are an error. `host_memory` (--host-memory): what the target's host
// has ("": this machine's memory).
inline std::unique_ptr<memory::DryRun> make_dry_run(const std::string& target, bool device_given,
                                                    const std::string& host_memory = "") {
  if (target.empty()) {
    if (!host_memory.empty())
      throw std::invalid_argument("--host-memory applies to a dry run: it needs --estimate");
    return nullptr;
  }
  if (device_given)
    throw std::invalid_argument(
        "--estimate: it predicts a run on its target device (cpu, h100, h200, cuda): leave out "
        "--device");
  const size_t host = host_memory.empty() ? 0 : memory::parse_bytes(host_memory, "--host-memory");
  if (!host_memory.empty() && host == 0)
    throw std::invalid_argument("--host-memory: expected a size above 0 (128GiB, say)");
  try {
    return std::make_unique<memory::DryRun>(
        memory::EstimateOptions{.target = target, .host_memory = host});
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("--estimate: {}", e.what()));
  }
}

// The end of a run: memory_summary() (--summary) and the snapshot (--snapshot) of `device`.
inline void write_memory_outputs(Device device, bool summary, const std::string& snapshot) {
  if (summary) std::fputs(memory::memory_summary(device).c_str(), stdout);
  if (!snapshot.empty()) {
    memory::dump_snapshot(snapshot, device);
    std::printf("snapshot written to %s (open it at https://pytorch.org/memory_viz)\n",
                snapshot.c_str());
  }
  std::fflush(stdout);
}

// The end of an --estimate run: the report, and the dry run's snapshot (memory_viz) and
// memory_summary() when asked. `out_of_memory`: the message when the dry run ran out.
inline int finish_dry_run(memory::DryRun& dry, const std::string& out_of_memory,
                          const std::string& snapshot, bool summary) {
  const memory::Estimate e = dry.finish(out_of_memory);
  std::fputs(e.report().c_str(), stdout);
  write_memory_outputs(e.device, summary, snapshot);  // the dry run's own
  return e.fits() ? 0 : kExitOutOfMemory;
}

// --checkpoint auto --memory-budget SIZE [--amp auto] [--offload auto]: the memory planner
// for any model (optim/plan_training.h) picks the checkpointing plan, the optimizer (AdamW or
// AdamW8bit), step-in-backward and the micro-batches (gradient accumulation) the flags leave
// free, the precision with --amp auto and whether to offload activations with --offload auto,
// for the run's device or the --estimate target, and prints its grid. `run` dry-runs one
// candidate the way the program trains. Errors name the flag.
struct AutoPlan {
  bool checkpoint_auto = false;
  bool amp_auto = false;
  bool offload_auto = false;
  nn::OffloadSpec offload;  // the --offload given (not auto)
  size_t budget = 0;
  // The values searched of the levers the flags leave free, or the one a flag pins (empty:
  // the planner's default, nn::TrainingPlanOptions).
  std::vector<std::string> optimizers;
  std::vector<bool> step_in_backward;
  std::vector<int64_t> micro_batches;  // empty: 1, 2, 4, ... up to the batch, as needed
  std::vector<bool> fused_classifier;  // a model that builds one on request (train_gpt)
  size_t host_memory = 0;              // --host-memory: the dry runs' host (0: this machine's)
};
inline AutoPlan parse_auto_plan(const std::string& checkpoint, const std::string& amp,
                                const std::string& budget, const std::string& offload = "none") {
  AutoPlan p;
  p.checkpoint_auto = checkpoint == "auto";
  p.amp_auto = amp == "auto";
  p.offload_auto = offload == "auto";
  if (!p.offload_auto) p.offload = nn::parse_offload_spec(offload);
  if (p.offload_auto && !p.checkpoint_auto)
    throw std::invalid_argument(
        "--offload auto lets the planner choose: it needs --checkpoint auto");
  if (!budget.empty()) {
    p.budget = memory::parse_bytes(budget, "--memory-budget");  // its errors name the flag
    if (p.budget == 0) throw std::invalid_argument("--memory-budget: 0 bytes");
  }
  if (p.checkpoint_auto && budget.empty())
    throw std::invalid_argument("--checkpoint auto needs --memory-budget (e.g. 6GiB)");
  if (!p.checkpoint_auto && !budget.empty())
    throw std::invalid_argument("--memory-budget applies to --checkpoint auto");
  if (p.amp_auto && !p.checkpoint_auto)
    throw std::invalid_argument("--amp auto lets the planner choose: it needs --checkpoint auto");
  return p;
}

// What one row of a batch is, from the first input's shape (without its batch dimension) and
// dtype: "sequences of 2048 tokens" (integer ids), "images of 3x32x32", "samples of 16x8".
inline std::string describe_rows(const Shape& input, DType dtype) {
  std::string dims;
  for (size_t i = 1; i < input.size(); ++i) dims += fmt::format("{}{}", i > 1 ? "x" : "", input[i]);
  if (input.size() == 2 && !is_floating(dtype)) return fmt::format("sequences of {} tokens", dims);
  if (input.size() == 4) return "images of " + dims;
  return input.size() > 1 ? "samples of " + dims : "samples";
}

// What a step of `batch` rows in `micro_batches` keeps: "32 sequences of 2048 tokens per step
// (65536 tokens) in 8 micro-batches of 4". `rows` as describe_rows says; `tokens_per_row` 0
// for rows that are not sequences of tokens.
inline std::string describe_step(int64_t batch, int64_t micro_batches, const std::string& rows,
                                 int64_t tokens_per_row = 0) {
  const int64_t k = std::max<int64_t>(1, micro_batches);
  return fmt::format(
      "{} {} per step{} in {}", batch, rows,
      tokens_per_row > 0 ? fmt::format(" ({} tokens)", batch * tokens_per_row) : std::string(),
      k > 1 ? fmt::format("{} micro-batches of {}", k, batch / k)
            : std::string("one batch (no micro-batches)"));
}

// The planner's choice, its grid printed. `device` is the run's (a dry run's meta device for
// --estimate: its target is planned for); `model` (built on a meta device) gives the
// checkpointing policies; `batch` the micro-batch counts that divide it. `run` trains `steps`
// steps of a candidate; `classifier_chunks`: the fused classifier's chunk budgets to search
// (nn::PlanOptions).
inline nn::PlanCandidate plan_run(const AutoPlan& ap, std::optional<DType> amp, Device device,
                                  nn::Module& model, int64_t batch,
                                  const std::function<void(Device, const nn::PlanCandidate&)>& run,
                                  int64_t steps, std::vector<int64_t> classifier_chunks = {}) {
  nn::TrainingPlanOptions o;
  o.steps = steps;
  o.host_memory = ap.host_memory;
  o.classifier_chunks = std::move(classifier_chunks);
  o.target = device.is_meta() ? memory::meta_target_of(device).name
                              : (device.type == DeviceType::cuda ? "cuda" : "cpu");
  o.budget = ap.budget;
  if (ap.amp_auto)
    o.precisions =
        memory::behaves_as(device) == DeviceType::cuda
            ? std::vector<std::optional<DType>>{std::nullopt, DType::bfloat16, DType::float16}
            : std::vector<std::optional<DType>>{std::nullopt, DType::bfloat16};
  else
    o.precisions = {amp};
  o.offloads = ap.offload_auto ? std::vector<nn::OffloadSpec>{nn::OffloadSpec{},
                                                              nn::parse_offload_spec("activations"),
                                                              nn::parse_offload_spec("link")}
                               : std::vector<nn::OffloadSpec>{ap.offload};
  if (!ap.optimizers.empty()) o.optimizers = ap.optimizers;
  if (!ap.step_in_backward.empty()) o.step_in_backward = ap.step_in_backward;
  if (!ap.micro_batches.empty()) o.micro_batches = ap.micro_batches;
  if (!ap.fused_classifier.empty()) o.fused_classifier = ap.fused_classifier;
  nn::MemoryPlan plan;
  try {
    plan = nn::plan_memory(model, batch, run, o);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("--memory-budget: {}", e.what()));
  }
  std::fputs(plan.report().c_str(), stdout);
  // Micro-batches change what batch norm computes: its statistics over each micro-batch.
  const int64_t k = plan.chosen.candidate.micro_batches;
  if (k > 1 && ap.micro_batches.size() != 1)  // the planner chose them, not --grad-accum
    for (const auto& [name, m] : model.named_modules())
      if (dynamic_cast<const nn::BatchNormBase*>(m) != nullptr) {
        std::printf(
            "note: the plan runs %lld micro-batches of %lld rows: batch norm (%s, ...) takes its "
            "statistics over each micro-batch, not the whole batch of %lld (pass --grad-accum 1 "
            "to keep them)\n",
            static_cast<long long>(k), static_cast<long long>(batch / k),
            name.empty() ? "the model" : name.c_str(), static_cast<long long>(batch));
        break;
      }
  std::fflush(stdout);
  return plan.chosen.candidate;
}

inline std::string fmt_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} {}", b, units[u]) : fmt::format("{:.1f} {}", b, units[u]);
}

// --memory-limit SIZE: the most the device's allocator may reserve
// (set_per_process_memory_fraction), so that a run stops with out-of-memory where a smaller
// device would; on the CPU, the out-of-memory report without a GPU. A real run's flag: a
// dry run (--estimate) replays its target's capacity.
inline void apply_memory_limit(const std::string& limit, Device device) {
  if (limit.empty()) return;
  if (device.is_meta())
    throw std::invalid_argument(
        "--memory-limit caps a real run's device; --estimate predicts for its target's capacity");
  const size_t bytes = memory::parse_bytes(limit, "--memory-limit");
  const size_t total = memory::get_allocator(device).provider().total_memory();
  if (bytes == 0 || bytes > total)
    throw std::invalid_argument(
        fmt::format("--memory-limit {}: must be more than 0 and at most {}'s "
                    "memory ({} bytes)",
                    limit, device.str(), total));
  memory::set_per_process_memory_fraction(static_cast<double>(bytes) / static_cast<double>(total),
                                          device);
}

// What the out-of-memory report varies: the run's checkpointing, precision and offload (a
// planner candidate) and its batch.
struct RunShape {
  nn::PlanCandidate plan;
  int64_t batch = 0;
};

// After a real run stopped with out-of-memory on `device`: prints the error ("PROGRAM: ...",
// naming the oom_snapshot file when TALLY_ALLOC_CONF sets one), then what would fit,
// predicted by dry runs (memory/estimate.h) of the run and a few variations of it
// (--checkpoint blocks, --amp bf16 where it was off, both, and halving --batch, up to three
// times, until one fits) against the memory the run may reserve (the device's, or
// --memory-limit's):
//   with --checkpoint blocks the predicted peak is 61.2 GiB (fits in 80.0 GiB)
// A predicted peak is the dry run's peak reserved plus `held`, what the program held on the
// device before it built the model (the datasets of a CPU run). `dry_run(device, shape)` trains
// kEstimateSteps steps of `shape` and the evaluation after them on a meta device the way the
// program does. Never throws; returns kExitOutOfMemory.
inline int report_out_of_memory(const std::string& program, const memory::OutOfMemoryError& error,
                                Device device, const RunShape& run, size_t held,
                                const std::function<void(Device, const RunShape&)>& dry_run) {
  std::fflush(stdout);
  fmt::print(stderr, "{}: {}\n", program, error.what());
  try {
    const size_t limit = memory::get_allocator(device).memory_cap();
    const std::string target = device.type == DeviceType::cuda ? "cuda" : "cpu";
    const std::string room = fmt_bytes(static_cast<double>(limit));
    fmt::print(stderr, "what would fit on {} (peak reserved, predicted by dry runs on '{}'):\n",
               device.str(), target);
    // One line per variation; true when it is predicted to fit. The dry run replays the cap
    // too (its device holds what the run may reserve past `held`): near the cap the allocator
    // frees its cache and retries, and a request of 1 to 10 MiB takes a 20 MiB segment, so a run
    // whose uncapped peak is under the cap can still run out of memory.
    const size_t room_left = limit > held ? limit - held : 0;
    auto predict = [&](const std::string& flags, const RunShape& shape) {
      const std::string with = flags.empty() ? "as run," : "with " + flags;
      try {
        if (room_left == 0)
          throw std::runtime_error("the program's own data fills the cap before the model");
        memory::DryRun dry({.target = target, .capacity = room_left, .max_history = 0});
        std::string oom;
        try {
          dry_run(dry.device(), shape);
        } catch (const memory::OutOfMemoryError& e) {
          oom = e.what();
        }
        const memory::Estimate e = dry.finish(oom);
        const size_t peak = static_cast<size_t>(e.peak_reserved) + held;
        const bool fits = e.fits() && peak <= limit;
        fmt::print(stderr, "  {} the predicted peak is {}{} ({} in {})\n", with,
                   e.fits() ? "" : "over ", fmt_bytes(static_cast<double>(peak)),
                   fits ? "fits" : "does not fit", room);
        return fits;
      } catch (const std::exception& e) {
        fmt::print(stderr, "  {}: no prediction ({})\n", with, e.what());
      }
      return false;
    };
    predict("", run);
    const bool blocks = run.plan.checkpoint.kind == nn::CheckpointSpec::Kind::blocks &&
                        run.plan.checkpoint.blocks == 0;
    RunShape shape = run;
    shape.plan.checkpoint = nn::parse_checkpoint_spec("blocks");
    if (!blocks) predict("--checkpoint blocks", shape);
    if (!run.plan.amp) {
      shape = run;
      shape.plan.amp = DType::bfloat16;
      predict("--amp bf16", shape);
      shape.plan.checkpoint = nn::parse_checkpoint_spec("blocks");
      if (!blocks) predict("--checkpoint blocks --amp bf16", shape);
    }
    shape = run;
    for (int tries = 0; tries < 3 && shape.batch > 1; ++tries) {
      shape.batch /= 2;
      if (predict(fmt::format("--batch {}", shape.batch), shape)) break;
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "  (no prediction: {})\n", e.what());
  } catch (...) {
    fmt::print(stderr, "  (no prediction)\n");
  }
  std::fflush(stderr);
  return kExitOutOfMemory;
}

// --cuda-graphs: what a replayed step cannot do, named before any work (tensor/cuda/graph.h).
// `estimate` is the --estimate target (a dry run has no device to capture on).
inline void check_cuda_graphs(bool on, const std::string& device, const std::string& estimate,
                              const std::string& /*amp*/, const std::string& offload,
                              bool step_in_backward, const std::string& optimizer) {
  if (!on) return;
  if (!estimate.empty())
    throw std::invalid_argument(
        "--cuda-graphs with --estimate: a dry run has no device to capture on; leave one out");
  if (device != "cuda")
    throw std::invalid_argument(
        fmt::format("--cuda-graphs captures CUDA work: it needs --device cuda, not {}", device));
  if (offload != "none")
    throw std::invalid_argument(
        "--cuda-graphs with --offload: the copies are fenced by the host; use --offload none");
  if (step_in_backward)
    throw std::invalid_argument(
        "--cuda-graphs with --step-in-backward: the hooks step from the host; leave one out");
  if (optimizer == "adamw8bit")
    throw std::invalid_argument(
        "--cuda-graphs with --optimizer adamw8bit: its step count stays on the host; use adamw");
  if (optimizer.ends_with(":cpu"))
    throw std::invalid_argument(fmt::format(
        "--cuda-graphs with --optimizer {}: its update runs on the host; use adamw", optimizer));
}

// --cuda-graphs: the training step (forward, backward, optimizer step; the caller's `step`) runs
// eagerly at the first call, is captured into a CUDA graph at the second and replayed from then
// on (tensor/cuda/graph.h). The step reads its inputs from tensors kept here, into which each
// call's inputs are copied (their shapes must not change); its outputs (the loss, the logits) are
// the graph's, overwritten by the next replay: read them before it. Disabled, it calls `step`.
class GraphedStep {
 public:
  using Step = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
  GraphedStep(bool enabled, Device device) : enabled_(enabled), device_(device) {}
  bool enabled() const { return enabled_; }
  std::vector<Tensor> operator()(const std::vector<Tensor>& inputs, const Step& step) {
    if (!enabled_) return step(inputs);
    if (statics_.empty()) {
      memory::CategoryScope input(memory::Category::input);
      for (const Tensor& t : inputs) statics_.push_back(ops::clone(t));
      return step(statics_);
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].sizes() != statics_[i].sizes() || inputs[i].dtype() != statics_[i].dtype())
        throw std::invalid_argument(fmt::format(
            "--cuda-graphs: the step's input {} is {} {}, the captured step's {} {}: a graph "
            "replays fixed shapes",
            i, dtype_name(inputs[i].dtype()), inputs[i].shape_string(),
            dtype_name(statics_[i].dtype()), statics_[i].shape_string()));
      ops::copy_(statics_[i], inputs[i]);
    }
    if (!graph_.captured()) graph_.capture([&] { outputs_ = step(statics_); }, device_.index);
    graph_.replay();
    return outputs_;
  }

 private:
  bool enabled_;
  Device device_;
  cuda::Graph graph_;
  std::vector<Tensor> statics_, outputs_;
};

// The offloader's totals as a line ("offload: 2.1 GiB a step to host memory, ..."); nothing
// for a run that does not offload.
inline void print_offload(const std::shared_ptr<ActivationOffloader>& offloader, int64_t steps) {
  if (!offloader || steps <= 0) return;
  const OffloadStats s = offloader->stats();
  const double n = static_cast<double>(steps);
  fmt::print(
      "offload: {} a step to host memory ({:.0f} tensors; {:.0f} prefetched, {:.0f} fetched on "
      "demand, {:.0f} saves kept on the device, {:.0f} saved twice and copied once)\n",
      fmt_bytes(static_cast<double>(s.bytes_offloaded) / n), s.tensors_offloaded / n,
      s.tensors_prefetched / n, s.tensors_fetched / n, s.tensors_kept / n,
      s.tensors_deduplicated / n);
}

// --detect-leaks: a inspect::LeakDetector on the run's device, told each step's end. A line
// found leaking gets a one-line warning when first found (on a line of its own after the
// progress bar); report() prints the detector's report at the end. Off, it does nothing.
class LeakCheck {
 public:
  LeakCheck(bool enabled, Device device, bool tty = false) : tty_(tty) {
    if (enabled) detector_.emplace(device);
  }
  bool enabled() const { return detector_.has_value(); }
  void step() {
    if (!detector_) return;
    for (const inspect::LeakingLine& l : inspect::group_by_line(detector_->step())) {
      if (!warned_.insert(l.location).second) continue;
      std::fprintf(stdout, "%swarning: memory leak: %s\n", tty_ ? "\n" : "", l.describe().c_str());
      std::fflush(stdout);
    }
  }
  void report() const {
    if (detector_) std::fputs(detector_->report().c_str(), stdout);
  }

 private:
  std::optional<inspect::LeakDetector> detector_;
  std::set<std::string> warned_;
  bool tty_;
};

// "step 12/100 [=====>    ] 00:41<05:01 | loss 0.4312 acc 86.2% | 41.3 ms/step | peak 1.2 GiB"
// Elapsed and estimated time left (mm:ss, or h:mm:ss) after the bar; on a terminal the line
// is redrawn in place and cleared to its end; done() ends it with the total time.
class Progress {
 public:
  explicit Progress(int64_t total, bool tty = true)
      : total_(total), tty_(tty), t0_(std::chrono::steady_clock::now()) {}
  void update(int64_t step, const std::string& metrics) {
    const int width = 24;
    const int filled =
        total_ > 0 ? static_cast<int>(width * std::min(step, total_) / total_) : width;
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < width) bar += '>' + std::string(static_cast<size_t>(width - filled - 1), ' ');
    const double elapsed = seconds();
    const double left = step > 0 && total_ > step ? elapsed * static_cast<double>(total_ - step) /
                                                        static_cast<double>(step)
                                                  : 0.0;
    std::fprintf(stdout, "%sstep %lld/%lld [%s] %s<%s | %s%s", tty_ ? "\r" : "",
                 static_cast<long long>(step), static_cast<long long>(total_), bar.c_str(),
                 clock(elapsed).c_str(), clock(left).c_str(), metrics.c_str(),
                 tty_ ? "\033[K" : "\n");
    std::fflush(stdout);
    last_step_ = step;
  }
  // Ends the line: "done: 400 steps in 01:12 (180.2 ms/step)".
  void done() {
    if (tty_) std::fputc('\n', stdout);
    const double elapsed = seconds();
    std::fprintf(stdout, "done: %lld steps in %s (%.1f ms/step)\n",
                 static_cast<long long>(last_step_), clock(elapsed).c_str(),
                 last_step_ > 0 ? 1000.0 * elapsed / static_cast<double>(last_step_) : 0.0);
    std::fflush(stdout);
  }
  // "00:41", "1:02:03".
  static std::string clock(double seconds) {
    const auto s = static_cast<long long>(std::max(0.0, seconds) + 0.5);
    if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
    return fmt::format("{:02}:{:02}", s / 60, s % 60);
  }

 private:
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  int64_t total_;
  bool tty_;
  std::chrono::steady_clock::time_point t0_;
  int64_t last_step_ = 0;
};

class Stopwatch {
 public:
  Stopwatch() : t0_(std::chrono::steady_clock::now()) {}
  double ms() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_)
        .count();
  }
  void reset() { t0_ = std::chrono::steady_clock::now(); }

 private:
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace tally::examples
