#include "nn/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <mutex>
#include <stdexcept>

#include "memory/caching_allocator.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace tally::nn {

namespace {

std::string mib(int64_t bytes) {
  return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / 1048576.0);
}

// The CPU's rates, measured.
meta::Rates measure_cpu() {
  // On an allocator of its own: its buffers (32 MiB of them) must not stay cached in, or raise
  // the peaks of, the CPU's allocator, whose budget the planner is choosing for.
  memory::PrivateCpuAllocatorScope own_allocator;
  const int64_t n = 384;
  Generator gen(51);  // its own: a plan leaves the user's random stream where it was
  const Tensor a = ops::randn({n, n}, DType::float32, Device::cpu(), &gen),
               b = ops::randn({n, n}, DType::float32, Device::cpu(), &gen);
  const double gemm = 2.0 * static_cast<double>(n * n * n);
  meta::Rates r;
  r.flops_32bit = r.flops_tf32 = gemm / best_seconds(5, 0.15, [&] { ops::matmul(a, b); });
  r.flops_64bit = r.flops_32bit / 2;
  // The CPU multiplies 16-bit operands in float32 (tensor/linalg/cpu.cpp: widen, sgemm, round
  // back), and the meta kernel charges the widening and rounding as ops of their own
  // (tensor/linalg/meta.cpp). Timing a whole 16-bit matmul here counted those copies twice, and
  // on a loaded machine their three parallel regions made a 384 x 384 product take 48 ms
  // against 1.2 ms in float32: GPT-2's bf16 step priced at 11x its float32 one (issue 51).
  r.flops_16bit = r.flops_32bit;
  const Tensor src = ops::zeros({int64_t{1} << 22}), dst = ops::empty({int64_t{1} << 22});
  r.bandwidth = 2.0 * static_cast<double>(src.nbytes()) /
                best_seconds(3, 0.02, [&] { ops::copy_(dst, src); });
  // A 16-bit map's time over its bytes' time at `bandwidth`: the CPU's kernels widen every
  // element to float32 (bfloat16 by a shift, float16 by a conversion), so a bfloat16 add takes
  // about a float32 add's time for half the bytes, and a float16 one several times that.
  const double add_32 = best_seconds(3, 0.02, [&] { ops::binary(ops::BinaryOp::add, src, src); });
  auto scale = [&](DType d) {
    const Tensor h = ops::zeros({int64_t{1} << 22}, d);
    const double t = best_seconds(3, 0.02, [&] { ops::binary(ops::BinaryOp::add, h, h); });
    return std::max(1.0, 2.0 * t / add_32);  // float32's bytes are twice the 16-bit ones
  };
  r.byte_scale_bf16 = scale(DType::bfloat16);
  r.byte_scale_fp16 = scale(DType::float16);
  const Tensor one = ops::zeros({1});
  r.launch_seconds = best_seconds(3, 0,
                                  [&] {
                                    for (int i = 0; i < 100; ++i)
                                      ops::binary(ops::BinaryOp::add, one, one);
                                  }) /
                     100.0;
  return r;
}

}  // namespace

std::string PlanCandidate::str() const {
  std::string s =
      fmt::format("checkpoint {}, amp {}{}{}", checkpoint.str(),
                  amp ? std::string(dtype_name(*amp)) : std::string("off"),
                  offload.enabled() ? ", offload " + offload.str() : std::string(),
                  classifier_chunk_bytes > 0 ? ", classifier chunks " + mib(classifier_chunk_bytes)
                                             : std::string());
  if (!optimizer.empty()) s += ", " + optimizer;
  if (step_in_backward) s += ", step-in-backward";
  if (micro_batches > 1) s += fmt::format(", {} micro-batches", micro_batches);
  if (fused_classifier) s += ", fused classifier";
  return s;
}

std::vector<CheckpointSpec> checkpoint_plans(int blocks) {
  std::vector<std::string> names = {"none", "selective"};
  if (blocks > 0) {
    for (const int k : {blocks / 4, blocks / 2, 3 * blocks / 4})
      if (k > 0 && k < blocks &&
          std::find(names.begin(), names.end(), fmt::format("{}-blocks", k)) == names.end())
        names.push_back(fmt::format("{}-blocks", k));
    names.push_back("blocks");
  }
  for (const int segments : {2, 4})  // no more segments than blocks (enable_checkpointing refuses)
    if (blocks <= 0 || segments <= blocks) names.push_back(fmt::format("{}-segments", segments));
  std::vector<CheckpointSpec> out;
  for (const std::string& s : names) out.push_back(parse_checkpoint_spec(s));
  return out;
}

meta::Rates calibrated_rates(const memory::MetaTarget& t) {
  meta::Rates r = meta::rates_for(t);
  if (r.bandwidth > 0) return r;
  if (t.type == DeviceType::cpu) {
    static std::once_flag once;
    static meta::Rates cpu;
    std::call_once(once, [] { cpu = measure_cpu(); });
    return cpu;
  }
  // A GPU without recorded rates: the H200's, as a relative model (ranks plans, not seconds).
  const meta::Rates h = meta::rates_for(memory::meta_target("h200"));
  r.flops_16bit = h.flops_16bit, r.flops_32bit = h.flops_32bit, r.flops_tf32 = h.flops_tf32;
  r.flops_64bit = h.flops_64bit, r.bandwidth = h.bandwidth, r.launch_seconds = h.launch_seconds;
  // The host link and the host's update too: without them an offloaded activation's copies
  // cost nothing, and the planner chose offloading every block (215 ms a step against 37).
  r.host_bandwidth = h.host_bandwidth, r.host_update_bandwidth = h.host_update_bandwidth;
  r.host_update_8bit_bandwidth = h.host_update_8bit_bandwidth;
  return r;
}

MemoryPlan plan_memory(const std::function<void(Device, const PlanCandidate&)>& run,
                       int checkpoint_blocks, const PlanOptions& options) {
  if (options.budget == 0)
    throw std::invalid_argument("memory budget: 0 bytes (give one, e.g. 6GiB or 900MiB)");
  if (options.precisions.empty())
    throw std::invalid_argument("plan_memory: no precision to search");
  if (options.steps < 1)
    throw std::invalid_argument(fmt::format("plan_memory: {} steps", options.steps));
  const memory::MetaTarget target = memory::meta_target(options.target);
  const meta::Rates rates = calibrated_rates(target);
  if (options.budget > target.capacity)
    throw std::invalid_argument(
        fmt::format("memory budget {} is larger than the {} target's memory ({})",
                    mib(static_cast<int64_t>(options.budget)), target.name,
                    mib(static_cast<int64_t>(target.capacity))));
  MemoryPlan plan;
  plan.budget = options.budget;
  plan.target = target.name;
  if (options.offloads.empty())
    throw std::invalid_argument("plan_memory: no offload plan to search");
  const int64_t first_chunk =
      options.classifier_chunks.empty() ? 0 : options.classifier_chunks.front();
  std::vector<PlanCandidate> grid;
  for (const std::optional<DType>& amp : options.precisions)
    for (const OffloadSpec& offload : options.offloads) {
      if (!offload.enabled()) {
        for (const CheckpointSpec& spec : checkpoint_plans(checkpoint_blocks))
          grid.push_back({spec, amp, offload, first_chunk});
        continue;
      }
      grid.push_back({CheckpointSpec{}, amp, offload, first_chunk});
      grid.push_back({parse_checkpoint_spec("blocks"), amp, offload, first_chunk});
    }
  plan.candidates = dry_run_grid(run, grid, options.classifier_chunks, target, rates, options.steps,
                                 options.budget, options.host_memory);
  plan = choose_plan(std::move(plan.candidates), options.budget, target);
  return plan;
}

std::vector<PlannedCandidate> dry_run_grid(
    const std::function<void(Device, const PlanCandidate&)>& run,
    const std::vector<PlanCandidate>& grid, const std::vector<int64_t>& chunks,
    const memory::MetaTarget& target, const meta::Rates& rates, int64_t steps, size_t budget,
    size_t host_memory) {
  for (size_t i = 0; i < chunks.size(); ++i)
    if (chunks[i] <= 0 || (i > 0 && chunks[i] >= chunks[i - 1]))
      throw std::invalid_argument(
          fmt::format("plan_memory: classifier chunk budgets must be positive and decreasing, "
                      "got {} at position {}",
                      chunks[i], i));
  const int64_t first_chunk = chunks.empty() ? 0 : chunks.front();
  auto dry_run = [&](const PlanCandidate& candidate) {
    return dry_run_candidate(run, candidate, target, rates, steps, budget, host_memory);
  };
  // A smaller chunk lowers the peak by at most twice the difference of the chunk budgets (the
  // chunk's buffers are all it changes; training and the validation after it can each keep a
  // segment of them), give or take a segment's rounding.
  constexpr int64_t kSegmentRounding = int64_t{20} << 20;
  std::vector<PlannedCandidate> out;
  for (const PlanCandidate& candidate : grid) {
    PlannedCandidate pc = dry_run(candidate);
    const bool retry = pc.error.empty() && !pc.fits;
    // A dry run that ran out of the target's memory has no peak to compare: retry it.
    const bool completed = pc.estimate.fits();
    const int64_t over = pc.estimate.peak_reserved - static_cast<int64_t>(budget);
    out.push_back(std::move(pc));
    if (!retry) continue;
    for (size_t i = 1; i < chunks.size(); ++i) {
      if (completed && over > 2 * (first_chunk - chunks[i]) + kSegmentRounding) continue;
      PlanCandidate smaller = candidate;
      smaller.classifier_chunk_bytes = chunks[i];
      out.push_back(dry_run(smaller));
      if (out.back().fits || !out.back().error.empty()) break;
    }
  }
  return out;
}

PlannedCandidate dry_run_candidate(const std::function<void(Device, const PlanCandidate&)>& run,
                                   const PlanCandidate& candidate, const memory::MetaTarget& target,
                                   const meta::Rates& rates, int64_t steps, size_t budget,
                                   size_t host_memory) {
  PlannedCandidate pc;
  pc.candidate = candidate;
  memory::DryRun dry({.spec = target, .max_history = 0, .host_memory = host_memory});
  meta::set_rates(dry.device(), rates);
  try {
    run(dry.device(), pc.candidate);
    pc.estimate = dry.finish();
  } catch (const memory::OutOfMemoryError& e) {
    pc.estimate = dry.finish(e.what());
  } catch (const std::invalid_argument& e) {
    pc.error = e.what();
    pc.estimate = dry.finish();
  }
  memory::empty_cache(dry.device());
  pc.step_seconds = pc.estimate.predicted_seconds / static_cast<double>(steps);
  pc.fits = pc.error.empty() && pc.estimate.fits() &&
            pc.estimate.peak_reserved <= static_cast<int64_t>(budget);
  return pc;
}

MemoryPlan choose_plan(std::vector<PlannedCandidate> candidates, size_t budget,
                       const memory::MetaTarget& target) {
  MemoryPlan plan;
  plan.budget = budget;
  plan.target = target.name;
  plan.candidates = std::move(candidates);
  // Whether each fits is this budget's (the dry runs may have been for another).
  for (PlannedCandidate& c : plan.candidates)
    c.fits = c.error.empty() && c.estimate.fits() &&
             c.estimate.peak_reserved <= static_cast<int64_t>(budget);
  // An 8-bit optimizer changes what training computes, where every other lever changes only
  // where and when: it is chosen only when no plan with the program's optimizer fits, however
  // the cost model ranks their times (they are within its error of each other). An optimizer in
  // host memory (":cpu") is chosen only when no plan on the device fits: its update is bound
  // by the host, which the cost model knows least.
  auto lossy = [](const PlannedCandidate& c) {
    const std::string& o = c.candidate.optimizer;
    return 2 * (o.find("8bit") != std::string::npos) + (o.ends_with(":cpu") ? 1 : 0);
  };
  const PlannedCandidate* best = nullptr;
  // The smallest peak of the plans whose dry run went to the end on the device and its host;
  // else, of those that ran out of either, the one that stopped with the least on the device
  // (a stopped run's peak is where it stopped, not a figure to compare with the budget).
  const PlannedCandidate* smallest = nullptr;
  const PlannedCandidate* stopped = nullptr;
  for (const PlannedCandidate& c : plan.candidates) {
    if (!c.error.empty()) continue;
    const PlannedCandidate*& least = c.estimate.fits() ? smallest : stopped;
    if (!least || c.estimate.peak_reserved < least->estimate.peak_reserved) least = &c;
    if (!c.fits) continue;
    if (!best || lossy(c) < lossy(*best) ||
        (lossy(c) == lossy(*best) && (c.step_seconds < best->step_seconds ||
                                      (c.step_seconds == best->step_seconds &&
                                       c.estimate.peak_reserved < best->estimate.peak_reserved))))
      best = &c;
  }
  if (!smallest && !stopped)
    throw std::invalid_argument(fmt::format("plan_memory: the model took none of the plans: {}",
                                            plan.candidates.front().error));
  if (!smallest) {
    const memory::Estimate& e = stopped->estimate;
    throw std::invalid_argument(fmt::format(
        "memory budget {}: no plan fits on {} or its host: every plan's dry run ran out of "
        "memory. With {}: {}",
        mib(static_cast<int64_t>(budget)), target.name, stopped->candidate.str(),
        e.out_of_memory.empty() ? e.host_out_of_memory : e.out_of_memory));
  }
  if (!best) {
    const auto& at = smallest->estimate.at_peak;
    const int64_t floor = at[static_cast<size_t>(memory::Category::parameter)] +
                          at[static_cast<size_t>(memory::Category::optimizer_state)];
    std::string parts;
    for (const memory::Category c : memory::kAllCategories)
      if (const int64_t b = at[static_cast<size_t>(c)]; b > 0)
        parts +=
            fmt::format("{}{} {}", parts.empty() ? "" : ", ", memory::category_name(c), mib(b));
    if (static_cast<int64_t>(budget) < floor)
      throw std::invalid_argument(fmt::format(
          "memory budget {} is below the parameters plus optimizer state ({}), which every plan "
          "keeps on {}: no plan the planner searched can fit",
          mib(static_cast<int64_t>(budget)), mib(floor), target.name));
    throw std::invalid_argument(fmt::format(
        "memory budget {}: no plan fits on {}. The smallest peak is {} reserved ({} allocated) "
        "with {}, made of {} at its peak",
        mib(static_cast<int64_t>(budget)), target.name, mib(smallest->estimate.peak_reserved),
        mib(smallest->estimate.peak_allocated), smallest->candidate.str(), parts));
  }
  plan.chosen = *best;
  return plan;
}

std::string MemoryPlan::report() const {
  std::string s =
      fmt::format("Memory plan for {} within {} (dry runs; time from the cost model):\n", target,
                  mib(static_cast<int64_t>(budget)));
  size_t w = 34;
  for (const PlannedCandidate& c : candidates) w = std::max(w, c.candidate.str().size());
  s += fmt::format("  {:<{}} {:>14} {:>14} {:>12}  {}\n", "candidate", w, "peak alloc", "peak resv",
                   "ms/step", "");
  for (const PlannedCandidate& c : candidates) {
    const bool chosen_one = c.candidate.str() == chosen.candidate.str();
    std::string verdict = !c.error.empty()     ? "not applicable"
                          : !c.estimate.fits() ? "out of memory"
                          : c.fits             ? (chosen_one ? "fits  <- chosen" : "fits")
                                   : fmt::format("over by {}", mib(c.estimate.peak_reserved -
                                                                   static_cast<int64_t>(budget)));
    if (!c.error.empty())
      s += fmt::format("  {:<{}} {:>14} {:>14} {:>12}  {}\n", c.candidate.str(), w, "-", "-", "-",
                       verdict);
    else
      s += fmt::format("  {:<{}} {:>14} {:>14} {:>12.2f}  {}\n", c.candidate.str(), w,
                       mib(c.estimate.peak_allocated), mib(c.estimate.peak_reserved),
                       c.step_seconds * 1e3, verdict);
  }
  s += fmt::format("Chosen: {} (predicted peak {} reserved, {} allocated; {:.2f} ms/step)\n",
                   chosen.candidate.str(), mib(chosen.estimate.peak_reserved),
                   mib(chosen.estimate.peak_allocated), chosen.step_seconds * 1e3);
  return s;
}

}  // namespace tally::nn
