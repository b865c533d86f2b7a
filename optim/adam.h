// Adam (L2 weight decay added to the gradient) and AdamW (decoupled weight decay), with
// bias correction, amsgrad and maximize: torch.optim.Adam / AdamW's update equations step
// for step (optim/update_math.h). State per parameter: exp_avg, exp_avg_sq (and
// max_exp_avg_sq with amsgrad), and a host-side step count.
#pragma once

#include "optim/multi_tensor.h"
#include "optim/optimizer.h"

namespace tally::optim {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;  // Adam: 0; AdamW: PyTorch's default is 1e-2
  bool amsgrad = false;
  bool maximize = false;
  // PyTorch's capturable=True: each parameter's step count is also kept on its device (state
  // "device_step", a float32 scalar) and the update takes the bias corrections from it, so a
  // CUDA graph can replay the step (tensor/cuda/graph.h); the lr is read there too
  // (Optimizer::device_lr), so a scheduler's changes reach the replays. Adam and AdamW only.
  bool capturable = false;
  GroupOptions to_map() const;
};

class Adam : public Optimizer {
 public:
  Adam(std::vector<Tensor> params, AdamOptions options = {});
  Adam(std::vector<ParamGroup> groups, AdamOptions defaults);
  const char* name() const override { return decoupled_ ? "AdamW" : "Adam"; }

 protected:
  Adam(std::vector<ParamGroup> groups, AdamOptions defaults, bool decoupled);
  void update_group(const ParamGroup& group, const std::vector<size_t>& indices) override;
  void check_options(const GroupOptions& o) const override;
  std::optional<StateSpec> state_spec(size_t index, const std::string& name) const override;

 private:
  bool decoupled_ = false;
};

// AdamW: param *= 1 - lr * weight_decay before the Adam update.
class AdamW : public Adam {
 public:
  static AdamOptions default_options() {
    AdamOptions o;
    o.weight_decay = 1e-2;
    return o;
  }
  AdamW(std::vector<Tensor> params, AdamOptions options = default_options());
  AdamW(std::vector<ParamGroup> groups, AdamOptions defaults);
};

// A group's Adam hyperparameters (lr, betas, eps, weight_decay, amsgrad, maximize,
// capturable) for the fused kernels; the step count is the caller's.
AdamHyper adam_hyper(const ParamGroup& group, bool decoupled);

}  // namespace tally::optim
