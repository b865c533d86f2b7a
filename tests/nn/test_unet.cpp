// The diffusion U-Net (nn/models/unet.h): shapes, parameter counts (ddpm-cifar is DDPM's 35.7M),
// the timestep embedding and the schedule's values, the registry's batch and loss, a
// checkpointed step equal to the plain one, a meta dry run, and errors naming the shapes.
#include <gtest/gtest.h>

#include <cmath>

#include "nn/checkpoint.h"
#include "nn/models/registry.h"
#include "nn/models/unet.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using nn::UNet;
using nn::UNetConfig;

// The tiny preset at 16x16 (attention at the top level then): cheap on the CPU.
UNetConfig small_config() {
  UNetConfig c = UNetConfig::preset("tiny");
  c.resolution = 16;
  return c;
}

TEST(UNet, ShapesAndParameterCounts) {
  manual_seed(0);
  UNet m(small_config());
  const Tensor x = randn({2, 3, 16, 16});
  const Tensor y = m(x, tally::tensor({3, 999}, TensorOptions{}.with_dtype(DType::int64)));
  EXPECT_EQ(y.sizes(), (Shape{2, 3, 16, 16}));
  // Counted by hand from the structure (bench/models/unet.py's model has the same).
  EXPECT_EQ(UNet(UNetConfig::preset("tiny")).num_parameters(), 702499);
  // At 16x16 the three attention blocks of 16x16 have 32 channels where they had 64
  // (4c^2 + 6c parameters each).
  EXPECT_EQ(m.num_parameters(), 702499 - 3 * (4 * 64 * 64 + 6 * 64) + 3 * (4 * 32 * 32 + 6 * 32));
  EXPECT_EQ(m.get_submodule<nn::AttnBlock>("down.0.attns.0").channels, 32);
  EXPECT_EQ(m.get_submodule<nn::ResBlock>("up.1.blocks.0").in_channels, 96);  // 64 + skip 32
  EXPECT_EQ(m.get_submodule<nn::ResBlock>("up.1.blocks.1").in_channels, 64);  // 32 + conv_in's
}

TEST(UNet, DdpmCifarIsDdpmsSizeAndRunsOnMeta) {
  const Device meta = Device::meta();
  nn::BuildOnDevice on(meta);
  UNet m(UNetConfig::preset("ddpm-cifar"));
  EXPECT_EQ(m.num_parameters(), 35746307);  // DDPM's CIFAR-10 model: 35.7M
  const Tensor x0 = ops::empty({1, 3, 32, 32}, DType::float32, meta);
  const Tensor t = ops::empty({1}, DType::int64, meta);
  Tensor loss = nn::ddpm_loss(m, x0, x0, t);
  EXPECT_EQ(loss.numel(), 1);
  loss.backward();
  EXPECT_EQ(m.conv_in->weight.grad().device(), meta);
}

TEST(UNet, TimestepEmbeddingAndSchedule) {
  const Tensor t = tally::tensor({0, 10}, TensorOptions{}.with_dtype(DType::int64));
  const std::vector<double> e = nn::timestep_embedding(t, 8, DType::float64).tolist();
  // t = 0: sin 0 then cos 1; t = 10, frequency i of 4: 10000^(-i/3).
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(e[static_cast<size_t>(i)], 0.0);
    EXPECT_EQ(e[static_cast<size_t>(4 + i)], 1.0);
    const double arg = 10.0 * std::pow(10000.0, -i / 3.0);
    EXPECT_NEAR(e[static_cast<size_t>(8 + i)], std::sin(arg), 1e-12);
    EXPECT_NEAR(e[static_cast<size_t>(12 + i)], std::cos(arg), 1e-12);
  }
  const auto [a, b] = nn::ddpm_schedule();
  ASSERT_EQ(a.size(), 1000u);
  EXPECT_DOUBLE_EQ(a[0] * a[0], 1.0 - 1e-4);
  EXPECT_NEAR(a[999] * a[999], 4.0358e-5, 1e-8);  // DDPM's alphas_cumprod[-1]
  EXPECT_NEAR(a[500] * a[500] + b[500] * b[500], 1.0, 1e-15);
}

TEST(UNet, RegistryBatchCarriesX0EpsAndTimesteps) {
  const nn::ModelEntry& e = nn::model_entry("unet");
  const nn::ModelOptions o = nn::resolve_options(e, {.image_size = 16});
  const data::Example b = e.synthetic_batch(o, 3, 1, 5);
  EXPECT_EQ(b.input.sizes(), (Shape{3, 6, 16, 16}));
  ASSERT_EQ(b.target.sizes(), (Shape{3}));
  EXPECT_EQ(b.target.dtype(), DType::int64);
  for (double v : b.target.tolist()) {
    EXPECT_GE(v, 0);
    EXPECT_LT(v, 1000);
  }
  // eps (channels 3..5) is N(0, 1): mean near 0, variance near 1 over 2304 values.
  const Tensor eps = b.input.narrow(1, 3, 3).to(DType::float64);
  EXPECT_NEAR(eps.mean().item(), 0.0, 0.1);
  EXPECT_NEAR((eps * eps).mean().item(), 1.0, 0.1);
  // Another step: other examples and other noise.
  const data::Example c = e.synthetic_batch(o, 3, 2, 5);
  EXPECT_NE(c.input.to(DType::float64).sum().item(), b.input.to(DType::float64).sum().item());
}

// The loss equals mse(model(x_t, t), eps) written out, and a checkpointed step ("blocks" and
// "selective") gives the same loss and gradients as the plain one.
TEST(UNet, LossAndCheckpointedStepEqualPlain) {
  manual_seed(1);
  const nn::ModelEntry& e = nn::model_entry("unet");
  const nn::ModelOptions o = nn::resolve_options(e, {.image_size = 16});
  std::shared_ptr<nn::Module> m = e.build(o);
  auto& unet = dynamic_cast<UNet&>(*m);
  const data::Example b = e.synthetic_batch(o, 2, 0, 3);

  const auto step = [&] {
    m->zero_grad();
    Tensor loss = e.loss(*m, b);
    loss.backward();
    std::vector<Tensor> grads{loss.detach()};
    for (const Tensor& p : m->parameters()) grads.push_back(p.grad());
    return grads;
  };
  const std::vector<Tensor> plain = step();

  {
    NoGradGuard no_grad;
    const Tensor x0 = b.input.narrow(1, 0, 3), eps = b.input.narrow(1, 3, 3);
    const std::vector<double> t = b.target.tolist();
    const auto [sa, s1a] = nn::ddpm_schedule();
    const Tensor a = tally::tensor({sa[static_cast<size_t>(t[0])], sa[static_cast<size_t>(t[1])]})
                         .view({2, 1, 1, 1});
    const Tensor s = tally::tensor({s1a[static_cast<size_t>(t[0])], s1a[static_cast<size_t>(t[1])]})
                         .view({2, 1, 1, 1});
    const Tensor d = unet(x0 * a + eps * s, b.target) - eps;
    EXPECT_NEAR((d * d).mean().item(), plain[0].item(), 1e-6);
  }

  for (const char* spec : {"blocks", "selective"}) {
    SCOPED_TRACE(spec);
    nn::enable_checkpointing(*m, nn::parse_checkpoint_spec(spec));
    EXPECT_EQ(nn::checkpoint_block_count(*m), 12);  // 8 ResBlocks, 4 AttnBlocks
    nn::reset_checkpoint_stats();
    const std::vector<Tensor> ckpt = step();
    EXPECT_EQ(nn::checkpoint_stats().segments, 12);
    ASSERT_EQ(ckpt.size(), plain.size());
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_EQ(ckpt[i].tolist(), plain[i].tolist()) << i;
  }
  nn::enable_checkpointing(*m, {});
}

TEST(UNet, BadInputsNameTheShapes) {
  UNet m(small_config());
  const Tensor t = tally::tensor({1, 2}, TensorOptions{}.with_dtype(DType::int64));
  testing::expect_error<std::invalid_argument>(
      [&] {
        (void)m(randn({2, 4, 16, 16}), t);
      },
      {"expected x [B, 3, 16, 16], got [2, 4, 16, 16]"});
  testing::expect_error<std::invalid_argument>(
      [&] {
        (void)m(randn({2, 3, 16, 16}), t.view({2, 1}));
      },
      {"timesteps t [2]"});
  UNetConfig odd = small_config();
  odd.num_groups = 5;
  EXPECT_THROW(UNet{odd}, std::invalid_argument);
  EXPECT_THROW(UNetConfig::preset("huge"), std::invalid_argument);
}

}  // namespace
}  // namespace tally
