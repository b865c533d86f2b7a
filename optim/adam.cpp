// Adam and AdamW: state and the per-bucket fused update (see adam.h).
#include "optim/adam.h"

#include <fmt/format.h>

#include <stdexcept>

#include "optim/multi_tensor.h"
#include "tensor/ops.h"

namespace tally::optim {

GroupOptions AdamOptions::to_map() const {
  return {{"lr", lr},
          {"beta1", beta1},
          {"beta2", beta2},
          {"eps", eps},
          {"weight_decay", weight_decay},
          {"amsgrad", amsgrad ? 1.0 : 0.0},
          {"maximize", maximize ? 1.0 : 0.0},
          {"capturable", capturable ? 1.0 : 0.0}};
}

Adam::Adam(std::vector<Tensor> params, AdamOptions options)
    : Adam(std::vector<ParamGroup>{{std::move(params), {}}}, options, false) {}
Adam::Adam(std::vector<ParamGroup> groups, AdamOptions defaults)
    : Adam(std::move(groups), defaults, false) {}
Adam::Adam(std::vector<ParamGroup> groups, AdamOptions defaults, bool decoupled)
    : Optimizer(defaults.to_map()), decoupled_(decoupled) {
  for (ParamGroup& g : groups) add_param_group(std::move(g));
}

AdamW::AdamW(std::vector<Tensor> params, AdamOptions options)
    : Adam(std::vector<ParamGroup>{{std::move(params), {}}}, options, true) {}
AdamW::AdamW(std::vector<ParamGroup> groups, AdamOptions defaults)
    : Adam(std::move(groups), defaults, true) {}

void Adam::check_options(const GroupOptions& o) const {
  const char* n = decoupled_ ? "AdamW" : "Adam";
  if (!(o.at("lr") >= 0))  // PyTorch's `not 0.0 <= lr`: NaN is invalid too
    throw std::invalid_argument(fmt::format("{}: invalid learning rate {}", n, o.at("lr")));
  if (!(o.at("eps") >= 0))
    throw std::invalid_argument(fmt::format("{}: invalid epsilon {}", n, o.at("eps")));
  for (const char* b : {"beta1", "beta2"})
    if (!(o.at(b) >= 0 && o.at(b) < 1))
      throw std::invalid_argument(
          fmt::format("{}: invalid {} {} (must be in [0, 1))", n, b, o.at(b)));
  if (!(o.at("weight_decay") >= 0))
    throw std::invalid_argument(
        fmt::format("{}: invalid weight_decay {}", n, o.at("weight_decay")));
}

std::optional<StateSpec> Adam::state_spec(size_t index, const std::string& name) const {
  if (name == "device_step") return StateSpec{{}, DType::float32, true};
  return Optimizer::state_spec(index, name);
}

AdamHyper adam_hyper(const ParamGroup& group, bool decoupled) {
  AdamHyper h;
  h.lr = group.get("lr");
  h.beta1 = group.get("beta1");
  h.beta2 = group.get("beta2");
  h.eps = group.get("eps");
  h.weight_decay = group.get("weight_decay");
  h.amsgrad = group.flag("amsgrad");
  h.maximize = group.flag("maximize");
  h.capturable = group.options.count("capturable") != 0 && group.flag("capturable");
  h.decoupled = decoupled;
  return h;
}

void Adam::update_group(const ParamGroup& group, const std::vector<size_t>& indices) {
  AdamHyper h = adam_hyper(group, decoupled_);
  // Bucket by (device, dtype, step count): the bias corrections are per step.
  auto step_of = [&](size_t i) { return state(i).step; };
  for (const std::vector<size_t>& bucket : buckets(indices, step_of)) {
    const Tensor& first = param_at(bucket[0]);
    TensorLists lists(first.device(), first.dtype(), 4 + h.amsgrad + h.capturable);
    for (size_t i : bucket) {
      const Tensor& p = param_at(i);
      const Tensor g = p.grad();
      ParamState& s = state(i);
      if (!s.tensors.count("exp_avg")) {
        s.tensors["exp_avg"] = make_state(p);
        s.tensors["exp_avg_sq"] = make_state(p);
      }
      if (h.amsgrad && !s.tensors.count("max_exp_avg_sq"))
        s.tensors["max_exp_avg_sq"] = make_state(p);
      if (h.capturable && !s.tensors.count("device_step")) {  // counts on from the host's count
        s.tensors["device_step"] = make_state({}, DType::float32, p.device());
        if (s.step) ops::fill_(s.tensors["device_step"], static_cast<double>(s.step));
      }
      ++s.step;
      void* m = s.tensors["exp_avg"].data_ptr();
      void* v = s.tensors["exp_avg_sq"].data_ptr();
      void* vmax = h.amsgrad ? s.tensors["max_exp_avg_sq"].data_ptr() : nullptr;
      void* step = h.capturable ? s.tensors["device_step"].data_ptr() : nullptr;
      if (h.amsgrad && h.capturable)
        lists.add({p.data_ptr(), g.data_ptr(), m, v, vmax, step}, p.numel());
      else if (h.amsgrad)
        lists.add({p.data_ptr(), g.data_ptr(), m, v, vmax}, p.numel());
      else if (h.capturable)
        lists.add({p.data_ptr(), g.data_ptr(), m, v, step}, p.numel());
      else
        lists.add({p.data_ptr(), g.data_ptr(), m, v}, p.numel());
    }
    h.step = state(bucket[0]).step;
    h.lr_device = h.capturable ? device_lr(group, first.device()) : nullptr;
    h.found_inf = found_inf_on(first.device());
    fused_adam_(lists, h);
  }
}

}  // namespace tally::optim
