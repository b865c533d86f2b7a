// A model's parameters split into trainable and frozen (requires_grad), for memory_summary
// and the A/B report: a LoRA fine-tune's frozen base against its adapters (issue 50).
#pragma once

#include <optional>
#include <string>

#include "memory/parameter_split.h"
#include "nn/module.h"

namespace tally::nn {

// Elements and block bytes of `model`'s parameters (on `device` only, when given), split by
// requires_grad. A storage that several parameters share (tied weights, views of one flat
// buffer) counts its bytes once, as trainable when any of them is.
memory::ParameterSplit parameter_split(const Module& model,
                                       std::optional<Device> device = std::nullopt);

// memory::memory_summary(device, abbreviated) with its `parameter` row split into `model`'s
// trainable and frozen parameters (memory::with_parameter_split).
std::string memory_summary(const Module& model, Device device, bool abbreviated = false);

}  // namespace tally::nn
