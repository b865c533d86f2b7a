// LoRA injection (nn/lora.h). The adapter's forward is Linear::forward's (nn/layers.cpp).
#include "nn/lora.h"

#include <fmt/format.h>

#include <cmath>

#include "nn/init.h"
#include "nn/layers.h"

namespace tally::nn::lora {

namespace {

// `*` matches any run of characters; everything else literally.
bool glob(const char* p, const char* s) {
  if (*p == '\0') return *s == '\0';
  if (*p == '*') return glob(p + 1, s) || (*s != '\0' && glob(p, s + 1));
  return *s == *p && glob(p + 1, s + 1);
}

std::string with_commas(int64_t n) {
  const std::string digits = std::to_string(n);
  std::string s;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0 && digits[i - 1] != '-') s += ',';
    s += digits[i];
  }
  return s;
}

}  // namespace

bool matches(const std::string& name, const std::string& target) {
  if (target.empty() || name.empty()) return false;
  if (target.find('*') != std::string::npos) return glob(target.c_str(), name.c_str());
  if (name == target) return true;
  return name.size() > target.size() &&
         name.compare(name.size() - target.size(), target.size(), target) == 0 &&
         name[name.size() - target.size() - 1] == '.';
}

std::vector<std::string> inject(Module& model, const std::vector<std::string>& targets, int64_t r,
                                double alpha, double dropout, Generator* gen) {
  if (r <= 0)
    throw std::invalid_argument(fmt::format("lora.inject: r must be positive, got {}", r));
  if (!(alpha > 0) || !std::isfinite(alpha))
    throw std::invalid_argument(fmt::format("lora.inject: alpha must be positive, got {}", alpha));
  if (!(dropout >= 0.0 && dropout < 1.0))
    throw std::invalid_argument(
        fmt::format("lora.inject: dropout must be in [0, 1), got {}", dropout));
  if (targets.empty()) throw std::invalid_argument("lora.inject: no target modules given");

  // Find every target first, so that an error leaves the model untouched.
  std::vector<std::pair<std::string, Linear*>> found;
  for (const auto& [name, m] : model.named_modules()) {
    bool hit = false;
    for (const std::string& t : targets) hit = hit || matches(name, t);
    if (!hit) continue;
    auto* lin = dynamic_cast<Linear*>(m);
    if (!lin)
      throw std::invalid_argument(fmt::format(
          "lora.inject: target module '{}' is a {}, not a Linear", name, m->type_name()));
    if (lin->lora_A)
      throw std::invalid_argument(
          fmt::format("lora.inject: module '{}' already has a LoRA adapter", name));
    found.emplace_back(name, lin);
  }
  if (found.empty()) {
    std::string list;
    for (const std::string& t : targets) list += (list.empty() ? "" : ", ") + t;
    throw std::invalid_argument(
        fmt::format("lora.inject: target modules [{}] not found in the model", list));
  }

  for (Tensor p : model.parameters()) p.requires_grad_(false);
  std::vector<std::string> names;
  for (auto& [name, lin] : found) {
    const Device dev = lin->weight.device();
    const DType dtype = lin->weight.dtype();
    BuildOnDevice on(dev);
    auto a = std::make_shared<Linear>(lin->in_features, r, false, gen);  // kaiming_uniform(sqrt 5)
    auto b = std::make_shared<Linear>(r, lin->out_features, false, gen);
    init::zeros_(b->weight);
    if (dtype != a->weight.dtype()) {
      a->to(dtype);
      b->to(dtype);
    }
    lin->lora_A = lin->register_module("lora_A", a);
    lin->lora_B = lin->register_module("lora_B", b);
    lin->lora_dropout = lin->register_module("lora_dropout", std::make_shared<Dropout>(dropout));
    lin->lora_scaling = alpha / static_cast<double>(r);
    names.push_back(name);
  }
  return names;
}

std::string trainable_summary(const Module& model) {
  const int64_t all = model.num_parameters(), trainable = model.num_parameters(true);
  return fmt::format(
      "trainable params: {} || all params: {} || trainable%: {:.4f}", with_commas(trainable),
      with_commas(all),
      all > 0 ? 100.0 * static_cast<double>(trainable) / static_cast<double>(all) : 0.0);
}

}  // namespace tally::nn::lora
