// torch.profiler for Tally: op-level CPU and CUDA time and memory over a window of
// training steps, with a schedule, user ranges and module scopes.
//
//   using namespace tally::profiler;
//   ProfilerOptions opts;
//   opts.profile_memory = opts.record_shapes = true;
//   opts.schedule = schedule(/*wait=*/1, /*warmup=*/1, /*active=*/2);
//   opts.on_trace_ready = [](Profiler& p) { p.export_chrome_trace("step.trace.json"); };
//   Profiler prof(opts);
//   {
//     ProfilerGuard guard(prof);  // or prof.start() ... prof.stop()
//     for (...) { { record_function r("## Forward Pass ##"); ... } prof.step(); }
//   }
//   std::cout << prof.key_averages().table("self_cpu_time_total", 10);
// Use, what is recorded and exported: docs/notes.md §19.
#pragma once

#include <functional>
#include <memory>
#include <set>
#include <source_location>
#include <string>
#include <string_view>

#include "profiler/events.h"
#include "profiler/key_averages.h"

namespace tally::profiler {

enum class ProfilerActivity : uint8_t { cpu, cuda };

// What the profiler does during a step (torch.profiler.ProfilerAction).
enum class ProfilerAction : uint8_t { none, warmup, record, record_and_save };
const char* action_name(ProfilerAction a);

using Schedule = std::function<ProfilerAction(int step)>;

// torch.profiler.schedule: skip `skip_first` steps, then cycles of `wait` idle steps,
// `warmup` steps (tracing on, results dropped) and `active` recorded steps; `repeat`
// cycles (0 = until stop). Throws std::invalid_argument unless active > 0 and the rest >= 0.
Schedule schedule(int wait, int warmup, int active, int repeat = 0, int skip_first = 0);

class Profiler;

struct ProfilerOptions {
  std::set<ProfilerActivity> activities = {ProfilerActivity::cpu, ProfilerActivity::cuda};
  bool profile_memory = false;
  bool record_shapes = false;
  bool with_stack = false;
  Schedule schedule;  // empty: record everything from start() to stop()
  std::function<void(Profiler&)> on_trace_ready;
};

class Profiler {
 public:
  explicit Profiler(ProfilerOptions options = {});
  ~Profiler();  // stops if running (never throws)
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Only one profiler may run at a time; start() throws std::logic_error otherwise.
  void start();
  void stop();
  // Marks the end of a training step: advances the schedule.
  void step();
  int step_num() const { return step_num_; }
  ProfilerAction current_action() const { return action_; }
  bool running() const { return running_; }

  // The last completed recording window (after stop(), or inside on_trace_ready).
  // Throws std::logic_error when nothing has been recorded yet.
  const ProfileData& data() const;
  // PyTorch's events() grouped by name (and input shapes).
  EventList key_averages(bool group_by_input_shape = false) const;
  // Rows per module path instead of per op.
  EventList key_averages_by_module() const;

  void export_chrome_trace(const std::string& path) const;
  // `.json`: PyTorch's [times_us, sizes] layout (plus Tally's extra columns), `.html`:
  // self-contained page. `device` picks the allocator (default: cuda:0 when present, else
  // the device with the most traffic... i.e. cpu).
  void export_memory_timeline(const std::string& path) const;
  void export_memory_timeline(const std::string& path, memory::Device device) const;
  // The allocator's memory_viz snapshot (pickle) for the window (needs profile_memory).
  void export_memory_snapshot(const std::string& path) const;
  void export_memory_snapshot(const std::string& path, memory::Device device) const;

  const ProfilerOptions& options() const { return options_; }

 private:
  void begin_window(bool warmup);
  // `reopen`: another window begins right after this one (the GPU tracer stays attached).
  void end_window(bool save, bool reopen = false);
  void transition(ProfilerAction from, ProfilerAction to);
  memory::Device timeline_device() const;

  ProfilerOptions options_;
  bool running_ = false;
  bool collecting_ = false;
  int step_num_ = 0;
  ProfilerAction action_ = ProfilerAction::none;
  std::unique_ptr<ProfileData> last_;
  struct Session;
  std::unique_ptr<Session> session_;
};

// RAII window, as `with profile(...) as prof:`: starts `prof` now, stops it at scope exit
// (on_trace_ready runs then when the last step was active).
class ProfilerGuard {
 public:
  explicit ProfilerGuard(Profiler& prof) : prof_(prof) { prof_.start(); }
  ~ProfilerGuard() {
    try {
      prof_.stop();
    } catch (...) {
    }
  }
  ProfilerGuard(const ProfilerGuard&) = delete;
  ProfilerGuard& operator=(const ProfilerGuard&) = delete;

 private:
  Profiler& prof_;
};

// RAII user range (torch.profiler.record_function). Nothing is recorded when no profiler
// is collecting.
class record_function {
 public:
  explicit record_function(std::string_view name,
                           std::source_location loc = std::source_location::current());
  ~record_function();
  record_function(const record_function&) = delete;
  record_function& operator=(const record_function&) = delete;

 private:
  bool active_ = false;
  uint64_t generation_ = 0;
  uint32_t name_ = 0;
};

}  // namespace tally::profiler
