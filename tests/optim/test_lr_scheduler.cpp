// LR schedules: the lr sequences they set, against PyTorch's closed forms worked out by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "optim/lr_scheduler.h"
#include "optim/sgd.h"
#include "optim_testing.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using namespace optim;

// The lr the optimizer sees at epochs 0..n-1 (the constructor sets epoch 0).
template <typename S>
std::vector<double> sequence(S& sched, Optimizer& opt, int n) {
  std::vector<double> out;
  for (int i = 0; i < n; ++i) {
    if (i > 0) sched.step();
    EXPECT_EQ(sched.last_epoch(), i);
    EXPECT_DOUBLE_EQ(sched.get_last_lr().at(0), opt.get_lr());
    out.push_back(opt.get_lr());
  }
  return out;
}

void expect_seq(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12) << "epoch " << i;
}

SGDOptions lr(double v) {
  SGDOptions o;
  o.lr = v;
  return o;
}

TEST(LRScheduler, StepLR) {
  Tensor p = testing::param({1});
  SGD opt({p}, lr(1.0));
  StepLR s(opt, 2, 0.5);
  expect_seq(sequence(s, opt, 7), {1, 1, 0.5, 0.5, 0.25, 0.25, 0.125});
}

TEST(LRScheduler, CosineAnnealing) {
  Tensor p = testing::param({1});
  SGD opt({p}, lr(1.0));
  CosineAnnealingLR s(opt, 4, 0.0);
  const double r = std::sqrt(0.5);
  // (1 + cos(pi e / 4)) / 2; past T_max the closed form keeps going round the cosine
  expect_seq(sequence(s, opt, 7), {1, (1 + r) / 2, 0.5, (1 - r) / 2, 0, (1 - r) / 2, 0.5});
  Tensor q = testing::param({1});
  SGD opt2({q}, lr(0.5));
  CosineAnnealingLR s2(opt2, 2, 0.1);
  expect_seq(sequence(s2, opt2, 3), {0.5, 0.3, 0.1});
}

TEST(LRScheduler, Lambda) {
  Tensor p = testing::param({1}), q = testing::param({1});
  SGD opt(std::vector<ParamGroup>{{{p}, {}}, {{q}, {{"lr", 0.2}}}}, lr(1.0));
  LambdaLR s(opt, [](int64_t e) { return 1.0 / (1 + e); });
  expect_seq(sequence(s, opt, 4), {1, 0.5, 1.0 / 3, 0.25});
  EXPECT_NEAR(opt.get_lr(1), 0.05, 1e-15);  // every group from its own base lr
  EXPECT_NEAR(s.get_last_lr().at(1), 0.05, 1e-15);
}

TEST(LRScheduler, WarmupCosineLikeNanoGPT) {
  Tensor p = testing::param({1});
  SGD opt({p}, lr(1.0));
  WarmupCosineLR s(opt, 2, 6, 0.1);
  // warmup (it+1)/3; then 0.1 + 0.9 (1 + cos(pi (it-2)/4)) / 2; min_lr after total_steps
  const double r = std::sqrt(0.5);
  expect_seq(sequence(s, opt, 9), {1.0 / 3, 2.0 / 3, 1.0, 0.1 + 0.45 * (1 + r), 0.55,
                                   0.1 + 0.45 * (1 - r), 0.1, 0.1, 0.1});
  s.set_last_epoch(4);
  EXPECT_NEAR(opt.get_lr(), 0.55, 1e-12);
  testing::expect_error<std::invalid_argument>([&] { WarmupCosineLR(opt, 5, 5, 0.0); },
                                               {"warmup_steps"});
}

}  // namespace
}  // namespace tally
