// GradScaler on the CPU: scaling the loss through autograd, unscaling, skipping the step
// on inf/NaN with the scale backing off, growth after growth_interval clean steps, and its
// state_dict.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "optim/adam.h"
#include "optim/adamw8bit.h"
#include "optim/grad_scaler.h"
#include "optim/sgd.h"
#include "optim_testing.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using namespace optim;
using testing::near_rel;
using testing::param;
using testing::set_grad;

SGDOptions lr(double v) {
  SGDOptions o;
  o.lr = v;
  return o;
}

GradScalerOptions small(double init, int64_t interval = 2000) {
  GradScalerOptions o;
  o.init_scale = init;
  o.growth_interval = interval;
  return o;
}

TEST(GradScaler, DefaultsArePyTorchs) {
  GradScaler s;
  EXPECT_EQ(s.get_scale(), 65536.0);
  EXPECT_EQ(s.options().growth_factor, 2.0);
  EXPECT_EQ(s.options().backoff_factor, 0.5);
  EXPECT_EQ(s.options().growth_interval, 2000);
  EXPECT_TRUE(s.is_enabled());
}

TEST(GradScaler, ScaledLossGivesScaledGradientsAndStepUnscales) {
  // loss = sum(w * w): grad 2w, scaled by 8; the step sees 2w.
  Tensor w = param({1.0, -2.0});
  SGD opt({w}, lr(0.1));
  GradScaler scaler(small(8));
  const Tensor loss = tally::sum(tally::mul(w, w));
  const Tensor scaled = scaler.scale(loss);
  EXPECT_NEAR(scaled.item(), 5.0 * 8, 0);
  scaled.backward();
  EXPECT_TRUE(near_rel(w.grad(), {16, -32}, 0));
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_TRUE(near_rel(w.grad(), {2, -4}, 0));
  EXPECT_TRUE(near_rel(w, {0.8, -1.6}, 1e-7));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 1);
}

TEST(GradScaler, InfSkipsTheStepAndHalvesTheScale) {
  Tensor a = param({1.0, 2.0}), b = param({3.0});
  SGD opt({a, b}, lr(0.1));
  GradScaler scaler(small(1024));
  set_grad(a, {1.0, std::numeric_limits<double>::infinity()});
  set_grad(b, {4.0});
  EXPECT_FALSE(scaler.step(opt));
  EXPECT_TRUE(near_rel(a, {1.0, 2.0}, 0));  // unchanged
  EXPECT_TRUE(near_rel(b, {3.0}, 0));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 512.0);
  EXPECT_EQ(scaler.scale_tensor(Device::cpu()).item(), 512.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  // NaN the same way; then a clean step goes through with the new scale
  set_grad(a, {NAN, 0});
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 256.0);
  set_grad(a, {256, 512});
  set_grad(b, {0});
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_TRUE(near_rel(a, {0.9, 1.8}, 1e-7));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 256.0);
}

TEST(GradScaler, GrowsAfterGrowthIntervalCleanSteps) {
  Tensor a = param({1.0});
  SGD opt({a}, lr(0.0));
  GradScaler scaler(small(4, 3));
  auto clean = [&] {
    set_grad(a, {1.0});
    EXPECT_TRUE(scaler.step(opt));
    scaler.update();
  };
  clean();
  clean();
  EXPECT_EQ(scaler.get_scale(), 4.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 2);
  clean();
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  // an inf in between restarts the count
  clean();
  set_grad(a, {INFINITY});
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 4.0);
  clean();
  clean();
  EXPECT_EQ(scaler.get_scale(), 4.0);
  clean();
  EXPECT_EQ(scaler.get_scale(), 8.0);
}

TEST(GradScaler, UnscaleIsIdempotentPerStep) {
  Tensor a = param({1.0});
  SGD opt({a}, lr(1.0));
  GradScaler scaler(small(4));
  set_grad(a, {8.0});
  scaler.unscale_(opt);
  EXPECT_EQ(a.grad().item(), 2.0);
  scaler.unscale_(opt);  // no second division
  EXPECT_EQ(a.grad().item(), 2.0);
  EXPECT_TRUE(scaler.step(opt));  // no third
  EXPECT_EQ(a.item(), -1.0);
  EXPECT_THROW(scaler.step(opt), std::logic_error);
  scaler.update();
  set_grad(a, {8.0});
  scaler.unscale_(opt);  // a new step: divides again
  EXPECT_EQ(a.grad().item(), 2.0);
}

TEST(GradScaler, DisabledIsATransparentWrapper) {
  Tensor a = param({1.0});
  SGD opt({a}, lr(1.0));
  GradScalerOptions o;
  o.enabled = false;
  GradScaler scaler(o);
  const Tensor loss = tally::sum(tally::mul(a, a));
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  set_grad(a, {INFINITY});
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
}

// capturable: the skip and the next scale decided on the device (for CUDA graphs) give the host
// rule's parameters and scales bit for bit, through skipped steps (inf, NaN) and growth; Adam's
// device step count does not advance on a skipped step.
TEST(GradScaler, CapturableDecidesOnTheDeviceLikeTheHost) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::vector<double>> grads{{8, -4}, {inf, 1}, {16, 2}, {NAN, 0},
                                               {4, 4},  {2, -8},  {1, 1},  {-4, 2}};
  for (const bool adam : {false, true}) {
    Tensor a = param({1.0, -2.0}), b = param({1.0, -2.0});
    std::unique_ptr<Optimizer> host, dev;
    if (adam) {
      host = std::make_unique<Adam>(std::vector<Tensor>{a}, AdamOptions{.lr = 0.1});
      dev = std::make_unique<Adam>(std::vector<Tensor>{b},
                                   AdamOptions{.lr = 0.1, .capturable = true});
    } else {
      host = std::make_unique<SGD>(std::vector<Tensor>{a}, SGDOptions{.lr = 0.1, .momentum = 0.9});
      dev = std::make_unique<SGD>(std::vector<Tensor>{b},
                                  SGDOptions{.lr = 0.1, .momentum = 0.9, .capturable = true});
    }
    GradScaler hs(small(64, 2));
    GradScalerOptions o = small(64, 2);
    o.capturable = true;
    GradScaler ds(o);
    int stepped = 0;
    for (const auto& g : grads) {
      (void)hs.scale(tally::sum(a));  // makes the scale tensors, as a step's scale(loss) does
      (void)ds.scale(tally::sum(b));
      set_grad(a, g);
      set_grad(b, g);
      stepped += hs.step(*host);
      EXPECT_TRUE(ds.step(*dev));  // it cannot know on the host
      hs.update();
      ds.update();
      EXPECT_EQ(ds.get_scale(), hs.get_scale()) << "adam " << adam;
      EXPECT_EQ(ds.get_growth_tracker(), hs.get_growth_tracker()) << "adam " << adam;
    }
    EXPECT_EQ(stepped, 6);
    EXPECT_TRUE(near_rel(b, ops::to_vector(a), 0)) << "adam " << adam;
    if (adam) {
      EXPECT_EQ(ops::item(dev->state(0).tensors.at("device_step")), 6.0);
    }
    EXPECT_EQ(ds.state_dict().at("scale"), hs.state_dict().at("scale"));
  }
  // One device only; AdamW8bit cannot skip on the device.
  GradScalerOptions o;
  o.capturable = true;
  GradScaler ds(o);
  Tensor w = param({1.0});
  set_grad(w, {1.0});
  AdamW8bit q({w}, AdamOptions{.lr = 0.1});
  testing::expect_error<std::invalid_argument>([&] { ds.step(q); }, {"AdamW8bit", "capturable"});
}

TEST(GradScaler, StateDictAndErrors) {
  GradScaler a(small(1024, 7));
  Tensor p = param({1.0});
  SGD opt({p}, lr(0.0));
  EXPECT_THROW(a.update(), std::logic_error);  // nothing recorded
  set_grad(p, {1.0});
  a.step(opt);
  a.update();
  const auto sd = a.state_dict();
  EXPECT_EQ(sd.at("scale"), 1024.0);
  EXPECT_EQ(sd.at("_growth_tracker"), 1.0);
  EXPECT_EQ(sd.at("growth_interval"), 7.0);
  GradScaler b;
  b.load_state_dict(sd);
  EXPECT_EQ(b.get_scale(), 1024.0);
  EXPECT_EQ(b.get_growth_tracker(), 1);
  EXPECT_EQ(b.options().growth_interval, 7);
  b.update(3.0);
  EXPECT_EQ(b.get_scale(), 3.0);
  testing::expect_error<std::invalid_argument>([] { GradScaler(small(-1)); }, {"init_scale"});
}

}  // namespace
}  // namespace tally
