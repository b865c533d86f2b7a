// Step-in-backward: the optimizer updates each parameter as soon as backward has accumulated
// its gradient, and frees that gradient at once, PyTorch's optimizer-in-backward recipe
// (Tensor.register_post_accumulate_grad_hook + one optimizer step per parameter). A step then
// never holds every gradient: the `gradient` category at the peak is one parameter's
// gradient, not the model's.
//
//   optim::AdamW opt(model->parameters());
//   optim::StepInBackward sib(opt);   // while alive, loss.backward() also steps
//   for (...) { loss = ...; loss.backward(); sched.step(); }   // no opt.step(), no zero_grad
//
// What it excludes, as in PyTorch: gradient clipping by the total norm and fp16 loss scaling
// (both need every gradient before any update), gradient accumulation over several
// backwards, and data parallelism (the all-reduce needs the gradients); the training
// programs refuse those combinations with an error naming the flags.
#pragma once

#include <cstdint>
#include <vector>

#include "optim/optimizer.h"

namespace tally::optim {

class StepInBackward {
 public:
  // Hooks every parameter of `opt` (which must outlive this object). Throws
  // std::invalid_argument for a parameter that does not require grad, or that appears twice.
  explicit StepInBackward(Optimizer& opt);
  ~StepInBackward();  // removes the hooks
  StepInBackward(const StepInBackward&) = delete;
  StepInBackward& operator=(const StepInBackward&) = delete;

  // Parameter updates made so far.
  int64_t updates() const { return updates_; }

 private:
  Optimizer& opt_;
  std::vector<std::pair<Tensor, uint64_t>> hooks_;  // (parameter, handle)
  int64_t updates_ = 0;
};

}  // namespace tally::optim
