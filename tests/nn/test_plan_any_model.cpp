// Memory policies and the planner for any model (issue 51): checkpoint and offload policies by
// module type, dotted-name glob, every k-th and predicate on a user-defined module; the planner
// over every lever for a user's model and step, whose chosen run stays within the budget on the
// CPU; and nothing the planner measures stays in the CPU's allocator.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "autograd/ops.h"
#include "memory/caching_allocator.h"
#include "memory/estimate.h"
#include "memory/memory.h"
#include "nn/checkpoint.h"
#include "nn/container.h"
#include "nn/layers.h"
#include "nn/models/registry.h"
#include "nn/norm.h"
#include "nn/offload.h"
#include "optim/plan_training.h"
#include "tensor/pinned.h"
#include "testing/residual_mlp.h"

namespace tally {
namespace {

using testing::MyNet;

// |a - b| <= atol + rtol |b| everywhere (same shapes).
bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  const std::vector<double> x = a.contiguous().reshape({-1}).tolist();
  const std::vector<double> y = b.contiguous().reshape({-1}).tolist();
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i)
    if (std::abs(x[i] - y[i]) > atol + rtol * std::abs(y[i])) return false;
  return true;
}

constexpr int64_t kIn = 16, kD = 32, kBlocks = 4, kClasses = 10, kBatch = 1024;

using testing::my_loss;

std::shared_ptr<MyNet> make_net() {
  return testing::seeded_my_net(kIn, kD, kBlocks, kClasses);
}

std::vector<Tensor> make_batch() {
  return testing::my_batch(kBatch, kIn, kClasses);
}

// One forward and backward; the loss, the gradients and the peak activation bytes of the step.
struct StepResult {
  double loss = 0;
  std::vector<Tensor> grads;
  int64_t activation_peak = 0;
};
StepResult step(nn::Module& model, const std::vector<Tensor>& batch) {
  memory::reset_peak_memory_stats(Device::cpu());
  const Tensor loss = my_loss(model, batch);
  loss.backward();
  StepResult r;
  r.activation_peak = memory::get_allocator(Device::cpu())
                          .stats()
                          .category_bytes[static_cast<size_t>(memory::Category::activation)]
                          .peak;
  r.loss = loss.item();
  for (const Tensor& p : model.parameters()) r.grads.push_back(p.grad().clone());
  return r;
}

nn::TrainingPlanOptions small_grid(size_t budget) {
  nn::TrainingPlanOptions o;
  o.budget = budget;
  o.precisions = {std::nullopt};
  o.micro_batches = {1, 4};
  o.step_in_backward = {false};  // TheGridSearchesEveryLever covers it; this keeps the test short
  o.eval = [](nn::Module& m, const std::vector<Tensor>& b) { (void)my_loss(m, b); };
  return o;
}

nn::MemoryPlan plan_for(size_t budget) {
  return nn::plan_memory([](const nn::PlanCandidate&) { return make_net(); }, my_loss, make_batch(),
                         small_grid(budget));
}

// First in this binary: the planner's first call also times the CPU for its cost model.
TEST(PlanAnyModel, NothingThePlannerMeasuresStaysInTheCpuAllocator) {
  const std::vector<Tensor> batch = make_batch();
  memory::empty_cache(Device::cpu());
  const memory::DeviceStats before = memory::get_allocator(Device::cpu()).stats();
  (void)nn::plan_memory([](const nn::PlanCandidate&) { return make_net(); }, my_loss, batch,
                        small_grid(size_t{1} << 30));
  const memory::DeviceStats after = memory::get_allocator(Device::cpu()).stats();
  EXPECT_EQ(after.reserved_bytes[memory::kAllPools].current,
            before.reserved_bytes[memory::kAllPools].current);
  EXPECT_EQ(after.reserved_bytes[memory::kAllPools].peak,
            before.reserved_bytes[memory::kAllPools].peak);
  EXPECT_EQ(after.allocated_bytes[memory::kAllPools].peak,
            before.allocated_bytes[memory::kAllPools].peak);
  EXPECT_EQ(after.num_device_alloc, before.num_device_alloc);
}

TEST(PlanAnyModel, PoliciesSelectByTypeNameEveryAndPredicate) {
  auto net = make_net();
  auto checkpointed = [&] {
    std::vector<std::string> out;
    for (auto& [name, m] : net->named_modules())
      if (m->is_checkpointed()) out.push_back(name);
    return out;
  };
  using V = std::vector<std::string>;
  nn::enable_checkpointing(*net, nn::parse_checkpoint_spec("type:MyBlock"));
  EXPECT_EQ(checkpointed(), (V{"blocks.0", "blocks.1", "blocks.2", "blocks.3"}));
  nn::enable_checkpointing(*net, nn::parse_checkpoint_spec("type:MyBlock/2"));
  EXPECT_EQ(checkpointed(), (V{"blocks.0", "blocks.2"}));
  nn::enable_checkpointing(*net, nn::parse_checkpoint_spec("name:blocks.*"));
  EXPECT_EQ(checkpointed(), (V{"blocks.0", "blocks.1", "blocks.2", "blocks.3"}));
  nn::enable_checkpointing(*net, nn::parse_checkpoint_spec("name:blocks.*.up"));
  EXPECT_EQ(checkpointed(), (V{"blocks.0.up", "blocks.1.up", "blocks.2.up", "blocks.3.up"}));
  nn::enable_checkpointing(*net, nn::parse_checkpoint_spec("name:**.down/4"));
  EXPECT_EQ(checkpointed(), (V{"blocks.0.down"}));
  nn::enable_checkpointing(*net, nn::checkpoint_modules(
                                     [](const std::string& name, const nn::Module& m) {
                                       return m.type_name() == "MyBlock" && name != "blocks.0";
                                     },
                                     "not-first"));
  EXPECT_EQ(checkpointed(), (V{"blocks.1", "blocks.2", "blocks.3"}));
  nn::enable_checkpointing(*net, nn::parse_checkpoint_spec("none"));
  EXPECT_TRUE(checkpointed().empty());

  for (const std::string s : {"type:MyBlock", "name:blocks.*/2", "type:MyBlock+selective"})
    EXPECT_EQ(nn::parse_checkpoint_spec(s).str(), s);
  EXPECT_EQ(nn::parse_offload_spec("type:MyBlock/2").str(), "type:MyBlock/2");
  EXPECT_THROW(nn::parse_checkpoint_spec("type:"), std::invalid_argument);
  EXPECT_THROW(nn::parse_checkpoint_spec("type:MyBlock/0"), std::invalid_argument);
  EXPECT_THROW(nn::parse_offload_spec("name:x/y"), std::invalid_argument);
  try {
    nn::enable_checkpointing(*net, nn::parse_checkpoint_spec("type:Nothing"));
    FAIL() << "no module matches";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("type:Nothing"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MyNet"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(nn::glob_match("blocks.*", "blocks.10"));
  EXPECT_FALSE(nn::glob_match("blocks.*", "blocks.1.up"));
  EXPECT_TRUE(nn::glob_match("blocks.**", "blocks.1.up"));
  EXPECT_TRUE(nn::glob_match("blocks.?", "blocks.1"));
  const auto repeated = nn::repeated_module_types(*net);
  ASSERT_EQ(repeated.size(), 1u);
  EXPECT_EQ(repeated[0].first, "MyBlock");
  EXPECT_EQ(repeated[0].second, 4);
}

TEST(PlanAnyModel, CheckpointedStepEqualsThePlainStepWithALowerActivationPeak) {
  const std::vector<Tensor> batch = make_batch();
  auto plain_net = make_net();
  const StepResult plain = step(*plain_net, batch);
  for (const std::string spec : {"name:blocks.*/2", "type:MyBlock+selective"}) {
    SCOPED_TRACE(spec);
    auto net = make_net();
    nn::enable_checkpointing(*net, nn::parse_checkpoint_spec(spec));
    const StepResult r = step(*net, batch);
    EXPECT_EQ(r.loss, plain.loss);
    ASSERT_EQ(r.grads.size(), plain.grads.size());
    for (size_t i = 0; i < r.grads.size(); ++i)
      EXPECT_TRUE(allclose(r.grads[i], plain.grads[i], 1e-6, 1e-7)) << i;
    EXPECT_LT(r.activation_peak, plain.activation_peak);
  }
  auto net = make_net();
  nn::enable_checkpointing(*net,
                           nn::checkpoint_modules([](const std::string&, const nn::Module& m) {
                             return m.type_name() == "MyBlock";
                           }));
  const StepResult r = step(*net, batch);
  EXPECT_EQ(r.loss, plain.loss);
  EXPECT_LT(r.activation_peak, plain.activation_peak);
}

TEST(PlanAnyModel, OffloadPolicyOnAUserModule) {
  const std::vector<Tensor> batch = make_batch();
  auto plain_net = make_net();
  const StepResult plain = step(*plain_net, batch);
  auto net = make_net();
  const auto offloader = nn::offload_activations(*net, nn::parse_offload_spec("type:MyBlock/2"));
  ASSERT_NE(offloader, nullptr);
  int offloading = 0;
  for (auto& [name, m] : net->named_modules()) offloading += m->offloader() != nullptr;
  EXPECT_EQ(offloading, 2);
  const StepResult r = step(*net, batch);
  EXPECT_EQ(r.loss, plain.loss);
  for (size_t i = 0; i < r.grads.size(); ++i)
    EXPECT_TRUE(allclose(r.grads[i], plain.grads[i], 1e-6, 1e-7)) << i;
  EXPECT_GT(offloader->stats().tensors_offloaded + offloader->stats().tensors_kept, 0);
  EXPECT_EQ(nn::offload_activations(*net, nn::OffloadSpec{}), nullptr);
  EXPECT_THROW(nn::offload_activations(*net, nn::parse_offload_spec("name:nothing")),
               std::invalid_argument);
}

TEST(PlanAnyModel, CheckpointSequentialOverASequential) {
  const std::vector<Tensor> batch = make_batch();
  auto plain_net = make_net();
  const Tensor x = (*plain_net->stem)(batch[0]);
  const Tensor want = (*plain_net->blocks)(x);
  sum(want).backward();
  const Tensor want_grad = plain_net->blocks->parameters()[0].grad().clone();
  auto net = make_net();
  nn::reset_checkpoint_stats();
  const Tensor got = nn::checkpoint_sequential(*net->blocks, 2, (*net->stem)(batch[0]));
  sum(got).backward();
  EXPECT_TRUE(allclose(got, want, 0, 0));
  EXPECT_TRUE(allclose(net->blocks->parameters()[0].grad(), want_grad, 1e-6, 1e-7));
  EXPECT_EQ(nn::checkpoint_stats().segments, 1);
}

std::string adamw_plain() {
  nn::PlanCandidate c;
  c.optimizer = "adamw";
  return c.str();
}

// The peaks reserved of a grid planned at a budget everything fits: the plain AdamW run's and
// the smallest. Every candidate must have been planned without error.
std::pair<int64_t, int64_t> plain_and_smallest_peaks(const nn::MemoryPlan& all) {
  int64_t plain = 0, smallest = INT64_MAX;
  for (const nn::PlannedCandidate& c : all.candidates) {
    EXPECT_TRUE(c.error.empty()) << c.candidate.str() << ": " << c.error;
    smallest = std::min(smallest, c.estimate.peak_reserved);
    if (c.candidate.str() == adamw_plain()) plain = c.estimate.peak_reserved;
  }
  return {plain, smallest};
}

// The chosen candidate of `factory`'s model trained for real on the CPU with `loss` on
// `batch`: its peak reserved, from a clean cache.
int64_t measured_peak_reserved(const nn::PlanCandidate& c, const nn::TrainingPlanOptions& o,
                               const nn::ModelFactory& factory, const nn::LossFn& loss,
                               const std::vector<Tensor>& batch) {
  memory::empty_cache(Device::cpu());
  memory::reset_peak_memory_stats(Device::cpu());
  const int64_t base = static_cast<int64_t>(memory::memory_reserved(Device::cpu()));
  {
    auto net = factory(c);
    std::vector<Tensor> in;
    {
      memory::CategoryScope input(memory::Category::input);
      for (const Tensor& t : batch) in.push_back(t.clone());
    }
    (void)nn::train_candidate(*net, c, loss, in, o.steps, o);
  }
  const int64_t peak = static_cast<int64_t>(memory::max_memory_reserved(Device::cpu())) - base;
  memory::empty_cache(Device::cpu());
  return peak;
}

int64_t measured_peak_reserved(const nn::PlanCandidate& c, const nn::TrainingPlanOptions& o) {
  return measured_peak_reserved(
      c, o, [](const nn::PlanCandidate&) { return make_net(); }, my_loss, make_batch());
}

TEST(PlanAnyModel, TheChosenRunStaysWithinThreeBudgets) {
  // The grid's peaks at a budget everything fits: the plain run's and the smallest.
  const nn::MemoryPlan all = plan_for(size_t{1} << 30);
  const auto [plain, smallest] = plain_and_smallest_peaks(all);
  ASSERT_GT(plain, smallest) << all.report();
  for (const int64_t budget : {plain, (plain + smallest) / 2, smallest}) {
    SCOPED_TRACE(budget);
    const nn::MemoryPlan plan = plan_for(static_cast<size_t>(budget));
    EXPECT_LE(plan.chosen.estimate.peak_reserved, budget);
    EXPECT_LE(measured_peak_reserved(plan.chosen.candidate, small_grid(0)), budget)
        << plan.report();
  }
  // Below the smallest: the error names it and the candidate that reaches it.
  try {
    (void)plan_for(static_cast<size_t>(smallest - 1));
    FAIL() << "nothing fits";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("The smallest peak"), std::string::npos) << e.what();
  }
}

TEST(PlanAnyModel, TheEstimateNamesTrainAndEvalPeaks) {
  const nn::MemoryPlan plan = plan_for(size_t{1} << 30);
  const auto& phases = plan.chosen.estimate.phases;
  ASSERT_EQ(phases.size(), 3u) << plan.chosen.estimate.report();
  EXPECT_EQ(phases[0].phase, "setup");
  EXPECT_EQ(phases[1].phase, "train");
  EXPECT_EQ(phases[2].phase, "eval");
  EXPECT_EQ(
      plan.chosen.estimate.peak_allocated,
      std::max({phases[0].peak_allocated, phases[1].peak_allocated, phases[2].peak_allocated}));
  EXPECT_GT(phases[1].peak_allocated, phases[2].peak_allocated);
  EXPECT_NE(plan.chosen.estimate.report().find("peak by phase"), std::string::npos);
}

TEST(PlanAnyModel, TheGridSearchesEveryLever) {
  std::shared_ptr<MyNet> net;
  {
    nn::BuildOnDevice on(Device::meta());
    net = make_net();
  }
  nn::TrainingPlanOptions o;
  o.target = "h200";
  // By default each candidate starts at 1 micro-batch (plan_memory climbs from there).
  for (const nn::PlanCandidate& c : nn::training_plan_grid(*net, kBatch, o))
    EXPECT_EQ(c.micro_batches, 1) << c.str();
  o.micro_batches = {1, 2};
  const auto grid = nn::training_plan_grid(*net, kBatch, o);
  bool ckpt = false, bf16 = false, fp16 = false, eight = false, sib = false, mb = false,
       off = false;
  for (const nn::PlanCandidate& c : grid) {
    ckpt |= c.checkpoint.kind == nn::CheckpointSpec::Kind::modules;
    bf16 |= c.amp == DType::bfloat16;
    fp16 |= c.amp == DType::float16;
    eight |= c.optimizer == "adamw8bit";
    sib |= c.step_in_backward;
    mb |= c.micro_batches > 1;
    off |= c.offload.enabled();
    EXPECT_FALSE(c.step_in_backward && c.micro_batches > 1) << c.str();
  }
  EXPECT_TRUE(ckpt && bf16 && fp16 && eight && sib && mb && off);
}

TEST(PlanAnyModel, MicroBatchLadderDoublesThroughDivisorsOfTheBatch) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(nn::micro_batch_ladder(32), (V{1, 2, 4, 8, 16, 32}));
  EXPECT_EQ(nn::micro_batch_ladder(12), (V{1, 2, 4, 6, 12}));
  EXPECT_EQ(nn::micro_batch_ladder(24), (V{1, 2, 4, 8, 12, 24}));
  EXPECT_EQ(nn::micro_batch_ladder(7), (V{1, 7}));
  EXPECT_EQ(nn::micro_batch_ladder(1), (V{1}));
  EXPECT_TRUE(nn::micro_batch_ladder(0).empty());
}

// One lever set (no checkpointing, float32, AdamW) so that only the micro-batches vary.
nn::TrainingPlanOptions one_candidate(size_t budget) {
  nn::TrainingPlanOptions o;
  o.budget = budget;
  o.checkpoints = {nn::CheckpointSpec{}};
  o.precisions = {std::nullopt};
  o.optimizers = {"adamw"};
  o.step_in_backward = {false};
  o.steps = 2;
  return o;
}

// A budget the whole batch does not fit: the planner climbs 1, 2, 4, ... micro-batches and
// stops at the first count that fits (more would only cost time); a budget below what no
// count of micro-batches changes stops the climb at once.
TEST(PlanAnyModel, ABudgetTooSmallForTheWholeBatchTakesMoreMicroBatches) {
  int builds = 0;
  const nn::ModelFactory factory = [&](const nn::PlanCandidate&) {
    ++builds;
    return make_net();
  };
  const std::vector<Tensor> batch = make_batch();
  const std::vector<int64_t> ladder = nn::micro_batch_ladder(kBatch);
  // The first counts dry-run: each one's peak reserved.
  nn::TrainingPlanOptions every = one_candidate(size_t{1} << 30);
  every.micro_batches = {ladder.begin(), ladder.begin() + 4};
  const nn::MemoryPlan all = nn::plan_memory(factory, my_loss, batch, every);
  ASSERT_EQ(all.candidates.size(), 4u) << all.report();
  // The budget: the smallest of those peaks, first reached at count ladder[k] (8 micro-batches:
  // 2 MiB reserved, against 8 MiB for the whole batch).
  size_t k = 0;
  for (size_t i = 1; i < all.candidates.size(); ++i)
    if (all.candidates[i].estimate.peak_reserved < all.candidates[k].estimate.peak_reserved) k = i;
  ASSERT_GE(k, 2u) << all.report();
  const int64_t budget = all.candidates[k].estimate.peak_reserved;

  builds = 0;
  const nn::MemoryPlan plan =
      nn::plan_memory(factory, my_loss, batch, one_candidate(static_cast<size_t>(budget)));
  EXPECT_EQ(plan.chosen.candidate.micro_batches, ladder[k]) << plan.report();
  EXPECT_LE(plan.chosen.estimate.peak_reserved, budget);
  // Climbed rung by rung, none past the one that fits.
  ASSERT_EQ(plan.candidates.size(), k + 1) << plan.report();
  for (size_t i = 0; i <= k; ++i) EXPECT_EQ(plan.candidates[i].candidate.micro_batches, ladder[i]);
  EXPECT_EQ(builds, static_cast<int>(k + 2));  // the probe, then one per dry run

  // Below the parameters and optimizer state (above the parameters, which fail before any dry
  // run): one dry run, then the error.
  int64_t params = 0;
  for (const Tensor& p : make_net()->parameters()) params += static_cast<int64_t>(p.nbytes());
  builds = 0;
  EXPECT_THROW((void)nn::plan_memory(factory, my_loss, batch,
                                     one_candidate(static_cast<size_t>(params + params / 2))),
               std::invalid_argument);
  EXPECT_EQ(builds, 2);
}

// Every candidate's dry run replays the host memory the options name (a GPU run's host, which
// a :cpu optimizer's state must fit), not this machine's.
TEST(PlanAnyModel, TheDryRunsReplayTheHostMemoryAsked) {
  std::shared_ptr<MyNet> net;
  {
    nn::BuildOnDevice on(Device::meta());
    net = make_net();
  }
  // 64 MiB of optimizer state in the host memory of an H200 dry run, a little on the device.
  const nn::CandidateRun run = [](Device d, const nn::PlanCandidate&) {
    memory::CategoryScope state(memory::Category::optimizer_state);
    const Tensor host = ops::empty_host({int64_t{16} << 20}, DType::float32, d);
    const Tensor device = ops::empty({1024}, DType::float32, d);
  };
  nn::TrainingPlanOptions o = one_candidate(size_t{1} << 30);
  o.target = "h200";
  o.offloads = {nn::OffloadSpec{}};
  o.micro_batches = {1};
  o.host_memory = size_t{1} << 30;
  const nn::MemoryPlan plan = nn::plan_memory(*net, kBatch, run, o);
  EXPECT_EQ(plan.chosen.estimate.host_memory, o.host_memory);
  EXPECT_EQ(plan.chosen.estimate.host_peak_reserved, int64_t{64} << 20) << plan.report();
  o.host_memory = size_t{32} << 20;  // below the state: no candidate fits
  EXPECT_THROW((void)nn::plan_memory(*net, kBatch, run, o), std::invalid_argument);
}

// The registry's GPT and ResNet at their tiny presets under the planner at three budgets
// (the plain run's peak, half way to the smallest, the smallest): the chosen run, trained for
// real on the CPU, stays within each. One grid's dry runs serve the three budgets (choose_plan
// over them is plan_memory's choice); the levers kept to a few for CI's time.
void check_three_budgets(const std::string& name, const nn::ModelOptions& mo, int64_t rows) {
  SCOPED_TRACE(name);
  const nn::ModelEntry& entry = nn::model_entry(name);
  const nn::ModelOptions opts = nn::resolve_options(entry, mo);
  const data::Example b = entry.synthetic_batch(opts, rows, 0, 0);
  std::vector<Tensor> batch;
  {
    memory::CategoryScope input(memory::Category::input);
    batch = {b.input.clone(), b.target.clone()};
  }
  const nn::ModelFactory factory = [&](const nn::PlanCandidate&) {
    manual_seed(0);
    return entry.build(opts);
  };
  const nn::LossFn loss = [&](nn::Module& m, const std::vector<Tensor>& in) {
    return entry.loss(m, {in[0], in[1]});
  };
  nn::TrainingPlanOptions o;
  o.budget = size_t{1} << 30;
  o.precisions = {std::nullopt};
  o.micro_batches = {1, 2};
  o.step_in_backward = {false};
  o.steps = 2;
  const nn::MemoryPlan all = nn::plan_memory(factory, loss, batch, o);
  const auto [plain, smallest] = plain_and_smallest_peaks(all);
  ASSERT_GT(plain, smallest) << all.report();
  const memory::MetaTarget target = memory::meta_target(o.target);
  for (const int64_t budget : {plain, (plain + smallest) / 2, smallest}) {
    SCOPED_TRACE(budget);
    const nn::MemoryPlan plan =
        nn::choose_plan(all.candidates, static_cast<size_t>(budget), target);
    EXPECT_LE(plan.chosen.estimate.peak_reserved, budget);
    EXPECT_LE(measured_peak_reserved(plan.chosen.candidate, o, factory, loss, batch), budget)
        << plan.report();
  }
}

TEST(PlanReferenceModels, GptTinyStaysWithinThreeBudgets) {
  check_three_budgets("gpt", {.preset = "tiny", .seq = 16}, 8);
}

TEST(PlanReferenceModels, ResnetTinyStaysWithinThreeBudgets) {
  check_three_budgets("resnet", {.preset = "tiny", .image_size = 16}, 8);
}

}  // namespace
}  // namespace tally
