// Activation offload (autograd/offload.h, nn/offload.h) on the CPU: gradients are bitwise
// those of the run without it; what autograd saved is held as `offloaded` host copies, not
// `activation`; a tensor saved twice is copied once; groups prefetch in backward; the
// spec's spellings and errors; and a dry run replays it allocation for allocation.
#include <gtest/gtest.h>

#include "autograd/offload.h"
#include "autograd/ops.h"
#include "memory/estimate.h"
#include "memory/memory.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "nn/offload.h"
#include "tensor/pinned.h"

namespace tally {
namespace {

using memory::Category;

bool same(const Tensor& a, const Tensor& b) {
  return a.sizes() == b.sizes() && ops::to_vector(a) == ops::to_vector(b);
}

int64_t category_now(Device d, Category c) {
  return memory::get_allocator(d).stats().category_bytes[static_cast<size_t>(c)].current;
}

// y = relu(x @ w1^T) @ w2^T, summed: relu's output is saved by relu and by the second linear.
struct Mlp {
  Tensor w1, w2, x;
  Mlp() {
    manual_seed(3);
    {
      memory::CategoryScope params(Category::parameter);  // as a module's parameters are
      w1 = ops::randn({64, 32}).requires_grad_();
      w2 = ops::randn({16, 64}).requires_grad_();
    }
    x = ops::randn({128, 32});
  }
  Tensor forward() const { return linear(relu(linear(x, w1)), w2).sum(); }
};

TEST(SaveOnCpu, GradientsAreBitwiseThoseWithoutOffload) {
  Mlp m;
  m.forward().backward();
  const Tensor g1 = m.w1.grad().clone(), g2 = m.w2.grad().clone();
  m.w1.set_grad(Tensor());
  m.w2.set_grad(Tensor());
  Tensor loss;
  std::shared_ptr<ActivationOffloader> off;
  {
    SaveOnCpu scope;
    off = scope.offloader();
    loss = m.forward();
  }
  loss.backward();
  EXPECT_TRUE(same(m.w1.grad(), g1));
  EXPECT_TRUE(same(m.w2.grad(), g2));
  const OffloadStats s = off->stats();
  // Saved: x (linear 1), relu's output (relu and linear 2: one copy), w2 (kept: a parameter).
  EXPECT_EQ(s.tensors_offloaded, 2);
  EXPECT_EQ(s.tensors_deduplicated, 1);
  EXPECT_EQ(s.bytes_offloaded, (128 * 32 + 128 * 64) * 4);
  EXPECT_EQ(s.tensors_kept, 1);
  EXPECT_EQ(s.tensors_fetched, 2);  // one scope, one group: nothing to prefetch
}

TEST(SaveOnCpu, SavedTensorsAreHeldAsOffloadedNotActivation) {
  const Device cpu = Device::cpu();
  Mlp m;
  const int64_t act0 = category_now(cpu, Category::activation);
  const int64_t off0 = category_now(cpu, Category::offloaded);
  Tensor kept_loss = m.forward();
  const int64_t act_without = category_now(cpu, Category::activation) - act0;
  kept_loss = Tensor();
  EXPECT_GT(act_without, 0);
  Tensor loss;
  {
    SaveOnCpu scope;
    loss = m.forward();
  }
  EXPECT_EQ(category_now(cpu, Category::activation) - act0, 0);
  EXPECT_EQ(category_now(cpu, Category::offloaded) - off0, act_without);
  loss.backward();
  loss = Tensor();
  EXPECT_EQ(category_now(cpu, Category::offloaded), off0);
  EXPECT_EQ(category_now(cpu, Category::activation), act0);
}

TEST(SaveOnCpu, ASecondBackwardIsTheUsualError) {
  Mlp m;
  Tensor loss;
  {
    SaveOnCpu scope;
    loss = m.forward();
  }
  loss.backward();
  EXPECT_THROW(loss.backward(), std::runtime_error);
}

TEST(SaveOnCpu, NullOffloaderIsAnError) {
  EXPECT_THROW(SaveOnCpu(std::shared_ptr<ActivationOffloader>()), std::invalid_argument);
}

// One ResNetTiny / GPT training step's gradients with a given offload and checkpoint spec.
std::vector<Tensor> model_grads(const std::string& model, const std::string& offload,
                                const std::string& checkpoint, OffloadStats* stats = nullptr) {
  manual_seed(0);
  std::shared_ptr<nn::Module> m;
  std::shared_ptr<nn::GPT> gpt;
  if (model == "resnet") {
    m = nn::resnet_tiny({.num_classes = 10});
  } else {
    gpt = std::make_shared<nn::GPT>(nn::GPTConfig::preset("tiny"));
    m = gpt;
  }
  nn::enable_checkpointing(*m, nn::parse_checkpoint_spec(checkpoint));
  auto off = nn::offload_activations(*m, nn::parse_offload_spec(offload));
  Tensor loss;
  if (gpt) {
    const Tensor x = ops::randint(0, 256, {2, 64}, DType::int64);
    const Tensor y = ops::randint(0, 256, {2, 64}, DType::int64);
    loss = (*gpt)(x, y).second;
  } else {
    const Tensor x = ops::randn({4, 3, 32, 32});
    const Tensor y = ops::randint(0, 10, {4}, DType::int64);
    loss = cross_entropy((*m)(x), y);
  }
  loss.backward();
  if (stats) *stats = off ? off->stats() : OffloadStats{};
  std::vector<Tensor> grads;
  for (const Tensor& p : m->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

struct ModelCase {
  std::string model, offload, checkpoint;
};
class OffloadModels : public ::testing::TestWithParam<ModelCase> {};

TEST_P(OffloadModels, SameGradientsAndBlocksPrefetchEachOther) {
  const ModelCase c = GetParam();
  const std::vector<Tensor> want = model_grads(c.model, "none", c.checkpoint);
  OffloadStats s;
  const std::vector<Tensor> got = model_grads(c.model, c.offload, c.checkpoint, &s);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(same(got[i], want[i])) << i;
  EXPECT_GT(s.tensors_offloaded, 0);
  EXPECT_GT(s.groups, 1);
  // Every block prefetches the one before it; with two blocks offloaded the second never
  // leaves the device, so the first is fetched with nothing to prefetch.
  if (c.offload == "activations") {
    EXPECT_GT(s.tensors_prefetched, 0);
  }
  // What backward needs first (the last group: the head, or the last offloaded block) never
  // left the device (copies are deferred by two groups); the rest was prefetched or fetched.
  EXPECT_GT(s.tensors_in_place, 0);
  EXPECT_EQ(s.tensors_prefetched + s.tensors_fetched, s.tensors_offloaded);
}

// With a prefetch lead, backward restores the offloaded group once the bytes saved between it
// and where backward is are within lead x its bytes. Backward's progress comes from the scopes
// that only report (SaveOnCpu with copy false), whose saves stay on the device.
TEST(SaveOnCpu, APrefetchLeadRestoresAGroupThatFarAhead) {
  constexpr int kMarkers = 6;
  struct Run {
    Tensor grad;
    OffloadStats stats;
    std::vector<int64_t> prefetched_at;  // index: marker; tensors restored when its grad came
  };
  const auto run = [](double lead) {
    manual_seed(5);
    Tensor w;
    {
      memory::CategoryScope params(Category::parameter);
      w = ops::randn({64, 64}).requires_grad_();
    }
    const Tensor x = ops::randn({32, 64});
    OffloadOptions o;
    o.prefetch_lead = lead;
    auto off = ActivationOffloader::create(o);
    Run r;
    r.prefetched_at.assign(kMarkers, -1);
    Tensor h;
    {
      SaveOnCpu copy(off);
      h = relu(linear(x, w));  // copied: x and relu's output, 8 KiB each
    }
    for (int k = 0; k < kMarkers; ++k) {
      SaveOnCpu mark(off, /*copy=*/false);
      h = relu(linear(h, w));  // kept: relu's output (8 KiB; its input is the group before's)
      h.register_hook([&r, off, k](const Tensor& g) {
        r.prefetched_at[static_cast<size_t>(k)] = off->stats().tensors_prefetched;
        return g;
      });
    }
    h.sum().backward();
    r.grad = w.grad().clone();
    r.stats = off->stats();
    return r;
  };
  const Run plain = run(0);
  EXPECT_EQ(plain.stats.bytes_offloaded, 2 * 32 * 64 * 4);
  EXPECT_EQ(plain.stats.tensors_fetched, 2);  // no earlier group: fetched when needed
  EXPECT_EQ(plain.stats.tensors_prefetched, 0);
  // Lead 1: due once 16 KiB or less lie between, when backward reaches marker 1 (markers 1
  // and 0 lie between): the hook of marker 1's output has run by then, marker 0's has not.
  const Run one = run(1.0);
  EXPECT_TRUE(same(one.grad, plain.grad));
  EXPECT_EQ(one.stats.tensors_prefetched, 2);
  EXPECT_EQ(one.stats.tensors_fetched, 0);
  EXPECT_GE(one.stats.tensors_kept, kMarkers * 2);  // each marker's saves (and w)
  EXPECT_EQ(one.prefetched_at, (std::vector<int64_t>{2, 0, 0, 0, 0, 0}));
  // Lead 2: 32 KiB, two markers earlier.
  const Run two = run(2.0);
  EXPECT_TRUE(same(two.grad, plain.grad));
  EXPECT_EQ(two.prefetched_at, (std::vector<int64_t>{2, 2, 2, 0, 0, 0}));
}

// A long run keeps no per-step bookkeeping: each finished backward drops its step's groups.
TEST(SaveOnCpu, AFinishedBackwardDropsItsStepsGroups) {
  Mlp m;
  OffloadOptions o;
  o.prefetch_lead = 1.0;
  auto off = ActivationOffloader::create(o);
  std::vector<int64_t> during, after;
  for (int step = 0; step < 4; ++step) {
    Tensor loss;
    for (int k = 0; k < 3; ++k) {  // three scopes a step, as three blocks
      SaveOnCpu scope(off, /*copy=*/k == 0);
      loss = k == 0 ? m.forward() : loss * loss;
    }
    during.push_back(off->stats().groups_held);
    loss.backward();
    after.push_back(off->stats().groups_held);
  }
  EXPECT_GE(during[0], 3);  // the first scope's group up to the last's
  EXPECT_EQ(during, std::vector<int64_t>(4, during[0]));
  EXPECT_EQ(after, std::vector<int64_t>(4, after[0]));
  EXPECT_LE(after[0], 1);             // the current group
  EXPECT_EQ(off->stats().groups, 4);  // one group saved something each step
}

// Views of one activation block (attention's q, k and v of one qkv buffer) are offloaded by
// copying the block once; a view of a block more than 4x its size stays on the device.
TEST(SaveOnCpu, ViewsGoOutThroughTheirWholeBlockOnce) {
  manual_seed(5);
  const Tensor x = ops::randn({4, 6}).requires_grad_();
  const Tensor wide = ops::randn({4, 64}).requires_grad_();
  auto forward = [&] {
    const Tensor base = x * x;  // an activation block of 24 floats
    const Tensor a = base.slice(1, 0, 3), b = base.slice(1, 3, 6);  // views, half of it each
    const Tensor narrow = (wide * wide).slice(1, 0, 2);             // 1/32 of its block
    return (a * b).sum() + (narrow * narrow).sum();
  };
  forward().backward();
  const Tensor gx = x.grad().clone(), gw = wide.grad().clone();
  x.set_grad(Tensor());
  wide.set_grad(Tensor());
  Tensor loss;
  std::shared_ptr<ActivationOffloader> off;
  {
    SaveOnCpu scope;
    off = scope.offloader();
    loss = forward();
  }
  const OffloadStats s = off->stats();
  loss.backward();
  EXPECT_TRUE(same(x.grad(), gx));
  EXPECT_TRUE(same(wide.grad(), gw));
  // Saved: x and wide twice each (x * x, wide * wide: one copy each), a and b (one copy of
  // base, their block), narrow twice (kept).
  EXPECT_EQ(s.tensors_offloaded, 3);
  EXPECT_EQ(s.bytes_offloaded, (24 + 256 + 24) * 4);
  EXPECT_EQ(s.tensors_deduplicated, 3);
  EXPECT_EQ(s.tensors_kept, 2);
  EXPECT_EQ(s.tensors_in_place, 0);  // SaveOnCpu's own offloader copies at once
}

INSTANTIATE_TEST_SUITE_P(Specs, OffloadModels,
                         ::testing::Values(ModelCase{"resnet", "activations", "none"},
                                           ModelCase{"resnet", "2-blocks", "none"},
                                           ModelCase{"resnet", "activations", "blocks"},
                                           ModelCase{"gpt", "activations", "none"},
                                           ModelCase{"gpt", "activations", "blocks"}),
                         [](const auto& info) {
                           const ModelCase& c = info.param;
                           std::string n = c.model + "_" + c.offload + "_ckpt_" + c.checkpoint;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

TEST(OffloadSpec, SpellingsAndErrors) {
  EXPECT_EQ(nn::parse_offload_spec("none").str(), "none");
  EXPECT_EQ(nn::parse_offload_spec("").str(), "none");
  EXPECT_EQ(nn::parse_offload_spec("activations").str(), "activations");
  EXPECT_EQ(nn::parse_offload_spec("3-blocks").blocks, 3);
  for (const char* bad :
       {"all", "0-blocks", "-blocks", "x-blocks", "99999999-blocks", "blocks", "activation"})
    EXPECT_THROW(nn::parse_offload_spec(bad), std::invalid_argument) << bad;
  try {
    nn::parse_offload_spec("all");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--offload"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'all'"), std::string::npos) << e.what();
  }
}

TEST(OffloadSpec, AModelWithoutBlocksOrTooFewIsAnError) {
  nn::Linear lin(4, 4);
  EXPECT_THROW(nn::offload_activations(lin, nn::parse_offload_spec("activations")),
               std::invalid_argument);
  auto tiny = nn::resnet_tiny({.num_classes = 10});
  EXPECT_THROW(nn::offload_activations(*tiny, nn::parse_offload_spec("99-blocks")),
               std::invalid_argument);
  // "none" clears what an earlier call set.
  nn::offload_activations(*tiny, nn::parse_offload_spec("activations"));
  EXPECT_NE(tiny->offloader(), nullptr);
  EXPECT_EQ(nn::offload_activations(*tiny, nn::parse_offload_spec("none")), nullptr);
  for (auto& [name, m] : tiny->named_modules()) EXPECT_EQ(m->offloader(), nullptr) << name;
}

// A dry run of a CPU target with offload goes through the real run's allocations.
TEST(OffloadEstimate, DryRunMatchesTheRealCpuRun) {
  auto step = [](Device d) {
    manual_seed(0);
    std::shared_ptr<nn::Module> m;
    {
      nn::BuildOnDevice on(d);
      m = nn::resnet_tiny({.num_classes = 10});
    }
    nn::offload_activations(*m, nn::parse_offload_spec("activations"));
    const Tensor x = ops::randn({4, 3, 32, 32}, DType::float32, d);
    const Tensor y = ops::randint(0, 10, {4}, DType::int64, d);
    cross_entropy((*m)(x), y).backward();
  };
  const Device cpu = Device::cpu();
  memory::empty_cache(cpu);
  memory::reset_peak_memory_stats(cpu);
  const int64_t base = static_cast<int64_t>(memory::memory_allocated(cpu));
  step(cpu);
  const int64_t real_peak = static_cast<int64_t>(memory::max_memory_allocated(cpu)) - base;
  const memory::Estimate e = memory::estimate(step, {.target = "cpu"});
  ASSERT_TRUE(e.fits()) << e.out_of_memory;
  EXPECT_EQ(e.peak_allocated, real_peak);
  EXPECT_GT(e.at_peak[static_cast<size_t>(Category::offloaded)], 0);
}

// A dry run for the H200: host copies leave the device, so the device's activation peak
// falls, and the copies' time is charged.
TEST(OffloadEstimate, CudaTargetMovesActivationsOffTheDevice) {
  auto run = [](const std::string& offload) {
    return memory::estimate(
        [&](Device d) {
          manual_seed(0);
          std::shared_ptr<nn::GPT> gpt;
          {
            nn::BuildOnDevice on(d);
            nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
            cfg.n_layer = 8;  // backward holds about two blocks' activations, not eight
            gpt = std::make_shared<nn::GPT>(cfg);
          }
          nn::offload_activations(*gpt, nn::parse_offload_spec(offload));
          const Tensor x = ops::randint(0, 256, {8, 64}, DType::int64, d);
          gpt->forward(x, x).second.backward();
        },
        {.target = "h200"});
  };
  const memory::Estimate base = run("none");
  const memory::Estimate off = run("activations");
  const auto act = static_cast<size_t>(Category::activation);
  EXPECT_LT(off.at_peak[act], base.at_peak[act] / 2);
  EXPECT_EQ(off.at_peak[static_cast<size_t>(Category::offloaded)], 0);  // on the host
  EXPECT_GT(off.predicted_seconds, base.predicted_seconds);
}

// A dry run for a GPU replays its copy stream: a block an offload copy reads is held after
// its free until the clock passes the copy (32 MiB at the H200's 50 GB/s: 671 us), so the next
// request of its size takes a new segment, as on the GPU while the copy drains; once a fence
// has been waited for, the block is free again. The clock moved on by the copy's time.
TEST(OffloadEstimate, CudaTargetHoldsBlocksWhileTheirCopiesDrain) {
  const Device d = memory::new_meta_device(memory::meta_target("h200"));
  auto& a = memory::get_allocator(d);
  const Shape shape{8, 1024, 1024};  // 32 MiB of float32: a segment of its own
  const Tensor host = [&] {
    const Tensor t = ops::empty(shape, DType::float32, d);
    return ops::to_host_async(t, Category::offloaded);
  }();  // t is freed here, its copy still queued
  EXPECT_EQ(a.memory_allocated(), 0u);
  const size_t held = a.memory_reserved();
  Tensor u = ops::empty(shape, DType::float32, d);
  EXPECT_EQ(a.memory_reserved(), 2 * held) << "the first block is held by its copy";
  u = Tensor();
  EXPECT_GE(memory::meta_copies_done(d), 32.0 * 1024 * 1024 / 50e9);
  EXPECT_LT(memory::meta_host_seconds(d), memory::meta_copies_done(d)) << "the host ran ahead";
  ops::CopyFence::record(d).synchronize();
  EXPECT_EQ(memory::meta_host_seconds(d), memory::meta_copies_done(d));
  const Tensor v = ops::empty(shape, DType::float32, d);
  const Tensor w = ops::empty(shape, DType::float32, d);
  EXPECT_EQ(a.memory_reserved(), 2 * held) << "both blocks reused once the copy is done";
  EXPECT_TRUE(host.device().is_meta());
}

}  // namespace
}  // namespace tally
