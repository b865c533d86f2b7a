// examples::Trainer (trainer.h): the preflight, planner, step, progress and outputs of the
// training programs.
#include "examples/trainer.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "examples/cli_common.h"
#include "memory/host_memory.h"
#include "nn/module.h"
#include "optim/cpu_offload.h"

namespace tally::examples {

void add_output_flags(CLI::App& app, TrainFlags& f, const std::string& metrics_help,
                      const std::string& seed_help) {
  app.add_option("--snapshot", f.snapshot, "write a memory_viz snapshot of the run to FILE");
  app.add_flag("--summary", f.summary, "print memory_summary() at the end");
  app.add_option("--metrics", f.metrics, metrics_help);
  app.add_flag("--detect-leaks", f.detect_leaks,
               "report allocations that survive each step and grow, by source line "
               "(inspect::LeakDetector)");
  add_checked_option(app, "--seed", f.seed, seed_help, seed_value());
  add_memory_options(app, f.checkpoint, f.amp, f.memory_budget, f.estimate, f.offload);
  app.add_option("--host-memory", f.host_memory,
                 "with --estimate: the host memory the target will have, which the host's peak "
                 "(pinned optimizer state, offloaded activations) must fit (128GiB, ...; default: "
                 "this machine's)");
  app.add_flag("--overlap-update", f.overlap_update,
               "with a host optimizer (adamw:cpu, adamw8bit:cpu): the updates not done when the "
               "last gradient reaches the host wait for the next forward, each layer's run as "
               "the forward reaches it, overlapped with the forward of the layers before it; "
               "--clip's coefficient is folded into them (no gradient sent twice)");
  add_checked_option(app, "--grad-accum", f.grad_accum,
                     "micro-batches per optimizer step: the batch split into N, N forwards and "
                     "backwards (losses scaled by 1/N), one optimizer step",
                     int_range(1, 1 << 20));
  app.add_option("--memory-limit", f.memory_limit,
                 "cap what the device may reserve (6GiB, 900MiB, ...): past it the run stops with "
                 "out-of-memory and reports what would fit");
}

void add_token_model_flags(CLI::App& app, TrainFlags& f, int64_t& batch, int64_t& steps,
                           const std::string& weight_decay_help) {
  f.optimizer = "adamw";
  f.lr = 1e-3;
  f.weight_decay = 0.1;
  f.clip = 1.0;
  add_checked_option(app, "--batch", batch, "batch size", int_range(1));
  add_checked_option(app, "--steps", steps, "training steps", int_range(1));
  add_checked_option(app, "--lr", f.lr, "peak learning rate (linear warm-up, cosine decay)",
                     positive_real());
  add_checked_option(app, "--weight-decay", f.weight_decay, weight_decay_help, non_negative_real());
  add_checked_option(app, "--clip", f.clip, "gradient clipping norm (0: off)", non_negative_real());
  app.add_option("--device", f.device, "cpu | cuda")->capture_default_str();
  add_output_flags(
      app, f, "write one JSON record per logged step (and the validation) to FILE.jsonl", "seed");
}

void add_token_step_flags(CLI::App& app, TrainFlags& f, const std::string& cuda_graphs_help) {
  app.add_flag("--step-in-backward", f.step_in_backward,
               "update each parameter as soon as its gradient is ready and free the gradient "
               "(needs --clip 0, the default with it; not with --amp fp16)");
  app.add_flag("--cuda-graphs", f.cuda_graphs, cuda_graphs_help);
}

std::unique_ptr<optim::Optimizer> make_token_model_optimizer(const TrainFlags& f, nn::Module& m) {
  return make_optimizer(
      f.optimizer, m.parameters(),
      {.lr = f.lr,
       .beta1 = 0.9,
       .beta2 = 0.95,
       .eps = 1e-8,
       .weight_decay = f.weight_decay,
       .capturable = f.cuda_graphs},
      {.lr = f.lr, .momentum = 0.9, .weight_decay = f.weight_decay, .capturable = f.cuda_graphs});
}

void Trainer::check_flags(const CLI::App& app, const std::vector<std::string>& optimizers) {
  // Before the device is parsed: what --cuda-graphs cannot do is the first thing said.
  check_cuda_graphs(f_.cuda_graphs, f_.device, f_.estimate, f_.amp, f_.offload, f_.step_in_backward,
                    f_.optimizer);
  dry_ = make_dry_run(f_.estimate, app.count("--device") > 0, f_.host_memory);
  dev_ = dry_ ? dry_->device() : parse_device(f_.device);
  apply_memory_limit(f_.memory_limit, dev_);
  auto_plan_ = parse_auto_plan(f_.checkpoint, f_.amp, f_.memory_budget, f_.offload);
  offload = auto_plan_.offload;
  amp = auto_plan_.amp_auto ? std::nullopt : parse_amp(f_.amp);
  checkpoint =
      auto_plan_.checkpoint_auto ? nn::CheckpointSpec{} : nn::parse_checkpoint_spec(f_.checkpoint);
  check_optimizer(f_.optimizer, optimizers);
  // The planner may pick a host optimizer; a given one must be one.
  if (f_.overlap_update && !auto_plan_.checkpoint_auto && !f_.optimizer.ends_with(":cpu"))
    throw std::invalid_argument(fmt::format(
        "--overlap-update defers a host optimizer's updates: it needs --optimizer adamw:cpu or "
        "adamw8bit:cpu, got {}",
        f_.optimizer));
  const CLI::Option* clip = app.get_option_no_throw("--clip");
  clip_given_ = clip != nullptr && clip->count() > 0;
  if (f_.step_in_backward && !clip_given_) f_.clip = 0;  // clipping needs every gradient
  check_step_in_backward(f_.step_in_backward, f_.amp, f_.clip);
  if (f_.grad_accum > 1 && f_.step_in_backward)
    throw std::invalid_argument(
        fmt::format("--grad-accum {} with --step-in-backward: each parameter would step at every "
                    "micro-batch; leave one out",
                    f_.grad_accum));
  if (auto_plan_.checkpoint_auto) {
    // The levers a flag pins stay as given; the planner searches the others. AdamW's 8-bit
    // form keeps its hyperparameters; CUDA graphs take neither it nor step-in-backward.
    const bool graphs = f_.cuda_graphs;
    auto given = [&](const char* flag) { return app.count(flag) > 0; };
    auto_plan_.optimizers = {f_.optimizer};
    auto offered = [&](const char* o) {
      return std::find(optimizers.begin(), optimizers.end(), o) != optimizers.end();
    };
    if (f_.optimizer == "adamw" && !given("--optimizer") && !graphs && offered("adamw8bit"))
      auto_plan_.optimizers.push_back("adamw8bit");
    // On a GPU, the optimizer's placement too: AdamW with its state in host memory, and its
    // 8-bit form there (a 13B model's float32 moments outgrow a 128 GiB host; 8-bit ones fit).
    if (f_.optimizer == "adamw" && !given("--optimizer") && !graphs &&
        memory::behaves_as(dev_) == DeviceType::cuda)
      for (const char* host : {"adamw:cpu", "adamw8bit:cpu"})
        if (offered(host)) auto_plan_.optimizers.push_back(host);
    auto_plan_.step_in_backward = {f_.step_in_backward};
    if (!given("--step-in-backward") && !clip_given_ && !graphs && !given("--grad-accum"))
      auto_plan_.step_in_backward = {false, true};
    // Without --grad-accum: 1, 2, 4, ... micro-batches up to the batch, as the budget needs.
    auto_plan_.micro_batches = {f_.grad_accum};
    if (!given("--grad-accum") && !f_.step_in_backward) auto_plan_.micro_batches.clear();
    // The dry runs' host: --host-memory's (make_dry_run checked it), else this machine's.
    if (!f_.host_memory.empty())
      auto_plan_.host_memory = memory::parse_bytes(f_.host_memory, "--host-memory");
  }
}

namespace {
// --offload link on `m`: one forward of the first micro-batch of `in` (under `prec`'s
// autocast) measures what each block saves and the forward's time (nn/offload.h); the choice
// is printed.
std::shared_ptr<ActivationOffloader> offload_by_link(nn::Module& m, const nn::OffloadSpec& spec,
                                                     Precision& prec, const std::vector<Tensor>& in,
                                                     const Trainer::Forward& forward, int64_t accum,
                                                     bool print) {
  std::vector<Tensor> micro = in;
  const int64_t rows = !in.empty() && in[0].dim() > 0 ? in[0].size(0) : 0;
  if (accum > 1 && rows % accum == 0)
    for (Tensor& t : micro)
      if (t.dim() > 0 && t.size(0) == rows) t = ops::narrow(t, 0, 0, rows / accum);
  nn::LinkOffloadChoice choice;
  auto offloader = nn::offload_activations(
      m, spec, {},
      [&] {
        memory::PhaseScope phase("forward");
        auto guard = prec.autocast();
        forward(micro);
      },
      &choice);
  if (print) fmt::print("{}\n", choice.str());
  return offloader;
}

// A host optimizer (--optimizer adamw:cpu) under --amp bf16: the float32 masters are made from
// the float32 weights, then the device keeps bfloat16 weights, and so gets bfloat16 gradients:
// half the device memory of each, and half the bytes each way between device and host
// (optim/cpu_offload.h). Buffers (RoPE tables, batch-norm statistics) stay as they are.
// With --overlap-update, its updates wait for the next forward (overlap_with_forward).
void setup_host_optimizer(nn::Module& model, optim::Optimizer& opt, std::optional<DType> amp,
                          bool overlap_update) {
  auto* offload = dynamic_cast<optim::CpuOffload*>(&opt);
  if (offload == nullptr) return;
  if (amp == DType::bfloat16) offload->keep_16bit_weights(model);
  if (overlap_update) offload->overlap_with_forward(model);
}
}  // namespace

Trainer::Training Trainer::prepare(
    nn::Module& model,
    const std::function<std::unique_ptr<optim::Optimizer>(nn::Module&)>& make_opt, int64_t total,
    int64_t warmup_div, double min_lr_factor) {
  Training t;
  nn::enable_checkpointing(model, checkpoint);
  // --offload link measures the forward: at the first step, on its batch.
  link_model_ = offload.kind == nn::OffloadSpec::Kind::link ? &model : nullptr;
  if (!link_model_) t.offloader = nn::offload_activations(model, offload);
  t.opt = make_opt(model);
  setup_host_optimizer(model, *t.opt, amp, f_.overlap_update);
  // None for a 1-step run.
  const int64_t warmup = std::min<int64_t>(std::max<int64_t>(1, total / warmup_div), total - 1);
  t.sched = std::make_unique<optim::WarmupCosineLR>(*t.opt, warmup, total, f_.lr * min_lr_factor);
  begin(*t.opt, total);
  return t;
}

void PhasePeaks::on_allocation_event(const memory::AllocationEvent& e) {
  if (next_) next_->on_allocation_event(e);
  if (e.bytes <= 0 || e.retag || e.tag.phase == 0 || e.device_type != device_.type ||
      e.device_index != device_.index)
    return;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [phase, peak] : peaks_)
    if (phase == e.tag.phase) {
      peak = std::max(peak, e.total_allocated);
      return;
    }
  peaks_.emplace_back(e.tag.phase, e.total_allocated);
}

void PhasePeaks::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  peaks_.clear();
}

std::string PhasePeaks::str() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [phase, peak] : peaks_)
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", memory::interned(phase),
                       fmt_bytes(static_cast<double>(peak)));
  return out;
}

void Trainer::start() {
  if (!f_.snapshot.empty()) check_output_file(f_.snapshot, "--snapshot");
  if (!f_.metrics.empty()) check_output_file(f_.metrics, "--metrics");
  manual_seed(f_.seed);
  if (!f_.snapshot.empty() && !dry_) {
    memory::record_memory_history(true, 1000000, dev_);
    memory::record_pinned_host_memory(true, 1000000, dev_);  // the snapshot's host_segments
  }
}

std::optional<nn::PlanCandidate> Trainer::plan(nn::Module& meta_model, const DrySteps& dry_steps,
                                               int64_t batch,
                                               std::vector<int64_t> classifier_chunks,
                                               bool fused_lever) {
  if (!auto_plan_.checkpoint_auto) return std::nullopt;
  AutoPlan ap = auto_plan_;
  if (fused_lever) ap.fused_classifier = {false, true};
  const nn::PlanCandidate chosen = plan_run(
      ap, amp, dev_, meta_model, batch,
      [&](Device d, const nn::PlanCandidate& c) {
        dry_steps(d, {c, batch});
      },
      kEstimateSteps, std::move(classifier_chunks));
  // The step the plan keeps, its rows as the dry runs' inputs had them.
  const bool tokens = dry_input_shape_.size() == 2 && !is_floating(dry_input_dtype_);
  fmt::print("Step: {}\n", describe_step(batch, chosen.micro_batches,
                                         describe_rows(dry_input_shape_, dry_input_dtype_),
                                         tokens ? dry_input_shape_[1] : 0));
  std::fflush(stdout);
  checkpoint = chosen.checkpoint;
  amp = chosen.amp;
  offload = chosen.offload;
  f_.checkpoint = checkpoint.str();
  if (!chosen.optimizer.empty()) f_.optimizer = chosen.optimizer;
  f_.step_in_backward = chosen.step_in_backward;
  if (f_.step_in_backward) f_.clip = 0;  // searched only when --clip was not given
  f_.grad_accum = chosen.micro_batches;
  return chosen;
}

void Trainer::dry_train(
    Device d, const nn::PlanCandidate& c, nn::Module& m,
    const std::function<std::unique_ptr<optim::Optimizer>(nn::Module&)>& make_opt,
    const std::function<std::vector<Tensor>()>& make_inputs, const Forward& forward,
    const std::function<void(const std::vector<Tensor>&)>& eval) const {
  nn::enable_checkpointing(m, c.checkpoint);
  const bool link = c.offload.kind == nn::OffloadSpec::Kind::link;
  if (!link) nn::offload_activations(m, c.offload);
  // make_opt reads the flags' optimizer: the candidate's while it builds this one.
  std::unique_ptr<optim::Optimizer> o;
  {
    const std::string given = f_.optimizer;
    if (!c.optimizer.empty()) f_.optimizer = c.optimizer;
    try {
      o = make_opt(m);
    } catch (...) {
      f_.optimizer = given;
      throw;
    }
    f_.optimizer = given;
  }
  setup_host_optimizer(m, *o, c.amp, f_.overlap_update);
  Precision p(c.amp, d);
  if (c.step_in_backward || f_.step_in_backward) p.step_in_backward(*o);
  const int64_t accum = c.micro_batches > 1 ? c.micro_batches : f_.grad_accum;
  std::vector<Tensor> in;
  {
    memory::CategoryScope input(memory::Category::input);
    in = make_inputs();
  }
  if (!in.empty()) {  // what a row is, for the planner's printed step
    dry_input_shape_ = in.front().sizes();
    dry_input_dtype_ = in.front().dtype();
  }
  if (link) offload_by_link(m, c.offload, p, in, forward, accum, false);
  memory::dry_run_phase(d, "train");
  for (int64_t s = 0; s < kEstimateSteps; ++s) train_step(*o, p, in, forward, 0, accum);
  memory::dry_run_phase(d, "eval");
  // Then the evaluation the program runs after training: its blocks can need segments that
  // training left no room for (GPT-2 B16, 2 segments: about 100 MiB more after validation).
  // It reads grad_accum(): the candidate's micro-batches, as the run would have them.
  NoGradGuard ng;
  m.eval();
  auto guard = p.autocast();
  const int64_t given = f_.grad_accum;
  f_.grad_accum = accum;
  try {
    eval(in);
  } catch (...) {
    f_.grad_accum = given;
    throw;
  }
  f_.grad_accum = given;
}

int Trainer::run(const RunShape& shape, const DrySteps& dry_steps,
                 const std::function<int()>& body) {
  // What the program holds on the device before the model (the data on the CPU).
  const size_t held = dry_ ? 0 : memory::memory_allocated(dev_);
  try {
    return body();
  } catch (const memory::OutOfMemoryError& e) {
    // A real run: the error and what would fit. A dry run: its report, marked as not fitting.
    if (!dry_) return report_out_of_memory(program_, e, dev_, shape, held, dry_steps);
    return finish_dry_run(*dry_, e.what(), f_.snapshot, f_.summary);
  }
}

std::string Trainer::describe() const {
  return fmt::format(
      "checkpoint {}, amp {}{}{}{}", f_.checkpoint,
      prec_ ? prec_->name() : Precision(amp, dev_).name(),
      offload.enabled() ? ", offload " + offload.str() : std::string(),
      f_.grad_accum > 1 ? fmt::format(", {} micro-batches", f_.grad_accum) : std::string(),
      f_.cuda_graphs ? ", CUDA graphs" : "");
}

void Trainer::begin(optim::Optimizer& opt, int64_t total) {
  opt_ = &opt;
  total_ = total;
  prec_ = std::make_unique<Precision>(amp, dev_, f_.cuda_graphs);
  if (f_.step_in_backward) prec_->step_in_backward(opt);
  graphed_ = std::make_unique<GraphedStep>(f_.cuda_graphs, dev_);
  const bool tty = isatty(fileno(stdout));
  bar_ = std::make_unique<Progress>(total, tty);
  metrics_ = std::make_unique<MetricsLog>(dry_ ? std::string() : f_.metrics);
  leak_check_ = std::make_unique<LeakCheck>(f_.detect_leaks && !dry_, dev_, tty);
  if (dry_) dry_->phase("train");
  if (f_.grad_accum > 1) phase_peaks_ = std::make_unique<PhasePeaks>(dev_);
  clock_.reset();
  loss_acc_ = zeros({}, TensorOptions{}.with_device(dev_));
  window_ = 0;
}

std::vector<Tensor> Trainer::step(const std::vector<Tensor>& in, const Forward& forward,
                                  std::source_location site) {
  if (nn::Module* m = std::exchange(link_model_, nullptr))
    link_offloader_ = offload_by_link(*m, offload, *prec_, in, forward, f_.grad_accum, true);
  return (*graphed_)(in, [&](const std::vector<Tensor>& x) {
    if (phase_peaks_) phase_peaks_->clear();  // the last step's
    return train_step(*opt_, *prec_, x, forward, f_.clip, f_.grad_accum, site);
  });
}

bool Trainer::end_step(int64_t step, const Tensor& loss) {
  {
    NoGradGuard ng;
    loss_acc_ = add(loss_acc_, loss.detach().to(DType::float32));
  }
  ++window_;
  leak_check_->step();
  if (dry_) return false;  // no values to read
  return step % f_.log_every == 0 || step == total_;
}

Trainer::Window Trainer::read_window() {
  Window w;
  w.steps = window_;
  w.loss = loss_acc_.item() / static_cast<double>(window_);  // one sync per update
  memory::synchronize(dev_);
  w.ms = clock_.ms() / static_cast<double>(window_);
  if (dry_) dry_->phase("train");
  clock_.reset();
  loss_acc_ = zeros({}, TensorOptions{}.with_device(dev_));
  window_ = 0;
  return w;
}

void Trainer::log(int64_t step, const Window& w, nlohmann::json record, const std::string& text) {
  record["step"] = step;
  record["loss"] = w.loss;
  record["ms_per_step"] = w.ms;
  record["lr"] = opt_->get_lr();
  record["peak_allocated"] = memory::max_memory_allocated(dev_);
  record["peak_reserved"] = memory::max_memory_reserved(dev_);
  // The host side (a :cpu optimizer's pinned state, offloaded activations), where it has one.
  if (memory::CachingAllocator* host = memory::host_allocator(dev_)) {
    record["host_peak_allocated"] = host->max_memory_allocated();
    record["host_peak_reserved"] = host->max_memory_reserved();
  }
  metrics_->write(record);
  bar_->update(step,
               fmt::format("{} | peak {}", text,
                           fmt_bytes(static_cast<double>(memory::max_memory_allocated(dev_)))));
}

std::optional<int> Trainer::end_training(const std::function<void()>& dry_eval) {
  if (dry_) {
    // The estimate covers the whole program: the evaluation after training too.
    dry_->phase("eval");
    if (dry_eval) dry_eval();
    return finish_dry_run(*dry_, "", f_.snapshot, f_.summary);
  }
  bar_->done();
  return std::nullopt;
}

std::string Trainer::peaks() const {
  return fmt::format("peak allocated {}, peak reserved {}",
                     fmt_bytes(static_cast<double>(memory::max_memory_allocated(dev_))),
                     fmt_bytes(static_cast<double>(memory::max_memory_reserved(dev_))));
}

int Trainer::finish(const std::shared_ptr<ActivationOffloader>& offloader, int64_t steps,
                    const std::function<void()>& extra) {
  print_offload(offloader ? offloader : link_offloader_, steps);
  leak_check_->report();
  if (phase_peaks_) {
    const std::string peaks = phase_peaks_->str();
    phase_peaks_.reset();
    if (!peaks.empty())
      fmt::print("peak allocated by micro-batch phase (last step, {} micro-batches): {}\n",
                 f_.grad_accum, peaks);
  }
  if (extra) extra();
  write_memory_outputs(dev_, f_.summary, f_.snapshot);
  return 0;
}

}  // namespace tally::examples
