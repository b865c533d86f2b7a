// Gradient clipping (torch.nn.utils.clip_grad_norm_ / clip_grad_value_).
#pragma once

#include <limits>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace tally::optim {

// Scales the gradients of `params` (those that have one) in place so that their norm,
// taken as one vector, is at most max_norm: grads *= min(1, max_norm / (total + 1e-6)).
// Returns the total norm before clipping as a 0-dim tensor of the gradients' dtype on their
// device. On CUDA this is two fused multi-tensor launches plus one scaling launch and no
// host synchronisation (the coefficient is read on the device). norm_type: any p > 0, 0, or
// infinity. All gradients must share one device and dtype. 16-bit gradients are reduced and
// scaled in float32, one tensor at a time, each stored back rounded.
Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0);

namespace detail {
// clip_grad_norm_'s first half (`op` names the caller in errors): the gradients of `params` that
// exist, checked (one device and dtype), and their total norm as clip_grad_norm_ scales by it,
// in float32 for 16-bit gradients (else their dtype); undefined when there is none.
// optim::CpuOffload::clip_grad_norm_ folds the same coefficient into its host update.
std::pair<std::vector<Tensor>, Tensor> total_grad_norm(const std::vector<Tensor>& params,
                                                       double norm_type, const char* op);
}  // namespace detail

// Clamps every gradient to [-clip_value, clip_value] in place.
void clip_grad_value_(const std::vector<Tensor>& params, double clip_value);

inline constexpr double kInfNorm = std::numeric_limits<double>::infinity();

}  // namespace tally::optim
