// SGD: state (momentum_buffer) and the per-bucket fused update (see sgd.h).
#include "optim/sgd.h"

#include <fmt/format.h>

#include <stdexcept>

#include "optim/multi_tensor.h"

namespace tally::optim {

GroupOptions SGDOptions::to_map() const {
  return {{"lr", lr},
          {"momentum", momentum},
          {"dampening", dampening},
          {"weight_decay", weight_decay},
          {"nesterov", nesterov ? 1.0 : 0.0},
          {"maximize", maximize ? 1.0 : 0.0},
          {"capturable", capturable ? 1.0 : 0.0}};
}

SGD::SGD(std::vector<Tensor> params, SGDOptions options)
    : SGD(std::vector<ParamGroup>{{std::move(params), {}}}, options) {}

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions defaults) : Optimizer(defaults.to_map()) {
  for (ParamGroup& g : groups) add_param_group(std::move(g));
}

void SGD::check_options(const GroupOptions& o) const {
  if (!(o.at("lr") >= 0))  // PyTorch's `not 0.0 <= lr`: NaN is invalid too
    throw std::invalid_argument(fmt::format("SGD: invalid learning rate {}", o.at("lr")));
  if (!(o.at("momentum") >= 0))
    throw std::invalid_argument(fmt::format("SGD: invalid momentum {}", o.at("momentum")));
  if (!(o.at("weight_decay") >= 0))
    throw std::invalid_argument(fmt::format("SGD: invalid weight_decay {}", o.at("weight_decay")));
  if (o.at("nesterov") != 0 && (o.at("momentum") <= 0 || o.at("dampening") != 0))
    throw std::invalid_argument("SGD: Nesterov momentum requires a momentum and zero dampening");
}

void SGD::update_group(const ParamGroup& group, const std::vector<size_t>& indices) {
  SGDHyper h;
  h.lr = group.get("lr");
  h.momentum = group.get("momentum");
  h.dampening = group.get("dampening");
  h.weight_decay = group.get("weight_decay");
  h.nesterov = group.flag("nesterov");
  h.maximize = group.flag("maximize");
  const bool capturable = group.options.count("capturable") != 0 && group.flag("capturable");
  const bool use_momentum = h.momentum != 0;
  // Bucket by (device, dtype, whether the momentum buffer is new).
  auto fresh = [&](size_t i) {
    return use_momentum && !state(i).tensors.count("momentum_buffer") ? 1 : 0;
  };
  for (const std::vector<size_t>& bucket : buckets(indices, fresh)) {
    const Tensor& first = param_at(bucket[0]);
    h.first_step = fresh(bucket[0]) == 1;
    TensorLists lists(first.device(), first.dtype(), use_momentum ? 3 : 2);
    for (size_t i : bucket) {
      const Tensor& p = param_at(i);
      const Tensor g = p.grad();
      ParamState& s = state(i);
      if (use_momentum) {
        if (h.first_step) s.tensors["momentum_buffer"] = make_state(p);
        lists.add({p.data_ptr(), g.data_ptr(), s.tensors["momentum_buffer"].data_ptr()}, p.numel());
      } else {
        lists.add({p.data_ptr(), g.data_ptr()}, p.numel());
      }
      ++s.step;
    }
    h.lr_device = capturable ? device_lr(group, first.device()) : nullptr;
    h.found_inf = found_inf_on(first.device());
    fused_sgd_(lists, h);
  }
}

}  // namespace tally::optim
