// DataLoader on the CPU: every index once per epoch, seeded shuffling that differs across
// epochs, drop_last, batches tagged `input`, worker errors rethrown with context, clean
// stop mid-epoch (no hang, memory back to the baseline); and the pinned-memory API's CPU
// fallback.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <set>
#include <thread>

#include "memory/memory.h"
#include "nn/data/dataloader.h"
#include "nn/data/synthetic.h"
#include "tensor/ops.h"
#include "tensor/pinned.h"

using namespace tally;
using namespace tally::data;

namespace {

// Example i: input float32 [2] = {i, -i}, target int64 i. Uses the default get_batch.
class IndexDataset : public Dataset {
 public:
  explicit IndexDataset(int64_t n, int64_t fail_at = -1) : n_(n), fail_at_(fail_at) {}
  int64_t size() const override { return n_; }
  Example get(int64_t i) const override {
    check_index("IndexDataset", i, n_);
    if (i == fail_at_)
      throw std::runtime_error("IndexDataset: example " + std::to_string(i) + " is broken");
    ++calls;
    const auto d = static_cast<double>(i);
    return {ops::from_vector({d, -d}, {2}), ops::from_vector({d}, {}, DType::int64)};
  }
  mutable std::atomic<int64_t> calls{0};

 private:
  int64_t n_, fail_at_;
};

std::vector<int64_t> targets_of(DataLoader& loader) {
  std::vector<int64_t> out;
  for (const Example& b : loader) {
    const std::vector<double> t = ops::to_vector(b.target);
    const std::vector<double> x = ops::to_vector(b.input);
    for (size_t k = 0; k < t.size(); ++k) {
      EXPECT_EQ(x[2 * k], t[k]);  // input and target stay paired
      EXPECT_EQ(x[2 * k + 1], -t[k]);
      out.push_back(static_cast<int64_t>(t[k]));
    }
  }
  return out;
}

}  // namespace

TEST(Randperm, IsAPermutationAndSeeded) {
  Generator g1(5), g2(5);
  const std::vector<int64_t> a = randperm(1000, g1), b = randperm(1000, g2);
  EXPECT_EQ(a, b);
  std::vector<int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i);
  EXPECT_NE(randperm(1000, g1), a);  // the generator moved on
  int fixed = 0;
  for (int64_t i = 0; i < 1000; ++i) fixed += a[static_cast<size_t>(i)] == i;
  EXPECT_LT(fixed, 10);
}

TEST(DataLoader, EveryIndexOncePerEpochShuffledAndSeeded) {
  IndexDataset ds(103);
  DataLoader loader(ds, {.batch_size = 10, .shuffle = true, .seed = 123});
  EXPECT_EQ(loader.len(), 11);
  const std::vector<int64_t> e0 = targets_of(loader);
  const std::vector<int64_t> e1 = targets_of(loader);
  ASSERT_EQ(e0.size(), 103u);
  EXPECT_EQ(std::set<int64_t>(e0.begin(), e0.end()).size(), 103u);
  EXPECT_EQ(std::set<int64_t>(e1.begin(), e1.end()).size(), 103u);
  EXPECT_NE(e0, e1);  // a new order each epoch
  EXPECT_EQ(e0, loader.epoch_order(0));
  EXPECT_EQ(e1, loader.epoch_order(1));
  std::vector<int64_t> identity(103);
  std::iota(identity.begin(), identity.end(), int64_t{0});
  EXPECT_NE(e0, identity);

  DataLoader again(ds, {.batch_size = 7, .shuffle = true, .seed = 123});
  EXPECT_EQ(targets_of(again), e0);  // the seed reproduces the order
  DataLoader other(ds, {.batch_size = 10, .shuffle = true, .seed = 124});
  EXPECT_NE(targets_of(other), e0);
  again.set_epoch(0);
  EXPECT_EQ(targets_of(again), e0);

  DataLoader plain(ds, {.batch_size = 10});
  EXPECT_EQ(targets_of(plain), identity);
}

// Data parallel through the loader: two ranks' loaders over one dataset visit disjoint
// shards of equal length (padded by repetition) that together cover it; each epoch
// reshuffles, the same way on both ranks; shuffle + sampler and a size mismatch are errors.
TEST(DataLoader, DistributedSamplerShardsTheDataset) {
  IndexDataset ds(11);
  DataLoader r0(
      ds, {.batch_size = 4, .sampler = DistributedSampler(11, 2, 0, {.shuffle = true, .seed = 7})});
  DataLoader r1(
      ds, {.batch_size = 4, .sampler = DistributedSampler(11, 2, 1, {.shuffle = true, .seed = 7})});
  EXPECT_EQ(r0.len(), 2);  // 6 samples a rank (11 padded to 12), batches of 4 and 2
  EXPECT_EQ(r1.len(), 2);
  const std::vector<int64_t> a0 = targets_of(r0), b0 = targets_of(r1);
  ASSERT_EQ(a0.size(), 6u);
  ASSERT_EQ(b0.size(), 6u);
  std::multiset<int64_t> all(a0.begin(), a0.end());
  all.insert(b0.begin(), b0.end());
  EXPECT_EQ(std::set<int64_t>(all.begin(), all.end()).size(), 11u)
      << "the shards cover the dataset";
  EXPECT_EQ(all.size(), 12u) << "one sample repeated as padding";
  EXPECT_EQ(a0, r0.epoch_order(0));
  DistributedSampler same(11, 2, 0, {.shuffle = true, .seed = 7});
  same.set_epoch(1);
  const std::vector<int64_t> a1 = targets_of(r0);  // the loader's second epoch
  EXPECT_EQ(a1, same.indices()) << "loader epoch e is sampler epoch e";
  EXPECT_NE(a1, a0);
  EXPECT_THROW(
      DataLoader(ds, {.batch_size = 4, .shuffle = true, .sampler = DistributedSampler(11, 2, 0)}),
      std::invalid_argument);
  EXPECT_THROW(DataLoader(ds, {.batch_size = 4, .sampler = DistributedSampler(12, 2, 0)}),
               std::invalid_argument);
}

TEST(DataLoader, DropLastAndBatchShapes) {
  IndexDataset ds(10);
  DataLoader keep(ds, {.batch_size = 3});
  DataLoader drop(ds, {.batch_size = 3, .drop_last = true});
  EXPECT_EQ(keep.len(), 4);
  EXPECT_EQ(drop.len(), 3);
  std::vector<int64_t> sizes;
  for (const Example& b : keep) {
    EXPECT_EQ(b.input.size(1), 2);
    EXPECT_EQ(b.input.dim(), 2);
    EXPECT_EQ(b.target.dim(), 1);
    sizes.push_back(b.input.size(0));
  }
  EXPECT_EQ(sizes, (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(targets_of(drop), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  int64_t n = 0;
  for (const Example& b : drop) n += b.input.size(0) == 3;
  EXPECT_EQ(n, 3);
}

// A batch larger than the dataset: one short batch without drop_last, none with it; an empty
// dataset: no batch either way. An epoch without a batch ends at once (no wait, no hang).
TEST(DataLoader, BatchLargerThanTheDatasetAndEmptyDataset) {
  IndexDataset ds(5), none(0);
  DataLoader keep(ds, {.batch_size = 8, .shuffle = true, .seed = 3});
  DataLoader drop(ds, {.batch_size = 8, .drop_last = true});
  EXPECT_EQ(keep.len(), 1);
  EXPECT_EQ(drop.len(), 0);
  std::vector<int64_t> got = targets_of(keep);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  for (bool drop_last : {false, true}) {
    DataLoader empty(none, {.batch_size = 4, .drop_last = drop_last});
    EXPECT_EQ(empty.len(), 0);
    for (int epoch = 0; epoch < 3; ++epoch) EXPECT_TRUE(targets_of(empty).empty());
  }
  for (int epoch = 0; epoch < 3; ++epoch) {
    EXPECT_TRUE(drop.begin() == drop.end());
    EXPECT_TRUE(targets_of(drop).empty());
  }
}

TEST(DataLoader, BatchesTaggedInput) {
  SyntheticImages ds(64, {3, 8, 8}, 4, 1);
  auto& cpu = memory::get_allocator(Device::cpu());
  const auto input_before = cpu.stats().cat_bytes(memory::Category::input).current;
  DataLoader loader(ds, {.batch_size = 16, .shuffle = true, .seed = 3, .prefetch = 2});
  int64_t batches = 0;
  for (const Example& b : loader) {
    EXPECT_EQ(b.input.storage().category(), memory::Category::input);
    EXPECT_EQ(b.target.storage().category(), memory::Category::input);
    EXPECT_EQ(b.input.device(), Device::cpu());
    const auto input_now = cpu.stats().cat_bytes(memory::Category::input).current;
    // At least this batch's bytes are tagged input (plus up to `prefetch` ready ones).
    EXPECT_GE(input_now - input_before, static_cast<int64_t>(b.input.storage().block_bytes() +
                                                             b.target.storage().block_bytes()));
    EXPECT_EQ(cpu.block_tag(b.input.data_ptr()).op, memory::intern("DataLoader"));
    ++batches;
  }
  EXPECT_EQ(batches, 4);
  const std::map<std::string, int64_t> stats = memory::memory_stats(Device::cpu());
  EXPECT_GT(stats.at("category.input.peak"), 0);
}

TEST(DataLoader, DestroyMidEpochDoesNotHangOrLeak) {
  SyntheticImages ds(10000, {1, 28, 28}, 10, 2);
  const size_t baseline = memory::memory_allocated(Device::cpu());
  const auto t0 = std::chrono::steady_clock::now();
  {
    DataLoader loader(ds, {.batch_size = 32, .shuffle = true, .seed = 9, .prefetch = 4});
    int k = 0;
    for (const Example& b : loader) {
      EXPECT_EQ(b.input.size(0), 32);
      if (++k == 3) break;
    }
    // The worker goes on preparing batches ahead (poll: it runs on its own schedule).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (memory::memory_allocated(Device::cpu()) == baseline &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_GT(memory::memory_allocated(Device::cpu()), baseline);  // prefetched batches
    // Restarting mid-epoch stops the first worker too.
    auto it = loader.begin();
    EXPECT_FALSE(it == loader.end());
  }
  EXPECT_EQ(memory::memory_allocated(Device::cpu()), baseline);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
}

TEST(DataLoader, WorkerErrorRethrownWithContext) {
  IndexDataset ds(40, /*fail_at=*/17);
  const size_t baseline = memory::memory_allocated(Device::cpu());
  {
    DataLoader loader(ds, {.batch_size = 5});
    int64_t seen = 0;
    try {
      for (const Example& b : loader) seen += b.input.size(0);
      ADD_FAILURE() << "no exception";
    } catch (const std::runtime_error& e) {
      // Where the worker failed (batch, epoch, dataset indices) and the dataset's own error.
      const std::string msg = e.what();
      for (const char* part :
           {"batch 3 of 8 of epoch 0", "dataset indices 15 .. 19", "example 17 is broken"})
        EXPECT_NE(msg.find(part), std::string::npos) << msg;
    }
    EXPECT_EQ(seen, 15);
    // The next epoch starts afresh (and fails again at the same place).
    EXPECT_THROW(for (const Example& b : loader)(void) b, std::runtime_error);
  }
  EXPECT_EQ(memory::memory_allocated(Device::cpu()), baseline);
}

TEST(DataLoader, BadOptions) {
  IndexDataset ds(4);
  EXPECT_THROW(DataLoader(ds, {.batch_size = 0}), std::invalid_argument);
  EXPECT_THROW(DataLoader(ds, {.prefetch = 0}), std::invalid_argument);
}

TEST(Pinned, CpuFallback) {
  if (memory::pinned_memory_available()) GTEST_SKIP() << "a GPU is present: see test_data_cuda";
  Tensor p = ops::empty_pinned({4, 5}, DType::float32);
  EXPECT_EQ(p.device(), Device::cpu());
  EXPECT_FALSE(ops::is_pinned(p));
  EXPECT_EQ(&memory::get_pinned_allocator(), &memory::get_allocator(Device::cpu()));
  Tensor src = ops::arange(0, 6, 1, DType::float32).view({2, 3});
  Tensor q = ops::pin_memory(src);
  EXPECT_EQ(ops::to_vector(q), ops::to_vector(src));
  EXPECT_FALSE(q.storage().is_same(src.storage()));
  {
    memory::CategoryScope scope(memory::Category::activation);
    Tensor same = ops::to_device_async(src, Device::cpu());
    EXPECT_TRUE(same.is_same(src));
  }
  // A loader asked for pinned CUDA batches on a machine without a GPU refuses the device.
  IndexDataset ds(4);
  EXPECT_THROW(DataLoader(ds, {.device = Device::cuda(0)}), std::invalid_argument);
}
