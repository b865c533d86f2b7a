#include "memory/meta.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "base/checked.h"
#include "memory/cpu_provider.h"
#ifdef TALLY_WITH_CUDA
#include "memory/cuda_provider.h"
#endif

namespace tally::memory {

namespace {

// Addresses without memory: a bump pointer over a range nothing maps, shared by every meta
// device so that no two blocks of the process ever share an address. Addresses are never
// reused (the range holds 2^62 - 2^52 bytes of segments).
std::atomic<uint64_t> g_next_address{kMetaAddressBase};

class MetaProvider final : public MemoryProvider {
 public:
  MetaProvider(int index, MetaTarget target) : index_(index), target_(std::move(target)) {}

  void* allocate(size_t bytes) override {
    if (bytes > target_.capacity - std::min(used_, target_.capacity)) return nullptr;
    const size_t span = base::checked_round_up(bytes, kAlignment, "MetaProvider::allocate");
    used_ += bytes;
    return reinterpret_cast<void*>(g_next_address.fetch_add(span));
  }
  void deallocate(void* /*ptr*/, size_t bytes) override { used_ -= std::min(used_, bytes); }
  size_t total_memory() const override { return target_.capacity; }
  void set_capacity(size_t bytes) { target_.capacity = bytes; }
  size_t free_memory() const override {
    return target_.capacity - std::min(used_, target_.capacity);
  }
  // Events on the copy stream end with the copies queued before them (meta_copies_done);
  // every other stream's are done at once. Called under the allocator's lock.
  EventId record_event(StreamId stream) override {
    if (stream != kMetaCopyStream) return 0;
    events_[++last_event_] = meta_copies_done(Device::meta(index_));
    return last_event_;
  }
  bool query_event(EventId event) override {
    auto it = events_.find(event);
    return it == events_.end() || meta_host_seconds(Device::meta(index_)) >= it->second;
  }
  void destroy_event(EventId event) override { events_.erase(event); }
  void synchronize() override {
    const Device self = Device::meta(index_);
    const double all = std::max(meta_seconds(self), meta_copies_done(self));
    wait_meta_clock(self, all);
    sync_meta_host(self, all);
  }
  DeviceType device_type() const override { return DeviceType::meta; }
  int device_index() const override { return index_; }
  std::string device_name() const override {
    return fmt::format("meta:{} ({})", index_, target_.name);
  }
  // Expandable segments as the replayed device grows them: addresses from the same range,
  // pages counted against the capacity while mapped, so a dry run under
  // expandable_segments:True predicts the mapped (reserved) memory of the real run.
  std::unique_ptr<ExpandableSegment> create_expandable_segment(StreamId /*stream*/,
                                                               size_t page_size,
                                                               size_t pages) override {
    const size_t span = base::checked_round_up(
        base::checked_mul(page_size, pages, "MetaProvider::create_expandable_segment"), kAlignment,
        "MetaProvider::create_expandable_segment");
    return std::make_unique<Segment>(g_next_address.fetch_add(span), page_size, pages, *this);
  }

  static constexpr size_t kAlignment = 4096;

 private:
  class Segment final : public ExpandableSegment {
   public:
    Segment(uint64_t base, size_t page_size, size_t pages, MetaProvider& owner)
        : ExpandableSegment(base, page_size, pages), owner_(owner) {}
    ~Segment() override { owner_.used_ -= std::min(owner_.used_, mapped_); }
    bool map(size_t /*offset*/, size_t bytes) override {
      if (bytes > owner_.free_memory()) return false;
      owner_.used_ += bytes;
      mapped_ += bytes;
      return true;
    }
    void unmap(size_t /*offset*/, size_t bytes, size_t& done) override {
      owner_.used_ -= std::min(owner_.used_, bytes);
      mapped_ -= bytes;
      done = bytes;
    }

   private:
    MetaProvider& owner_;  // outlives its segments (the allocator owns both)
    size_t mapped_ = 0;
  };

  int index_;
  MetaTarget target_;
  size_t used_ = 0;  // under the allocator's lock
  // Copy-stream events: when each ends on the clock (under the allocator's lock).
  std::map<EventId, double> events_;
  EventId last_event_ = 0;
};

struct MetaDevices {
  std::mutex mu;
  std::deque<MetaTarget> targets;  // a deque: meta_target_of's references stay valid
  std::vector<std::unique_ptr<CachingAllocator>> allocators;
  std::deque<std::map<std::string, int64_t>> notes;  // note_unreplayed, by device
  std::deque<double> seconds;                        // add_meta_seconds, by device
  std::deque<double> copies_done;                    // queue_meta_copy, by device
  std::deque<double> host;                           // the host's clock, by device
};
MetaDevices& devices() {
  // Leaked on purpose, as the other allocators are: tensors may free during static destruction.
  static MetaDevices* d = new MetaDevices();
  return *d;
}

int add_locked(MetaDevices& d, const MetaTarget& target) {
  const int index = static_cast<int>(d.targets.size());
  d.targets.push_back(target);
  d.notes.emplace_back();
  d.seconds.push_back(0.0);
  d.copies_done.push_back(0.0);
  d.host.push_back(0.0);
  // TALLY_ALLOC_CONF's settings, as the device replayed would have them, except oom_snapshot:
  // that file is the real device's post-mortem, which a dry run that runs out (the planner's,
  // the out-of-memory report's) must not overwrite.
  AllocatorConfig config = AllocatorConfig::from_env();
  config.oom_snapshot_path.clear();
  d.allocators.push_back(std::make_unique<CachingAllocator>(
      std::make_unique<MetaProvider>(index, target), std::move(config)));
  return index;
}

// meta:0, replaying this machine's CPU backend, made on first use.
void ensure_default_locked(MetaDevices& d) {
  if (d.targets.empty()) add_locked(d, meta_target("cpu"));
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

size_t cublaslt_workspace_bytes_from_env() {
  if (const char* env = std::getenv("CUBLASLT_WORKSPACE_SIZE")) {
    char* end = nullptr;
    const unsigned long long kib = std::strtoull(env, &end, 10);
    if (end != env) return static_cast<size_t>(kib) * 1024;
  }
  return size_t{32} << 20;
}

std::vector<std::string> meta_target_names() {
  std::vector<std::string> names{"cpu", "h100", "h200"};
  if (cuda_available()) names.emplace_back("cuda");
  return names;
}

MetaTarget meta_target(std::string_view name) {
  const std::string n = lower(name);
  if (n == "cpu")
    return MetaTarget{.name = "cpu",
                      .description = "this machine's CPU backend",
                      .type = DeviceType::cpu,
                      .capacity = HostMemoryProvider::physical_memory()};
  // The GPUs whose tables are recorded, as cuda:0 reports them on the machines the benchmarks
  // run on (bench/RESULTS.md): cudaMemGetInfo's total and the multiprocessor count. The H100's
  // convolution workspaces are recorded, its rates are not (the planner ranks its plans with
  // the H200's, nn/plan.cpp).
  const auto recorded_gpu = [](const char* gpu, const char* description, size_t mib) {
    return MetaTarget{.name = gpu,
                      .description = description,
                      .type = DeviceType::cuda,
                      .capacity = mib * kMiB,
                      .sm_count = 132,
                      .matmul_workspace = cublaslt_workspace_bytes_from_env(),
                      .workspace_tables = gpu};
  };
  if (n == "h200") return recorded_gpu("h200", "NVIDIA H200 (143,771 MiB, 132 SMs)", 143771);
  if (n == "h100")
    return recorded_gpu("h100", "NVIDIA H100 80GB HBM3 (81,079 MiB, 132 SMs)", 81079);
#ifdef TALLY_WITH_CUDA
  if (n == "cuda" && cuda_available()) {
    // This machine's GPU: its capacity and multiprocessors; an H200 or an H100 also takes that
    // target's recorded tables (workspaces and, tensor/meta/cost.h, rates).
    CachingAllocator& a = get_allocator(Device::cuda(0));
    const std::string product = CudaProvider::product_name(0);
    MetaTarget t = product.find("H200") != std::string::npos ? meta_target("h200")
                   : product.find("H100") != std::string::npos
                       ? meta_target("h100")
                       : MetaTarget{.type = DeviceType::cuda,
                                    .matmul_workspace = cublaslt_workspace_bytes_from_env()};
    t.name = "cuda";
    t.description = fmt::format("{}, {}", a.provider().device_name(), product);
    t.capacity = a.provider().total_memory();
    t.sm_count = CudaProvider::multiprocessor_count(0);
    return t;
  }
#endif
  std::string known;
  for (const std::string& k : meta_target_names()) known += (known.empty() ? "" : ", ") + k;
  throw std::invalid_argument(
      fmt::format("unknown target device '{}' (known: {}{})", name, known,
                  n == "cuda" ? "; 'cuda' needs a GPU on this machine" : ""));
}

Device new_meta_device(const MetaTarget& target) {
  if (target.type == DeviceType::meta)
    throw std::invalid_argument(
        fmt::format("new_meta_device: target '{}' must replay cpu or cuda, not meta", target.name));
  if (target.capacity == 0)
    throw std::invalid_argument(
        fmt::format("new_meta_device: target '{}' has a capacity of 0 bytes", target.name));
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  ensure_default_locked(d);
  return Device::meta(add_locked(d, target));
}

void set_meta_host_memory(size_t bytes) {
  if (bytes == 0) bytes = HostMemoryProvider::physical_memory();
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  ensure_default_locked(d);
  d.targets[0].capacity = bytes;
  static_cast<MetaProvider&>(d.allocators[0]->provider()).set_capacity(bytes);
}

const MetaTarget& meta_target_of(Device device) {
  if (device.type != DeviceType::meta)
    throw std::invalid_argument(
        fmt::format("meta_target_of: {} is not a meta device", device.str()));
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  ensure_default_locked(d);
  if (device.index < 0 || static_cast<size_t>(device.index) >= d.targets.size())
    throw std::invalid_argument(
        fmt::format("no device {} ({} meta device(s) made)", device.str(), d.targets.size()));
  return d.targets[static_cast<size_t>(device.index)];
}

DeviceType behaves_as(Device device) {
  return device.type == DeviceType::meta ? meta_target_of(device).type : device.type;
}

void note_unreplayed(Device meta_device, const std::string& what) {
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  if (meta_device.type == DeviceType::meta && meta_device.index >= 0 &&
      static_cast<size_t>(meta_device.index) < d.notes.size())
    ++d.notes[static_cast<size_t>(meta_device.index)][what];
}

std::vector<std::pair<std::string, int64_t>> unreplayed(Device meta_device) {
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  if (meta_device.type != DeviceType::meta || meta_device.index < 0 ||
      static_cast<size_t>(meta_device.index) >= d.notes.size())
    return {};
  const auto& n = d.notes[static_cast<size_t>(meta_device.index)];
  return {n.begin(), n.end()};
}

namespace {
// Device `meta_device`'s slot of a per-device list, or null for any other device.
double* slot(std::deque<double>& list, Device meta_device) {
  if (meta_device.type != DeviceType::meta || meta_device.index < 0 ||
      static_cast<size_t>(meta_device.index) >= list.size())
    return nullptr;
  return &list[static_cast<size_t>(meta_device.index)];
}
}  // namespace

namespace {
// fn(compute stream's clock, host's clock) of `meta_device`, under the lock; nothing for any
// other device.
template <class Fn>
void update_clocks(Device meta_device, Fn&& fn) {
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  double* now = slot(d.seconds, meta_device);
  double* host = slot(d.host, meta_device);
  if (now && host) fn(*now, *host);
}
}  // namespace

void add_meta_seconds(Device meta_device, double seconds, double launch_seconds) {
  update_clocks(meta_device, [&](double& now, double& host) {
    now = std::max(now, host) + seconds;
    host += launch_seconds;
  });
}

namespace {
// One of a meta device's clocks (0 for any other device).
double read_clock(std::deque<double> MetaDevices::*clock, Device meta_device) {
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  const double* t = slot(d.*clock, meta_device);
  return t ? *t : 0;
}
}  // namespace

double meta_seconds(Device meta_device) {
  return read_clock(&MetaDevices::seconds, meta_device);
}

double meta_host_seconds(Device meta_device) {
  return read_clock(&MetaDevices::host, meta_device);
}

void rewind_meta_clocks(Device meta_device, double seconds, double host_seconds) {
  update_clocks(meta_device, [&](double& now, double& host) {
    now = std::min(now, seconds);
    host = std::min(host, host_seconds);
  });
}

double queue_meta_copy(Device meta_device, double seconds) {
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  double* done = slot(d.copies_done, meta_device);
  const double* now = slot(d.seconds, meta_device);
  if (!done || !now) return 0;
  *done = std::max(*done, *now) + seconds;
  return *done;
}

double meta_copies_done(Device meta_device) {
  return read_clock(&MetaDevices::copies_done, meta_device);
}

void wait_meta_clock(Device meta_device, double seconds) {
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  if (double* now = slot(d.seconds, meta_device)) *now = std::max(*now, seconds);
}

void sync_meta_host(Device meta_device, double seconds) {
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  if (double* host = slot(d.host, meta_device)) *host = std::max(*host, seconds);
}

CachingAllocator& meta_allocator(int index) {
  MetaDevices& d = devices();
  std::lock_guard lock(d.mu);
  ensure_default_locked(d);
  if (index < 0 || static_cast<size_t>(index) >= d.allocators.size())
    throw std::invalid_argument(fmt::format(
        "get_allocator: no device meta:{} ({} meta device(s) made)", index, d.allocators.size()));
  return *d.allocators[static_cast<size_t>(index)];
}

}  // namespace tally::memory
