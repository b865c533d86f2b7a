#include "nn/offload.h"

#include <fmt/format.h>

#include <stdexcept>

#include "base/enum_table.h"
#include "nn/module.h"

namespace tally::nn {

std::string OffloadSpec::str() const {
  if (kind == Kind::modules) return modules.str();
  if (kind == Kind::blocks) return fmt::format("{}-blocks", blocks);
  static constexpr const char* kNames[] = {"none", "activations"};
  return base::enum_table<Kind::activations>(kind, kNames, "none");
}

OffloadSpec parse_offload_spec(const std::string& s) {
  OffloadSpec spec;
  if (s == "none" || s == "off" || s.empty()) return spec;
  if (s == "activations") {
    spec.kind = OffloadSpec::Kind::activations;
    return spec;
  }
  if (is_module_selector(s)) {
    spec.kind = OffloadSpec::Kind::modules;
    spec.modules = parse_module_selector(s, "--offload");
    return spec;
  }
  const std::string suffix = "-blocks";
  if (s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) {
    const std::string n = s.substr(0, s.size() - suffix.size());
    if (n.size() <= 6 && n.find_first_not_of("0123456789") == std::string::npos) {
      const int v = std::stoi(n);
      if (v >= 1) {
        spec.kind = OffloadSpec::Kind::blocks;
        spec.blocks = v;
        return spec;
      }
    }
  }
  throw std::invalid_argument(fmt::format(
      "--offload: expected none, activations, N-blocks (e.g. 6-blocks), type:TYPE or name:GLOB "
      "(optionally /K), got '{}'",
      s));
}

std::shared_ptr<ActivationOffloader> offload_activations(Module& model, const OffloadSpec& spec,
                                                         OffloadOptions options) {
  const auto modules = model.named_modules();
  for (auto& [name, m] : modules) m->set_offload(nullptr);
  if (!spec.enabled()) return nullptr;
  // Each block's saves are copied as the next block opens; the head's (the logits, which
  // backward needs first) stay on the device rather than going out and straight back.
  if (options.defer_groups < 0) options.defer_groups = 2;
  if (spec.kind == OffloadSpec::Kind::modules) {
    const auto selected = spec.modules.select(model);
    if (selected.empty())
      throw std::invalid_argument(
          fmt::format("offload_activations({}): no module of the model "
                      "({}) matches",
                      spec.str(), model.type_name()));
    auto offloader = ActivationOffloader::create(options);
    for (auto& [name, m] : selected) m->set_offload(offloader);
    return offloader;
  }
  int blocks = 0;
  for (auto& [name, m] : modules)
    if (m->is_checkpoint_block()) ++blocks;
  if (blocks == 0)
    throw std::invalid_argument(
        fmt::format("offload_activations({}): the model ({}) has no residual or transformer blocks",
                    spec.str(), model.type_name()));
  if (spec.kind == OffloadSpec::Kind::blocks && spec.blocks > blocks)
    throw std::invalid_argument(fmt::format("offload_activations({}): the model ({}) has {} blocks",
                                            spec.str(), model.type_name(), blocks));
  auto offloader = ActivationOffloader::create(options);
  if (spec.kind == OffloadSpec::Kind::activations) model.set_offload(offloader);
  int n = 0;
  for (auto& [name, m] : modules)
    if (m->is_checkpoint_block()) {
      if (spec.kind == OffloadSpec::Kind::activations || n < spec.blocks) m->set_offload(offloader);
      ++n;
    }
  return offloader;
}

}  // namespace tally::nn
