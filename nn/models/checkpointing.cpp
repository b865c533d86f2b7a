// --checkpoint for the models: parse the spec and mark the blocks (or set the segment count)
// of any model whose modules declare them (Module::is_checkpoint_block,
// Module::set_checkpoint_segments): ResNet, ResNetTiny and GPT do.
#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "base/enum_table.h"
#include "nn/checkpoint.h"
#include "nn/module.h"

namespace tally::nn {

std::string CheckpointSpec::str() const {
  if (kind == Kind::modules) return modules.str() + (selective ? "+selective" : "");
  if (kind == Kind::segments) return fmt::format("{}-segments", segments);
  if (kind == Kind::blocks && blocks > 0) return fmt::format("{}-blocks", blocks);
  static constexpr const char* kNames[] = {"none", "blocks", "segments", "selective"};
  return base::enum_table<Kind::selective>(kind, kNames, "none");
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
  if (is_module_selector(s)) {
    std::string_view body = s;
    if (body.ends_with("+selective")) {
      spec.selective = true;
      body.remove_suffix(std::string_view("+selective").size());
    }
    spec.kind = CheckpointSpec::Kind::modules;
    spec.modules = parse_module_selector(body, "--checkpoint");
    return spec;
  }
  // "N-segments" and "N-blocks": a count >= 1 and the suffix.
  for (const auto& [suffix, kind] :
       {std::pair{std::string("-segments"), CheckpointSpec::Kind::segments},
        std::pair{std::string("-blocks"), CheckpointSpec::Kind::blocks}}) {
    if (s.size() <= suffix.size() ||
        s.compare(s.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string n = s.substr(0, s.size() - suffix.size());
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(n, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == n.size() && v >= 1 && n.find_first_not_of("0123456789") == std::string::npos) {
      spec.kind = kind;
      (kind == CheckpointSpec::Kind::segments ? spec.segments : spec.blocks) = v;
      return spec;
    }
  }
  throw std::invalid_argument(fmt::format(
      "--checkpoint: expected none, blocks, N-blocks (e.g. 6-blocks), N-segments (e.g. "
      "4-segments), selective, type:TYPE or name:GLOB (optionally /K and +selective), got '{}'",
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
  if (spec.kind == Kind::modules) {
    const auto selected = spec.modules.select(model);
    if (selected.empty())
      throw std::invalid_argument(
          fmt::format("enable_checkpointing({}): no module of the model ({}) matches", spec.str(),
                      model.type_name()));
    for (auto& [name, m] : selected)
      m->set_checkpoint(true, spec.selective ? selective_policy() : CheckpointPolicy{});
    return;
  }
  if (spec.kind == Kind::blocks || spec.kind == Kind::selective) {
    int n = 0;
    for (auto& [name, m] : model.named_modules())
      if (m->is_checkpoint_block()) {
        if (spec.blocks == 0 || n < spec.blocks)
          m->set_checkpoint(true,
                            spec.kind == Kind::selective ? selective_policy() : CheckpointPolicy{});
        ++n;
      }
    if (n == 0)
      throw std::invalid_argument(fmt::format(
          "enable_checkpointing({}): the model ({}) has no residual or transformer blocks",
          spec.str(), model.type_name()));
    if (spec.blocks > n)
      throw std::invalid_argument(
          fmt::format("enable_checkpointing({}): the model ({}) has {} blocks", spec.str(),
                      model.type_name(), n));
    return;
  }
  // A segment holds at least one stage: the most a staged module's forward can cut is its
  // blocks (ResNet's residual blocks once N exceeds its layers, GPT's transformer blocks). More
  // segments than that would be cut down silently while the run reports N.
  int n = 0;
  for (auto& [name, m] : model.named_modules()) {
    if (!m->set_checkpoint_segments(0)) continue;
    const int stages = checkpoint_block_count(*m);
    if (stages > 0 && spec.segments > stages)
      throw std::invalid_argument(fmt::format(
          "enable_checkpointing({}): the model ({}) has {} stages (its blocks){}, so N-segments "
          "takes N from 1 to {}",
          spec.str(), model.type_name(), stages,
          name.empty() ? std::string() : fmt::format(" in '{}'", name), stages));
    m->set_checkpoint_segments(spec.segments);
    ++n;
  }
  if (n == 0)
    throw std::invalid_argument(
        fmt::format("enable_checkpointing({}): {} has no stage list to segment", spec.str(),
                    model.type_name()));
}

CheckpointSpec checkpoint_modules(ModulePredicate check_fn, std::string label, int every,
                                  bool selective) {
  if (!check_fn) throw std::invalid_argument("checkpoint_modules: check_fn is empty");
  CheckpointSpec spec;
  spec.kind = CheckpointSpec::Kind::modules;
  spec.modules.predicate = std::move(check_fn);
  spec.modules.label = std::move(label);
  spec.modules.every = every;
  spec.selective = selective;
  return spec;
}

int checkpoint_block_count(Module& model) {
  int n = 0;
  for (auto& [name, m] : model.named_modules())
    if (m->is_checkpoint_block()) ++n;
  return n;
}

}  // namespace tally::nn
