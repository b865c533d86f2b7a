// The A/B runner's outputs: the comparison table (stdout) and the self-contained HTML
// report (inline SVG drawn by an inline script from inline data; no network requests).
#pragma once

#include <string>
#include <vector>

#include "memory/estimate.h"
#include "memory/timeline.h"

namespace tally::examples {

struct ConfigResult {
  std::string name;  // "ckpt=blocks amp=bf16"
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
  memory::CategoryBytes at_peak{};  // bytes per category when allocated memory peaked
  double median_ms = 0;
  double final_loss = 0;
  memory::MemoryTimeline timeline;  // the last (recorded) step
  std::string snapshot_path, timeline_path;
  // The run was measured (false: --estimate, the figures above are the dry run's).
  bool measured = true;
  // The dry run's prediction of the same configuration (memory/estimate.h), when made.
  bool predicted = false;
  memory::Estimate estimate;
};

// One row per configuration; every column after the first also shows its change against
// the first configuration (the baseline) in bytes and percent.
std::string format_table(const std::vector<ConfigResult>& results);

// report.html: one chart per configuration (stacked bytes by category over the recorded
// step, phase bands, the forward staircase labelled by module), all on the same scale,
// then the table. Throws std::runtime_error naming the path when it cannot be written.
void write_report(const std::string& path, const std::string& title,
                  const std::vector<ConfigResult>& results);

// "layer2.1.conv1" -> "layer2.1", "transformer.h.3.attn.c_attn" -> "h.3", "fc" -> "fc".
std::string module_group(const std::string& path);

}  // namespace tally::examples
