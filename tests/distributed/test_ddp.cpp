// DistributedDataParallel at world size 1 on the CPU (no NCCL): bitwise the plain model's
// losses and gradients, buckets tagged `communication`, no_sync, unused parameters, and
// the autograd hooks it is built on (post-accumulate-grad hooks, queue_callback).
#include <gtest/gtest.h>

#include <cmath>

#include "ddp_testing.h"
#include "memory/memory.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using distributed::DDPOptions;
using distributed::DistributedDataParallel;
using distributed::LocalProcessGroup;
using testing::make_mlp;
using testing::train;

std::shared_ptr<LocalProcessGroup> local_pg() {
  return std::make_shared<LocalProcessGroup>(Device::cpu());
}

TEST(AutogradHooks, PostAccumulateGradHookSeesTheAccumulatedGrad) {
  Tensor w = ones({3}, TensorOptions{}.with_requires_grad());
  std::vector<double> seen;
  const uint64_t h = autograd::register_post_accumulate_grad_hook(w, [&](const Tensor& leaf) {
    EXPECT_TRUE(leaf.is_same(w) || leaf.unsafe_impl() == w.unsafe_impl());
    seen.push_back(leaf.grad().tolist()[0]);
  });
  mul(w, 2.0).sum().backward();
  mul(w, 3.0).sum().backward();  // accumulates: 2 + 3
  EXPECT_EQ(seen, (std::vector<double>{2.0, 5.0}));
  autograd::remove_post_accumulate_grad_hook(w, h);
  mul(w, 1.0).sum().backward();
  EXPECT_EQ(seen.size(), 2u);
  // Non-leaf tensors and tensors without grad are refused.
  Tensor y = mul(w, 2.0);
  EXPECT_THROW(autograd::register_post_accumulate_grad_hook(y, [](const Tensor&) {}),
               std::runtime_error);
  EXPECT_THROW(autograd::register_post_accumulate_grad_hook(ones({2}), [](const Tensor&) {}),
               std::runtime_error);
}

TEST(AutogradHooks, QueueCallbackRunsAfterTheWholeBackward) {
  Tensor a = ones({2}, TensorOptions{}.with_requires_grad());
  Tensor b = ones({2}, TensorOptions{}.with_requires_grad());
  std::vector<std::string> events;
  bool queued = false;
  for (Tensor* t : {&a, &b}) {
    autograd::register_post_accumulate_grad_hook(*t, [&, t](const Tensor&) {
      events.push_back(t == &a ? "a" : "b");
      if (!queued) {
        queued = true;
        autograd::queue_callback([&] {
          events.push_back("done");
          EXPECT_TRUE(a.grad().defined());
          EXPECT_TRUE(b.grad().defined());
        });
      }
    });
  }
  add(mul(a, 2.0), b).sum().backward();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events.back(), "done");
  EXPECT_THROW(autograd::queue_callback([] {}), std::logic_error);  // no backward running
}

TEST(DDP, WorldSizeOneIsBitwiseThePlainModel) {
  auto plain = make_mlp(7, Device::cpu());
  auto wrapped = make_mlp(7, Device::cpu());
  // A small cap so the model spans several buckets (and the rebuild has work to do).
  DistributedDataParallel ddp(wrapped, local_pg(),
                              DDPOptions{.bucket_cap_mb = 0.002, .first_bucket_cap_mb = 0.0005});
  ASSERT_GT(ddp.num_buckets(), 2u);
  const int64_t initial_buckets = static_cast<int64_t>(ddp.num_buckets());
  const auto a = train(*plain, nullptr, 5, Device::cpu());
  const auto b = train(*wrapped, &ddp, 5, Device::cpu());
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t s = 0; s < a.losses.size(); ++s) {
    EXPECT_EQ(a.losses[s], b.losses[s]) << "step " << s;  // bitwise
    EXPECT_EQ(a.grads[s], b.grads[s]) << "step " << s;
  }
  EXPECT_LT(a.losses.back(), a.losses.front());
  EXPECT_TRUE(ddp.buckets_rebuilt());
  // Each step launched every bucket once (the first step with the initial buckets).
  EXPECT_EQ(ddp.num_allreduces(), initial_buckets + 4 * static_cast<int64_t>(ddp.num_buckets()));
  // Every parameter became ready, each once.
  std::vector<size_t> order = ddp.last_ready_order();
  std::sort(order.begin(), order.end());
  ASSERT_EQ(order.size(), ddp.parameters().size());
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i], i);
}

TEST(DDP, BucketsAreCommunicationMemory) {
  auto model = make_mlp(3, Device::cpu());
  memory::CachingAllocator& alloc = memory::get_allocator(Device::cpu());
  const int64_t before = alloc.stats().cat_bytes(memory::Category::communication).current;
  alloc.record_memory_history(true, 100000);
  {
    DistributedDataParallel ddp(model, local_pg(), DDPOptions{.bucket_cap_mb = 0.004});
    size_t param_bytes = 0;
    for (const Tensor& p : model->parameters()) param_bytes += p.nbytes();
    EXPECT_EQ(ddp.bucket_bytes(), param_bytes);
    for (size_t b = 0; b < ddp.num_buckets(); ++b)
      EXPECT_EQ(ddp.bucket_buffer(b).storage().category(), memory::Category::communication);
    EXPECT_GE(alloc.stats().cat_bytes(memory::Category::communication).current - before,
              static_cast<int64_t>(param_bytes));
    bool found = false;
    for (const memory::TraceEntry& e : alloc.history())
      if (e.action == memory::TraceAction::alloc &&
          e.tag.category == memory::Category::communication) {
        EXPECT_EQ(memory::interned(e.tag.module), "ddp");
        EXPECT_EQ(memory::interned(e.tag.op), "allreduce_bucket");
        found = true;
      }
    EXPECT_TRUE(found);
  }
  alloc.record_memory_history(false);
  EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::communication).current, before);
}

TEST(DDP, NoSyncAccumulatesLocally) {
  auto plain = make_mlp(11, Device::cpu());
  auto wrapped = make_mlp(11, Device::cpu());
  DistributedDataParallel ddp(wrapped, local_pg(), DDPOptions{.bucket_cap_mb = 0.002});
  auto micro = [](nn::Module& m, DistributedDataParallel* d, int k) {
    const auto b = testing::make_batch(k, 8, Device::cpu());
    cross_entropy(d ? (*d)(b.x) : m(b.x), b.y).backward();
  };
  {
    auto guard = ddp.no_sync();
    micro(*wrapped, &ddp, 0);
    micro(*wrapped, &ddp, 1);
  }
  EXPECT_EQ(ddp.num_allreduces(), 0);
  micro(*wrapped, &ddp, 2);
  EXPECT_EQ(ddp.num_allreduces(), static_cast<int64_t>(ddp.num_buckets()));
  for (int k = 0; k < 3; ++k) micro(*plain, nullptr, k);
  const auto pp = plain->parameters(), wp = wrapped->parameters();
  for (size_t i = 0; i < pp.size(); ++i)
    EXPECT_EQ(pp[i].grad().tolist(), wp[i].grad().tolist()) << i;
}

// An MLP with a layer its forward never uses.
class WithUnused : public nn::Module {
 public:
  WithUnused() : Module("WithUnused") {
    Generator gen(5);
    used = register_module("used", std::make_shared<nn::Linear>(8, 5, true, &gen));
    unused = register_module("unused", std::make_shared<nn::Linear>(8, 5, true, &gen));
  }
  Tensor forward(const Tensor& x) override { return (*used)(x); }
  std::shared_ptr<nn::Linear> used, unused;
};

TEST(DDP, UnusedParameterIsAnErrorNamingIt) {
  auto model = std::make_shared<WithUnused>();
  DistributedDataParallel ddp(model, local_pg());
  const auto b = testing::make_batch(0, 4, Device::cpu());
  testing::expect_error<std::runtime_error>(
      [&] { cross_entropy(ddp(b.x), b.y).backward(); },
      {"unused.weight", "unused.bias", "find_unused_parameters",
       "did not receive grad for rank 0: unused.weight, unused.bias\n",
       "indices which did not receive grad for rank 0: 2 3"});
  // The wrapper recovers: the next iteration (with the option off) fails the same way,
  // not with a stale-state error.
  model->zero_grad();
  EXPECT_THROW(cross_entropy(ddp(b.x), b.y).backward(), std::runtime_error);
}

TEST(DDP, FindUnusedParametersTreatsThemAsZero) {
  auto model = std::make_shared<WithUnused>();
  DistributedDataParallel ddp(model, local_pg(), DDPOptions{.find_unused_parameters = true});
  const auto b = testing::make_batch(0, 4, Device::cpu());
  for (int it = 0; it < 2; ++it) {  // before and after the rebuild
    model->zero_grad();
    cross_entropy(ddp(b.x), b.y).backward();
    ASSERT_TRUE(model->unused->parameters()[0].grad().defined());
    for (double v : model->unused->parameters()[0].grad().tolist()) EXPECT_EQ(v, 0.0);
    double norm = 0;
    for (double v : model->used->parameters()[0].grad().tolist()) norm += v * v;
    EXPECT_GT(norm, 0.0);
  }
}

TEST(DDP, ForwardWithAnotherSignatureAndErrors) {
  auto model = make_mlp(1, Device::cpu());
  DistributedDataParallel ddp(model, local_pg());
  const auto b = testing::make_batch(0, 4, Device::cpu());
  auto [logits, loss] = ddp.forward([&] {
    Tensor l = (*model)(b.x);
    return std::make_pair(l, cross_entropy(l, b.y));
  });
  loss.backward();
  EXPECT_EQ(logits.size(0), 4);
  EXPECT_THROW(DistributedDataParallel(nullptr, local_pg()), std::invalid_argument);
  EXPECT_THROW(DistributedDataParallel(model, local_pg(), DDPOptions{.bucket_cap_mb = 0}),
               std::invalid_argument);
  // Caps whose bytes do not fit in 63 bits, or are not numbers (the double -> size_t cast was
  // undefined behaviour).
  for (const DDPOptions& o : {DDPOptions{.bucket_cap_mb = 1e300}, DDPOptions{.bucket_cap_mb = NAN},
                              DDPOptions{.bucket_cap_mb = 25, .first_bucket_cap_mb = INFINITY},
                              DDPOptions{.bucket_cap_mb = 25, .first_bucket_cap_mb = -1}})
    EXPECT_THROW(DistributedDataParallel(model, local_pg(), o), std::invalid_argument);
  // A process group on another device than the model.
  auto cuda_pg = std::make_shared<LocalProcessGroup>(Device::cuda(0));
  EXPECT_THROW(DistributedDataParallel(model, cuda_pg), std::invalid_argument);
}

// Rank 1 of a pretend 2-rank group on the CPU: collectives leave data as it is, except
// that broadcasts deliver what "rank 0" holds once `fill` is on: `value` in float tensors,
// `int_value` in integer ones.
class FakeRank1 final : public distributed::ProcessGroup {
 public:
  struct Done final : distributed::Work {
    void wait() override {}
  };
  int rank() const override { return 1; }
  int size() const override { return 2; }
  Device device() const override { return Device::cpu(); }
  std::string backend() const override { return "fake"; }
  std::shared_ptr<distributed::Work> all_reduce(const Tensor&, distributed::ReduceOp) override {
    ++all_reduces;
    return std::make_shared<Done>();
  }
  std::shared_ptr<distributed::Work> broadcast(const Tensor& t, int) override {
    ++broadcasts;
    if (fill) ops::fill_(t, is_floating(t.dtype()) ? value : int_value);
    return std::make_shared<Done>();
  }
  Tensor all_gather(const Tensor& t) override {
    return ops::contiguous(ops::expand(ops::unsqueeze(t, 0), {2, -1}));
  }
  void barrier() override {}
  bool fill = false;
  double value = 7.0;
  double int_value = 9.0;
  int all_reduces = 0, broadcasts = 0;
};

class WithBuffers : public nn::Module {
 public:
  WithBuffers() : Module("WithBuffers") {
    Generator gen(3);
    lin = register_module("lin", std::make_shared<nn::Linear>(8, 5, true, &gen));
    register_buffer("stat", ops::zeros({3}));
    register_buffer("count", ops::full({}, 4, DType::int64));
  }
  Tensor forward(const Tensor& x) override { return (*lin)(x); }
  std::shared_ptr<nn::Linear> lin;
};

TEST(DDP, BuffersComeFromRankZeroBeforeEachForward) {
  auto model = std::make_shared<WithBuffers>();
  auto pg = std::make_shared<FakeRank1>();
  DistributedDataParallel ddp(model, pg);
  const int initial = pg->broadcasts;
  EXPECT_EQ(initial, 4);  // construction: 2 parameters + 2 buffers, one by one
  pg->fill = true;
  const auto b = testing::make_batch(0, 4, Device::cpu());
  const Tensor loss = cross_entropy(ddp(b.x), b.y);
  pg->fill = false;
  loss.backward();
  // Two dtypes coalesced into two broadcasts; then the rebuild's broadcast of rank 0's
  // bucket order (an int64 tensor: the fake's 9s would be a bad order, so fill is off).
  EXPECT_EQ(pg->broadcasts - initial, 2 + 1);
  const auto bufs = model->named_buffers();
  ASSERT_EQ(bufs.size(), 2u);
  EXPECT_EQ(bufs[0].second.tolist(), (std::vector<double>{7, 7, 7}));
  EXPECT_EQ(bufs[1].second.tolist(), (std::vector<double>{9}));
  EXPECT_EQ(pg->all_reduces, static_cast<int>(ddp.num_allreduces()));
  // Parameters kept rank 1's values at construction (fill was off), so gradients exist.
  EXPECT_TRUE(model->lin->parameters()[0].grad().defined());
}

TEST(ProcessGroup, LocalCollectivesAreIdentities) {
  LocalProcessGroup pg;
  Tensor t = ops::from_vector({1, 2, 3}, {3});
  pg.all_reduce(t, distributed::ReduceOp::avg)->wait();
  pg.broadcast(t, 0)->wait();
  EXPECT_EQ(t.tolist(), (std::vector<double>{1, 2, 3}));
  const Tensor g = pg.all_gather(ops::from_vector({4}, {}));
  EXPECT_EQ(g.sizes(), (Shape{1}));
  EXPECT_EQ(g.tolist(), (std::vector<double>{4}));
  pg.barrier();
  EXPECT_THROW(pg.broadcast(t, 1), std::invalid_argument);
  // WORLD_SIZE 1: init_process_group needs no NCCL.
  auto p = distributed::init_process_group(Device::cpu(), distributed::DistEnv{});
  EXPECT_EQ(p->backend(), "local");
  EXPECT_EQ(p->size(), 1);
  distributed::DistEnv two;
  two.world_size = 2;
  EXPECT_THROW(distributed::init_process_group(Device::cpu(), two), std::runtime_error);
}

}  // namespace
}  // namespace tally
