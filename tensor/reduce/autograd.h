// The differentiable reduce family (namespace tally): max/min along a dim with indices,
// max/min over everything, amax/amin, argmax/argmin (no gradient), var/std and logsumexp.
// Built from the raw ops of tensor/reduce/ops.h; sum and mean are core (autograd/ops.h).
//
// Gradients: max/min along a dim send the gradient to the selected index (first on ties),
// saving the indices; max/min over everything and amax/amin split it evenly among the
// tied extreme elements, as PyTorch does, saving the input and the result.
#pragma once

#include "tensor/elementwise/autograd.h"
#include "tensor/reduce/ops.h"

namespace tally {

// (values, indices) along `dim`: `auto [values, indices] = max(x, 1);`.
ValuesIndices max(const Tensor& x, int64_t dim, bool keepdim = false);
ValuesIndices min(const Tensor& x, int64_t dim, bool keepdim = false);
// Over all elements (0-D result).
Tensor max(const Tensor& x, CallSite site = CallSite::current());
Tensor min(const Tensor& x, CallSite site = CallSite::current());
// Over `dims` (empty = all).
Tensor amax(const Tensor& x, const Shape& dims = {}, bool keepdim = false,
            CallSite site = CallSite::current());
Tensor amin(const Tensor& x, const Shape& dims = {}, bool keepdim = false,
            CallSite site = CallSite::current());
// int64 indices; without a dim, into the flattened input. No gradient: the raw ops are the
// differentiable ones.
using ops::argmax;
using ops::argmin;

// torch.var / torch.std over `dims` (empty = all), divisor max(0, N - correction).
Tensor var(const Tensor& x, const Shape& dims = {}, double correction = 1.0, bool keepdim = false,
           CallSite site = CallSite::current());
Tensor std(const Tensor& x, const Shape& dims = {}, double correction = 1.0, bool keepdim = false,
           CallSite site = CallSite::current());

// log(sum(exp(x))) over `dims` (empty = all) or one dim, numerically stable.
Tensor logsumexp(const Tensor& x, const Shape& dims, bool keepdim = false,
                 CallSite site = CallSite::current());
Tensor logsumexp(const Tensor& x, int64_t dim, bool keepdim = false,
                 CallSite site = CallSite::current());

}  // namespace tally
