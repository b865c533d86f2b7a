// What the causal language models (GPT, LlamaForCausalLM) share: forward(idx, targets) ->
// (logits, loss) called under the model's scope, the classifier and its loss over the final
// hidden states (plain, or fused and chunked: linear_cross_entropy), and their registry entry.
#pragma once

#include <cstdint>
#include <memory>
#include <source_location>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "nn/container.h"
#include "nn/layers.h"
#include "nn/models/registry.h"

namespace tally::nn {

class CausalLM : public Module {
 public:
  using Module::Module;
  // logits [B, T, vocab] and, when targets [B, T] (int64) are given, the mean cross-entropy
  // over the targets that are not -1 (undefined otherwise). With the config's
  // fused_classifier and targets: undefined logits and the loss from linear_cross_entropy, run
  // under lm_head's module scope (its allocations carry "lm_head").
  virtual std::pair<Tensor, Tensor> forward(const Tensor& idx, const Tensor& targets) = 0;
  std::pair<Tensor, Tensor> operator()(
      const Tensor& idx, const Tensor& targets = Tensor(),
      const std::source_location& site = std::source_location::current()) {
    return call([&] { return forward(idx, targets); }, site);
  }

  std::shared_ptr<Linear> lm_head;  // registered by the model, in its own order

 protected:
  // std::invalid_argument naming the model when targets are given and do not match idx.
  void check_targets(const Tensor& idx, const Tensor& targets) const;
  // The classifier over the final hidden states `x` [B, T, C] and the loss (as forward);
  // `fused`: with targets, linear_cross_entropy in chunks of `chunk_bytes` of logits.
  std::pair<Tensor, Tensor> classify(const Tensor& x, const Tensor& targets, bool fused,
                                     int64_t chunk_bytes);
};

// A pre-norm stack whose residual adds ride in the norms: each Block of `blocks` (can_defer(),
// forward_deferred(x, delta) -> {h, delta'}, GPT's Block and LLaMA's decoder layer) leaves its
// last add to the next block's first norm, and the last one to `final_norm`
// (forward_with_residual). Returns final_norm's output, or an undefined tensor when a block or
// final_norm may not defer (checkpointed or offloaded on its own): the caller runs the plain
// stack then. Each block runs under blocks' scope, so its allocations carry "h.0..." or
// "layers.0...", as in the plain loop.
template <class Block, class Norm>
Tensor forward_deferred_stack(ModuleList& blocks, Norm& final_norm, Tensor x) {
  if (final_norm.is_checkpointed() || final_norm.offloader()) return Tensor();
  std::vector<Block*> list;
  for (const auto& m : blocks) {
    auto* b = dynamic_cast<Block*>(m.get());
    if (!b || !b->can_defer()) return Tensor();
    list.push_back(b);
  }
  if (list.empty()) return Tensor();
  Tensor delta;
  for (Block* b : list)
    std::tie(x, delta) = blocks.call([&] { return b->forward_deferred(x, delta); });
  return final_norm.forward_with_residual(x, delta).second;
}

// The registry entry of a causal language model: `Model` built from Config::preset(name) (its
// fused_classifier from --fused-classifier), synthetic tokens below the preset's vocab_size,
// the loss from forward(idx, targets); `what` begins the description (set_presets), `context`
// is the preset's longest sequence.
template <class Model, class Config>
ModelEntry causal_lm_entry(std::string name, const std::string& what,
                           std::vector<std::string> presets, int64_t Config::*context) {
  ModelEntry e;
  e.name = std::move(name);
  set_presets(e, what, std::move(presets));
  e.input = ModelEntry::Input::tokens;
  e.context = [context](const std::string& p) { return Config::preset(p).*context; };
  e.build = [](const ModelOptions& o) -> std::shared_ptr<Module> {
    Config cfg = Config::preset(o.preset);
    cfg.fused_classifier = o.fused_classifier;
    return std::make_shared<Model>(cfg);
  };
  e.synthetic_batch = [](const ModelOptions& o, int64_t batch, int64_t step, uint64_t seed) {
    return synthetic_token_batch(Config::preset(o.preset).vocab_size, o, batch, step, seed);
  };
  e.loss = [](Module& m, const data::Example& b) {
    return dynamic_cast<CausalLM&>(m)(b.input, b.target).second;
  };
  return e;
}

}  // namespace tally::nn
