// The fused optimizer kernels' common language: a list of tensors (each a few pointers of
// the same length: param, grad, state...) and the per-launch hyperparameters, with the
// kernel table (CPU reference, CUDA twin) and the named ops that dispatch to it. All tensors of a
// list share one device and one dtype (float32 or float64) and are contiguous; AdamW8bit's
// lists add its uint8 codes and float32 block scales to float32 parameters.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "tensor/tensor.h"

namespace tally::optim {

inline constexpr int kMaxListDepth = 6;

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
// lr_device (capturable optimizers, Adam's too): the lr read on the list's device (a float64
// scalar the optimizer keeps equal to its option), so that a CUDA graph's replays see what a
// scheduler sets between them; `lr` is then the same value, for the host's own uses.
struct SGDHyper {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false, maximize = false;
  bool first_step = false;  // momentum buffers are new: buf = grad
  const double* lr_device = nullptr;
  // A capturable GradScaler's decision, made on the device (Adam's too): the update does
  // nothing (Adam's step count included) when *found_inf != 0.
  const float* found_inf = nullptr;
};

// Adam / AdamW (torch.optim.Adam(W), _single_tensor_adam). Lists: param, grad, exp_avg,
// exp_avg_sq[, max_exp_avg_sq][, step]. Bias corrections come from the host-side step count,
// or with `capturable` (PyTorch's capturable=True) from each tensor's own step, a float32
// scalar on its device (the last list) that the update first adds 1 to: a CUDA graph that
// replays the update then counts its steps without the host.
struct AdamHyper {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool decoupled = false;  // AdamW: param *= 1 - lr * weight_decay
  bool amsgrad = false, maximize = false;
  bool capturable = false;
  int64_t step = 1;
  const double* lr_device = nullptr;  // capturable: as SGDHyper's
  const float* found_inf = nullptr;   // as SGDHyper's
};

// AdamW8bit (bitsandbytes' AdamW8bit, block-wise quantized states). Lists: param, grad (float32),
// exp_avg, exp_avg_sq (uint8 codes, one per element), exp_avg_absmax, exp_avg_sq_absmax
// (float32, one per block of block_size elements; the last block may be short). Per block:
// each moment is dequantized (map[code] * absmax: the signed map for exp_avg, the unsigned
// for exp_avg_sq), updated by adam_element's AdamW in float32, the parameter moved with the
// updated moments; then the new absmax is the block's largest |moment| and each code the
// nearest map entry to moment / absmax (update_math.h).
struct AdamW8bitHyper {
  AdamHyper adam;  // decoupled; no amsgrad
  int64_t block_size = 256;
};
// block_size: a power of two from kMin8bitBlock to kMax8bitBlock (it divides kChunkSize).
inline constexpr int64_t kMin8bitBlock = 64, kMax8bitBlock = 4096;

// The 256-entry code books of the 8-bit states: bitsandbytes' dynamic (tree) quantization
// maps, create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8), sorted ascending.
// Seven decades 10^-6..1 of linearly spaced fractions, finer in the larger decades, plus 0
// and 1; the signed map mirrors them (its most negative code is -0.99297, not -1).
std::array<float, 256> create_dynamic_map(bool is_signed);
struct DynamicMaps {
  float signed_map[256];    // exp_avg's
  float unsigned_map[256];  // exp_avg_sq's
};
const DynamicMaps& dynamic_maps();  // made once

// The fused kernels' table: one signature each, a CPU reference (optim/multi_tensor.cpp)
// and a CUDA twin (optim/cuda_multi_tensor.cu), each one pass (on CUDA one launch, PyTorch's
// multi_tensor_apply) over the whole list. Registered in optim/multi_tensor.cpp.
struct MultiTensorKernels {
  void (*sgd)(const TensorLists& l, const SGDHyper& h);
  void (*adam)(const TensorLists& l, const AdamHyper& h);
  void (*adamw8bit)(const TensorLists& l, const AdamW8bitHyper& h);
  // The norm of list 0 taken as one vector, as a 0-dim tensor of the list's dtype on its
  // device (sums in double).
  Tensor (*total_norm)(const TensorLists& l, double norm_type);
  // list 0 *= clip_coef(total_norm, max_norm) (update_math.h), total_norm from total_norm().
  void (*clip_scale)(const TensorLists& l, const Tensor& total_norm, double max_norm);
  // list 0 *= inv_scale; sets found_inf (float32, one element, on the list's device) to 1 when
  // any value (before scaling) was inf or NaN, and leaves it alone otherwise. With `scale` (a
  // float32 on the device: a capturable GradScaler's), inv_scale is 1 / *scale, taken there.
  void (*unscale)(const TensorLists& l, float inv_scale, const float* scale,
                  const Tensor& found_inf);
  // torch's _amp_update_scale_ on the scale's device (float32 arithmetic, as GradScaler's host
  // rule): when *found_inf != 0, scale *= backoff_factor and growth_tracker = 0; else
  // growth_tracker += 1 and, at growth_interval, scale *= growth_factor (if finite) and
  // growth_tracker = 0. scale float32 {}, growth_tracker int64 {}, found_inf float32 {1}.
  void (*update_scale)(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval);
};
// The table's entries in member order, each the backend's kernel of the member's name: each
// backend defines `const MultiTensorKernels multi_tensor_kernels{TALLY_MULTI_TENSOR_KERNELS};`,
// so the list of kernels is written once.
#define TALLY_MULTI_TENSOR_KERNELS                                                \
  .sgd = &sgd, .adam = &adam, .adamw8bit = &adamw8bit, .total_norm = &total_norm, \
  .clip_scale = &clip_scale, .unscale = &unscale, .update_scale = &update_scale
// The chunk table a fused CUDA launch uploads (optim/cuda_multi_tensor.cu) into a `temporary`
// block: one entry per tensor, one chunk per kChunkSize elements of each (AdamW8bit's launch
// walks the same table with one thread block per quantization block of each chunk).
inline constexpr int64_t kChunkSize = 65536;  // elements per thread block
static_assert(kChunkSize % kMax8bitBlock == 0, "a chunk holds whole quantization blocks");
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
// The registered CPU kernels: Adam(W) and AdamW8bit over every core where the update allows
// (optim/cpu_adam.h: not capturable, no device lr; bit-identical to the serial loops).
extern const MultiTensorKernels multi_tensor_kernels;  // optim/multi_tensor.cpp
// The serial loops, one element after another: the reference the threaded kernels equal.
extern const MultiTensorKernels serial_multi_tensor_kernels;
}  // namespace cpu
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
              const float* scale,                     //  check_and_unscale_"
              const Tensor& found_inf);
// "_amp_update_scale_" (MultiTensorKernels::update_scale), on the scale's device.
void amp_update_scale_(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval);
// "_fused_adamw8bit_" (checks the block size and the list's depth first)
void fused_adamw8bit_(const TensorLists& l, const AdamW8bitHyper& h);

}  // namespace tally::optim
