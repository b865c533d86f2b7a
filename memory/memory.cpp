#include "memory/memory.h"

#include <fmt/format.h>

#include <mutex>
#include <stdexcept>
#include <vector>

#include "memory/cpu_provider.h"
#include "memory/host_memory.h"
#include "memory/meta.h"
#include "memory/snapshot.h"
#ifdef TALLY_WITH_CUDA
#include "memory/cuda_pinned_provider.h"
#include "memory/cuda_provider.h"
#endif

namespace tally::memory {

std::string Device::str() const {
  switch (type) {
    case DeviceType::cpu:
      return "cpu";
    case DeviceType::cuda:
      return fmt::format("cuda:{}", index);
    case DeviceType::meta:
      return fmt::format("meta:{}", index);
  }
  return "unknown";
}

int cuda_device_count() {
#ifdef TALLY_WITH_CUDA
  return CudaProvider::device_count();
#else
  return 0;
#endif
}

bool cuda_available() {
  return cuda_device_count() > 0;
}

Device default_device() {
  return cuda_available() ? Device::cuda(0) : Device::cpu();
}

namespace {
struct Registry {
  std::mutex mu;
  std::unique_ptr<CachingAllocator> cpu;
  std::unique_ptr<CachingAllocator> pinned;
  std::vector<std::unique_ptr<CachingAllocator>> cuda;
};
Registry& registry() {
  // Leaked on purpose: tensors destroyed during static destruction may still free.
  static Registry* r = new Registry();
  return *r;
}
}  // namespace

thread_local CachingAllocator* tls_private_cpu = nullptr;

PrivateCpuAllocatorScope::PrivateCpuAllocatorScope()
    : allocator_(std::make_unique<CachingAllocator>(std::make_unique<CpuProvider>())) {
  if (tls_private_cpu) throw std::logic_error("PrivateCpuAllocatorScope: scopes do not nest");
  tls_private_cpu = allocator_.get();
}
PrivateCpuAllocatorScope::~PrivateCpuAllocatorScope() {
  tls_private_cpu = nullptr;
  allocator_->empty_cache();
}

CachingAllocator& get_allocator(Device device) {
  if (device.type == DeviceType::meta) return meta_allocator(device.index);
  if (device.type == DeviceType::cpu && tls_private_cpu) return *tls_private_cpu;
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  if (device.type == DeviceType::cpu) {
    if (!r.cpu) r.cpu = std::make_unique<CachingAllocator>(std::make_unique<CpuProvider>());
    return *r.cpu;
  }
  const int n = cuda_device_count();
  if (device.index < 0 || device.index >= n)
    throw std::invalid_argument(
        fmt::format("get_allocator: no device {} ({} CUDA device(s))", device.str(), n));
#ifdef TALLY_WITH_CUDA
  if (r.cuda.size() < static_cast<size_t>(n)) r.cuda.resize(static_cast<size_t>(n));
  auto& slot = r.cuda[static_cast<size_t>(device.index)];
  if (!slot)
    slot = std::make_unique<CachingAllocator>(std::make_unique<CudaProvider>(device.index));
  return *slot;
#else
  throw std::invalid_argument("get_allocator: Tally was built without CUDA");
#endif
}

bool pinned_memory_available() {
  return cuda_available();
}

CachingAllocator& get_pinned_allocator() {
  if (!pinned_memory_available()) return get_allocator(Device::cpu());
#ifdef TALLY_WITH_CUDA
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  if (!r.pinned) {
    // expandable_segments is the device allocator's setting (PyTorch's pinned host allocator
    // ignores it too): pinned buffers are cudaHostAlloc'd segments.
    AllocatorConfig config = AllocatorConfig::from_env();
    config.expandable_segments = false;
    r.pinned = std::make_unique<CachingAllocator>(std::make_unique<CudaPinnedProvider>(),
                                                  std::move(config));
  }
  return *r.pinned;
#else
  return get_allocator(Device::cpu());
#endif
}

size_t memory_allocated(Device d) {
  return get_allocator(d).memory_allocated();
}
size_t max_memory_allocated(Device d) {
  return get_allocator(d).max_memory_allocated();
}
size_t memory_reserved(Device d) {
  return get_allocator(d).memory_reserved();
}
size_t max_memory_reserved(Device d) {
  return get_allocator(d).max_memory_reserved();
}
void reset_peak_memory_stats(Device d) {
  get_allocator(d).reset_peak_memory_stats();
}
void synchronize(Device device) {
  if (device.type != DeviceType::cuda) return;
  get_allocator(device).provider().synchronize();
}

void empty_cache(Device d) {
  get_allocator(d).empty_cache();
}
void set_per_process_memory_fraction(double f, Device d) {
  get_allocator(d).set_memory_fraction(f);
}
std::map<std::string, int64_t> memory_stats(Device d) {
  return get_allocator(d).memory_stats();
}
std::string memory_summary(Device d, bool abbreviated) {
  std::string s = get_allocator(d).memory_summary(abbreviated);
  // The host side (an offloaded optimizer's state, offloaded activations), when it holds any.
  if (CachingAllocator* host = host_allocator(d); host && host->memory_reserved() > 0)
    s += fmt::format("\nHost memory of {} ({}):\n{}", d.str(), host->provider().device_name(),
                     host->memory_summary(abbreviated));
  return s;
}

CachingAllocator* host_allocator(Device d) {
  if (d.type == DeviceType::cuda)
    return pinned_memory_available() ? &get_pinned_allocator() : nullptr;
  if (d.is_meta() && d.index != 0 && behaves_as(d) == DeviceType::cuda)
    return &get_allocator(Device::meta(0));
  return nullptr;
}

void record_memory_history(bool enabled, size_t max_entries, Device d) {
  get_allocator(d).record_memory_history(enabled, max_entries);
}

void record_pinned_host_memory(bool enabled, size_t max_entries, Device d) {
  if (CachingAllocator* host = host_allocator(d)) host->record_memory_history(enabled, max_entries);
}

void dump_snapshot(const std::string& path, Device d) {
  CachingAllocator& a = get_allocator(d);
  CachingAllocator* host = host_allocator(d);
  if (host == nullptr || !host->history_enabled()) return a.dump_snapshot(path);
  const SnapshotData host_snap = host->snapshot();
  write_snapshot_file(a.snapshot(), &host_snap, path);
}

}  // namespace tally::memory
