// memory_summary(): PyTorch's table layout (torch.cuda.memory_summary) followed by
// Tally's per-category table and the fragmentation line.
#pragma once

#include <string>

#include "memory/stats.h"

namespace tally::memory {

// `device_label` is e.g. "cuda:0" or "cpu"; `device_id` the ordinal in the title line.
std::string format_memory_summary(const DeviceStats& stats, int device_id,
                                  const std::string& device_label, bool abbreviated = false);

}  // namespace tally::memory
