// The differentiable index family (namespace tally): gather/scatter, index_select/index_add,
// cumsum, sort/topk (values differentiable, indices not), flip/roll and masked_select. Built
// from the raw ops of tensor/index/ops.h.
//
// Gradients: gather and index_select add the gradient back at the indices (scatter_add /
// index_add); scatter sends src the gradient at the written places and x the gradient
// elsewhere; cumsum's is the reversed cumulative sum; sort/topk route the gradient to the
// sorted positions; flip and roll map it back; masked_select puts it back under the mask.
#pragma once

#include "autograd/ops.h"
#include "tensor/index/ops.h"

namespace tally {

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index,
              CallSite site = CallSite::current());
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
               CallSite site = CallSite::current());
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, double value,
               CallSite site = CallSite::current());
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
                   CallSite site = CallSite::current());
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index,
                    CallSite site = CallSite::current());
Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& source,
                 double alpha = 1.0, CallSite site = CallSite::current());
Tensor cumsum(const Tensor& x, int64_t dim, CallSite site = CallSite::current());
// (values, indices): `auto [v, i] = sort(x, 1, true);`.
ValuesIndices sort(const Tensor& x, int64_t dim = -1, bool descending = false);
ValuesIndices topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true,
                   bool sorted = true);
Tensor flip(const Tensor& x, const Shape& dims, CallSite site = CallSite::current());
Tensor roll(const Tensor& x, const Shape& shifts, const Shape& dims = {},
            CallSite site = CallSite::current());
Tensor masked_select(const Tensor& x, const Tensor& mask, CallSite site = CallSite::current());
// In place, not recorded by autograd (as the Python item assignment): x[mask] = source's
// elements in order; x[mask] = value.
using ops::masked_fill_;
using ops::masked_scatter_;

}  // namespace tally
