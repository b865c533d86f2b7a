// Optimizer: the base of SGD, Adam and AdamW (torch.optim.Optimizer). It owns the parameter
// groups (each with its own hyperparameters, PyTorch's names: "lr", "momentum", "betas" as
// "beta1"/"beta2", ...), the per-parameter state (created lazily at the first step under
// the `optimizer_state` category), zero_grad, and the flat state_dict.
//
// A step runs under PhaseScope("optimizer") and NoGradGuard, updates the parameters'
// storage in place (bumping their version counters) and groups the parameters by (device,
// dtype, step count) so that on CUDA each group is ONE fused multi-tensor launch.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <source_location>
#include <string>
#include <tuple>
#include <vector>

#include "tensor/tensor.h"

namespace tally::optim {

// Hyperparameters of a group by PyTorch's names; booleans are 0 or 1.
using GroupOptions = std::map<std::string, double>;

struct ParamGroup {
  std::vector<Tensor> params;
  GroupOptions options;  // missing keys are filled from the optimizer's defaults

  double get(const std::string& key) const;  // throws naming the key when absent
  bool flag(const std::string& key) const { return get(key) != 0.0; }
};

// A parameter's state: named tensors (exp_avg, momentum_buffer, ...) and its step count.
struct ParamState {
  int64_t step = 0;
  std::map<std::string, Tensor> tensors;
  bool initialized() const { return !tensors.empty() || step > 0; }
};

// How an optimizer keeps one state tensor: load_state_dict checks a loaded tensor against it.
struct StateSpec {
  Shape sizes;
  DType dtype = DType::float32;
  // The loaded tensor must have `dtype` (quantization codes and scales); otherwise it is
  // converted to it, as a float64 state loads into float32 parameters.
  bool exact_dtype = false;
};

// The optimizer's state as flat names (params indexed 0.. across groups in order, as
// PyTorch's state_dict): tensors "state.<i>.<name>", and scalars "state.<i>.step" and
// "param_groups.<g>.<option>". Ready for safetensors (tensors) + metadata (scalars).
struct OptimizerStateDict {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, double> scalars;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter that has a gradient; `site`, defaulted at the caller, is
  // the user's line its allocations are attributed to (memory::CallSiteScope).
  void step(std::source_location site = std::source_location::current());
  // One update of the i-th parameter (counted across groups) alone, when it has a gradient:
  // what step() does for it, with its group's options (optim/step_in_backward.h).
  void step_param(size_t param_index);
  // Drops the gradients (set_to_none) or zeroes them in place.
  void zero_grad(bool set_to_none = true);

  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // A new group; missing options come from the defaults. Its parameters are checked.
  void add_param_group(ParamGroup group);

  double get_lr(size_t group = 0) const;
  void set_lr(double lr, size_t group = 0);
  const GroupOptions& defaults() const { return defaults_; }

  // State of the i-th parameter counted across groups in order.
  ParamState& state(size_t param_index);
  const ParamState& state(size_t param_index) const;
  size_t num_params() const { return state_.size(); }

  // A capturable GradScaler's step (optim/grad_scaler.h): until set again, each fused update on
  // a flag's device does nothing when that flag (float32, one element) is nonzero, so the skip is
  // decided on the device. Optimizers whose update cannot skip that way (AdamW8bit) throw.
  void set_found_inf(std::vector<Tensor> flags) { found_inf_ = std::move(flags); }

  OptimizerStateDict state_dict() const;
  // Restores state and group options; shapes, devices and group sizes must match.
  void load_state_dict(const OptimizerStateDict& sd);

  virtual const char* name() const = 0;

 protected:
  friend class GradScaler;
  explicit Optimizer(GroupOptions defaults) : defaults_(std::move(defaults)) {}
  // Called once per step per group with the global indices of its parameters that have a
  // gradient (checked); the state is still as the previous step left it.
  virtual void update_group(const ParamGroup& group, const std::vector<size_t>& indices) = 0;
  // Splits indices into buckets of one device, one dtype and one `key` (e.g. the step count):
  // each bucket is one fused launch.
  template <typename Key>
  std::vector<std::vector<size_t>> buckets(const std::vector<size_t>& indices, Key key);
  // Checks a group's options (ranges), throwing std::invalid_argument.
  virtual void check_options(const GroupOptions&) const {}
  // Checks a new parameter (index: its position across groups): check_param by default;
  // CpuOffload also takes 16-bit parameters (its float32 master copies live on the host).
  virtual void check_parameter(const Tensor& p, size_t index) const;
  // The group's lr as a float64 scalar on `device` (capturable updates read it there, so that
  // a CUDA graph's replays see the lr a scheduler sets between them): made at the group's first
  // capturable update, kept equal to the option by set_lr and load_state_dict, and by each
  // update outside a capture. Throws inside a capture when it would have to be made or changed
  // (the change would be captured and repeated): run a step first, change lr with set_lr.
  const double* device_lr(const ParamGroup& group, Device device);
  // set_found_inf's flag for `device`, or nullptr.
  const float* found_inf_on(Device device) const;
  // A zero state tensor like `param`, under the optimizer_state category.
  static Tensor make_state(const Tensor& param);
  // A zero state tensor of the given shape and dtype on `device`, under optimizer_state
  // (AdamW8bit's uint8 codes and float32 block scales).
  static Tensor make_state(const Shape& sizes, DType dtype, Device device);
  // The state tensor `name` of parameter `index` as this optimizer keeps it, for
  // load_state_dict's checks: by default the parameter's shape and dtype, whatever the name.
  // std::nullopt: this optimizer keeps no tensor of that name (load_state_dict rejects it).
  virtual std::optional<StateSpec> state_spec(size_t index, const std::string& name) const;
  // load_state_dict's last check of one parameter's restored state, before anything changes
  // (throws std::invalid_argument): AdamW8bit's four tensors come together or not at all.
  virtual void check_loaded_state(size_t /*index*/, const ParamState& /*s*/) const {}
  // Runs what an optimizer deferred past step() (CpuOffload::overlap_with_forward's updates):
  // step(), step_param(), add_param_group(), state_dict() and load_state_dict() call it first,
  // so no step starts and no state is read or replaced while an update is pending.
  virtual void finish_deferred_updates() {}
  // GradScaler::step calls it when it skips this optimizer's step (inf or NaN gradients).
  virtual void on_skipped_step() {}

  Tensor& param_at(size_t global_index);
  const Tensor& param_at(size_t global_index) const;

 private:
  void write_device_lr(size_t group);  // every device's copy of the group's lr, from the option
  struct DeviceLr {
    Tensor value;    // float64, shape {}
    double written;  // what the host last wrote there
  };
  // By (group, device type, device index).
  std::map<std::tuple<size_t, int, int>, DeviceLr> device_lr_;
  std::vector<Tensor> found_inf_;
  std::vector<ParamGroup> groups_;
  std::vector<ParamState> state_;
  std::vector<std::pair<size_t, size_t>> where_;  // global index -> (group, position)
  GroupOptions defaults_;
};

// The parameters' validation shared by optimizers and clip_grad_norm_: defined, leaf,
// float32/float64, contiguous; the gradient (when present) of the same shape, dtype, device
// and contiguous. `what` names the caller in the error; `index` is the parameter's position.
void check_param(const Tensor& p, size_t index, const char* what);
void check_grad(const Tensor& p, const Tensor& g, size_t index, const char* what);

template <typename Key>
std::vector<std::vector<size_t>> Optimizer::buckets(const std::vector<size_t>& indices, Key key) {
  std::vector<std::vector<size_t>> out;
  std::vector<std::tuple<int, int, DType, int64_t>> keys;
  for (size_t i : indices) {
    const Tensor& p = param_at(i);
    const auto k = std::make_tuple(static_cast<int>(p.device().type), p.device().index, p.dtype(),
                                   static_cast<int64_t>(key(i)));
    size_t b = 0;
    while (b < keys.size() && keys[b] != k) ++b;
    if (b == keys.size()) {
      keys.push_back(k);
      out.emplace_back();
    }
    out[b].push_back(i);
  }
  return out;
}

}  // namespace tally::optim
