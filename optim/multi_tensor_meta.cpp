// Meta kernels of the fused optimizer updates (tensor/meta/target.h): on a CUDA target each
// fused launch uploads its chunk table into a `temporary` block (optim/cuda_multi_tensor.cu),
// and the total norm takes a float64 partial per chunk; the CPU kernels allocate only the
// total norm's 0-dim result.
#include "memory/context.h"
#include "optim/multi_tensor.h"
#include "tensor/meta/target.h"
#include "tensor/ops.h"

namespace tally::optim::meta {

namespace {

bool replays_cuda(const TensorLists& l) {
  return memory::meta_target_of(l.device).type == DeviceType::cuda;
}

// The chunk table's block, held for the launch; and the launch's predicted time: every
// list read and, but the gradient, written once.
Storage upload(const TensorLists& l) {
  double elements = 0;
  for (const int64_t n : l.numels) elements += static_cast<double>(n);
  tally::meta::cost(l.device, l.dtype, 0,
                    elements * static_cast<double>(dtype_size(l.dtype)) * (2.0 * l.depth - 1));
  const size_t bytes = chunk_table_bytes(l);
  if (!replays_cuda(l) || bytes == 0) return {};
  memory::CategoryScope category(memory::Category::temporary);
  return Storage::allocate(bytes, l.device);
}

void sgd(const TensorLists& l, const SGDHyper& /*h*/) {
  upload(l);
}

void adam(const TensorLists& l, const AdamHyper& /*h*/) {
  upload(l);
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

void unscale(const TensorLists& l, float /*inv_scale*/, const Tensor& /*found_inf*/) {
  upload(l);
}

}  // namespace

const MultiTensorKernels multi_tensor_kernels{
    .sgd = &sgd,
    .adam = &adam,
    .total_norm = &total_norm,
    .clip_scale = &clip_scale,
    .unscale = &unscale,
};

}  // namespace tally::optim::meta
