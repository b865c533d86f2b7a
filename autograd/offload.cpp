#include "autograd/offload.h"

#include <fmt/format.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "memory/context.h"
#include "tensor/ops.h"
#include "tensor/pinned.h"

namespace tally {

// One offloaded tensor: its host copy and, once backward has asked for it (or its group was
// prefetched), the device copy. Shared by every save of the tensor.
struct ActivationOffloader::Entry {
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
  std::vector<std::vector<std::weak_ptr<Entry>>> groups;  // index: group
  std::vector<bool> prefetched;                           // index: group
  // Deduplication: the saves of one tensor (same block, offset, shape, dtype) share an entry
  // while the block lives.
  using Key = std::tuple<const void*, int64_t, Shape, DType>;
  struct Seen {
    std::weak_ptr<const void> block;
    std::weak_ptr<Entry> entry;
  };
  std::map<Key, Seen> seen;
  OffloadStats stats;

  std::vector<std::weak_ptr<Entry>>& group_of(int64_t g) {
    if (groups.size() <= static_cast<size_t>(g)) {
      groups.resize(static_cast<size_t>(g) + 1);
      prefetched.resize(static_cast<size_t>(g) + 1, false);
    }
    return groups[static_cast<size_t>(g)];
  }

  // Backward reached group g: restore the nearest earlier group that still holds tensors,
  // on the copy stream, behind one fence.
  void prefetch_before(int64_t g) {
    for (int64_t k = g - 1; k >= 0; --k) {
      if (prefetched[static_cast<size_t>(k)]) return;
      std::vector<std::shared_ptr<Entry>> todo;
      for (const std::weak_ptr<Entry>& w : groups[static_cast<size_t>(k)])
        if (std::shared_ptr<Entry> e = w.lock(); e && !e->restored.defined())
          todo.push_back(std::move(e));
      prefetched[static_cast<size_t>(k)] = true;
      if (todo.empty()) continue;
      memory::PhaseScope phase("backward");
      for (const std::shared_ptr<Entry>& e : todo) {
        e->restored =
            ops::to_device_on_copy_stream(e->host, e->device, memory::Category::activation);
        ++stats.tensors_prefetched;
      }
      const ops::CopyFence fence = ops::CopyFence::record(todo.front()->device);
      for (const std::shared_ptr<Entry>& e : todo) e->fence = fence;
      return;
    }
  }
};

namespace {
// A save the offloader keeps on the device: held as a plain saved tensor, so that it is
// accounted as `activation` like any saved tensor.
using Kept = std::shared_ptr<SavedTensor>;
using Offloaded = std::shared_ptr<ActivationOffloader::Entry>;

bool offloadable_category(memory::Category c) {
  return c == memory::Category::temporary || c == memory::Category::activation;
}
}  // namespace

std::shared_ptr<ActivationOffloader> ActivationOffloader::create(OffloadOptions options) {
  return std::shared_ptr<ActivationOffloader>(new ActivationOffloader(options));
}

ActivationOffloader::ActivationOffloader(OffloadOptions options)
    : options_(options), state_(std::make_shared<State>()) {
  state_->options = options;
}

ActivationOffloader::~ActivationOffloader() = default;

void ActivationOffloader::next_group() {
  std::lock_guard lock(state_->mu);
  ++state_->group;
}

OffloadStats ActivationOffloader::stats() const {
  std::lock_guard lock(state_->mu);
  OffloadStats s = state_->stats;
  s.groups = 0;
  for (const auto& g : state_->groups)
    if (!g.empty()) ++s.groups;
  return s;
}

SavedTensorHooks ActivationOffloader::hooks() {
  // The hooks hold the state, not the offloader: saved tensors outlive a scope's offloader.
  std::shared_ptr<State> st = state_;
  SavedTensorHooks h;
  h.pack = [st](const Tensor& t) -> std::any {
    const Storage& s = t.storage();
    const bool offload = s.owned() && offloadable_category(s.category()) && t.is_contiguous() &&
                         t.nbytes() >= st->options.min_bytes && t.nbytes() > 0;
    if (!offload) {
      std::lock_guard lock(st->mu);
      ++st->stats.tensors_kept;
      return Kept(std::make_shared<SavedTensor>(t, "save_on_cpu", false));
    }
    if (t.is_cuda() && st->options.pin_memory && !memory::pinned_memory_available())
      throw std::runtime_error(fmt::format(
          "save_on_cpu: cannot offload a {} tensor of shape {}: no pinned host memory is "
          "available (cudaHostAlloc is unavailable here); offload with pin_memory=false",
          t.device().str(), t.shape_string()));
    std::lock_guard lock(st->mu);
    const State::Key key{s.key(), t.storage_offset(), t.sizes(), t.dtype()};
    if (auto it = st->seen.find(key); it != st->seen.end() && !it->second.block.expired())
      if (Offloaded e = it->second.entry.lock()) {
        ++st->stats.tensors_deduplicated;
        return e;
      }
    auto e = std::make_shared<ActivationOffloader::Entry>();
    e->host = ops::to_host_async(t, memory::Category::offloaded, st->options.pin_memory);
    e->device = t.device();
    e->group = st->group;
    st->group_of(st->group).push_back(e);
    st->seen[key] = State::Seen{s.watch(), e};
    ++st->stats.tensors_offloaded;
    st->stats.bytes_offloaded += static_cast<int64_t>(t.nbytes());
    return Offloaded(e);
  };
  h.unpack = [st](const std::any& packed) -> Tensor {
    if (const Kept* k = std::any_cast<Kept>(&packed)) return (*k)->unpack();
    const Offloaded& e = std::any_cast<const Offloaded&>(packed);
    std::lock_guard lock(st->mu);
    if (st->options.prefetch) st->prefetch_before(e->group);
    if (!e->restored.defined()) {
      // Not prefetched: fetch it now (the copy stream, then Tally's stream waits for it).
      e->restored = ops::to_device_on_copy_stream(e->host, e->device, memory::Category::activation);
      e->fence = ops::CopyFence::record(e->device);
      ++st->stats.tensors_fetched;
    }
    if (!e->waited) e->fence.wait();
    e->waited = true;
    return e->restored;
  };
  return h;
}

SaveOnCpu::SaveOnCpu(bool pin_memory)
    : SaveOnCpu(ActivationOffloader::create(OffloadOptions{.pin_memory = pin_memory})) {}

SaveOnCpu::SaveOnCpu(std::shared_ptr<ActivationOffloader> offloader)
    : offloader_(offloader ? std::move(offloader)
                           : throw std::invalid_argument("SaveOnCpu: null offloader")),
      scope_(offloader_->hooks()) {
  offloader_->next_group();
}

SaveOnCpu::~SaveOnCpu() {
  offloader_->next_group();
}

}  // namespace tally
