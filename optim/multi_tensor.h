// The fused optimizer kernels' common language: a list of tensors (each a few pointers of
// the same length: param, grad, state...) and the per-launch hyperparameters, with the CPU
// kernels (plain loops, the reference). optim/cuda_multi_tensor.h has the CUDA twins, each
// ONE launch over the whole list (PyTorch's multi_tensor_apply). All tensors of a list share
// one device and one dtype (float32 or float64) and are contiguous.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "tensor/tensor.h"

namespace tally::optim {

inline constexpr int kMaxListDepth = 5;

struct TensorLists {
  Device device;
  DType dtype = DType::float32;
  int depth = 0;  // pointers per tensor
  std::vector<std::array<void*, kMaxListDepth>> ptrs;
  std::vector<int64_t> numels;

  TensorLists(Device d, DType t, int depth_) : device(d), dtype(t), depth(depth_) {}
  // One tensor: `depth` pointers to `numel` elements each.
  void add(std::initializer_list<void*> p, int64_t numel);
  size_t size() const { return numels.size(); }
  bool empty() const { return numels.empty(); }
};

// SGD (torch.optim.SGD, _single_tensor_sgd). Lists: param, grad[, momentum_buffer].
struct SGDHyper {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false, maximize = false;
  bool first_step = false;  // momentum buffers are new: buf = grad
};

// Adam / AdamW (torch.optim.Adam(W), _single_tensor_adam). Lists: param, grad, exp_avg,
// exp_avg_sq[, max_exp_avg_sq]. Bias corrections come from the host-side step count.
struct AdamHyper {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool decoupled = false;  // AdamW: param *= 1 - lr * weight_decay
  bool amsgrad = false, maximize = false;
  int64_t step = 1;
};

namespace cpu {
void sgd_(const TensorLists& l, const SGDHyper& h);
void adam_(const TensorLists& l, const AdamHyper& h);
// sum |x|^p (p = inf: max |x|) over list 0 of every tensor, in double.
double norm_power_sum(const TensorLists& l, double norm_type);
// x *= clip_coef(total_norm, max_norm) over list 0 (update_math.h), in the element type.
void clip_scale_(const TensorLists& l, double total_norm, double max_norm);
// x *= inv_scale over list 0; true if any value (before scaling) is inf or NaN.
bool unscale_(const TensorLists& l, float inv_scale);
}  // namespace cpu

}  // namespace tally::optim
