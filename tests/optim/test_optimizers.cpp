// SGD, Adam and AdamW on the CPU against PyTorch's update equations (float64 references and
// hand-derived constants), their state (lazy, tagged optimizer_state), zero_grad, state_dict
// and the errors for bad parameters.
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "memory/memory.h"
#include "optim/adam.h"
#include "optim/adamw8bit.h"
#include "optim/sgd.h"
#include "optim_testing.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using optim::Adam;
using optim::AdamOptions;
using optim::AdamW;
using optim::SGD;
using optim::SGDOptions;
using testing::near_rel;
using testing::param;
using testing::set_grad;

const std::vector<double> kP0 = {1.0, -2.0, 3.0};
const std::vector<double> kG = {0.5, 0.25, -1.0};

// Three SGD steps with the constant gradient kG from kP0: the hand-derived totals.
std::vector<double> sgd3(const SGDOptions& o) {
  Tensor p = param(kP0);
  SGD opt({p}, o);
  for (int s = 0; s < 3; ++s) {
    set_grad(p, kG);
    opt.step();
  }
  return ops::to_vector(p);
}

TEST(SGD, PlainMovesAgainstTheGradient) {
  SGDOptions o;
  o.lr = 0.1;
  // p - 3 * 0.1 * g
  EXPECT_TRUE(near_rel(param(sgd3(o)), {0.85, -2.075, 3.3}, 1e-6));
}

TEST(SGD, MomentumHandConstants) {
  SGDOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  // buf: g, 1.9g, 2.71g -> p0 - 0.1 * 5.61 g
  std::vector<double> p = sgd3(o);
  EXPECT_NEAR(p[0], 1.0 - 0.561 * 0.5, 1e-6);
  EXPECT_NEAR(p[2], 3.0 + 0.561, 1e-6);
  o.dampening = 0.5;  // buf: g (first step undamped), 1.4g, 1.76g -> 4.16g
  p = sgd3(o);
  EXPECT_NEAR(p[0], 1.0 - 0.416 * 0.5, 1e-6);
  o.dampening = 0;
  o.nesterov = true;  // g + 0.9 buf: 1.9g, 2.71g, 3.439g -> 8.049g
  p = sgd3(o);
  EXPECT_NEAR(p[0], 1.0 - 0.8049 * 0.5, 1e-6);
  EXPECT_NEAR(p[1], -2.0 - 0.8049 * 0.25, 1e-6);
}

TEST(SGD, WeightDecayAndMaximizeHandConstants) {
  SGDOptions o;
  o.lr = 0.1;
  o.weight_decay = 0.1;  // p <- 0.99 p - 0.1 g: 0.94, 0.8806, 0.821794
  EXPECT_NEAR(sgd3(o)[0], 0.821794, 1e-6);
  o.weight_decay = 0;
  o.maximize = true;
  EXPECT_TRUE(near_rel(param(sgd3(o)), {1.15, -1.925, 2.7}, 1e-6));
}

TEST(SGD, AllOptionsMatchTheFloat64Reference) {
  struct Case {
    double momentum, dampening, wd;
    bool nesterov, maximize;
  };
  for (const Case& c : {Case{0, 0, 0, false, false}, Case{0.9, 0, 0, false, false},
                        Case{0.9, 0.3, 0.01, false, false}, Case{0.8, 0, 0.05, true, false},
                        Case{0.5, 0.1, 0.02, false, true}}) {
    SGDOptions o;
    o.lr = 0.05;
    o.momentum = c.momentum;
    o.dampening = c.dampening;
    o.weight_decay = c.wd;
    o.nesterov = c.nesterov;
    o.maximize = c.maximize;
    Tensor a = param({0.3, -1.2, 2.5, 0.0}), b = param({4.0, -0.5});
    SGD opt({a, b}, o);
    testing::RefSGD ra{o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov, o.maximize};
    testing::RefSGD rb = ra;
    std::vector<double> pa = {0.3, -1.2, 2.5, 0.0}, pb = {4.0, -0.5};
    for (int s = 0; s < 4; ++s) {
      const std::vector<double> ga = {0.1 * (s + 1), -0.7, 0.3 / (s + 1), 1.5 - s},
                                gb = {-0.2 * s, 0.9};
      set_grad(a, ga);
      set_grad(b, gb);
      opt.step();
      ra.step(pa, ga);
      rb.step(pb, gb);
      EXPECT_TRUE(near_rel(a, pa, 1e-6)) << "momentum " << c.momentum << " step " << s;
      EXPECT_TRUE(near_rel(b, pb, 1e-6)) << "momentum " << c.momentum << " step " << s;
    }
  }
}

TEST(SGD, ParamsWithoutGradAreLeftAlone) {
  Tensor a = param({1, 2}), b = param({3, 4});
  SGDOptions o;
  o.lr = 1;
  o.momentum = 0.9;
  SGD opt({a, b}, o);
  set_grad(a, {1, 1});
  const uint64_t vb = b.storage().version(), va = a.storage().version();
  opt.step();
  EXPECT_TRUE(near_rel(a, {0, 1}, 0));
  EXPECT_TRUE(near_rel(b, {3, 4}, 0));
  EXPECT_GT(a.storage().version(), va);  // in-place updates bump the version
  EXPECT_EQ(b.storage().version(), vb);
  EXPECT_TRUE(opt.state(0).tensors.count("momentum_buffer"));
  EXPECT_FALSE(opt.state(1).tensors.count("momentum_buffer"));
}

TEST(Adam, ConstantGradientStepsByLrHandConstants) {
  // With a constant gradient, m_hat = g and v_hat = g^2 exactly at every step, so each step
  // moves by lr * g / (|g| + eps) = lr * sign(g) (to 1e-8).
  Tensor p = param(kP0);
  AdamOptions o;
  o.lr = 0.1;
  Adam opt({p}, o);
  for (int s = 0; s < 3; ++s) {
    set_grad(p, kG);
    opt.step();
  }
  EXPECT_TRUE(near_rel(p, {0.7, -2.3, 3.3}, 1e-6));
  EXPECT_EQ(opt.state(0).step, 3);
  // m = (1 - 0.9^3) g, v = (1 - 0.999^3) g^2
  EXPECT_TRUE(
      near_rel(opt.state(0).tensors.at("exp_avg"), {0.271 * 0.5, 0.271 * 0.25, -0.271}, 1e-7));
  EXPECT_TRUE(near_rel(opt.state(0).tensors.at("exp_avg_sq"),
                       {0.002997001 * 0.25, 0.002997001 * 0.0625, 0.002997001}, 1e-9));
}

TEST(AdamW, DecoupledDecayHandConstant) {
  // step 1: p * (1 - lr * wd) - lr * sign(g) = 0.99 - 0.1
  Tensor p = param({1.0});
  AdamOptions o;
  o.lr = 0.1;
  o.weight_decay = 0.1;
  AdamW opt({p}, o);
  set_grad(p, {0.5});
  opt.step();
  EXPECT_NEAR(p.item(), 0.89, 1e-6);
  EXPECT_STREQ(opt.name(), "AdamW");
  EXPECT_EQ(AdamW::default_options().weight_decay, 1e-2);
}

TEST(Adam, AllVariantsMatchTheFloat64Reference) {
  struct Case {
    bool decoupled;
    double wd;
    bool amsgrad, maximize;
  };
  for (const Case& c :
       {Case{false, 0, false, false}, Case{false, 0.1, false, false}, Case{true, 0.1, false, false},
        Case{false, 0.05, true, false}, Case{true, 0.01, true, true}}) {
    AdamOptions o;
    o.lr = 0.01;
    o.beta1 = 0.8;
    o.beta2 = 0.95;
    o.eps = 1e-6;
    o.weight_decay = c.wd;
    o.amsgrad = c.amsgrad;
    o.maximize = c.maximize;
    Tensor a = param({0.3, -1.2, 2.5, 0.7});
    std::unique_ptr<optim::Optimizer> opt;
    if (c.decoupled)
      opt = std::make_unique<AdamW>(std::vector<Tensor>{a}, o);
    else
      opt = std::make_unique<Adam>(std::vector<Tensor>{a}, o);
    testing::RefAdam ref{o.lr,           o.beta1,     o.beta2,   o.eps,
                         o.weight_decay, c.decoupled, c.amsgrad, c.maximize};
    std::vector<double> pa = {0.3, -1.2, 2.5, 0.7};
    for (int s = 0; s < 5; ++s) {
      // gradients that shrink, so that amsgrad's running max matters
      const std::vector<double> ga = {0.9 / (s + 1), -0.4 * (s % 2 ? 1 : -1), 0.05 * s,
                                      2.0 / (1 + s * s)};
      set_grad(a, ga);
      opt->step();
      ref.step(pa, ga);
      EXPECT_TRUE(near_rel(a, pa, 2e-6))
          << opt->name() << " wd " << c.wd << " amsgrad " << c.amsgrad << " step " << s;
    }
    EXPECT_EQ(opt->state(0).tensors.count("max_exp_avg_sq"), c.amsgrad ? 1u : 0u);
  }
}

TEST(Adam, Float64ParametersFollowTheReferenceClosely) {
  Tensor a = param({0.3, -1.2}, DType::float64);
  AdamOptions o;
  o.lr = 0.01;
  Adam opt({a}, o);
  testing::RefAdam ref;
  ref.lr = 0.01;
  std::vector<double> pa = {0.3, -1.2};
  for (int s = 0; s < 3; ++s) {
    set_grad(a, {0.1 * s - 0.05, 0.3});
    opt.step();
    ref.step(pa, {0.1 * s - 0.05, 0.3});
  }
  EXPECT_TRUE(near_rel(a, pa, 1e-13));
}

TEST(Adam, MixedDtypesAndStepCountsBucketSeparately) {
  // b misses the first step, so at step 2 a and b have different bias corrections; c is
  // float64: three buckets, each following its own reference.
  Tensor a = param({0.5}), b = param({-0.5}), c = param({2.0}, DType::float64);
  AdamOptions o;
  o.lr = 0.05;
  Adam opt({a, b, c}, o);
  testing::RefAdam ra, rb, rc;
  ra.lr = rb.lr = rc.lr = 0.05;
  std::vector<double> pa = {0.5}, pb = {-0.5}, pc = {2.0};
  set_grad(a, {0.3});
  set_grad(c, {-0.2});
  opt.step();
  ra.step(pa, {0.3});
  rc.step(pc, {-0.2});
  for (int s = 0; s < 2; ++s) {
    set_grad(a, {0.1 - s});
    set_grad(b, {0.7 + s});
    set_grad(c, {0.4});
    opt.step();
    ra.step(pa, {0.1 - s});
    rb.step(pb, {0.7 + s});
    rc.step(pc, {0.4});
  }
  EXPECT_EQ(opt.state(0).step, 3);
  EXPECT_EQ(opt.state(1).step, 2);
  EXPECT_TRUE(near_rel(a, pa, 1e-6));
  EXPECT_TRUE(near_rel(b, pb, 1e-6));
  EXPECT_TRUE(near_rel(c, pc, 1e-13));
  EXPECT_EQ(opt.state(2).tensors.at("exp_avg").dtype(), DType::float64);
}

TEST(Optimizer, ParamGroupsHaveTheirOwnOptions) {
  Tensor a = param({1.0}), b = param({1.0});
  SGDOptions d;
  d.lr = 0.1;
  SGD opt(std::vector<optim::ParamGroup>{{{a}, {}}, {{b}, {{"lr", 0.5}}}}, d);
  EXPECT_DOUBLE_EQ(opt.get_lr(0), 0.1);
  EXPECT_DOUBLE_EQ(opt.get_lr(1), 0.5);
  set_grad(a, {1});
  set_grad(b, {1});
  opt.step();
  EXPECT_NEAR(a.item(), 0.9, 1e-7);
  EXPECT_NEAR(b.item(), 0.5, 1e-7);
  opt.set_lr(0.25, 0);
  opt.step();
  EXPECT_NEAR(a.item(), 0.65, 1e-7);
  EXPECT_THROW(opt.get_lr(2), std::out_of_range);
  testing::expect_error<std::invalid_argument>(
      [&] {
        SGD(std::vector<optim::ParamGroup>{{{a}, {{"betas", 0.5}}}}, d);
      },
      {"unknown", "betas"});
}

// PyTorch's checks (`not 0.0 <= lr`, ...): negative values and NaN are both invalid.
TEST(Optimizer, RejectsNegativeAndNanHyperparameters) {
  Tensor a = param({1.0});
  struct Case {
    std::function<void(double)> make;  // builds an optimizer with the value in one field
    std::initializer_list<const char*> parts;
  };
  const Case cases[] = {
      {[&](double v) { SGD({a}, SGDOptions{.lr = v}); }, {"SGD", "learning rate"}},
      {[&](double v) { SGD({a}, SGDOptions{.momentum = v}); }, {"SGD", "momentum"}},
      {[&](double v) { Adam({a}, AdamOptions{.lr = v}); }, {"Adam", "learning rate"}},
      {[&](double v) { AdamW({a}, AdamOptions{.eps = v}); }, {"AdamW", "epsilon"}},
      {[&](double v) { Adam({a}, AdamOptions{.weight_decay = v}); }, {"Adam", "weight_decay"}},
  };
  for (const Case& c : cases)
    for (double bad : {-0.1, std::nan("")})
      testing::expect_error<std::invalid_argument>([&] { c.make(bad); }, c.parts);
}

TEST(Optimizer, StateIsLazyAndTaggedOptimizerState) {
  auto& alloc = memory::get_allocator(Device::cpu());
  auto cat = [&] { return alloc.stats().cat_bytes(memory::Category::optimizer_state).current; };
  auto tmp = [&] { return alloc.stats().cat_bytes(memory::Category::temporary).current; };
  const int64_t base = cat();
  {
    Tensor a = param(std::vector<double>(3, 1.0)), b = param(std::vector<double>(300, 1.0));
    Adam opt({a, b});
    EXPECT_EQ(cat(), base);  // nothing before the first step
    set_grad(a, std::vector<double>(3, 0.1));
    set_grad(b, std::vector<double>(300, 0.1));
    const int64_t tmp_base = tmp();
    opt.step();
    int64_t state_bytes = 0;
    for (size_t i = 0; i < 2; ++i)
      for (const auto& [name, t] : opt.state(i).tensors) {
        EXPECT_EQ(t.storage().category(), memory::Category::optimizer_state) << name;
        state_bytes += static_cast<int64_t>(t.storage().block_bytes());
      }
    EXPECT_GT(cat() - base, 0);
    EXPECT_EQ(cat() - base, state_bytes);
    // 12 bytes -> one 512-byte block, 1200 -> 1536; exp_avg and exp_avg_sq of each.
    EXPECT_EQ(state_bytes, 2 * (512 + 1536));
    opt.step();  // no new state
    EXPECT_EQ(cat() - base, state_bytes);
    EXPECT_EQ(tmp(), tmp_base);  // no temporaries left behind
  }
  EXPECT_EQ(cat(), base);
}

TEST(Optimizer, ZeroGrad) {
  Tensor a = param({1, 2});
  SGD opt({a}, SGDOptions{});
  set_grad(a, {3, 4});
  const Tensor g = a.grad();
  opt.zero_grad(false);
  EXPECT_TRUE(a.grad().is_same(g));  // same tensor, zeroed in place
  EXPECT_TRUE(near_rel(a.grad(), {0, 0}, 0));
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  opt.step();  // no gradients: nothing happens
  EXPECT_TRUE(near_rel(a, {1, 2}, 0));
}

TEST(Optimizer, RejectsBadParametersNamingTheIndex) {
  Tensor a = param({1, 2}), b = param({1, 2, 3});
  Tensor i = ops::from_vector({1, 2}, {2}, DType::int64);
  testing::expect_error<std::invalid_argument>(
      [&] {
        SGD({a, i}, SGDOptions{});
      },
      {"parameter 1", "int64"});
  testing::expect_error<std::invalid_argument>(
      [&] {
        SGD({a, a}, SGDOptions{});
      },
      {"parameter 1", "more than once"});
  SGD opt({a, b}, SGDOptions{});
  b.set_grad(ops::zeros({3}, DType::float64));
  testing::expect_error<std::invalid_argument>([&] { opt.step(); },
                                               {"parameter 1", "float64", "[3]"});
  AdamOptions bad;
  bad.beta1 = 1.0;
  testing::expect_error<std::invalid_argument>([&] { Adam({a}, bad); }, {"beta1"});
  SGDOptions nest;
  nest.nesterov = true;
  testing::expect_error<std::invalid_argument>([&] { SGD({a}, nest); }, {"Nesterov"});
}

TEST(Optimizer, StateDictRoundTrips) {
  Tensor a = param({0.3, -1.2}), b = param({2.0});
  AdamOptions o;
  o.lr = 0.01;
  Adam opt({a, b}, o);
  set_grad(a, {0.1, 0.2});
  set_grad(b, {-0.3});
  opt.step();
  opt.step();
  const optim::OptimizerStateDict sd = opt.state_dict();
  EXPECT_EQ(sd.tensors.size(), 4u);
  EXPECT_TRUE(sd.tensors.count("state.1.exp_avg_sq"));
  EXPECT_EQ(sd.scalars.at("state.0.step"), 2);
  EXPECT_DOUBLE_EQ(sd.scalars.at("param_groups.0.lr"), 0.01);

  // A second optimizer over copies of the parameters continues exactly like the first.
  Tensor a2 = param(ops::to_vector(a)), b2 = param(ops::to_vector(b));
  Adam opt2({a2, b2});
  opt2.load_state_dict(sd);
  EXPECT_DOUBLE_EQ(opt2.get_lr(), 0.01);
  EXPECT_EQ(opt2.state(1).step, 2);
  EXPECT_EQ(opt2.state(0).tensors.at("exp_avg").storage().category(),
            memory::Category::optimizer_state);
  set_grad(a2, {0.1, 0.2});
  set_grad(b2, {-0.3});
  opt.step();
  opt2.step();
  EXPECT_TRUE(near_rel(a2, ops::to_vector(a), 0));
  EXPECT_TRUE(near_rel(b2, ops::to_vector(b), 0));

  Tensor c = param({1, 2, 3});
  Adam opt3({c, b2});
  testing::expect_error<std::invalid_argument>([&] { opt3.load_state_dict(sd); },
                                               {"state.0.exp_avg", "[3]"});
}

// capturable=True keeps each parameter's step on its device and takes the bias corrections
// from it: the same numbers as the host's count, bit for bit, and a state dict that reads it.
TEST(Adam, CapturableCountsOnTheDeviceWithTheSameResults) {
  for (const bool amsgrad : {false, true}) {
    for (const bool decoupled : {false, true}) {
      AdamOptions o{.lr = 0.05, .weight_decay = 0.01, .amsgrad = amsgrad};
      Tensor a = param({0.3, -1.2, 0.7}), b = param({0.3, -1.2, 0.7});
      AdamOptions oc = o;
      oc.capturable = true;
      std::unique_ptr<optim::Optimizer> plain, capt;
      if (decoupled) {
        plain = std::make_unique<AdamW>(std::vector<Tensor>{a}, o);
        capt = std::make_unique<AdamW>(std::vector<Tensor>{b}, oc);
      } else {
        plain = std::make_unique<Adam>(std::vector<Tensor>{a}, o);
        capt = std::make_unique<Adam>(std::vector<Tensor>{b}, oc);
      }
      for (int step = 0; step < 5; ++step) {
        const std::vector<double> g{0.1 * step - 0.2, 0.5, -0.05 * step};
        set_grad(a, g);
        set_grad(b, g);
        plain->step();
        capt->step();
        // A scheduler's change reaches the device's copy of the lr (a graph reads it there).
        plain->set_lr(0.05 / (step + 2));
        capt->set_lr(0.05 / (step + 2));
      }
      EXPECT_TRUE(near_rel(b, ops::to_vector(a), 0)) << "amsgrad " << amsgrad;
      const Tensor device_step = capt->state(0).tensors.at("device_step");
      EXPECT_EQ(device_step.dim(), 0);
      EXPECT_EQ(device_step.storage().category(), memory::Category::optimizer_state);
      EXPECT_EQ(ops::item(device_step), 5.0);
      EXPECT_FALSE(plain->state(0).tensors.count("device_step"));
    }
  }
  // The state dict's step is the device's count (a graph's replays move only that one), and it
  // round-trips: the loaded optimizer counts on from it, on the device and on the host.
  Tensor b = param({1.0, 2.0});
  Adam capt({b}, {.lr = 0.1, .capturable = true});
  set_grad(b, {0.3, -0.1});
  capt.step();
  ops::fill_(capt.state(0).tensors.at("device_step"), 7.0);
  const optim::OptimizerStateDict sd = capt.state_dict();
  EXPECT_EQ(sd.scalars.at("state.0.step"), 7.0);
  EXPECT_EQ(sd.scalars.at("param_groups.0.capturable"), 1.0);
  ASSERT_EQ(sd.tensors.count("state.0.device_step"), 1u);
  Tensor c = param(ops::to_vector(b));
  Adam resumed({c}, {.lr = 0.1});
  resumed.load_state_dict(sd);  // the saved options win, capturable included (as in PyTorch)
  set_grad(c, {0.2, 0.2});
  resumed.step();
  EXPECT_EQ(ops::item(resumed.state(0).tensors.at("device_step")), 8.0);
  EXPECT_EQ(resumed.state(0).step, 8);
  testing::expect_error<std::invalid_argument>(
      [&] { optim::AdamW8bit bad({param({1.0})}, {.lr = 0.1, .capturable = true}); },
      {"AdamW8bit", "capturable"});
}

// SGD's capturable: the lr read from the device's copy, which set_lr and a group's option keep
// equal to the host's; the same bits as the plain update.
TEST(SGD, CapturableReadsTheLrOnTheDevice) {
  Tensor a = param({0.3, -1.2, 0.7}), b = param({0.3, -1.2, 0.7});
  SGD plain({a}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
  SGD capt({b}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .capturable = true});
  for (int step = 0; step < 4; ++step) {
    set_grad(a, {0.2, -0.1 * step, 0.05});
    set_grad(b, {0.2, -0.1 * step, 0.05});
    plain.step();
    capt.step();
    plain.set_lr(0.1 / (step + 2));
    if (step == 1)
      capt.param_groups()[0].options["lr"] = 0.1 / (step + 2);  // set directly: still seen
    else
      capt.set_lr(0.1 / (step + 2));
  }
  EXPECT_TRUE(near_rel(b, ops::to_vector(a), 0));
  EXPECT_EQ(capt.state_dict().scalars.at("param_groups.0.capturable"), 1.0);
}

TEST(Optimizer, TrainsWithAutograd) {
  // Minimise sum((w - 3)^2) with SGD: w - 3 shrinks by 0.8 a step.
  Tensor w = param({0.0, 10.0});
  SGDOptions o;
  o.lr = 0.1;
  SGD opt({w}, o);
  for (int s = 0; s < 100; ++s) {
    opt.zero_grad();
    Tensor d = tally::sub(w, ops::full({2}, 3.0));
    tally::sum(tally::mul(d, d)).backward();
    opt.step();
  }
  EXPECT_TRUE(near_rel(w, {3.0, 3.0}, 1e-5));
}

}  // namespace
}  // namespace tally
