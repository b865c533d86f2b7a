// A deterministic device for allocator tests: addresses come from a bump pointer (never
// dereferenced), capacity is exact, and every call is counted.
#pragma once

#include <map>
#include <stdexcept>

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

  size_t used() const { return used_; }
  size_t live_segments() const { return live_.size(); }

  int allocs = 0, frees = 0, syncs = 0, events_recorded = 0;
  int fail_next = 0;
  bool events_complete = true;

 private:
  static constexpr uint64_t kGap = 1 << 20;
  size_t capacity_;
  int device_;
  size_t used_ = 0;
  uint64_t next_ = 0x7f0000000000ull;
  EventId next_event_ = 0;
  std::map<uint64_t, size_t> live_;
};

}  // namespace tally::memory::testing
