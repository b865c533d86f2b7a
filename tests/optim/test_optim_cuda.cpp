// The fused CUDA multi-tensor optimizer kernels against the CPU loops (label gpu: skipped
// without a device): SGD, Adam, AdamW, AdamW8bit, clip_grad_norm_ and GradScaler over > 100
// tensors of odd sizes (1, 3, 1000, 65537 elements), so the table holds many tensors and chunks.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

#include "memory/memory.h"
#include "optim/adam.h"
#include "optim/adamw8bit.h"
#include "optim/clip_grad.h"
#include "optim/grad_scaler.h"
#include "optim/multi_tensor.h"
#include "optim/sgd.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using testing::close_pointwise;
using testing::kGpu;
using testing::rand_tensor;

constexpr double kTol = 1e-6;
const int64_t kSizes[] = {1, 3, 1000, 65537, 7, 130};

// The same parameters on both devices.
struct Params {
  std::vector<Tensor> cpu, gpu;
  explicit Params(int n = 104, uint64_t seed = 1) {
    for (int i = 0; i < n; ++i) {
      const Tensor c = rand_tensor({kSizes[i % 6]}, DType::float32, seed + i);
      Tensor g = ops::to(c, kGpu, DType::float32);
      Tensor cc = ops::clone(c);
      cc.requires_grad_(true);
      g.requires_grad_(true);
      cpu.push_back(cc);
      gpu.push_back(g);
    }
  }
  // Fresh random gradients (the same on both devices); every 7th parameter gets none.
  void grads(uint64_t seed, double lo = -1, double hi = 1) {
    for (size_t i = 0; i < cpu.size(); ++i) {
      if (i % 7 == 6) {
        cpu[i].set_grad(Tensor());
        gpu[i].set_grad(Tensor());
        continue;
      }
      const Tensor g = rand_tensor(cpu[i].sizes(), DType::float32, seed * 1000 + i, lo, hi);
      cpu[i].set_grad(g);
      gpu[i].set_grad(ops::to(g, kGpu, DType::float32));
    }
  }
  void expect_equal(const char* what) {
    for (size_t i = 0; i < cpu.size(); ++i)
      EXPECT_TRUE(close_pointwise(gpu[i], cpu[i], kTol)) << what << " param " << i;
  }
};

using Factory = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;

void run_both(const Factory& make, const char* what, int steps = 4) {
  Params p;
  auto oc = make(p.cpu);
  auto og = make(p.gpu);
  for (int s = 0; s < steps; ++s) {
    p.grads(s + 1);
    oc->step();
    og->step();
  }
  p.expect_equal(what);
  for (size_t i = 0; i < p.cpu.size(); ++i)
    for (const auto& [name, t] : oc->state(i).tensors) {
      const Tensor& tg = og->state(i).tensors.at(name);
      EXPECT_TRUE(tg.is_cuda());
      EXPECT_EQ(tg.storage().category(), memory::Category::optimizer_state);
      EXPECT_TRUE(close_pointwise(tg, t, kTol)) << what << " state " << name << " of param " << i;
    }
}

// A factory of Opt (SGD, Adam, AdamW) with options `o`.
template <class Opt, class Options>
Factory of(const Options& o) {
  return [o](std::vector<Tensor> ps) { return std::make_unique<Opt>(std::move(ps), o); };
}

TEST(CudaOptim, SGDVariantsMatchTheCpu) {
  REQUIRE_GPU();
  // Plain; momentum, maximizing; momentum with dampening and weight decay; Nesterov with
  // weight decay.
  const optim::SGDOptions variants[] = {
      {.lr = 0.05},
      {.lr = 0.05, .momentum = 0.9, .maximize = true},
      {.lr = 0.05, .momentum = 0.9, .dampening = 0.2, .weight_decay = 0.01},
      {.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true}};
  for (const optim::SGDOptions& o : variants) run_both(of<optim::SGD>(o), "SGD");
}

TEST(CudaOptim, AdamAndAdamWMatchTheCpu) {
  REQUIRE_GPU();
  run_both(of<optim::Adam>(optim::AdamOptions{.lr = 0.01}), "Adam");
  run_both(of<optim::AdamW>(optim::AdamOptions{.lr = 0.01, .weight_decay = 0.05}), "AdamW");
  run_both(of<optim::Adam>(optim::AdamOptions{.lr = 0.01, .weight_decay = 0.05, .maximize = true}),
           "Adam");
  run_both(of<optim::AdamW>(optim::AdamOptions{.lr = 0.01, .weight_decay = 0.05, .amsgrad = true}),
           "AdamW");
  // capturable: the step counted on the device, the bias corrections taken from it there.
  run_both(
      of<optim::AdamW>(optim::AdamOptions{.lr = 0.01, .weight_decay = 0.05, .capturable = true}),
      "AdamW");
  run_both(of<optim::Adam>(optim::AdamOptions{
               .lr = 0.01, .weight_decay = 0.05, .amsgrad = true, .capturable = true}),
           "Adam");
}

TEST(CudaOptim, AdamW8bitMatchesTheCpu) {
  REQUIRE_GPU();
  // min_8bit_size 1000: the 1000- and 65537-element parameters get 8-bit state (short last
  // blocks; the 65537's second chunk holds one element), the others AdamW's float32 state.
  // The codes must match exactly (one code apart is an error of 1 / 255 > kTol).
  for (const int64_t bs : {64, 128, 256, 512, 1024, 4096}) {
    const optim::AdamW8bitOptions q{.block_size = bs, .min_8bit_size = 1000};
    run_both(
        [q](std::vector<Tensor> ps) {
          return std::make_unique<optim::AdamW8bit>(
              std::move(ps), optim::AdamOptions{.lr = 0.01, .weight_decay = 0.05}, q);
        },
        "AdamW8bit");
  }
  Params p;
  optim::AdamW8bit opt(p.gpu, optim::AdamOptions{.lr = 0.01},
                       optim::AdamW8bitOptions{.min_8bit_size = 1000});
  p.grads(1);
  auto& alloc = memory::get_allocator(kGpu);
  const int64_t before = alloc.stats().cat_bytes(memory::Category::temporary).current;
  opt.step();
  EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::temporary).current, before);
  const Tensor& codes = opt.state(3).tensors.at("exp_avg");  // 65537 elements
  EXPECT_TRUE(codes.is_cuda());
  EXPECT_EQ(codes.dtype(), DType::uint8);
  EXPECT_EQ(opt.state(3).tensors.at("exp_avg_absmax").sizes(), Shape{257});
}

TEST(CudaOptim, StepLeavesNoTemporaries) {
  REQUIRE_GPU();
  Params p;
  optim::Adam opt(p.gpu);
  p.grads(1);
  auto& alloc = memory::get_allocator(kGpu);
  const int64_t before = alloc.stats().cat_bytes(memory::Category::temporary).current;
  opt.step();
  EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::temporary).current, before);
  EXPECT_GT(alloc.stats().cat_bytes(memory::Category::optimizer_state).current, 0);
}

TEST(CudaOptim, ClipGradNormMatchesTheCpu) {
  REQUIRE_GPU();
  for (double norm_type : {2.0, 1.0, 3.0, optim::kInfNorm}) {
    for (double max_norm : {0.5, 1e6}) {
      Params p;
      p.grads(3);
      const Tensor nc = optim::clip_grad_norm_(p.cpu, max_norm, norm_type);
      const Tensor ng = optim::clip_grad_norm_(p.gpu, max_norm, norm_type);
      EXPECT_TRUE(ng.is_cuda());
      EXPECT_EQ(ng.dim(), 0);
      EXPECT_NEAR(ng.item(), nc.item(), kTol * std::abs(nc.item())) << "norm " << norm_type;
      for (size_t i = 0; i < p.cpu.size(); ++i) {
        if (p.cpu[i].grad().defined()) {
          EXPECT_TRUE(close_pointwise(p.gpu[i].grad(), p.cpu[i].grad(), kTol))
              << "norm " << norm_type << " grad " << i;
        }
      }
    }
  }
}

TEST(CudaOptim, GradScalerMatchesTheCpuAndSkipsOnInf) {
  REQUIRE_GPU();
  Params p;
  optim::SGDOptions o;
  o.lr = 0.1;
  optim::SGD oc(p.cpu, o), og(p.gpu, o);
  optim::GradScalerOptions so;
  so.init_scale = 1024;
  so.growth_interval = 2;
  optim::GradScaler sc(so), sg(so);
  for (int s = 0; s < 3; ++s) {
    p.grads(s + 10, -1000, 1000);
    if (s == 1) {           // an inf deep in the list (a late chunk of a big tensor)
      const size_t k = 99;  // 65537 elements
      ASSERT_EQ(p.cpu[k].numel(), 65537);
      Tensor gc = ops::clone(p.cpu[k].grad());
      ops::fill_(ops::narrow(gc, 0, 65536, 1), INFINITY);
      p.cpu[k].set_grad(gc);
      p.gpu[k].set_grad(ops::to(gc, kGpu, DType::float32));
    }
    EXPECT_EQ(sc.step(oc), s != 1);
    EXPECT_EQ(sg.step(og), s != 1);
    for (size_t i = 0; i < p.cpu.size(); ++i) {
      if (p.cpu[i].grad().defined()) {
        EXPECT_TRUE(close_pointwise(p.gpu[i].grad(), p.cpu[i].grad(), kTol))
            << "step " << s << " grad " << i;
      }
    }
    sc.update();
    sg.update();
    EXPECT_EQ(sg.get_scale(), sc.get_scale());
    EXPECT_EQ(sg.scale_tensor(kGpu).item(), sc.get_scale());
  }
  EXPECT_EQ(sc.get_scale(), 512.0);  // 1024, backoff at step 1, one clean step since
  p.expect_equal("SGD under GradScaler");
  // scale(loss) on the GPU
  const Tensor loss = ops::full({}, 3.0, DType::float32, kGpu);
  const Tensor scaled = sg.scale(loss);
  EXPECT_TRUE(scaled.is_cuda());
  EXPECT_EQ(scaled.item(), 3.0 * 512);
}

// _amp_update_scale_ on the device against the CPU kernel, step by step through growth, a
// backoff, a growth that overflows float32 (kept), and growth_interval 1.
TEST(CudaOptim, AmpUpdateScaleMatchesTheCpu) {
  REQUIRE_GPU();
  struct Case {
    float scale;
    int64_t tracker, interval;
    std::vector<int> infs;  // found_inf per step
  };
  const std::vector<Case> cases{{1024.f, 0, 2, {0, 0, 1, 0, 0, 0}},
                                {3.0e38f, 1, 2, {0, 0, 0}},
                                {65536.f, 0, 1, {0, 1, 0, 1, 1}}};
  for (const Case& c : cases) {
    const Device cpu = Device::cpu();
    Tensor sc = ops::full({}, c.scale, DType::float32, cpu);
    Tensor tc = ops::full({}, static_cast<double>(c.tracker), DType::int64, cpu);
    Tensor sg = ops::to(sc, kGpu, DType::float32), tg = ops::to(tc, kGpu, DType::int64);
    for (size_t k = 0; k < c.infs.size(); ++k) {
      const Tensor fc = ops::full({1}, c.infs[k], DType::float32, cpu);
      optim::amp_update_scale_(sc, tc, fc, 2.0, 0.5, c.interval);
      optim::amp_update_scale_(sg, tg, ops::to(fc, kGpu, DType::float32), 2.0, 0.5, c.interval);
      EXPECT_EQ(ops::item(sg), ops::item(sc)) << "scale " << c.scale << " step " << k;
      EXPECT_EQ(ops::item(tg), ops::item(tc)) << "scale " << c.scale << " step " << k;
    }
  }
  EXPECT_THROW(optim::amp_update_scale_(ops::full({}, 1.0, DType::float32, kGpu),
                                        ops::full({}, 0.0, DType::int64, Device::cpu()),
                                        ops::full({1}, 0.0, DType::float32, kGpu), 2.0, 0.5, 2),
               std::invalid_argument);
}

}  // namespace
}  // namespace tally
