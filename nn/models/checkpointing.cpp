// --checkpoint for the models: parse the spec and mark the blocks (or set the segment count)
// of any model whose modules declare them (Module::is_checkpoint_block,
// Module::set_checkpoint_segments): ResNet, ResNetTiny and GPT do.
#include <fmt/format.h>

#include <stdexcept>

#include "memory/enum_table.h"
#include "nn/checkpoint.h"
#include "nn/module.h"

namespace tally::nn {

std::string CheckpointSpec::str() const {
  if (kind == Kind::segments) return fmt::format("{}-segments", segments);
  static constexpr const char* kNames[] = {"none", "blocks", "segments", "selective"};
  return memory::enum_table<Kind::selective>(kind, kNames, "none");
}

CheckpointSpec parse_checkpoint_spec(const std::string& s) {
  CheckpointSpec spec;
  if (s == "none" || s == "off" || s.empty()) return spec;
  if (s == "blocks") {
    spec.kind = CheckpointSpec::Kind::blocks;
    return spec;
  }
  if (s == "selective") {
    spec.kind = CheckpointSpec::Kind::selective;
    return spec;
  }
  const std::string suffix = "-segments";
  if (s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) {
    const std::string n = s.substr(0, s.size() - suffix.size());
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(n, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == n.size() && v >= 1) {
      spec.kind = CheckpointSpec::Kind::segments;
      spec.segments = v;
      return spec;
    }
  }
  throw std::invalid_argument(fmt::format(
      "--checkpoint: expected none, blocks, N-segments (e.g. 4-segments) or selective, got '{}'",
      s));
}

CheckpointPolicy selective_policy() {
  return save_ops({"linear", "matmul", "mm", "bmm", "conv2d", "scaled_dot_product_attention",
                   "flash_attention_forward"});
}

void enable_checkpointing(Module& model, const CheckpointSpec& spec) {
  // Reset what an earlier call set.
  for (auto& [name, m] : model.named_modules()) {
    if (m->is_checkpointed()) m->set_checkpoint(false);
    m->set_checkpoint_segments(0);
  }
  using Kind = CheckpointSpec::Kind;
  if (spec.kind == Kind::none) return;
  if (spec.kind == Kind::blocks || spec.kind == Kind::selective) {
    int n = 0;
    for (auto& [name, m] : model.named_modules())
      if (m->is_checkpoint_block()) {
        m->set_checkpoint(true,
                          spec.kind == Kind::selective ? selective_policy() : CheckpointPolicy{});
        ++n;
      }
    if (n == 0)
      throw std::invalid_argument(fmt::format(
          "enable_checkpointing({}): the model ({}) has no residual or transformer blocks",
          spec.str(), model.type_name()));
    return;
  }
  int n = 0;
  for (auto& [name, m] : model.named_modules())
    if (m->set_checkpoint_segments(spec.segments)) ++n;
  if (n == 0)
    throw std::invalid_argument(
        fmt::format("enable_checkpointing({}): {} has no stage list to segment", spec.str(),
                    model.type_name()));
}

}  // namespace tally::nn
