// CUDA graphs (tensor/cuda/graph.h) on device 0 (label gpu; skipped without a device, except the
// error a build or a machine without CUDA gives): a captured training step replays to the same
// bits as the same step run op by op, its memory lives in a graph-private pool that snapshots
// and memory_summary show and that nothing else reuses, and what a replay cannot repeat is
// refused while capturing, leaving the graph empty and the device usable.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "memory/memory.h"
#include "optim/adam.h"
#include "optim/grad_scaler.h"
#include "optim/sgd.h"
#include "tensor/cuda/graph.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using testing::kGpu;
using testing::rand_tensor;

constexpr int64_t kBatch = 64, kIn = 96, kHidden = 256, kClasses = 10;

// A two-layer classifier's parameters, the same on every call with the same seed.
struct Mlp {
  std::vector<Tensor> params;
  explicit Mlp(uint64_t seed) {
    const std::vector<Shape> shapes{{kHidden, kIn}, {kHidden},           {kHidden},
                                    {kHidden},      {kClasses, kHidden}, {kClasses}};
    for (size_t i = 0; i < shapes.size(); ++i) {
      Tensor p = ops::to(rand_tensor(shapes[i], DType::float32, seed + i, -0.1, 0.1), kGpu,
                         DType::float32);
      p.requires_grad_(true);
      params.push_back(p);
    }
  }
  Tensor loss(const Tensor& x, const Tensor& y) const {
    Tensor h = gelu(linear(x, params[0], params[1]));
    h = layer_norm(h, {kHidden}, params[2], params[3]);
    return cross_entropy(linear(h, params[4], params[5]), y);
  }
};

// Batch k of the run: inputs and labels made on the CPU, the same for both runs. Batch 3 of an
// fp16 run is huge: its activations overflow, so the GradScaler skips that step.
Tensor batch_x(int k, bool fp16 = false) {
  const double hi = fp16 && k == 3 ? 1e30 : 1.0;
  return ops::to(rand_tensor({kBatch, kIn}, DType::float32, 1000 + k, -hi, hi), kGpu,
                 DType::float32);
}
Tensor batch_y(int k) {
  std::vector<double> labels(kBatch);
  for (int64_t i = 0; i < kBatch; ++i) labels[static_cast<size_t>(i)] = (i * 7 + k * 3) % kClasses;
  return ops::from_vector(labels, {kBatch}, DType::int64, kGpu);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const std::vector<double> va = ops::to_vector(a), vb = ops::to_vector(b);
  return va.size() == vb.size() &&
         std::memcmp(va.data(), vb.data(), va.size() * sizeof(double)) == 0;
}

using MakeOpt = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;

// Trains two copies for `steps` steps: one op by op, one with a warm-up step and then a
// captured step replayed; between replays, other tensors are allocated and freed (they must
// never land on the graph's memory). Every loss and, at the end, every parameter must agree
// bit for bit. fp16: under autocast with a capturable GradScaler, one step skipped.
void expect_replay_matches(const MakeOpt& make, const char* what, bool fp16 = false,
                           int steps = 6) {
  Mlp eager(1), graphed(1);
  auto opt_e = make(eager.params);
  auto opt_g = make(graphed.params);
  const optim::GradScalerOptions so{
      .init_scale = 1024, .growth_interval = 2, .enabled = fp16, .capturable = true};
  optim::GradScaler scaler_e(so), scaler_g(so);
  auto step = [fp16](const Mlp& m, optim::Optimizer& opt, optim::GradScaler& scaler,
                     const Tensor& x, const Tensor& y) {
    opt.zero_grad(true);
    Tensor loss;
    {
      AutocastGuard ac(DeviceType::cuda, DType::float16, fp16);
      loss = m.loss(x, y);
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    return loss;
  };
  std::vector<double> eager_losses, eager_scales;
  for (int k = 0; k < steps; ++k) {
    eager_losses.push_back(ops::item(step(eager, *opt_e, scaler_e, batch_x(k, fp16), batch_y(k))));
    eager_scales.push_back(scaler_e.get_scale());
  }
  if (fp16) {
    EXPECT_EQ(eager_scales[3], eager_scales[2] / 2) << what << ": step 3 was not skipped";
  }

  // The graphed copy: static inputs, one eager warm-up step, then the capture.
  const Tensor x = batch_x(0, fp16), y = batch_y(0);
  EXPECT_EQ(ops::item(step(graphed, *opt_g, scaler_g, x, y)), eager_losses[0]) << what;
  cuda::Graph g;
  Tensor loss;
  g.capture([&] { loss = step(graphed, *opt_g, scaler_g, x, y); });
  ASSERT_TRUE(g.captured());
  memory::CachingAllocator& alloc = memory::get_allocator(kGpu);
  std::vector<std::pair<uintptr_t, uintptr_t>> pool_ranges;
  for (const memory::SegmentInfo& s : alloc.snapshot().segments)
    if (s.pool_id == g.pool()) pool_ranges.emplace_back(s.address, s.address + s.total_size);
  ASSERT_FALSE(pool_ranges.empty()) << what;
  for (int k = 1; k < steps; ++k) {
    ops::copy_(x, batch_x(k, fp16));
    ops::copy_(y, batch_y(k));
    g.replay();
    const double l = ops::item(loss), want = eager_losses[static_cast<size_t>(k)];
    EXPECT_TRUE(l == want || (std::isnan(l) && std::isnan(want)))
        << what << " step " << k << ": " << l << " replayed, " << want << " eager";
    EXPECT_EQ(scaler_g.get_scale(), eager_scales[static_cast<size_t>(k)]) << what << " step " << k;
    // Tensors made between replays stay out of the pool.
    for (int j = 0; j < 8; ++j) {
      const Tensor t = ops::empty({(j + 1) * 100000}, DType::float32, kGpu);
      const auto a = reinterpret_cast<uintptr_t>(t.data_ptr());
      for (const auto& [lo, hi] : pool_ranges)
        EXPECT_FALSE(a >= lo && a < hi) << what << ": a tensor made between replays took the "
                                        << "graph's memory";
    }
  }
  for (size_t i = 0; i < eager.params.size(); ++i)
    EXPECT_TRUE(same_bits(graphed.params[i], eager.params[i])) << what << " param " << i;
}

TEST(CudaGraph, ReplayedStepsEqualEagerStepsBitForBit) {
  REQUIRE_GPU();
  expect_replay_matches(
      [](std::vector<Tensor> ps) {
        return std::make_unique<optim::SGD>(std::move(ps),
                                            optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
      },
      "SGD momentum");
  expect_replay_matches(
      [](std::vector<Tensor> ps) {
        return std::make_unique<optim::AdamW>(
            std::move(ps),
            optim::AdamOptions{.lr = 1e-3, .weight_decay = 0.01, .capturable = true});
      },
      "AdamW capturable");
  // fp16 with a capturable GradScaler: the skip and the scale are decided on the device.
  expect_replay_matches(
      [](std::vector<Tensor> ps) {
        return std::make_unique<optim::SGD>(std::move(ps),
                                            optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
      },
      "SGD momentum fp16", true);
  expect_replay_matches(
      [](std::vector<Tensor> ps) {
        return std::make_unique<optim::AdamW>(
            std::move(ps),
            optim::AdamOptions{.lr = 1e-3, .weight_decay = 0.01, .capturable = true});
      },
      "AdamW capturable fp16", true);
}

TEST(CudaGraph, PoolIsShownAndGivenBackAfterReset) {
  REQUIRE_GPU();
  memory::CachingAllocator& alloc = memory::get_allocator(kGpu);
  Mlp m(3);
  optim::SGD opt(m.params, {.lr = 0.01});
  const Tensor x = batch_x(0), y = batch_y(0);
  auto step = [&] {
    opt.zero_grad(true);
    Tensor loss = m.loss(x, y);
    loss.backward();
    opt.step();
    return loss;
  };
  step();
  // The captured optimizer step copies its chunk table from host memory the graph keeps: from
  // the pinned caching allocator, tagged workspace, until the graph is reset.
  memory::CachingAllocator& pinned = memory::get_pinned_allocator();
  auto pinned_workspace = [&] {
    return pinned.stats().cat_bytes(memory::Category::workspace).current;
  };
  const int64_t pinned_before = pinned_workspace();
  auto g = std::make_unique<cuda::Graph>();
  Tensor loss;
  g->capture([&] { loss = step(); });
  EXPECT_GT(pinned_workspace(), pinned_before);
  bool listed = false;
  for (const memory::PoolInfo& p : alloc.graph_pools()) {
    if (p.id != g->pool()) continue;
    listed = true;
    EXPECT_EQ(p.use_count, 1);
    EXPECT_GT(p.allocated, 0u);  // the loss and the gradients outlive the capture
    EXPECT_GE(p.reserved, p.allocated);
  }
  EXPECT_TRUE(listed);
  EXPECT_NE(alloc.memory_summary().find("Graph pool " + std::to_string(g->pool())),
            std::string::npos);
  g->replay();
  const memory::MempoolId pool = g->pool();
  g.reset();  // the graph's use ends; its live blocks (loss, gradients) keep the segments
  EXPECT_EQ(pinned_workspace(), pinned_before);
  loss = Tensor();
  opt.zero_grad(true);
  memory::empty_cache(kGpu);
  for (const memory::PoolInfo& p : alloc.graph_pools()) EXPECT_NE(p.id, pool);
  for (const memory::SegmentInfo& s : alloc.snapshot().segments) EXPECT_NE(s.pool_id, pool);
}

// What a replay cannot repeat is refused during the capture; the graph stays empty, the
// allocator stops serving the pool, and the device works on.
TEST(CudaGraph, RefusesHostSynchronisationAndRandomNumbers) {
  REQUIRE_GPU();
  const Tensor x = batch_x(0);
  ops::item(ops::sum(x));  // the reduction's first call happens outside
  const std::vector<std::pair<const char*, std::function<void()>>> cases{
      {"item", [&] { (void)ops::item(ops::sum(x)); }},
      {"randn", [&] { (void)ops::randn({4}, DType::float32, kGpu); }},
      {"dropout", [&] { (void)dropout(x, 0.5); }},
  };
  for (const auto& [name, fn] : cases) {
    cuda::Graph g;
    try {
      g.capture(fn);
      ADD_FAILURE() << name << " was captured";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("inside a CUDA graph capture on cuda:0"),
                std::string::npos)
          << name << ": " << e.what();
    }
    EXPECT_FALSE(g.captured()) << name;
    EXPECT_FALSE(cuda::is_capturing(0)) << name;
    EXPECT_FALSE(memory::get_allocator(kGpu).capturing()) << name;
    EXPECT_THROW(g.replay(), std::logic_error);
    EXPECT_EQ(ops::item(ops::sum(ops::full({3}, 2.0, DType::float32, kGpu))), 6.0) << name;
  }
  cuda::Graph g;
  g.capture_begin(0);
  EXPECT_THROW(g.capture_begin(0), std::logic_error);
  cuda::Graph other;
  EXPECT_THROW(other.capture_begin(0), std::logic_error);  // one capture per device at a time
  g.capture_end();
  EXPECT_TRUE(g.captured());
  g.replay();                                          // an empty graph replays
  EXPECT_THROW(g.capture_begin(0), std::logic_error);  // reset() first
}

// Without a device (or without CUDA in the build) a capture is refused at once, naming why.
TEST(CudaGraph, WithoutADeviceCaptureIsAClearError) {
  if (memory::cuda_available()) GTEST_SKIP() << "a CUDA device is present";
  cuda::Graph g;
  try {
    g.capture_begin(0);
    ADD_FAILURE() << "a capture began without a device";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("built without CUDA") != std::string::npos ||
                msg.find("no CUDA device 0") != std::string::npos)
        << msg;
  }
  EXPECT_FALSE(g.captured());
  EXPECT_FALSE(cuda::is_capturing(0));
}

}  // namespace
}  // namespace tally
