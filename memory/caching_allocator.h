// The caching allocator: PyTorch's CUDA caching policy (c10 CUDACachingAllocator) as
// plain C++ over a MemoryProvider, instrumented so that every block carries the
// allocation context (category, module, op, phase, C++ call site) it was made under.
// The policy with PyTorch's numbers, expandable segments, reclaim_on_growth, graph-private
// pools; stats, history and snapshot live in their own files: docs/notes.md §1.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <source_location>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "memory/alloc_config.h"
#include "memory/context.h"
#include "memory/history.h"
#include "memory/provider.h"
#include "memory/snapshot.h"
#include "memory/stats.h"
#include "memory/summary.h"

namespace tally::memory {

inline constexpr size_t kMinBlockSize = 512;
inline constexpr size_t kSmallSize = 1 * kMiB;
inline constexpr size_t kSmallBuffer = 2 * kMiB;
inline constexpr size_t kMinLargeAlloc = 10 * kMiB;
inline constexpr size_t kRoundLarge = 2 * kMiB;

// Raised when the device cannot satisfy a request even after freeing the cache. The
// allocator is consistent afterwards; the caller may retry with less.
class OutOfMemoryError : public std::runtime_error {
 public:
  OutOfMemoryError(const std::string& what, size_t requested)
      : std::runtime_error(what), requested_(requested) {}
  size_t requested() const { return requested_; }

 private:
  size_t requested_;
};

// One allocator event as the profiler sees it: a block handed out (bytes > 0), freed
// (bytes < 0) or re-tagged (`retag`, bytes = its size, `old_category` set), with the
// allocator's totals after the event.
struct AllocationEvent {
  uint64_t addr = 0;
  int64_t bytes = 0;           // rounded block size: + alloc, - free, + re-tag
  size_t total_allocated = 0;  // memory_allocated() after the event
  size_t total_reserved = 0;   // memory_reserved() after the event
  AllocTag tag;                // category (new one for a re-tag), module, op, phase, call site
  Category old_category = Category::unknown;  // re-tags only
  bool retag = false;
  DeviceType device_type = DeviceType::cpu;
  int device_index = 0;
};

// Observer of every allocator's alloc/free/re-tag (the profiler). Called with the
// allocator's lock held: it must not call back into the allocator. When none is installed
// an allocation pays one pointer check.
struct AllocationObserver {
  virtual ~AllocationObserver() = default;
  virtual void on_allocation_event(const AllocationEvent& e) = 0;
};
void set_allocation_observer(AllocationObserver* observer);
AllocationObserver* allocation_observer();

// A private memory pool's id (PyTorch's MempoolId_t, written in snapshots as
// segment_pool_id (0, id)); 0 is the default pool.
using MempoolId = uint64_t;
// A new private pool id, unique in the process (torch.cuda.graph_pool_handle()).
MempoolId graph_pool_handle();

// One private pool's account (memory_summary's "Graph pools" lines).
struct PoolInfo {
  MempoolId id = 0;
  int use_count = 0;     // captures that hold it (graphs not reset)
  size_t reserved = 0;   // bytes of its segments
  size_t allocated = 0;  // bytes of its live blocks
  size_t segments = 0;
};

namespace detail {
struct Block;
struct Segment;
struct BlockPool;
}  // namespace detail

class CachingAllocator {
 public:
  explicit CachingAllocator(std::unique_ptr<MemoryProvider> provider,
                            AllocatorConfig config = AllocatorConfig::from_env());
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Hand out at least `bytes` on `stream`, tagged with the current allocation context.
  // bytes == 0 returns nullptr. Throws OutOfMemoryError.
  void* allocate(size_t bytes, StreamId stream = 0,
                 std::source_location loc = std::source_location::current());
  // Return a block from allocate(). nullptr is ignored; an unknown pointer throws.
  void deallocate(void* ptr, std::source_location loc = std::source_location::current());
  // Change the category of a live block (e.g. autograd saving it -> activation).
  void retag(void* ptr, Category category,
             std::source_location loc = std::source_location::current());
  // Hand a live block to a new owner: an op writing its output over an input nobody else
  // holds (buffer donation, PyTorch's in-place `out += identity`). The block takes the current
  // allocation context's tag; the trace and the observers see the old owner's free and the new
  // owner's alloc at the same address, so every reader (memory_viz, timelines, the estimate)
  // names the new owner. Allocated and reserved bytes and the allocation counts do not change.
  // Returns false, changing nothing, when the block belongs to a stream other than `stream`
  // or was freed.
  bool reassign(void* ptr, StreamId stream,
                std::source_location loc = std::source_location::current());
  // The block will be used on `stream` too: its memory is reused only once the work
  // queued there before the free has completed.
  void record_stream(void* ptr, StreamId stream);

  // The rounded size and tag of a live block; throw for an unknown pointer.
  size_t block_size(const void* ptr) const;
  AllocTag block_tag(const void* ptr) const;

  // Release all unused cached segments to the device (a private pool's only once no graph
  // uses it).
  void empty_cache();

  // Graph-private pools (the file comment). begin: requests on `stream` come from `pool`
  // (made on first use; its use count goes up by one) until end_allocate_to_pool(pool).
  // Throws for pool 0 or a stream that already allocates to a pool.
  void begin_allocate_to_pool(MempoolId pool, StreamId stream);
  // Stops routing to `pool`; the frees held back during the capture are done now.
  void end_allocate_to_pool(MempoolId pool);
  // One user of `pool` (a graph) is gone: at zero its free segments go back to the device,
  // and the rest as their blocks are freed and the cache is emptied. Throws for an unknown
  // pool or one still capturing.
  void release_pool(MempoolId pool);
  // Whether any stream is allocating to a private pool (a capture is open).
  bool capturing() const;
  // The private pools in id order.
  std::vector<PoolInfo> graph_pools() const;
  // Cap reserved memory at fraction * device total (enables garbage_collection_threshold).
  void set_memory_fraction(double fraction);
  // The most memory this allocator may reserve: the set_memory_fraction cap, else the
  // device's total.
  size_t memory_cap() const;

  DeviceStats stats() const;
  std::map<std::string, int64_t> memory_stats() const { return stats().to_map(); }
  size_t memory_allocated() const {
    return all_pools(&DeviceStats::allocated_bytes, &Stat::current);
  }
  size_t max_memory_allocated() const {
    return all_pools(&DeviceStats::allocated_bytes, &Stat::peak);
  }
  size_t memory_reserved() const { return all_pools(&DeviceStats::reserved_bytes, &Stat::current); }
  size_t max_memory_reserved() const {
    return all_pools(&DeviceStats::reserved_bytes, &Stat::peak);
  }
  void reset_peak_memory_stats();
  void reset_accumulated_memory_stats();
  // PyTorch's table, Tally's categories and the fragmentation diagnosis (memory/summary.h).
  std::string memory_summary(bool abbreviated = false) const;
  // What the diagnosis is read from: free blocks by pool and segment, the categories between
  // them, the largest request and the last out-of-memory request.
  FragmentationInfo fragmentation() const;

  // Keep the last `max_entries` trace entries (enabled) or stop recording and drop them.
  void record_memory_history(bool enabled, size_t max_entries = 100000);
  bool history_enabled() const;
  // Tally's own history (includes re-tags), oldest first.
  std::vector<TraceEntry> history() const;

  // Segments, blocks and trace; records a `snapshot` trace entry after capturing.
  SnapshotData snapshot();
  void dump_snapshot(const std::string& path);
  // The blocks handed out and not yet returned (active_allocated), in no particular order:
  // a snapshot's allocated blocks without its segments and history, for a cheap look at
  // every step (inspect::LeakDetector). Records nothing.
  std::vector<BlockInfo> allocated_blocks() const;

  const AllocatorConfig& config() const { return config_; }
  // Replace the settings (e.g. in tests); cached blocks stay.
  void set_config(AllocatorConfig config);
  MemoryProvider& provider() { return *provider_; }
  const MemoryProvider& provider() const { return *provider_; }
  int device_index() const { return device_; }

  // Size policy, exposed for tests.
  size_t round_size(size_t bytes) const;

 private:
  struct AllocParams;

  bool get_free_block(AllocParams& p);
  bool alloc_segment(AllocParams& p, bool is_retry);
  // Expandable segments (the file comment).
  bool alloc_expandable(AllocParams& p);
  void reclaim_for(const AllocParams& p);
  detail::Block* find_expandable_block(const AllocParams& p);
  detail::Block* new_expandable_segment(const AllocParams& p);
  bool map_block(detail::Block* block, size_t size, const AllocTag& tag);
  void unmap_block(detail::Block* block);
  void forget_pages(detail::Block* block, uintptr_t start, size_t bytes);
  void release_expandable_segment(detail::Segment* seg);
  void release_if_unmapped(detail::Segment* seg);
  size_t try_merge(detail::Block* dst, detail::Block* src);
  void* alloc_found_block(AllocParams& p, const AllocTag& tag);
  void free_block(detail::Block* block);
  void insert_events(detail::Block* block);
  void process_events();
  void synchronize_and_free_events();
  bool release_available_cached_blocks(const AllocParams& p);
  bool release_cached_blocks();
  void release_pool(detail::BlockPool& pool);
  struct PrivatePool;
  void release_unused_private_pools();
  void release_block(detail::Block* block);
  void garbage_collect_cached_blocks();
  bool should_split(const detail::Block* block, size_t size) const;
  detail::Block* find_active(const void* ptr) const;
  [[noreturn]] void raise_oom(const AllocParams& p, std::unique_lock<std::mutex>& lock);
  void record(TraceAction action, uint64_t addr, size_t size, StreamId stream, const AllocTag& tag);
  void notify(AllocationObserver* o, uint64_t addr, int64_t bytes, const AllocTag& tag, bool retag,
              Category old_category) const;
  SnapshotData snapshot_locked() const;
  FragmentationInfo fragmentation_locked() const;
  // One all-pools figure of a byte counter (memory_allocated(), ...), read under the lock.
  size_t all_pools(StatArray DeviceStats::*counter, int64_t Stat::*figure) const;

  std::unique_ptr<MemoryProvider> provider_;
  AllocatorConfig config_;
  int device_;
  mutable std::mutex mu_;
  std::unique_ptr<detail::BlockPool> small_pool_;
  std::unique_ptr<detail::BlockPool> large_pool_;
  std::map<MempoolId, std::unique_ptr<PrivatePool>> private_pools_;
  std::vector<std::pair<MempoolId, StreamId>> capture_streams_;  // open begin_allocate_to_pool
  std::vector<detail::Block*> deferred_frees_;  // freed with stream uses in capture
  std::unordered_map<const void*, detail::Block*> active_;
  std::map<uintptr_t, detail::Segment*> segments_;
  std::vector<std::pair<EventId, detail::Block*>> outstanding_events_;
  DeviceStats stats_;
  size_t total_reserved_ = 0;
  double memory_fraction_ = 0.0;
  size_t allowed_maximum_ = 0;
  bool recording_ = false;
  TraceRing ring_;
  // For the diagnosis: the largest rounded request since the peaks were reset (and its
  // pool), and the last request that ran out of memory.
  size_t largest_request_ = 0;
  bool largest_request_small_ = false;
  OomRecord last_oom_;
};

}  // namespace tally::memory
