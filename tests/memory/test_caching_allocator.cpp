// Policy tests of the caching allocator against a deterministic fake device, with the
// numbers PyTorch's allocator shows (docs/memory-formats.md §4).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>

#include "memory/caching_allocator.h"
#include "memory/fake_provider.h"
#include "testing/gradcheck.h"

namespace tally::memory {
namespace {

using testing::FakeProvider;

struct Fixture {
  explicit Fixture(size_t capacity = size_t{1} << 34, std::string conf = "") {
    auto p = std::make_unique<FakeProvider>(capacity);
    fake = p.get();
    alloc = std::make_unique<CachingAllocator>(std::move(p), AllocatorConfig::parse(conf));
  }
  FakeProvider* fake;
  std::unique_ptr<CachingAllocator> alloc;
  int64_t stat(const std::string& k) const { return alloc->memory_stats().at(k); }
};

uintptr_t addr(void* p) {
  return reinterpret_cast<uintptr_t>(p);
}

TEST(CachingAllocator, RoundsTo512) {
  Fixture f;
  EXPECT_EQ(f.alloc->round_size(1), 512u);
  EXPECT_EQ(f.alloc->round_size(100), 512u);
  EXPECT_EQ(f.alloc->round_size(512), 512u);
  EXPECT_EQ(f.alloc->round_size(513), 1024u);
  EXPECT_EQ(f.alloc->round_size(12000), 12288u);
}

TEST(CachingAllocator, RoundupPower2Divisions) {
  Fixture f(size_t{1} << 34, "roundup_power2_divisions:4");
  EXPECT_EQ(f.alloc->round_size(5 * kMiB + 1), 6 * kMiB);  // step 1 MiB in [4, 8) MiB
  EXPECT_EQ(f.alloc->round_size(8 * kMiB), 8 * kMiB);      // powers of two stay
  EXPECT_EQ(f.alloc->round_size(1000), 1024u);             // <= 512 * divisions: plain
  EXPECT_EQ(f.alloc->round_size(3000), 3072u);             // [2048, 4096) step 512
  Fixture g(size_t{1} << 34, "roundup_power2_divisions:[256:1,>:8]");
  EXPECT_EQ(g.alloc->round_size(5 * kMiB + 1), 5 * kMiB + 512);  // 1 division: plain
  EXPECT_EQ(g.alloc->round_size(300 * kMiB), 300 * kMiB);        // [256, 512): 1 division
  EXPECT_EQ(g.alloc->round_size(600 * kMiB), 640 * kMiB);        // [512, 1024): step 64 MiB
}

TEST(CachingAllocator, SmallRequestGetsSmallSegment) {
  Fixture f;
  void* p = f.alloc->allocate(1);
  EXPECT_EQ(f.alloc->block_size(p), 512u);
  EXPECT_EQ(f.alloc->memory_reserved(), 2 * kMiB);
  EXPECT_EQ(f.alloc->memory_allocated(), 512u);
  EXPECT_EQ(f.stat("segment.small_pool.current"), 1);
  EXPECT_EQ(f.stat("requested_bytes.all.current"), 1);
  f.alloc->deallocate(p);
  EXPECT_EQ(f.alloc->memory_allocated(), 0u);
  EXPECT_EQ(f.alloc->memory_reserved(), 2 * kMiB);  // cached
}

TEST(CachingAllocator, OneMiBIsSmallOneMiBPlusOneIsLarge) {
  Fixture f;
  void* a = f.alloc->allocate(kMiB);
  EXPECT_EQ(f.stat("allocated_bytes.small_pool.current"), static_cast<int64_t>(kMiB));
  void* b = f.alloc->allocate(kMiB + 1);
  EXPECT_EQ(f.alloc->block_size(b), 1049088u);
  EXPECT_EQ(f.stat("reserved_bytes.large_pool.current"), static_cast<int64_t>(20 * kMiB));
  f.alloc->deallocate(a);
  f.alloc->deallocate(b);
}

TEST(CachingAllocator, LargeBlocksShareATwentyMiBSegment) {
  Fixture f;
  void* a = f.alloc->allocate(kMiB + 1);
  void* b = f.alloc->allocate(5 * kMiB);
  void* c = f.alloc->allocate(10 * kMiB);  // best fit from the 20 MiB segment's remainder
  EXPECT_EQ(f.fake->allocs, 1);
  EXPECT_EQ(f.alloc->memory_reserved(), 20 * kMiB);
  EXPECT_EQ(addr(b), addr(a) + 1049088);
  EXPECT_EQ(addr(c), addr(b) + 5 * kMiB);
  SnapshotData s = f.alloc->snapshot();
  ASSERT_EQ(s.segments.size(), 1u);
  ASSERT_EQ(s.segments[0].blocks.size(), 4u);
  EXPECT_EQ(s.segments[0].blocks[3].state, BlockState::inactive);
  EXPECT_EQ(s.segments[0].blocks[3].size, 20 * kMiB - 1049088 - 15 * kMiB);
  for (void* p : {a, b, c}) f.alloc->deallocate(p);
  s = f.alloc->snapshot();
  ASSERT_EQ(s.segments[0].blocks.size(), 1u);  // merged back into one free block
  EXPECT_EQ(f.stat("inactive_split.all.current"), 0);
  EXPECT_EQ(f.stat("inactive_split_bytes.all.current"), 0);
}

TEST(CachingAllocator, TenMiBPlusOneSplitsTwelveMiBSegment) {
  Fixture f;
  void* p = f.alloc->allocate(10 * kMiB + 1);
  EXPECT_EQ(f.alloc->block_size(p), 10486272u);
  EXPECT_EQ(f.alloc->memory_reserved(), 12 * kMiB);
  SnapshotData s = f.alloc->snapshot();
  ASSERT_EQ(s.segments[0].blocks.size(), 2u);
  EXPECT_EQ(s.segments[0].blocks[1].size, 2096640u);
  EXPECT_EQ(f.stat("inactive_split_bytes.large_pool.current"), 2096640);
  EXPECT_EQ(f.stat("inactive_split.large_pool.current"), 1);
  f.alloc->deallocate(p);
}

TEST(CachingAllocator, ThirtyMiBGetsItsOwnSegment) {
  Fixture f;
  void* p = f.alloc->allocate(30 * kMiB);
  EXPECT_EQ(f.alloc->memory_reserved(), 30 * kMiB);
  EXPECT_EQ(f.alloc->snapshot().segments[0].blocks.size(), 1u);
  f.alloc->deallocate(p);
}

TEST(CachingAllocator, SmallSplitAndMergeTracksInactiveSplit) {
  Fixture f;
  void* a = f.alloc->allocate(1000);
  void* b = f.alloc->allocate(1000);
  void* c = f.alloc->allocate(1000);
  EXPECT_EQ(f.fake->allocs, 1);
  EXPECT_EQ(addr(b), addr(a) + 1024);
  EXPECT_EQ(f.stat("inactive_split.small_pool.current"), 1);  // the tail
  f.alloc->deallocate(b);                                     // hole in the middle
  EXPECT_EQ(f.stat("inactive_split.small_pool.current"), 2);
  EXPECT_EQ(f.stat("inactive_split_bytes.small_pool.current"),
            static_cast<int64_t>(2 * kMiB - 3072 + 1024));
  f.alloc->deallocate(a);  // merges with b
  EXPECT_EQ(f.stat("inactive_split.small_pool.current"), 2);
  f.alloc->deallocate(c);  // merges everything
  EXPECT_EQ(f.stat("inactive_split.small_pool.current"), 0);
  EXPECT_EQ(f.stat("inactive_split_bytes.small_pool.current"), 0);
  EXPECT_EQ(f.alloc->snapshot().segments[0].blocks.size(), 1u);
  // Best fit: the freed 2 MiB block is reused, no new segment.
  void* d = f.alloc->allocate(4096);
  EXPECT_EQ(addr(d), addr(a));
  EXPECT_EQ(f.fake->allocs, 1);
  f.alloc->deallocate(d);
}

TEST(CachingAllocator, BestFitPicksSmallestSufficientBlock) {
  Fixture f;
  void* big = f.alloc->allocate(40 * kMiB);
  void* mid = f.alloc->allocate(12 * kMiB);
  f.alloc->deallocate(big);
  f.alloc->deallocate(mid);
  void* p = f.alloc->allocate(11 * kMiB);
  EXPECT_EQ(p, mid);
  f.alloc->deallocate(p);
}

TEST(CachingAllocator, CacheReuseAvoidsDeviceAllocation) {
  Fixture f;
  void* p = f.alloc->allocate(4 * kMiB);
  f.alloc->deallocate(p);
  void* q = f.alloc->allocate(4 * kMiB);
  EXPECT_EQ(p, q);
  EXPECT_EQ(f.stat("num_device_alloc"), 1);
  f.alloc->deallocate(q);
}

TEST(CachingAllocator, BlocksRememberTheirStream) {
  Fixture f;
  void* p = f.alloc->allocate(4 * kMiB, /*stream=*/1);
  f.alloc->deallocate(p);
  void* q = f.alloc->allocate(4 * kMiB, /*stream=*/2);
  EXPECT_NE(p, q);
  EXPECT_EQ(f.stat("num_device_alloc"), 2);
  SnapshotData s = f.alloc->snapshot();
  ASSERT_EQ(s.segments.size(), 2u);
  EXPECT_EQ(s.segments[0].stream, 1u);
  EXPECT_EQ(s.segments[1].stream, 2u);
  f.alloc->deallocate(q);
}

TEST(CachingAllocator, MaxSplitSizeKeepsOversizeBlocksWhole) {
  Fixture f(size_t{1} << 34, "max_split_size_mb:20");
  EXPECT_EQ(f.stat("max_split_size"), static_cast<int64_t>(20 * kMiB));
  void* big = f.alloc->allocate(25 * kMiB);
  EXPECT_EQ(f.stat("oversize_allocations.current"), 1);
  EXPECT_EQ(f.stat("oversize_segments.current"), 1);
  f.alloc->deallocate(big);
  void* small = f.alloc->allocate(5 * kMiB);  // must not carve the oversize block
  EXPECT_NE(small, big);
  EXPECT_EQ(f.stat("num_device_alloc"), 2);
  void* again = f.alloc->allocate(24 * kMiB);  // 26 MiB block < 24 + 20 MiB: taken whole
  EXPECT_EQ(again, big);
  EXPECT_EQ(f.alloc->block_size(again), 26 * kMiB);  // 25 MiB rounded up to 2 MiB, unsplit
  void* huge = f.alloc->allocate(50 * kMiB);
  f.alloc->deallocate(huge);
  void* q = f.alloc->allocate(28 * kMiB);  // 50 >= 28 + 20: not taken
  EXPECT_NE(q, huge);
  void* r = f.alloc->allocate(31 * kMiB);  // 50 < 31 + 20: taken
  EXPECT_EQ(r, huge);
  for (void* p : {again, q, r, small}) f.alloc->deallocate(p);
}

TEST(CachingAllocator, RetryFreesCacheThenSucceeds) {
  Fixture f(64 * kMiB);
  void* a = f.alloc->allocate(30 * kMiB);
  f.alloc->deallocate(a);                  // 30 MiB cached
  void* b = f.alloc->allocate(40 * kMiB);  // device has 34 MiB free: free cache, retry
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(f.stat("num_alloc_retries"), 1);
  EXPECT_EQ(f.stat("num_device_free"), 1);
  EXPECT_EQ(f.alloc->memory_reserved(), 40 * kMiB);
  f.alloc->deallocate(b);
}

TEST(CachingAllocator, OomLeavesAllocatorConsistentAndUsable) {
  Fixture f(64 * kMiB);
  CategoryScope cat(Category::activation);
  void* a = f.alloc->allocate(40 * kMiB);
  void* s = f.alloc->allocate(1000);
  try {
    f.alloc->allocate(30 * kMiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.requested(), 30 * kMiB);
    EXPECT_NE(m.find("tried to allocate 30.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("Device total 64.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("Allocated 40.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("reserved 42.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("largest cached block"), std::string::npos) << m;
    EXPECT_NE(m.find("activation 40.00 MiB"), std::string::npos) << m;
  }
  EXPECT_EQ(f.stat("num_ooms"), 1);
  EXPECT_EQ(f.stat("num_alloc_retries"), 1);
  EXPECT_EQ(f.alloc->memory_allocated(), 40 * kMiB + 1024);
  // Usable afterwards with a smaller request.
  void* b = f.alloc->allocate(20 * kMiB);
  EXPECT_NE(b, nullptr);
  for (void* p : {a, s, b}) f.alloc->deallocate(p);
  EXPECT_EQ(f.alloc->memory_allocated(), 0u);
}

// Requests near 2^64 are errors, never a wrap to a small block (issue 22): 2^64 - 2^20 bytes
// (ops::empty of 2^62 - 2^18 floats) used to round to a 0-byte segment. The fake device has
// room for anything, so only the arithmetic can refuse.
TEST(CachingAllocator, RequestsNearTwoToThe64AreErrorsNotWraps) {
  Fixture f(std::numeric_limits<size_t>::max());
  const size_t issue = std::numeric_limits<size_t>::max() - (size_t{1} << 20) + 1;
  for (size_t bytes : {issue, std::numeric_limits<size_t>::max(),
                       std::numeric_limits<size_t>::max() - kRoundLarge + 2}) {
    SCOPED_TRACE(bytes);
    tally::testing::expect_error<std::overflow_error>(
        [&] { (void)f.alloc->allocate(bytes); },
        {"CachingAllocator: rounding the", "overflows an unsigned 64-bit integer"});
  }
  EXPECT_THROW((void)f.alloc->round_size(std::numeric_limits<size_t>::max()), std::overflow_error);
  // Past 2^63 - 1 bytes (the int64 statistics' range) but not wrapping: refused by size.
  tally::testing::expect_error<std::length_error>(
      [&] { (void)f.alloc->allocate(std::numeric_limits<size_t>::max() >> 1); },
      {"a request of 9223372036854775807 bytes needs a segment of 9223372036854775808 bytes, "
       "more than 2^63 - 1"});
  EXPECT_EQ(f.fake->allocs, 0);  // nothing reached the device
  EXPECT_EQ(f.alloc->memory_reserved(), 0u);
  EXPECT_EQ(f.stat("allocation.all.current"), 0);
  EXPECT_EQ(f.stat("num_ooms"), 0);
  // Still usable, and a huge request that fits is served from a segment rounded exactly.
  void* p = f.alloc->allocate(1000);
  EXPECT_EQ(f.alloc->block_size(p), 1024u);
  void* big = f.alloc->allocate((size_t{1} << 62) + 1);
  EXPECT_EQ(f.alloc->block_size(big), (size_t{1} << 62) + 512);
  EXPECT_EQ(f.alloc->memory_reserved(), kSmallBuffer + (size_t{1} << 62) + kRoundLarge);
  EXPECT_EQ(f.stat("reserved_bytes.all.current"),
            static_cast<int64_t>(kSmallBuffer + (size_t{1} << 62) + kRoundLarge));
  for (void* q : {p, big}) f.alloc->deallocate(q);
  EXPECT_EQ(f.alloc->memory_allocated(), 0u);

  // The power-of-two divisions round within [2^63, 2^64) and refuse past it.
  Fixture g(std::numeric_limits<size_t>::max(), "roundup_power2_divisions:4");
  EXPECT_EQ(g.alloc->round_size((size_t{1} << 63) + 1), (size_t{1} << 63) + (size_t{1} << 61));
  EXPECT_THROW((void)g.alloc->round_size(std::numeric_limits<size_t>::max() - 5),
               std::overflow_error);
  // A division count that 512 * divisions would wrap is refused by the config (at most 2^30).
  try {
    Fixture h(size_t{1} << 34, "roundup_power2_divisions:36028797018963968");  // 2^55
    ADD_FAILURE() << "2^55 divisions accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("at most 2^30"), std::string::npos) << e.what();
  }
}

// max_non_split_rounding near 2^64 (the config allows it): "block >= size + rounding" used to
// wrap and refuse every cached oversize block.
TEST(CachingAllocator, HugeMaxNonSplitRoundingDoesNotWrap) {
  Fixture f(size_t{1} << 34, "max_split_size_mb:20,max_non_split_rounding_mb:17592186044415");
  void* a = f.alloc->allocate(100 * kMiB);
  f.alloc->deallocate(a);
  void* b = f.alloc->allocate(30 * kMiB);  // any cached oversize block is close enough
  EXPECT_EQ(b, a);
  EXPECT_EQ(f.stat("num_device_alloc"), 1);
  f.alloc->deallocate(b);
}

TEST(CachingAllocator, OomWritesSnapshotWhenHistoryIsOn) {
  const auto path = std::filesystem::temp_directory_path() / "tally_test_oom.pickle";
  std::filesystem::remove(path);
  Fixture f(16 * kMiB, "oom_snapshot:" + path.string());
  f.alloc->record_memory_history(true);
  void* a = f.alloc->allocate(10 * kMiB);
  try {
    f.alloc->allocate(10 * kMiB);
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("Snapshot written to"), std::string::npos);
  }
  EXPECT_TRUE(std::filesystem::exists(path));
  const auto h = f.alloc->history();
  EXPECT_EQ(h.back().action, TraceAction::oom);
  f.alloc->deallocate(a);
}

// The post-mortem needs no history: with recording off, oom_snapshot still writes the
// segments and blocks with their tags (the traces are empty), the message names the file,
// and the allocator goes on serving smaller requests.
TEST(CachingAllocator, OomWritesSnapshotWithHistoryOff) {
  namespace fs = std::filesystem;
  const fs::path path = fs::temp_directory_path() /
                        ("tally_test_oom_no_history_" + std::to_string(::getpid()) + ".pickle");
  fs::remove(path);
  Fixture f(24 * kMiB, "oom_snapshot:" + path.string());
  ASSERT_FALSE(f.alloc->history_enabled());
  void* w = nullptr;
  void* s = nullptr;
  {
    AllocContextScope ctx(Category::parameter, "model.fc", "empty", "init");
    w = f.alloc->allocate(6 * kMiB);
  }
  {
    AllocContextScope ctx(Category::optimizer_state, "model.fc", "zeros_like", "optimizer");
    s = f.alloc->allocate(1000);
  }
  std::string message;
  {
    AllocContextScope ctx(Category::activation, "model.fc", "linear", "forward");
    try {
      (void)f.alloc->allocate(20 * kMiB);
      FAIL() << "expected out of memory";
    } catch (const OutOfMemoryError& e) {
      message = e.what();
    }
  }
  EXPECT_NE(message.find("Snapshot written to " + path.string()), std::string::npos) << message;
  EXPECT_NE(message.find("no trace: history is off"), std::string::npos) << message;
  ASSERT_TRUE(fs::exists(path));
  EXPECT_TRUE(f.alloc->history().empty());

  // Python's pickle reads it back: both segments, the blocks with their categories, modules
  // and ops (frames, docs/memory-formats.md §1.6), no trace entries.
  const fs::path script =
      fs::temp_directory_path() / ("tally_test_oom_check_" + std::to_string(::getpid()) + ".py");
  std::ofstream(script)
      << "import pickle,sys\n"
         "d=pickle.load(open(sys.argv[1],'rb'))\n"
         "assert len(d['segments'])==2, d['segments']\n"
         "assert all(t==[] for t in d['device_traces']), d['device_traces']\n"
         "live=[b for s in d['segments'] for b in s['blocks'] if b['state']=='active_allocated']\n"
         "def tag(b):\n"
         "  names=[f['name'] for f in b['frames']]\n"
         "  files=[f['filename'] for f in b['frames']]\n"
         "  cat=[x for x in files if x.startswith('category=')]\n"
         "  mod=[f['name'] for f in b['frames'] if f['filename']=='module']\n"
         "  op=[x for x in ('empty','zeros_like') if x in names]\n"
         "  return (cat,mod,op)\n"
         "tags=sorted(tag(b) for b in live)\n"
         "assert tags==[(['category=optimizer_state'],['model.fc'],['zeros_like']),"
         "(['category=parameter'],['model.fc'],['empty'])], tags\n"
         "print('ok')\n";
  const std::string python = TALLY_PYTHON;
  const std::string out_file = path.string() + ".out";
  int status = std::system(
      (python + " " + script.string() + " " + path.string() + " > " + out_file + " 2>&1").c_str());
  EXPECT_EQ(status, 0) << std::ifstream(out_file).rdbuf();
  // ... and it is a snapshot the viewer opens (docs/memory-formats.md §1, §7).
  status = std::system((python + " " + TALLY_SOURCE_DIR + "/tests/memory/check_snapshot.py " +
                        path.string() + " --expect-live 2 > " + out_file + " 2>&1")
                           .c_str());
  EXPECT_EQ(status, 0) << std::ifstream(out_file).rdbuf();

  // Still usable and consistent: a smaller request succeeds, the diagnosis names the failure.
  void* smaller = f.alloc->allocate(10 * kMiB);
  EXPECT_NE(smaller, nullptr);
  EXPECT_EQ(f.alloc->fragmentation().last_oom.requested, 20 * kMiB);
  for (void* p : {w, s, smaller}) f.alloc->deallocate(p);
  EXPECT_EQ(f.alloc->memory_allocated(), 0u);
  for (const fs::path& p : {path, script, fs::path(out_file)}) fs::remove(p);
}

TEST(CachingAllocator, ReleaseOversizeCachedBlocksBeforeEverything) {
  Fixture f(60 * kMiB, "max_split_size_mb:20");
  void* keep = f.alloc->allocate(1000);      // 2 MiB small segment
  void* big = f.alloc->allocate(30 * kMiB);  // oversize, own segment
  void* mid = f.alloc->allocate(8 * kMiB);   // 20 MiB segment, split
  f.alloc->deallocate(big);
  // 15 MiB needs a 16 MiB segment: 52 + 16 > 60. The cached 30 MiB block is oversize (not
  // given to a request under max_split_size), so it alone is released and the retry works.
  void* other = f.alloc->allocate(15 * kMiB);
  EXPECT_EQ(f.stat("num_alloc_retries"), 0);  // no full flush was needed
  EXPECT_EQ(f.stat("num_device_free"), 1);
  for (void* p : {keep, mid, other}) f.alloc->deallocate(p);
}

TEST(CachingAllocator, EmptyCacheKeepsSegmentsWithLiveBlocks) {
  Fixture f;
  void* a = f.alloc->allocate(1000);
  void* b = f.alloc->allocate(30 * kMiB);
  void* c = f.alloc->allocate(4 * kMiB);
  f.alloc->deallocate(b);
  f.alloc->deallocate(c);
  f.alloc->empty_cache();
  EXPECT_EQ(f.alloc->memory_reserved(), 2 * kMiB);
  EXPECT_EQ(f.fake->live_segments(), 1u);
  f.alloc->deallocate(a);
  f.alloc->empty_cache();
  EXPECT_EQ(f.alloc->memory_reserved(), 0u);
  EXPECT_EQ(f.fake->used(), 0u);
}

TEST(CachingAllocator, CrossStreamFreeWaitsForEvents) {
  Fixture f;
  f.fake->events_complete = false;
  void* p = f.alloc->allocate(4 * kMiB, 1);
  f.alloc->record_stream(p, 2);
  f.alloc->deallocate(p);
  EXPECT_EQ(f.alloc->memory_allocated(), 0u);
  EXPECT_EQ(f.stat("active_bytes.all.current"), static_cast<int64_t>(4 * kMiB));
  SnapshotData s = f.alloc->snapshot();
  EXPECT_EQ(s.segments[0].blocks[0].state, BlockState::active_pending_free);
  void* q = f.alloc->allocate(4 * kMiB, 1);  // event not done: cannot reuse
  EXPECT_NE(p, q);
  f.fake->events_complete = true;
  f.alloc->deallocate(q);
  void* r = f.alloc->allocate(4 * kMiB, 1);  // events processed: p's block is free again
  EXPECT_EQ(f.stat("active_bytes.all.current"), static_cast<int64_t>(4 * kMiB));
  f.alloc->deallocate(r);
  EXPECT_EQ(f.stat("active.all.current"), 0);
}

TEST(CachingAllocator, MemoryFractionCapsReservedAndGcFreesOldBlocks) {
  Fixture f(200 * kMiB, "garbage_collection_threshold:0.5");
  f.alloc->set_memory_fraction(0.5);  // 100 MiB allowed, GC above 50 MiB
  EXPECT_THROW(f.alloc->allocate(101 * kMiB), OutOfMemoryError);
  const int64_t retries = f.stat("num_alloc_retries");
  void* a = f.alloc->allocate(30 * kMiB);
  void* b = f.alloc->allocate(30 * kMiB);
  f.alloc->deallocate(a);
  f.alloc->deallocate(b);
  EXPECT_EQ(f.alloc->memory_reserved(), 60 * kMiB);
  void* c = f.alloc->allocate(40 * kMiB);  // misses the cache; GC frees aged blocks first
  EXPECT_LE(f.alloc->memory_reserved(), 70 * kMiB);
  EXPECT_EQ(f.stat("num_alloc_retries"), retries);  // GC, not the flush-all retry
  f.alloc->deallocate(c);
  EXPECT_THROW(f.alloc->set_memory_fraction(1.5), std::invalid_argument);
}

TEST(CachingAllocator, BadPointersThrowAndChangeNothing) {
  Fixture f;
  void* p = f.alloc->allocate(100);
  int x = 0;
  EXPECT_THROW(f.alloc->deallocate(&x), std::invalid_argument);
  f.alloc->deallocate(p);
  EXPECT_THROW(f.alloc->deallocate(p), std::invalid_argument);  // double free
  EXPECT_THROW(f.alloc->retag(p, Category::activation), std::invalid_argument);
  EXPECT_EQ(f.alloc->memory_allocated(), 0u);
  EXPECT_EQ(f.stat("allocation.all.current"), 0);
  f.alloc->deallocate(nullptr);  // like free(nullptr)
  EXPECT_EQ(f.alloc->allocate(0), nullptr);
}

TEST(CachingAllocator, CategoriesAndRetag) {
  Fixture f;
  void* w;
  void* x;
  {
    AllocContextScope ctx(Category::parameter, "layer1.conv", "empty", "init");
    w = f.alloc->allocate(4096);
  }
  {
    CategoryScope c(Category::temporary);
    ModuleScope m("layer1");
    OpScope op("relu");
    x = f.alloc->allocate(10000);
    const AllocTag t = f.alloc->block_tag(x);
    EXPECT_EQ(interned(t.module), "layer1");
    EXPECT_EQ(interned(t.op), "relu");
  }
  auto s = f.alloc->stats();
  EXPECT_EQ(s.cat_bytes(Category::parameter).current, 4096);
  EXPECT_EQ(s.cat_bytes(Category::temporary).current, 10240);
  f.alloc->record_memory_history(true);
  f.alloc->retag(x, Category::activation);
  s = f.alloc->stats();
  EXPECT_EQ(s.cat_bytes(Category::temporary).current, 0);
  EXPECT_EQ(s.cat_bytes(Category::activation).current, 10240);
  EXPECT_EQ(s.cat_bytes(Category::temporary).peak, 10240);
  EXPECT_EQ(f.alloc->block_tag(x).category, Category::activation);
  const auto h = f.alloc->history();
  ASSERT_EQ(h.size(), 1u);
  EXPECT_EQ(h[0].action, TraceAction::retag);
  EXPECT_EQ(h[0].old_category, Category::temporary);
  EXPECT_EQ(h[0].tag.category, Category::activation);
  f.alloc->deallocate(w);
  f.alloc->deallocate(x);
  s = f.alloc->stats();
  for (Category c : kAllCategories) EXPECT_EQ(s.cat_bytes(c).current, 0);
}

// reassign hands a live block to the current context: its tag, category bytes and history
// change (the old owner's free, the new owner's alloc, same address), allocated bytes and
// allocation counts do not. Another stream, a block with pending stream uses or a freed
// pointer change nothing.
TEST(CachingAllocator, ReassignHandsALiveBlockToTheCurrentContext) {
  Fixture f;
  void* x;
  {
    AllocContextScope ctx(Category::temporary, "layer1.bn3", "batch_norm", "forward");
    x = f.alloc->allocate(3 * kMiB);
  }
  const auto allocs = f.stat("allocation.all.allocated");
  f.alloc->record_memory_history(true);
  {
    AllocContextScope ctx(Category::activation, "layer1.relu", "add_relu", "forward");
    EXPECT_FALSE(f.alloc->reassign(x, /*stream=*/1)) << "another stream";
    EXPECT_TRUE(f.alloc->reassign(x, 0));
  }
  const AllocTag t = f.alloc->block_tag(x);
  EXPECT_EQ(interned(t.module), "layer1.relu");
  EXPECT_EQ(interned(t.op), "add_relu");
  EXPECT_EQ(t.category, Category::activation);
  auto s = f.alloc->stats();
  EXPECT_EQ(s.cat_bytes(Category::temporary).current, 0);
  EXPECT_EQ(s.cat_bytes(Category::activation).current, static_cast<int64_t>(3 * kMiB));
  EXPECT_EQ(f.alloc->memory_allocated(), 3 * kMiB);
  EXPECT_EQ(f.stat("allocation.all.allocated"), allocs);
  const auto h = f.alloc->history();
  ASSERT_EQ(h.size(), 3u);
  EXPECT_EQ(h[0].action, TraceAction::free_requested);
  EXPECT_EQ(h[1].action, TraceAction::free_completed);
  EXPECT_EQ(interned(h[1].tag.op), "batch_norm");
  EXPECT_EQ(h[2].action, TraceAction::alloc);
  EXPECT_EQ(interned(h[2].tag.op), "add_relu");
  for (const auto& e : h) EXPECT_EQ(e.addr, reinterpret_cast<uint64_t>(x));
  f.alloc->record_stream(x, 1);
  EXPECT_FALSE(f.alloc->reassign(x, 0)) << "used on another stream";
  f.alloc->deallocate(x);
  EXPECT_FALSE(f.alloc->reassign(x, 0)) << "freed";
  f.fake->events_complete = true;
  f.alloc->empty_cache();
  s = f.alloc->stats();
  for (Category c : kAllCategories) EXPECT_EQ(s.cat_bytes(c).current, 0);
}

TEST(CachingAllocator, ResetPeakAndAccumulated) {
  Fixture f;
  void* a = f.alloc->allocate(8 * kMiB);
  f.alloc->deallocate(a);
  EXPECT_EQ(f.alloc->max_memory_allocated(), 8 * kMiB);
  f.alloc->reset_peak_memory_stats();
  EXPECT_EQ(f.alloc->max_memory_allocated(), 0u);
  EXPECT_EQ(f.alloc->max_memory_reserved(), 20 * kMiB);  // still reserved
  EXPECT_EQ(f.stat("allocated_bytes.all.allocated"), static_cast<int64_t>(8 * kMiB));
  f.alloc->reset_accumulated_memory_stats();
  EXPECT_EQ(f.stat("allocated_bytes.all.allocated"), 0);
  EXPECT_EQ(f.stat("num_device_alloc"), 0);
}

TEST(CachingAllocator, StatsHavePyTorchKeys) {
  Fixture f;
  const auto m = f.alloc->memory_stats();
  for (const char* k : {"allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
                        "inactive_split_bytes.small_pool.freed", "allocation.all.allocated",
                        "active_bytes.all.peak", "requested_bytes.all.current",
                        "segment.all.current", "num_alloc_retries", "num_ooms", "num_device_alloc",
                        "num_device_free", "num_sync_all_streams", "oversize_allocations.current",
                        "oversize_segments.peak", "max_split_size", "category.activation.peak"}) {
    EXPECT_TRUE(m.count(k)) << k;
  }
  // PyTorch's 122 keys, plus 3 per Tally category.
  EXPECT_EQ(m.size(), 122u + 3u * kNumCategories);
}

}  // namespace
}  // namespace tally::memory
