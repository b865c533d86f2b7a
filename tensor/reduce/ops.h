// Raw selecting and statistical reductions (namespace tally::ops, no autograd): max/min
// along a dim with their indices, max/min/amax/amin over dims, argmax/argmin, var/std and
// logsumexp, plus the scatter that backpropagates through max/min along a dim. The
// differentiable versions live in tensor/reduce/autograd.h. (sum and mean are core: tensor/ops.h.)
//
// `dims` lists follow PyTorch: negative dims count from the end, an empty list means every
// dim, a dim may not appear twice. keepdim keeps each reduced dim with size 1.
// Dtypes: max/min/amax/amin/argmax/argmin take every dtype (values keep it, comparisons run
// in acc_t, NaN wins and the first index wins ties); var/std take the floating dtypes;
// logsumexp takes floating dtypes and computes integer inputs in float32. Accumulation is
// in double; results keep the input's (floating) dtype.
#pragma once

#include "tensor/elementwise/ops.h"

namespace tally {

// What max/min along a dim return (PyTorch's (values, indices) named tuple); works with
// structured bindings: `auto [v, i] = max(x, 1);`. indices are int64.
struct ValuesIndices {
  Tensor values;
  Tensor indices;
};

}  // namespace tally

namespace tally::ops {

// Largest (smallest) element along `dim` and its index (first on ties; a NaN wins, the
// first NaN's index). The reduced dim must be non-empty. A 0-D x takes dim 0 or -1.
ValuesIndices max(const Tensor& x, int64_t dim, bool keepdim = false);
ValuesIndices min(const Tensor& x, int64_t dim, bool keepdim = false);
// Over all elements: a 0-D tensor of x's dtype. x must not be empty.
Tensor max(const Tensor& x);
Tensor min(const Tensor& x);
// Largest (smallest) element over `dims` (empty = all); reduced dims must be non-empty.
Tensor amax(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor amin(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
// Index of the largest (smallest) element along `dim` (int64), or, without a dim, the
// row-major index into the flattened x (a 0-D int64 tensor).
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& x);
Tensor argmin(const Tensor& x);

// Variance over `dims` (empty = all): sum((x - mean)^2) / max(0, N - correction), N the
// number of reduced elements (correction = 1: Bessel's unbiased estimate; 0: population).
// A divisor of 0 gives inf or NaN, as PyTorch. std is its square root.
Tensor var(const Tensor& x, const Shape& dims = {}, double correction = 1.0, bool keepdim = false);
Tensor std(const Tensor& x, const Shape& dims = {}, double correction = 1.0, bool keepdim = false);

// log(sum(exp(x))) over `dims` (empty = all), stable: max + log(sum(exp(x - max))).
// All -inf gives -inf, any +inf gives +inf, an empty reduction gives -inf.
Tensor logsumexp(const Tensor& x, const Shape& dims, bool keepdim = false);

// Backward of max/min along a dim (PyTorch's value_selecting_reduction_backward): zeros of
// `input_sizes` (grad's dtype) with grad[...] written at indices[...] along `dim`. grad and
// indices have the reduced shape (size 1 at `dim` if keepdim, else without it).
Tensor value_selecting_reduction_backward(const Tensor& grad, const Tensor& indices,
                                          const Shape& input_sizes, int64_t dim, bool keepdim);

}  // namespace tally::ops
