// The A/B runner's outputs (ab/ab.h): the comparison table (stdout), the headline of each
// configuration against the first, and the self-contained HTML report (inline SVG drawn by an
// inline script from inline data, through inspect/svg_chart.h's renderer and palette; no network
// requests).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "memory/context.h"
#include "memory/estimate.h"
#include "memory/history.h"
#include "memory/parameter_split.h"
#include "memory/timeline.h"

namespace tally::ab {

// A run of one phase over the recorded step, in ms from the step's first sample.
struct PhaseRun {
  std::string name;
  double start_ms = 0, end_ms = 0;
};

struct ConfigResult {
  std::string name;  // "ckpt=blocks amp=bf16"
  // The configuration's value on each axis, in order: {"ckpt", "blocks"}, {"amp", "bf16"},
  // {"offload", "none"}, {"opt", "sgd"}, {"sib", "off"}. The headlines describe the axes on
  // which a configuration differs from the first.
  std::vector<std::pair<std::string, std::string>> settings;
  std::string device;  // where it ran ("cpu", "cuda:0"); a dry run (--estimate): its target
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
  memory::CategoryBytes at_peak{};  // bytes per category when allocated memory peaked
  // The host side's peaks (a :cpu optimizer's pinned state, offloaded activations): the pinned
  // allocator's for a CUDA run, the dry run's host for a GPU target; 0 where the host is the
  // device (the CPU).
  int64_t host_peak_allocated = 0;
  int64_t host_peak_reserved = 0;
  // The model's parameters, trainable and frozen (requires_grad), when it was built
  // (nn::parameter_split): the table and the report split `parameter` when any is frozen.
  memory::ParameterSplit parameters;
  // The step time: the median over the timing rounds (ab::Options::rounds) of each round's
  // median warm step, and the rounds' range (min_ms..max_ms); without rounds, the recorded
  // run's median step.
  double median_ms = 0;
  double min_ms = std::numeric_limits<double>::quiet_NaN();
  double max_ms = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> round_ms;  // each round's figure, in order
  double final_loss = 0;
  // Steps the fp16 GradScaler skipped (inf/NaN gradients: no optimizer step). A dry run has
  // no values and takes every step as finite, so its allocations match a run without skips.
  int64_t skipped_steps = 0;
  memory::MemoryTimeline timeline;  // the last (recorded) step
  std::vector<PhaseRun> phases;     // that step's phases (PhaseRecorder)
  // The peak allocated bytes within each phase of that step, in order (forward.0, backward.0,
  // forward.1, ... with gradient accumulation; eval with an eval function).
  std::vector<std::pair<std::string, int64_t>> phase_peaks;
  // The files written for it (snapshot, timeline JSON and HTML, the diff against the first
  // configuration); the report links those that exist.
  std::string snapshot_path, timeline_path, timeline_html_path, diff_path;
  // The run was measured (false: --estimate, the figures above are the dry run's).
  bool measured = true;
  // The dry run's prediction of the same configuration (memory/estimate.h), when made.
  bool predicted = false;
  memory::Estimate estimate;
  // The cost model's time per step of the dry run (NaN: no model for the target).
  double predicted_step_ms = std::numeric_limits<double>::quiet_NaN();
};

// One row per configuration; every column after the first also shows its change against
// the first configuration (the baseline) in bytes and percent.
std::string format_table(const std::vector<ConfigResult>& results);

// What configuration i changes against the first, in words: "4-segment checkpointing",
// "per-block checkpointing + bf16 autocast", "8-bit AdamW" (its name when nothing differs).
std::string describe_change(const std::vector<ConfigResult>& results, size_t i);

// The headline of configuration i >= 1 against the first: "4-segment checkpointing: peak
// allocated −38% (−2,084 MiB), reserved −30% (−1,600 MiB), step +19% (rounds' spread 0.52 ms)"
// (step: the median step
// time, or the cost model's "predicted step" for a dry run, left out when there is none; when
// the difference is within the timing rounds' spread, "step within noise (difference 0.31 ms,
// rounds' spread 1.20 ms)" instead of a percentage). Percentages have no decimals from 1% up
// and one below ("−0.4%", "±0%"); bytes are MiB with no decimals from 100 MiB up (thousands
// separated), one from 1 MiB, else KiB with none (no change: "±0 MiB"). The minus sign is
// U+2212.
std::string headline(const std::vector<ConfigResult>& results, size_t i);

// A sentence saying why a measured CPU run under 16-bit autocast is slower, or "" when no
// configuration is one.
std::string cpu_autocast_caveat(const std::vector<ConfigResult>& results);

// Records the phases (memory::PhaseScope) opened on the thread that made it, at every
// nesting level (forward, backward, optimizer; recompute inside backward), with their times,
// through memory::ContextObserver (an observer installed before it, the profiler's, is not told
// while it lives, and is restored when it goes).
class PhaseRecorder : public memory::ContextObserver {
 public:
  PhaseRecorder();
  ~PhaseRecorder() override;
  PhaseRecorder(const PhaseRecorder&) = delete;
  PhaseRecorder& operator=(const PhaseRecorder&) = delete;
  // The spans in order of their start, in ms from t0_us (from 0 at the earliest).
  std::vector<PhaseRun> runs(int64_t t0_us) const;

  void on_module_enter(memory::StrId) override {}
  void on_module_exit(memory::StrId) override {}
  void on_phase_enter(memory::StrId phase) override;
  void on_phase_exit(memory::StrId phase) override;

 private:
  struct Span {
    memory::StrId phase;
    int64_t start_us, end_us;
  };
  memory::ContextObserver* previous_;
  std::thread::id thread_;
  std::vector<Span> spans_;
  std::vector<size_t> open_;  // indices into spans_ of the phases open now
};

// report.html: the headlines, a peak-versus-step-time chart of every configuration, one
// timeline chart per configuration (stacked bytes by category over the recorded step, one
// band per phase, the forward staircase labelled by module, round ticks on both axes, hover
// values) on the same scale with links to its files, then the table, transposed (one column
// per configuration, split into several tables when it is wider than the page). Throws
// std::runtime_error naming the path when it cannot be written.
void write_report(const std::string& path, const std::string& title,
                  const std::vector<ConfigResult>& results);

// "layer2.1.conv1" -> "layer2.1", "transformer.h.3.attn.c_attn" -> "h.3", "fc" -> "fc".
std::string module_group(const std::string& path);

}  // namespace tally::ab
