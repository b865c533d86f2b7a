#include "optim/plan_training.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <vector>

#include "autograd/autocast.h"
#include "memory/context.h"
#include "memory/memory.h"
#include "nn/layers.h"
#include "optim/adamw8bit.h"
#include "optim/grad_scaler.h"
#include "optim/multi_tensor.h"
#include "optim/step_in_backward.h"
#include "tensor/meta/cost.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace tally::nn {
namespace {

std::unique_ptr<optim::Optimizer> make_optimizer(const std::string& name, Module& model,
                                                 const optim::AdamOptions& adam) {
  if (name == "adamw8bit") return std::make_unique<optim::AdamW8bit>(model.parameters(), adam);
  if (name.empty() || name == "adamw")
    return std::make_unique<optim::AdamW>(model.parameters(), adam);
  throw std::invalid_argument(
      fmt::format("plan_memory: optimizer '{}': expected adamw or adamw8bit", name));
}

}  // namespace

std::vector<int64_t> micro_batch_ladder(int64_t batch) {
  std::vector<int64_t> ladder;
  if (batch < 1) return ladder;
  ladder.push_back(1);
  for (int64_t k = 1; k < batch;) {
    int64_t next = 0;
    for (int64_t d = std::min(2 * k, batch); d > k; --d)
      if (batch % d == 0) {
        next = d;
        break;
      }
    if (next == 0)
      for (next = 2 * k + 1; batch % next != 0;) ++next;
    ladder.push_back(next);
    k = next;
  }
  return ladder;
}

std::vector<PlanCandidate> training_plan_grid(Module& model, int64_t batch,
                                              const TrainingPlanOptions& options) {
  const memory::MetaTarget target = memory::meta_target(options.target);
  std::vector<CheckpointSpec> checkpoints = options.checkpoints;
  std::vector<OffloadSpec> offloads = options.offloads;
  const auto repeated = repeated_module_types(model);
  const int blocks = checkpoint_block_count(model);
  if (checkpoints.empty()) {
    if (blocks > 0) {
      checkpoints = checkpoint_plans(blocks);
    } else {
      checkpoints.push_back(CheckpointSpec{});
      for (size_t i = 0; i < repeated.size() && i < 2; ++i) {
        const std::string type = repeated[i].first;
        checkpoints.push_back(parse_checkpoint_spec("type:" + type));
        if (repeated[i].second >= 4)
          checkpoints.push_back(parse_checkpoint_spec("type:" + type + "/2"));
        checkpoints.push_back(parse_checkpoint_spec("type:" + type + "+selective"));
      }
    }
  }
  // The checkpointing an offloading candidate is also tried with.
  const std::string offload_with =
      blocks > 0 ? "blocks" : checkpoints[std::min<size_t>(1, checkpoints.size() - 1)].str();
  std::vector<std::optional<DType>> precisions = options.precisions;
  if (precisions.empty()) {
    precisions = {std::nullopt, DType::bfloat16};
    if (target.type == DeviceType::cuda) precisions.push_back(DType::float16);
  }
  if (offloads.empty()) {
    offloads.push_back(OffloadSpec{});
    // Host offload from a CPU device moves nothing off it.
    if (target.type == DeviceType::cuda && (blocks > 0 || !repeated.empty()))
      offloads.push_back(parse_offload_spec(blocks > 0 ? std::string("activations")
                                                       : "type:" + repeated.front().first));
    // And what the host link can carry while the forward computes (nn/offload.h).
    if (target.type == DeviceType::cuda && (blocks > 0 || !repeated.empty()))
      offloads.push_back(parse_offload_spec("link"));
  }
  // Empty: every candidate at 1 micro-batch; plan_memory climbs the ladder from there.
  const std::vector<int64_t> micro_batches =
      options.micro_batches.empty() ? std::vector<int64_t>{1} : options.micro_batches;
  std::vector<PlanCandidate> grid;
  for (const bool fused : options.fused_classifier)
    for (const std::optional<DType>& amp : precisions)
      for (const std::string& opt : options.optimizers)
        for (const bool sib : options.step_in_backward)
          for (const int64_t mb : micro_batches) {
            if (mb < 1 || batch % mb != 0) continue;
            // Step-in-backward steps inside each backward: not with several backwards a step,
            // nor with fp16's loss scaling (optim/step_in_backward.h).
            if (sib && (mb > 1 || (amp && *amp == DType::float16))) continue;
            for (const OffloadSpec& off : offloads)
              for (const CheckpointSpec& ck : checkpoints) {
                // Offload with no checkpointing, or with the first policy's checkpoints.
                if (off.enabled() && ck.kind != CheckpointSpec::Kind::none &&
                    ck.str() != offload_with)
                  continue;
                PlanCandidate c;
                c.checkpoint = ck;
                c.amp = amp;
                c.offload = off;
                c.optimizer = opt;
                c.step_in_backward = sib;
                c.micro_batches = mb;
                c.fused_classifier = fused;
                c.classifier_chunk_bytes =
                    options.classifier_chunks.empty() ? 0 : options.classifier_chunks.front();
                grid.push_back(std::move(c));
              }
          }
  return grid;
}

Tensor train_candidate(Module& model, const PlanCandidate& c, const LossFn& loss_fn,
                       const std::vector<Tensor>& batch, int64_t steps,
                       const TrainingPlanOptions& options) {
  if (batch.empty()) throw std::invalid_argument("plan_memory: the batch has no tensors");
  const int64_t n = batch.front().dim() > 0 ? batch.front().size(0) : 1;
  if (c.micro_batches < 1 || n % c.micro_batches != 0)
    throw std::invalid_argument(fmt::format(
        "plan_memory: {} micro-batches do not divide the batch of {}", c.micro_batches, n));
  for (const Tensor& t : batch)
    if (t.dim() == 0 || t.size(0) != n)
      throw std::invalid_argument(fmt::format(
          "plan_memory: every batch tensor splits along dim 0 into micro-batches; got {} and {}",
          batch.front().shape_string(), t.shape_string()));
  enable_checkpointing(model, c.checkpoint);
  // `link` measures one forward of the first micro-batch (nn/offload.h).
  std::vector<Tensor> first;
  for (const Tensor& t : batch)
    first.push_back(c.micro_batches == 1 ? t : t.narrow(0, 0, n / c.micro_batches));
  const auto offloader = offload_activations(model, c.offload, {}, [&] {
    memory::PhaseScope phase("forward");
    AutocastGuard guard(batch.front().device().type, c.amp.value_or(DType::bfloat16),
                        c.amp.has_value());
    loss_fn(model, first);
  });
  const std::unique_ptr<optim::Optimizer> opt = make_optimizer(c.optimizer, model, options.adam);
  const bool fp16 = c.amp && *c.amp == DType::float16;
  if (c.step_in_backward && (fp16 || c.micro_batches > 1))
    throw std::invalid_argument(
        "plan_memory: step-in-backward cannot be combined with fp16 or micro-batches");
  optim::GradScaler scaler(optim::GradScalerOptions{.enabled = fp16});
  std::unique_ptr<optim::StepInBackward> sib;
  if (c.step_in_backward) sib = std::make_unique<optim::StepInBackward>(*opt);
  const Device device = batch.front().device();
  const int64_t mb = n / c.micro_batches;
  auto autocast = [&] {
    return AutocastGuard(device.type, c.amp.value_or(DType::bfloat16), c.amp.has_value());
  };
  Tensor last;
  model.train();
  for (int64_t s = 0; s < steps; ++s) {
    if (!sib) opt->zero_grad(true);
    Tensor total;
    for (int64_t i = 0; i < c.micro_batches; ++i) {
      std::vector<Tensor> part;
      for (const Tensor& t : batch)
        part.push_back(c.micro_batches == 1 ? t : t.narrow(0, i * mb, mb));
      Tensor loss;
      {
        memory::PhaseScope phase("forward");
        auto guard = autocast();
        loss = loss_fn(model, part);
        if (c.micro_batches > 1) loss = div(loss, static_cast<double>(c.micro_batches));
      }
      {
        memory::PhaseScope phase("backward");
        scaler.scale(loss).backward();
      }
      total = total.defined() ? add(total, loss.detach()) : loss.detach();
    }
    if (!sib) {
      scaler.step(*opt);
      scaler.update();
    }
    last = total;
  }
  if (options.eval) {
    memory::dry_run_phase(device, "eval");
    NoGradGuard ng;
    model.eval();
    auto guard = autocast();
    options.eval(model, batch);
    model.train();
  }
  return last;
}

namespace {

// `rates` with the CPU's measured time per element of the fused AdamW and AdamW8bit updates
// (once per process, over 1M float32 elements on an allocator of its own, as
// nn::calibrated_rates measures: nothing stays cached in the CPU's). The meta kernels charge
// an update the larger of it and its bytes: AdamW8bit's code-book search made its CPU step cost
// 2.6x AdamW's while its bytes are fewer, and the planner ranked it 2% cheaper (issue 51).
meta::Rates with_cpu_update_rates(meta::Rates rates, const memory::MetaTarget& target) {
  if (target.type != DeviceType::cpu || rates.bandwidth <= 0) return rates;
  static std::once_flag once;
  static double adam = 0, adam8 = 0;
  std::call_once(once, [] {
    constexpr int64_t n = int64_t{1} << 20;
    const optim::AdamW8bitHyper h8{
        .adam = {.lr = 1e-3, .weight_decay = 0.01, .decoupled = true, .step = 1}};
    memory::PrivateCpuAllocatorScope own_allocator;
    const int64_t blocks = n / h8.block_size;
    // Random values (from a generator of its own: the user's stream is untouched), so that the
    // update's code-book search costs what it does on real moments.
    Generator gen(51);
    const Device cpu = Device::cpu();
    const Tensor p = ops::randn({n}, DType::float32, cpu, &gen),
                 g = ops::randn({n}, DType::float32, cpu, &gen), m = ops::zeros({n}),
                 v = ops::zeros({n}), am = ops::zeros({blocks}), av = ops::zeros({blocks});
    const Tensor qm = ops::zeros({n}, DType::uint8), qv = ops::zeros({n}, DType::uint8);
    auto ptr = [](const Tensor& t) { return t.storage().data(); };
    optim::TensorLists l(Device::cpu(), DType::float32, 4);
    l.add({ptr(p), ptr(g), ptr(m), ptr(v)}, n);
    adam = best_seconds(3, 0.02, [&] { optim::fused_adam_(l, h8.adam); }) / static_cast<double>(n);
    optim::TensorLists l8(Device::cpu(), DType::float32, 6);
    l8.add({ptr(p), ptr(g), ptr(qm), ptr(qv), ptr(am), ptr(av)}, n);
    adam8 =
        best_seconds(3, 0.02, [&] { optim::fused_adamw8bit_(l8, h8); }) / static_cast<double>(n);
  });
  rates.adam_element_seconds = adam;
  rates.adamw8bit_element_seconds = adam8;
  return rates;
}

// Whether a candidate over `budget` with estimate `e` at `rows` rows a micro-batch can fit
// with more micro-batches (`below`: its estimate at the count before, if any). What is live at
// the peak splits into what no micro-batch count changes (parameters, gradients, optimizer
// state, inputs) and what grows with the micro-batch's rows (activations, temporaries), which
// one row cannot bring below its share per row: not when that floor is over the budget (or
// the host's, over its memory), nor when the peak allocated stopped falling.
bool more_micro_batches_can_help(const memory::Estimate& e,
                                 const std::optional<memory::Estimate>& below, size_t budget,
                                 int64_t rows) {
  using memory::Category;
  auto floor = [rows](const std::array<int64_t, memory::kNumCategories>& at) {
    int64_t kept = 0, scaled = 0;
    for (const Category c : memory::kAllCategories)
      (c == Category::activation || c == Category::temporary ? scaled : kept) +=
          at[static_cast<size_t>(c)];
    return kept + scaled / std::max<int64_t>(1, rows);
  };
  if (floor(e.at_peak) > static_cast<int64_t>(budget)) return false;
  if (!e.host_out_of_memory.empty() && floor(e.host_at_peak) > static_cast<int64_t>(e.host_memory))
    return false;
  // Peaks compare only between dry runs that completed on the device; allocated ones, as the
  // reserved can stay on a segment's size for a rung and fall at the next.
  if (below && below->out_of_memory.empty() && e.out_of_memory.empty() &&
      e.peak_allocated >= below->peak_allocated &&
      e.host_peak_allocated >= below->host_peak_allocated)
    return false;
  return true;
}

// What both planners check before any dry run: the budget, the steps, the target.
memory::MetaTarget check_plan_options(const TrainingPlanOptions& options) {
  if (options.budget == 0)
    throw std::invalid_argument("memory budget: 0 bytes (give one, e.g. 6GiB or 900MiB)");
  if (options.steps < 1)
    throw std::invalid_argument(fmt::format("plan_memory: {} steps", options.steps));
  const memory::MetaTarget target = memory::meta_target(options.target);
  if (options.budget > target.capacity)
    throw std::invalid_argument(
        fmt::format("memory budget {} B is larger than the {} target's memory ({} B)",
                    options.budget, target.name, target.capacity));
  return target;
}

}  // namespace

MemoryPlan plan_memory(Module& model, int64_t batch, const CandidateRun& run,
                       const TrainingPlanOptions& options) {
  if (!run) throw std::invalid_argument("plan_memory: no run function");
  if (batch < 1) throw std::invalid_argument(fmt::format("plan_memory: a batch of {}", batch));
  const memory::MetaTarget target = check_plan_options(options);
  // Every plan keeps the parameters on the device: a budget below them fails before any work.
  int64_t parameters = 0;
  for (const Tensor& p : model.parameters()) parameters += static_cast<int64_t>(p.nbytes());
  if (static_cast<int64_t>(options.budget) < parameters)
    throw std::invalid_argument(fmt::format(
        "memory budget {:.1f} MiB is below the model's parameters ({:.1f} MiB), which every "
        "plan keeps on {}: no plan can fit",
        static_cast<double>(options.budget) / 1048576.0,
        static_cast<double>(parameters) / 1048576.0, target.name));
  const std::vector<PlanCandidate> grid = training_plan_grid(model, batch, options);
  if (grid.empty())
    throw std::invalid_argument(fmt::format(
        "plan_memory: no candidate to search (no micro-batch count of {} divides the batch "
        "of {}, or a lever's list is empty)",
        fmt::join(options.micro_batches, ", "), batch));
  const meta::Rates rates = with_cpu_update_rates(calibrated_rates(target), target);
  auto dry_run = [&](const PlanCandidate& c) {
    return dry_run_grid(run, {c}, options.classifier_chunks, target, rates, options.steps,
                        options.budget, options.host_memory);
  };
  std::vector<PlannedCandidate> tried;
  if (!options.micro_batches.empty()) {
    tried = dry_run_grid(run, grid, options.classifier_chunks, target, rates, options.steps,
                         options.budget, options.host_memory);
    return choose_plan(std::move(tried), options.budget, target);
  }
  // Climb the ladder per candidate: a candidate over the budget at k micro-batches is tried
  // at the next count, until one fits or more cannot help.
  const std::vector<int64_t> ladder = micro_batch_ladder(batch);
  for (const PlanCandidate& first : grid) {
    PlanCandidate c = first;
    std::optional<memory::Estimate> below;  // the last rung's estimate
    for (size_t rung = 0;; ++rung) {
      std::vector<PlannedCandidate> runs = dry_run(c);
      const bool fits =
          std::any_of(runs.begin(), runs.end(), [](const PlannedCandidate& p) { return p.fits; });
      const bool rejected = !runs.front().error.empty();
      const memory::Estimate e = runs.front().estimate;
      for (PlannedCandidate& p : runs) tried.push_back(std::move(p));
      if (fits || rejected || c.step_in_backward || rung + 1 >= ladder.size() ||
          !more_micro_batches_can_help(e, below, options.budget, batch / c.micro_batches))
        break;
      below = e;
      c.micro_batches = ladder[rung + 1];
    }
  }
  return choose_plan(std::move(tried), options.budget, target);
}

MemoryPlan plan_memory(const ModelFactory& model_factory, const LossFn& loss_fn,
                       const std::vector<Tensor>& batch, const TrainingPlanOptions& options) {
  if (!model_factory) throw std::invalid_argument("plan_memory: no model factory");
  if (!loss_fn) throw std::invalid_argument("plan_memory: no loss function");
  const memory::MetaTarget target = check_plan_options(options);
  if (batch.empty() || batch.front().dim() == 0)
    throw std::invalid_argument("plan_memory: the batch needs a tensor with a batch dimension");
  // The candidates come from the model's modules: one built on a meta device.
  memory::DryRun probe({.spec = target, .max_history = 0});
  std::shared_ptr<Module> probe_model;
  {
    BuildOnDevice on(probe.device());
    probe_model = model_factory(PlanCandidate{});
  }
  if (!probe_model) throw std::invalid_argument("plan_memory: the model factory returned no model");
  auto run = [&](Device d, const PlanCandidate& c) {
    std::shared_ptr<Module> model;
    {
      BuildOnDevice on(d);
      model = model_factory(c);
    }
    std::vector<Tensor> in;
    {
      memory::CategoryScope input(memory::Category::input);
      for (const Tensor& t : batch) in.push_back(ops::empty(t.sizes(), t.dtype(), d));
    }
    memory::dry_run_phase(d, "train");
    train_candidate(*model, c, loss_fn, in, options.steps, options);
  };
  return plan_memory(*probe_model, batch.front().size(0), run, options);
}

}  // namespace tally::nn
