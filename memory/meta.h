// The meta device: tensors with shapes, dtypes, strides and allocation tags but no data.
// Every op runs its meta kernel, which writes nothing and asks the caching allocator for
// exactly the outputs, temporaries and workspaces the replayed backend's kernel asks for.
// The allocator's policy is plain C++ over a MemoryProvider (memory/caching_allocator.h),
// so a meta device is one more allocator over a provider that hands out addresses without
// memory: a training step on it goes through the same allocations, in the same order, as
// on the device it replays, and the stats, history, snapshot and summary are the real ones.
//
// A meta device replays a target (MetaTarget): the backend whose kernels' scratch it
// mirrors (cpu or cuda) and the device's capacity, multiprocessor count and library
// workspace sizes, the numbers those kernels size their scratch by. meta:0 replays this
// machine's CPU backend; new_meta_device() makes one per dry run (memory/estimate.h).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "memory/memory.h"

namespace tally::memory {

struct MetaTarget {
  std::string name{};                 // "cpu", "h100", "h200", "cuda"
  std::string description{};          // "NVIDIA H200 (143,771 MiB, 132 SMs)"
  DeviceType type = DeviceType::cpu;  // the backend replayed: cpu or cuda
  size_t capacity = 0;                // the device's total memory in bytes
  int sm_count = 0;                   // cuda: multiprocessors (partial-sum buffers scale with it)
  size_t matmul_workspace = 0;        // cuda: cuBLASLt's workspace per product
  // cuda: the name of the recorded tables of this GPU to replay (cuDNN's convolution plans'
  // workspaces, tensor/conv/workspaces_<name>.inc; the cost model's rates,
  // tensor/meta/cost.h); empty when none was recorded for it.
  std::string workspace_tables{};
};

// The names meta_target() accepts: "cpu", "h100", "h200", and "cuda" where a GPU is present.
std::vector<std::string> meta_target_names();
// The target called `name` (case-insensitive). "cuda" reads this machine's cuda:0.
// std::invalid_argument naming the known targets for any other name.
MetaTarget meta_target(std::string_view name);

// A fresh meta device replaying `target`: its own caching allocator (TALLY_ALLOC_CONF's
// settings, the target's capacity), so its peak and history start at zero.
// std::invalid_argument for a target whose type is not cpu or cuda or whose capacity is 0.
Device new_meta_device(const MetaTarget& target);
// The memory of meta:0, the host every GPU target's dry run shares: `bytes`, or this machine's
// physical memory for 0. A dry run sets it from EstimateOptions::host_memory when that is
// larger, so that a run planned for a larger host (--host-memory) replays that host.
void set_meta_host_memory(size_t bytes);
// The target a meta device replays; std::invalid_argument for any other device or an
// unknown meta index.
const MetaTarget& meta_target_of(Device device);
// The backend whose kernels a device runs: its own type, or for a meta device the type of
// the target it replays. Ops that choose an algorithm by backend ask this, so a dry run
// takes the same path as the run it predicts.
DeviceType behaves_as(Device device);

// cuBLASLt's workspace per product as PyTorch sizes it: CUBLASLT_WORKSPACE_SIZE (KiB) when
// set, else 32 MiB (PyTorch's default on Hopper). The CUDA backend's default and the CUDA
// targets' `matmul_workspace`.
size_t cublaslt_workspace_bytes_from_env();

// What a dry run could not replay exactly, counted per meta device: a meta kernel that
// lacks a number it needs (a library workspace for shapes its target's table has no row
// for) notes it here instead of guessing silently; the estimate's report lists the notes.
void note_unreplayed(Device meta_device, const std::string& what);
std::vector<std::pair<std::string, int64_t>> unreplayed(Device meta_device);

// A meta device keeps three clocks, in seconds: its compute stream's (the predicted time of
// the ops run so far: each meta kernel adds its cost, tensor/meta/cost.h, starting no earlier
// than the host launched it), its copy stream's, and the host's (each kernel launch takes
// the target's launch overhead; the host runs ahead of the streams until it waits).
// A kernel of `seconds` launched now, its launch taking the host `launch_seconds`.
void add_meta_seconds(Device meta_device, double seconds, double launch_seconds);
// The compute stream's clock: the predicted time so far.
double meta_seconds(Device meta_device);
// The host's clock.
double meta_host_seconds(Device meta_device);
// Sets the compute stream's and the host's clocks back to `seconds` and `host_seconds`, read
// before work a dry run does but does not count (offload link's measuring forward, which a
// real run does once, not every step); copies must not have been queued since.
void rewind_meta_clocks(Device meta_device, double seconds, double host_seconds);

// The copy stream of a meta device that replays a GPU: activation offload's copies to and
// from pinned host memory run there one after another (at the cost model's host bandwidth), each
// starting once the ops issued before it and the copies queued before it are done. A block
// such a copy reads or writes is recorded on kMetaCopyStream (CachingAllocator::record_stream):
// freed, it is reused only once the copies queued before the free are done by the host's
// clock, when the allocator looks, so a dry run holds the blocks a real run holds while its
// copies drain and its host runs ahead.
inline constexpr StreamId kMetaCopyStream = 1;
// Queues a copy taking `seconds` on the copy stream; returns when it ends.
double queue_meta_copy(Device meta_device, double seconds);
// When the copies queued so far end.
double meta_copies_done(Device meta_device);
// The compute stream waits for `seconds` (a fence: cudaStreamWaitEvent).
void wait_meta_clock(Device meta_device, double seconds);
// The host waits for `seconds` (cudaEventSynchronize; a device synchronize waits for every
// stream).
void sync_meta_host(Device meta_device, double seconds);

// The caching allocator of meta device `index` (memory::get_allocator's meta case).
CachingAllocator& meta_allocator(int index);

// Where meta storage lives: addresses no process can map on x86-64 with 4-level paging
// (past the 47-bit user space), so a kernel that dereferences one faults at once instead
// of reading another allocation.
inline constexpr uint64_t kMetaAddressBase = uint64_t{1} << 52;

}  // namespace tally::memory
