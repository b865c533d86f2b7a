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
}  // namespace

LRScheduler::LRScheduler(Optimizer& optimizer) : opt_(optimizer) {
  for (size_t g = 0; g < opt_.param_groups().size(); ++g) base_lrs_.push_back(opt_.get_lr(g));
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
    const double lr = lr_at(base_lrs_[g], last_epoch_);
    opt_.set_lr(lr, g);
    last_lr_.push_back(lr);
  }
}

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer),
      step_size_(positive_period(step_size, "StepLR: step_size")),
      gamma_(gamma) {
  initial_step();
}

double StepLR::lr_at(double base, int64_t epoch) const {
  return base * std::pow(gamma_, static_cast<double>(epoch / step_size_));
}

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min)
    : LRScheduler(optimizer),
      t_max_(positive_period(T_max, "CosineAnnealingLR: T_max")),
      eta_min_(eta_min) {
  initial_step();
}

double CosineAnnealingLR::lr_at(double base, int64_t epoch) const {
  return eta_min_ + (base - eta_min_) *
                        (1 + std::cos(std::numbers::pi * static_cast<double>(epoch) /
                                      static_cast<double>(t_max_))) /
                        2;
}

LambdaLR::LambdaLR(Optimizer& optimizer, std::function<double(int64_t)> lr_lambda)
    : LRScheduler(optimizer), lambda_(std::move(lr_lambda)) {
  if (!lambda_) throw std::invalid_argument("LambdaLR: empty lr_lambda");
  initial_step();
}

double LambdaLR::lr_at(double base, int64_t epoch) const {
  return base * lambda_(epoch);
}

WarmupCosineLR::WarmupCosineLR(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps,
                               double min_lr)
    : LRScheduler(optimizer), warmup_(warmup_steps), total_(total_steps), min_lr_(min_lr) {
  if (warmup_steps < 0 || total_steps <= warmup_steps)
    throw std::invalid_argument(
        fmt::format("WarmupCosineLR: need 0 <= warmup_steps < total_steps, got warmup_steps {} and "
                    "total_steps {}",
                    warmup_steps, total_steps));
  initial_step();
}

double WarmupCosineLR::lr_at(double base, int64_t it) const {
  if (it < warmup_) return base * static_cast<double>(it + 1) / static_cast<double>(warmup_ + 1);
  if (it > total_) return min_lr_;
  const double ratio = static_cast<double>(it - warmup_) / static_cast<double>(total_ - warmup_);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * ratio));
  return min_lr_ + coeff * (base - min_lr_);
}

}  // namespace tally::optim
