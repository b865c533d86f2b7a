#include "memory/caching_allocator.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>

#include "base/bytes.h"
#include "base/checked.h"
#include "base/rank_path.h"
#include "memory/summary.h"
#include "memory/user_site.h"

namespace tally::memory {
namespace detail {

struct Segment {
  // When it was made (a count over every allocator of the process): best fit breaks ties
  // between free blocks of one size by it, then by address within the segment. Not by address
  // across segments, which is the provider's business: the host's heap hands them out in an
  // order of its own, and a dry run's device in another, and the two runs of one program would
  // then split different blocks and reserve different amounts.
  uint64_t order = 0;
  uintptr_t base = 0;
  size_t size = 0;  // an expandable segment: its reserved addresses
  StreamId stream = 0;
  bool small = false;
  MempoolId pool_id = 0;  // a graph-private pool's segment, or 0
  AllocTag tag;
  Block* head = nullptr;
  // Set for an expandable segment: the provider's pages (blocks then may be unmapped).
  std::unique_ptr<ExpandableSegment> expandable;
};

struct Block;

// Ordered by (stream, size, segment order, address): lower_bound gives the best fit on a
// stream (a search key has no segment, order 0).
struct BlockLess {
  bool operator()(const Block* a, const Block* b) const;
};
// Ordered by (stream, address): the unmapped ranges of expandable segments, lowest first.
struct AddressLess {
  bool operator()(const Block* a, const Block* b) const;
};
using PoolSet = std::set<Block*, BlockLess>;
using ActiveMap = std::unordered_map<const void*, Block*>;

struct Block {
  void* ptr = nullptr;
  size_t size = 0;
  size_t requested = 0;
  StreamId stream = 0;
  BlockPool* pool = nullptr;
  Segment* segment = nullptr;
  Block* prev = nullptr;
  Block* next = nullptr;
  bool allocated = false;
  // Backed by memory. Always true outside expandable segments; an unmapped block is free,
  // starts on a page boundary and is a whole number of pages.
  bool mapped = true;
  int event_count = 0;
  int gc_count = 0;
  AllocTag tag;
  std::vector<StreamId> stream_uses;
  // Container nodes kept while the block is out of the pool / active map, so that a
  // cache hit moves nodes instead of allocating them.
  PoolSet::node_type pool_node;
  ActiveMap::node_type active_node;

  bool is_split() const { return prev != nullptr || next != nullptr; }
  bool expandable() const { return segment->expandable != nullptr; }
  // A block that is a whole (ordinary) segment: what release_block gives back.
  bool whole_segment() const { return !is_split() && !expandable(); }
  uintptr_t addr() const { return reinterpret_cast<uintptr_t>(ptr); }
  // After `prev` changed: the new predecessor (or, first in its segment, the segment) points
  // here.
  void link_from_prev() {
    if (prev)
      prev->next = this;
    else
      segment->head = this;
  }
};

inline bool BlockLess::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  const uint64_t oa = a->segment ? a->segment->order : 0, ob = b->segment ? b->segment->order : 0;
  if (oa != ob) return oa < ob;
  return a->addr() < b->addr();
}

static std::atomic<uint64_t> next_segment_order{1};

inline bool AddressLess::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  return a->addr() < b->addr();
}

struct BlockPool {
  explicit BlockPool(bool small, MempoolId owner = 0) : small(small), owner(owner) {}
  PoolSet blocks;  // free mapped blocks
  std::set<Block*, AddressLess> unmapped;
  const bool small;
  const MempoolId owner;  // the private pool this belongs to, or 0

  void insert(Block* b) {
    if (b->pool_node) {
      b->pool_node.value() = b;
      blocks.insert(std::move(b->pool_node));
    } else {
      blocks.insert(b);
    }
  }
};

}  // namespace detail

namespace {
std::atomic<AllocationObserver*> g_allocation_observer{nullptr};
std::atomic<MempoolId> g_next_pool_id{1};
std::atomic<int> g_recording_allocators{0};  // allocators recording history now

// The user's line (the innermost CallSiteScope) or, with none open, the API's call site.
SourceLoc user_site_or(const std::source_location& api_call) {
  SourceLoc site = current_tag().loc;
  if (site.line == 0 && !hooked_user_site(site)) site = SourceLoc::from(api_call);
  return site;
}
}  // namespace

MempoolId graph_pool_handle() {
  return g_next_pool_id.fetch_add(1, std::memory_order_relaxed);
}

void set_allocation_observer(AllocationObserver* observer) {
  g_allocation_observer.store(observer);
}
AllocationObserver* allocation_observer() {
  return g_allocation_observer.load(std::memory_order_acquire);
}

void CachingAllocator::notify(AllocationObserver* o, uint64_t addr, int64_t bytes,
                              const AllocTag& tag, bool retag, Category old_category) const {
  AllocationEvent e;
  e.addr = addr;
  e.bytes = bytes;
  e.total_allocated = static_cast<size_t>(stats_.allocated_bytes[kAllPools].current);
  e.total_reserved = total_reserved_;
  e.tag = tag;
  e.retag = retag;
  e.old_category = old_category;
  e.device_type = provider_->device_type();
  e.device_index = device_;
  o->on_allocation_event(e);
}

using detail::Block;
using detail::BlockPool;
using detail::Segment;

// A graph-private pool: its own free lists, small and large, and the captures that use it.
struct CachingAllocator::PrivatePool {
  explicit PrivatePool(MempoolId id) : small(true, id), large(false, id) {}
  int use_count = 0;
  BlockPool small, large;
};

struct CachingAllocator::AllocParams {
  size_t requested = 0;   // what the caller asked for
  size_t size = 0;        // rounded block size
  size_t alloc_size = 0;  // segment size if a new segment is needed
  StreamId stream = 0;
  BlockPool* pool = nullptr;
  Block* block = nullptr;
  AllocTag tag;  // the request's context and call site
};

CachingAllocator::CachingAllocator(std::unique_ptr<MemoryProvider> provider, AllocatorConfig config)
    : provider_(std::move(provider)),
      config_(std::move(config)),
      device_(provider_->device_index()),
      small_pool_(std::make_unique<BlockPool>(true)),
      large_pool_(std::make_unique<BlockPool>(false)) {
  stats_.max_split_size =
      config_.max_split_size_set() ? static_cast<int64_t>(config_.max_split_size) : -1;
}

CachingAllocator::~CachingAllocator() {
  // Give every segment back, live blocks included: the process is done with this device.
  std::lock_guard lock(mu_);
  if (recording_) g_recording_allocators.fetch_sub(1);
  for (auto& [base, seg] : segments_) {
    Block* b = seg->head;
    while (b) {
      Block* next = b->next;
      delete b;
      b = next;
    }
    // An expandable segment's destructor unmaps its pages and frees its addresses.
    if (!seg->expandable) provider_->deallocate(reinterpret_cast<void*>(seg->base), seg->size);
    delete seg;
  }
  for (auto& [ev, block] : outstanding_events_) provider_->destroy_event(ev);
}

void CachingAllocator::set_config(AllocatorConfig config) {
  std::lock_guard lock(mu_);
  config_ = std::move(config);
  stats_.max_split_size =
      config_.max_split_size_set() ? static_cast<int64_t>(config_.max_split_size) : -1;
}

size_t CachingAllocator::round_size(size_t bytes) const {
  static constexpr const char* what = "CachingAllocator: rounding the request size";
  if (bytes < kMinBlockSize) return kMinBlockSize;
  const size_t divisions = config_.divisions_for(bytes);
  // bytes > kMinBlockSize * divisions, without the product (divisions comes from the config).
  if (divisions > 1 && bytes / kMinBlockSize >= divisions && bytes != kMinBlockSize * divisions &&
      !std::has_single_bit(bytes)) {
    const size_t floor2 = std::bit_floor(bytes);
    const size_t step = floor2 / divisions;
    if (step == 0) return base::checked_mul(floor2, size_t{2}, what);
    return base::checked_round_up(bytes, step, what);
  }
  return base::checked_round_up(bytes, kMinBlockSize, what);
}

void CachingAllocator::record(TraceAction action, uint64_t addr, size_t size, StreamId stream,
                              const AllocTag& tag) {
  if (!recording_) return;
  TraceEntry e;
  e.action = action;
  e.addr = addr;
  e.size = size;
  e.stream = stream;
  e.time_us = now_us();
  e.tag = tag;
  ring_.push(e);
}

void* CachingAllocator::allocate(size_t bytes, StreamId stream, std::source_location loc) {
  if (bytes == 0) return nullptr;
  AllocTag tag = current_tag();
  // No CallSiteScope open: the interpreter's line, else the allocator API's caller.
  if (tag.loc.line == 0 && !hooked_user_site(tag.loc)) tag.loc = SourceLoc::from(loc);

  std::unique_lock lock(mu_);
  const bool capturing = !capture_streams_.empty();
  if (!capturing) process_events();  // an event query is not allowed while capturing

  AllocParams p;
  p.requested = bytes;
  p.tag = tag;
  p.size = round_size(bytes);
  p.stream = stream;
  p.pool = p.size <= kSmallSize ? small_pool_.get() : large_pool_.get();
  for (const auto& [id, s] : capture_streams_) {
    if (s != stream) continue;
    PrivatePool& pp = *private_pools_.at(id);
    p.pool = p.size <= kSmallSize ? &pp.small : &pp.large;
  }
  if (p.size > largest_request_) {
    largest_request_ = p.size;
    largest_request_small_ = p.pool->small;
  }
  if (p.pool->small) {
    p.alloc_size = kSmallBuffer;
  } else {
    p.alloc_size =
        base::checked_round_up(p.size, kRoundLarge, "CachingAllocator: rounding the segment size");
    // Mid-size requests share a large segment (20 MiB unless large_segment_size_mb says).
    if (p.size < kMinLargeAlloc) p.alloc_size = std::max(p.alloc_size, config_.large_segment_size);
  }
  // Sizes are counted in int64 statistics (as in PyTorch): a segment must fit in 63 bits.
  if (p.alloc_size > base::kMaxBytes)
    throw std::length_error(fmt::format(
        "CachingAllocator: a request of {} bytes needs a segment of {} bytes, more than 2^63 - 1",
        bytes, p.alloc_size));

  bool found = get_free_block(p);
  if (!found && capturing) {
    // Freeing segments synchronises: not while a capture is open.
    found = alloc_segment(p, false);
  } else if (!found) {
    if (memory_fraction_ > 0 && config_.garbage_collection_threshold > 0)
      garbage_collect_cached_blocks();
    found = alloc_segment(p, false) ||
            (release_available_cached_blocks(p) && alloc_segment(p, false)) ||
            (release_cached_blocks() && alloc_segment(p, true));
  }
  if (!found) raise_oom(p, lock);
  return alloc_found_block(p, tag);
}

bool CachingAllocator::get_free_block(AllocParams& p) {
  BlockPool& pool = *p.pool;
  if (memory_fraction_ > 0 && config_.garbage_collection_threshold > 0) {
    for (Block* b : pool.blocks) ++b->gc_count;
  }
  Block key;
  key.stream = p.stream;
  key.size = p.size;
  key.ptr = nullptr;
  auto it = pool.blocks.lower_bound(&key);
  if (it == pool.blocks.end() || (*it)->stream != p.stream) return false;
  if ((*it)->expandable()) {
    if (config_.expandable_segments) {
      // PyTorch: a free block followed by unmapped pages counts for best fit as large as it
      // could grow, so that a hole elsewhere that fits is taken before the growing end.
      auto growable = [](const Block* b) {
        return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
      };
      for (auto next = std::next(it);
           (*it)->expandable() && next != pool.blocks.end() && (*next)->stream == p.stream &&
           growable(*next) < growable(*it);
           ++next)
        it = next;
    } else {
      // Turned off (set_config) after expandable segments were made: only ordinary ones.
      do {
        ++it;
      } while (it != pool.blocks.end() && (*it)->stream == p.stream && (*it)->expandable());
      if (it == pool.blocks.end() || (*it)->stream != p.stream) return false;
    }
  }
  const size_t max_split = config_.max_split_size;
  // Never hand an oversize block to a small request, nor a far larger one to a large one.
  if (p.size < max_split && (*it)->size >= max_split) return false;
  // (*it)->size >= p.size: the difference cannot wrap, unlike p.size + max_non_split_rounding.
  if (p.size >= max_split && (*it)->size - p.size >= config_.max_non_split_rounding) return false;
  p.block = *it;
  p.block->gc_count = 0;
  p.block->pool_node = pool.blocks.extract(it);
  return true;
}

bool CachingAllocator::alloc_segment(AllocParams& p, bool is_retry) {
  if (is_retry) ++stats_.num_alloc_retries;
  // A private pool's memory stays mapped until its graph is gone: ordinary segments.
  if (config_.expandable_segments && p.pool->owner == 0) return alloc_expandable(p);
  const size_t size = p.alloc_size;
  if (memory_fraction_ > 0 &&
      (total_reserved_ > allowed_maximum_ || size > allowed_maximum_ - total_reserved_))
    return false;
  void* ptr = provider_->allocate(size);
  if (!ptr) return false;
  ++stats_.num_device_alloc;
  total_reserved_ += size;

  auto* seg = new Segment();
  seg->order = detail::next_segment_order.fetch_add(1, std::memory_order_relaxed);
  seg->base = reinterpret_cast<uintptr_t>(ptr);
  seg->size = size;
  seg->stream = p.stream;
  seg->small = p.pool->small;
  seg->pool_id = p.pool->owner;
  seg->tag = p.tag;
  auto* block = new Block();
  block->ptr = ptr;
  block->size = size;
  block->stream = p.stream;
  block->pool = p.pool;
  block->segment = seg;
  seg->head = block;
  segments_.emplace(seg->base, seg);
  p.block = block;

  stat_increase(stats_.segment, seg->small, 1);
  stat_increase(stats_.reserved_bytes, seg->small, static_cast<int64_t>(size));
  if (size >= config_.max_split_size) stats_.oversize_segments.increase(1);
  AllocTag seg_tag;  // a segment belongs to no category
  seg_tag.loc = seg->tag.loc;
  record(TraceAction::segment_alloc, seg->base, size, p.stream, seg_tag);
  return true;
}

// Expandable segments (PyTorch's try_allocate_expandable_block): map the pages the request
// needs at the lowest address where free and unmapped space together fit it, merging them
// into one free block, and hand that block on to alloc_found_block.
bool CachingAllocator::alloc_expandable(AllocParams& p) {
  if (config_.reclaim_on_growth) reclaim_for(p);
  Block* candidate = find_expandable_block(p);
  if (!candidate) candidate = new_expandable_segment(p);
  if (!candidate) return false;  // larger than a whole segment: the device cannot hold it
  Segment* seg = candidate->segment;
  try {
    // The candidate is unmapped, or free and followed by unmapped pages (and maybe more free
    // and unmapped blocks): each map merges the new pages with the free block before them.
    if (!candidate->mapped && !map_block(candidate, std::min(candidate->size, p.size), p.tag)) {
      release_if_unmapped(seg);
      return false;
    }
    while (candidate->size < p.size) {
      Block* next = candidate->next;
      if (!next || next->mapped)
        throw std::logic_error(fmt::format(
            "CachingAllocator on {}: expandable segment {:#x} has no unmapped pages after the free "
            "block {:#x} it was going to grow",
            provider_->device_name(), seg->base, candidate->addr()));
      if (!map_block(next, std::min(p.size - candidate->size, next->size), p.tag)) return false;
      candidate = next;  // map_block merged the free block into it
    }
  } catch (...) {
    release_if_unmapped(seg);  // a segment made for this request and never mapped
    throw;
  }
  p.block = candidate;
  candidate->gc_count = 0;
  candidate->pool_node = p.pool->blocks.extract(candidate);
  return true;
}

// reclaim_on_growth (docs/notes.md §1): unmap the whole pages of the stream's free
// expandable blocks, largest first, until `p.size` bytes are given back (or none is left).
// Each unmap_block merges only with unmapped neighbours and leaves the other gathered blocks
// alone (as in release_pool).
void CachingAllocator::reclaim_for(const AllocParams& p) {
  std::vector<Block*> free_blocks;
  for (Block* b : p.pool->blocks)
    if (b->expandable() && b->stream == p.stream && b->event_count == 0 && b->stream_uses.empty())
      free_blocks.push_back(b);
  std::sort(free_blocks.begin(), free_blocks.end(), [](const Block* a, const Block* b) {
    return a->size != b->size ? a->size > b->size : a->addr() < b->addr();
  });
  const size_t reserved_before = total_reserved_;
  for (Block* b : free_blocks) {
    if (reserved_before - total_reserved_ >= p.size) break;
    unmap_block(b);
  }
}

// The lowest unmapped range of the request's stream and pool that, with the free block
// before it and the free and unmapped blocks after it, has room for the request: that free
// block, or the range itself. nullptr when no segment has room.
Block* CachingAllocator::find_expandable_block(const AllocParams& p) {
  auto allocatable = [](const Block* b) {
    return b && !b->allocated && b->event_count == 0 && b->stream_uses.empty();
  };
  auto has_room = [&](const Block* b) {
    size_t bytes = 0;  // at most the segment's size
    for (; bytes < p.size && allocatable(b); b = b->next) bytes += b->size;
    return bytes >= p.size;
  };
  Block key;
  key.stream = p.stream;
  for (auto it = p.pool->unmapped.lower_bound(&key);
       it != p.pool->unmapped.end() && (*it)->stream == p.stream; ++it) {
    Block* c = *it;
    if (allocatable(c->prev)) c = c->prev;
    if (has_room(c)) return c;
  }
  return nullptr;
}

// A new expandable segment for the request's stream and pool, all of it one unmapped block,
// or nullptr when the request is larger than a whole segment.
Block* CachingAllocator::new_expandable_segment(const AllocParams& p) {
  static constexpr const char* what = "CachingAllocator: sizing an expandable segment";
  // PyTorch's pages: kSmallBuffer for the small pool, kLargeBuffer (Tally: the large segment
  // size) for the large one.
  const size_t page = p.pool->small ? kSmallBuffer : config_.large_segment_size;
  if (page > base::kMaxBytes)
    throw std::length_error(fmt::format(
        "{}: pages of {} bytes (large_segment_size_mb) are more than 2^63 - 1", what, page));
  // Addresses for 1 1/8 of the device's memory, as PyTorch reserves: room to map pages at
  // the end while earlier ones are still mapped. The segment's size fits in 63 bits.
  const size_t total = provider_->total_memory();
  const size_t want = total > base::kMaxBytes / 9 * 8 ? base::kMaxBytes : total + total / 8;
  size_t pages = want / page;
  if (want % page != 0 && pages < base::kMaxBytes / page) ++pages;
  pages = std::max<size_t>(pages, 1);
  if (p.size > base::checked_mul(page, pages, what)) return nullptr;

  std::unique_ptr<ExpandableSegment> es =
      provider_->create_expandable_segment(p.stream, page, pages);
  auto seg = std::make_unique<Segment>();
  seg->order = detail::next_segment_order.fetch_add(1, std::memory_order_relaxed);
  seg->base = es->base();
  seg->size = es->size();
  seg->stream = p.stream;
  seg->small = p.pool->small;
  seg->tag = p.tag;
  seg->expandable = std::move(es);
  auto* block = new Block();
  block->ptr = reinterpret_cast<void*>(seg->base);
  block->size = seg->size;
  block->stream = p.stream;
  block->pool = p.pool;
  block->segment = seg.get();
  block->mapped = false;
  seg->head = block;
  p.pool->unmapped.insert(block);
  const uintptr_t base = seg->base;
  segments_.emplace(base, seg.release());
  return block;
}

// Map the pages holding the first `size` bytes of unmapped `block`; false when the device
// (or the memory fraction) has no room for them. The pages merge with free mapped
// neighbours into one free block, in the pool.
bool CachingAllocator::map_block(Block* block, size_t size, const AllocTag& tag) {
  Segment* seg = block->segment;
  ExpandableSegment& es = *seg->expandable;
  const size_t bytes =
      base::checked_round_up(size, es.page_size(), "CachingAllocator: rounding to whole pages");
  if (memory_fraction_ > 0 &&
      (total_reserved_ > allowed_maximum_ || bytes > allowed_maximum_ - total_reserved_))
    return false;
  const uintptr_t start = block->addr();
  if (!es.map(start - seg->base, bytes)) return false;

  BlockPool& pool = *block->pool;
  pool.unmapped.erase(block);
  block->mapped = true;
  if (bytes < block->size) {  // the rest stays unmapped
    auto* rest = new Block();
    rest->ptr = reinterpret_cast<void*>(start + bytes);
    rest->size = block->size - bytes;
    rest->stream = block->stream;
    rest->pool = block->pool;
    rest->segment = seg;
    rest->mapped = false;
    rest->prev = block;
    rest->next = block->next;
    if (rest->next) rest->next->prev = rest;
    block->next = rest;
    block->size = bytes;
    pool.unmapped.insert(rest);
  }
  // The run of mapped pages this joins: a new one, an extension, or two joined into one.
  const int64_t runs =
      1 - int64_t{block->prev && block->prev->mapped} - int64_t{block->next && block->next->mapped};
  try_merge(block, block->prev);
  try_merge(block, block->next);
  pool.insert(block);

  total_reserved_ += bytes;
  ++stats_.num_device_alloc;
  stat_increase(stats_.reserved_bytes, seg->small, static_cast<int64_t>(bytes));
  if (runs > 0) stat_increase(stats_.segment, seg->small, runs);
  if (runs < 0) stat_decrease(stats_.segment, seg->small, -runs);
  AllocTag seg_tag;  // pages belong to no category
  seg_tag.loc = tag.loc;
  record(TraceAction::segment_map, start, bytes, block->stream, seg_tag);
  return true;
}

// Unmap the whole pages inside free `block` (PyTorch's unmap_block); the partial pages at
// its ends stay mapped, as free blocks.
void CachingAllocator::unmap_block(Block* block) {
  Segment* seg = block->segment;
  ExpandableSegment& es = *seg->expandable;
  const size_t page = es.page_size();
  const size_t offset = block->addr() - seg->base;  // offsets and sizes below 2^63
  const size_t first = (offset + page - 1) / page * page;
  const size_t last = (offset + block->size) / page * page;
  if (first >= last) return;
  size_t done = 0;
  try {
    es.unmap(first, last - first, done);
  } catch (...) {
    if (done > 0) forget_pages(block, seg->base + first, done);  // what the provider gave back
    throw;
  }
  forget_pages(block, seg->base + first, done);
}

// [start, start + bytes), whole pages inside free `block`, were unmapped: they become an
// unmapped block (merged with unmapped neighbours), the rest of `block` free blocks. Gives
// the segment back when nothing in it is mapped any more.
void CachingAllocator::forget_pages(Block* block, uintptr_t start, size_t bytes) {
  Segment* seg = block->segment;
  BlockPool& pool = *block->pool;
  pool.blocks.erase(block);
  const size_t before = start - block->addr();
  const size_t after = block->size - before - bytes;
  const int64_t runs = -1 + int64_t{before > 0 || (block->prev && block->prev->mapped)} +
                       int64_t{after > 0 || (block->next && block->next->mapped)};
  auto free_part = [&](uintptr_t addr, size_t size) {
    auto* b = new Block();
    b->ptr = reinterpret_cast<void*>(addr);
    b->size = size;
    b->stream = block->stream;
    b->pool = block->pool;
    b->segment = seg;
    return b;
  };
  if (before > 0) {  // prev -> part -> block
    Block* part = free_part(block->addr(), before);
    part->prev = block->prev;
    part->link_from_prev();
    part->next = block;
    block->prev = part;
    pool.insert(part);
  }
  if (after > 0) {  // block -> part -> next
    Block* part = free_part(start + bytes, after);
    part->prev = block;
    part->next = block->next;
    if (part->next) part->next->prev = part;
    block->next = part;
    pool.insert(part);
  }
  block->ptr = reinterpret_cast<void*>(start);
  block->size = bytes;
  block->mapped = false;
  try_merge(block, block->prev);
  try_merge(block, block->next);
  pool.unmapped.insert(block);

  total_reserved_ -= bytes;
  ++stats_.num_device_free;
  stat_decrease(stats_.reserved_bytes, seg->small, static_cast<int64_t>(bytes));
  if (runs > 0) stat_increase(stats_.segment, seg->small, runs);
  if (runs < 0) stat_decrease(stats_.segment, seg->small, -runs);
  AllocTag tag;
  tag.loc = seg->tag.loc;
  record(TraceAction::segment_unmap, start, bytes, block->stream, tag);
  if (!block->is_split()) release_expandable_segment(seg);
}

// Give back an expandable segment that is one unmapped block.
void CachingAllocator::release_expandable_segment(Segment* seg) {
  Block* block = seg->head;
  block->pool->unmapped.erase(block);
  segments_.erase(seg->base);
  delete block;
  delete seg;  // its ExpandableSegment frees the addresses
}

void CachingAllocator::release_if_unmapped(Segment* seg) {
  if (!seg->head->mapped && !seg->head->next) release_expandable_segment(seg);
}

bool CachingAllocator::should_split(const Block* block, size_t size) const {
  const size_t remaining = block->size - size;
  if (block->pool->small || block->expandable()) return remaining >= kMinBlockSize;
  return size < config_.max_split_size && remaining > kSmallSize;
}

void* CachingAllocator::alloc_found_block(AllocParams& p, const AllocTag& tag) {
  Block* block = p.block;
  BlockPool* pool = p.pool;
  const bool small = pool->small;
  const bool already_split = block->is_split();
  // PyTorch leaves expandable segments out of inactive_split: their free pages can always be
  // released.
  const bool counts_split = !block->expandable();
  if (should_split(block, p.size)) {
    Block* remaining = block;
    block = new Block();
    block->ptr = remaining->ptr;
    block->size = p.size;
    block->stream = p.stream;
    block->pool = pool;
    block->segment = remaining->segment;
    block->prev = remaining->prev;
    block->link_from_prev();
    block->next = remaining;
    remaining->prev = block;
    remaining->ptr = static_cast<char*>(remaining->ptr) + p.size;
    remaining->size -= p.size;
    pool->insert(remaining);
    if (counts_split && already_split) {
      stat_decrease(stats_.inactive_split_bytes, small, static_cast<int64_t>(block->size));
    } else if (counts_split) {
      stat_increase(stats_.inactive_split_bytes, small, static_cast<int64_t>(remaining->size));
      stat_increase(stats_.inactive_split, small, 1);
    }
  } else if (already_split && counts_split) {
    stat_decrease(stats_.inactive_split_bytes, small, static_cast<int64_t>(block->size));
    stat_decrease(stats_.inactive_split, small, 1);
  }

  block->allocated = true;
  block->requested = p.requested;
  block->tag = tag;
  if (block->active_node) {
    block->active_node.key() = block->ptr;
    block->active_node.mapped() = block;
    active_.insert(std::move(block->active_node));
  } else {
    active_.emplace(block->ptr, block);
  }

  const auto size = static_cast<int64_t>(block->size);
  stat_increase(stats_.allocation, small, 1);
  stat_increase(stats_.allocated_bytes, small, size);
  stat_increase(stats_.active, small, 1);
  stat_increase(stats_.active_bytes, small, size);
  stat_increase(stats_.requested_bytes, small, static_cast<int64_t>(p.requested));
  if (block->size >= config_.max_split_size) stats_.oversize_allocations.increase(1);
  stats_.cat_bytes(tag.category).increase(size);
  stats_.category_blocks[static_cast<size_t>(tag.category)].increase(1);
  stats_.note_peak();
  record(TraceAction::alloc, block->addr(), p.requested, p.stream, tag);
  if (AllocationObserver* o = allocation_observer())
    notify(o, block->addr(), static_cast<int64_t>(block->size), tag, false, tag.category);
  return block->ptr;
}

Block* CachingAllocator::find_active(const void* ptr) const {
  auto it = active_.find(ptr);
  return it == active_.end() ? nullptr : it->second;
}

void CachingAllocator::deallocate(void* ptr, std::source_location loc) {
  if (!ptr) return;
  std::lock_guard lock(mu_);
  auto it = active_.find(ptr);
  Block* block = it == active_.end() ? nullptr : it->second;
  if (!block || !block->allocated) {
    throw std::invalid_argument(fmt::format(
        "CachingAllocator::deallocate on {}: pointer {} was not allocated by this allocator "
        "(or was already freed)",
        provider_->device_name(), ptr));
  }
  const bool small = block->pool->small;
  const auto size = static_cast<int64_t>(block->size);
  block->allocated = false;
  stat_decrease(stats_.allocation, small, 1);
  stat_decrease(stats_.allocated_bytes, small, size);
  if (block->size >= config_.max_split_size) stats_.oversize_allocations.decrease(1);
  stats_.cat_bytes(block->tag.category).decrease(size);
  stats_.category_blocks[static_cast<size_t>(block->tag.category)].decrease(1);
  AllocTag tag = block->tag;
  tag.loc = user_site_or(loc);
  record(TraceAction::free_requested, block->addr(), block->requested, block->stream, tag);
  if (AllocationObserver* o = allocation_observer())
    notify(o, block->addr(), -size, tag, false, tag.category);
  if (!block->stream_uses.empty() && !capture_streams_.empty()) {
    deferred_frees_.push_back(block);  // no event may be recorded and queried mid-capture
  } else if (!block->stream_uses.empty()) {
    insert_events(block);  // stays in active_ until its events complete
  } else {
    block->active_node = active_.extract(it);
    free_block(block);
  }
}

size_t CachingAllocator::try_merge(Block* dst, Block* src) {
  // dst is in no set: its key changes below.
  if (!src || src->allocated || src->event_count > 0 || !src->stream_uses.empty() ||
      src->mapped != dst->mapped)
    return 0;
  BlockPool& pool = *dst->pool;
  if (src->mapped)
    pool.blocks.erase(src);
  else
    pool.unmapped.erase(src);
  if (dst->prev == src) {
    dst->ptr = src->ptr;
    dst->prev = src->prev;
    dst->link_from_prev();
  } else {
    dst->next = src->next;
    if (dst->next) dst->next->prev = dst;
  }
  const size_t merged = src->size;
  dst->size += merged;
  delete src;
  return merged;
}

void CachingAllocator::free_block(Block* block) {
  BlockPool& pool = *block->pool;
  const bool small = pool.small;
  const auto original_size = static_cast<int64_t>(block->size);
  const auto requested = static_cast<int64_t>(block->requested);
  record(TraceAction::free_completed, block->addr(), block->requested, block->stream, block->tag);
  // Callers take the block out of active_ (keeping its node) before freeing it.

  int64_t net_split_blocks = 0;
  int64_t net_split_bytes = 0;
  for (Block* candidate : {block->prev, block->next}) {
    if (const size_t merged = try_merge(block, candidate)) {
      net_split_blocks -= 1;
      net_split_bytes -= static_cast<int64_t>(merged);
    }
  }
  block->requested = 0;
  block->tag = AllocTag{};
  block->stream_uses.clear();
  pool.insert(block);
  if (block->is_split()) {
    net_split_blocks += 1;
    net_split_bytes += static_cast<int64_t>(block->size);
  }
  if (block->expandable()) net_split_blocks = net_split_bytes = 0;  // see alloc_found_block
  if (net_split_blocks > 0) stat_increase(stats_.inactive_split, small, net_split_blocks);
  if (net_split_blocks < 0) stat_decrease(stats_.inactive_split, small, -net_split_blocks);
  if (net_split_bytes > 0) stat_increase(stats_.inactive_split_bytes, small, net_split_bytes);
  if (net_split_bytes < 0) stat_decrease(stats_.inactive_split_bytes, small, -net_split_bytes);
  stat_decrease(stats_.active, small, 1);
  stat_decrease(stats_.active_bytes, small, original_size);
  stat_decrease(stats_.requested_bytes, small, requested);
}

void CachingAllocator::record_stream(void* ptr, StreamId stream) {
  std::lock_guard lock(mu_);
  Block* block = find_active(ptr);
  if (!block || !block->allocated)
    throw std::invalid_argument(
        fmt::format("CachingAllocator::record_stream: unknown pointer {}", ptr));
  if (stream == block->stream) return;
  if (std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
      block->stream_uses.end())
    block->stream_uses.push_back(stream);
}

void CachingAllocator::insert_events(Block* block) {
  std::vector<StreamId> streams;
  streams.swap(block->stream_uses);
  for (StreamId s : streams) {
    outstanding_events_.emplace_back(provider_->record_event(s), block);
    ++block->event_count;
  }
}

void CachingAllocator::process_events() {
  if (outstanding_events_.empty()) return;
  std::vector<std::pair<EventId, Block*>> still;
  for (auto& [ev, block] : outstanding_events_) {
    if (!provider_->query_event(ev)) {
      still.emplace_back(ev, block);
      continue;
    }
    provider_->destroy_event(ev);
    if (--block->event_count == 0) {
      block->active_node = active_.extract(block->ptr);
      free_block(block);
    }
  }
  outstanding_events_.swap(still);
}

void CachingAllocator::synchronize_and_free_events() {
  if (outstanding_events_.empty()) return;
  provider_->synchronize();
  ++stats_.num_sync_all_streams;
  auto events = std::move(outstanding_events_);
  outstanding_events_.clear();
  for (auto& [ev, block] : events) {
    provider_->destroy_event(ev);
    if (--block->event_count == 0) {
      block->active_node = active_.extract(block->ptr);
      free_block(block);
    }
  }
}

void CachingAllocator::release_block(Block* block) {
  Segment* seg = block->segment;
  const bool small = seg->small;
  provider_->deallocate(block->ptr, block->size);
  ++stats_.num_device_free;
  total_reserved_ -= block->size;
  block->pool->blocks.erase(block);
  stat_decrease(stats_.segment, small, 1);
  stat_decrease(stats_.reserved_bytes, small, static_cast<int64_t>(block->size));
  if (block->size >= config_.max_split_size) stats_.oversize_segments.decrease(1);
  AllocTag tag;
  tag.loc = seg->tag.loc;
  record(TraceAction::segment_free, block->addr(), block->size, block->stream, tag);
  segments_.erase(seg->base);
  delete seg;
  delete block;
}

void CachingAllocator::release_pool(BlockPool& pool) {
  std::vector<Block*> to_unmap;  // unmapping changes the pool: gather first
  for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
    Block* b = *it;
    ++it;
    if (b->expandable())
      to_unmap.push_back(b);
    else if (!b->is_split())
      release_block(b);
  }
  // Each leaves the others alone: it merges only with unmapped neighbours, and gives the
  // segment back only when nothing else is in it.
  for (Block* b : to_unmap) unmap_block(b);
}

bool CachingAllocator::release_cached_blocks() {
  synchronize_and_free_events();
  provider_->synchronize();
  release_pool(*large_pool_);
  release_pool(*small_pool_);
  release_unused_private_pools();
  return true;
}

void CachingAllocator::release_unused_private_pools() {
  for (auto it = private_pools_.begin(); it != private_pools_.end();) {
    PrivatePool& pp = *it->second;
    if (pp.use_count > 0) {
      ++it;
      continue;
    }
    release_pool(pp.large);
    release_pool(pp.small);
    const MempoolId id = it->first;
    const bool empty = std::none_of(segments_.begin(), segments_.end(),
                                    [&](const auto& kv) { return kv.second->pool_id == id; });
    it = empty ? private_pools_.erase(it) : std::next(it);
  }
}

void CachingAllocator::begin_allocate_to_pool(MempoolId pool, StreamId stream) {
  std::lock_guard lock(mu_);
  if (pool == 0)
    throw std::invalid_argument(
        "CachingAllocator::begin_allocate_to_pool: pool 0 is the default pool; take a private "
        "one from graph_pool_handle()");
  for (const auto& [id, s] : capture_streams_)
    if (s == stream)
      throw std::logic_error(fmt::format(
          "CachingAllocator::begin_allocate_to_pool on {}: stream {:#x} already allocates to "
          "private pool {}",
          provider_->device_name(), stream, id));
  auto& pp = private_pools_[pool];
  if (!pp) pp = std::make_unique<PrivatePool>(pool);
  ++pp->use_count;
  capture_streams_.emplace_back(pool, stream);
}

void CachingAllocator::end_allocate_to_pool(MempoolId pool) {
  std::lock_guard lock(mu_);
  auto it = std::find_if(capture_streams_.begin(), capture_streams_.end(),
                         [&](const auto& e) { return e.first == pool; });
  if (it == capture_streams_.end())
    throw std::logic_error(fmt::format(
        "CachingAllocator::end_allocate_to_pool on {}: private pool {} is not being allocated to",
        provider_->device_name(), pool));
  capture_streams_.erase(it);
  if (!capture_streams_.empty()) return;
  std::vector<Block*> deferred;
  deferred.swap(deferred_frees_);
  for (Block* b : deferred) insert_events(b);
}

void CachingAllocator::release_pool(MempoolId pool) {
  std::lock_guard lock(mu_);
  auto it = private_pools_.find(pool);
  if (it == private_pools_.end() || it->second->use_count == 0)
    throw std::invalid_argument(
        fmt::format("CachingAllocator::release_pool on {}: private pool {} is not in use",
                    provider_->device_name(), pool));
  for (const auto& [id, s] : capture_streams_)
    if (id == pool)
      throw std::logic_error(fmt::format(
          "CachingAllocator::release_pool on {}: private pool {} is still being captured into",
          provider_->device_name(), pool));
  if (--it->second->use_count > 0 || !capture_streams_.empty()) return;
  release_unused_private_pools();
}

bool CachingAllocator::capturing() const {
  std::lock_guard lock(mu_);
  return !capture_streams_.empty();
}

std::vector<PoolInfo> CachingAllocator::graph_pools() const {
  std::lock_guard lock(mu_);
  std::vector<PoolInfo> out;
  for (const auto& [id, pp] : private_pools_) {
    PoolInfo info{.id = id, .use_count = pp->use_count};
    for (const auto& [base, seg] : segments_) {
      if (seg->pool_id != id) continue;
      ++info.segments;
      for (const Block* b = seg->head; b; b = b->next) {
        info.reserved += b->size;
        if (b->allocated) info.allocated += b->size;
      }
    }
    out.push_back(info);
  }
  return out;
}

bool CachingAllocator::release_available_cached_blocks(const AllocParams& p) {
  if (!config_.max_split_size_set()) return false;
  BlockPool& pool = *p.pool;
  Block key;
  key.stream = p.stream;
  key.size = p.size < config_.max_split_size ? config_.max_split_size : p.size;
  auto it = pool.blocks.lower_bound(&key);
  if (it != pool.blocks.end() && (*it)->stream == p.stream && (*it)->whole_segment()) {
    release_block(*it);
    return true;
  }
  // No single oversize block is enough: release oversize blocks, largest first.
  if (it == pool.blocks.begin()) return false;
  size_t released = 0;
  --it;
  while (released < key.size && (*it)->size >= config_.max_split_size &&
         (*it)->stream == p.stream) {
    auto cur = it;
    const bool first = cur == pool.blocks.begin();
    if (!first) --it;
    if ((*cur)->whole_segment()) {
      released += (*cur)->size;
      release_block(*cur);
    }
    if (first) break;
  }
  return released >= key.size;
}

void CachingAllocator::garbage_collect_cached_blocks() {
  const auto threshold = static_cast<size_t>(config_.garbage_collection_threshold *
                                             static_cast<double>(allowed_maximum_));
  if (total_reserved_ <= threshold) return;
  const size_t target = total_reserved_ - threshold;
  size_t reclaimed = 0;
  double total_age = 0;
  int freeable = 0;
  for (Block* b : large_pool_->blocks) {
    if (b->whole_segment()) {
      total_age += b->gc_count;
      ++freeable;
    }
  }
  bool freed = true;
  while (reclaimed < target && freed && freeable > 0) {
    const double age_threshold = total_age / freeable;
    freed = false;
    for (auto it = large_pool_->blocks.begin(); it != large_pool_->blocks.end();) {
      Block* b = *it;
      ++it;
      if (b->whole_segment() && b->gc_count >= age_threshold) {
        freed = true;
        reclaimed += b->size;
        total_age -= b->gc_count;
        --freeable;
        release_block(b);
      }
    }
  }
}

static std::string fmt_bytes(size_t b) {
  return base::format_bytes(static_cast<double>(b), 2);
}

void CachingAllocator::raise_oom(const AllocParams& p, std::unique_lock<std::mutex>& lock) {
  const size_t device_free = provider_->free_memory();
  const size_t device_total = provider_->total_memory();
  ++stats_.num_ooms;
  if (recording_) {
    TraceEntry e;
    e.action = TraceAction::oom;
    e.size = p.size;
    e.stream = p.stream;
    e.time_us = now_us();
    e.tag = current_tag();
    e.device_free = device_free;
    ring_.push(e);
  }
  size_t largest_cached = 0;
  size_t cached = 0;
  last_oom_ = OomRecord{.requested = p.requested,
                        .size = p.size,
                        .small_pool = p.pool->small,
                        .category = p.tag.category};
  for (BlockPool* pool : {small_pool_.get(), large_pool_.get()}) {
    for (Block* b : pool->blocks) {
      largest_cached = std::max(largest_cached, b->size);
      cached += b->size;
      if (pool != p.pool) continue;
      last_oom_.free_bytes += b->size;
      if (b->stream == p.stream) last_oom_.largest_free = std::max(last_oom_.largest_free, b->size);
    }
  }
  std::vector<std::pair<int64_t, Category>> cats;
  for (Category c : kAllCategories) {
    const int64_t cur = stats_.cat_bytes(c).current;
    if (cur > 0) cats.emplace_back(cur, c);
  }
  std::sort(cats.rbegin(), cats.rend());
  std::string top;
  for (size_t i = 0; i < cats.size() && i < 4; ++i) {
    top += fmt::format("{}{} {}", i ? ", " : "", category_name(cats[i].second),
                       fmt_bytes(static_cast<size_t>(cats[i].first)));
  }
  if (top.empty()) top = "none";
  const AllocTag tag = current_tag();
  std::string where;
  if (tag.module) where += fmt::format(" module '{}'", interned(tag.module));
  if (tag.op) where += fmt::format(" op '{}'", interned(tag.op));
  std::string msg = fmt::format(
      "Tally out of memory on {}: tried to allocate {} (request {} bytes, block {} bytes, "
      "{} pool) as {}{}. Device total {}, free {}. Allocated {}, reserved {} (cached free {}, "
      "largest cached block {}). Top categories: {}.",
      provider_->device_name(), fmt_bytes(p.requested), p.requested, p.size,
      p.pool->small ? "small" : "large", category_name(tag.category), where,
      fmt_bytes(device_total), fmt_bytes(device_free),
      fmt_bytes(static_cast<size_t>(stats_.allocated_bytes[kAllPools].current)),
      fmt_bytes(total_reserved_), fmt_bytes(cached), fmt_bytes(largest_cached), top);
  if (memory_fraction_ > 0)
    msg += fmt::format(" Memory fraction {} caps reserved memory at {}.", memory_fraction_,
                       fmt_bytes(allowed_maximum_));
  // oom_snapshot: the segments and blocks with their tags always; the trace when recording
  // (empty otherwise). Whatever goes wrong writing it, the error stays the out-of-memory one.
  const std::string path = config_.oom_snapshot_path;
  const bool with_trace = recording_;
  SnapshotData snap;
  std::string dump_error;
  if (!path.empty()) {
    try {
      snap = snapshot_locked();
    } catch (const std::exception& e) {
      dump_error = e.what();
    }
  }
  lock.unlock();
  if (!path.empty()) {
    try {
      if (!dump_error.empty()) throw std::runtime_error(dump_error);
      write_snapshot_file(snap, path);
      msg += fmt::format(" Snapshot written to {}{}.", base::per_rank_path(path),
                         with_trace ? "" : " (segments and blocks; no trace: history is off)");
    } catch (const std::exception& e) {
      msg += fmt::format(" Writing the snapshot to {} failed: {}", path, e.what());
    }
  }
  throw OutOfMemoryError(msg, p.requested);
}

void CachingAllocator::retag(void* ptr, Category category, std::source_location loc) {
  std::lock_guard lock(mu_);
  Block* block = find_active(ptr);
  if (!block || !block->allocated)
    throw std::invalid_argument(
        fmt::format("CachingAllocator::retag to {}: pointer {} is not a live block",
                    category_name(category), ptr));
  const Category old = block->tag.category;
  if (old == category) return;
  const auto size = static_cast<int64_t>(block->size);
  stats_.cat_bytes(old).decrease(size);
  stats_.category_blocks[static_cast<size_t>(old)].decrease(1);
  stats_.cat_bytes(category).increase(size);
  stats_.category_blocks[static_cast<size_t>(category)].increase(1);
  block->tag.category = category;
  if (AllocationObserver* o = allocation_observer()) {
    AllocTag t = block->tag;
    t.loc = user_site_or(loc);
    notify(o, block->addr(), size, t, true, old);
  }
  if (recording_) {
    TraceEntry e;
    e.action = TraceAction::retag;
    e.addr = block->addr();
    e.size = block->requested;
    e.stream = block->stream;
    e.time_us = now_us();
    e.tag = block->tag;
    e.tag.loc = user_site_or(loc);
    e.old_category = old;
    ring_.push(e);
  }
}

bool CachingAllocator::reassign(void* ptr, StreamId stream, std::source_location loc) {
  AllocTag tag = current_tag();
  if (tag.loc.line == 0 && !hooked_user_site(tag.loc)) tag.loc = SourceLoc::from(loc);
  std::lock_guard lock(mu_);
  Block* block = find_active(ptr);
  if (!block || !block->allocated || block->stream != stream || !block->stream_uses.empty())
    return false;
  const auto size = static_cast<int64_t>(block->size);
  AllocTag old = block->tag;
  old.loc = tag.loc;
  stats_.cat_bytes(old.category).decrease(size);
  stats_.category_blocks[static_cast<size_t>(old.category)].decrease(1);
  stats_.cat_bytes(tag.category).increase(size);
  stats_.category_blocks[static_cast<size_t>(tag.category)].increase(1);
  block->tag = tag;
  record(TraceAction::free_requested, block->addr(), block->requested, block->stream, old);
  record(TraceAction::free_completed, block->addr(), block->requested, block->stream, old);
  record(TraceAction::alloc, block->addr(), block->requested, block->stream, tag);
  if (AllocationObserver* o = allocation_observer()) {
    notify(o, block->addr(), -size, old, false, old.category);
    notify(o, block->addr(), size, tag, false, tag.category);
  }
  return true;
}

size_t CachingAllocator::block_size(const void* ptr) const {
  std::lock_guard lock(mu_);
  Block* b = find_active(ptr);
  if (!b) throw std::invalid_argument(fmt::format("block_size: unknown pointer {}", ptr));
  return b->size;
}

AllocTag CachingAllocator::block_tag(const void* ptr) const {
  std::lock_guard lock(mu_);
  Block* b = find_active(ptr);
  if (!b) throw std::invalid_argument(fmt::format("block_tag: unknown pointer {}", ptr));
  return b->tag;
}

void CachingAllocator::empty_cache() {
  std::lock_guard lock(mu_);
  if (!capture_streams_.empty())
    throw std::logic_error(
        fmt::format("empty_cache on {}: a CUDA graph capture is open (freeing segments "
                    "synchronises the device, which a capture does not allow)",
                    provider_->device_name()));
  release_cached_blocks();
}

void CachingAllocator::set_memory_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0))
    throw std::invalid_argument(
        fmt::format("set_memory_fraction: fraction {} is not in (0, 1]", fraction));
  std::lock_guard lock(mu_);
  memory_fraction_ = fraction;
  allowed_maximum_ = static_cast<size_t>(fraction * static_cast<double>(provider_->total_memory()));
}

size_t CachingAllocator::memory_cap() const {
  std::lock_guard lock(mu_);
  return memory_fraction_ > 0 ? allowed_maximum_ : provider_->total_memory();
}

DeviceStats CachingAllocator::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}
size_t CachingAllocator::all_pools(StatArray DeviceStats::*counter, int64_t Stat::*figure) const {
  std::lock_guard lock(mu_);
  return static_cast<size_t>((stats_.*counter)[kAllPools].*figure);
}
void CachingAllocator::reset_peak_memory_stats() {
  std::lock_guard lock(mu_);
  stats_.reset_peak();
  largest_request_ = 0;
}
void CachingAllocator::reset_accumulated_memory_stats() {
  std::lock_guard lock(mu_);
  stats_.reset_accumulated();
}

std::string CachingAllocator::memory_summary(bool abbreviated) const {
  DeviceStats st;
  FragmentationInfo frag;
  {
    std::lock_guard lock(mu_);
    st = stats_;
    frag = fragmentation_locked();
  }
  std::string out =
      format_memory_summary(st, device_, provider_->device_name(), abbreviated, &frag);
  // The graphs' private pools: memory held for captured kernels, out of the cache's reach.
  for (const PoolInfo& pool : graph_pools())
    out += fmt::format(
        "Graph pool {}: {} graph(s) use it, {} segment(s), reserved {}, allocated {}\n", pool.id,
        pool.use_count, pool.segments, fmt_bytes(pool.reserved), fmt_bytes(pool.allocated));
  return out;
}

FragmentationInfo CachingAllocator::fragmentation() const {
  std::lock_guard lock(mu_);
  return fragmentation_locked();
}

FragmentationInfo CachingAllocator::fragmentation_locked() const {
  static constexpr size_t kKeptSegments = 4;  // the diagnosis names the first two
  FragmentationInfo f;
  f.largest_request = largest_request_;
  f.largest_request_small = largest_request_small_;
  f.last_oom = last_oom_;
  f.max_split_size = config_.max_split_size;
  f.expandable_segments = config_.expandable_segments;
  for (const auto& [base, seg] : segments_) {
    FreeSegment s;
    s.address = seg->base;
    s.small = seg->small;
    s.expandable = seg->expandable != nullptr;
    for (const Block* b = seg->head; b; b = b->next) {
      if (!b->mapped) continue;  // unmapped pages of an expandable segment hold nothing
      s.size += b->size;
      if (b->allocated || b->event_count > 0) {
        ++s.live_blocks;
        s.live_bytes[static_cast<size_t>(b->tag.category)] += static_cast<int64_t>(b->size);
      } else {
        ++s.free_blocks;
        s.free_bytes += b->size;
        s.largest_free = std::max(s.largest_free, b->size);
      }
    }
    if (s.free_bytes == 0) continue;
    for (const PoolIndex pool : {kAllPools, s.small ? kSmallPool : kLargePool}) {
      const auto i = static_cast<size_t>(pool);
      f.free_bytes[i] += s.free_bytes;
      f.largest_free[i] = std::max(f.largest_free[i], s.largest_free);
      ++f.free_segments[i];
      if (s.live_blocks == 0) f.releasable[i] += s.free_bytes;
    }
    if (s.live_blocks > 0)
      for (size_t c = 0; c < f.interleaved.size(); ++c) f.interleaved[c] += s.live_bytes[c];
    f.segments.push_back(s);
  }
  // The segments holding the most free bytes, most first (lowest address first on ties).
  const size_t kept = std::min(f.segments.size(), kKeptSegments);
  std::partial_sort(f.segments.begin(), f.segments.begin() + static_cast<std::ptrdiff_t>(kept),
                    f.segments.end(), [](const FreeSegment& a, const FreeSegment& b) {
                      return a.free_bytes != b.free_bytes ? a.free_bytes > b.free_bytes
                                                          : a.address < b.address;
                    });
  f.segments.resize(kept);
  return f;
}

void CachingAllocator::record_memory_history(bool enabled, size_t max_entries) {
  std::lock_guard lock(mu_);
  if (enabled) {
    if (ring_.capacity() != max_entries) ring_.set_capacity(max_entries);
  } else {
    ring_.clear();
    ring_.set_capacity(0);
  }
  if (enabled != recording_) g_recording_allocators.fetch_add(enabled ? 1 : -1);
  recording_ = enabled;  // after the ring changed (set_capacity may throw)
}

bool any_history_recording() {
  return g_recording_allocators.load(std::memory_order_relaxed) > 0;
}

bool CachingAllocator::history_enabled() const {
  std::lock_guard lock(mu_);
  return recording_;
}

std::vector<TraceEntry> CachingAllocator::history() const {
  std::lock_guard lock(mu_);
  return ring_.entries();
}

SnapshotData CachingAllocator::snapshot_locked() const {
  SnapshotData snap;
  snap.config = config_;
  // The segment of blocks [first, end): a whole ordinary segment, or a run of mapped pages
  // of an expandable one.
  auto add_segment = [&](const Segment& seg, const Block* first, const Block* end) {
    SegmentInfo s;
    s.device = device_;
    s.address = first->addr();
    s.stream = seg.stream;
    s.small = seg.small;
    s.pool_id = seg.pool_id;
    s.expandable = seg.expandable != nullptr;
    s.tag = seg.tag;
    for (const Block* b = first; b != end; b = b->next) {
      s.total_size += b->size;
      BlockInfo bi;
      bi.address = b->addr();
      bi.size = b->size;
      bi.requested_size = b->requested;
      if (b->allocated) {
        bi.state = BlockState::active_allocated;
        bi.tag = b->tag;
        s.allocated_size += b->size;
        s.active_size += b->size;
        s.requested_size += b->requested;
      } else if (b->event_count > 0 || !b->stream_uses.empty()) {  // events, or held to a
        bi.state = BlockState::active_pending_free;                // capture's end
        bi.tag = b->tag;
        s.active_size += b->size;
        s.requested_size += b->requested;
      } else {
        bi.state = BlockState::inactive;
      }
      s.blocks.push_back(bi);
    }
    snap.segments.push_back(std::move(s));
  };
  for (const auto& [base, seg] : segments_) {
    if (!seg->expandable) {
      add_segment(*seg, seg->head, nullptr);
      continue;
    }
    for (const Block* b = seg->head; b;) {
      if (!b->mapped) {
        b = b->next;
        continue;
      }
      const Block* end = b;
      while (end && end->mapped) end = end->next;
      add_segment(*seg, b, end);
      b = end;
    }
  }
  snap.device_traces.resize(static_cast<size_t>(device_) + 1);
  snap.device_traces[static_cast<size_t>(device_)] = ring_.entries();
  return snap;
}

std::vector<BlockInfo> CachingAllocator::allocated_blocks() const {
  std::lock_guard lock(mu_);
  std::vector<BlockInfo> out;
  out.reserve(active_.size());
  for (const auto& [ptr, b] : active_) {
    if (!b->allocated) continue;  // pending free: returned, waiting for its streams
    out.push_back(BlockInfo{.address = b->addr(),
                            .size = b->size,
                            .requested_size = b->requested,
                            .state = BlockState::active_allocated,
                            .tag = b->tag});
  }
  return out;
}

SnapshotData CachingAllocator::snapshot() {
  std::lock_guard lock(mu_);
  SnapshotData snap = snapshot_locked();
  if (recording_) {
    TraceEntry e;
    e.action = TraceAction::snapshot;
    e.size = static_cast<size_t>(stats_.active_bytes[kAllPools].current);
    e.time_us = now_us();
    ring_.push(e);
  }
  return snap;
}

void CachingAllocator::dump_snapshot(const std::string& path) {
  write_snapshot_file(snapshot(), path);
}

}  // namespace tally::memory
