// A model's parameters split into trainable and frozen, in memory_summary's table (the split
// itself is nn::parameter_split's: the allocator knows categories, not requires_grad).
#pragma once

#include <cstdint>
#include <string>

namespace tally::memory {

// A model's parameters split by requires_grad (nn::parameter_split): a LoRA fine-tune's frozen
// base against its trainable adapters. The allocator knows categories, not requires_grad: both
// are `parameter` in its stats and snapshots.
struct ParameterSplit {
  int64_t trainable = 0, frozen = 0;              // elements
  int64_t trainable_bytes = 0, frozen_bytes = 0;  // their blocks' bytes, as the allocator counts
};

// `summary` (format_memory_summary's) with two rows under its `parameter` row: the trainable
// and the frozen parameters' current bytes and element counts.
std::string with_parameter_split(const std::string& summary, const ParameterSplit& split);

}  // namespace tally::memory
