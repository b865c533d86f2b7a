// Meta kernels of the core ops (tensor/meta/target.h). Fills, maps and random fills write
// nothing and allocate nothing on either backend. A copy onto a meta tensor from the host
// replays CUDA's host-to-device copy, which stages a non-contiguous destination through a
// contiguous device buffer. sum: the CPU kernel allocates nothing; the CUDA kernel's
// float64 partial sums (a few per output element, sized by the device's SM count) are not
// replayed: they are small and short-lived.
#include "tensor/elementwise/kernels.h"
#include "tensor/meta/target.h"

namespace tally::meta {

namespace {

void copy(const Tensor& dst, const Tensor& src) {
  cost(dst, 0, tensor_bytes(dst, src));
  if (replays_cuda(dst) && !src.device().is_meta() && !dst.is_contiguous())
    alloc_scratch(dst.numel(), dst.dtype(), dst.device());
}

void copy_many(const TensorList& dsts, const TensorList& srcs) {
  for (size_t i = 0; i < dsts.size(); ++i) copy(dsts[i], srcs[i]);
}

}  // namespace

const ElementwiseKernels elementwise_kernels{.copy = &copy,
                                             .copy_many = &copy_many,
                                             .fill = nothing,
                                             .rand_uniform = nothing,
                                             .rand_normal = nothing,
                                             .rand_int = nothing,
                                             .binary = nothing,
                                             .binary_scalar = nothing,
                                             .unary = nothing,
                                             .affine = nothing,
                                             .clamp = nothing,
                                             .where = nothing,
                                             .lerp = nothing,
                                             .sum = nothing};

}  // namespace tally::meta
