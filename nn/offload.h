// Activation offload for a model (--offload): the blocks the spec names run under SaveOnCpu
// (autograd/offload.h) with one shared ActivationOffloader, so each block is a group and
// backward prefetches the block it needs next while the current one runs.
#pragma once

#include <memory>
#include <string>

#include "autograd/offload.h"
#include "nn/module_select.h"

namespace tally::nn {

class Module;

// "none" | "activations" (every residual or transformer block, and what the model saves
// outside them: the stem, the head, the classifier) | "N-blocks" (the first N blocks in
// forward order, nothing outside them: the partial plans the memory planner searches) | a
// module policy for any model: "type:Block", "name:blocks.*", each optionally "/K"
// (nn/module_select.h).
struct OffloadSpec {
  enum class Kind { none, activations, blocks, modules };
  Kind kind = Kind::none;
  int blocks = 0;               // Kind::blocks
  ModuleSelector modules = {};  // Kind::modules
  std::string str() const;
  bool enabled() const { return kind != Kind::none; }
};
// Throws std::invalid_argument naming the accepted spellings.
OffloadSpec parse_offload_spec(const std::string& s);

// Applies `spec` to a ResNet, ResNetTiny or GPT (any model whose blocks declare
// Module::is_checkpoint_block) or the modules a module policy selects in any model, replacing
// what an earlier call set, and returns the
// offloader (null for "none"; its stats() say what moved). Combines with checkpointing: a
// checkpointed block then offloads the input it keeps.
std::shared_ptr<ActivationOffloader> offload_activations(Module& model, const OffloadSpec& spec,
                                                         OffloadOptions options = {});

}  // namespace tally::nn
