// The reference models by name: what `ab_memory --model NAME`, the example trainers and the
// library A/B (tally::ab::run) build when the user names a model instead of passing one.
// Each entry builds its model, makes a synthetic batch of the right kind and computes the
// training loss of a batch. Adding a model: write `ModelEntry NAME_entry()` beside the model
// and list it in registry.cpp's table.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/data/dataset.h"
#include "nn/module.h"

namespace tally::nn {

// What the user chose; 0 / empty fields take the entry's defaults.
struct ModelOptions {
  std::string preset;             // the entry's presets (GPT: tiny | small | gpt2 ...)
  int64_t num_classes = 0;        // image models: classes of the labels
  int64_t in_channels = 0;        // image models: input channels
  int64_t image_size = 0;         // image models: height = width
  int64_t seq = 0;                // token models: sequence length (0: the preset's context)
  bool fused_classifier = false;  // models with a vocabulary-sized classifier that fuse it
};

struct ModelEntry {
  std::string name;         // "resnet", "gpt", ...
  std::string description;  // one line for --help
  // The first is the default, and small enough that a CPU step takes well under a second
  // (tests/nn/test_model_registry.cpp trains every entry's first preset).
  std::vector<std::string> presets;
  enum class Input { images, tokens } input = Input::tokens;
  // Token models: the context length of a preset (the default --seq); image models, where
  // set: the image size of a preset (the default --image-size, else 32).
  std::function<int64_t(const std::string& preset)> context;
  // Builds the model (on the device of an enclosing nn::BuildOnDevice, as every layer does).
  std::function<std::shared_ptr<Module>(const ModelOptions&)> build;
  // Batch number `step` of a synthetic dataset seeded with `seed` (deterministic in both):
  // images [B, C, H, W] float32 with int64 labels [B], or tokens [B, T] int64 with
  // next-token targets [B, T]. On the CPU; `opts` resolved (resolve_options).
  std::function<data::Example(const ModelOptions& opts, int64_t batch, int64_t step, uint64_t seed)>
      synthetic_batch;
  // The training loss of one batch (already on the model's device): the forward and the loss.
  std::function<Tensor(Module& model, const data::Example& batch)> loss;
};

// The entry's presets and its description: "WHAT (a | b | ...)".
void set_presets(ModelEntry& e, const std::string& what, std::vector<std::string> presets);

// Every registered model, in the order --help lists them.
const std::vector<ModelEntry>& model_registry();
// The entry called `name`; std::invalid_argument naming the known models otherwise.
const ModelEntry& model_entry(const std::string& name);
// "resnet | gpt | ...", for help texts and errors.
std::string model_names();
// Batch number `step` of `batch` rows of a synthetic dataset seeded with `seed`, for
// synthetic_batch: tokens [B, opts.seq] below `vocab` with next-token targets
// (data::SyntheticTokens), or images [B, in_channels, image_size, image_size] with labels
// below `classes` (data::SyntheticImages).
data::Example synthetic_token_batch(int64_t vocab, const ModelOptions& opts, int64_t batch,
                                    int64_t step, uint64_t seed);
data::Example synthetic_image_batch(int64_t classes, const ModelOptions& opts, int64_t batch,
                                    int64_t step, uint64_t seed);
// `opts` with the entry's defaults filled in (the first preset when none is given);
// std::invalid_argument naming the entry's presets for an unknown one.
ModelOptions resolve_options(const ModelEntry& entry, ModelOptions opts);

}  // namespace tally::nn
