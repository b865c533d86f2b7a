// cuda::Graph (tensor/cuda/graph.h): stream capture into a graph-private pool, replay, reset.
// Here, not under tensor/cuda/ (CUDA-only sources), because it builds on every backend: without
// CUDA its calls throw and is_capturing() is false.
#include "tensor/cuda/graph.h"

#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "memory/memory.h"
#ifdef TALLY_WITH_CUDA
#include <cuda_runtime.h>

#include "memory/cuda_device_guard.h"
#include "tensor/cuda/runtime.h"
#endif

namespace tally::cuda {

struct Graph::Impl {
  int device = -1;
  memory::MempoolId pool = 0;
  bool capturing = false;
  bool holds_pool = false;  // a capture counted a use of `pool`
#ifdef TALLY_WITH_CUDA
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
#endif
  std::vector<void*> host_buffers;  // pinned copies the captured copies read (keep_for_replay)
};

namespace {

#ifdef TALLY_WITH_CUDA
// The open captures by device (their graphs' kept host buffers). The count makes
// is_capturing() one load when none is open.
std::mutex g_mu;
std::map<int, std::vector<void*>*> g_open;
std::atomic<int> g_open_count{0};

// The pinned allocator may query events or call cudaHostAlloc / cudaFreeHost, which a capture
// in the thread-local mode refuses otherwise. None of it touches the capturing stream.
using memory::RelaxedCapture;

void free_host_buffers(std::vector<void*>& buffers) {
  const RelaxedCapture relaxed;
  memory::CachingAllocator& pinned = memory::get_pinned_allocator();
  for (void* p : buffers) pinned.deallocate(p);
  buffers.clear();
}
#endif

}  // namespace

Graph::Graph() : impl_(std::make_unique<Impl>()) {}

Graph::~Graph() {
  try {
    reset();
  } catch (...) {  // a destructor does not throw; reset() fails only on a broken device
  }
}

bool Graph::captured() const {
#ifdef TALLY_WITH_CUDA
  return impl_->exec != nullptr;
#else
  return false;
#endif
}
memory::MempoolId Graph::pool() const {
  return impl_->pool;
}
int Graph::device() const {
  return impl_->device;
}

#ifdef TALLY_WITH_CUDA

void Graph::capture_begin(int device, memory::MempoolId pool) {
  if (impl_->capturing || captured())
    throw std::logic_error(
        "cuda::Graph::capture_begin: this graph already holds a capture; reset() it first");
  if (device < 0 || device >= memory::cuda_device_count())
    throw std::invalid_argument(
        fmt::format("cuda::Graph::capture_begin: no CUDA device {} ({} visible)", device,
                    memory::cuda_device_count()));
  {
    std::lock_guard lock(g_mu);
    if (g_open.count(device))
      throw std::logic_error(
          fmt::format("cuda::Graph::capture_begin: a capture is already open on cuda:{}", device));
  }
  // The work queued before the capture runs first (and an error it left surfaces here).
  synchronize(device);
  memory::CachingAllocator& alloc = memory::get_allocator(memory::Device::cuda(device));
  const memory::MempoolId id = pool ? pool : memory::graph_pool_handle();
  const memory::StreamId sid = stream_id(device);
  alloc.begin_allocate_to_pool(id, sid);
  DeviceGuard g(device);
  const cudaError_t err = cudaStreamBeginCapture(stream(device), cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) {
    cudaGetLastError();
    alloc.end_allocate_to_pool(id);
    alloc.release_pool(id);
    check(err, "cuda::Graph::capture_begin: cudaStreamBeginCapture");
  }
  impl_->device = device;
  impl_->pool = id;
  impl_->holds_pool = true;
  impl_->capturing = true;
  std::lock_guard lock(g_mu);
  g_open[device] = &impl_->host_buffers;
  g_open_count.fetch_add(1);
}

void Graph::abort_capture() noexcept {
  Impl& m = *impl_;
  if (!m.capturing) return;
  {
    DeviceGuard g(m.device);
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(stream(m.device), &partial);
    if (partial) cudaGraphDestroy(partial);
    cudaGetLastError();  // the capture's error is not the caller's next launch's
  }
  {
    std::lock_guard lock(g_mu);
    g_open.erase(m.device);
    g_open_count.fetch_sub(1);
  }
  m.capturing = false;
  try {
    memory::CachingAllocator& alloc = memory::get_allocator(memory::Device::cuda(m.device));
    alloc.end_allocate_to_pool(m.pool);
    alloc.release_pool(m.pool);
  } catch (...) {
  }
  m.holds_pool = false;
  free_host_buffers(m.host_buffers);
}

void Graph::capture_end() {
  Impl& m = *impl_;
  if (!m.capturing)
    throw std::logic_error("cuda::Graph::capture_end: no capture is open on this graph");
  DeviceGuard g(m.device);
  cudaGraph_t graph = nullptr;
  const cudaError_t err = cudaStreamEndCapture(stream(m.device), &graph);
  {
    std::lock_guard lock(g_mu);
    g_open.erase(m.device);
    g_open_count.fetch_sub(1);
  }
  m.capturing = false;
  memory::CachingAllocator& alloc = memory::get_allocator(memory::Device::cuda(m.device));
  alloc.end_allocate_to_pool(m.pool);
  auto fail = [&](cudaError_t e, const char* call) {
    cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    alloc.release_pool(m.pool);
    m.holds_pool = false;
    free_host_buffers(m.host_buffers);
    throw std::runtime_error(fmt::format(
        "cuda::Graph::capture_end on cuda:{}: {} failed: {} ({}). Something in the captured "
        "work cannot be captured: work on another stream that did not join Tally's, or a CUDA "
        "call that waits for the device",
        m.device, call, cudaGetErrorString(e), cudaGetErrorName(e)));
  };
  if (err != cudaSuccess) fail(err, "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t ierr = cudaGraphInstantiateWithFlags(&exec, graph, 0);
  if (ierr != cudaSuccess) fail(ierr, "cudaGraphInstantiateWithFlags");
  m.graph = graph;
  m.exec = exec;
}

void Graph::replay() {
  Impl& m = *impl_;
  if (!m.exec)
    throw std::logic_error(m.capturing ? "cuda::Graph::replay: the capture is still open"
                                       : "cuda::Graph::replay: nothing captured");
  DeviceGuard g(m.device);
  check(cudaGraphLaunch(m.exec, stream(m.device)), "cuda::Graph::replay: cudaGraphLaunch");
}

void Graph::reset() {
  Impl& m = *impl_;
  if (m.capturing) {
    abort_capture();
    return;
  }
  if (!m.exec && !m.holds_pool) return;
  // Replays may still be reading the graph's memory and host buffers.
  synchronize(m.device);
  if (m.exec) cudaGraphExecDestroy(m.exec);
  if (m.graph) cudaGraphDestroy(m.graph);
  m.exec = nullptr;
  m.graph = nullptr;
  free_host_buffers(m.host_buffers);
  if (m.holds_pool) {
    m.holds_pool = false;
    memory::get_allocator(memory::Device::cuda(m.device)).release_pool(m.pool);
  }
}

void Graph::capture(const std::function<void()>& fn, int device, memory::MempoolId pool) {
  if (!impl_->capturing && !captured() && device >= 0 && device < memory::cuda_device_count()) {
    // As torch.cuda.graph does: the cache's free segments go back first, so that the pool the
    // capture fills is not reserved on top of them.
    synchronize(device);
    memory::empty_cache(memory::Device::cuda(device));
  }
  capture_begin(device, pool);
  try {
    fn();
  } catch (...) {
    abort_capture();
    throw;
  }
  capture_end();
}

bool is_capturing(int device) {
  if (g_open_count.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard lock(g_mu);
  return g_open.count(device) != 0;
}

const void* keep_for_replay(int device, const void* src, size_t bytes) {
  if (g_open_count.load(std::memory_order_relaxed) == 0 || !is_capturing(device)) return nullptr;
  // From the pinned caching allocator, so that the copy is counted and tagged like every other
  // byte (a captured copy's source table is scratch of the op that made it: workspace).
  void* p = nullptr;
  {
    const RelaxedCapture relaxed;
    const memory::CategoryScope cat(memory::Category::workspace);
    p = memory::get_pinned_allocator().allocate(bytes == 0 ? 1 : bytes);
  }
  std::memcpy(p, src, bytes);
  std::lock_guard lock(g_mu);
  auto it = g_open.find(device);
  if (it == g_open.end()) {  // the capture ended meanwhile (another thread): nothing keeps it
    const RelaxedCapture relaxed;
    memory::get_pinned_allocator().deallocate(p);
    return nullptr;
  }
  it->second->push_back(p);
  return p;
}

#else  // no CUDA: a graph can never be captured

void Graph::capture_begin(int device, memory::MempoolId) {
  throw std::invalid_argument(fmt::format(
      "cuda::Graph::capture_begin on cuda:{}: Tally was built without CUDA (TALLY_CUDA=OFF)",
      device));
}
void Graph::capture_end() {
  throw std::logic_error("cuda::Graph::capture_end: no capture is open on this graph");
}
void Graph::abort_capture() noexcept {}
void Graph::replay() {
  throw std::logic_error("cuda::Graph::replay: nothing captured");
}
void Graph::reset() {}
void Graph::capture(const std::function<void()>& fn, int device, memory::MempoolId pool) {
  capture_begin(device, pool);
  fn();
}
bool is_capturing(int) {
  return false;
}
const void* keep_for_replay(int, const void*, size_t) {
  return nullptr;
}

#endif

void check_not_capturing(int device, const char* what) {
  if (!is_capturing(device)) return;
  throw std::logic_error(fmt::format(
      "{}: not allowed inside a CUDA graph capture on cuda:{}. A replay repeats only the "
      "captured device work, so nothing that waits for the device (item(), a device-to-host "
      "copy, a GradScaler's found_inf check, an algorithm search on an op's first call: run "
      "the step once before capturing) and no random numbers (their offsets come from the "
      "host) can be captured",
      what, device));
}

}  // namespace tally::cuda
