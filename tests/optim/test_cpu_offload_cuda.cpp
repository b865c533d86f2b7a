// CpuOffload (optim/cpu_offload.h) on the GPU (label gpu: skipped without a device): 20 steps of
// GPT-2 tiny and small with the state offloaded to pinned host memory against the same steps
// with AdamW on the device, in float32 (two runs) and under bf16 autocast (one backward feeding
// both optimizers); the state is pinned and tagged optimizer_state on the host, the gradients
// went out during backward, and a bfloat16 model trains against its float32 master weights
// (AdamW's moments, or AdamW8bit's); with overlap_with_forward, each forward reads the weights
// its pre-hooks copied back.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "memory/memory.h"
#include "nn/models/gpt.h"
#include "optim/adam.h"
#include "optim/clip_grad.h"
#include "optim/cpu_offload.h"
#include "tensor/pinned.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using testing::kGpu;

struct Run {
  std::vector<std::vector<double>> params;
  std::vector<double> losses;
  int64_t hooked = 0;
};

Run train(const std::string& preset, bool offload, int steps = 20) {
  manual_seed(0);
  nn::GPT gpt(nn::GPTConfig::preset(preset));
  gpt.to(kGpu);
  const optim::AdamOptions o{.lr = 1e-3, .beta2 = 0.95, .weight_decay = 0.1};
  std::unique_ptr<optim::Optimizer> opt;
  optim::CpuOffload* off = nullptr;
  if (offload) {
    auto c = std::make_unique<optim::CpuOffload>(gpt.parameters(), o);
    off = c.get();
    opt = std::move(c);
  } else {
    opt = std::make_unique<optim::AdamW>(gpt.parameters(), o);
  }
  Run r;
  for (int s = 0; s < steps; ++s) {
    manual_seed(1000 + s);
    const Tensor x = ops::randint(0, 256, {4, 64}, DType::int64, kGpu);
    opt->zero_grad();
    const Tensor loss = gpt(x, x).second;
    loss.backward();
    opt->step();
    r.losses.push_back(ops::item(loss));
  }
  for (const Tensor& p : gpt.parameters())
    r.params.push_back(ops::to_vector(ops::to(p, Device::cpu(), p.dtype())));
  if (off) {
    r.hooked = off->hooked_copies();
    const Tensor master = off->state(0).tensors.at("master");
    EXPECT_TRUE(ops::is_pinned(master));
    EXPECT_GT(
        memory::get_pinned_allocator().stats().cat_bytes(memory::Category::optimizer_state).current,
        0);
  }
  return r;
}

double max_abs_diff(const Run& a, const Run& b) {
  double worst = 0;
  for (size_t i = 0; i < a.params.size(); ++i)
    for (size_t j = 0; j < a.params[i].size(); ++j)
      worst = std::max(worst, std::abs(a.params[i][j] - b.params[i][j]));
  return worst;
}

void expect_equal_runs(const std::string& preset) {
  REQUIRE_GPU();
  const Run plain = train(preset, false), offloaded = train(preset, true);
  EXPECT_GT(offloaded.hooked, 0) << "gradients sent from the post-accumulate-grad hooks";
  // The host update equals the CUDA kernel's math (update_math.h), but backward is not
  // deterministic on the device (atomics in a few backward kernels, e.g. the embedding's), and
  // Adam turns a flipped rounding of a near-zero gradient into a step of about lr (after 20
  // steps of GPT small the offloaded run differed from a plain one by 1.4e-5 in fp32 and
  // 8.5e-3 under bf16 on an H100). So the offloaded run may differ from a plain one by as much
  // as plain runs differ among themselves, with room: the widest of three pairs.
  const Run plain2 = train(preset, false), plain3 = train(preset, false);
  const double noise = std::max(
      {max_abs_diff(plain, plain2), max_abs_diff(plain, plain3), max_abs_diff(plain2, plain3)});
  const double tol = std::max(1e-5, 4 * noise);
  EXPECT_LE(max_abs_diff(plain, offloaded), tol)
      << preset << "; two plain runs differ by " << noise;
  for (size_t s = 0; s < plain.losses.size(); ++s)
    EXPECT_NEAR(plain.losses[s], offloaded.losses[s], 1e-4) << "step " << s;
}

TEST(CpuOffloadCuda, TinyFloat32Equals20StepsOfAdamW) {
  expect_equal_runs("tiny");
}
TEST(CpuOffloadCuda, SmallFloat32Equals20StepsOfAdamW) {
  expect_equal_runs("small");
}
// Under bf16 autocast two runs drift apart faster than backward's nondeterminism shows between
// plain runs (sessions 45-47 on an H100: the offloaded run ~8.5e-3 from a plain one every time,
// plain pairs 1.1-1.8e-3), so there the comparison is of the updates alone: each step one
// model's backward (offloaded: its hooks send the gradients as backward makes them) feeds both
// optimizers, AdamW on the device reading a copy of the same gradients for a second model of the
// same initial weights. The weights then differ only by the update's rounding, host against
// device, and the plain model's loss (forward only) follows the offloaded one's. With `clip`,
// the offloaded optimizer clips by its own clip_grad_norm_ (the coefficient folded into the host
// update), AdamW by optim::clip_grad_norm_ on the device: the same norm (up to the reduction's
// order), the same steps, and no gradient sent twice.
void expect_equal_updates(const std::string& preset, bool bf16, int steps = 20, double clip = 0) {
  REQUIRE_GPU();
  const auto make = [&] {
    manual_seed(0);
    auto gpt = std::make_unique<nn::GPT>(nn::GPTConfig::preset(preset));
    gpt->to(kGpu);
    return gpt;
  };
  const std::unique_ptr<nn::GPT> offloaded = make(), plain = make();
  const std::vector<Tensor> ps = offloaded->parameters(), qs = plain->parameters();
  ASSERT_EQ(ps.size(), qs.size());
  const optim::AdamOptions o{.lr = 1e-3, .beta2 = 0.95, .weight_decay = 0.1};
  optim::CpuOffload off(ps, o);
  optim::AdamW adamw(qs, o);
  int clipped = 0;
  for (int s = 0; s < steps; ++s) {
    manual_seed(1000 + s);
    const Tensor x = ops::randint(0, 256, {4, 64}, DType::int64, kGpu);
    off.zero_grad();
    adamw.zero_grad();
    Tensor loss, plain_loss;
    {
      AutocastGuard ac(DeviceType::cuda, DType::bfloat16, bf16);
      loss = (*offloaded)(x, x).second;
      NoGradGuard no_grad;
      plain_loss = (*plain)(x, x).second;
    }
    loss.backward();
    {
      NoGradGuard no_grad;
      for (size_t i = 0; i < ps.size(); ++i)
        if (ps[i].grad().defined()) qs[i].set_grad(ps[i].grad().clone());
    }
    if (clip > 0) {
      const double host = ops::item(off.clip_grad_norm_(clip));
      const double device = ops::item(optim::clip_grad_norm_(qs, clip));
      EXPECT_NEAR(host, device, 1e-6 * device) << "step " << s;
      clipped += host > clip;
    }
    adamw.step();
    off.step();
    EXPECT_NEAR(ops::item(loss), ops::item(plain_loss), bf16 ? 1e-2 : 1e-4) << "step " << s;
  }
  EXPECT_GT(off.hooked_copies(), 0) << "gradients sent from the post-accumulate-grad hooks";
  if (clip > 0) {
    EXPECT_GT(clipped, 0) << "the clipping scaled no step";
    EXPECT_EQ(off.step_copies(), 0) << "gradients sent again at step()";
  }
  double worst = 0;
  size_t where = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    const std::vector<double> a = ops::to_vector(ops::to(ps[i], Device::cpu(), DType::float32));
    const std::vector<double> b = ops::to_vector(ops::to(qs[i], Device::cpu(), DType::float32));
    ASSERT_EQ(a.size(), b.size());
    for (size_t j = 0; j < a.size(); ++j)
      if (std::abs(a[j] - b[j]) > worst) {
        worst = std::abs(a[j] - b[j]);
        where = i;
      }
  }
  // 20 updates' roundings, host against device, of weights up to ~1 (float32's ulp: 1.2e-7).
  EXPECT_LE(worst, 1e-5) << preset << (bf16 ? " bf16" : " fp32") << ", parameter " << where;
}

TEST(CpuOffloadCuda, SmallBf16AutocastEquals20StepsOfAdamW) {
  expect_equal_updates("small", true);
}

TEST(CpuOffloadCuda, SmallBf16ClippedOnTheHostEquals20StepsOfClippedAdamW) {
  expect_equal_updates("small", true, 20, 0.1);
}

// A bfloat16 model: the device holds bfloat16 weights and gradients, the host float32 masters;
// the device's weights are the masters rounded (for AdamW8bit, by parallel_adamw8bit_16_ in the
// same pass as the update).
void expect_bf16_model_trains(const optim::CpuOffloadOptions& offload) {
  REQUIRE_GPU();
  manual_seed(0);
  nn::GPT gpt(nn::GPTConfig::preset("tiny"));
  gpt.to(kGpu, DType::bfloat16);
  optim::CpuOffload opt(gpt.parameters(), optim::AdamOptions{.lr = 1e-3}, offload);
  double first = 0, last = 0;
  for (int s = 0; s < 20; ++s) {
    manual_seed(7);  // one batch: the loss must fall
    const Tensor x = ops::randint(0, 256, {4, 64}, DType::int64, kGpu);
    opt.zero_grad();
    const Tensor loss = gpt(x, x).second;
    loss.backward();
    opt.step();
    (s == 0 ? first : last) = ops::item(loss);
  }
  EXPECT_LT(last, first);
  const std::vector<Tensor> ps = gpt.parameters();
  for (size_t i = 0; i < ps.size(); ++i) {
    const Tensor master = opt.state(i).tensors.at("master");
    EXPECT_EQ(master.dtype(), DType::float32);
    if (offload.adamw8bit && ps[i].numel() >= offload.quant.min_8bit_size) {
      EXPECT_EQ(opt.state(i).tensors.at("exp_avg").dtype(), DType::uint8) << "parameter " << i;
    }
    EXPECT_EQ(
        ops::to_vector(ops::to(master, Device::cpu(), DType::bfloat16)),
        ops::to_vector(ops::to(ps[i].reshape({ps[i].numel()}), Device::cpu(), DType::bfloat16)))
        << "parameter " << i;
  }
}

TEST(CpuOffloadCuda, Bfloat16ModelTrainsAgainstFloat32Masters) {
  expect_bf16_model_trains({});
}

TEST(CpuOffloadCuda, Bfloat16ModelTrainsWithEightBitMomentsOnTheHost) {
  expect_bf16_model_trains({.adamw8bit = true, .quant = {.block_size = 64, .min_8bit_size = 1024}});
}

// overlap_with_forward: the forward after a step runs the deferred updates in its pre-hooks, and
// Tally's stream waits for each bucket's copies back before the layer reads them. So its loss
// equals, bit for bit, a second forward over the same batch made once every copy is done (a
// missing wait would let the first read the old weights). A bfloat16 "small" GPT with clipping,
// whose step resends every gradient, so most updates wait for the forward; the loss falls.
TEST(CpuOffloadCuda, OverlapWithForwardReadsTheUpdatedWeights) {
  REQUIRE_GPU();
  manual_seed(0);
  const nn::GPTConfig cfg = nn::GPTConfig::preset("small");
  nn::GPT gpt(cfg);
  gpt.to(kGpu);
  optim::CpuOffload opt(gpt.parameters(), optim::AdamOptions{.lr = 1e-4});
  opt.keep_16bit_weights(gpt);
  opt.overlap_with_forward(gpt);
  manual_seed(7);  // one batch: the loss must fall
  // Tokens of the preset's vocabulary (an index past it is a NaN row on CUDA, not an error).
  const Tensor x = ops::randint(0, cfg.vocab_size, {4, cfg.block_size}, DType::int64, kGpu);
  double first = 0, last = 0;
  for (int s = 0; s < 10; ++s) {
    opt.zero_grad();
    const Tensor loss = gpt(x, x).second;
    const double read = ops::item(loss);
    EXPECT_EQ(opt.deferred_updates(), 0u) << "step " << s;
    const double again = ops::item(gpt(x, x).second);
    EXPECT_EQ(read, again) << "step " << s;
    loss.backward();
    optim::clip_grad_norm_(gpt.parameters(), 1.0);
    opt.step();
    (s == 0 ? first : last) = read;
  }
  EXPECT_GT(opt.updates_in_forward(), 0);
  EXPECT_LT(last, first);
  opt.finish_updates();
  const std::vector<Tensor> ps = gpt.parameters();
  for (size_t i = 0; i < ps.size(); ++i)
    EXPECT_EQ(
        ops::to_vector(ops::to(opt.state(i).tensors.at("master"), Device::cpu(), DType::bfloat16)),
        ops::to_vector(ops::to(ps[i].reshape({ps[i].numel()}), Device::cpu(), DType::bfloat16)))
        << "parameter " << i;
}

}  // namespace
}  // namespace tally
