// Invariants after random alloc/free/retag sequences, and multi-threaded stress tests (also
// run under ThreadSanitizer by .ci/run): allocation from several threads, and the reports
// (snapshots, summaries, stats, history, empty_cache) taken while other threads allocate.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <thread>

#include "memory/caching_allocator.h"
#include "memory/cpu_provider.h"
#include "memory/fake_provider.h"
#include "memory/invariants.h"

namespace tally::memory {
namespace {

// A worker thread's live blocks, each marked at both ends with the thread's byte, so a block
// handed out twice (to two threads at once) shows as a clash when it is freed.
struct MarkedBlocks {
  CachingAllocator& alloc;
  unsigned char mark;
  std::vector<std::pair<unsigned char*, size_t>> live;

  void allocate(size_t n, StreamId stream) {
    auto* p = static_cast<unsigned char*>(alloc.allocate(n, stream));
    p[0] = p[n - 1] = mark;
    live.emplace_back(p, n);
  }
  // Frees a random live block; false when its marks were overwritten.
  bool free_random(std::mt19937_64& rng) {
    const size_t k = rng() % live.size();
    auto [p, n] = live[k];
    const bool intact = p[0] == mark && p[n - 1] == mark;
    alloc.deallocate(p);
    live[k] = live.back();
    live.pop_back();
    return intact;
  }
  ~MarkedBlocks() {
    for (auto [p, n] : live) alloc.deallocate(p);
  }
};

size_t random_size(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> kind(0, 9);
  const int k = kind(rng);
  if (k < 5) return std::uniform_int_distribution<size_t>(1, 64 * 1024)(rng);
  if (k < 8) return std::uniform_int_distribution<size_t>(64 * 1024, 4 * kMiB)(rng);
  return std::uniform_int_distribution<size_t>(4 * kMiB, 40 * kMiB)(rng);
}

void random_walk(const std::string& conf, uint64_t seed, size_t capacity) {
  auto fake = std::make_unique<testing::FakeProvider>(capacity);
  CachingAllocator alloc(std::move(fake), AllocatorConfig::parse(conf));
  alloc.record_memory_history(true, 1000);
  std::mt19937_64 rng(seed);
  std::vector<void*> live;
  int ooms = 0;
  for (int step = 0; step < 4000; ++step) {
    const int op = std::uniform_int_distribution<int>(0, 99)(rng);
    const auto cat = kAllCategories[std::uniform_int_distribution<size_t>(0, 9)(rng)];
    if (op < 55 || live.empty()) {
      CategoryScope scope(cat);
      try {
        live.push_back(alloc.allocate(random_size(rng), rng() % 2));
      } catch (const OutOfMemoryError&) {
        ++ooms;
      }
    } else if (op < 95) {
      const size_t i = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
      alloc.deallocate(live[i]);
      live[i] = live.back();
      live.pop_back();
    } else if (op < 98) {
      const size_t i = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
      alloc.retag(live[i], cat);
    } else {
      alloc.empty_cache();
    }
    if (step % 500 == 0) {
      testing::expect_consistent(alloc);
      if (::testing::Test::HasFailure()) return;
    }
  }
  testing::expect_consistent(alloc);
  for (void* p : live) alloc.deallocate(p);
  EXPECT_EQ(alloc.memory_allocated(), 0u);
  alloc.empty_cache();
  EXPECT_EQ(alloc.memory_reserved(), 0u);
  testing::expect_consistent(alloc);
  EXPECT_EQ(alloc.stats().num_ooms, ooms);
}

TEST(AllocatorInvariants, RandomDefault) {
  random_walk("", 1, size_t{8} << 30);
}
TEST(AllocatorInvariants, RandomTightMemoryWithOoms) {
  random_walk("", 2, 300 * kMiB);
}
TEST(AllocatorInvariants, RandomMaxSplit) {
  random_walk("max_split_size_mb:24,roundup_power2_divisions:[4:2,64:8,>:4]", 3, 400 * kMiB);
}
TEST(AllocatorInvariants, RandomLargeSegments) {
  random_walk("large_segment_size_mb:4,max_non_split_rounding_mb:4", 4, size_t{1} << 31);
}
TEST(AllocatorInvariants, RandomExpandable) {
  random_walk("expandable_segments:True", 5, size_t{8} << 30);
}
TEST(AllocatorInvariants, RandomExpandableTightMemoryWithOoms) {
  random_walk("expandable_segments:True,max_split_size_mb:24,large_segment_size_mb:4", 6,
              300 * kMiB);
}
TEST(AllocatorInvariants, RandomExpandableReclaim) {
  random_walk("expandable_segments:True,reclaim_on_growth:True", 7, size_t{8} << 30);
}
TEST(AllocatorInvariants, RandomExpandableReclaimTightMemoryWithOoms) {
  random_walk("expandable_segments:True,reclaim_on_growth:True,large_segment_size_mb:4", 8,
              300 * kMiB);
}

TEST(AllocatorInvariants, PeakIsAtLeastCurrentAndCountsTheHighWaterMark) {
  CachingAllocator alloc(std::make_unique<testing::FakeProvider>(size_t{1} << 32),
                         AllocatorConfig{});
  void* a = alloc.allocate(3 * kMiB);
  void* b = alloc.allocate(5 * kMiB);
  alloc.deallocate(a);
  void* c = alloc.allocate(kMiB);
  EXPECT_EQ(alloc.max_memory_allocated(), 8 * kMiB);
  EXPECT_EQ(alloc.memory_allocated(), 6 * kMiB);
  alloc.deallocate(b);
  alloc.deallocate(c);
}

void multi_threaded_stress(const std::string& conf) {
  CachingAllocator alloc(std::make_unique<CpuProvider>(size_t{4} << 30),
                         AllocatorConfig::parse(conf));
  alloc.record_memory_history(true, 5000);
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::atomic<int> corrupt{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      CategoryScope scope(kAllCategories[static_cast<size_t>(t)]);
      MarkedBlocks blocks{alloc, static_cast<unsigned char>(t + 1), {}};
      for (int i = 0; i < 20000; ++i) {
        if (blocks.live.size() < 64 && (rng() % 3 != 0 || blocks.live.empty())) {
          const size_t n = std::uniform_int_distribution<size_t>(1, 3 * kMiB / 2)(rng);
          blocks.allocate(n, static_cast<StreamId>(t % 2));
        } else if (!blocks.free_random(rng)) {
          ++corrupt;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_EQ(alloc.memory_allocated(), 0u);
  testing::expect_consistent(alloc);
  const DeviceStats s = alloc.stats();
  for (int t = 0; t < kThreads; ++t) EXPECT_GT(s.category_bytes[static_cast<size_t>(t)].peak, 0);
  alloc.empty_cache();
  EXPECT_EQ(alloc.memory_reserved(), 0u);
}

TEST(AllocatorInvariants, MultiThreadedStress) {
  multi_threaded_stress("");
}
// Blocks of mprotect'ed pages: one handed out unmapped faults, one handed out twice clashes.
TEST(AllocatorInvariants, MultiThreadedStressExpandable) {
  multi_threaded_stress("expandable_segments:True");
}
// reclaim_on_growth unmaps free pages while the other threads write into their blocks.
TEST(AllocatorInvariants, MultiThreadedStressExpandableReclaim) {
  multi_threaded_stress("expandable_segments:True,reclaim_on_growth:True");
}

// What one snapshot shows must hold on its own, whatever other threads do meanwhile: blocks
// tile their segments in 512-byte multiples, and each block's request fits in it.
void expect_snapshot_tiles(const SnapshotData& snap) {
  for (const SegmentInfo& seg : snap.segments) {
    uint64_t next = seg.address;
    size_t sum = 0;
    for (const BlockInfo& b : seg.blocks) {
      EXPECT_EQ(b.address, next) << "blocks must tile the segment";
      EXPECT_EQ(b.size % 512, 0u);
      if (b.state != BlockState::inactive) {
        EXPECT_LE(b.requested_size, b.size);
      }
      next += b.size;
      sum += b.size;
    }
    EXPECT_EQ(sum, seg.total_size);
  }
}

// Reports while 3 threads allocate, free and re-tag: a reporter thread takes snapshots (and
// encodes them as pickles, and writes one to a file), summaries, stats and the history,
// empties the cache, resets the peaks and switches the history off and on; the workers go on
// until it has done 8 rounds. Every report is
// consistent on its own, the workers' blocks are never handed out twice, and at the end the
// allocator is consistent and empty.
void reports_while_threads_allocate(const std::string& conf) {
  CachingAllocator alloc(std::make_unique<CpuProvider>(size_t{4} << 30),
                         AllocatorConfig::parse(conf));
  alloc.record_memory_history(true, 2000);
  constexpr int kWorkers = 3;
  constexpr int kRounds = 8;  // the workers allocate until the reporter has done these
  std::atomic<int> running{kWorkers};
  std::atomic<int> reports{0};
  std::atomic<int> corrupt{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kWorkers; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(200 + t);
      CategoryScope scope(kAllCategories[static_cast<size_t>(t)]);
      {
        MarkedBlocks blocks{alloc, static_cast<unsigned char>(t + 1), {}};
        for (int i = 0; i < 2000 || reports.load() < kRounds; ++i) {
          const unsigned op = rng() % 8;
          if (blocks.live.size() < 32 && (op < 5 || blocks.live.empty())) {
            const size_t n = std::uniform_int_distribution<size_t>(1, 3 * kMiB)(rng);
            blocks.allocate(n, static_cast<StreamId>(t % 2));
          } else if (op == 5) {
            alloc.retag(blocks.live[rng() % blocks.live.size()].first, Category::activation);
          } else if (!blocks.free_random(rng)) {
            ++corrupt;
          }
        }
      }  // the rest of the blocks freed
      --running;
    });
  }
  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / ("tally_reports_" + std::to_string(::getpid()) +
                                                (conf.empty() ? "" : "_expandable") + ".pickle");
  threads.emplace_back([&] {
    for (int round = 0; running.load() > 0; ++round) {
      const SnapshotData snap = alloc.snapshot();
      expect_snapshot_tiles(snap);
      std::ostringstream pickle;
      write_snapshot_pickle(snap, pickle);
      EXPECT_GT(pickle.str().size(), 2u);
      const std::string summary = alloc.memory_summary(round % 2 == 0);
      EXPECT_NE(summary.find("Allocated memory"), std::string::npos) << summary;
      const DeviceStats s = alloc.stats();
      EXPECT_LE(s.allocated_bytes[kAllPools].current, s.reserved_bytes[kAllPools].current);
      int64_t by_category = 0;
      for (Category c : kAllCategories) by_category += s.cat_bytes(c).current;
      EXPECT_EQ(by_category, s.allocated_bytes[kAllPools].current);
      EXPECT_LE(s.allocated_bytes[kAllPools].current, s.allocated_bytes[kAllPools].peak);
      // Current first, the peak after (the arguments of one EXPECT_LE are evaluated in an
      // unspecified order, and while threads allocate a peak read first can trail the current).
      const size_t current = alloc.memory_allocated();
      const size_t peak = alloc.max_memory_allocated();
      EXPECT_LE(current, peak);
      EXPECT_FALSE(alloc.memory_stats().empty());
      EXPECT_LE(alloc.history().size(), 2000u);
      switch (round % 4) {
        case 0:
          alloc.empty_cache();
          break;
        case 1:
          alloc.reset_peak_memory_stats();
          break;
        case 2:
          alloc.dump_snapshot(file.string());
          break;
        case 3:
          alloc.record_memory_history(false);
          alloc.record_memory_history(true, 2000);
          break;
      }
      ++reports;
    }
  });
  for (auto& th : threads) th.join();
  std::filesystem::remove(file);
  EXPECT_GE(reports.load(), kRounds);
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_EQ(alloc.memory_allocated(), 0u);
  testing::expect_consistent(alloc);
  alloc.empty_cache();
  EXPECT_EQ(alloc.memory_reserved(), 0u);
}

TEST(AllocatorInvariants, ReportsWhileThreadsAllocate) {
  reports_while_threads_allocate("");
}
// empty_cache unmaps pages while the workers write into their blocks.
TEST(AllocatorInvariants, ReportsWhileThreadsAllocateExpandable) {
  reports_while_threads_allocate("expandable_segments:True");
}

}  // namespace
}  // namespace tally::memory
