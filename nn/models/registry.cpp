#include "nn/models/registry.h"

#include <fmt/format.h>

#include <numeric>
#include <stdexcept>

#include "nn/data/synthetic.h"
#include "nn/models/bert.h"
#include "nn/models/gpt.h"
#include "nn/models/llama.h"
#include "nn/models/lstm.h"
#include "nn/models/resnet.h"
#include "nn/models/unet.h"
#include "nn/models/vit.h"
#include "tensor/softmax/autograd.h"

namespace tally::nn {
namespace {

std::vector<int64_t> batch_indices(int64_t batch, int64_t step) {
  std::vector<int64_t> idx(static_cast<size_t>(batch));
  std::iota(idx.begin(), idx.end(), step * batch);
  return idx;
}

ModelEntry resnet_entry() {
  ModelEntry e;
  e.name = "resnet";
  set_presets(e, "torchvision's ResNet", {"tiny", "resnet18", "resnet34", "resnet50", "resnet101"});
  e.input = ModelEntry::Input::images;
  e.build = [](const ModelOptions& o) {
    return resnet_by_name(o.preset, {.num_classes = o.num_classes, .in_channels = o.in_channels});
  };
  e.synthetic_batch = [](const ModelOptions& o, int64_t batch, int64_t step, uint64_t seed) {
    return synthetic_image_batch(o.num_classes, o, batch, step, seed);
  };
  e.loss = [](Module& m, const data::Example& b) { return cross_entropy(m(b.input), b.target); };
  return e;
}

ModelEntry gpt_entry() {
  return causal_lm_entry<GPT, GPTConfig>(
      "gpt", "nanoGPT's GPT-2", {"tiny", "small", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"},
      &GPTConfig::block_size);
}

}  // namespace

const std::vector<ModelEntry>& model_registry() {
  // One line per model; each NAME_entry() lives beside its model (or above, for the first two).
  // clang-format off
  static const std::vector<ModelEntry> entries = {
      resnet_entry(),
      gpt_entry(),
      llama_entry(),
      unet_entry(),
      lstm_entry(),
      vit_entry(),
      bert_entry(),
  };
  // clang-format on
  return entries;
}

std::string model_names() {
  std::string s;
  for (const ModelEntry& e : model_registry()) s += (s.empty() ? "" : " | ") + e.name;
  return s;
}

const ModelEntry& model_entry(const std::string& name) {
  for (const ModelEntry& e : model_registry())
    if (e.name == name) return e;
  throw std::invalid_argument(
      fmt::format("--model: unknown model '{}' (expected {})", name, model_names()));
}

void set_presets(ModelEntry& e, const std::string& what, std::vector<std::string> presets) {
  std::string list;
  for (const std::string& p : presets) list += (list.empty() ? "" : " | ") + p;
  e.description = fmt::format("{} ({})", what, list);
  e.presets = std::move(presets);
}

data::Example synthetic_token_batch(int64_t vocab, const ModelOptions& o, int64_t batch,
                                    int64_t step, uint64_t seed) {
  const data::SyntheticTokens ds((step + 1) * batch, vocab, {o.seq}, seed);
  return ds.get_batch(batch_indices(batch, step));
}

data::Example synthetic_image_batch(int64_t classes, const ModelOptions& o, int64_t batch,
                                    int64_t step, uint64_t seed) {
  const data::SyntheticImages ds((step + 1) * batch, {o.in_channels, o.image_size, o.image_size},
                                 classes, seed);
  return ds.get_batch(batch_indices(batch, step));
}

ModelOptions resolve_options(const ModelEntry& entry, ModelOptions o) {
  if (o.preset.empty()) o.preset = entry.presets.at(0);
  bool known = false;
  for (const std::string& p : entry.presets) known = known || p == o.preset;
  if (!known) {
    std::string list;
    for (const std::string& p : entry.presets) list += (list.empty() ? "" : ", ") + p;
    throw std::invalid_argument(
        fmt::format("--model {}: unknown preset '{}' (expected {})", entry.name, o.preset, list));
  }
  if (entry.input == ModelEntry::Input::images) {
    if (o.num_classes == 0) o.num_classes = 10;
    if (o.in_channels == 0) o.in_channels = 3;
    if (o.image_size == 0) o.image_size = entry.context ? entry.context(o.preset) : 32;
  } else if (o.seq == 0 && entry.context) {
    o.seq = entry.context(o.preset);
  }
  return o;
}

}  // namespace tally::nn
