// CrossEntropyLoss over autograd's fused cross_entropy; the other losses over
// nn/functional.h and nll_loss.
#include "nn/loss.h"

#include <fmt/format.h>

#include <stdexcept>

#include "nn/functional.h"

namespace tally::nn {

CrossEntropyLoss::CrossEntropyLoss(int64_t ignore, std::string red, double smoothing)
    : Module("CrossEntropyLoss"),
      ignore_index(ignore),
      reduction(std::move(red)),
      label_smoothing(smoothing) {
  if (reduction != "mean" && reduction != "sum" && reduction != "none")
    throw std::invalid_argument(
        fmt::format("CrossEntropyLoss: {} is not a valid value for reduction", reduction));
  if (label_smoothing < 0.0 || label_smoothing > 1.0)
    throw std::invalid_argument(fmt::format(
        "CrossEntropyLoss: label_smoothing must be in [0, 1], got {}", label_smoothing));
}

Tensor CrossEntropyLoss::forward(const Tensor& input, const Tensor& target) {
  return cross_entropy(input, target, ignore_index, label_smoothing, reduction);
}

std::string CrossEntropyLoss::extra_repr() const {
  return fmt::format("ignore_index={}, reduction='{}', label_smoothing={}", ignore_index, reduction,
                     label_smoothing);
}

PairLoss::PairLoss(std::string type, std::string red, bool batchmean)
    : Module(std::move(type)), reduction(std::move(red)) {
  if (reduction != "mean" && reduction != "sum" && reduction != "none" &&
      !(batchmean && reduction == "batchmean"))
    throw std::invalid_argument(
        fmt::format("{}: {} is not a valid value for reduction", type_name(), reduction));
}

std::string PairLoss::extra_repr() const {
  return reduction == "mean" ? std::string() : fmt::format("reduction='{}'", reduction);
}

Tensor MSELoss::forward(const Tensor& input, const Tensor& target) {
  return functional::mse_loss(input, target, reduction);
}

Tensor L1Loss::forward(const Tensor& input, const Tensor& target) {
  return functional::l1_loss(input, target, reduction);
}

SmoothL1Loss::SmoothL1Loss(std::string red, double beta_)
    : PairLoss("SmoothL1Loss", std::move(red)), beta(beta_) {
  if (beta < 0.0)
    throw std::invalid_argument(
        fmt::format("SmoothL1Loss: beta must be non-negative, got {}", beta));
}
Tensor SmoothL1Loss::forward(const Tensor& input, const Tensor& target) {
  return functional::smooth_l1_loss(input, target, reduction, beta);
}
std::string SmoothL1Loss::extra_repr() const {
  return fmt::format("reduction='{}', beta={}", reduction, beta);
}

HuberLoss::HuberLoss(std::string red, double delta_)
    : PairLoss("HuberLoss", std::move(red)), delta(delta_) {
  if (delta <= 0.0)
    throw std::invalid_argument(fmt::format("HuberLoss: delta must be positive, got {}", delta));
}
Tensor HuberLoss::forward(const Tensor& input, const Tensor& target) {
  return functional::huber_loss(input, target, reduction, delta);
}
std::string HuberLoss::extra_repr() const {
  return fmt::format("reduction='{}', delta={}", reduction, delta);
}

BCEWithLogitsLoss::BCEWithLogitsLoss(Tensor w, std::string red, Tensor pw)
    : PairLoss("BCEWithLogitsLoss", std::move(red)) {
  if (w.defined()) weight = register_buffer("weight", std::move(w));
  if (pw.defined()) pos_weight = register_buffer("pos_weight", std::move(pw));
}
Tensor BCEWithLogitsLoss::forward(const Tensor& input, const Tensor& target) {
  return functional::binary_cross_entropy_with_logits(input, target, weight, reduction, pos_weight);
}

NLLLoss::NLLLoss(int64_t ignore, std::string red)
    : PairLoss("NLLLoss", std::move(red)), ignore_index(ignore) {}
Tensor NLLLoss::forward(const Tensor& input, const Tensor& target) {
  return nll_loss(input, target, ignore_index, reduction);
}
std::string NLLLoss::extra_repr() const {
  return fmt::format("ignore_index={}, reduction='{}'", ignore_index, reduction);
}

KLDivLoss::KLDivLoss(std::string red, bool log_t)
    : PairLoss("KLDivLoss", std::move(red), /*batchmean=*/true), log_target(log_t) {}
Tensor KLDivLoss::forward(const Tensor& input, const Tensor& target) {
  return functional::kl_div(input, target, reduction, log_target);
}
std::string KLDivLoss::extra_repr() const {
  return fmt::format("reduction='{}', log_target={}", reduction, log_target ? "True" : "False");
}

}  // namespace tally::nn
