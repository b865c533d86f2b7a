// Meta kernels of the fused optimizer updates (tensor/meta/target.h): on a CUDA target each
// fused launch (AdamW8bit's too) uploads its chunk table into a `temporary` block
// (optim/cuda_multi_tensor.cu), and the total norm takes a float64 partial per chunk; the CPU
// kernels allocate only the total norm's 0-dim result.
#include "memory/context.h"
#include "optim/multi_tensor.h"
#include "tensor/meta/cost.h"
#include "tensor/meta/target.h"
#include "tensor/ops.h"

namespace tally::optim::meta {

namespace {

bool replays_cuda(const TensorLists& l) {
  return memory::meta_target_of(l.device).type == DeviceType::cuda;
}

double elements_of(const TensorLists& l) {
  double elements = 0;
  for (const int64_t n : l.numels) elements += static_cast<double>(n);
  return elements;
}

// The chunk table's block, held for the launch; and the launch's predicted time, moving
// `bytes` (by default every list read and, but the gradient, written once), and at least
// `element_seconds` per element (the target's calibrated update time, tensor/meta/cost.h).
Storage upload(const TensorLists& l, double bytes_moved = -1, double element_seconds = 0) {
  if (bytes_moved < 0)
    bytes_moved = elements_of(l) * static_cast<double>(dtype_size(l.dtype)) * (2.0 * l.depth - 1);
  tally::meta::cost(l.device, l.dtype, 0, bytes_moved, false, elements_of(l) * element_seconds);
  const size_t bytes = chunk_table_bytes(l);
  if (!replays_cuda(l) || bytes == 0) return {};
  memory::CategoryScope category(memory::Category::temporary);
  return Storage::allocate(bytes, l.device);
}

void sgd(const TensorLists& l, const SGDHyper& /*h*/) {
  upload(l);
}

void adam(const TensorLists& l, const AdamHyper& /*h*/) {
  upload(l, -1, tally::meta::rates_of(l.device).adam_element_seconds);
}

// The same chunk table as Adam's (the CUDA launch walks it by quantization block). Per
// element: the parameter read and written, the gradient read, two codes read and written;
// per block two scales read and written.
void adamw8bit(const TensorLists& l, const AdamW8bitHyper& h) {
  double blocks = 0;
  for (const int64_t n : l.numels)
    blocks += static_cast<double>((n + h.block_size - 1) / h.block_size);
  upload(l, elements_of(l) * (3 * 4 + 2 * 2) + blocks * 2 * 2 * 4,
         tally::meta::rates_of(l.device).adamw8bit_element_seconds);
}

Tensor total_norm(const TensorLists& l, double /*norm_type*/) {
  if (!replays_cuda(l)) return ops::full({}, 0.0, l.dtype, l.device);  // the CPU kernel's result
  memory::CategoryScope category(memory::Category::temporary);
  Tensor out = ops::zeros({}, l.dtype, l.device);
  const Storage table = upload(l);
  if (const int64_t chunks = chunk_count(l); chunks > 0)
    ops::empty({chunks}, DType::float64, l.device);
  return out;
}

void clip_scale(const TensorLists& l, const Tensor& /*total_norm*/, double /*max_norm*/) {
  upload(l);
}

void unscale(const TensorLists& l, float /*inv_scale*/, const float* /*scale*/,
             const Tensor& /*found_inf*/) {
  upload(l);
}

void update_scale(const Tensor&, const Tensor&, const Tensor&, double, double, int64_t) {}

}  // namespace

const MultiTensorKernels multi_tensor_kernels{TALLY_MULTI_TENSOR_KERNELS};

}  // namespace tally::optim::meta
