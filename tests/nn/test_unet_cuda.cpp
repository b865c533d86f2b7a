// The diffusion U-Net on the GPU: one fp32 training step of the registry's "unet" (tiny) on
// CUDA matches the CPU (loss and every gradient, norm-wise relative error; TF32 off), and an
// fp16 autocast step gives a finite loss and a gradient for every parameter. Skips without a
// device.
#include <gtest/gtest.h>

#include <cmath>

#include "autograd/autocast.h"
#include "nn/models/registry.h"
#include "nn/models/unet.h"
#include "tensor/precision.h"
#include "testing/cuda_testing.h"

using namespace tally;
using namespace tally::nn;
using tally::testing::kCpu;
using tally::testing::kGpu;

namespace {
double rel_err(const Tensor& a, const Tensor& b) {
  const auto x = ops::to_vector(ops::to(a, kCpu, DType::float64));
  const auto y = ops::to_vector(ops::to(b, kCpu, DType::float64));
  if (x.size() != y.size()) return INFINITY;
  double d = 0, n = 0;
  for (size_t i = 0; i < x.size(); ++i) d += (x[i] - y[i]) * (x[i] - y[i]), n += y[i] * y[i];
  return n > 0 ? std::sqrt(d / n) : std::sqrt(d);
}

data::Example on(const data::Example& b, Device d) {
  return {ops::to(b.input, d, b.input.dtype()), ops::to(b.target, d, b.target.dtype())};
}
}  // namespace

TEST(UNetCuda, TinyStepMatchesCpu) {
  REQUIRE_GPU();
  set_allow_tf32(false);
  manual_seed(11);
  const ModelEntry& e = model_entry("unet");
  const ModelOptions o = resolve_options(e, {});
  std::shared_ptr<Module> cpu = e.build(o), gpu = e.build(o);
  gpu->load_state_dict(cpu->state_dict());
  gpu->to(kGpu);
  const data::Example b = e.synthetic_batch(o, 4, 0, 1);
  Tensor lc = e.loss(*cpu, b), lg = e.loss(*gpu, on(b, kGpu));
  lc.backward();
  lg.backward();
  EXPECT_LE(rel_err(lg, lc), 1e-5) << lg.item() << " vs " << lc.item();
  const auto pc = cpu->named_parameters(), pg = gpu->named_parameters();
  ASSERT_EQ(pc.size(), pg.size());
  for (size_t i = 0; i < pc.size(); ++i) {
    ASSERT_TRUE(pg[i].second.grad().defined()) << pg[i].first;
    EXPECT_LE(rel_err(pg[i].second.grad(), pc[i].second.grad()), 1e-4) << pc[i].first;
  }
  set_allow_tf32(true);
}

TEST(UNetCuda, Fp16AutocastStepIsFinite) {
  REQUIRE_GPU();
  manual_seed(12);
  const ModelEntry& e = model_entry("unet");
  const ModelOptions o = resolve_options(e, {});
  std::shared_ptr<Module> m = e.build(o);
  m->to(kGpu);
  const data::Example b = on(e.synthetic_batch(o, 4, 0, 2), kGpu);
  Tensor loss;
  {
    AutocastGuard autocast(DeviceType::cuda, DType::float16);
    loss = e.loss(*m, b);
  }
  EXPECT_TRUE(std::isfinite(loss.item()));
  loss.backward();
  for (const auto& [name, p] : m->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().dtype(), DType::float32) << name;
  }
}
