// inspect::LeakDetector on the CPU: a synthetic leak (a vector keeping a tensor each step) and
// memory_patterns' leak (a loss history of graph-holding losses) are found at this file's
// lines with their bytes per step; clean ResNet and GPT training loops (AdamW, a DataLoader,
// with and without autocast and a GradScaler) raise nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "inspect/leak_detector.h"
#include "memory/memory.h"
#include "nn/data/dataloader.h"
#include "nn/data/synthetic.h"
#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "optim/adam.h"
#include "optim/grad_scaler.h"

namespace tally {
namespace {

using inspect::Leak;
using inspect::LeakDetector;

constexpr const char* kThisFile = "tests/memory/test_leak_detector.cpp";
const Device cpu = Device::cpu();

TEST(LeakDetector, FindsATensorKeptEveryStepAtItsLine) {
  LeakDetector detector(cpu);  // warm-up 2, window 3: found at the 5th boundary
  std::vector<Tensor> kept;
  Tensor last;  // lives across steps, replaced each step: not a leak
  const uint32_t leak_line = __LINE__ + 6;
  for (int step = 1; step <= 8; ++step) {
    const Tensor x = randn({32, 32});
    last = matmul(x, x);
    {
      memory::PhaseScope phase("metrics");
      kept.push_back(full({256}, double(step)));  // 1 KiB a step, never freed
    }
    const std::vector<Leak> found = detector.step();
    if (step == 5) {
      ASSERT_EQ(found.size(), 1u) << detector.report();
      EXPECT_EQ(found[0].confirmed_step, 5);
    } else {
      EXPECT_TRUE(found.empty()) << "step " << step << "\n" << detector.report();
    }
  }
  ASSERT_TRUE(detector.found());
  const std::vector<Leak> leaks = detector.leaks();
  ASSERT_EQ(leaks.size(), 1u) << detector.report();
  const Leak& l = leaks[0];
  EXPECT_EQ(l.site.file, kThisFile);
  EXPECT_EQ(l.site.line, leak_line);
  EXPECT_EQ(l.site.phase, "metrics");
  EXPECT_EQ(l.site.location(), std::string(kThisFile) + ":" + std::to_string(leak_line));
  EXPECT_DOUBLE_EQ(l.bytes_per_step, 1024.0);
  EXPECT_EQ(l.live_bytes, 8 * 1024);
  EXPECT_EQ(l.live_blocks, 8);
  EXPECT_TRUE(l.growing);
  EXPECT_EQ(l.growing_since, 2);
  const std::string report = detector.report();
  EXPECT_NE(report.find("LEAK: 1.0 KiB per step"), std::string::npos) << report;
  EXPECT_NE(report.find(l.site.location()), std::string::npos) << report;
  const std::vector<inspect::LeakingLine> lines = detector.leaking_lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].location, l.site.location());

  // Freed, it stops growing: still reported, marked stopped, with its rate kept.
  kept.clear();
  EXPECT_TRUE(detector.step().empty());
  const Leak after = detector.leaks().at(0);
  EXPECT_FALSE(after.growing);
  EXPECT_EQ(after.live_bytes, 0);
  EXPECT_DOUBLE_EQ(after.bytes_per_step, 1024.0);
}

TEST(LeakDetector, GrowthThatStopsIsNoLeak) {
  // A cache that fills over the first steps (a prefetch queue, state built lazily) and then
  // stays: growth at fewer than `window` consecutive boundaries after warm-up.
  LeakDetector detector(cpu, {.warmup_steps = 1, .window = 3});
  std::vector<Tensor> cache;
  for (int step = 1; step <= 10; ++step) {
    if (cache.size() < 3) cache.push_back(zeros({1024}));
    detector.step();
  }
  EXPECT_FALSE(detector.found()) << detector.report();
  EXPECT_NE(detector.report().find("No leak found."), std::string::npos);
}

TEST(LeakDetector, OptionsAreChecked) {
  EXPECT_THROW(LeakDetector(cpu, {.window = 0}), std::invalid_argument);
  EXPECT_THROW(LeakDetector(cpu, {.warmup_steps = -1}), std::invalid_argument);
  LeakDetector short_run(cpu);
  short_run.step();
  EXPECT_NE(short_run.report().find("cannot show one"), std::string::npos) << short_run.report();
}

// ---------------------------------------------------------------- training loops

struct LoopOptions {
  bool amp = false;          // bf16 autocast + an enabled GradScaler
  bool keep_losses = false;  // memory_patterns' leak: history.push_back(loss), retain_graph
  int steps = 8;
};

// A tiny ResNet on a DataLoader (prefetching on its thread), AdamW; the detector told each
// step's end. Returns the model call's line through `call_line`.
void resnet_loop(LeakDetector& detector, const LoopOptions& o, uint32_t& call_line) {
  manual_seed(0);
  data::SyntheticImages images(64, {3, 16, 16}, 10, 1);
  data::DataLoaderOptions lo;
  lo.batch_size = 4;
  lo.shuffle = true;
  lo.seed = 1;
  data::DataLoader loader(images, lo);
  std::shared_ptr<nn::ResNetTiny> model = nn::resnet_tiny({.num_classes = 10});
  optim::AdamW opt(model->parameters(), optim::AdamOptions{.lr = 1e-3});
  optim::GradScaler scaler(optim::GradScalerOptions{.enabled = o.amp});
  std::vector<Tensor> history;
  int step = 0;
  while (step < o.steps) {
    for (const data::Example& batch : loader) {
      if (step == o.steps) break;
      opt.zero_grad(true);
      Tensor loss;
      {
        memory::PhaseScope phase("forward");
        AutocastGuard autocast(DeviceType::cpu, DType::bfloat16, o.amp);
        call_line = __LINE__ + 1;
        loss = cross_entropy((*model)(batch.input), batch.target);
      }
      {
        memory::PhaseScope phase("backward");
        scaler.scale(loss).backward(Tensor(), o.keep_losses);
      }
      scaler.step(opt);
      scaler.update();
      if (o.keep_losses) history.push_back(loss);
      ++step;
      detector.step();
    }
  }
}

void gpt_loop(LeakDetector& detector, const LoopOptions& o, uint32_t& call_line) {
  manual_seed(0);
  nn::GPT gpt(nn::GPTConfig::preset("tiny"));
  optim::AdamW opt(gpt.parameters(), optim::AdamOptions{.lr = 1e-3});
  optim::GradScaler scaler(optim::GradScalerOptions{.enabled = o.amp});
  std::vector<Tensor> history;
  Tensor loss_sum = zeros({});
  for (int step = 0; step < o.steps; ++step) {
    Tensor idx, tgt;
    {
      memory::CategoryScope input(memory::Category::input);
      idx = randint(0, 256, {2, 32});
      tgt = randint(0, 256, {2, 32});
    }
    opt.zero_grad(true);
    Tensor loss;
    {
      memory::PhaseScope phase("forward");
      AutocastGuard autocast(DeviceType::cpu, DType::bfloat16, o.amp);
      call_line = __LINE__ + 1;
      loss = gpt(idx, tgt).second;
    }
    {
      memory::PhaseScope phase("backward");
      scaler.scale(loss).backward(Tensor(), o.keep_losses);
    }
    scaler.step(opt);
    scaler.update();
    {
      NoGradGuard no_grad;
      loss_sum = add(loss_sum, loss.detach().to(DType::float32));  // replaced every step
    }
    if (o.keep_losses) history.push_back(loss);
    detector.step();
  }
}

class CleanLoop : public ::testing::TestWithParam<std::pair<std::string, bool>> {};

TEST_P(CleanLoop, RaisesNothing) {
  const auto& [model, amp] = GetParam();
  LeakDetector detector(cpu);
  uint32_t line = 0;
  if (model == "resnet")
    resnet_loop(detector, {.amp = amp}, line);
  else
    gpt_loop(detector, {.amp = amp}, line);
  EXPECT_EQ(detector.steps(), 8);
  EXPECT_FALSE(detector.found()) << detector.report();
}

INSTANTIATE_TEST_SUITE_P(Models, CleanLoop,
                         ::testing::Values(std::pair<std::string, bool>{"resnet", false},
                                           std::pair<std::string, bool>{"resnet", true},
                                           std::pair<std::string, bool>{"gpt", false},
                                           std::pair<std::string, bool>{"gpt", true}),
                         [](const auto& info) {
                           return info.param.first + (info.param.second ? "_amp" : "");
                         });

// memory_patterns' leak: the kept losses hold their graphs' saved activations. The detector
// names the model call's line, with about the growth of memory_allocated per step.
TEST(LeakDetector, FindsALossHistoryThatKeepsGraphs) {
  for (const std::string model : {"gpt", "resnet"}) {
    SCOPED_TRACE(model);
    LeakDetector detector(cpu);
    uint32_t line = 0;
    const LoopOptions o{.keep_losses = true, .steps = 7};
    if (model == "gpt")
      gpt_loop(detector, o, line);
    else
      resnet_loop(detector, o, line);
    ASSERT_TRUE(detector.found()) << detector.report();
    const std::vector<inspect::LeakingLine> lines = detector.leaking_lines();
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(lines[0].location, std::string(kThisFile) + ":" + std::to_string(line))
        << detector.report();
    EXPECT_GT(lines[0].sites, 1);  // the model's modules and ops, all at its call
    EXPECT_GT(lines[0].bytes_per_step, 1024.0);
    // The rest (the inputs that the graphs save; for the ResNet, cross_entropy, a raw op
    // without a site of its own) is small next to the model's activations.
    double total = 0;
    for (const inspect::LeakingLine& l : lines) total += l.bytes_per_step;
    EXPECT_GT(lines[0].bytes_per_step, 0.8 * total) << detector.report();
  }
}

}  // namespace
}  // namespace tally
