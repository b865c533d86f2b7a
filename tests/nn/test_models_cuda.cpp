// nn on the GPU: Module::to(cuda) keeps the parameter handles and their `parameter` tag,
// and one fp32 training step of resnet_tiny, gpt-tiny (plain and with the fused
// classifier) and the U-Net (tiny; and an fp16 autocast step is finite) on CUDA matches the CPU
// (loss and every gradient, norm-wise relative error), as does linear_cross_entropy alone in
// float32 and bf16 autocast. Skips without a device.
#include <gtest/gtest.h>

#include <cmath>

#include "autograd/autocast.h"
#include "nn/models/gpt.h"
#include "nn/models/registry.h"
#include "nn/models/resnet.h"
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

// Runs `step` (forward + loss) on both models, backward, and compares.
template <typename M, typename Step>
void compare_step(M& cpu, M& gpu, Step step) {
  Tensor lc = step(cpu, kCpu);
  Tensor lg = step(gpu, kGpu);
  lc.backward();
  lg.backward();
  EXPECT_LE(rel_err(lg, lc), 1e-5) << "loss " << lg.item() << " vs " << lc.item();
  auto pc = cpu.named_parameters(), pg = gpu.named_parameters();
  ASSERT_EQ(pc.size(), pg.size());
  for (size_t i = 0; i < pc.size(); ++i) {
    ASSERT_TRUE(pg[i].second.grad().defined()) << pg[i].first;
    EXPECT_LE(rel_err(pg[i].second.grad(), pc[i].second.grad()), 1e-4) << pc[i].first;
  }
}
}  // namespace

TEST(NNCuda, ToDeviceKeepsHandles) {
  REQUIRE_GPU();
  auto m = resnet_tiny({.num_classes = 10, .in_channels = 1});
  Tensor w = m->conv1->weight;
  m->to(kGpu);
  EXPECT_TRUE(w.is_same(m->conv1->weight));
  EXPECT_TRUE(w.is_cuda());
  EXPECT_EQ(w.storage().category(), memory::Category::parameter);
  EXPECT_TRUE(m->bn1->num_batches_tracked.is_cuda());
  EXPECT_EQ(m->bn1->num_batches_tracked.dtype(), DType::int64);
}

TEST(NNCuda, ResnetTinyStepMatchesCpu) {
  REQUIRE_GPU();
  manual_seed(3);
  auto cpu = resnet_tiny({.num_classes = 10, .in_channels = 1});
  auto gpu = resnet_tiny({.num_classes = 10, .in_channels = 1});
  gpu->load_state_dict(cpu->state_dict());
  gpu->to(kGpu);
  Generator g(4);
  const Tensor x = ops::randn({8, 1, 28, 28}, DType::float32, kCpu, &g);
  const Tensor y = ops::randint(0, 10, {8}, DType::int64, kCpu, &g);
  compare_step(*cpu, *gpu, [&](ResNetTiny& m, Device d) {
    return cross_entropy(m(ops::to(x, d, x.dtype())), ops::to(y, d, y.dtype()));
  });
  EXPECT_LE(rel_err(gpu->bn1->running_var, cpu->bn1->running_var), 1e-5);
  EXPECT_EQ(ops::item(gpu->bn1->num_batches_tracked), 1.0);
}

TEST(NNCuda, GptTinyStepMatchesCpu) {
  REQUIRE_GPU();
  manual_seed(5);
  GPT cpu(GPTConfig::preset("tiny"));
  GPT gpu(GPTConfig::preset("tiny"));
  gpu.load_state_dict(cpu.state_dict());
  gpu.to(kGpu);
  EXPECT_TRUE(gpu.lm_head->weight.is_same(gpu.transformer->wte->weight));
  Generator g(6);
  const Tensor idx = ops::randint(0, 256, {4, 32}, DType::int64, kCpu, &g);
  const Tensor tgt = ops::randint(0, 256, {4, 32}, DType::int64, kCpu, &g);
  compare_step(cpu, gpu, [&](GPT& m, Device d) {
    return m(ops::to(idx, d, idx.dtype()), ops::to(tgt, d, tgt.dtype())).second;
  });
}

TEST(NNCuda, GptTinyFusedClassifierStepMatchesCpu) {
  // GPTConfig::fused_classifier (linear_cross_entropy, 16-row chunks) on the GPU against the
  // same fused step on the CPU.
  REQUIRE_GPU();
  manual_seed(7);
  GPTConfig cfg = GPTConfig::preset("tiny");
  cfg.fused_classifier = true;
  cfg.fused_classifier_chunk_bytes = 16 * 256 * 4 * 2;
  GPT cpu(cfg);
  GPT gpu(cfg);
  gpu.load_state_dict(cpu.state_dict());
  gpu.to(kGpu);
  Generator g(8);
  const Tensor idx = ops::randint(0, 256, {4, 30}, DType::int64, kCpu, &g);
  Tensor tgt = ops::randint(0, 256, {4, 30}, DType::int64, kCpu, &g);
  ops::fill_(ops::narrow(ops::select(tgt, 0, 2), 0, 0, 5), -1.0);  // ignored rows
  compare_step(cpu, gpu, [&](GPT& m, Device d) {
    auto [logits, loss] = m(ops::to(idx, d, idx.dtype()), ops::to(tgt, d, tgt.dtype()));
    EXPECT_FALSE(logits.defined());
    return loss;
  });
}

TEST(NNCuda, LinearCrossEntropyMatchesCpu) {
  // The op alone, a vocabulary of 50257 (GPT-2's odd row stride), chunks that do not divide
  // N, ignored rows: float32, and bfloat16 under autocast (float32 loss).
  REQUIRE_GPU();
  const int64_t N = 100, C = 64, V = 50257;
  Generator g(9);
  const Tensor h = ops::randn({N, C}, DType::float32, kCpu, &g);
  const Tensor w = ops::mul(ops::randn({V, C}, DType::float32, kCpu, &g), 0.1);
  Tensor t = ops::randint(0, V, {N}, DType::int64, kCpu, &g);
  ops::fill_(ops::narrow(t, 0, 10, 7), -100.0);
  for (const bool bf16 : {false, true}) {
    for (const char* red : {"mean", "sum"}) {
      Tensor loss[2], gh[2], gw[2];
      for (int k = 0; k < 2; ++k) {
        const Device d = k == 0 ? kCpu : kGpu;
        Tensor hd = ops::to(h, d, h.dtype(), true), wd = ops::to(w, d, w.dtype(), true);
        hd.requires_grad_(true);
        wd.requires_grad_(true);
        {
          AutocastGuard autocast(d.type, DType::bfloat16, bf16);
          loss[k] = linear_cross_entropy(hd, wd, ops::to(t, d, t.dtype()), -100, red, 24);
        }
        loss[k].backward();
        gh[k] = hd.grad();
        gw[k] = wd.grad();
      }
      EXPECT_EQ(loss[1].dtype(), DType::float32);
      const double tol = bf16 ? 2e-2 : 1e-4;
      EXPECT_LE(rel_err(loss[1], loss[0]), bf16 ? 1e-3 : 1e-5) << red << " bf16 " << bf16;
      EXPECT_LE(rel_err(gh[1], gh[0]), tol) << red << " bf16 " << bf16;
      EXPECT_LE(rel_err(gw[1], gw[0]), tol) << red << " bf16 " << bf16;
    }
  }
}

TEST(NNCuda, GpuAllocationsCarryModulePath) {
  REQUIRE_GPU();
  auto m = resnet_tiny({.num_classes = 10, .in_channels = 1});
  m->to(kGpu);
  auto& alloc = memory::get_allocator(kGpu);
  alloc.record_memory_history(true);
  (*m)(ops::to(ops::randn({2, 1, 28, 28}), kGpu, DType::float32));
  bool found = false;
  for (const auto& e : alloc.history())
    found |= e.action == memory::TraceAction::alloc &&
             memory::interned(e.tag.module) == "layer2.0.conv1";
  alloc.record_memory_history(false);
  EXPECT_TRUE(found);
}

namespace {
data::Example on_device(const data::Example& b, Device d) {
  return {ops::to(b.input, d, b.input.dtype()), ops::to(b.target, d, b.target.dtype())};
}
}  // namespace

TEST(NNCuda, UNetTinyStepMatchesCpu) {
  REQUIRE_GPU();
  set_allow_tf32(false);
  manual_seed(11);
  const ModelEntry& e = model_entry("unet");
  const ModelOptions o = resolve_options(e, {});
  std::shared_ptr<Module> cpu = e.build(o), gpu = e.build(o);
  gpu->load_state_dict(cpu->state_dict());
  gpu->to(kGpu);
  const data::Example b = e.synthetic_batch(o, 4, 0, 1);
  compare_step(*cpu, *gpu, [&](Module& m, Device d) { return e.loss(m, on_device(b, d)); });
  set_allow_tf32(true);
}

TEST(NNCuda, UNetFp16AutocastStepIsFinite) {
  REQUIRE_GPU();
  manual_seed(12);
  const ModelEntry& e = model_entry("unet");
  const ModelOptions o = resolve_options(e, {});
  std::shared_ptr<Module> m = e.build(o);
  m->to(kGpu);
  const data::Example b = on_device(e.synthetic_batch(o, 4, 0, 2), kGpu);
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
