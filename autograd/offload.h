// Activation offload: what autograd saves for backward is kept in host memory instead of on
// the device, PyTorch's torch.autograd.graph.save_on_cpu(pin_memory=True), built on the
// saved-tensor hooks (autograd/saved_tensor.h).
// How saves are copied, grouped, prefetched and bounded: docs/notes.md §4.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "autograd/saved_tensor.h"

namespace tally {

struct OffloadOptions {
  bool pin_memory = true;  // pinned host memory (asynchronous copies); else pageable
  size_t min_bytes = 0;    // tensors smaller than this stay on the device
  bool prefetch = true;    // backward prefetches one group ahead
  // When a group's saves are copied: 0 at once; k > 0 when group g + k opens, so the groups
  // still open, or just closed, when backward starts (a model's head and its logits, which
  // backward needs first) are never copied and are used where they are. -1: the creator's
  // default (0 for SaveOnCpu's own offloader; 2 for nn::offload_activations, whose blocks
  // alternate with the groups between them, so each block is copied as the next one opens).
  int defer_groups = -1;
  // Bytes of device-to-host copies allowed in flight: past it the forward (the host) waits
  // for the oldest copies to finish. The blocks a copy reads stay out of reuse until the copy
  // stream has passed them, and a forward that outruns the host link would otherwise take new
  // memory for every block it frees (reserved far above allocated). 0: no bound.
  size_t max_inflight_bytes = size_t{1} << 30;
  // 0: backward restores the group before the one it reached. > 0: backward restores each
  // offloaded group once the bytes saved between it and where backward is (the work left
  // before backward needs it) are at most prefetch_lead x the bytes restored from there on,
  // so the copy runs while that work computes. Backward's progress is seen through the
  // modules that only report to the offloader (SaveOnCpu with copy false). The link policy
  // sets it from the forward's saved bytes a second over the link's bytes a second.
  double prefetch_lead = 0;
};

// What an offloader did (tests, reports).
struct OffloadStats {
  int64_t tensors_offloaded = 0;     // distinct tensors copied to the host
  int64_t bytes_offloaded = 0;       // their bytes
  int64_t tensors_kept = 0;          // saves kept on the device (parameters, small, views
                                     // of a block more than 4x their size, and every save of
                                     // a scope that only reports progress)
  int64_t tensors_in_place = 0;      // deferred saves backward used before they were copied
  int64_t copy_waits = 0;            // times the forward waited for copies in flight
  int64_t tensors_deduplicated = 0;  // saves of a tensor already offloaded
  int64_t tensors_prefetched = 0;    // restored ahead of use by a group prefetch
  int64_t tensors_fetched = 0;       // restored on demand at unpack
  int64_t groups = 0;                // groups that saved something
  int64_t groups_held = 0;           // groups still tracked: a finished backward drops its
                                     // step's (the current group stays)
};

// How a save's bytes are counted, once per tensor while its block lives: the block, the offset
// and the bytes; a non-contiguous view as its whole block (offset -1), which its copy takes.
// The offloader's progress counts (prefetch_lead) and the link policy's candidates
// (nn/offload.cpp) both key saves this way.
struct SaveKey {
  const void* block = nullptr;
  int64_t offset = 0;
  size_t bytes = 0;
  auto operator<=>(const SaveKey&) const = default;
};
SaveKey save_key(const Tensor& t);

class ActivationOffloader : public std::enable_shared_from_this<ActivationOffloader> {
 public:
  static std::shared_ptr<ActivationOffloader> create(OffloadOptions options = {});
  ~ActivationOffloader();
  ActivationOffloader(const ActivationOffloader&) = delete;
  ActivationOffloader& operator=(const ActivationOffloader&) = delete;

  // The pack/unpack hooks that offload into this offloader; with `copy` false they keep every
  // save on the device and only tell the offloader where forward and backward are.
  SavedTensorHooks hooks(bool copy = true);
  // Starts a new group of saves (SaveOnCpu calls it when it opens and closes).
  void next_group();
  const OffloadOptions& options() const { return options_; }
  OffloadStats stats() const;

  struct Entry;
  struct State;

 private:
  explicit ActivationOffloader(OffloadOptions options);
  OffloadOptions options_;
  std::shared_ptr<State> state_;
};

// RAII: tensors saved inside (on this thread) go to host memory. The first form makes an
// offloader of its own; the second shares one across scopes (its groups, its prefetch), and
// with `copy` false the scope's saves stay on the device: it is a group whose backward tells
// the offloader how far backward has come (OffloadOptions::prefetch_lead).
class SaveOnCpu {
 public:
  explicit SaveOnCpu(bool pin_memory = true);
  explicit SaveOnCpu(std::shared_ptr<ActivationOffloader> offloader, bool copy = true);
  ~SaveOnCpu();
  SaveOnCpu(const SaveOnCpu&) = delete;
  SaveOnCpu& operator=(const SaveOnCpu&) = delete;
  const std::shared_ptr<ActivationOffloader>& offloader() const { return offloader_; }

 private:
  std::shared_ptr<ActivationOffloader> offloader_;
  SavedTensorHooksScope scope_;
};

}  // namespace tally
