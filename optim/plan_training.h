// The memory planner for any model: nn::plan_memory(model_factory, loss_fn, batch, options)
// dry-runs (memory/estimate.h) the user's model and training step under every combination of
// the memory levers and returns the fastest predicted to fit the budget (nn/plan.h's cost
// model). The levers: checkpoint policies derived from the model's repeated module types
// (`type:T`, every other one, `+selective`), or its own plans (`N-blocks`, `N-segments`,
// `selective`) where it declares checkpoint blocks;
// precision; optimizer (AdamW / AdamW8bit); activation offload; step-in-backward; gradient
// accumulation with the same effective batch (micro-batches); the fused classifier where the
// factory builds one. The step is the planner's own (zero_grad, forward and loss under
// autocast per micro-batch, backward, one optimizer step), then `eval` in eval mode under
// no_grad: the estimate names each phase's peak (train, eval).
//
//   nn::TrainingPlanOptions o{.budget = memory::parse_bytes("40MiB")};
//   nn::MemoryPlan plan = nn::plan_memory(
//       [](const nn::PlanCandidate&) { return std::make_shared<MyNet>(); },
//       [](nn::Module& m, const std::vector<Tensor>& b) { return cross_entropy(m(b[0]), b[1]); },
//       {x, y}, o);
//   nn::apply_plan(*model, plan.chosen.candidate);   // then train with its other levers
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/module.h"
#include "nn/plan.h"
#include "optim/adam.h"
#include "optim/optimizer.h"

namespace tally::nn {

// Builds the model for a candidate (inside nn::BuildOnDevice of the dry run's device: build
// as usual, no .to()); a factory with a fused classifier reads candidate.fused_classifier.
using ModelFactory = std::function<std::shared_ptr<Module>(const PlanCandidate& candidate)>;
// The training loss of one (micro-)batch: forward and loss, on the model's device.
using LossFn = std::function<Tensor(Module& model, const std::vector<Tensor>& batch)>;
// The evaluation after training (eval mode, no gradients, under the candidate's autocast).
using EvalFn = std::function<void(Module& model, const std::vector<Tensor>& batch)>;

struct TrainingPlanOptions {
  std::string target = "cpu";  // memory::meta_target's names
  size_t budget = 0;           // bytes the run may reserve on the device (its peak reserved)
  // Each lever's values; empty: the default shown. Checkpoint policies: for a model that
  // declares checkpoint blocks, its own plans (nn::checkpoint_plans); else none, then for each
  // of the first two repeated composite module types T (repeated_module_types): type:T,
  // type:T/2 (4 or more of them) and type:T+selective.
  std::vector<CheckpointSpec> checkpoints;
  // {fp32, bf16}, and fp16 on a CUDA target.
  std::vector<std::optional<DType>> precisions;
  std::vector<std::string> optimizers = {"adamw", "adamw8bit"};
  // none, and on a CUDA target `type:T` for the first repeated type (or `activations` for a
  // model with blocks) and `link` (nn/offload.h), with no checkpointing and with the first
  // checkpointing policy (every block for a model with blocks).
  std::vector<OffloadSpec> offloads;
  std::vector<bool> step_in_backward = {false, true};
  // Micro-batches per step (gradient accumulation, the same batch per step). Empty: climb
  // micro_batch_ladder(batch) (1, 2, 4, ... up to the batch) for each candidate, one rung at a
  // time while it is over the budget and more can still bring it under: what no count changes
  // (parameters, gradients, optimizer state) plus one row's share of its activations and
  // temporaries fits, and its peak allocated fell at the last rung. More micro-batches of the
  // same levers only cost time, so none past the first that fits is dry-run. A list: each
  // count in it for every candidate (those that do not divide the batch are left out), so
  // that one search's candidates serve other budgets (choose_plan).
  std::vector<int64_t> micro_batches;
  // {false}: set {false, true} for a factory that builds a fused classifier on request.
  std::vector<bool> fused_classifier = {false};
  // The fused classifier's chunk budgets (nn::PlanOptions::classifier_chunks): the grid runs
  // with the first, a candidate just over the budget is tried again with the next ones.
  std::vector<int64_t> classifier_chunks;
  optim::AdamOptions adam = optim::AdamW::default_options();
  // Training steps per dry run (the time per step divides by it).
  int64_t steps = 3;
  EvalFn eval;  // the evaluation after training, if any
  // The host memory the run will have, which a candidate's host peak (a :cpu optimizer's
  // state, offloaded activations) must fit; 0: this machine's (nn::PlanOptions::host_memory).
  size_t host_memory = 0;
};

// The micro-batch counts the planner climbs for a batch of `batch` rows: 1, then from k the
// largest divisor of the batch in (k, 2k], else the smallest above k, up to the batch itself
// (32: 1, 2, 4, 8, 16, 32; 12: 1, 2, 4, 6, 12).
std::vector<int64_t> micro_batch_ladder(int64_t batch);

// The candidates plan_memory searches for `model` (built on a meta device by the caller);
// with options.micro_batches empty, each at 1 micro-batch (plan_memory climbs from there).
std::vector<PlanCandidate> training_plan_grid(Module& model, int64_t batch,
                                              const TrainingPlanOptions& options);

// How a program that trains its own way dry-runs a candidate: builds the model on `device` and
// trains options.steps steps with every lever of the candidate (checkpoint, precision,
// offload, optimizer, step-in-backward, micro-batches, fused classifier and its chunk).
using CandidateRun = std::function<void(Device device, const PlanCandidate& candidate)>;

// The planner over every lever for a program with its own training step (the example
// programs' --checkpoint auto, ab::run's checkpoint "auto"): the candidates of
// training_plan_grid(model, batch, options) (`model` built on a meta device), each dry-run by
// `run` on options.target; the fastest predicted to fit options.budget is chosen. Errors as
// the plan_memory below.
MemoryPlan plan_memory(Module& model, int64_t batch, const CandidateRun& run,
                       const TrainingPlanOptions& options);

// Dry-runs every candidate of training_plan_grid on options.target and chooses the fastest
// predicted to fit options.budget. `batch` (the step's inputs, any device: only shapes and
// dtypes are used) is split along dim 0 into micro-batches. Errors as nn::plan_memory's (a
// budget of 0, an unknown target, nothing fits: the smallest peak and what it is made of).
MemoryPlan plan_memory(const ModelFactory& model_factory, const LossFn& loss_fn,
                       const std::vector<Tensor>& batch, const TrainingPlanOptions& options);

// The planner's training step, as it is dry-run, for a real run of a candidate: `steps`
// steps of `batch` split into candidate.micro_batches (zero_grad, forward and loss under
// autocast, loss / micro_batches, backward; one optimizer step; fp16 with loss scaling), then
// `eval`. Checkpoint and offload are applied to `model` here. Returns the last step's loss
// (summed over the micro-batches).
Tensor train_candidate(Module& model, const PlanCandidate& candidate, const LossFn& loss_fn,
                       const std::vector<Tensor>& batch, int64_t steps,
                       const TrainingPlanOptions& options);

}  // namespace tally::nn
