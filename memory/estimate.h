// Predict a run's memory before running it: memory::estimate runs a function (a few
// training steps, say) on a fresh meta device (memory/meta.h), which replays a target
// device's backend and allocator with shapes and no data, and returns what a real run's
// allocator would report: peak allocated and reserved, the bytes of each category at the
// peak, and the activation bytes of each module at the peak. The meta device's allocator
// keeps its stats and history afterwards, so memory_summary(device), dump_snapshot(path,
// device) and the memory timeline work on the dry run as on a real one.
//
//   memory::Estimate e = memory::estimate([&](Device d) {
//     auto model = std::make_shared<nn::GPT>(cfg);
//     model->to(d);
//     ... two training steps on d ...
//   }, {.target = "h200"});
//   fmt::print("{}", e.report());
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "memory/category.h"
#include "memory/meta.h"
#include "memory/stats.h"

namespace tally::memory {

struct EstimateOptions {
  std::string target = "cpu";  // a meta_target() name: "cpu", "h200", "cuda"
  // The target itself, when set (a calibrated or edited one): `target` is then not looked up.
  std::optional<MetaTarget> spec = std::nullopt;
  size_t capacity = 0;  // the device memory to replay; 0: the target's
  // Trace entries the meta allocator keeps for snapshots and timelines (0: none).
  size_t max_history = 1'000'000;
  // The host memory the run will have (pinned optimizer state, offloaded activations); 0:
  // this machine's (MemTotal, host_memory_total()). A GPU target's host peak above it is a
  // plan that does not fit (Estimate::host_out_of_memory).
  size_t host_memory = 0;
};

struct ModuleBytes {
  std::string module;  // dotted module path ("" for allocations outside any module)
  int64_t bytes = 0;
};

// The peaks of one phase of a dry run (DryRun::phase): "setup", "train", "eval", ...
struct PhasePeak {
  std::string phase;
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
};

struct Estimate {
  MetaTarget target;
  Device device;  // the meta device the dry run used
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
  std::array<int64_t, kNumCategories> at_peak{};  // bytes per category at the allocated peak
  std::vector<ModuleBytes> activations_at_peak;   // activation bytes by module, largest first
  int64_t allocations = 0;                        // blocks handed out
  double seconds = 0;                             // the dry run's wall time
  // Set when the dry run ran out of the target's memory: the allocator's message. The peaks
  // are then those reached before the failing request.
  std::string out_of_memory;
  // What the dry run could not replay exactly, and how often (memory::note_unreplayed).
  std::vector<std::pair<std::string, int64_t>> unreplayed;
  // The host side: what the run holds in host memory (the pinned state of an offloaded
  // optimizer, optim/cpu_offload.h; offloaded activations). A GPU target's host is meta:0;
  // a CPU target's host is its device, and these repeat the device's figures.
  Device host;
  int64_t host_peak_allocated = 0;
  int64_t host_peak_reserved = 0;
  std::array<int64_t, kNumCategories> host_at_peak{};  // bytes per category at the host's peak
  size_t host_memory = 0;                              // what the host has
  // Set when the host's peak reserved exceeds host_memory: the figures, named.
  std::string host_out_of_memory;

  // The predicted time of the ops the dry run ran, by the cost model (tensor/meta/cost.h: a
  // recorded GPU's rates, or those the caller set on device(); 0 without rates).
  double predicted_seconds = 0;
  // Each phase's peaks, in order, when the run named its phases (DryRun::phase, dry_run_phase):
  // e.g. the training steps and the evaluation after them. Empty otherwise.
  std::vector<PhasePeak> phases;

  bool fits() const { return out_of_memory.empty() && host_out_of_memory.empty(); }
  // The report a user reads: target, peaks, the categories at the peak, the largest
  // activations by module.
  std::string report(size_t top_modules = 8) const;
};

// The dry run as an object, for programs whose training loop is not one function: make it,
// run the steps on device(), then finish(). estimate() is this around a function.
//
//   memory::DryRun dry({.target = "h200"});
//   ... build the model and train a few steps on dry.device() ...
//   fmt::print("{}", dry.finish().report());
class PeakTracker;
class DryRun {
 public:
  // std::invalid_argument for an unknown target, before anything is made.
  explicit DryRun(const EstimateOptions& options = {});
  ~DryRun();
  DryRun(const DryRun&) = delete;
  DryRun& operator=(const DryRun&) = delete;

  Device device() const { return device_; }
  // From now on the run is in phase `name` (the part before the first call is "setup"): the
  // estimate then names each phase's peaks (Estimate::phases).
  void phase(const std::string& name);
  // The figures of everything allocated on device() so far. `out_of_memory`: the message of
  // the OutOfMemoryError that stopped the run, if one did.
  Estimate finish(const std::string& out_of_memory = "");

 private:
  MetaTarget target_;
  Device device_;
  Device host_;
  size_t host_memory_ = 0;
  int64_t host_base_allocated_ = 0, host_base_reserved_ = 0;  // the host's bytes at the start
  std::array<int64_t, kNumCategories> host_base_{};
  std::unique_ptr<PeakTracker> tracker_;
  double start_ = 0;
  std::string phase_ = "setup";
  std::vector<PhasePeak> phases_;
  std::optional<DeviceStats> highest_;  // the stats of the phase with the highest peak so far
  void close_phase();
  // A GPU target's host (meta:0) is shared by every dry run, and a dry run inside this one (a
  // planner's candidate) resets its peaks: the host's stats at their highest before each reset.
  std::optional<DeviceStats> host_highest_;
  void keep_host_peak();
};

// DryRun::phase for the dry run whose device is `device` (code that has the device, not the
// DryRun); nothing for a device no dry run is running on (a real run).
void dry_run_phase(Device device, const std::string& name);

// Runs `run` on a fresh meta device replaying options.target. Exceptions from `run` other
// than running out of the target's memory propagate (an op without a meta kernel names
// itself); an unknown target or a capacity too small for anything is std::invalid_argument
// before anything runs.
Estimate estimate(const std::function<void(Device)>& run, const EstimateOptions& options = {});

// This machine's memory (MemTotal: sysconf's physical pages).
size_t host_memory_total();
// The host check of a plan: "" when `host_peak` bytes fit in `host_memory`, else an error
// naming both figures and what holds host memory.
std::string host_memory_error(int64_t host_peak, size_t host_memory);

// "6GiB", "900MiB", "512KiB", "1.5GB" (decimal units too) or plain bytes, as a byte count.
// std::invalid_argument naming `what` for anything else, a negative or non-finite size, or
// one past 2^63 bytes.
size_t parse_bytes(std::string_view text, std::string_view what = "size");

}  // namespace tally::memory
