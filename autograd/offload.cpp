#include "autograd/offload.h"

#include <fmt/format.h>

#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "autograd/engine.h"
#include "memory/context.h"
#include "tensor/ops.h"
#include "tensor/pinned.h"

namespace tally {
namespace {
bool offloadable_category(memory::Category c) {
  return c == memory::Category::temporary || c == memory::Category::activation;
}
}  // namespace

SaveKey save_key(const Tensor& t) {
  const Storage& s = t.storage();
  if (!t.is_contiguous()) return {s.key(), -1, s.nbytes()};
  return {s.key(), t.storage_offset(), t.nbytes()};
}

// One offloaded tensor: its host copy and, once backward has asked for it (or its group was
// prefetched), the device copy. Shared by every save of the tensor.
struct ActivationOffloader::Entry {
  // The device tensor until its copy is issued (OffloadOptions::defer_groups), held as a
  // saved tensor is: accounted as `activation`, and checked for in-place changes at unpack.
  std::shared_ptr<SavedTensor> pending;
  Tensor host;
  Device device;
  int64_t group = 0;
  Tensor restored;       // on the device: prefetched or fetched
  ops::CopyFence fence;  // the prefetch's fence (empty when fetched, or CPU / meta)
  bool waited = false;   // Tally's stream already waits for the fence
};

struct ActivationOffloader::State {
  std::mutex mu;
  OffloadOptions options;
  int64_t group = 0;
  // One group's entries; whether backward restored it; its saved bytes (kept and offloaded,
  // each block once: prefetch_lead only) and offloaded bytes.
  struct Group {
    std::vector<std::weak_ptr<Entry>> entries;
    bool prefetched = false;
    int64_t saved_bytes = 0, offloaded_bytes = 0;
  };
  // Groups first_group, first_group + 1, ...: the steps before this one are dropped when their
  // backward finishes (a retained graph's later backward fetches what it needs on demand).
  std::deque<Group> groups;
  int64_t first_group = 0;
  int64_t groups_with_saves = 0;  // OffloadStats::groups
  // Deduplication: the saves of one tensor (same block, offset, shape, dtype) share an entry
  // while the block lives.
  using Key = std::tuple<const void*, int64_t, Shape, DType>;
  struct Seen {
    std::weak_ptr<const void> block;
    std::weak_ptr<Entry> entry;
  };
  std::map<Key, Seen> seen;
  OffloadStats stats;
  // Entries whose copy waits for a later group (defer_groups > 0), in save order.
  std::vector<std::weak_ptr<Entry>> deferred;
  // Device-to-host copies issued and maybe not finished, oldest first (CUDA only: the CPU's
  // and meta's copies are done when they return), and their bytes.
  std::deque<std::pair<ops::CopyFence, size_t>> inflight;
  size_t inflight_bytes = 0;
  // This step's first group; the last group its forward opened (set when backward starts:
  // groups past it are a recompute's); the group backward reached last (prefetch_lead).
  std::map<SaveKey, std::weak_ptr<const void>> counted;
  int64_t step_first_group = 0;
  int64_t forward_last_group = -1;
  int64_t last_reached = -1;
  bool in_backward = false;

  void issue_copy(Entry& e) {
    const Tensor& t = e.pending->held();
    e.host = ops::to_host_async(t, memory::Category::offloaded, options.pin_memory);
    ++stats.tensors_offloaded;
    stats.bytes_offloaded += static_cast<int64_t>(t.nbytes());
    if (options.max_inflight_bytes > 0) {
      ops::CopyFence fence = ops::CopyFence::record(t.device());
      if (!fence.empty()) {
        inflight.emplace_back(std::move(fence), t.nbytes());
        inflight_bytes += t.nbytes();
        // Keep the newest copy queued (the copy stream stays busy); wait for older ones.
        while (inflight_bytes > options.max_inflight_bytes && inflight.size() > 1) {
          inflight.front().first.synchronize();
          inflight_bytes -= inflight.front().second;
          inflight.pop_front();
          ++stats.copy_waits;
        }
      }
    }
    e.pending.reset();
  }

  // Group `group` opened: copy the deferred saves of groups <= group - defer_groups.
  void issue_deferred() {
    std::vector<std::weak_ptr<Entry>> later;
    for (const std::weak_ptr<Entry>& w : deferred) {
      const std::shared_ptr<Entry> e = w.lock();
      if (!e || !e->pending) continue;  // released, or copied
      if (e->group <= group - options.defer_groups)
        issue_copy(*e);
      else
        later.push_back(w);
    }
    deferred = std::move(later);
  }

  // Group g (made if new); null for one dropped with its step.
  Group* group_at(int64_t g) {
    if (g < first_group) return nullptr;
    const auto i = static_cast<size_t>(g - first_group);
    if (groups.size() <= i) groups.resize(i + 1);
    return &groups[i];
  }

  // Restores group k's copied saves on the copy stream, behind one fence; false when it held
  // none.
  bool restore(int64_t k) {
    Group* gr = group_at(k);
    if (!gr) return false;
    gr->prefetched = true;
    std::vector<std::shared_ptr<Entry>> todo;
    for (const std::weak_ptr<Entry>& w : gr->entries)
      if (std::shared_ptr<Entry> e = w.lock(); e && !e->restored.defined() && !e->pending)
        todo.push_back(std::move(e));
    if (todo.empty()) return false;
    // A micro-batch's backward ("backward.0", gradient accumulation) keeps its phase.
    const std::string& outer = memory::interned(memory::current_tag().phase);
    memory::PhaseScope phase(outer.starts_with("backward.") ? std::string_view(outer) : "backward");
    for (const std::shared_ptr<Entry>& e : todo) {
      e->restored = ops::to_device_on_copy_stream(e->host, e->device, memory::Category::activation);
      ++stats.tensors_prefetched;
    }
    const ops::CopyFence fence = ops::CopyFence::record(todo.front()->device);
    for (const std::shared_ptr<Entry>& e : todo) e->fence = fence;
    return true;
  }

  // Backward reached group g: restore the nearest earlier group that still holds tensors.
  void prefetch_before(int64_t g) {
    for (int64_t k = g - 1; k >= first_group; --k) {
      if (group_at(k)->prefetched) return;
      if (restore(k)) return;
    }
  }

  // The first unpack after a forward: backward started. Groups opened from now on are
  // recomputes'; the next forward starts once this backward has finished.
  void note_backward(const std::shared_ptr<State>& self) {
    if (in_backward) return;
    in_backward = true;
    forward_last_group = group;
    last_reached = -1;
    try {
      autograd::queue_callback([self] {
        std::lock_guard lock(self->mu);
        self->in_backward = false;
        self->step_first_group = self->group + 1;
        self->drop_finished_steps();
      });
    } catch (const std::logic_error&) {
      // Unpacked outside a backward pass (a hook called by hand): no step to close.
    }
  }

  // A backward finished: its step's groups, and the keys of blocks freed since, go (a long run
  // would otherwise keep a few of each per step).
  void drop_finished_steps() {
    // The current group stays: a scope open across backward (SaveOnCpu around a whole step)
    // saves into it again.
    const int64_t keep = std::min(step_first_group, group);
    while (!groups.empty() && first_group < keep) {
      groups.pop_front();
      ++first_group;
    }
    if (groups.empty()) first_group = std::max(first_group, keep);
    std::erase_if(seen, [](const auto& kv) { return kv.second.block.expired(); });
    std::erase_if(counted, [](const auto& kv) { return kv.second.expired(); });
  }

  // Counts a save's bytes into group g (prefetch_lead only), each block once while it lives.
  void count_save(const Tensor& t, int64_t g) {
    const Storage& s = t.storage();
    if (!s.owned() || !offloadable_category(s.category())) return;
    const SaveKey key = save_key(t);
    std::weak_ptr<const void>& block = counted[key];
    if (!block.expired()) return;
    block = s.watch();
    if (Group* gr = group_at(g)) gr->saved_bytes += static_cast<int64_t>(key.bytes);
  }

  // Backward reached group g (prefetch_lead > 0): restore each earlier group of this step
  // whose restore is due, latest first: the bytes saved between it and g are at most
  // prefetch_lead x the bytes restored from g down to it. One not yet due stops the walk
  // (the copy stream restores in backward's order).
  void reached(int64_t g) {
    if (g == last_reached || g < step_first_group || g > forward_last_group) return;
    last_reached = g;
    if (g < first_group) return;
    int64_t between = group_at(g)->saved_bytes;
    int64_t ahead = 0;
    for (int64_t k = g - 1; k >= std::max(step_first_group, first_group); --k) {
      const Group& gk = *group_at(k);
      const int64_t off = gk.offloaded_bytes;
      if (off > 0) {
        if (!gk.prefetched) {
          if (static_cast<double>(between) >
              options.prefetch_lead * static_cast<double>(ahead + off))
            return;
          restore(k);
        }
        ahead += off;
      }
      between += gk.saved_bytes;
    }
  }
};

namespace {
// A save the offloader keeps on the device: held as a plain saved tensor, so that it is
// accounted as `activation` like any saved tensor; and its group (backward's progress).
struct Kept {
  std::shared_ptr<SavedTensor> saved;
  int64_t group = 0;
};
using Offloaded = std::shared_ptr<ActivationOffloader::Entry>;
// A view offloaded through its whole block: the entry holds the block (flat, from element 0)
// and the view's layout over it.
struct OffloadedView {
  Offloaded entry;
  Shape sizes, strides;
  int64_t offset = 0;
};

// The whole block under the view `t` as a flat tensor from element 0, when the block holds
// whole elements of t's dtype and is at most 4x t's bytes (q, k and v of one qkv buffer are
// a third of it each); else undefined.
Tensor whole_block(const Tensor& t) {
  for (int64_t st : t.strides())
    if (st < 0) return Tensor();
  const size_t item = dtype_size(t.dtype());
  const size_t block = t.storage().nbytes();
  if (block % item != 0 || block / 4 > t.nbytes()) return Tensor();
  return ops::as_strided(t, {static_cast<int64_t>(block / item)}, {1}, 0);
}
}  // namespace

std::shared_ptr<ActivationOffloader> ActivationOffloader::create(OffloadOptions options) {
  return std::shared_ptr<ActivationOffloader>(new ActivationOffloader(options));
}

ActivationOffloader::ActivationOffloader(OffloadOptions options)
    : options_(options), state_(std::make_shared<State>()) {
  if (options_.defer_groups < 0) options_.defer_groups = 0;  // a SaveOnCpu's own default
  state_->options = options_;
}

ActivationOffloader::~ActivationOffloader() = default;

void ActivationOffloader::next_group() {
  std::lock_guard lock(state_->mu);
  ++state_->group;
  if (state_->options.defer_groups > 0) state_->issue_deferred();
}

OffloadStats ActivationOffloader::stats() const {
  std::lock_guard lock(state_->mu);
  OffloadStats s = state_->stats;
  s.groups = state_->groups_with_saves;
  s.groups_held = static_cast<int64_t>(state_->groups.size());
  return s;
}

SavedTensorHooks ActivationOffloader::hooks(bool copy) {
  // The hooks hold the state, not the offloader: saved tensors outlive a scope's offloader.
  std::shared_ptr<State> st = state_;
  SavedTensorHooks h;
  const bool lead = st->options.prefetch_lead > 0;
  h.pack = [st, copy, lead](const Tensor& t) -> std::any {
    const Storage& s = t.storage();
    // What is copied: t itself, or for a view the whole block under it.
    Tensor span;
    if (copy && s.owned() && offloadable_category(s.category()) &&
        t.nbytes() >= st->options.min_bytes && t.nbytes() > 0)
      span = t.is_contiguous() ? t : whole_block(t);
    if (!span.defined()) {
      std::lock_guard lock(st->mu);
      ++st->stats.tensors_kept;
      if (lead) st->count_save(t, st->group);
      return Kept{std::make_shared<SavedTensor>(t, "save_on_cpu", false), st->group};
    }
    const bool view = !span.is_same(t);
    if (t.is_cuda() && st->options.pin_memory && !memory::pinned_memory_available())
      throw std::runtime_error(fmt::format(
          "save_on_cpu: cannot offload a {} tensor of shape {}: no pinned host memory is "
          "available (cudaHostAlloc is unavailable here); offload with pin_memory=false",
          t.device().str(), t.shape_string()));
    std::lock_guard lock(st->mu);
    // A whole block is keyed by the block alone: every view of it shares one copy.
    const State::Key key = view ? State::Key{s.key(), -1, Shape{}, t.dtype()}
                                : State::Key{s.key(), t.storage_offset(), t.sizes(), t.dtype()};
    Offloaded e;
    if (auto it = st->seen.find(key); it != st->seen.end() && !it->second.block.expired())
      e = it->second.entry.lock();
    if (e) {
      ++st->stats.tensors_deduplicated;
    } else {
      e = std::make_shared<ActivationOffloader::Entry>();
      e->pending = std::make_shared<SavedTensor>(span, "save_on_cpu", false);
      e->device = t.device();
      e->group = st->group;
      State::Group& gr = *st->group_at(st->group);  // the current group: never dropped
      if (gr.entries.empty()) ++st->groups_with_saves;
      gr.entries.push_back(e);
      gr.offloaded_bytes += static_cast<int64_t>(span.nbytes());
      st->seen[key] = State::Seen{s.watch(), e};
      if (st->options.defer_groups > 0)
        st->deferred.push_back(e);
      else
        st->issue_copy(*e);
    }
    if (lead) st->count_save(span, e->group);
    if (view) return OffloadedView{e, t.sizes(), t.strides(), t.storage_offset()};
    return e;
  };
  h.unpack = [st, lead](const std::any& packed) -> Tensor {
    if (const Kept* k = std::any_cast<Kept>(&packed)) {
      if (lead) {
        std::lock_guard lock(st->mu);
        st->note_backward(st);
        st->reached(k->group);
      }
      return k->saved->unpack();
    }
    const OffloadedView* v = std::any_cast<OffloadedView>(&packed);
    const Offloaded& e = v ? v->entry : std::any_cast<const Offloaded&>(packed);
    Tensor data;
    {
      std::lock_guard lock(st->mu);
      st->note_backward(st);
      if (e->pending) {
        // Deferred and not copied yet: backward uses it where it is. No prefetch from here:
        // this is the head's backward, the step's peak (the logits and their gradient), and
        // an earlier group restored now would add to it.
        ++st->stats.tensors_in_place;
        data = e->pending->unpack();
      } else {
        if (lead || st->options.prefetch) {
          // The host waits for this group's restore (issued ahead, so done by now unless the
          // link is behind). Running ahead of the streams, it would otherwise restore (and
          // free) every group before the copy stream got there, and a block freed in backward
          // is reused only once the copy stream has passed the copies queued before its free:
          // backward would hold them all.
          if (!e->waited && !e->fence.empty()) e->fence.synchronize();
          if (lead) {
            st->reached(e->group);
          } else {
            st->prefetch_before(e->group);
          }
        }
        if (!e->restored.defined()) {
          // Not prefetched: fetch it now (the copy stream, then Tally's stream waits for it).
          e->restored =
              ops::to_device_on_copy_stream(e->host, e->device, memory::Category::activation);
          e->fence = ops::CopyFence::record(e->device);
          ++st->stats.tensors_fetched;
        }
        if (!e->waited) e->fence.wait();
        e->waited = true;
        data = e->restored;
      }
    }
    return v ? ops::as_strided(data, v->sizes, v->strides, v->offset) : data;
  };
  return h;
}

SaveOnCpu::SaveOnCpu(bool pin_memory)
    : SaveOnCpu(ActivationOffloader::create(
          OffloadOptions{.pin_memory = pin_memory, .defer_groups = 0})) {}

SaveOnCpu::SaveOnCpu(std::shared_ptr<ActivationOffloader> offloader, bool copy)
    : offloader_(offloader ? std::move(offloader)
                           : throw std::invalid_argument("SaveOnCpu: null offloader")),
      scope_(offloader_->hooks(copy)) {
  offloader_->next_group();
}

SaveOnCpu::~SaveOnCpu() {
  offloader_->next_group();
}

}  // namespace tally
