// The caching allocator over the CUDA provider (label gpu: skipped without a device).
#include <gtest/gtest.h>

#include <filesystem>
#include <initializer_list>
#include <vector>

#include "memory/invariants.h"
#include "memory/memory.h"
#include "memory/oom_recovery.h"

#ifdef TALLY_WITH_CUDA
#include <cuda_runtime.h>

#include "memory/cuda_provider.h"
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

// A training run out of memory under a memory fraction (history off): the oom_snapshot file
// is written and named by the error, and a smaller batch of the same model then trains in
// this process (tests/memory/oom_recovery.h; the CPU twin is tests/nn/test_out_of_memory.cpp).
TEST(CudaAllocator, OomSnapshotThenSmallerBatchTrains) {
  REQUIRE_GPU();
  // GPT "tiny" at 4096 x 64 tokens needs well over a GiB (its logits alone are 256 MiB); at
  // 4 x 64 a few MiB besides the libraries' workspaces.
  tally::testing::expect_oom_then_recovery(Device::cuda(0), 256 * kMiB, 4096, 4);
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

// ---- expandable_segments:True over the driver's virtual memory API (cuMemAddressReserve,
// cuMemCreate + cuMemMap + cuMemSetAccess, cuMemUnmap + cuMemRelease). Each test has an
// allocator of its own over cuda:0, so the process-wide one keeps its settings.

#ifdef TALLY_WITH_CUDA
std::unique_ptr<CachingAllocator> expandable_cuda(const std::string& extra = "") {
  return std::make_unique<CachingAllocator>(
      std::make_unique<CudaProvider>(0),
      AllocatorConfig::parse("expandable_segments:True" + extra));
}

// Sets [p, p + n) to `value` on the device; true when its first and last bytes read back so.
bool device_bytes_are(void* p, size_t n, unsigned char value) {
  unsigned char first = 0, last = 0;
  if (cudaMemcpy(&first, p, 1, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  if (cudaMemcpy(&last, static_cast<char*>(p) + n - 1, 1, cudaMemcpyDeviceToHost) != cudaSuccess)
    return false;
  return first == value && last == value;
}

// A block of `n` bytes set to `value` on the device.
struct Filled {
  void* p;
  size_t n;
  unsigned char value;
};

// After the device synchronises, every block still holds its value.
void expect_filled(std::initializer_list<Filled> blocks) {
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int i = 0;
  for (const Filled& b : blocks)
    EXPECT_TRUE(device_bytes_are(b.p, b.n, b.value)) << "block " << i++ << " (" << b.n << " bytes)";
}

// A test's end: expect_filled(blocks), then testing::expect_consistent_then_release(a, live).
void expect_filled_then_release(CachingAllocator& a, std::initializer_list<Filled> blocks,
                                std::initializer_list<void*> live) {
  expect_filled(blocks);
  testing::expect_consistent_then_release(a, live);
}
#endif

// After REQUIRE_GPU().
#define REQUIRE_VMM()                                                                  \
  do {                                                                                 \
    if (!CudaProvider::virtual_memory_supported(0))                                    \
      GTEST_SKIP() << "cuda:0 has no virtual memory management (expandable segments)"; \
  } while (0)

TEST(CudaExpandableSegments, TheDeviceSupportsThem) {
  REQUIRE_GPU();
#ifdef TALLY_WITH_CUDA
  // The H200 (any GPU since Pascal under a recent driver) has the API.
  EXPECT_TRUE(CudaProvider::virtual_memory_supported(0));
#endif
}

TEST(CudaExpandableSegments, GrowSplitFreeAndEmptyCacheUnmaps) {
  REQUIRE_GPU();
#ifdef TALLY_WITH_CUDA
  REQUIRE_VMM();
  auto a = expandable_cuda();
  void* p = a->allocate(kMiB + 1);  // one 20 MiB page
  EXPECT_EQ(a->memory_reserved(), 20 * kMiB);
  ASSERT_EQ(cudaMemset(p, 0x11, kMiB + 1), cudaSuccess);
  void* q = a->allocate(30 * kMiB);  // the free rest of the page + one more page
  EXPECT_EQ(reinterpret_cast<uintptr_t>(q), reinterpret_cast<uintptr_t>(p) + 1049088);
  EXPECT_EQ(a->memory_reserved(), 40 * kMiB);
  ASSERT_EQ(cudaMemset(q, 0x22, 30 * kMiB), cudaSuccess);
  void* big = a->allocate(size_t{1} << 30);  // the 9 MiB rest + 51 more pages
  EXPECT_EQ(a->memory_reserved(), 1060 * kMiB);
  ASSERT_EQ(cudaMemset(big, 0x33, size_t{1} << 30), cudaSuccess);
  // p was written before the segment grew.
  expect_filled({{p, kMiB + 1, 0x11}, {q, 30 * kMiB, 0x22}, {big, size_t{1} << 30, 0x33}});
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, big), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  EXPECT_EQ(a->memory_stats().at("segment.large_pool.current"), 1);
  testing::expect_consistent(*a);
  a->deallocate(big);
  a->deallocate(q);
  a->empty_cache();  // everything past p's page is unmapped and back on the device
  // Reserved is the mapped bytes. (The device's free memory is no measure here: ctest runs
  // other GPU tests at the same time.)
  EXPECT_EQ(a->memory_reserved(), 20 * kMiB);
  EXPECT_TRUE(device_bytes_are(p, kMiB + 1, 0x11));
  testing::expect_consistent(*a);
  a->deallocate(p);
  a->empty_cache();
  EXPECT_EQ(a->memory_reserved(), 0u);
  EXPECT_EQ(a->memory_stats().at("segment.all.current"), 0);
#endif
}

TEST(CudaExpandableSegments, InteriorPagesUnmapAndTheHoleIsRefilled) {
  REQUIRE_GPU();
#ifdef TALLY_WITH_CUDA
  REQUIRE_VMM();
  auto a = expandable_cuda();
  void* x = a->allocate(30 * kMiB);
  void* y = a->allocate(30 * kMiB);
  void* z = a->allocate(30 * kMiB);
  const auto base = reinterpret_cast<uintptr_t>(x);
  ASSERT_EQ(cudaMemset(z, 0x44, 30 * kMiB), cudaSuccess);
  a->deallocate(y);
  a->empty_cache();  // the whole page [40, 60) MiB inside y goes back
  EXPECT_EQ(a->memory_reserved(), 80 * kMiB);
  EXPECT_EQ(a->memory_stats().at("segment.large_pool.current"), 2);
  void* w = a->allocate(25 * kMiB);  // the lowest room: [30, 40) free + the hole
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w), base + 30 * kMiB);
  EXPECT_EQ(a->memory_reserved(), 100 * kMiB);
  ASSERT_EQ(cudaMemset(w, 0x55, 25 * kMiB), cudaSuccess);
  expect_filled_then_release(*a, {{w, 25 * kMiB, 0x55}, {z, 30 * kMiB, 0x44}}, {x, w, z});
#endif
}

// reclaim_on_growth on the device: x [0, 40), y [40, 60), z [60, 100), w [100, 120) MiB;
// x and z are freed while a kernel still writes them (stream order), then 60 MiB miss: their
// pages are unmapped (after the device synchronisation) and the end's mapping reuses them.
// The live blocks keep their bytes; the new block takes writes.
TEST(CudaExpandableSegments, ReclaimOnGrowthUnmapsScatteredPages) {
  REQUIRE_GPU();
#ifdef TALLY_WITH_CUDA
  REQUIRE_VMM();
  auto a = expandable_cuda(",reclaim_on_growth:True");
  void* x = a->allocate(40 * kMiB);
  void* y = a->allocate(20 * kMiB);
  void* z = a->allocate(40 * kMiB);
  void* w = a->allocate(20 * kMiB);
  const auto base = reinterpret_cast<uintptr_t>(x);
  ASSERT_EQ(cudaMemset(y, 0x61, 20 * kMiB), cudaSuccess);
  ASSERT_EQ(cudaMemset(w, 0x62, 20 * kMiB), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(x, 0x63, 40 * kMiB), cudaSuccess);  // in flight when freed
  ASSERT_EQ(cudaMemsetAsync(z, 0x64, 40 * kMiB), cudaSuccess);
  a->deallocate(x);
  a->deallocate(z);
  void* big = a->allocate(60 * kMiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big), base + 120 * kMiB);
  EXPECT_EQ(a->memory_reserved(), 100 * kMiB);  // 120 - 80 + 60; plain expandable: 180
  EXPECT_EQ(a->max_memory_reserved(), 120 * kMiB);
  ASSERT_EQ(cudaMemset(big, 0x65, 60 * kMiB), cudaSuccess);
  expect_filled_then_release(
      *a, {{y, 20 * kMiB, 0x61}, {w, 20 * kMiB, 0x62}, {big, 60 * kMiB, 0x65}}, {y, w, big});
#endif
}

TEST(CudaExpandableSegments, OomWhileGrowingIsRecoverable) {
  REQUIRE_GPU();
#ifdef TALLY_WITH_CUDA
  REQUIRE_VMM();
  auto a = expandable_cuda();
  const size_t total = a->provider().total_memory();
  EXPECT_THROW((void)a->allocate(total * 2), OutOfMemoryError);  // larger than a segment
  // Out of memory at a 24 GiB cap, not by filling the device: ctest runs other GPU tests at
  // the same time.
  a->set_memory_fraction(static_cast<double>(size_t{24} << 30) / static_cast<double>(total));
  std::vector<void*> chunks;
  bool oom = false;
  for (int i = 0; i < 64 && !oom; ++i) {
    try {
      chunks.push_back(a->allocate(size_t{8} << 30));
    } catch (const OutOfMemoryError& e) {
      oom = true;
      EXPECT_NE(std::string(e.what()).find("Tally out of memory on cuda:0: tried to allocate "
                                           "8.00 GiB"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_TRUE(oom);
  EXPECT_FALSE(chunks.empty());
  testing::expect_consistent(*a);
  EXPECT_GE(a->memory_stats().at("num_ooms"), 1);
  // Still usable: the memory of the freed chunks is found again.
  a->deallocate(chunks.back());
  chunks.pop_back();
  void* again = a->allocate(size_t{4} << 30);
  ASSERT_EQ(cudaMemset(again, 1, size_t{4} << 30), cudaSuccess);
  chunks.push_back(again);
  for (void* p : chunks) a->deallocate(p);
  a->empty_cache();
  EXPECT_EQ(a->memory_reserved(), 0u);
  testing::expect_consistent(*a);
#endif
}

TEST(CudaExpandableSegments, StreamsGetSegmentsOfTheirOwn) {
  REQUIRE_GPU();
#ifdef TALLY_WITH_CUDA
  REQUIRE_VMM();
  auto a = expandable_cuda();
  cudaStream_t s1;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
  const auto id1 = reinterpret_cast<StreamId>(s1);
  void* p = a->allocate(4 * kMiB);
  void* q = a->allocate(4 * kMiB, id1);
  ASSERT_EQ(cudaMemsetAsync(q, 3, 4 * kMiB, s1), cudaSuccess);
  EXPECT_EQ(a->snapshot().segments.size(), 2u);
  a->deallocate(q);
  a->empty_cache();  // waits for s1 before unmapping q's page
  EXPECT_EQ(a->memory_reserved(), 20 * kMiB);
  a->deallocate(p);
  a->empty_cache();
  EXPECT_EQ(a->memory_reserved(), 0u);
  testing::expect_consistent(*a);
  cudaStreamDestroy(s1);
#endif
}

TEST(CudaExpandableSegments, SnapshotForMemoryViz) {
  REQUIRE_GPU();
#ifdef TALLY_WITH_CUDA
  REQUIRE_VMM();
  // Like CudaAllocator.SnapshotForMemoryViz, under expandable segments: is_expandable
  // segments and segment_map / segment_unmap entries (tests/memory/check_memviz.py opens it).
  auto a = expandable_cuda();
  a->record_memory_history(true, 100000);
  std::vector<void*> acts;
  for (int i = 0; i < 8; ++i) {
    AllocContextScope ctx(Category::activation, "model.layer" + std::to_string(i), "linear",
                          "forward");
    acts.push_back(a->allocate(12 * kMiB + i * 1000));
  }
  // A hole of three ~12 MiB blocks holds at least one whole 20 MiB page of the large pool.
  a->deallocate(acts[2]);
  a->deallocate(acts[3]);
  a->deallocate(acts[4]);
  a->empty_cache();  // unmaps the page inside the hole
  {
    AllocContextScope ctx(Category::gradient, "model.layer2", "linear_backward", "backward");
    acts[2] = a->allocate(20 * kMiB);
  }
  acts.erase(acts.begin() + 3, acts.begin() + 5);
  const char* dir = std::getenv("TALLY_SNAPSHOT_DIR");
  const std::filesystem::path out =
      std::filesystem::path(dir ? dir : std::filesystem::temp_directory_path().string()) /
      "tally_cuda_expandable_snapshot.pickle";
  a->dump_snapshot(out.string());
  EXPECT_TRUE(std::filesystem::exists(out));
  const SnapshotData snap = a->snapshot();
  ASSERT_FALSE(snap.segments.empty());
  for (const SegmentInfo& seg : snap.segments) EXPECT_TRUE(seg.expandable);
  bool mapped = false, unmapped = false;
  for (const TraceEntry& e : a->history()) {
    mapped |= e.action == TraceAction::segment_map;
    unmapped |= e.action == TraceAction::segment_unmap;
  }
  EXPECT_TRUE(mapped);
  EXPECT_TRUE(unmapped);
  for (void* p : acts) a->deallocate(p);
  testing::expect_consistent(*a);
  a->empty_cache();
  EXPECT_EQ(a->memory_reserved(), 0u);
#endif
}

}  // namespace
}  // namespace tally::memory
