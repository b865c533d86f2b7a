// CUDA graphs (torch.cuda.CUDAGraph): capture the work that Tally's stream on a device queues,
// then replay all of it with one launch, without the host's per-op cost.
//
//   cuda::Graph g;
//   step();                        // warm up first: algorithm searches, optimizer state, ...
//   g.capture([&] { step(); });    // forward + backward + optimizer, queued once
//   for (...) { copy_(static_x, batch); g.replay(); }
// Use, the private pool and what cannot be captured: docs/notes.md §22.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "memory/caching_allocator.h"

namespace tally::cuda {

class Graph {
 public:
  Graph();
  ~Graph();  // reset()
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Start capturing Tally's stream on `device`; its allocations come from `pool` (a new
  // private pool when 0). Throws when this graph holds a capture already (reset() it), when
  // another capture is open on the device, or on a build without CUDA.
  void capture_begin(int device = 0, memory::MempoolId pool = 0);
  // End the capture and instantiate the graph. Throws, naming the CUDA error, when the
  // captured work was invalid; the graph is then empty again.
  void capture_end();
  // empty_cache (as torch.cuda.graph does: the pool is then not reserved on top of the cache's
  // free segments), capture_begin, fn(), capture_end. An exception from fn ends the capture,
  // drops it (the graph stays empty) and propagates.
  void capture(const std::function<void()>& fn, int device = 0, memory::MempoolId pool = 0);
  // Launch the captured work on the device's stream (asynchronous, like any op).
  void replay();
  // Drop the captured graph, waiting for its replays, and give up its use of the pool.
  void reset();

  bool captured() const;           // capture_end succeeded and reset() has not been called
  memory::MempoolId pool() const;  // 0 before the first capture_begin
  int device() const;

 private:
  struct Impl;
  void abort_capture() noexcept;
  std::unique_ptr<Impl> impl_;
};

// Whether a Graph is capturing Tally's stream on `device` (false on a build without CUDA).
bool is_capturing(int device);
// Throws std::logic_error naming `what` and the device when a capture is open on it (the
// file comment says what cannot be captured and why).
void check_not_capturing(int device, const char* what);
// A host-to-device copy inside a capture reads its host memory at every replay: a pinned copy
// of `bytes` from `src` (from memory::get_pinned_allocator(), tagged workspace), kept until the
// capturing graph is reset, to copy from instead.
// nullptr when no capture is open on `device`.
const void* keep_for_replay(int device, const void* src, size_t bytes);

}  // namespace tally::cuda
