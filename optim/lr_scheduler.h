// Learning-rate schedules (torch.optim.lr_scheduler): each sets every param group's lr to
// f(base lr, epoch) by PyTorch's closed forms. Constructing a scheduler performs the
// initial step (epoch 0), like PyTorch; call step() after each optimizer.step().
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "optim/optimizer.h"

namespace tally::optim {

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advances one epoch (or iteration) and sets the groups' lr.
  void step();
  // The lr of each group as last set by this scheduler.
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  int64_t last_epoch() const { return last_epoch_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  // Jumps to `epoch` (e.g. after loading a checkpoint) and sets the lrs for it.
  void set_last_epoch(int64_t epoch);

  // The lr of a group with `base_lr` at `epoch`.
  using LrAt = std::function<double(double base_lr, int64_t epoch)>;

 protected:
  // Performs the initial step (epoch 0) with lr_at, as PyTorch's _initial_step.
  LRScheduler(Optimizer& optimizer, LrAt lr_at);

 private:
  void apply();
  Optimizer& opt_;
  LrAt lr_at_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
  int64_t last_epoch_ = -1;
};

// lr = base * gamma^floor(epoch / step_size).
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1);
};

// lr = eta_min + (base - eta_min) * (1 + cos(pi * epoch / T_max)) / 2.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min = 0.0);
};

// lr = base * lambda(epoch).
class LambdaLR : public LRScheduler {
 public:
  LambdaLR(Optimizer& optimizer, std::function<double(int64_t)> lr_lambda);
};

// nanoGPT's schedule (llm.c's is the same shape): linear warmup
// base * (it + 1) / (warmup_steps + 1) for it < warmup_steps, then cosine decay from base to
// min_lr over [warmup_steps, total_steps], then min_lr.
class WarmupCosineLR : public LRScheduler {
 public:
  WarmupCosineLR(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps,
                 double min_lr = 0.0);
};

}  // namespace tally::optim
