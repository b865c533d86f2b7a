// The fused optimizer kernels' common language: a list of tensors (each a few pointers of
// the same length: param, grad, state...) and the per-launch hyperparameters, with the
// kernel table (CPU reference, CUDA twin) and the named ops that dispatch to it. All tensors of a
// list share one device and one dtype (float32 or float64) and are contiguous.
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

// The fused kernels' table: one signature each, a CPU reference (optim/multi_tensor.cpp)
// and a CUDA twin (optim/cuda_multi_tensor.cu), each one pass (on CUDA one launch, PyTorch's
// multi_tensor_apply) over the whole list. Registered in optim/multi_tensor.cpp.
struct MultiTensorKernels {
  void (*sgd)(const TensorLists& l, const SGDHyper& h);
  void (*adam)(const TensorLists& l, const AdamHyper& h);
  // The norm of list 0 taken as one vector, as a 0-dim tensor of the list's dtype on its
  // device (sums in double).
  Tensor (*total_norm)(const TensorLists& l, double norm_type);
  // list 0 *= clip_coef(total_norm, max_norm) (update_math.h), total_norm from total_norm().
  void (*clip_scale)(const TensorLists& l, const Tensor& total_norm, double max_norm);
  // list 0 *= inv_scale; sets found_inf (float32, one element, on the list's device) to 1 when
  // any value (before scaling) was inf or NaN, and leaves it alone otherwise.
  void (*unscale)(const TensorLists& l, float inv_scale, const Tensor& found_inf);
};
// The chunk table a fused CUDA launch uploads (optim/cuda_multi_tensor.cu) into a `temporary`
// block: one entry per tensor, one chunk per kChunkSize elements of each.
inline constexpr int64_t kChunkSize = 65536;  // elements per thread block
struct ChunkEntry {
  void* ptr[kMaxListDepth];
  int64_t numel;
};
struct Chunk {
  int32_t tensor;
  int32_t chunk;
};
// The chunks of l's tensors, and the table's bytes (0 when there are no chunks).
int64_t chunk_count(const TensorLists& l);
size_t chunk_table_bytes(const TensorLists& l);

namespace cpu {
extern const MultiTensorKernels multi_tensor_kernels;  // optim/multi_tensor.cpp
}
namespace meta {
extern const MultiTensorKernels multi_tensor_kernels;  // optim/multi_tensor_meta.cpp
}
namespace cuda {
extern const MultiTensorKernels multi_tensor_kernels;  // optim/cuda_multi_tensor.cu
}

// The fused steps as named ops: each enters the dispatch point (so the profiler's operator
// table and Chrome trace show it, under PyTorch's names) and runs the list's device's kernel.
void fused_sgd_(const TensorLists& l, const SGDHyper& h);     // "_fused_sgd_"
void fused_adam_(const TensorLists& l, const AdamHyper& h);   // "_fused_adam_" / "_fused_adamw_"
Tensor foreach_norm(const TensorLists& l, double norm_type);  // "_foreach_norm"
void clip_scale_(const TensorLists& l, const Tensor& total_norm,  // "_foreach_mul_"
                 double max_norm);
void unscale_(const TensorLists& l, float inv_scale,  // "_amp_foreach_non_finite_
              const Tensor& found_inf);               //  check_and_unscale_"

}  // namespace tally::optim
