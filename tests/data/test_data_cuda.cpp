// The data pipeline on a GPU: pinned host buffers (their own allocator and stats),
// asynchronous host-to-device copies equal to the source and tagged `input`, pinned blocks
// kept out of reuse until the copy has run, and the DataLoader feeding CUDA batches.
#include <gtest/gtest.h>

#include <set>

#include "memory/memory.h"
#include "nn/data/dataloader.h"
#include "nn/data/synthetic.h"
#include "tensor/ops.h"
#include "tensor/pinned.h"
#include "testing/cuda_testing.h"
#if defined(TALLY_WITH_CUDA)
#include <cuda_runtime.h>

#include "tensor/cuda/runtime.h"
#endif

using namespace tally;
using namespace tally::data;
using tally::testing::kGpu;

namespace {
void sync_gpu() {
#if defined(TALLY_WITH_CUDA)
  cuda::synchronize(0);
#endif
}
}  // namespace

TEST(PinnedCuda, BuffersHaveTheirOwnAllocator) {
  REQUIRE_GPU();
  ASSERT_TRUE(memory::pinned_memory_available());
  auto& pinned = memory::get_pinned_allocator();
  auto& cpu = memory::get_allocator(Device::cpu());
  EXPECT_NE(&pinned, &cpu);
  EXPECT_EQ(pinned.provider().device_name(), "cpu (pinned)");
  const size_t cpu_before = cpu.memory_allocated(), pinned_before = pinned.memory_allocated();
  {
    memory::CategoryScope scope(memory::Category::input);
    Tensor p = ops::empty_pinned({1000, 100}, DType::float32);
    EXPECT_TRUE(ops::is_pinned(p));
    EXPECT_EQ(p.device(), Device::cpu());
    EXPECT_EQ(p.storage().category(), memory::Category::input);
    EXPECT_GE(pinned.memory_allocated(), pinned_before + 400000);
    EXPECT_EQ(cpu.memory_allocated(), cpu_before);  // not in the CPU allocator's numbers
#if defined(TALLY_WITH_CUDA)
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, p.data_ptr()), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);  // page-locked, known to the driver
#endif
    Tensor plain = ops::ones({3}, DType::float32);
    EXPECT_FALSE(ops::is_pinned(plain));
    Tensor pp = ops::pin_memory(plain);
    EXPECT_TRUE(ops::is_pinned(pp));
    EXPECT_TRUE(ops::pin_memory(pp).is_same(pp));
    EXPECT_GT(pinned.stats().cat_bytes(memory::Category::input).current, 0);
  }
  EXPECT_EQ(pinned.memory_allocated(), pinned_before);
  EXPECT_THROW(ops::pin_memory(ops::ones({2}, DType::float32, kGpu)), std::invalid_argument);
}

TEST(PinnedCuda, AsyncCopyEqualsSourceTaggedInput) {
  REQUIRE_GPU();
  for (DType dt : {DType::float32, DType::int64, DType::float16}) {
    Tensor src = ops::to(ops::randn({257, 33}, DType::float32), dt);
    Tensor host = ops::pin_memory(src);
    Tensor dev = ops::to_device_async(host, kGpu);
    EXPECT_TRUE(dev.is_cuda());
    EXPECT_EQ(dev.dtype(), dt);
    EXPECT_EQ(dev.storage().category(), memory::Category::input);
    EXPECT_EQ(ops::to_vector(dev), ops::to_vector(src));
    // A pageable source takes the ordinary path, still tagged input.
    Tensor dev2 = ops::to_device_async(src, kGpu);
    EXPECT_EQ(dev2.storage().category(), memory::Category::input);
    EXPECT_EQ(ops::to_vector(dev2), ops::to_vector(src));
  }
}

TEST(PinnedCuda, PinnedBlockNotReusedBeforeTheCopyRan) {
  REQUIRE_GPU();
  auto& pinned = memory::get_pinned_allocator();
  const size_t n = 1 << 22;  // 16 MiB of float32
  Tensor big = ops::empty({8192, 8192}, DType::float32, kGpu);
  void* first = nullptr;
  Tensor dev;
  {
    Tensor host = ops::empty_pinned({static_cast<int64_t>(n)}, DType::float32);
    ops::fill_(host, 3.0);
    first = host.data_ptr();
    // Queue enough work ahead of the copy that it cannot have run when `host` is dropped.
    for (int i = 0; i < 50; ++i) ops::fill_(big, i);
    dev = ops::to_device_async(host, kGpu);
  }
  // The freed block waits on its event: memory stays allocated while the copy is queued.
  Tensor again = ops::empty_pinned({static_cast<int64_t>(n)}, DType::float32);
  if (again.data_ptr() == first) {
    ADD_FAILURE() << "the pinned block was handed out again before the copy could have run";
  }
  // As in PyTorch, the dropped block leaves the allocated statistics at free() even while its
  // event is pending; the protection is that it is not handed out again (checked above).
  EXPECT_GE(pinned.memory_allocated(), n * sizeof(float));
  ops::fill_(again, 5.0);
  EXPECT_DOUBLE_EQ(ops::item(ops::sum(dev)), 3.0 * static_cast<double>(n));  // read before reuse
  sync_gpu();
}

TEST(DataLoaderCuda, FeedsCudaBatches) {
  REQUIRE_GPU();
  SyntheticImages ds(300, {3, 16, 16}, 10, 4);
  auto& gpu = memory::get_allocator(kGpu);
  DataLoader loader(ds, {.batch_size = 64, .shuffle = true, .seed = 2, .device = kGpu});
  EXPECT_TRUE(loader.pinned());
  const std::vector<int64_t> order = loader.epoch_order(0);
  int64_t k = 0;
  for (const Example& b : loader) {
    EXPECT_TRUE(b.input.is_cuda());
    EXPECT_TRUE(b.target.is_cuda());
    EXPECT_EQ(b.input.storage().category(), memory::Category::input);
    EXPECT_EQ(b.target.storage().category(), memory::Category::input);
    EXPECT_GT(gpu.stats().cat_bytes(memory::Category::input).current, 0);
    // Same contents as the dataset's CPU batch for the same indices.
    const int64_t lo = k * 64, hi = std::min<int64_t>(300, lo + 64);
    std::vector<int64_t> idx(order.begin() + lo, order.begin() + hi);
    const Example ref = ds.get_batch(idx);
    EXPECT_EQ(ops::to_vector(b.input), ops::to_vector(ref.input));
    EXPECT_EQ(ops::to_vector(b.target), ops::to_vector(ref.target));
    ++k;
  }
  EXPECT_EQ(k, 5);
  EXPECT_GT(memory::get_pinned_allocator().stats().cat_bytes(memory::Category::input).peak, 0);
}

TEST(DataLoaderCuda, DestroyMidEpochReturnsMemory) {
  REQUIRE_GPU();
  SyntheticImages ds(2000, {3, 32, 32}, 10, 5);
  const size_t gpu_before = memory::memory_allocated(kGpu);
  {
    DataLoader loader(ds, {.batch_size = 128, .shuffle = true, .device = kGpu, .prefetch = 3});
    int k = 0;
    for (const Example& b : loader) {
      EXPECT_TRUE(b.input.is_cuda());
      if (++k == 2) break;
    }
  }
  sync_gpu();
  EXPECT_EQ(memory::memory_allocated(kGpu), gpu_before);
  // Pinned blocks come back once their copies have completed (the next allocation
  // processes the events).
  Tensor probe = ops::empty_pinned({1}, DType::float32);
  probe = Tensor();
  EXPECT_EQ(memory::get_pinned_allocator().stats().cat_bytes(memory::Category::input).current, 0);
}
