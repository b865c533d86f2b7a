// SGD with momentum, dampening, Nesterov momentum, weight decay and maximize
// (torch.optim.SGD, its update equations step for step; see optim/update_math.h).
#pragma once

#include "optim/optimizer.h"

namespace tally::optim {

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
  bool maximize = false;
  // The lr is read on the parameters' device (Optimizer::device_lr), so that a CUDA graph of
  // the step (tensor/cuda/graph.h) follows an lr scheduler. SGD has no other host-side value.
  bool capturable = false;
  GroupOptions to_map() const;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, SGDOptions options = {});
  // Several groups; each group's missing options come from `defaults`.
  SGD(std::vector<ParamGroup> groups, SGDOptions defaults);
  const char* name() const override { return "SGD"; }

 protected:
  void update_group(const ParamGroup& group, const std::vector<size_t>& indices) override;
  void check_options(const GroupOptions& o) const override;
};

}  // namespace tally::optim
