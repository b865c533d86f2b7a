// GradScaler (see grad_scaler.h).
#include "optim/grad_scaler.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "memory/context.h"
#include "optim/multi_tensor.h"
#include "tensor/cuda/graph.h"
#include "tensor/ops.h"

namespace tally::optim {

GradScaler::GradScaler(GradScalerOptions options)
    : opts_(options), enabled_(options.enabled), scale_(static_cast<float>(options.init_scale)) {
  if (!(options.init_scale > 0))
    throw std::invalid_argument(
        fmt::format("GradScaler: init_scale {} must be positive", options.init_scale));
  if (!(options.growth_factor > 1.0))
    throw std::invalid_argument(
        fmt::format("GradScaler: growth_factor {} must be > 1", options.growth_factor));
  if (!(options.backoff_factor < 1.0 && options.backoff_factor > 0))
    throw std::invalid_argument(
        fmt::format("GradScaler: backoff_factor {} must be in (0, 1)", options.backoff_factor));
  if (options.growth_interval <= 0)
    throw std::invalid_argument(
        fmt::format("GradScaler: growth_interval {} must be positive", options.growth_interval));
}

double GradScaler::get_scale() const {
  if (!enabled_) return 1.0;
  if (opts_.capturable && device_) {
    for (const Tensor& t : scale_tensors_)
      if (t.device() == *device_) return ops::item(t);  // where update() changed it
  }
  return static_cast<double>(scale_);
}

int64_t GradScaler::get_growth_tracker() const {
  if (opts_.capturable && tracker_tensor_.defined())
    return static_cast<int64_t>(ops::item(tracker_tensor_));
  return growth_tracker_;
}

Tensor GradScaler::growth_tracker_tensor(Device device) {
  if (!tracker_tensor_.defined()) {
    // Made inside a capture, its initial value would be written again by every replay.
    if (device.type == DeviceType::cuda)
      tally::cuda::check_not_capturing(device.index, "GradScaler: the first update()");
    memory::CategoryScope category(memory::Category::optimizer_state);
    tracker_tensor_ = ops::full({}, static_cast<double>(growth_tracker_), DType::int64, device);
  }
  return tracker_tensor_;
}

Tensor GradScaler::scale_tensor(Device device) {
  for (const Tensor& t : scale_tensors_)
    if (t.device() == device) return t;
  if (opts_.capturable && device.type == DeviceType::cuda)  // as growth_tracker_tensor's
    tally::cuda::check_not_capturing(device.index, "GradScaler: the first scale()");
  memory::CategoryScope category(memory::Category::optimizer_state);
  Tensor t = ops::full({}, scale_, DType::float32, device);
  scale_tensors_.push_back(t);
  return t;
}

void GradScaler::set_scale(float s) {
  scale_ = s;
  NoGradGuard no_grad;
  for (const Tensor& t : scale_tensors_) ops::fill_(t, s);  // enqueued, no host wait
}

Tensor GradScaler::scale(const Tensor& loss, std::source_location site) {
  if (!enabled_) return loss;
  memory::CallSiteScope call_site(site);
  return tally::mul(loss, scale_tensor(loss.device()));
}

void GradScaler::unscale_(Optimizer& optimizer, std::source_location site) {
  if (!enabled_) return;
  memory::CallSiteScope call_site(site);
  PerOptimizer& st = per_opt_[&optimizer];
  if (st.unscaled) return;
  if (st.stepped)
    throw std::logic_error("GradScaler.unscale_: called after step() and before update()");
  NoGradGuard no_grad;
  memory::PhaseScope phase("optimizer");
  memory::CategoryScope category(memory::Category::temporary);
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_));
  // Bucket the gradients by (device, dtype); nothing runs before all of them are checked.
  std::vector<TensorLists> lists;
  std::vector<Tensor> touched;
  size_t index = 0;
  for (const ParamGroup& group : optimizer.param_groups())
    for (const Tensor& p : group.params) {
      const Tensor g = p.grad();
      if (g.defined()) {
        check_grad(p, g, index, "GradScaler.unscale_");
        if (opts_.capturable) {
          if (!device_) device_ = g.device();
          if (!(g.device() == *device_))
            throw std::invalid_argument(fmt::format(
                "GradScaler(capturable): gradients on {} and {}; a capturable scaler keeps its "
                "scale on one device",
                device_->str(), g.device().str()));
        }
        size_t b = 0;
        while (b < lists.size() && !(lists[b].device == g.device() && lists[b].dtype == g.dtype()))
          ++b;
        if (b == lists.size()) lists.emplace_back(g.device(), g.dtype(), 1);
        lists[b].add({g.data_ptr()}, g.numel());
        touched.push_back(g);
      }
      ++index;
    }
  for (const TensorLists& l : lists) {
    Tensor flag;
    for (const Tensor& f : st.found_inf)
      if (f.device() == l.device) flag = f;
    if (!flag.defined()) {
      flag = ops::zeros({1}, DType::float32, l.device);
      st.found_inf.push_back(flag);
    }
    // capturable: 1 / scale taken on the device, from the scale update() left there.
    optim::unscale_(l, inv_scale, opts_.capturable ? scale_tensor(l.device).data<float>() : nullptr,
                    flag);
  }
  for (const Tensor& g : touched) g.storage().bump_version();
  st.unscaled = true;
}

bool GradScaler::read_found_inf(PerOptimizer& st) {
  if (st.found < 0) {
    bool any = false;
    // The step's host read. A dry run (meta device) has no values: its steps count as finite,
    // as they do in the run it predicts when training is healthy.
    for (const Tensor& f : st.found_inf)
      any = any || (!f.device().is_meta() && ops::item(f) != 0.0);
    st.found = any ? 1 : 0;
  }
  return st.found == 1;
}

bool GradScaler::step(Optimizer& optimizer, std::source_location site) {
  memory::CallSiteScope call_site(site);  // optimizer.step() keeps it (a library line)
  if (!enabled_) {
    optimizer.step();
    return true;
  }
  PerOptimizer& st = per_opt_[&optimizer];
  if (st.stepped)
    throw std::logic_error(
        "GradScaler.step: step() has already been called since the last update()");
  unscale_(optimizer);
  if (opts_.capturable) {  // the update skips itself on the device
    optimizer.set_found_inf(st.found_inf);
    try {
      optimizer.step();
    } catch (...) {
      optimizer.set_found_inf({});
      throw;
    }
    optimizer.set_found_inf({});
    st.stepped = true;
    return true;
  }
  const bool skip = read_found_inf(st);
  if (skip)
    optimizer.on_skipped_step();
  else
    optimizer.step();
  st.stepped = true;
  return !skip;
}

void GradScaler::update() {
  if (!enabled_) return;
  if (per_opt_.empty())
    throw std::logic_error("GradScaler.update: no inf checks were recorded prior to update()");
  if (opts_.capturable) {
    // found_inf of every optimizer on the scaler's device, summed there; then
    // _amp_update_scale_ on the device.
    NoGradGuard no_grad;
    memory::CategoryScope category(memory::Category::temporary);
    Tensor found;
    for (auto& [opt, st] : per_opt_)
      for (const Tensor& f : st.found_inf) found = found.defined() ? ops::add(found, f) : f;
    per_opt_.clear();
    if (!found.defined()) return;  // no gradient was unscaled: nothing was found
    optim::amp_update_scale_(scale_tensor(found.device()), growth_tracker_tensor(found.device()),
                             found, opts_.growth_factor, opts_.backoff_factor,
                             opts_.growth_interval);
    return;
  }
  bool found = false;
  for (auto& [opt, st] : per_opt_) found = read_found_inf(st) || found;
  per_opt_.clear();
  // torch's _amp_update_scale_, in float32 like the scale tensor.
  if (found) {
    growth_tracker_ = 0;
    set_scale(scale_ * static_cast<float>(opts_.backoff_factor));
    return;
  }
  if (++growth_tracker_ == opts_.growth_interval) {
    growth_tracker_ = 0;
    const float grown = scale_ * static_cast<float>(opts_.growth_factor);
    if (std::isfinite(grown)) set_scale(grown);
  }
}

void GradScaler::update(double new_scale) {
  if (!enabled_) return;
  per_opt_.clear();
  set_scale(static_cast<float>(new_scale));
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!enabled_) return {};
  // A capturable scaler's values live on the device; get_scale() and get_growth_tracker() read
  // them there, and the host copies otherwise.
  return {{"scale", get_scale()},
          {"growth_factor", opts_.growth_factor},
          {"backoff_factor", opts_.backoff_factor},
          {"growth_interval", static_cast<double>(opts_.growth_interval)},
          {"_growth_tracker", static_cast<double>(get_growth_tracker())}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& sd) {
  if (!enabled_) return;
  if (sd.empty())
    throw std::invalid_argument(
        "GradScaler.load_state_dict: the state dict is empty (from a disabled scaler?)");
  for (const char* k :
       {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    if (!sd.count(k))
      throw std::invalid_argument(fmt::format("GradScaler.load_state_dict: missing key '{}'", k));
  opts_.growth_factor = sd.at("growth_factor");
  opts_.backoff_factor = sd.at("backoff_factor");
  opts_.growth_interval = static_cast<int64_t>(sd.at("growth_interval"));
  growth_tracker_ = static_cast<int64_t>(sd.at("_growth_tracker"));
  if (tracker_tensor_.defined()) ops::fill_(tracker_tensor_, static_cast<double>(growth_tracker_));
  set_scale(static_cast<float>(sd.at("scale")));
}

}  // namespace tally::optim
