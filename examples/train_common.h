// What the training programs share: the --checkpoint / --amp / --device flags, a training
// step that applies them (autocast region, GradScaler for fp16, phases for the history),
// a one-line progress bar, and byte formatting.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "memory/estimate.h"
#include "memory/memory.h"
#include "nn/plan.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"

namespace tally::examples {

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
// (memory/estimate.h) for this many steps (the peak of a training run is reached by its
// second step, once the optimizer state exists), print the prediction and stop.
inline constexpr int64_t kEstimateSteps = 3;

// The dry run for --estimate (none when the flag is empty). --device names where a real run
// goes, so the two together are an error.
inline std::unique_ptr<memory::DryRun> make_dry_run(const std::string& target, bool device_given) {
  if (target.empty()) return nullptr;
  if (device_given)
    throw std::invalid_argument(
        "--estimate: it predicts a run on its target device (cpu, h200, cuda): leave out "
        "--device");
  try {
    return std::make_unique<memory::DryRun>(memory::EstimateOptions{.target = target});
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
  return e.fits() ? 0 : 3;
}

// --checkpoint auto --memory-budget SIZE [--amp auto]: the memory planner (nn/plan.h) picks
// the checkpointing plan (and precision, with --amp auto) for the run's device, or for the
// --estimate target, and prints its grid. `run` dry-runs one candidate the way the program
// trains. Errors name the flag.
struct AutoPlan {
  bool checkpoint_auto = false;
  bool amp_auto = false;
  size_t budget = 0;
};
inline AutoPlan parse_auto_plan(const std::string& checkpoint, const std::string& amp,
                                const std::string& budget) {
  AutoPlan p;
  p.checkpoint_auto = checkpoint == "auto";
  p.amp_auto = amp == "auto";
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

// The planner's choice, its grid printed. `device` is the run's (a dry run's meta device for
// --estimate: its target is planned for).
inline nn::PlanCandidate plan_run(
    const AutoPlan& ap, std::optional<DType> amp, Device device, int blocks,
    const std::function<void(Device, const nn::PlanCandidate&)>& run) {
  nn::PlanOptions o;
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
  nn::MemoryPlan plan;
  try {
    plan = nn::plan_memory(run, blocks, o);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("--memory-budget: {}", e.what()));
  }
  std::fputs(plan.report().c_str(), stdout);
  std::fflush(stdout);
  return plan.chosen.candidate;
}

// --amp off|fp16|bf16: the autocast dtype (nullopt: off).
inline std::optional<DType> parse_amp(const std::string& s) {
  if (s == "off" || s == "none" || s == "fp32") return std::nullopt;
  if (s == "fp16") return DType::float16;
  if (s == "bf16") return DType::bfloat16;
  throw std::invalid_argument(fmt::format("--amp: expected off, fp16 or bf16, got '{}'", s));
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

// Mixed precision for one training loop: an autocast region around the forward and, for
// fp16, dynamic loss scaling.
class Precision {
 public:
  Precision(std::optional<DType> amp, Device device)
      : amp_(amp),
        device_(device),
        scaler_(optim::GradScalerOptions{.enabled = amp && *amp == DType::float16}) {}

  bool enabled() const { return amp_.has_value(); }
  std::optional<DType> dtype() const { return amp_; }
  std::string name() const { return !amp_ ? "fp32" : (*amp_ == DType::float16 ? "fp16" : "bf16"); }
  // The autocast guard for a forward (disabled when amp is off).
  AutocastGuard autocast() const {
    return AutocastGuard(device_.type, amp_.value_or(DType::bfloat16), amp_.has_value());
  }
  // backward (scaled for fp16) + optimizer step (skipped on inf/NaN for fp16).
  void backward_and_step(const Tensor& loss, optim::Optimizer& opt) {
    {
      memory::PhaseScope phase("backward");
      scaler_.scale(loss).backward();
    }
    scaler_.step(opt);
    scaler_.update();
  }
  optim::GradScaler& scaler() { return scaler_; }

 private:
  std::optional<DType> amp_;
  Device device_;
  optim::GradScaler scaler_;
};

// "step 12/100 [=====>    ] loss 0.4312 acc 86.2% | 41.3 ms/step | peak 1.2 GiB"
class Progress {
 public:
  explicit Progress(int64_t total, bool tty = true) : total_(total), tty_(tty) {}
  void update(int64_t step, const std::string& metrics) {
    const int width = 24;
    const int filled = total_ > 0 ? static_cast<int>(width * step / total_) : width;
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < width) bar += '>' + std::string(static_cast<size_t>(width - filled - 1), ' ');
    std::fprintf(stdout, "%sstep %lld/%lld [%s] %s", tty_ ? "\r" : "", static_cast<long long>(step),
                 static_cast<long long>(total_), bar.c_str(), metrics.c_str());
    if (!tty_) std::fputc('\n', stdout);
    std::fflush(stdout);
  }
  void done() {
    if (tty_) std::fputc('\n', stdout);
  }

 private:
  int64_t total_;
  bool tty_;
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
