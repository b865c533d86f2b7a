// Cross-checks between the allocator's running statistics and its structure (snapshot):
// what the stats say must be what the segments and blocks show. With expandable segments a
// segment is a run of mapped pages: reserved is the mapped bytes, and the runs of one
// expandable segment neither overlap nor touch (they would be one run).
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>

#include "memory/caching_allocator.h"

namespace tally::memory::testing {

inline void expect_consistent(CachingAllocator& alloc) {
  const DeviceStats s = alloc.stats();
  const SnapshotData snap = alloc.snapshot();
  int64_t reserved = 0, allocated = 0, active = 0, requested = 0, segments = 0;
  int64_t split_blocks = 0, split_bytes = 0, allocations = 0;
  for (const SegmentInfo& seg : snap.segments) {
    ++segments;
    reserved += static_cast<int64_t>(seg.total_size);
    uint64_t next = seg.address;
    size_t sum = 0;
    for (const BlockInfo& b : seg.blocks) {
      EXPECT_EQ(b.address, next) << "blocks must tile the segment";
      EXPECT_EQ(b.size % 512, 0u);
      next += b.size;
      sum += b.size;
      if (b.state == BlockState::active_allocated) {
        allocated += static_cast<int64_t>(b.size);
        ++allocations;
      }
      if (b.state != BlockState::inactive) {
        active += static_cast<int64_t>(b.size);
        requested += static_cast<int64_t>(b.requested_size);
      }
      // Free blocks of expandable segments are not inactive_split (PyTorch's rule).
      if (b.state == BlockState::inactive && seg.blocks.size() > 1 && !seg.expandable) {
        ++split_blocks;
        split_bytes += static_cast<int64_t>(b.size);
      }
    }
    EXPECT_EQ(sum, seg.total_size);
  }
  for (size_t i = 1; i < snap.segments.size(); ++i) {
    const SegmentInfo& a = snap.segments[i - 1];
    const SegmentInfo& b = snap.segments[i];
    EXPECT_LT(a.address, b.address) << "segments in address order";
    EXPECT_LE(a.address + a.total_size, b.address) << "segments do not overlap";
    if (a.expandable && b.expandable && a.stream == b.stream && a.small == b.small) {
      EXPECT_NE(a.address + a.total_size, b.address) << "adjacent mapped runs are one segment";
    }
  }
  EXPECT_EQ(s.reserved_bytes[kAllPools].current, reserved);
  EXPECT_EQ(s.segment[kAllPools].current, segments);
  EXPECT_EQ(s.allocated_bytes[kAllPools].current, allocated);
  EXPECT_EQ(s.allocation[kAllPools].current, allocations);
  EXPECT_EQ(s.active_bytes[kAllPools].current, active);
  EXPECT_EQ(s.requested_bytes[kAllPools].current, requested);
  EXPECT_EQ(s.inactive_split[kAllPools].current, split_blocks);
  EXPECT_EQ(s.inactive_split_bytes[kAllPools].current, split_bytes);
  int64_t by_category = 0;
  for (Category c : kAllCategories) {
    by_category += s.cat_bytes(c).current;
    EXPECT_GE(s.cat_bytes(c).peak, s.cat_bytes(c).current);
    EXPECT_GE(s.cat_bytes(c).current, 0);
  }
  EXPECT_EQ(by_category, s.allocated_bytes[kAllPools].current) << "categories sum to allocated";
  int64_t at_peak = 0;
  for (int64_t b : s.category_at_peak) at_peak += b;
  EXPECT_EQ(at_peak, s.allocated_bytes[kAllPools].peak) << "the split at the peak sums to it";
  EXPECT_LE(s.allocated_bytes[kAllPools].current, s.reserved_bytes[kAllPools].current);
  for (const StatArray* a :
       {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
        &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
    for (const Stat& st : *a) {
      EXPECT_GE(st.peak, st.current);
      EXPECT_GE(st.current, 0);
    }
    EXPECT_EQ((*a)[kAllPools].current, (*a)[kSmallPool].current + (*a)[kLargePool].current);
  }
}

// A test's end: `alloc` is consistent; freeing `live` and emptying the cache leaves nothing
// reserved.
inline void expect_consistent_then_release(CachingAllocator& alloc,
                                           std::initializer_list<void*> live) {
  expect_consistent(alloc);
  for (void* p : live) alloc.deallocate(p);
  alloc.empty_cache();
  EXPECT_EQ(alloc.memory_reserved(), 0u);
}

}  // namespace tally::memory::testing
