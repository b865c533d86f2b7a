// LoRA (Hu et al., 2021), as PEFT's LoraConfig(target_modules, r, lora_alpha, lora_dropout):
// inject() gives every matching Linear a low-rank adapter, y = W x + b + (alpha / r) B A
// dropout(x), with A [r, in] kaiming-uniform(a = sqrt(5)) and B [out, r] zeros (so the model's
// output is unchanged at injection), and freezes every other parameter of the model
// (requires_grad false: no gradient, no optimizer state).
//
// Names: the adapted Linear keeps its own `weight` and `bias` (so the base model's state dict
// loads as is) and gains the children `lora_A`, `lora_B` (Linear without bias) and
// `lora_dropout`: "h.0.attn.c_attn.lora_A.weight". PEFT's differ: it moves the base weight to
// `base_layer.weight` and names the adapter (`lora_A.default.weight`).
#pragma once

#include <string>
#include <vector>

#include "nn/module.h"

namespace tally::nn::lora {

// Whether the module at dotted path `name` is named by `target`: the whole path
// ("h.0.attn.c_attn"), its last components ("attn.c_attn", "c_attn", as PEFT matches
// target_modules), or a pattern with `*` (any run of characters, dots included) matched
// against the whole path ("h.*.attn.c_attn").
bool matches(const std::string& name, const std::string& target);

// Adds an adapter to every Linear of `model` that a target names and freezes every other
// parameter; returns the adapted modules' paths. std::invalid_argument when r <= 0, alpha or
// dropout is out of range, no module matches, a target names a module that is not a Linear,
// or a Linear already has an adapter. The adapters are made on each Linear's device and in its
// dtype; `gen` draws lora_A (tally's default generator when null).
std::vector<std::string> inject(Module& model, const std::vector<std::string>& targets,
                                int64_t r = 8, double alpha = 8.0, double dropout = 0.0,
                                Generator* gen = nullptr);

// PEFT's print_trainable_parameters line: "trainable params: 1,536 || all params: 125,952 ||
// trainable%: 1.2195".
std::string trainable_summary(const Module& model);

}  // namespace tally::nn::lora
