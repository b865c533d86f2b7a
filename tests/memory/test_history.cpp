// The history ring buffer: order, dropping the oldest, actions and logical stacks.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/fake_provider.h"

namespace tally::memory {
namespace {

TEST(TraceRing, KeepsNewestOldestFirst) {
  TraceRing ring;
  ring.set_capacity(3);
  for (uint64_t i = 0; i < 5; ++i) {
    TraceEntry e;
    e.addr = i;
    ring.push(e);
  }
  const auto v = ring.entries();
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[0].addr, 2u);
  EXPECT_EQ(v[2].addr, 4u);
  EXPECT_EQ(ring.total_pushed(), 5u);
  ring.set_capacity(2);  // shrinking keeps the newest
  const auto w = ring.entries();
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].addr, 3u);
}

// A capacity is a bound, not memory set aside: PyTorch's default max_entries is sys.maxsize.
// The ring keeps order across wrapping, growing and shrinking.
TEST(TraceRing, CapacityIsABoundThatGrowsAndShrinksInOrder) {
  TraceRing ring;
  ring.set_capacity(std::numeric_limits<size_t>::max());
  auto push = [&](uint64_t from, uint64_t to) {
    for (uint64_t i = from; i < to; ++i) {
      TraceEntry e;
      e.addr = i;
      ring.push(e);
    }
  };
  auto addrs = [&] {
    std::vector<uint64_t> out;
    for (const TraceEntry& e : ring.entries()) out.push_back(e.addr);
    return out;
  };
  push(0, 1000);
  EXPECT_EQ(ring.size(), 1000u);
  EXPECT_EQ(addrs().front(), 0u);
  EXPECT_EQ(addrs().back(), 999u);
  ring.set_capacity(4);  // the newest 4
  EXPECT_EQ(addrs(), (std::vector<uint64_t>{996, 997, 998, 999}));
  push(1000, 1006);  // wraps
  EXPECT_EQ(addrs(), (std::vector<uint64_t>{1002, 1003, 1004, 1005}));
  ring.set_capacity(6);  // grows from a wrapped ring: order kept, room for 2 more
  push(1006, 1009);
  EXPECT_EQ(addrs(), (std::vector<uint64_t>{1003, 1004, 1005, 1006, 1007, 1008}));
  ring.set_capacity(0);
  push(0, 3);
  EXPECT_EQ(ring.size(), 0u);
  EXPECT_EQ(ring.total_pushed(), 1012u);
  ring.clear();
  EXPECT_EQ(ring.total_pushed(), 0u);
}

// record_memory_history(true, SIZE_MAX) used to reserve SIZE_MAX entries: the reservation
// threw after recording was switched on, and the next allocation wrote past the buffer.
TEST(History, HugeMaxEntriesRecordsWithoutReservingThem) {
  CachingAllocator alloc(std::make_unique<testing::FakeProvider>(size_t{1} << 32),
                         AllocatorConfig{});
  alloc.record_memory_history(true, std::numeric_limits<size_t>::max());
  EXPECT_TRUE(alloc.history_enabled());
  for (int i = 0; i < 100; ++i) alloc.deallocate(alloc.allocate(1000));
  EXPECT_EQ(alloc.history().size(), 1u + 100u * 3u);  // segment_alloc, then alloc + 2 frees each
  alloc.record_memory_history(true, size_t{1} << 62);
  EXPECT_EQ(alloc.history().size(), 301u);
  alloc.record_memory_history(false);
  EXPECT_TRUE(alloc.history().empty());
}

TEST(History, RecordsActionsWithContextAndDropsOldest) {
  CachingAllocator alloc(std::make_unique<testing::FakeProvider>(size_t{1} << 32),
                         AllocatorConfig{});
  void* before = alloc.allocate(100);  // not recorded: history off
  alloc.record_memory_history(true, 6);
  void* p;
  {
    AllocContextScope ctx(Category::activation, "encoder.block0", "matmul", "forward");
    p = alloc.allocate(3 * kMiB);  // segment_alloc + alloc
  }
  auto h = alloc.history();
  ASSERT_EQ(h.size(), 2u);
  EXPECT_EQ(h[0].action, TraceAction::segment_alloc);
  EXPECT_EQ(h[0].size, 20 * kMiB);
  EXPECT_EQ(h[0].tag.category, Category::unknown);
  EXPECT_EQ(h[1].action, TraceAction::alloc);
  EXPECT_EQ(h[1].size, 3 * kMiB);
  EXPECT_EQ(h[1].tag.category, Category::activation);
  EXPECT_EQ(interned(h[1].tag.module), "encoder.block0");
  EXPECT_EQ(interned(h[1].tag.op), "matmul");
  EXPECT_EQ(interned(h[1].tag.phase), "forward");
  EXPECT_NE(std::string(h[1].tag.loc.file).find("test_history.cpp"), std::string::npos);
  EXPECT_GT(h[1].tag.loc.line, 0u);
  EXPECT_GT(h[1].time_us, 1'700'000'000'000'000);  // µs since the epoch
  alloc.deallocate(p);                             // free_requested + free_completed
  h = alloc.history();
  ASSERT_EQ(h.size(), 4u);
  EXPECT_EQ(h[2].action, TraceAction::free_requested);
  EXPECT_EQ(h[3].action, TraceAction::free_completed);
  EXPECT_EQ(h[3].size, 3 * kMiB);
  for (int i = 0; i < 3; ++i) alloc.deallocate(alloc.allocate(1000));  // 6 more entries
  h = alloc.history();
  ASSERT_EQ(h.size(), 6u);  // the ring dropped the oldest
  EXPECT_EQ(h.front().action, TraceAction::alloc);
  EXPECT_EQ(h.front().size, 1000u);
  alloc.empty_cache();  // segment_free of the 20 MiB segment
  EXPECT_EQ(alloc.history().back().action, TraceAction::segment_free);
  alloc.record_memory_history(false);
  EXPECT_TRUE(alloc.history().empty());
  alloc.deallocate(before);
  EXPECT_TRUE(alloc.history().empty());
}

}  // namespace
}  // namespace tally::memory
