// The host side of a device's memory: where an offloaded optimizer's state
// (optim/cpu_offload.h) and offloaded activations live. For a CUDA device it is the pinned
// allocator; for a meta device replaying a GPU, meta:0 (the host of every dry run); the CPU's
// host memory is its device memory. PyTorch's record_pinned_host_memory=True: the host
// allocator records its history, and a snapshot of the device carries the host's segments and
// trace as `host_segments` and `host_traces` (docs/memory-formats.md §1.2); memory_summary of
// the device appends the host's table.
#pragma once

#include <cstddef>
#include <string>

#include "memory/memory.h"
#include "memory/snapshot.h"

namespace tally::memory {

// The allocator of `device`'s host memory when it is not `device`'s own, else nullptr.
CachingAllocator* host_allocator(Device device);

// PyTorch's _record_memory_history(..., record_pinned_host_memory=True) for `device`: its host
// allocator (host_allocator) records its history too (or stops, with enabled false), so that
// dump_snapshot(path, device) writes it beside the device's.
void record_pinned_host_memory(bool enabled, size_t max_entries = 100000,
                               Device device = default_device());

// write_snapshot_file with the host's segments and trace (`host`, a snapshot of the host
// allocator) written as `host_segments` and `host_traces`; without `host`, as the plain one.
void write_snapshot_file(const SnapshotData& snap, const SnapshotData* host,
                         const std::string& path);

}  // namespace tally::memory
