// expandable_segments:True (PyTorch's Note [Expandable Segments]) without a GPU: the CPU
// provider's segments reserve addresses with mmap(PROT_NONE) and map 2 MiB / 20 MiB pages with
// mprotect, so the growing-segment policy runs here exactly as on CUDA (the driver path is in
// test_allocator_cuda.cpp). The fake device checks the page bookkeeping and fails on demand;
// the meta device predicts what the CPU does.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "memory/caching_allocator.h"
#include "memory/cpu_provider.h"
#include "memory/fake_provider.h"
#include "memory/invariants.h"
#include "memory/meta.h"
#include "testing/files.h"

namespace tally::memory {
namespace {

namespace fs = std::filesystem;
using namespace tally::testing;

constexpr const char* kExpandable = "expandable_segments:True";

std::unique_ptr<CachingAllocator> cpu_allocator(size_t capacity,
                                                const std::string& conf = kExpandable) {
  return std::make_unique<CachingAllocator>(std::make_unique<CpuProvider>(capacity),
                                            AllocatorConfig::parse(conf));
}

uintptr_t addr(const void* p) {
  return reinterpret_cast<uintptr_t>(p);
}

int64_t stat(const CachingAllocator& a, const std::string& key) {
  return a.memory_stats().at(key);
}

// Fills [p, p + n) with a pattern of `seed`; checks it is still there.
void fill(void* p, size_t n, unsigned char seed) {
  auto* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; i += 4096) b[i] = static_cast<unsigned char>(seed + i / 4096);
  b[n - 1] = seed;
}
bool intact(const void* p, size_t n, unsigned char seed) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; i += 4096)
    if (b[i] != static_cast<unsigned char>(seed + i / 4096)) return false;
  return b[n - 1] == seed;
}

TEST(ExpandableSegments, OneSegmentGrowsByPages) {
  auto a = cpu_allocator(size_t{1} << 30);
  void* p = a->allocate(kMiB + 1);  // large pool: one 20 MiB page
  EXPECT_EQ(a->block_size(p), 1049088u);
  EXPECT_EQ(a->memory_reserved(), 20 * kMiB);
  EXPECT_EQ(stat(*a, "segment.large_pool.current"), 1);
  EXPECT_EQ(stat(*a, "num_device_alloc"), 1);
  fill(p, kMiB + 1, 7);
  // 30 MiB do not fit in the page's free rest: one more page is mapped right after it, and
  // the block starts where the free rest did (the segment grew, nothing moved).
  void* q = a->allocate(30 * kMiB);
  EXPECT_EQ(addr(q), addr(p) + 1049088);
  EXPECT_EQ(a->block_size(q), 30 * kMiB);  // split to 512 B although large (PyTorch)
  EXPECT_EQ(a->memory_reserved(), 40 * kMiB);
  EXPECT_EQ(stat(*a, "segment.large_pool.current"), 1);
  EXPECT_EQ(stat(*a, "num_device_alloc"), 2);
  fill(q, 30 * kMiB, 9);
  // Small requests get a segment of their own pool, in 2 MiB pages.
  void* s = a->allocate(500);
  EXPECT_EQ(a->memory_reserved(), 42 * kMiB);
  EXPECT_EQ(stat(*a, "segment.small_pool.current"), 1);
  // Much more: the large segment grows by 5 more pages; the data already there stays.
  void* big = a->allocate(100 * kMiB);
  EXPECT_EQ(addr(big), addr(q) + 30 * kMiB);
  EXPECT_EQ(a->memory_reserved(), 142 * kMiB);
  fill(big, 100 * kMiB, 11);
  EXPECT_TRUE(intact(p, kMiB + 1, 7));
  EXPECT_TRUE(intact(q, 30 * kMiB, 9));

  const SnapshotData snap = a->snapshot();
  ASSERT_EQ(snap.segments.size(), 2u);
  for (const SegmentInfo& seg : snap.segments) EXPECT_TRUE(seg.expandable);
  const SegmentInfo& large = snap.segments[0].small ? snap.segments[1] : snap.segments[0];
  EXPECT_EQ(large.address, addr(p));
  EXPECT_EQ(large.total_size, 140 * kMiB);
  ASSERT_EQ(large.blocks.size(), 4u);  // p, q, big, the free rest of the last page
  EXPECT_EQ(large.blocks[3].state, BlockState::inactive);
  EXPECT_EQ(large.blocks[3].size, 140 * kMiB - 1049088 - 130 * kMiB);
  testing::expect_consistent(*a);
  EXPECT_EQ(stat(*a, "inactive_split.all.current"), 0);  // PyTorch's rule for these segments
  for (void* b : {p, q, s, big}) a->deallocate(b);
  testing::expect_consistent(*a);
  EXPECT_EQ(a->snapshot().segments.size(), 2u);  // one free block per segment, still mapped
  a->empty_cache();
  EXPECT_EQ(a->memory_reserved(), 0u);
  EXPECT_EQ(a->snapshot().segments.size(), 0u);
  EXPECT_EQ(a->provider().free_memory(), a->provider().total_memory());
  EXPECT_EQ(stat(*a, "num_device_free"), 2);  // one unmap per free block
  testing::expect_consistent(*a);
}

// a, b, c of 30 MiB each: pages [0, 40) [40, 60) [60, 100) MiB get mapped for them.
struct ThreeBlocks {
  explicit ThreeBlocks(CachingAllocator& alloc) : a(alloc) {
    x = a.allocate(30 * kMiB);
    y = a.allocate(30 * kMiB);
    z = a.allocate(30 * kMiB);
    base = addr(x);
  }
  CachingAllocator& a;
  void* x;
  void* y;
  void* z;
  uintptr_t base;
};

TEST(ExpandableSegments, EmptyCacheUnmapsFreePagesAtTheEnd) {
  auto alloc = cpu_allocator(size_t{1} << 30);
  alloc->record_memory_history(true);
  ThreeBlocks t(*alloc);
  EXPECT_EQ(addr(t.y), t.base + 30 * kMiB);
  EXPECT_EQ(addr(t.z), t.base + 60 * kMiB);
  EXPECT_EQ(alloc->memory_reserved(), 100 * kMiB);
  alloc->deallocate(t.z);  // [60, 100) free, at the end
  alloc->empty_cache();
  EXPECT_EQ(alloc->memory_reserved(), 60 * kMiB);
  EXPECT_EQ(stat(*alloc, "reserved_bytes.large_pool.current"), static_cast<int64_t>(60 * kMiB));
  EXPECT_EQ(stat(*alloc, "segment.all.current"), 1);
  EXPECT_EQ(stat(*alloc, "num_device_free"), 1);
  const auto h = alloc->history();
  ASSERT_FALSE(h.empty());
  EXPECT_EQ(h.back().action, TraceAction::segment_unmap);
  EXPECT_EQ(h.back().addr, t.base + 60 * kMiB);
  EXPECT_EQ(h.back().size, 40 * kMiB);
  testing::expect_consistent(*alloc);
  alloc->deallocate(t.y);  // [30, 60) free: only the whole page [40, 60) can go
  alloc->empty_cache();
  EXPECT_EQ(alloc->memory_reserved(), 40 * kMiB);
  const SnapshotData snap = alloc->snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  ASSERT_EQ(snap.segments[0].blocks.size(), 2u);
  EXPECT_EQ(snap.segments[0].blocks[1].size, 10 * kMiB);
  EXPECT_EQ(snap.segments[0].blocks[1].state, BlockState::inactive);
  alloc->deallocate(t.x);
  alloc->empty_cache();  // nothing mapped any more: the segment's addresses go back too
  EXPECT_EQ(alloc->memory_reserved(), 0u);
  EXPECT_EQ(stat(*alloc, "segment.all.current"), 0);
  testing::expect_consistent(*alloc);
}

TEST(ExpandableSegments, EmptyCacheUnmapsInteriorPagesAndTheHoleIsRefilledFirst) {
  auto alloc = cpu_allocator(size_t{1} << 30);
  ThreeBlocks t(*alloc);
  fill(t.z, 30 * kMiB, 3);
  alloc->deallocate(t.y);
  alloc->empty_cache();  // [40, 60) unmapped: two runs of mapped pages, two segments
  EXPECT_EQ(alloc->memory_reserved(), 80 * kMiB);
  EXPECT_EQ(stat(*alloc, "segment.large_pool.current"), 2);
  SnapshotData snap = alloc->snapshot();
  ASSERT_EQ(snap.segments.size(), 2u);
  EXPECT_EQ(snap.segments[0].address, t.base);
  EXPECT_EQ(snap.segments[0].total_size, 40 * kMiB);
  EXPECT_EQ(snap.segments[1].address, t.base + 60 * kMiB);
  EXPECT_EQ(snap.segments[1].total_size, 40 * kMiB);
  testing::expect_consistent(*alloc);
  // 25 MiB fit nowhere mapped; the lowest place with room is the free [30, 40) plus the hole:
  // one page is mapped there and the segment is one run again.
  void* w = alloc->allocate(25 * kMiB);
  EXPECT_EQ(addr(w), t.base + 30 * kMiB);
  EXPECT_EQ(alloc->memory_reserved(), 100 * kMiB);
  EXPECT_EQ(stat(*alloc, "segment.large_pool.current"), 1);
  fill(w, 25 * kMiB, 5);
  EXPECT_TRUE(intact(t.z, 30 * kMiB, 3));
  testing::expect_consistent_then_release(*alloc, {t.x, w, t.z});
}

// The pattern of PyTorch's note: a batch that grows a little every step, so every step's
// activations are a little larger than the last step's. Per layer a small temporary and a
// large activation kept for the backward; the temporary is freed as soon as the next one is
// made (interleaved), the activations at the end of the step. Returns peak reserved / peak
// allocated: about 2.4 without expandable segments (each step's blocks are too small for the
// next step, new segments are made until the 2 GiB device is full), 1.03 with them (one
// segment that every step tiles from its start: the last page's rest and a free temporary).
double fragmentation(const std::string& conf) {
  auto alloc = cpu_allocator(size_t{2} << 30, conf);
  for (size_t step = 0; step < 10; ++step) {
    std::vector<void*> kept;
    void* tmp = nullptr;
    for (size_t layer = 0; layer < 12; ++layer) {
      const size_t batch = 32 + 4 * step;  // MiB of activation per layer
      void* next_tmp = alloc->allocate(batch * kMiB / 4);
      if (tmp) alloc->deallocate(tmp);
      tmp = next_tmp;
      kept.push_back(alloc->allocate(batch * kMiB + layer * 4096));
    }
    alloc->deallocate(tmp);
    for (void* p : kept) alloc->deallocate(p);
  }
  testing::expect_consistent(*alloc);
  return static_cast<double>(alloc->max_memory_reserved()) /
         static_cast<double>(alloc->max_memory_allocated());
}

TEST(ExpandableSegments, GrowingBatchDoesNotFragment) {
  const double without = fragmentation("");
  const double with = fragmentation(kExpandable);
  RecordProperty("reserved_over_allocated_without", std::to_string(without));
  RecordProperty("reserved_over_allocated_with", std::to_string(with));
  EXPECT_GT(without, 1.5) << "the pattern should fragment ordinary segments";
  EXPECT_LE(with, 1.05) << "without expandable segments: " << without;
}

// reclaim_on_growth: x [0, 40), y [40, 60), z [60, 100), w [100, 120) MiB; with x and z free
// (80 MiB scattered in two holes) 60 MiB fit in no free block. Plain expandable segments
// map three more pages at the end (reserved 180 MiB); with the reclaim, x's and z's pages go
// back first (the largest, then the next, until 60 MiB are unmapped) and the end's mapping
// reuses them (reserved 100 MiB; the peak stays 120). The next request refills a hole.
size_t reclaim_pattern(const std::string& conf, bool check) {
  auto alloc = cpu_allocator(size_t{1} << 30, conf);
  void* x = alloc->allocate(40 * kMiB);
  void* y = alloc->allocate(20 * kMiB);
  void* z = alloc->allocate(40 * kMiB);
  void* w = alloc->allocate(20 * kMiB);
  const uintptr_t base = addr(x);
  fill(y, 20 * kMiB, 1);
  fill(w, 20 * kMiB, 2);
  EXPECT_EQ(alloc->memory_reserved(), 120 * kMiB);
  alloc->deallocate(x);
  alloc->deallocate(z);
  const int64_t unmaps = stat(*alloc, "num_device_free");
  void* big = alloc->allocate(60 * kMiB);
  EXPECT_EQ(addr(big), base + 120 * kMiB);  // no hole holds it: the end
  fill(big, 60 * kMiB, 3);
  const size_t reserved = alloc->memory_reserved();
  if (check) {
    EXPECT_EQ(stat(*alloc, "num_device_free"), unmaps + 2);  // x's and z's pages
    EXPECT_EQ(alloc->max_memory_reserved(), 120 * kMiB);
    // Nothing free is left to take back: a request now maps (the lowest hole) without
    // unmapping anything.
    void* v = alloc->allocate(40 * kMiB);
    EXPECT_EQ(addr(v), base);
    EXPECT_EQ(alloc->memory_reserved(), 140 * kMiB);
    EXPECT_EQ(stat(*alloc, "num_device_free"), unmaps + 2);
    fill(v, 40 * kMiB, 4);
    alloc->deallocate(v);
  }
  EXPECT_TRUE(intact(y, 20 * kMiB, 1));
  EXPECT_TRUE(intact(w, 20 * kMiB, 2));
  EXPECT_TRUE(intact(big, 60 * kMiB, 3));
  testing::expect_consistent_then_release(*alloc, {y, w, big});
  return reserved;
}

TEST(ExpandableSegments, ReclaimOnGrowthMapsFreedPagesInsteadOfNewOnes) {
  EXPECT_EQ(reclaim_pattern(kExpandable, false), 180 * kMiB);
  EXPECT_EQ(reclaim_pattern("expandable_segments:True,reclaim_on_growth:True", true), 100 * kMiB);
}

// Less free than the request: what there is goes back, the rest is new. Only whole pages:
// x [0, 30) gives [0, 20) back, its [20, 30) stays mapped and free.
TEST(ExpandableSegments, ReclaimOnGrowthTakesBackWhatThereIs) {
  auto alloc = cpu_allocator(size_t{1} << 30, "expandable_segments:True,reclaim_on_growth:True");
  void* x = alloc->allocate(30 * kMiB);
  void* y = alloc->allocate(30 * kMiB);
  alloc->deallocate(x);
  void* z = alloc->allocate(50 * kMiB);  // 3 pages at the end, where 1 went back
  EXPECT_EQ(stat(*alloc, "num_device_free"), 1);
  EXPECT_EQ(alloc->memory_reserved(), 100 * kMiB);  // 60 - 20 + 60 (plain: 120)
  void* w = alloc->allocate(10 * kMiB);             // the free [20, 30): no miss, no unmap
  EXPECT_EQ(addr(w), addr(y) - 10 * kMiB);
  EXPECT_EQ(stat(*alloc, "num_device_free"), 1);
  testing::expect_consistent(*alloc);
  for (void* p : {y, z, w}) alloc->deallocate(p);
}

TEST(ExpandableSegments, OutOfMemoryWhileGrowingIsTheUsualError) {
  auto alloc = cpu_allocator(64 * kMiB);
  CategoryScope cat(Category::activation);
  void* a = alloc->allocate(40 * kMiB);  // two pages
  try {
    (void)alloc->allocate(30 * kMiB);  // two more pages: 80 MiB > 64 MiB
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.requested(), 30 * kMiB);
    EXPECT_NE(m.find("Tally out of memory on cpu: tried to allocate 30.00 MiB"), std::string::npos)
        << m;
    EXPECT_NE(m.find("Device total 64.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("Allocated 40.00 MiB, reserved 40.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("activation 40.00 MiB"), std::string::npos) << m;
  }
  EXPECT_EQ(stat(*alloc, "num_ooms"), 1);
  EXPECT_EQ(stat(*alloc, "num_alloc_retries"), 1);
  EXPECT_EQ(alloc->memory_reserved(), 40 * kMiB);
  testing::expect_consistent(*alloc);
  void* b = alloc->allocate(20 * kMiB);  // one page fits
  EXPECT_EQ(addr(b), addr(a) + 40 * kMiB);
  fill(b, 20 * kMiB, 1);
  alloc->deallocate(a);  // [0, 40) mapped and free
  // Another stream's segment needs two pages, the device has 4 MiB: the retry unmaps the
  // free pages of stream 0's segment (empty_cache's work) and maps the new ones.
  void* c = alloc->allocate(30 * kMiB, /*stream=*/1);
  EXPECT_EQ(stat(*alloc, "num_alloc_retries"), 2);
  EXPECT_EQ(alloc->memory_reserved(), 60 * kMiB);
  EXPECT_TRUE(intact(b, 20 * kMiB, 1));
  testing::expect_consistent(*alloc);
  alloc->deallocate(c);
  alloc->deallocate(b);
  alloc->empty_cache();
  EXPECT_EQ(alloc->memory_reserved(), 0u);
  testing::expect_consistent(*alloc);
}

TEST(ExpandableSegments, OomRetryUnmapsFreePagesForAnotherPool) {
  // The large pool's free pages are what the small pool needs: the retry unmaps them.
  auto alloc = cpu_allocator(42 * kMiB);
  void* a = alloc->allocate(40 * kMiB);
  void* s = alloc->allocate(1000);  // the small pool's 2 MiB page
  alloc->deallocate(a);             // 40 MiB mapped and free
  void* t = alloc->allocate(kMiB);  // fits in the small page
  std::vector<void*> smalls;
  for (int i = 0; i < 3; ++i) smalls.push_back(alloc->allocate(kMiB));  // more small pages
  EXPECT_EQ(stat(*alloc, "num_alloc_retries"), 1);
  EXPECT_LE(alloc->memory_reserved(), 42 * kMiB);
  testing::expect_consistent(*alloc);
  for (void* p : smalls) alloc->deallocate(p);
  for (void* p : {s, t}) alloc->deallocate(p);
  alloc->empty_cache();
  EXPECT_EQ(alloc->memory_reserved(), 0u);
}

// Empties the cache and checks that nothing is left: no reserved byte, segment or page.
void expect_all_given_back(CachingAllocator& alloc, const testing::FakeProvider& dev) {
  alloc.empty_cache();
  EXPECT_EQ(alloc.memory_reserved(), 0u);
  EXPECT_EQ(dev.live_expandable, 0);
  EXPECT_EQ(dev.live_segments(), 0u);
  EXPECT_EQ(dev.used(), 0u);
}

TEST(ExpandableSegments, StreamsGetSegmentsOfTheirOwn) {
  auto fake = std::make_unique<testing::FakeProvider>(size_t{1} << 32);
  testing::FakeProvider* dev = fake.get();
  CachingAllocator alloc(std::move(fake), AllocatorConfig::parse(kExpandable));
  void* a = alloc.allocate(4 * kMiB, 1);
  void* b = alloc.allocate(4 * kMiB, 2);
  EXPECT_EQ(dev->reserves, 2);
  alloc.deallocate(a);
  void* c = alloc.allocate(4 * kMiB, 2);  // stream 1's free block is not stream 2's
  EXPECT_NE(c, a);
  EXPECT_EQ(addr(c), addr(b) + 4 * kMiB);
  // A block still used on another stream is not free space to grow into.
  dev->events_complete = false;
  void* d = alloc.allocate(30 * kMiB, 1);
  alloc.record_stream(d, 3);
  alloc.deallocate(d);
  void* e = alloc.allocate(30 * kMiB, 1);
  EXPECT_GE(addr(e), addr(d) + 30 * kMiB);
  testing::expect_consistent(alloc);
  dev->events_complete = true;
  for (void* p : {b, c, e}) alloc.deallocate(p);
  expect_all_given_back(alloc, *dev);
}

TEST(ExpandableSegments, MaxSplitSizeDoesNotKeepTheirBlocksWhole) {
  auto alloc = cpu_allocator(size_t{1} << 30, "expandable_segments:True,max_split_size_mb:20");
  void* a = alloc->allocate(30 * kMiB);
  EXPECT_EQ(alloc->block_size(a), 30 * kMiB);
  EXPECT_EQ(stat(*alloc, "oversize_allocations.current"), 1);
  EXPECT_EQ(stat(*alloc, "oversize_segments.current"), 0);
  alloc->deallocate(a);
  testing::expect_consistent(*alloc);
}

// Failures of the device's calls: a clear error, and the allocator as it was.
TEST(ExpandableSegments, ProviderFailuresLeaveTheAllocatorUsable) {
  auto fake = std::make_unique<testing::FakeProvider>(size_t{1} << 32);
  testing::FakeProvider* dev = fake.get();
  CachingAllocator alloc(std::move(fake), AllocatorConfig::parse(kExpandable));
  dev->fail_next_reserve = 1;
  EXPECT_THROW(
      {
        try {
          (void)alloc.allocate(4 * kMiB);
        } catch (const std::runtime_error& e) {
          EXPECT_NE(std::string(e.what()).find("reserve failed"), std::string::npos) << e.what();
          throw;
        }
      },
      std::runtime_error);
  EXPECT_EQ(alloc.memory_reserved(), 0u);
  EXPECT_EQ(alloc.memory_allocated(), 0u);
  EXPECT_EQ(alloc.snapshot().segments.size(), 0u);
  // A map that fails on a new segment: the segment is given back at once.
  dev->throw_next_map = 1;
  EXPECT_THROW((void)alloc.allocate(4 * kMiB), std::runtime_error);
  EXPECT_EQ(dev->live_expandable, 0);
  EXPECT_EQ(alloc.memory_reserved(), 0u);
  testing::expect_consistent(alloc);
  // Growing an existing one fails: the blocks already there are untouched.
  void* a = alloc.allocate(4 * kMiB);
  dev->throw_next_map = 1;
  EXPECT_THROW((void)alloc.allocate(40 * kMiB), std::runtime_error);
  EXPECT_EQ(alloc.memory_reserved(), 20 * kMiB);
  EXPECT_EQ(alloc.memory_allocated(), 4 * kMiB);
  EXPECT_EQ(alloc.stats().num_ooms, 0);
  testing::expect_consistent(alloc);
  // An out-of-memory answer from the device is the usual OOM path (retry, then the error).
  dev->fail_next_map = 2;
  EXPECT_THROW((void)alloc.allocate(40 * kMiB), OutOfMemoryError);
  EXPECT_EQ(alloc.stats().num_ooms, 1);
  void* b = alloc.allocate(40 * kMiB);
  EXPECT_EQ(addr(b), addr(a) + 4 * kMiB);
  EXPECT_EQ(alloc.memory_reserved(), 60 * kMiB);
  alloc.deallocate(b);
  testing::expect_consistent(alloc);
  // Unmapping stops after one of the two free pages: the allocator forgets exactly that one.
  const int64_t frees = alloc.stats().num_device_free;
  dev->unmap_throws_after_pages = 1;
  EXPECT_THROW(alloc.empty_cache(), std::runtime_error);
  EXPECT_EQ(alloc.memory_reserved(), 40 * kMiB);
  EXPECT_EQ(alloc.stats().num_device_free, frees + 1);
  testing::expect_consistent(alloc);
  alloc.empty_cache();
  EXPECT_EQ(alloc.memory_reserved(), 20 * kMiB);
  alloc.deallocate(a);
  expect_all_given_back(alloc, *dev);
  testing::expect_consistent(alloc);
}

// A device without expandable segments names itself; the allocator stays usable.
class NoExpandableProvider final : public MemoryProvider {
 public:
  void* allocate(size_t bytes) override { return inner_.allocate(bytes); }
  void deallocate(void* ptr, size_t bytes) override { inner_.deallocate(ptr, bytes); }
  size_t total_memory() const override { return inner_.total_memory(); }
  size_t free_memory() const override { return inner_.free_memory(); }
  DeviceType device_type() const override { return DeviceType::cuda; }
  int device_index() const override { return 3; }
  std::string device_name() const override { return "plain:3"; }

 private:
  testing::FakeProvider inner_{size_t{1} << 30};
};

TEST(ExpandableSegments, UnsupportedDeviceIsAClearError) {
  CachingAllocator alloc(std::make_unique<NoExpandableProvider>(),
                         AllocatorConfig::parse(kExpandable));
  try {
    (void)alloc.allocate(1000);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("expandable_segments"), std::string::npos) << m;
    EXPECT_NE(m.find("plain:3"), std::string::npos) << m;
  }
  EXPECT_EQ(alloc.memory_reserved(), 0u);
  alloc.set_config(AllocatorConfig::parse(""));
  void* p = alloc.allocate(1000);
  EXPECT_EQ(alloc.memory_reserved(), 2 * kMiB);
  alloc.deallocate(p);
  testing::expect_consistent(alloc);
}

// set_config can turn them off with segments alive (PyTorch allows it too): new blocks come
// from ordinary segments, the expandable ones are freed and emptied as before.
TEST(ExpandableSegments, TurnedOffLater) {
  auto fake = std::make_unique<testing::FakeProvider>(size_t{1} << 32);
  testing::FakeProvider* dev = fake.get();
  CachingAllocator alloc(std::move(fake), AllocatorConfig::parse(kExpandable));
  void* a = alloc.allocate(4 * kMiB);
  void* b = alloc.allocate(4 * kMiB);
  alloc.deallocate(a);
  alloc.set_config(AllocatorConfig::parse(""));
  void* c = alloc.allocate(4 * kMiB);  // not into a's free block: a new 20 MiB cudaMalloc
  EXPECT_NE(c, a);
  EXPECT_EQ(dev->allocs, 1);
  EXPECT_EQ(alloc.memory_reserved(), 40 * kMiB);
  testing::expect_consistent(alloc);
  alloc.deallocate(b);
  alloc.deallocate(c);
  expect_all_given_back(alloc, *dev);
}

// Random work on real memory: every block is written at both ends and checked when freed,
// so a page handed out unmapped faults and a block handed out twice shows.
TEST(ExpandableSegments, RandomWorkKeepsDataAndInvariants) {
  auto alloc = cpu_allocator(size_t{1} << 30, "expandable_segments:True,max_split_size_mb:40");
  alloc->record_memory_history(true, 2000);
  std::mt19937_64 rng(17);
  struct Live {
    unsigned char* p;
    size_t n;
    unsigned char mark;
  };
  std::vector<Live> live;
  int ooms = 0;
  for (int step = 0; step < 3000; ++step) {
    const unsigned op = rng() % 100;
    if (op < 55 || live.empty()) {
      const size_t n = rng() % 4 == 0 ? 1 + rng() % (48 * kMiB) : 1 + rng() % (256 * 1024);
      try {
        auto* p = static_cast<unsigned char*>(alloc->allocate(n, rng() % 2));
        const auto mark = static_cast<unsigned char>(rng());
        p[0] = p[n - 1] = mark;
        live.push_back({p, n, mark});
      } catch (const OutOfMemoryError&) {
        ++ooms;
      }
    } else if (op < 97) {
      const size_t k = rng() % live.size();
      EXPECT_EQ(live[k].p[0], live[k].mark);
      EXPECT_EQ(live[k].p[live[k].n - 1], live[k].mark);
      alloc->deallocate(live[k].p);
      live[k] = live.back();
      live.pop_back();
    } else {
      alloc->empty_cache();
    }
    if (step % 250 == 0) {
      testing::expect_consistent(*alloc);
      if (::testing::Test::HasFailure()) return;
    }
  }
  testing::expect_consistent(*alloc);
  EXPECT_EQ(alloc->stats().num_ooms, ooms);
  for (const Live& l : live) alloc->deallocate(l.p);
  alloc->empty_cache();
  EXPECT_EQ(alloc->memory_reserved(), 0u);
  EXPECT_EQ(alloc->provider().free_memory(), alloc->provider().total_memory());
  testing::expect_consistent(*alloc);
}

// A dry run on the meta device maps the same pages as the device it replays, with and
// without reclaim_on_growth.
class ExpandableMeta : public ::testing::TestWithParam<const char*> {};

TEST_P(ExpandableMeta, MetaDevicePredictsTheCpu) {
  const size_t capacity = 512 * kMiB;
  auto cpu = cpu_allocator(capacity, GetParam());
  const Device meta = new_meta_device(
      MetaTarget{.name = "expandable-test", .type = DeviceType::cpu, .capacity = capacity});
  CachingAllocator& dry = meta_allocator(meta.index);
  dry.set_config(AllocatorConfig::parse(GetParam()));
  for (CachingAllocator* a : {cpu.get(), &dry}) {
    std::mt19937_64 rng(5);
    std::vector<void*> live;
    for (int i = 0; i < 600; ++i) {
      if (live.empty() || rng() % 3 != 0) {
        const size_t n = rng() % 3 == 0 ? 1 + rng() % (40 * kMiB) : 1 + rng() % 100000;
        try {
          live.push_back(a->allocate(n));
        } catch (const OutOfMemoryError&) {
        }
      } else {
        const size_t k = rng() % live.size();
        a->deallocate(live[k]);
        live[k] = live.back();
        live.pop_back();
      }
      if (i == 300) a->empty_cache();
    }
    for (void* p : live) a->deallocate(p);
  }
  for (const char* key : {"reserved_bytes.all.peak", "allocated_bytes.all.peak", "segment.all.peak",
                          "num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms",
                          "reserved_bytes.all.current"})
    EXPECT_EQ(stat(dry, key), stat(*cpu, key)) << key;
  testing::expect_consistent(dry);
  dry.empty_cache();
  EXPECT_EQ(dry.memory_reserved(), 0u);
}
INSTANTIATE_TEST_SUITE_P(Configs, ExpandableMeta,
                         ::testing::Values(kExpandable,
                                           "expandable_segments:True,reclaim_on_growth:True"));

// ---- snapshots: what PyTorch writes for expandable segments, read back by Python

TEST(ExpandableSegments, SnapshotMarksThemAndPythonReadsIt) {
  auto alloc = cpu_allocator(size_t{1} << 30);
  alloc->record_memory_history(true, 100000);
  std::vector<void*> live;
  {
    AllocContextScope ctx(Category::activation, "layer1", "linear", "forward");
    for (int i = 0; i < 6; ++i) live.push_back(alloc->allocate((i + 1) * 7 * kMiB + 123));
    for (int i = 0; i < 6; ++i) live.push_back(alloc->allocate(1000 * (i + 1)));
  }
  alloc->deallocate(live[4]);  // 35 MiB at 70 MiB: a hole with the page [80, 100) MiB inside
  live.erase(live.begin() + 4);
  alloc->empty_cache();
  {
    AllocContextScope ctx(Category::gradient, "layer1", "linear_backward", "backward");
    live.push_back(alloc->allocate(5 * kMiB));  // refills part of the hole
  }
  const fs::path file = temp_file("tally_expandable") += ".pickle";
  alloc->dump_snapshot(file.string());
  const SnapshotData snap = alloc->snapshot();
  size_t runs = 0;
  for (const SegmentInfo& s : snap.segments) {
    EXPECT_TRUE(s.expandable);
    ++runs;
  }
  const std::string py =
      "import pickle,sys\n"
      "d=pickle.load(open(sys.argv[1],'rb'))\n"
      "segs=d['segments']\n"
      "assert segs and all(s['is_expandable'] is True for s in segs), segs\n"
      "assert d['allocator_settings']['expandable_segments'] is True\n"
      "assert d['allocator_settings']['PYTORCH_CUDA_ALLOC_CONF'] == 'expandable_segments:True'\n"
      "t=d['device_traces'][0]\n"
      "acts=[e['action'] for e in t]\n"
      "assert 'segment_map' in acts and 'segment_unmap' in acts, acts\n"
      "assert 'segment_alloc' not in acts and 'segment_free' not in acts, acts\n"
      "for e in t:\n"
      "  if e['action'] in ('segment_map','segment_unmap'):\n"
      "    assert e['category']=='unknown' and e['size']>0 and e['size']%(2<<20)==0, e\n"
      "print(len(segs))\n";
  EXPECT_EQ(run_python(py, file.string()), std::to_string(runs) + "\n");
  // The format checker (docs/memory-formats.md) replays the trace, segment_map and
  // segment_unmap included, as the viewer's Allocator State History does.
  int status = 0;
  const std::string out =
      run(std::string(TALLY_PYTHON) + " " + TALLY_SOURCE_DIR + "/tests/memory/check_snapshot.py " +
              file.string() + " --expect-live " + std::to_string(live.size()),
          &status);
  EXPECT_EQ(status, 0) << out;
  fs::remove(file);
  for (void* p : live) alloc->deallocate(p);
}

// The CPU's memory is the system's too: a large request the system cannot give (less
// CpuProvider::kOsReserve) fails as out-of-memory, in ordinary and expandable segments, where
// touching it would have brought the kernel's out-of-memory killer.
size_t g_system_available = 0;
size_t system_available() {
  return g_system_available;
}

TEST(CpuProvider, LargeRequestsNeedWhatTheSystemCanGive) {
  g_system_available = CpuProvider::kOsReserve + 64 * kMiB;
  CpuProvider p(size_t{8} << 30, system_available);
  EXPECT_EQ(p.free_memory(), 64 * kMiB);  // less than the capacity: the system's
  EXPECT_EQ(p.allocate(65 * kMiB), nullptr);
  void* fits = p.allocate(64 * kMiB);
  ASSERT_NE(fits, nullptr);
  p.deallocate(fits, 64 * kMiB);
  g_system_available = 0;  // small requests do not ask
  void* small = p.allocate(CpuProvider::kOsCheckBytes - 4096);
  ASSERT_NE(small, nullptr);
  p.deallocate(small, CpuProvider::kOsCheckBytes - 4096);
  EXPECT_EQ(p.free_memory(), 0u);

  for (const char* conf : {"", kExpandable}) {
    SCOPED_TRACE(conf);
    g_system_available = CpuProvider::kOsReserve + 100 * kMiB;
    CachingAllocator a(std::make_unique<CpuProvider>(size_t{8} << 30, system_available),
                       AllocatorConfig::parse(conf));
    void* ok = a.allocate(60 * kMiB);
    g_system_available -= 60 * kMiB;  // what the first request took from the system
    try {
      a.allocate(60 * kMiB);
      FAIL() << "expected OutOfMemoryError";
    } catch (const OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("tried to allocate 60.00 MiB"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("free 40.00 MiB"), std::string::npos) << e.what();
    }
    a.deallocate(ok);
  }
}

TEST(CpuProvider, ReadsTheSystemsAvailableMemory) {
  const size_t a = CpuProvider::os_available_memory();
  if (!fs::exists("/proc/meminfo")) GTEST_SKIP() << "no /proc/meminfo";
  EXPECT_GT(a, size_t{0});
  EXPECT_LE(a, HostMemoryProvider::physical_memory());
}

// What is built outside the allocator must leave the reserve of what the system can give.
TEST(CpuProvider, HostCanHoldChecksSizeAndOverflow) {
  if (!fs::exists("/proc/meminfo")) GTEST_SKIP() << "no /proc/meminfo";
  uint64_t bytes = 0, available = 0;
  EXPECT_TRUE(CpuProvider::host_can_hold(1000, 32, bytes, available));
  EXPECT_EQ(bytes, 32000u);
  EXPECT_GT(available, CpuProvider::kOsReserve);
  // Twice what is available (the figure moves as other processes run).
  EXPECT_FALSE(CpuProvider::host_can_hold(available, 2, bytes, available));
  EXPECT_FALSE(CpuProvider::host_can_hold(uint64_t{1} << 62, 8, bytes, available));
  EXPECT_EQ(bytes, UINT64_MAX);  // 2^65 bytes: overflow, not a wrapped small size
}

}  // namespace
}  // namespace tally::memory
