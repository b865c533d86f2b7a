// The speed of the link between a device and its host memory (pinned device-to-host copies:
// what activation offload moves), measured once per machine and cached per device name, so
// that an offload policy (nn/offload.h, `--offload link`) knows how much the link can carry
// while the forward computes.
//
// The cache is a small JSON file, $XDG_CACHE_HOME/tally/host_link.json (else
// ~/.cache/tally/host_link.json), written atomically (base/atomic_file.h):
//   {"host_link_bytes_per_second": {"NVIDIA H100 80GB HBM3": 5.31e10}}
#pragma once

#include <map>
#include <string>

#include "tensor/tensor.h"

namespace tally::ops {

// Bytes per second of a copy from `device` to its host memory:
// - CUDA: a timed pinned device-to-host copy of 256 MiB on the copy stream, best of 3, made
//   on first use and cached under the GPU's name (host_link_cache_path);
// - CPU: a memcpy of 4 MiB within host memory, best of 3, once per process;
// - meta (dry runs): the target's figure in the cost model (meta::Rates::host_bandwidth, e.g.
//   the H200's), or for a target replaying the CPU its copy bandwidth.
// Throws std::runtime_error naming the cache file when it exists and cannot be read.
double host_link_bandwidth(Device device);

// The cache file's path: $XDG_CACHE_HOME/tally/host_link.json, else $HOME/.cache/tally/...;
// empty when neither variable is set (nothing is cached then).
std::string host_link_cache_path();
// The cache's entries (device name -> bytes/s); empty for a file that does not exist. Throws
// std::runtime_error naming `path` and, for text that is not JSON, the byte offset of the
// error; naming the entry for a value that is not a positive number.
std::map<std::string, double> read_host_link_cache(const std::string& path);
// Writes `entries` to `path` atomically, creating its folder.
void write_host_link_cache(const std::string& path, const std::map<std::string, double>& entries);

}  // namespace tally::ops
