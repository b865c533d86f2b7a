// GradScaler: dynamic loss scaling for mixed precision (torch.amp.GradScaler).
//
//   scaler.scale(loss).backward();
//   scaler.unscale_(opt);              // optional, e.g. before clip_grad_norm_
//   scaler.step(opt);                  // skips opt.step() when a gradient was inf/NaN
//   scaler.update();                   // backoff on inf, growth after growth_interval clean steps
//
// The scale lives in a float32 0-dim tensor per device (scale(loss) multiplies by it on the
// loss's device); a host copy of the same float is kept, since every change to it is decided
// on the host from the one found-inf read per step, so get_scale() does not synchronise.
// unscale_ is one fused multi-tensor launch per (device, dtype) over all gradients: multiply
// by 1/scale and raise a found_inf flag on the device. step() reads that flag once.
//
// capturable (for CUDA graphs, tensor/cuda/graph.h; the gradients on one device): nothing is read
// on the host. unscale_ takes 1/scale on the device, step() hands the flag to the optimizer
// (Optimizer::set_found_inf), whose fused update skips itself on the device, and update() runs
// torch's _amp_update_scale_ there (the growth tracker is a device tensor too). The scales are
// the host rule's, bit for bit; get_scale(), get_growth_tracker() and state_dict() read them
// back (a synchronisation each).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <source_location>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace tally::optim {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
  bool capturable = false;  // the file comment
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // `site`, defaulted at the caller, is the user's line the allocations are attributed to
  // (memory::CallSiteScope), as for Optimizer::step.
  //
  // loss * scale (differentiable); the loss itself when disabled.
  Tensor scale(const Tensor& loss, std::source_location site = std::source_location::current());
  // Divides the optimizer's gradients by the scale in place and records found_inf. Once
  // per optimizer per update(): a second call before update() does nothing.
  void unscale_(Optimizer& optimizer, std::source_location site = std::source_location::current());
  // Unscales if not done yet, reads found_inf (the one host read of the step) and runs
  // optimizer.step() unless a gradient was inf or NaN. Returns whether it stepped.
  bool step(Optimizer& optimizer, std::source_location site = std::source_location::current());
  // The next scale: scale * backoff_factor if any optimizer found inf/NaN since the last
  // update, else scale * growth_factor after growth_interval consecutive clean steps.
  void update();
  // Sets the scale explicitly (torch: update(new_scale)).
  void update(double new_scale);

  double get_scale() const;
  int64_t get_growth_tracker() const;
  bool is_enabled() const { return enabled_; }
  const GradScalerOptions& options() const { return opts_; }
  // The scale tensor on `device` (created on first use).
  Tensor scale_tensor(Device device);

  // PyTorch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker.
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& sd);

 private:
  struct PerOptimizer {
    bool unscaled = false;
    bool stepped = false;
    std::vector<Tensor> found_inf;  // one float32 flag per device the gradients are on
    int found = -1;                 // host value once read: 0 or 1
  };
  bool read_found_inf(PerOptimizer& st);
  void set_scale(float s);

  GradScalerOptions opts_;
  bool enabled_;
  float scale_;
  int64_t growth_tracker_ = 0;
  std::vector<Tensor> scale_tensors_;  // one per device used
  Tensor tracker_tensor_;              // capturable: the growth tracker (int64, on the device)
  Tensor growth_tracker_tensor(Device device);
  // capturable: the one device the gradients are on (set at the first unscale_)
  std::optional<Device> device_;
  std::map<const Optimizer*, PerOptimizer> per_opt_;
};

}  // namespace tally::optim
