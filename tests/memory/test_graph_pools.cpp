// Graph-private pools (CachingAllocator::begin_allocate_to_pool, PyTorch's MempoolId): what a
// CUDA graph's capture allocates stays out of everyone else's reach until the graph is gone.
// Against the fake device, so each rule is checked without a GPU.
#include <gtest/gtest.h>

#include <sstream>
#include <stdexcept>
#include <string>

#include "inspect/unpickle.h"
#include "memory/caching_allocator.h"
#include "memory/fake_provider.h"
#include "memory/snapshot.h"

namespace tally::memory {
using namespace tally::inspect;
namespace {

using testing::FakeProvider;

constexpr StreamId kCapture = 7;

struct Fixture {
  explicit Fixture(std::string conf = "") {
    auto p = std::make_unique<FakeProvider>(size_t{1} << 34);
    fake = p.get();
    alloc = std::make_unique<CachingAllocator>(std::move(p), AllocatorConfig::parse(conf));
  }
  FakeProvider* fake;
  std::unique_ptr<CachingAllocator> alloc;
};

TEST(GraphPools, HandlesAreUniqueAndNeverTheDefaultPool) {
  const MempoolId a = graph_pool_handle(), b = graph_pool_handle();
  EXPECT_NE(a, 0u);
  EXPECT_NE(b, 0u);
  EXPECT_NE(a, b);
}

TEST(GraphPools, CaptureNeverTakesTheDefaultPoolsCachedBlocks) {
  Fixture f;
  void* cached = f.alloc->allocate(4 * kMiB, kCapture);
  f.alloc->deallocate(cached);  // a free 20 MiB segment in the default pool
  const MempoolId pool = graph_pool_handle();
  f.alloc->begin_allocate_to_pool(pool, kCapture);
  EXPECT_TRUE(f.alloc->capturing());
  void* in_graph = f.alloc->allocate(4 * kMiB, kCapture);
  EXPECT_NE(in_graph, cached);
  EXPECT_EQ(f.fake->allocs, 2);  // a segment of the pool's own
  // Another stream is not captured: it still takes the default pool's block.
  void* other = f.alloc->allocate(4 * kMiB, /*stream=*/kCapture + 1);
  f.alloc->end_allocate_to_pool(pool);
  EXPECT_FALSE(f.alloc->capturing());
  // After the capture the default pool serves the stream again, and the graph's free memory
  // is not handed out.
  f.alloc->deallocate(in_graph);
  void* after = f.alloc->allocate(4 * kMiB, kCapture);
  EXPECT_EQ(after, cached);
  void* more = f.alloc->allocate(4 * kMiB, kCapture);
  EXPECT_NE(more, in_graph);
  f.alloc->deallocate(after);
  f.alloc->deallocate(more);
  f.alloc->deallocate(other);
  f.alloc->release_pool(pool);
}

TEST(GraphPools, BlocksFreedInACaptureAreReusedByTheSameCapture) {
  Fixture f;
  const MempoolId pool = graph_pool_handle();
  f.alloc->begin_allocate_to_pool(pool, kCapture);
  void* a = f.alloc->allocate(3 * kMiB, kCapture);
  f.alloc->deallocate(a);
  void* b = f.alloc->allocate(3 * kMiB, kCapture);
  EXPECT_EQ(a, b);  // stream order inside the graph makes this safe
  f.alloc->end_allocate_to_pool(pool);
  f.alloc->deallocate(b);
  f.alloc->release_pool(pool);
}

TEST(GraphPools, ReleaseGivesFreeSegmentsBackAndKeepsLiveOnes) {
  Fixture f;
  const MempoolId pool = graph_pool_handle();
  f.alloc->begin_allocate_to_pool(pool, kCapture);
  void* kept = f.alloc->allocate(30 * kMiB, kCapture);   // a static output: outlives the graph
  void* freed = f.alloc->allocate(40 * kMiB, kCapture);  // a temporary of the step
  f.alloc->deallocate(freed);
  f.alloc->end_allocate_to_pool(pool);
  EXPECT_EQ(f.alloc->memory_reserved(), 70 * kMiB);
  // empty_cache leaves a pool alone while a graph uses it.
  f.alloc->empty_cache();
  EXPECT_EQ(f.alloc->memory_reserved(), 70 * kMiB);
  auto pools = f.alloc->graph_pools();
  ASSERT_EQ(pools.size(), 1u);
  EXPECT_EQ(pools[0].id, pool);
  EXPECT_EQ(pools[0].use_count, 1);
  EXPECT_EQ(pools[0].segments, 2u);
  EXPECT_EQ(pools[0].reserved, 70 * kMiB);
  EXPECT_EQ(pools[0].allocated, 30 * kMiB);
  f.alloc->release_pool(pool);
  EXPECT_EQ(f.alloc->memory_reserved(), 30 * kMiB);  // the free segment went back
  EXPECT_EQ(f.alloc->graph_pools().size(), 1u);      // the live block keeps the pool
  f.alloc->deallocate(kept);
  f.alloc->empty_cache();
  EXPECT_EQ(f.alloc->memory_reserved(), 0u);
  EXPECT_TRUE(f.alloc->graph_pools().empty());
  EXPECT_EQ(f.fake->live_segments(), 0u);
}

TEST(GraphPools, ASharedPoolLivesUntilItsLastGraphIsReleased) {
  Fixture f;
  const MempoolId pool = graph_pool_handle();
  for (int graph = 0; graph < 2; ++graph) {
    f.alloc->begin_allocate_to_pool(pool, kCapture);
    f.alloc->deallocate(f.alloc->allocate(30 * kMiB, kCapture));
    f.alloc->end_allocate_to_pool(pool);
  }
  EXPECT_EQ(f.alloc->memory_reserved(), 30 * kMiB);  // the second capture reused the first's
  EXPECT_EQ(f.alloc->graph_pools().at(0).use_count, 2);
  f.alloc->release_pool(pool);
  EXPECT_EQ(f.alloc->memory_reserved(), 30 * kMiB);
  f.alloc->release_pool(pool);
  EXPECT_EQ(f.alloc->memory_reserved(), 0u);
  EXPECT_THROW(f.alloc->release_pool(pool), std::invalid_argument);
}

TEST(GraphPools, NothingSynchronisesWhileCapturing) {
  Fixture f;
  // A block used on a second stream: its free needs an event, which a capture cannot query.
  void* shared = f.alloc->allocate(4 * kMiB, kCapture);
  f.alloc->record_stream(shared, /*stream=*/99);
  const MempoolId pool = graph_pool_handle();
  f.alloc->begin_allocate_to_pool(pool, kCapture);
  f.alloc->deallocate(shared);
  EXPECT_EQ(f.fake->events_recorded, 0);
  // Out of memory while capturing raises at once, freeing no cached segment (that would
  // synchronise).
  void* cached = f.alloc->allocate(2 * kMiB, /*stream=*/5);
  f.alloc->deallocate(cached);
  const int syncs = f.fake->syncs, frees = f.fake->frees;
  EXPECT_THROW(f.alloc->allocate(size_t{1} << 35, kCapture), OutOfMemoryError);
  EXPECT_EQ(f.fake->syncs, syncs);
  EXPECT_EQ(f.fake->frees, frees);
  EXPECT_THROW(f.alloc->empty_cache(), std::logic_error);
  // The held-back free is pending (not reusable) until the capture ends.
  bool pending = false;
  for (const SegmentInfo& s : f.alloc->snapshot().segments)
    for (const BlockInfo& b : s.blocks)
      pending = pending || (b.address == reinterpret_cast<uintptr_t>(shared) &&
                            b.state == BlockState::active_pending_free);
  EXPECT_TRUE(pending);
  f.alloc->end_allocate_to_pool(pool);
  EXPECT_EQ(f.fake->events_recorded, 1);
  void* again = f.alloc->allocate(4 * kMiB, kCapture);  // the event completed: reused
  EXPECT_EQ(again, shared);
  f.alloc->deallocate(again);
  f.alloc->release_pool(pool);
}

TEST(GraphPools, MisuseIsAClearError) {
  Fixture f;
  EXPECT_THROW(f.alloc->begin_allocate_to_pool(0, kCapture), std::invalid_argument);
  const MempoolId pool = graph_pool_handle();
  EXPECT_THROW(f.alloc->end_allocate_to_pool(pool), std::logic_error);
  EXPECT_THROW(f.alloc->release_pool(pool), std::invalid_argument);
  f.alloc->begin_allocate_to_pool(pool, kCapture);
  try {
    f.alloc->begin_allocate_to_pool(graph_pool_handle(), kCapture);
    ADD_FAILURE() << "a stream allocated to two pools at once";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("already allocates to private pool"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(f.alloc->release_pool(pool), std::logic_error);  // still capturing
  f.alloc->end_allocate_to_pool(pool);
  f.alloc->release_pool(pool);
}

TEST(GraphPools, SnapshotAndSummaryShowThePool) {
  Fixture f;
  void* plain = f.alloc->allocate(kMiB, kCapture);
  const MempoolId pool = graph_pool_handle();
  f.alloc->begin_allocate_to_pool(pool, kCapture);
  void* in_graph = f.alloc->allocate(25 * kMiB, kCapture);
  f.alloc->end_allocate_to_pool(pool);
  const SnapshotData snap = f.alloc->snapshot();
  ASSERT_EQ(snap.segments.size(), 2u);
  int graph_segments = 0;
  for (const SegmentInfo& s : snap.segments) graph_segments += s.pool_id == pool;
  EXPECT_EQ(graph_segments, 1);
  // The pickle carries it as PyTorch's segment_pool_id (0, id).
  std::ostringstream out;
  write_snapshot_pickle(snap, out);
  const std::string bytes = out.str();
  const PickleValue root = unpickle(bytes);
  bool found = false;
  for (const PickleValue& seg : root.as_dict().find("segments")->as_list()) {
    const auto& id = seg.as_dict().find("segment_pool_id")->as_list();
    ASSERT_EQ(id.size(), 2u);
    EXPECT_EQ(id[0].as_int(), 0);
    found = found || id[1].as_int() == static_cast<int64_t>(pool);
  }
  EXPECT_TRUE(found);
  const std::string summary = f.alloc->memory_summary();
  EXPECT_NE(
      summary.find("Graph pool " + std::to_string(pool) + ": 1 graph(s) use it, 1 segment(s)"),
      std::string::npos)
      << summary;
  f.alloc->deallocate(in_graph);
  f.alloc->deallocate(plain);
  f.alloc->release_pool(pool);
}

}  // namespace
}  // namespace tally::memory
