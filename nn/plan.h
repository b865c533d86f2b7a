// The memory planner: which checkpointing plan (and, when allowed, which precision) makes a
// training run fit a memory budget at the least cost in time. Every candidate is dry-run on
// the target (memory/estimate.h), so its memory is the allocator's own prediction: peaks,
// caching, workspaces. Its time comes from a cost model: each op's FLOPs and bytes, counted by
// the meta kernels during the dry run, over the target's rates (tensor/meta/cost.h; the CPU
// target's are measured by a short timed run). The fastest candidate predicted to fit wins.
//
//   nn::PlanOptions o{.target = "h200", .budget = memory::parse_bytes("6GiB")};
//   nn::MemoryPlan plan = nn::plan_memory([&](Device d, const nn::PlanCandidate& c) {
//     ... build the model on d, nn::enable_checkpointing(model, c.checkpoint),
//         train o.steps steps with autocast to c.amp ...
//   }, nn::checkpoint_block_count(*model), o);
//   fmt::print("{}", plan.report());   // then train with plan.chosen.candidate
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "memory/estimate.h"
#include "nn/checkpoint.h"
#include "nn/offload.h"
#include "tensor/dtype.h"
#include "tensor/meta/cost.h"

namespace tally::nn {

struct PlanCandidate {
  CheckpointSpec checkpoint;
  std::optional<DType> amp;  // the autocast dtype; nullopt: float32 throughout
  OffloadSpec offload;       // activation offload (nn/offload.h)
  // The fused classifier's chunk budget (linear_cross_entropy's max_chunk_bytes, GPT's
  // GPTConfig::fused_classifier_chunk_bytes); 0: the model's own.
  int64_t classifier_chunk_bytes = 0;
  // The levers of the planner for any model (optim/plan_training.h); their defaults leave the
  // run as it is.
  std::string optimizer = {};     // "adamw", "adamw8bit"; empty: the program's own
  bool step_in_backward = false;  // optim/step_in_backward.h
  int64_t micro_batches = 1;      // gradient accumulation: the batch in this many parts
  bool fused_classifier = false;  // the model's fused classifier (the factory reads it)
  // "checkpoint 6-blocks, amp bf16" (", offload activations" when it offloads, ", classifier
  // chunks 64 MiB" when it sets a chunk budget, then the other levers set)
  std::string str() const;
};

struct PlanOptions {
  std::string target = "cpu";  // memory::meta_target's names
  size_t budget = 0;           // bytes of device memory the run may reserve (its peak reserved)
  // Precisions searched: {nullopt} keeps float32; --amp auto adds the 16-bit ones.
  std::vector<std::optional<DType>> precisions = {std::nullopt};
  // Offload plans searched: {none} by default; --offload auto adds "activations", tried with
  // no checkpointing and with every block checkpointed (then offloading the blocks' inputs).
  std::vector<OffloadSpec> offloads = {OffloadSpec{}};
  // Fused-classifier chunk budgets searched, largest first (empty: the model's own). The grid
  // runs with the first; a candidate over the budget by less than what a smaller chunk saves
  // (twice the difference of the two budgets, plus one 20 MiB segment of rounding) is tried again
  // with the next ones, down to the first that fits. A smaller chunk costs launches, so the
  // cost model keeps the largest that fits.
  std::vector<int64_t> classifier_chunks;
  // Training steps each candidate's dry run takes (the time per step divides by it): the peak
  // allocated needs 2, the peak reserved can need 3.
  int64_t steps = 3;
  // The host memory the run will have (a :cpu optimizer's pinned state, offloaded
  // activations), which each candidate's host peak must fit; 0: this machine's
  // (memory::EstimateOptions::host_memory).
  size_t host_memory = 0;
};

struct PlannedCandidate {
  PlanCandidate candidate;
  memory::Estimate estimate;
  double step_seconds = 0;  // predicted, per step
  bool fits = false;        // dry run completed and its peak reserved is within the budget
  std::string error;        // the model cannot take this candidate (e.g. no stage list)
};

struct MemoryPlan {
  PlannedCandidate chosen;
  std::vector<PlannedCandidate> candidates;  // every one tried, in search order
  size_t budget = 0;
  std::string target;
  // The grid (each candidate's predicted peaks and step time, whether it fits) and the choice.
  std::string report() const;
};

// The checkpointing plans searched for a model with `blocks` checkpoint blocks: none,
// selective, the first quarter, half and three quarters of the blocks, all of them, and 2
// and 4 segments (those no larger than `blocks`, when it is known).
std::vector<CheckpointSpec> checkpoint_plans(int blocks);

// Dry-runs `run(device, candidate)` for every checkpointing plan x precision (x offload, x
// classifier chunk as PlanOptions::classifier_chunks says) on options.target and returns the
// fastest predicted to fit options.budget. `run` builds the model on `device` (the way the real run
// does), applies the candidate and trains options.steps steps; a candidate the model rejects
// (std::invalid_argument) is skipped. Errors (std::invalid_argument), naming what was asked: a
// budget of 0, an unknown target (both before any dry run); nothing fits: the smallest peak any
// candidate's completed dry run reaches and what it is made of, or, when the budget is below the
// parameters plus optimizer state that every plan keeps, that floor; when no dry run completes
// (each ran out of the target's memory or its host's), one's out-of-memory message.
MemoryPlan plan_memory(const std::function<void(Device, const PlanCandidate&)>& run,
                       int checkpoint_blocks, const PlanOptions& options);

// One candidate's dry run: `run(device, candidate)` on a fresh meta device replaying `target`
// with `rates` and a host of `host_memory` bytes (0: this machine's); its predicted time per
// step (of `steps`) and whether it fits `budget` (and the host). A candidate the model rejects
// (std::invalid_argument) comes back with its error.
PlannedCandidate dry_run_candidate(const std::function<void(Device, const PlanCandidate&)>& run,
                                   const PlanCandidate& candidate, const memory::MetaTarget& target,
                                   const meta::Rates& rates, int64_t steps, size_t budget,
                                   size_t host_memory = 0);
// Every candidate of `grid` dry-run (dry_run_candidate), in order. `classifier_chunks`
// (PlanOptions::classifier_chunks; the grid's candidates have its first): a candidate over the
// budget by less than a smaller chunk saves is tried again with the next ones, down to the
// first that fits. Errors (std::invalid_argument): chunk budgets not positive and decreasing.
std::vector<PlannedCandidate> dry_run_grid(
    const std::function<void(Device, const PlanCandidate&)>& run,
    const std::vector<PlanCandidate>& grid, const std::vector<int64_t>& classifier_chunks,
    const memory::MetaTarget& target, const meta::Rates& rates, int64_t steps, size_t budget,
    size_t host_memory = 0);
// The fastest of `candidates` that fits `budget` (each one's `fits` set for it) (ties: the smaller
// peak); the errors of plan_memory when none does.
MemoryPlan choose_plan(std::vector<PlannedCandidate> candidates, size_t budget,
                       const memory::MetaTarget& target);

// The best timing of f(), in seconds, over at least `reps` calls and `seconds` of calls: on a
// 2-core machine the first products after start-up ran 3-14x slower (pages faulted in,
// OpenBLAS's idle threads still spinning), for up to about 100 ms.
template <typename F>
double best_seconds(int reps, double seconds, F&& f) {
  double best = std::numeric_limits<double>::infinity();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
    if (i + 1 >= reps && std::chrono::duration<double>(t1 - start).count() >= seconds) break;
  }
  return std::max(best, 1e-9);
}

// The cost model's rates for `target` (tensor/meta/cost.h): the CPU's measured now by a short
// timed run (a float32 GEMM, whose rate 16-bit products take too, as the CPU runs them in
// float32; a large copy), once per process; a recorded GPU's
// as recorded; another GPU takes the H200's (a relative model: ranks plans, not seconds).
meta::Rates calibrated_rates(const memory::MetaTarget& target);

}  // namespace tally::nn
