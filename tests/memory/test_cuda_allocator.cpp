// The caching allocator over the CUDA provider (label gpu: skipped without a device).
#include <gtest/gtest.h>

#include <filesystem>
#include <vector>

#include "memory/invariants.h"
#include "memory/memory.h"

#ifdef TALLY_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace tally::memory {
namespace {

#define REQUIRE_GPU()                                                \
  do {                                                               \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device present"; \
  } while (0)

TEST(CudaAllocator, PolicyOnTheDevice) {
  REQUIRE_GPU();
  CachingAllocator& a = get_allocator(Device::cuda(0));
  a.reset_peak_memory_stats();
  const size_t base = a.memory_allocated();
  void* p = a.allocate(1);
  EXPECT_EQ(a.block_size(p), 512u);
  void* q = a.allocate(10 * kMiB + 1);
  EXPECT_EQ(a.block_size(q), 10486272u);
#ifdef TALLY_WITH_CUDA
  // The memory is real device memory.
  ASSERT_EQ(cudaMemset(q, 0x5a, 10 * kMiB + 1), cudaSuccess);
  unsigned char last = 0;
  ASSERT_EQ(cudaMemcpy(&last, static_cast<char*>(q) + 10 * kMiB, 1, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(last, 0x5a);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, q), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
#endif
  EXPECT_EQ(a.memory_allocated(), base + 512 + 10486272);
  a.deallocate(p);
  a.deallocate(q);
  testing::expect_consistent(a);
  a.empty_cache();
}

TEST(CudaAllocator, OomIsRecoverable) {
  REQUIRE_GPU();
  CachingAllocator& a = get_allocator(Device::cuda(0));
  const size_t total = a.provider().total_memory();
  void* keep = a.allocate(64 * kMiB);
  EXPECT_THROW(a.allocate(total * 2), OutOfMemoryError);
  // Still usable, still consistent.
  void* p = a.allocate(256 * kMiB);
  EXPECT_NE(p, nullptr);
  a.deallocate(p);
  a.deallocate(keep);
  testing::expect_consistent(a);
  EXPECT_GE(a.memory_stats().at("num_ooms"), 1);
  a.empty_cache();
}

TEST(CudaAllocator, CrossStreamFree) {
  REQUIRE_GPU();
#ifdef TALLY_WITH_CUDA
  CachingAllocator& a = get_allocator(Device::cuda(0));
  cudaStream_t s1, s2;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), cudaSuccess);
  const auto id1 = reinterpret_cast<StreamId>(s1);
  void* p = a.allocate(32 * kMiB, id1);
  a.record_stream(p, reinterpret_cast<StreamId>(s2));
  ASSERT_EQ(cudaMemsetAsync(p, 1, 32 * kMiB, s2), cudaSuccess);
  a.deallocate(p);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  void* q = a.allocate(32 * kMiB, id1);  // events done: the same block comes back
  EXPECT_EQ(p, q);
  a.deallocate(q);
  testing::expect_consistent(a);
  a.empty_cache();
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
#endif
}

TEST(CudaAllocator, SnapshotForMemoryViz) {
  REQUIRE_GPU();
  // Writes a snapshot of a simulated training step on the GPU; tests/memory/check_memviz.py
  // opens it with PyTorch's torch.cuda._memory_viz on the GPU machine.
  CachingAllocator& a = get_allocator(Device::cuda(0));
  a.record_memory_history(true, 100000);
  std::vector<void*> params, acts, grads;
  {
    AllocContextScope ctx(Category::parameter, "model", "empty", "init");
    for (int i = 0; i < 8; ++i) params.push_back(a.allocate((i + 1) * 300000));
  }
  for (int i = 0; i < 8; ++i) {
    AllocContextScope ctx(Category::activation, "model.layer" + std::to_string(i), "linear",
                          "forward");
    acts.push_back(a.allocate(4 * kMiB + i * 1000));
  }
  for (int i = 7; i >= 0; --i) {
    AllocContextScope ctx(Category::gradient, "model.layer" + std::to_string(i), "linear_backward",
                          "backward");
    grads.push_back(a.allocate((i + 1) * 300000));
    a.deallocate(acts[static_cast<size_t>(i)]);
  }
  a.retag(grads[0], Category::optimizer_state);
  const char* dir = std::getenv("TALLY_SNAPSHOT_DIR");
  const std::filesystem::path out =
      std::filesystem::path(dir ? dir : std::filesystem::temp_directory_path().string()) /
      "tally_cuda_snapshot.pickle";
  a.dump_snapshot(out.string());
  EXPECT_TRUE(std::filesystem::exists(out));
  for (void* p : params) a.deallocate(p);
  for (void* p : grads) a.deallocate(p);
  a.record_memory_history(false);
  testing::expect_consistent(a);
}

}  // namespace
}  // namespace tally::memory
