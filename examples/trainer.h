// examples::Trainer: what train_gpt and train_resnet share around their model and data: the
// common flags, the preflight (every flag and output path checked before any work), the
// planner (--checkpoint auto), the training step (written once: train_step), the progress bar
// and --metrics records, and the outputs at the end (offload totals, leak report, summary,
// snapshot), with a dry run's report (--estimate) and the out-of-memory report in their place.
//
//   ex::Trainer tr("train_x", flags);           // flags: ex::TrainFlags, filled by CLI11
//   tr.check_flags(app, {"sgd", "adamw"});       // then the program's own checks
//   tr.start();                                  // outputs checked, seed, history
//   return tr.run(shape, dry_steps, [&] { ...; tr.begin(*opt, total); loop { tr.step(...);
//                                           if (tr.end_step(...)) tr.log(...); } ... });
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <source_location>
#include <string>
#include <vector>

#include "examples/cli_common.h"
#include "examples/metrics_log.h"
#include "examples/train_common.h"
#include "nn/checkpoint.h"
#include "optim/lr_scheduler.h"

namespace tally::examples {

// The flags every training program has (a program sets its own defaults before parsing).
struct TrainFlags {
  std::string device = "cpu";
  std::string snapshot;
  std::string metrics;  // --metrics FILE.jsonl
  bool summary = false;
  uint64_t seed = 0;
  std::string checkpoint = "none";
  std::string amp = "off";
  std::string offload = "none";
  std::string optimizer;
  bool step_in_backward = false;
  bool overlap_update = false;  // --overlap-update: CpuOffload::overlap_with_forward
  int64_t grad_accum = 1;       // --grad-accum: micro-batches per optimizer step
  bool cuda_graphs = false;
  bool detect_leaks = false;
  double lr = 0;
  double weight_decay = 0;
  double clip = 0;  // train_gpt's --clip; 0: off
  int64_t log_every = 10;
  std::string estimate;       // a dry run's target: predict memory instead of training
  std::string host_memory;    // the dry run's host memory for its host check ("": this host's)
  std::string memory_budget;  // --checkpoint auto: the planner's budget
  std::string memory_limit;   // caps what the device may reserve
};

// --snapshot, --summary, --metrics, --detect-leaks, --seed, the memory flags, --grad-accum and
// --memory-limit, in this order (--help lists them so).
void add_output_flags(CLI::App& app, TrainFlags& f, const std::string& metrics_help,
                      const std::string& seed_help);
// The token models' programs (train_gpt, train_model): AdamW's defaults (lr 1e-3, weight decay
// 0.1, clipping at 1), then --batch, --steps, --lr, --weight-decay, --clip, --device and the
// output flags, in this order.
void add_token_model_flags(CLI::App& app, TrainFlags& f, int64_t& batch, int64_t& steps,
                           const std::string& weight_decay_help);
// Their --step-in-backward, then --cuda-graphs (`cuda_graphs_help`).
void add_token_step_flags(CLI::App& app, TrainFlags& f, const std::string& cuda_graphs_help);
// Their --optimizer over `m`'s parameters: AdamW with betas (0.9, 0.95), SGD with momentum 0.9
// (capturable for --cuda-graphs).
std::unique_ptr<optim::Optimizer> make_token_model_optimizer(const TrainFlags& f, nn::Module& m);

// One training step, the only one of the programs: zero_grad, forward(in) under autocast
// (phase "forward"; it returns the loss first, then anything else the caller reads), backward,
// clipping to `clip` (0: off) and the optimizer step (Precision::backward_and_step). With
// `accum` > 1 micro-batches (gradient accumulation) the inputs are split into `accum` equal
// parts along their first dimension, each forwarded (phase "forward.K") and its loss, scaled
// by 1/accum, backpropagated ("backward.K") in turn, then one clipping and optimizer step; the
// loss returned is their sum (the batch's mean) and the other outputs are the micro-batches'
// joined along the first dimension, detached. Its allocations name the caller's line (`site`).
template <class Forward>
std::vector<Tensor> train_step(optim::Optimizer& opt, Precision& prec,
                               const std::vector<Tensor>& in, Forward&& forward, double clip = 0,
                               int64_t accum = 1,
                               std::source_location site = std::source_location::current()) {
  opt.zero_grad(true);
  if (accum <= 1) {
    std::vector<Tensor> out;
    {
      memory::PhaseScope phase("forward");
      auto guard = prec.autocast();
      out = forward(in);
    }
    prec.backward_and_step(out.at(0), opt, clip, site);
    return out;
  }
  const int64_t rows = in.at(0).dim() > 0 ? in.at(0).size(0) : 0;
  if (rows < accum || rows % accum != 0)
    throw std::invalid_argument(fmt::format(
        "--grad-accum {}: a batch of {} rows does not split into {} equal micro-batches", accum,
        rows, accum));
  const int64_t len = rows / accum;
  std::vector<std::vector<Tensor>> outs;
  for (int64_t k = 0; k < accum; ++k) {
    std::vector<Tensor> micro;
    for (const Tensor& t : in)
      micro.push_back(t.dim() > 0 && t.size(0) == rows ? ops::narrow(t, 0, k * len, len) : t);
    std::vector<Tensor> out;
    {
      memory::PhaseScope phase(fmt::format("forward.{}", k));
      auto guard = prec.autocast();
      out = forward(micro);
      out.at(0) = mul(out.at(0), 1.0 / static_cast<double>(accum));
    }
    {
      // The offloaded optimizer sends gradients once, after the last micro-batch's backward.
      auto* offload = dynamic_cast<optim::CpuOffload*>(&opt);
      std::optional<optim::CpuOffload::NoSyncGuard> no_sync;
      if (offload && k + 1 < accum) no_sync.emplace(*offload);
      prec.backward(out.at(0), fmt::format("backward.{}", k), site);
    }
    for (Tensor& t : out) t = t.detach();
    outs.push_back(std::move(out));
  }
  prec.step(opt, clip, site);
  NoGradGuard ng;
  std::vector<Tensor> out = outs.front();
  for (size_t k = 1; k < outs.size(); ++k) out[0] = add(out[0], outs[k][0]);
  for (size_t i = 1; i < out.size(); ++i) {
    if (out[i].dim() == 0) continue;
    std::vector<Tensor> parts;
    for (const auto& o : outs) parts.push_back(o.at(i));
    out[i] = cat(parts, 0);
  }
  return out;
}

// The peak allocated bytes reached by each phase's allocations ("forward.0", "backward.0", ...)
// on `device` since the last clear(), through the allocator's observer (chained to the one
// before it). Other allocators' events (the pinned host's) are passed on, not counted.
class PhasePeaks : public memory::AllocationObserver {
 public:
  explicit PhasePeaks(Device device) : device_(device), next_(memory::allocation_observer()) {
    memory::set_allocation_observer(this);
  }
  ~PhasePeaks() override { memory::set_allocation_observer(next_); }
  PhasePeaks(const PhasePeaks&) = delete;
  PhasePeaks& operator=(const PhasePeaks&) = delete;
  void on_allocation_event(const memory::AllocationEvent& e) override;
  void clear();
  // "forward.0 1.2 MiB, backward.0 2.3 MiB, ..." in order of first use.
  std::string str() const;

 private:
  Device device_;
  memory::AllocationObserver* next_;
  mutable std::mutex mu_;
  std::vector<std::pair<memory::StrId, size_t>> peaks_;
};

class Trainer {
 public:
  using Forward = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
  using DrySteps = std::function<void(Device, const RunShape&)>;

  Trainer(std::string program, TrainFlags& flags) : program_(std::move(program)), f_(flags) {}

  // Preflight, before any work: --cuda-graphs, --estimate, --device, --memory-limit, the
  // memory flags, --optimizer (one of `optimizers`), --step-in-backward (which sets --clip to
  // 0 when --clip was not given).
  void check_flags(const CLI::App& app, const std::vector<std::string>& optimizers);
  // Then: the output paths checked writable, the seed set, and with --snapshot the history
  // recorded from before the data and the model exist (memory_viz shows a block from before
  // the recording as `unknown`).
  void start();

  bool dry() const { return dry_ != nullptr; }
  int64_t grad_accum() const { return f_.grad_accum; }
  // --checkpoint auto: plan() will search. Build the meta model plan() takes only then: building
  // one draws from the default generator, which would change the real model's initialisation.
  bool planning() const { return auto_plan_.checkpoint_auto; }
  Device device() const { return dev_; }
  // The run's checkpointing, precision and offload: the flags', or the planner's choice.
  nn::CheckpointSpec checkpoint;
  std::optional<DType> amp;
  nn::OffloadSpec offload;

  // --checkpoint auto: the planner dry-runs each candidate (`dry_steps` with `batch`; its
  // checkpointing policies from `meta_model`, the model built on a meta device) over every
  // lever the flags leave free (--optimizer adamw may become adamw8bit, --step-in-backward,
  // --grad-accum; the fused classifier with `fused_lever`) and its choice becomes the run's,
  // the flags included; else nothing. Returns the choice (its classifier for GPT).
  std::optional<nn::PlanCandidate> plan(nn::Module& meta_model, const DrySteps& dry_steps,
                                        int64_t batch, std::vector<int64_t> classifier_chunks = {},
                                        bool fused_lever = false);
  // kEstimateSteps steps of train_step and the evaluation after them (`eval`, in eval mode,
  // without gradients, under autocast) for a dry run's device: `m` is already there. The
  // candidate's optimizer, step-in-backward and micro-batches where it sets them, else the
  // flags'.
  void dry_train(Device d, const nn::PlanCandidate& c, nn::Module& m,
                 const std::function<std::unique_ptr<optim::Optimizer>(nn::Module&)>& make_opt,
                 const std::function<std::vector<Tensor>()>& make_inputs, const Forward& forward,
                 const std::function<void(const std::vector<Tensor>&)>& eval) const;

  // body() (the model, the loop, the outputs); out of memory: the error and what would fit
  // (a real run, `shape` and `dry_steps` vary it) or the dry run's report. Returns the status.
  int run(const RunShape& shape, const DrySteps& dry_steps, const std::function<int()>& body);

  // The training of `model` (on the run's device) set up: the run's checkpointing and
  // activation offload, then `make_opt`'s optimizer, a warm-up cosine schedule over `total`
  // steps (warm-up: total / `warmup_div` steps, at least 1 and fewer than all; down to
  // lr * `min_lr_factor`) and begin().
  struct Training {
    std::shared_ptr<ActivationOffloader> offloader;  // null when nothing is offloaded
    std::unique_ptr<optim::Optimizer> opt;
    std::unique_ptr<optim::WarmupCosineLR> sched;
  };
  Training prepare(nn::Module& model,
                   const std::function<std::unique_ptr<optim::Optimizer>(nn::Module&)>& make_opt,
                   int64_t total, int64_t warmup_div, double min_lr_factor);
  // "checkpoint none, amp fp32[, offload ...][, CUDA graphs]" for the program's first line.
  std::string describe() const;
  // The precision, the graphed step, the progress bar, --metrics and --detect-leaks of a
  // loop of `total` steps of `opt`.
  void begin(optim::Optimizer& opt, int64_t total);
  Precision& precision() { return *prec_; }
  // train_step on `in`, captured and replayed with --cuda-graphs (outputs overwritten by the
  // next step: read them before it).
  std::vector<Tensor> step(const std::vector<Tensor>& in, const Forward& forward,
                           std::source_location site = std::source_location::current());
  // After each step: the loss summed on the device (no sync), the leak check. True when
  // `step` is one to log (every --log-every and the last; never on a dry run).
  bool end_step(int64_t step, const Tensor& loss);
  // At a logged step: the window's mean loss (one sync) and time per step; the window restarts.
  struct Window {
    int64_t steps = 0;
    double loss = 0;
    double ms = 0;
  };
  Window read_window();
  // A --metrics record (`record` plus the step, the window's loss and ms, lr and peaks) and
  // the progress line (`text` plus the peak allocated).
  void log(int64_t step, const Window& w, nlohmann::json record, const std::string& text);
  // After the loop: a dry run's report and its exit status (after `dry_eval`, the program's
  // evaluation on the dry run's device, its phase "eval"); else the progress bar's end.
  std::optional<int> end_training(const std::function<void()>& dry_eval = {});
  // "peak allocated 1.2 MiB, peak reserved 2.0 MiB"
  std::string peaks() const;
  void write_metrics(const nlohmann::json& record) { metrics_->write(record); }
  // The end: offload totals, the leak report, `extra` (e.g. a text sample), memory_summary()
  // and the snapshot. Returns 0.
  int finish(const std::shared_ptr<ActivationOffloader>& offloader, int64_t steps,
             const std::function<void()>& extra = {});

 private:
  std::string program_;
  TrainFlags& f_;
  std::unique_ptr<memory::DryRun> dry_;
  Device dev_ = Device::cpu();
  AutoPlan auto_plan_;
  bool clip_given_ = false;  // --clip on the command line: step-in-backward stays off
  // The first input of the last dry_train (what a row of the batch is, for plan()'s output).
  mutable Shape dry_input_shape_;
  mutable DType dry_input_dtype_ = DType::float32;
  optim::Optimizer* opt_ = nullptr;
  int64_t total_ = 0;
  std::unique_ptr<Precision> prec_;
  std::unique_ptr<GraphedStep> graphed_;
  std::unique_ptr<Progress> bar_;
  std::unique_ptr<MetricsLog> metrics_;
  std::unique_ptr<LeakCheck> leak_check_;
  std::unique_ptr<PhasePeaks> phase_peaks_;  // --grad-accum: each micro-batch's peak
  Stopwatch clock_;
  Tensor loss_acc_;
  int64_t window_ = 0;
  // --offload link: the model prepare() left for the first step() to measure (its forward on
  // the first batch, nn::offload_activations), and the offloader it chose.
  nn::Module* link_model_ = nullptr;
  std::shared_ptr<ActivationOffloader> link_offloader_;
};

// A training program's main: run_cli over `app` (its flags filling `flags`), with a Trainer of
// `program` whose common flags are checked first (check_flags, `optimizers` its --optimizer
// choices) for `body(trainer)`, which returns the exit status.
template <class Body>
int run_trainer(const std::string& program, CLI::App& app, TrainFlags& flags, int argc, char** argv,
                const std::vector<std::string>& optimizers, Body&& body) {
  return run_cli(program, app, argc, argv, [&] {
    // ---- everything is checked before the first step ----
    Trainer tr(program, flags);
    tr.check_flags(app, optimizers);
    return body(tr);
  });
}

}  // namespace tally::examples
