// Optimizer base: groups, lazily created state, zero_grad, state_dict (see optimizer.h).
#include "optim/optimizer.h"

#include <fmt/format.h>

#include <cstdio>
#include <stdexcept>

#include "autograd/grad_mode.h"
#include "memory/context.h"
#include "tensor/cuda/graph.h"
#include "tensor/ops.h"

namespace tally::optim {

double ParamGroup::get(const std::string& key) const {
  auto it = options.find(key);
  if (it == options.end())
    throw std::out_of_range(fmt::format("param group has no option '{}'", key));
  return it->second;
}

void check_param(const Tensor& p, size_t index, const char* what) {
  if (!p.defined())
    throw std::invalid_argument(
        fmt::format("{}: parameter {} is an undefined tensor", what, index));
  if (p.dtype() != DType::float32 && p.dtype() != DType::float64)
    throw std::invalid_argument(
        fmt::format("{}: parameter {} (shape {}) has dtype {}; float32 or float64 expected", what,
                    index, p.shape_string(), dtype_name(p.dtype())));
  if (!p.is_leaf())
    throw std::invalid_argument(fmt::format("{}: parameter {} (shape {}) is not a leaf tensor",
                                            what, index, p.shape_string()));
  // Updates run over each tensor's memory as one flat run: a parameter must be dense (row-major
  // or channels_last, Module::to(MemoryFormat)); its gradient and state share its layout.
  if (!p.is_contiguous() && !p.is_contiguous(MemoryFormat::channels_last))
    throw std::invalid_argument(
        fmt::format("{}: parameter {} (shape {}) is neither contiguous nor channels_last", what,
                    index, p.shape_string()));
}

void check_grad(const Tensor& p, const Tensor& g, size_t index, const char* what) {
  if (g.sizes() != p.sizes())
    throw std::invalid_argument(
        fmt::format("{}: gradient of parameter {} has shape {}, the parameter {}", what, index,
                    g.shape_string(), p.shape_string()));
  if (g.dtype() != p.dtype())
    throw std::invalid_argument(
        fmt::format("{}: gradient of parameter {} (shape {}) has dtype {}, the parameter {}", what,
                    index, p.shape_string(), dtype_name(g.dtype()), dtype_name(p.dtype())));
  if (!(g.device() == p.device()))
    throw std::invalid_argument(
        fmt::format("{}: gradient of parameter {} (shape {}) is on {}, the parameter on {}", what,
                    index, p.shape_string(), g.device().str(), p.device().str()));
  const MemoryFormat f = p.suggest_memory_format();
  if (!g.is_contiguous(f))
    throw std::invalid_argument(fmt::format(
        "{}: gradient of parameter {} (shape {}) is not {} like the parameter", what, index,
        p.shape_string(), f == MemoryFormat::contiguous ? "contiguous" : "channels_last"));
}

void Optimizer::check_parameter(const Tensor& p, size_t index) const {
  check_param(p, index, name());
}

void Optimizer::add_param_group(ParamGroup group) {
  finish_deferred_updates();
  for (const auto& [k, v] : defaults_) group.options.try_emplace(k, v);
  for (const auto& [k, v] : group.options)
    if (!defaults_.count(k))
      throw std::invalid_argument(fmt::format("{}: unknown param group option '{}'", name(), k));
  check_options(group.options);
  for (size_t j = 0; j < group.params.size(); ++j) {
    const Tensor& p = group.params[j];
    check_parameter(p, state_.size() + j);
    bool repeated = false;
    for (const ParamGroup& g : groups_)
      for (const Tensor& q : g.params) repeated = repeated || q.is_same(p);
    for (size_t k = 0; k < j; ++k) repeated = repeated || group.params[k].is_same(p);
    if (repeated)
      throw std::invalid_argument(fmt::format("{}: parameter {} (shape {}) appears more than once",
                                              name(), state_.size() + j, p.shape_string()));
  }
  const size_t g = groups_.size();
  for (size_t j = 0; j < group.params.size(); ++j) {
    where_.emplace_back(g, j);
    state_.emplace_back();
  }
  groups_.push_back(std::move(group));
}

Tensor& Optimizer::param_at(size_t i) {
  const auto [g, j] = where_.at(i);
  return groups_[g].params[j];
}
const Tensor& Optimizer::param_at(size_t i) const {
  const auto [g, j] = where_.at(i);
  return groups_[g].params[j];
}

ParamState& Optimizer::state(size_t i) {
  if (i >= state_.size())
    throw std::out_of_range(fmt::format("{}: parameter index {} of {}", name(), i, state_.size()));
  return state_[i];
}
const ParamState& Optimizer::state(size_t i) const {
  return const_cast<Optimizer*>(this)->state(i);
}

double Optimizer::get_lr(size_t group) const {
  if (group >= groups_.size())
    throw std::out_of_range(fmt::format("{}: param group {} of {}", name(), group, groups_.size()));
  return groups_[group].get("lr");
}

void Optimizer::set_lr(double lr, size_t group) {
  if (group >= groups_.size())
    throw std::out_of_range(fmt::format("{}: param group {} of {}", name(), group, groups_.size()));
  groups_[group].options["lr"] = lr;
  write_device_lr(group);
}

void Optimizer::write_device_lr(size_t group) {
  const double lr = groups_[group].get("lr");
  for (auto& [key, slot] : device_lr_) {
    if (std::get<0>(key) != group || slot.written == lr) continue;
    const Device d = slot.value.device();
    if (d.type == DeviceType::cuda && tally::cuda::is_capturing(d.index))
      throw std::logic_error(fmt::format(
          "{}: lr of param group {} changed to {} inside a CUDA graph capture (the write would "
          "be captured and repeated by every replay); change it between replays",
          name(), group, lr));
    ops::fill_(slot.value, lr);
    slot.written = lr;
  }
}

const float* Optimizer::found_inf_on(Device device) const {
  for (const Tensor& f : found_inf_)
    if (f.device() == device) return f.data<float>();
  return nullptr;
}

const double* Optimizer::device_lr(const ParamGroup& group, Device device) {
  const auto g = static_cast<size_t>(&group - groups_.data());
  if (g >= groups_.size()) throw std::logic_error("Optimizer::device_lr: not one of its groups");
  const auto key = std::make_tuple(g, static_cast<int>(device.type), device.index);
  auto it = device_lr_.find(key);
  if (it == device_lr_.end()) {
    if (device.type == DeviceType::cuda && tally::cuda::is_capturing(device.index))
      throw std::logic_error(fmt::format(
          "{}: a capturable update's first step is inside a CUDA graph capture; run one step "
          "before capturing (its lr must be on the device already)",
          name()));
    Tensor value = make_state({}, DType::float64, device);
    ops::fill_(value, group.get("lr"));
    it = device_lr_.emplace(key, DeviceLr{value, group.get("lr")}).first;
  }
  write_device_lr(g);  // the option may have been set directly (param_groups())
  return static_cast<const double*>(it->second.value.data_ptr());
}

namespace {
// `zeros` (a fresh row-major zero tensor of param's shape) in param's memory format: the same
// storage restrided (all zeros, so no values move). The flat updates then pair each element of
// the state with the parameter's element at the same memory offset.
Tensor in_layout_of(const Tensor& zeros, const Tensor& param) {
  if (param.suggest_memory_format() != MemoryFormat::channels_last ||
      zeros.sizes() != param.sizes())
    return zeros;
  return Tensor::make(zeros.storage(), zeros.sizes(), param.strides(), 0, zeros.dtype());
}
}  // namespace

Tensor Optimizer::make_state(const Tensor& param) {
  return in_layout_of(make_state(param.sizes(), param.dtype(), param.device()), param);
}

Tensor Optimizer::make_state(const Shape& sizes, DType dtype, Device device) {
  memory::CategoryScope category(memory::Category::optimizer_state);
  return ops::zeros(sizes, dtype, device);
}

std::optional<StateSpec> Optimizer::state_spec(size_t index, const std::string& /*name*/) const {
  const Tensor& p = param_at(index);
  return StateSpec{p.sizes(), p.dtype()};
}

void Optimizer::step(std::source_location site) {
  memory::CallSiteScope call_site(site);
  NoGradGuard no_grad;
  memory::PhaseScope phase("optimizer");
  memory::CategoryScope category(memory::Category::temporary);
  finish_deferred_updates();
  size_t base = 0;
  for (const ParamGroup& group : groups_) {
    std::vector<size_t> with_grad;
    for (size_t j = 0; j < group.params.size(); ++j) {
      const Tensor& p = group.params[j];
      const Tensor g = p.grad();
      if (!g.defined()) continue;
      check_grad(p, g, base + j, name());
      with_grad.push_back(base + j);
    }
    if (!with_grad.empty()) update_group(group, with_grad);
    for (size_t i : with_grad) param_at(i).storage().bump_version();
    base += group.params.size();
  }
}

void Optimizer::step_param(size_t param_index) {
  if (param_index >= state_.size())
    throw std::out_of_range(fmt::format("{}.step_param({}): the optimizer has {} parameters",
                                        name(), param_index, state_.size()));
  NoGradGuard no_grad;
  memory::PhaseScope phase("optimizer");
  memory::CategoryScope category(memory::Category::temporary);
  finish_deferred_updates();
  Tensor& p = param_at(param_index);
  const Tensor g = p.grad();
  if (!g.defined()) return;
  check_grad(p, g, param_index, name());
  update_group(groups_[where_[param_index].first], {param_index});
  p.storage().bump_version();
}

void Optimizer::zero_grad(bool set_to_none) {
  NoGradGuard no_grad;
  for (ParamGroup& group : groups_)
    for (Tensor& p : group.params) {
      const Tensor g = p.grad();
      if (!g.defined()) continue;
      if (set_to_none)
        p.set_grad(Tensor());
      else
        ops::zero_(g);
    }
}

OptimizerStateDict Optimizer::state_dict() const {
  // A pending update belongs to the state asked for: it runs first (the state changes as a
  // step would change it, which is why this const method may).
  const_cast<Optimizer*>(this)->finish_deferred_updates();
  OptimizerStateDict sd;
  for (size_t i = 0; i < state_.size(); ++i) {
    const ParamState& s = state_[i];
    if (!s.initialized()) continue;
    // Capturable Adam counts on the device too, where graph replays count without the host.
    const auto device_step = s.tensors.find("device_step");
    sd.scalars[fmt::format("state.{}.step", i)] = device_step == s.tensors.end()
                                                      ? static_cast<double>(s.step)
                                                      : ops::item(device_step->second);
    for (const auto& [k, t] : s.tensors) sd.tensors[fmt::format("state.{}.{}", i, k)] = t;
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    sd.scalars[fmt::format("param_groups.{}.num_params", g)] =
        static_cast<double>(groups_[g].params.size());
    for (const auto& [k, v] : groups_[g].options)
      sd.scalars[fmt::format("param_groups.{}.{}", g, k)] = v;
  }
  return sd;
}

void Optimizer::load_state_dict(const OptimizerStateDict& sd) {
  finish_deferred_updates();
  // Check everything before changing anything.
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto it = sd.scalars.find(fmt::format("param_groups.{}.num_params", g));
    if (it == sd.scalars.end() || static_cast<size_t>(it->second) != groups_[g].params.size())
      throw std::invalid_argument(fmt::format(
          "{}.load_state_dict: param group {} has {} parameters, the state dict {}", name(), g,
          groups_[g].params.size(),
          it == sd.scalars.end() ? std::string("none") : fmt::format("{}", it->second)));
  }
  std::vector<ParamState> fresh(state_.size());
  for (const auto& [key, v] : sd.scalars) {
    size_t i = 0;
    char rest[64] = {0};
    if (std::sscanf(key.c_str(), "state.%zu.%63s", &i, rest) == 2 && std::string(rest) == "step") {
      if (i >= fresh.size())
        throw std::invalid_argument(fmt::format("{}.load_state_dict: '{}' names parameter {} of {}",
                                                name(), key, i, fresh.size()));
      fresh[i].step = static_cast<int64_t>(v);
    }
  }
  for (const auto& [key, t] : sd.tensors) {
    size_t i = 0;
    char rest[64] = {0};
    if (std::sscanf(key.c_str(), "state.%zu.%63s", &i, rest) != 2 || i >= fresh.size())
      throw std::invalid_argument(fmt::format(
          "{}.load_state_dict: unexpected tensor '{}' ({} parameters)", name(), key, fresh.size()));
    const Tensor& p = param_at(i);
    const std::optional<StateSpec> spec = state_spec(i, rest);
    if (!spec)
      throw std::invalid_argument(
          fmt::format("{}.load_state_dict: unexpected tensor '{}' (parameter {}, shape {}, keeps "
                      "no state of that name)",
                      name(), key, i, p.shape_string()));
    if (t.sizes() != spec->sizes)
      throw std::invalid_argument(
          spec->sizes == p.sizes()
              ? fmt::format("{}.load_state_dict: '{}' has shape {}, parameter {} has shape {}",
                            name(), key, t.shape_string(), i, p.shape_string())
              : fmt::format("{}.load_state_dict: '{}' has shape {}, parameter {} (shape {}) keeps "
                            "it as {}",
                            name(), key, t.shape_string(), i, p.shape_string(),
                            shape_str(spec->sizes)));
    if (spec->exact_dtype && t.dtype() != spec->dtype)
      throw std::invalid_argument(fmt::format(
          "{}.load_state_dict: '{}' has dtype {}, parameter {} (shape {}) keeps it as {}", name(),
          key, dtype_name(t.dtype()), i, p.shape_string(), dtype_name(spec->dtype)));
    Tensor s = in_layout_of(make_state(spec->sizes, spec->dtype, p.device()), p);
    ops::copy_(s, t);
    fresh[i].tensors[rest] = s;
  }
  for (size_t i = 0; i < fresh.size(); ++i) check_loaded_state(i, fresh[i]);
  for (size_t g = 0; g < groups_.size(); ++g)
    for (auto& [k, v] : groups_[g].options) {
      auto it = sd.scalars.find(fmt::format("param_groups.{}.{}", g, k));
      if (it != sd.scalars.end()) v = it->second;
    }
  state_ = std::move(fresh);
  for (size_t g = 0; g < groups_.size(); ++g) write_device_lr(g);
}

}  // namespace tally::optim
