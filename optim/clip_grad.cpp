// clip_grad_norm_ and clip_grad_value_ over the fused multi-tensor kernels (see clip_grad.h).
#include "optim/clip_grad.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "autograd/grad_mode.h"
#include "memory/context.h"
#include "optim/multi_tensor.h"
#include "optim/optimizer.h"
#include "optim/update_math.h"
#include "tensor/ops.h"

namespace tally::optim {

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type) {
  if (std::isnan(norm_type) || norm_type < 0)
    throw std::invalid_argument(fmt::format("clip_grad_norm_: invalid norm_type {}", norm_type));
  NoGradGuard no_grad;
  memory::CategoryScope category(memory::Category::temporary);
  std::vector<Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined()) continue;
    const Tensor g = params[i].grad();
    if (!g.defined()) continue;
    check_grad(params[i], g, i, "clip_grad_norm_");
    if (!grads.empty() && (!(g.device() == grads[0].device()) || g.dtype() != grads[0].dtype()))
      throw std::invalid_argument(
          fmt::format("clip_grad_norm_: gradient of parameter {} (shape {}) is {} on {}, the first "
                      "gradient {} on {}; "
                      "one device and dtype expected",
                      i, g.shape_string(), dtype_name(g.dtype()), g.device().str(),
                      dtype_name(grads[0].dtype()), grads[0].device().str()));
    grads.push_back(g);
  }
  if (grads.empty()) return ops::zeros({});
  TensorLists lists(grads[0].device(), grads[0].dtype(), 1);
  for (const Tensor& g : grads) lists.add({g.data_ptr()}, g.numel());
  const Tensor total = foreach_norm(lists, norm_type);
  clip_scale_(lists, total, max_norm);
  for (const Tensor& g : grads) g.storage().bump_version();
  return total;
}

void clip_grad_value_(const std::vector<Tensor>& params, double clip_value) {
  NoGradGuard no_grad;
  memory::CategoryScope category(memory::Category::temporary);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined()) continue;
    const Tensor g = params[i].grad();
    if (!g.defined()) continue;
    check_grad(params[i], g, i, "clip_grad_value_");
    ops::copy_(g, ops::clamp(g, -clip_value, clip_value));
  }
}

}  // namespace tally::optim
