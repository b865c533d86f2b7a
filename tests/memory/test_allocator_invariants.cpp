// Invariants after random alloc/free/retag sequences, and a multi-threaded stress test.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "memory/caching_allocator.h"
#include "memory/cpu_provider.h"
#include "memory/fake_provider.h"
#include "memory/invariants.h"

namespace tally::memory {
namespace {

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

TEST(AllocatorInvariants, MultiThreadedStress) {
  CachingAllocator alloc(std::make_unique<CpuProvider>(size_t{4} << 30), AllocatorConfig{});
  alloc.record_memory_history(true, 5000);
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::atomic<int> corrupt{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      CategoryScope scope(kAllCategories[static_cast<size_t>(t)]);
      std::vector<std::pair<unsigned char*, size_t>> live;
      for (int i = 0; i < 20000; ++i) {
        if (live.size() < 64 && (rng() % 3 != 0 || live.empty())) {
          const size_t n = std::uniform_int_distribution<size_t>(1, 3 * kMiB / 2)(rng);
          auto* p = static_cast<unsigned char*>(alloc.allocate(n, static_cast<StreamId>(t % 2)));
          p[0] = static_cast<unsigned char>(t + 1);  // a block handed out twice would clash
          p[n - 1] = static_cast<unsigned char>(t + 1);
          live.emplace_back(p, n);
        } else {
          const size_t k = rng() % live.size();
          auto [p, n] = live[k];
          if (p[0] != t + 1 || p[n - 1] != t + 1) ++corrupt;
          alloc.deallocate(p);
          live[k] = live.back();
          live.pop_back();
        }
      }
      for (auto [p, n] : live) alloc.deallocate(p);
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

}  // namespace
}  // namespace tally::memory
