// Step-in-backward (optim/step_in_backward.h): each parameter is updated as soon as its
// gradient is accumulated, bitwise as a plain optimizer step would (AdamW, SGD with momentum,
// a GPT with a tied weight), the gradient is freed at once so the `gradient` category never
// holds more than one parameter's, and the hooks go away with the object.
#include <gtest/gtest.h>

#include "autograd/ops.h"
#include "memory/memory.h"
#include "nn/models/gpt.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "optim/step_in_backward.h"
#include "testing/mlp.h"

namespace tally {
namespace {

using testing::mlp_loss;
using testing::mlp_params;
using testing::values;
constexpr int64_t kHidden = 256, kBatch = 32;  // the MLP's sizes here

template <typename MakeOpt>
void expect_same_as_plain(MakeOpt make) {
  std::vector<Tensor> a = mlp_params(kHidden), b = mlp_params(kHidden);
  auto oa = make(a);
  auto ob = make(b);
  optim::StepInBackward sib(*ob);
  for (int s = 0; s < 4; ++s) {
    oa->zero_grad();
    mlp_loss(a, s, kBatch).backward();
    oa->step();
    mlp_loss(b, s, kBatch).backward();
    for (const Tensor& p : b) EXPECT_FALSE(p.grad().defined()) << "gradient freed after its step";
  }
  EXPECT_EQ(sib.updates(), 4 * 3);
  EXPECT_EQ(values(a), values(b));
}

TEST(StepInBackward, AdamWUpdatesBitwiseAsAPlainStep) {
  expect_same_as_plain([](const std::vector<Tensor>& p) {
    return std::make_unique<optim::AdamW>(p, optim::AdamOptions{.lr = 1e-2, .weight_decay = 0.1});
  });
}

TEST(StepInBackward, SgdWithMomentumUpdatesBitwiseAsAPlainStep) {
  expect_same_as_plain([](const std::vector<Tensor>& p) {
    return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  });
}

TEST(StepInBackward, TheGradientCategoryHoldsOneLayersGradientsAtMost) {
  const Device cpu = Device::cpu();
  auto peak_gradient = [&](bool in_backward) {
    std::vector<Tensor> p = mlp_params(kHidden);
    optim::SGD opt(p, {.lr = 0.1});
    std::unique_ptr<optim::StepInBackward> sib;
    if (in_backward) sib = std::make_unique<optim::StepInBackward>(opt);
    memory::reset_peak_memory_stats(cpu);
    mlp_loss(p, 0, kBatch).backward();
    if (!in_backward) opt.step();
    return memory::get_allocator(cpu)
        .stats()
        .category_bytes[static_cast<size_t>(memory::Category::gradient)]
        .peak;
  };
  const int64_t largest = 256 * 64 * 4;  // the first weight's gradient
  const int64_t plain = peak_gradient(false);
  const int64_t sib = peak_gradient(true);
  EXPECT_GE(plain, (256 * 64 + 256 + 10 * 256) * 4);
  // A Linear's backward returns its weight's and its bias's gradients at once: both are
  // `gradient` from then until their AccumulateGrad hands them to the optimizer.
  EXPECT_LE(sib, largest + 256 * 4 + 512);  // the two blocks, rounded
  EXPECT_GT(sib, 0);
}

TEST(StepInBackward, GptWithATiedWeightMatchesPlainSteps) {
  auto run = [](bool in_backward) {
    manual_seed(0);
    nn::GPT gpt(nn::GPTConfig::preset("tiny"));
    optim::AdamW opt(gpt.parameters(), optim::AdamOptions{.lr = 1e-3});
    std::unique_ptr<optim::StepInBackward> sib;
    if (in_backward) sib = std::make_unique<optim::StepInBackward>(opt);
    for (int s = 0; s < 2; ++s) {
      const Tensor x = ops::randint(0, 256, {2, 32}, DType::int64);
      opt.zero_grad();
      gpt(x, x).second.backward();
      if (!in_backward) opt.step();
    }
    return values(gpt.parameters());
  };
  EXPECT_EQ(run(true), run(false));
}

TEST(StepInBackward, HooksGoAwayWithTheObjectAndBadParametersAreErrors) {
  std::vector<Tensor> p = mlp_params(kHidden);
  optim::SGD opt(p, {.lr = 0.1});
  { optim::StepInBackward sib(opt); }
  mlp_loss(p, 0, kBatch).backward();
  for (const Tensor& t : p) EXPECT_TRUE(t.grad().defined()) << "no step, the gradient stays";
  const Tensor frozen = ops::randn({3});
  optim::SGD opt2(std::vector<Tensor>{frozen}, {.lr = 0.1});
  EXPECT_THROW(optim::StepInBackward{opt2}, std::invalid_argument);
  EXPECT_THROW(opt.step_param(99), std::out_of_range);
}

}  // namespace
}  // namespace tally
