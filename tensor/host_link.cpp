#include "tensor/host_link.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "base/atomic_file.h"
#include "memory/memory.h"
#include "memory/meta.h"
#include "tensor/elementwise/ops.h"
#include "tensor/meta/cost.h"
#include "tensor/pinned.h"
#ifdef TALLY_WITH_CUDA
#include "memory/cuda_provider.h"
#endif

namespace tally::ops {
namespace {

constexpr const char* kKey = "host_link_bytes_per_second";

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// memcpy within host memory: 4 MiB, best of 3 (the first touches the pages; larger buffers
// cost more in page faults than the figure gains: offload on the CPU copies within host memory).
double measure_memcpy() {
  constexpr size_t kBytes = size_t{4} << 20;
  std::vector<char> a(kBytes, 1), b(kBytes, 0);
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), kBytes);
    const double s = seconds_since(t0);
    if (s > 0) best = std::max(best, static_cast<double>(kBytes) / s);
    a[static_cast<size_t>(i)] = b[kBytes - 1];  // keep the copies observable
  }
  return best;
}

#ifdef TALLY_WITH_CUDA
// A pinned device-to-host copy of 256 MiB on the copy stream, best of 3, the device idle.
double measure_cuda(Device device) {
  constexpr int64_t kBytes = int64_t{256} << 20;
  memory::CategoryScope cat(memory::Category::temporary);
  double best = 0;
  {
    const Tensor dev = empty({kBytes}, DType::uint8, device);
    const Tensor host = empty_pinned({kBytes}, DType::uint8);
    memory::synchronize(device);
    for (int i = 0; i < 3; ++i) {
      const auto t0 = Clock::now();
      copy_on_copy_stream_(host, dev);
      CopyFence::record(device).synchronize();
      const double s = seconds_since(t0);
      if (s > 0) best = std::max(best, static_cast<double>(kBytes) / s);
    }
  }
  // The 256 MiB block is not kept in the device's cache.
  memory::empty_cache(device);
  return best;
}
#endif

}  // namespace

std::string host_link_cache_path() {
  namespace fs = std::filesystem;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0')
    return (fs::path(x) / "tally" / "host_link.json").string();
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0')
    return (fs::path(h) / ".cache" / "tally" / "host_link.json").string();
  return {};
}

std::map<std::string, double> read_host_link_cache(const std::string& path) {
  std::map<std::string, double> out;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (!std::filesystem::exists(path)) return out;
    throw std::runtime_error(fmt::format("host link cache '{}': cannot be read", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {
    throw std::runtime_error(
        fmt::format("host link cache '{}': not JSON at byte {} (delete the file to measure again)",
                    path, e.byte));
  }
  if (!doc.is_object() || !doc.contains(kKey) || !doc[kKey].is_object())
    throw std::runtime_error(
        fmt::format("host link cache '{}': expected an object with \"{}\" (delete the file to "
                    "measure again)",
                    path, kKey));
  for (const auto& [name, v] : doc[kKey].items()) {
    if (!v.is_number() || !(v.get<double>() > 0))
      throw std::runtime_error(
          fmt::format("host link cache '{}': \"{}\" is {}, expected a positive number of "
                      "bytes/s (delete the file to measure again)",
                      path, name, v.dump()));
    out[name] = v.get<double>();
  }
  return out;
}

void write_host_link_cache(const std::string& path, const std::map<std::string, double>& entries) {
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  nlohmann::json doc;
  doc[kKey] = nlohmann::json::object();
  for (const auto& [name, v] : entries) doc[kKey][name] = v;
  base::write_file_atomic(path, doc.dump(1) + "\n", "host_link_bandwidth");
}

double host_link_bandwidth(Device device) {
  if (device.is_meta()) {
    const meta::Rates r = meta::rates_of(device);
    if (r.host_bandwidth > 0) return r.host_bandwidth;
    if (r.bandwidth > 0) return r.bandwidth;  // a calibrated CPU target's copy bandwidth
    return host_link_bandwidth(Device::cpu());
  }
  static std::mutex mu;
  std::lock_guard lock(mu);
  if (device.type == DeviceType::cpu) {
    static const double cpu = measure_memcpy();
    return cpu;
  }
#ifdef TALLY_WITH_CUDA
  static std::map<int, double> measured;  // per process, by device index
  if (auto it = measured.find(device.index); it != measured.end()) return it->second;
  const std::string name = memory::CudaProvider::product_name(device.index);
  const std::string path = host_link_cache_path();
  std::map<std::string, double> cache;
  if (!path.empty()) cache = read_host_link_cache(path);
  double bw = 0;
  if (auto it = cache.find(name); it != cache.end()) {
    bw = it->second;
  } else {
    bw = measure_cuda(device);
    if (!path.empty() && bw > 0) {
      cache = read_host_link_cache(path);  // another process may have written meanwhile
      cache[name] = bw;
      write_host_link_cache(path, cache);
    }
  }
  measured[device.index] = bw;
  return bw;
#else
  throw std::invalid_argument(
      fmt::format("host_link_bandwidth: no link to measure for {}", device.str()));
#endif
}

}  // namespace tally::ops
