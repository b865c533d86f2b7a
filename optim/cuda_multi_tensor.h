// CUDA twins of the CPU kernels in optim/multi_tensor.h: each is ONE launch over the whole
// tensor list (PyTorch's multi_tensor_apply): the host packs every tensor's pointers and
// length, plus the list of (tensor, chunk) work items, into one table, copies it to the
// device with one cudaMemcpyAsync into a `temporary` block from the caching allocator, and
// each thread block walks one chunk. Nothing here waits for the device.
#pragma once

#include "optim/multi_tensor.h"

namespace tally::optim::cuda {

void sgd_(const TensorLists& l, const SGDHyper& h);
void adam_(const TensorLists& l, const AdamHyper& h);
// The norm of list 0 taken as one vector, as a 0-dim tensor of the list's dtype on its device
// (a per-chunk partial pass in double, then a one-block finishing pass).
Tensor total_norm(const TensorLists& l, double norm_type);
// list 0 *= min(1, max_norm / (total + 1e-6)), the coefficient read from total_norm on the device.
void clip_scale_(const TensorLists& l, const Tensor& total_norm, double max_norm);
// list 0 *= inv_scale; sets found_inf (float32, one element, same device) to 1 when any value
// was inf or NaN.
void unscale_(const TensorLists& l, float inv_scale, const Tensor& found_inf);

}  // namespace tally::optim::cuda
