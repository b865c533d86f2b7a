#include "nn/parameter_split.h"

#include <unordered_map>

#include "memory/memory.h"

namespace tally::nn {

memory::ParameterSplit parameter_split(const Module& model, std::optional<Device> device) {
  memory::ParameterSplit split;
  std::unordered_map<const void*, std::pair<int64_t, bool>> blocks;  // bytes, trainable
  for (const Tensor& p : model.parameters()) {
    if (!p.defined() || (device && p.device() != *device)) continue;
    const bool trainable = p.requires_grad();
    (trainable ? split.trainable : split.frozen) += p.numel();
    auto it =
        blocks
            .try_emplace(p.storage().data(), static_cast<int64_t>(p.storage().block_bytes()), false)
            .first;
    it->second.second = it->second.second || trainable;
  }
  for (const auto& entry : blocks) {
    const auto& block = entry.second;
    (block.second ? split.trainable_bytes : split.frozen_bytes) += block.first;
  }
  return split;
}

std::string memory_summary(const Module& model, Device device, bool abbreviated) {
  return memory::with_parameter_split(memory::memory_summary(device, abbreviated),
                                      parameter_split(model, device));
}

}  // namespace tally::nn
