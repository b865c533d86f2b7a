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

namespace {

// One tensor widened to float32, as a one-tensor list for the fused kernels.
struct Widened {
  Tensor t;
  TensorLists list;
  explicit Widened(const Tensor& g)
      : t(ops::to(g, DType::float32)), list(g.device(), DType::float32, 1) {
    list.add({t.data_ptr()}, t.numel());
  }
};

bool is_16bit(DType t) {
  return t == DType::bfloat16 || t == DType::float16;
}

// The fused kernels take float32 and float64 lists. 16-bit gradients (a model kept in bfloat16,
// its float32 masters elsewhere: optim::CpuOffload) are widened one tensor at a time: each
// tensor's norm, then the norm of those norms (a sum for norm_type 0), in float32. One
// tensor's float32 copy at a time; no host synchronisation.
Tensor total_norm_16bit(const std::vector<Tensor>& grads, double norm_type) {
  TensorList norms;
  for (const Tensor& g : grads) norms.push_back(foreach_norm(Widened(g).list, norm_type));
  const Tensor each = ops::stack(norms);
  TensorLists l(each.device(), DType::float32, 1);
  l.add({each.data_ptr()}, each.numel());
  return norm_type == 0 ? ops::sum(each) : foreach_norm(l, norm_type);
}

}  // namespace

namespace detail {
std::pair<std::vector<Tensor>, Tensor> total_grad_norm(const std::vector<Tensor>& params,
                                                       double norm_type, const char* op) {
  if (std::isnan(norm_type) || norm_type < 0)
    throw std::invalid_argument(fmt::format("{}: invalid norm_type {}", op, norm_type));
  std::vector<Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined()) continue;
    const Tensor g = params[i].grad();
    if (!g.defined()) continue;
    check_grad(params[i], g, i, op);
    if (!grads.empty() && (!(g.device() == grads[0].device()) || g.dtype() != grads[0].dtype()))
      throw std::invalid_argument(
          fmt::format("{}: gradient of parameter {} (shape {}) is {} on {}, the first "
                      "gradient {} on {}; "
                      "one device and dtype expected",
                      op, i, g.shape_string(), dtype_name(g.dtype()), g.device().str(),
                      dtype_name(grads[0].dtype()), grads[0].device().str()));
    grads.push_back(g);
  }
  if (grads.empty()) return {grads, Tensor()};
  if (is_16bit(grads[0].dtype())) return {grads, total_norm_16bit(grads, norm_type)};
  TensorLists lists(grads[0].device(), grads[0].dtype(), 1);
  for (const Tensor& g : grads) lists.add({g.data_ptr()}, g.numel());
  return {grads, foreach_norm(lists, norm_type)};
}
}  // namespace detail

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type) {
  NoGradGuard no_grad;
  memory::CategoryScope category(memory::Category::temporary);
  const auto [grads, total] = detail::total_grad_norm(params, norm_type, "clip_grad_norm_");
  if (grads.empty()) return ops::zeros({});
  if (is_16bit(grads[0].dtype())) {
    // Each tensor scaled in float32 and stored back rounded.
    for (const Tensor& g : grads) {
      Widened w(g);
      clip_scale_(w.list, total, max_norm);
      ops::copy_(g, w.t);
      g.storage().bump_version();
    }
    return ops::to(total, grads[0].dtype());
  }
  TensorLists lists(grads[0].device(), grads[0].dtype(), 1);
  for (const Tensor& g : grads) lists.add({g.data_ptr()}, g.numel());
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
