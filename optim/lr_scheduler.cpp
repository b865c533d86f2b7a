// LR schedules by their closed forms (see lr_scheduler.h).
#include "optim/lr_scheduler.h"

#include <fmt/format.h>

#include <cmath>
#include <numbers>
#include <stdexcept>

namespace tally::optim {

namespace {
// A schedule's period (StepLR's step_size, CosineAnnealingLR's T_max), checked to be > 0.
int64_t positive_period(int64_t v, const char* what) {
  if (v <= 0) throw std::invalid_argument(fmt::format("{} must be positive, got {}", what, v));
  return v;
}

// LambdaLR's function, checked to be set.
std::function<double(int64_t)> checked_lambda(std::function<double(int64_t)> f) {
  if (!f) throw std::invalid_argument("LambdaLR: empty lr_lambda");
  return f;
}

// WarmupCosineLR's schedule, its steps checked.
LRScheduler::LrAt warmup_cosine(int64_t warmup, int64_t total, double min_lr) {
  if (warmup < 0 || total <= warmup)
    throw std::invalid_argument(
        fmt::format("WarmupCosineLR: need 0 <= warmup_steps < total_steps, got warmup_steps {} and "
                    "total_steps {}",
                    warmup, total));
  return [warmup, total, min_lr](double base, int64_t it) {
    if (it < warmup) return base * static_cast<double>(it + 1) / static_cast<double>(warmup + 1);
    if (it > total) return min_lr;
    const double ratio = static_cast<double>(it - warmup) / static_cast<double>(total - warmup);
    const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * ratio));
    return min_lr + coeff * (base - min_lr);
  };
}
}  // namespace

LRScheduler::LRScheduler(Optimizer& optimizer, LrAt lr_at)
    : opt_(optimizer), lr_at_(std::move(lr_at)) {
  for (size_t g = 0; g < opt_.param_groups().size(); ++g) base_lrs_.push_back(opt_.get_lr(g));
  step();
}

void LRScheduler::step() {
  set_last_epoch(last_epoch_ + 1);
}

void LRScheduler::set_last_epoch(int64_t epoch) {
  last_epoch_ = epoch;
  apply();
}

void LRScheduler::apply() {
  last_lr_.clear();
  for (size_t g = 0; g < base_lrs_.size(); ++g) {
    const double lr = lr_at_(base_lrs_[g], last_epoch_);
    opt_.set_lr(lr, g);
    last_lr_.push_back(lr);
  }
}

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer, [step_size = positive_period(step_size, "StepLR: step_size"), gamma](
                                 double base, int64_t epoch) {
        return base * std::pow(gamma, static_cast<double>(epoch / step_size));
      }) {}

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min)
    : LRScheduler(optimizer, [t_max = positive_period(T_max, "CosineAnnealingLR: T_max"), eta_min](
                                 double base, int64_t epoch) {
        return eta_min + (base - eta_min) *
                             (1 + std::cos(std::numbers::pi * static_cast<double>(epoch) /
                                           static_cast<double>(t_max))) /
                             2;
      }) {}

LambdaLR::LambdaLR(Optimizer& optimizer, std::function<double(int64_t)> lr_lambda)
    : LRScheduler(optimizer, [lambda = checked_lambda(std::move(lr_lambda))](
                                 double base, int64_t epoch) { return base * lambda(epoch); }) {}

WarmupCosineLR::WarmupCosineLR(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps,
                               double min_lr)
    : LRScheduler(optimizer, warmup_cosine(warmup_steps, total_steps, min_lr)) {}

}  // namespace tally::optim
