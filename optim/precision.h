// The precision and optimizer levers of a training loop, by name, as the example programs'
// flags and the A/B library (ab/ab.h) spell them: --amp off|fp16|bf16 (Precision: autocast
// and, for fp16, dynamic loss scaling), --optimizer sgd|adam|adamw|adamw8bit, and
// --step-in-backward's constraints. Errors name the flag.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <source_location>
#include <stdexcept>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "memory/context.h"
#include "optim/adam.h"
#include "optim/adamw8bit.h"
#include "optim/clip_grad.h"
#include "optim/cpu_offload.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"
#include "optim/sgd.h"
#include "optim/step_in_backward.h"

namespace tally::optim {

// --amp off|fp16|bf16: the autocast dtype (nullopt: off).
inline std::optional<DType> parse_amp(const std::string& s) {
  if (s == "off" || s == "none" || s == "fp32") return std::nullopt;
  if (s == "fp16") return DType::float16;
  if (s == "bf16") return DType::bfloat16;
  throw std::invalid_argument(fmt::format("--amp: expected off, fp16 or bf16, got '{}'", s));
}

// --optimizer NAME: the optimizers the programs offer (`allowed`, e.g. {"sgd", "adam", "adamw",
// "adamw8bit"}); an unknown name is an error naming the flag and the choices.
inline void check_optimizer(const std::string& name, const std::vector<std::string>& allowed) {
  if (std::find(allowed.begin(), allowed.end(), name) != allowed.end()) return;
  std::string list;
  for (const std::string& n : allowed) list += (list.empty() ? "" : ", ") + n;
  throw std::invalid_argument(fmt::format("--optimizer: expected one of {}, got '{}'", list, name));
}
// The optimizer `name` over `params`: SGD with `sgd`'s options, Adam / AdamW / AdamW8bit
// (block-wise 8-bit moments, optim/adamw8bit.h) with `adam`'s; `adamw:cpu` and
// `adamw8bit:cpu` keep the master weights and the moments in pinned host memory and update them
// there (optim/cpu_offload.h).
inline std::unique_ptr<Optimizer> make_optimizer(const std::string& name,
                                                 std::vector<Tensor> params,
                                                 const AdamOptions& adam, const SGDOptions& sgd) {
  check_optimizer(name, {"sgd", "adam", "adamw", "adamw8bit", "adamw:cpu", "adamw8bit:cpu"});
  if (name == "adamw:cpu" || name == "adamw8bit:cpu")
    return std::make_unique<CpuOffload>(std::move(params), adam,
                                        CpuOffloadOptions{.adamw8bit = name == "adamw8bit:cpu"});
  if (name == "sgd") return std::make_unique<SGD>(std::move(params), sgd);
  if (name == "adam") return std::make_unique<Adam>(std::move(params), adam);
  if (name == "adamw8bit") return std::make_unique<AdamW8bit>(std::move(params), adam);
  return std::make_unique<AdamW>(std::move(params), adam);
}
// --step-in-backward: what it cannot be combined with, named (optim/step_in_backward.h).
inline void check_step_in_backward(bool on, const std::string& amp, double clip) {
  if (!on) return;
  if (amp == "fp16" || amp == "auto")
    throw std::invalid_argument(fmt::format(
        "--step-in-backward with --amp {}: fp16 loss scaling must see every gradient before any "
        "step; use --amp bf16 or off",
        amp));
  if (clip > 0)
    throw std::invalid_argument(
        "--step-in-backward with --clip: clipping by the total norm needs every gradient before "
        "any step; use --clip 0");
}

// Mixed precision for one training loop: an autocast region around the forward and, for
// fp16, dynamic loss scaling.
class Precision {
 public:
  // capturable: fp16's GradScaler decides on the device (--cuda-graphs; optim/grad_scaler.h).
  Precision(std::optional<DType> amp, Device device, bool capturable = false)
      : amp_(amp),
        device_(device),
        scaler_(GradScalerOptions{.enabled = amp && *amp == DType::float16,
                                  .capturable = capturable}) {}

  bool enabled() const { return amp_.has_value(); }
  std::optional<DType> dtype() const { return amp_; }
  std::string name() const { return !amp_ ? "fp32" : (*amp_ == DType::float16 ? "fp16" : "bf16"); }
  // The autocast guard for a forward (disabled when amp is off).
  AutocastGuard autocast() const {
    return AutocastGuard(device_.type, amp_.value_or(DType::bfloat16), amp_.has_value());
  }
  // From now on `opt` steps each parameter inside backward (optim/step_in_backward.h);
  // backward_and_step then only runs backward.
  void step_in_backward(Optimizer& opt) {
    if (scaler_.is_enabled())
      throw std::invalid_argument("step-in-backward cannot be combined with fp16 loss scaling");
    sib_ = std::make_unique<StepInBackward>(opt);
  }
  // backward (scaled for fp16), clipping of the gradients' total norm to `clip` (0: off) and
  // the optimizer step (skipped on inf/NaN for fp16). Their allocations name the caller's line
  // (`site`), not this file's.
  void backward_and_step(const Tensor& loss, Optimizer& opt, double clip = 0,
                         std::source_location site = std::source_location::current()) {
    backward(loss, "backward", site);
    step(opt, clip, site);
  }
  // The two halves, for gradient accumulation (several backwards, one step): backward of
  // `loss` (scaled for fp16) in the phase `phase` ("backward", "backward.0", ...)...
  void backward(const Tensor& loss, std::string_view phase = "backward",
                std::source_location site = std::source_location::current()) {
    memory::PhaseScope scope(phase);
    scaler_.scale(loss, site).backward(Tensor(), false, site);
  }
  // ... then the clipping and the optimizer step over the summed gradients (nothing with
  // step-in-backward, whose hooks stepped each parameter already).
  void step(Optimizer& opt, double clip = 0,
            std::source_location site = std::source_location::current()) {
    if (sib_) return;
    if (clip > 0) {
      scaler_.unscale_(opt, site);
      // A host optimizer whose updates wait for the forward folds the coefficient into them:
      // the gradients it sent during backward are not rewritten, so not sent again, and every
      // update can wait (the fold costs its 8-bit update about 5%: not the default).
      auto* host = dynamic_cast<CpuOffload*>(&opt);
      if (host && host->overlaps_forward()) {
        host->clip_grad_norm_(clip);
      } else {
        std::vector<Tensor> params;
        for (const ParamGroup& g : opt.param_groups())
          params.insert(params.end(), g.params.begin(), g.params.end());
        clip_grad_norm_(params, clip);
      }
    }
    scaler_.step(opt, site);
    scaler_.update();
  }
  GradScaler& scaler() { return scaler_; }

 private:
  std::optional<DType> amp_;
  Device device_;
  GradScaler scaler_;
  std::unique_ptr<StepInBackward> sib_;
};

}  // namespace tally::optim
