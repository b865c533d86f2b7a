// A deterministic device for allocator tests: addresses come from a bump pointer (never
// dereferenced), capacity is exact, and every call is counted. Its expandable segments count
// mapped pages against the capacity, check that the allocator never maps a mapped page nor
// unmaps an unmapped one, and can be told to fail.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>

#include "memory/provider.h"

namespace tally::memory::testing {

class FakeProvider final : public MemoryProvider {
 public:
  explicit FakeProvider(size_t capacity, int device = 0) : capacity_(capacity), device_(device) {}

  void* allocate(size_t bytes) override {
    ++allocs;
    if (fail_next > 0) {
      --fail_next;
      return nullptr;
    }
    if (bytes > capacity_ - used_) return nullptr;
    used_ += bytes;
    const uint64_t addr = next_;
    next_ += bytes + kGap;  // gaps so that distinct segments never look adjacent
    live_[addr] = bytes;
    return reinterpret_cast<void*>(addr);
  }
  void deallocate(void* ptr, size_t bytes) override {
    ++frees;
    auto it = live_.find(reinterpret_cast<uint64_t>(ptr));
    if (it == live_.end() || it->second != bytes)
      throw std::logic_error("FakeProvider: bad deallocate");
    used_ -= bytes;
    live_.erase(it);
  }
  size_t total_memory() const override { return capacity_; }
  size_t free_memory() const override { return capacity_ - used_; }
  DeviceType device_type() const override { return DeviceType::cuda; }
  int device_index() const override { return device_; }
  std::string device_name() const override { return "fake:" + std::to_string(device_); }
  void synchronize() override { ++syncs; }

  // Events complete only when `events_complete` is true (to test pending frees).
  EventId record_event(StreamId) override {
    ++events_recorded;
    return ++next_event_;
  }
  bool query_event(EventId) override { return events_complete; }

  std::unique_ptr<ExpandableSegment> create_expandable_segment(StreamId, size_t page_size,
                                                               size_t pages) override {
    if (fail_next_reserve > 0) {
      --fail_next_reserve;
      throw std::runtime_error("FakeProvider: reserve failed (as told)");
    }
    ++reserves;
    const uint64_t base = next_;
    next_ += page_size * pages + kGap;
    return std::make_unique<Segment>(*this, base, page_size, pages);
  }

  size_t used() const { return used_; }
  size_t live_segments() const { return live_.size(); }

  int allocs = 0, frees = 0, syncs = 0, events_recorded = 0;
  int fail_next = 0;
  bool events_complete = true;
  // Expandable segments: segments reserved and alive, map / unmap calls.
  int reserves = 0, live_expandable = 0, maps = 0, unmaps = 0;
  int fail_next_reserve = 0;  // create_expandable_segment throws
  int fail_next_map = 0;      // map returns false (out of memory)
  int throw_next_map = 0;     // map throws (a driver error), nothing mapped
  // unmap throws after unmapping this many pages (-1: never).
  int unmap_throws_after_pages = -1;

 private:
  class Segment final : public ExpandableSegment {
   public:
    Segment(FakeProvider& owner, uint64_t base, size_t page_size, size_t pages)
        : ExpandableSegment(base, page_size, pages), owner_(owner) {
      ++owner_.live_expandable;
    }
    ~Segment() override {
      owner_.used_ -= mapped_.size() * page_size_;
      --owner_.live_expandable;
    }
    bool map(size_t offset, size_t bytes) override {
      ++owner_.maps;
      check_range(offset, bytes, false, "map");
      if (owner_.throw_next_map > 0) {
        --owner_.throw_next_map;
        throw std::runtime_error("FakeProvider: map failed (as told)");
      }
      if (owner_.fail_next_map > 0) {
        --owner_.fail_next_map;
        return false;
      }
      if (bytes > owner_.capacity_ - owner_.used_) return false;
      owner_.used_ += bytes;
      for (size_t i = offset / page_size_; i < (offset + bytes) / page_size_; ++i)
        mapped_.insert(i);
      return true;
    }
    void unmap(size_t offset, size_t bytes, size_t& done) override {
      ++owner_.unmaps;
      check_range(offset, bytes, true, "unmap");
      done = 0;
      for (size_t i = offset / page_size_; i < (offset + bytes) / page_size_; ++i) {
        if (owner_.unmap_throws_after_pages == 0) {
          owner_.unmap_throws_after_pages = -1;
          throw std::runtime_error("FakeProvider: unmap failed (as told)");
        }
        if (owner_.unmap_throws_after_pages > 0) --owner_.unmap_throws_after_pages;
        mapped_.erase(i);
        owner_.used_ -= page_size_;
        done += page_size_;
      }
    }

   private:
    void check_range(size_t offset, size_t bytes, bool want_mapped, const char* what) const {
      if (bytes == 0 || offset % page_size_ != 0 || bytes % page_size_ != 0 ||
          offset + bytes > size())
        throw std::logic_error(std::string("FakeProvider: bad ") + what + " range");
      for (size_t i = offset / page_size_; i < (offset + bytes) / page_size_; ++i)
        if (mapped_.count(i) != (want_mapped ? 1u : 0u))
          throw std::logic_error(std::string("FakeProvider: ") + what + " of a page " +
                                 (want_mapped ? "not mapped" : "already mapped"));
    }

    FakeProvider& owner_;
    std::set<size_t> mapped_;  // page indices
  };

  static constexpr uint64_t kGap = 1 << 20;
  size_t capacity_;
  int device_;
  size_t used_ = 0;
  uint64_t next_ = 0x7f0000000000ull;
  EventId next_event_ = 0;
  std::map<uint64_t, size_t> live_;
};

}  // namespace tally::memory::testing
