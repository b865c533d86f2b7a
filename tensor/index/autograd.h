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
// reduce: "" replaces, "add"/"sum" adds, "multiply" multiplies (ops::scatter).
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
               const std::string& reduce = "", CallSite site = CallSite::current());
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, double value,
               const std::string& reduce = "", CallSite site = CallSite::current());
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
                   CallSite site = CallSite::current());
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index,
                    CallSite site = CallSite::current());
Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& source,
                 double alpha = 1.0, CallSite site = CallSite::current());
Tensor index_fill(const Tensor& x, int64_t dim, const Tensor& index, double value,
                  CallSite site = CallSite::current());
// value a 0-dim tensor (read back to the host, as PyTorch's); its gradient is the sum of the
// output's gradient at the filled places.
Tensor index_fill(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& value,
                  CallSite site = CallSite::current());
// x[..., mask, ...], PyTorch's boolean mask index at dim: mask (bool, k >= 1 dims) covers x's
// dims dim .. dim + k - 1 with the same sizes; they become one dim holding the true entries in
// row-major order. Differentiable (index_select); reads the mask back to the host, as the
// result's size depends on it. std::out_of_range when the mask does not fit x there.
Tensor index_mask(const Tensor& x, int64_t dim, const Tensor& mask,
                  CallSite site = CallSite::current());
// x[..., mask, ...] = values out of place (PyTorch's index_put with a boolean mask at dim):
// a copy of x with index_mask(x, dim, mask)'s entries replaced by `values` (broadcast to that
// shape, converted to x's dtype). Differentiable in x (the entries not written) and values.
Tensor index_mask_put(const Tensor& x, int64_t dim, const Tensor& mask, const Tensor& values,
                      CallSite site = CallSite::current());
Tensor cumsum(const Tensor& x, int64_t dim, CallSite site = CallSite::current());
// Its gradient handles zeros in x exactly (no division by them), as PyTorch's.
Tensor cumprod(const Tensor& x, int64_t dim, CallSite site = CallSite::current());
// (values, indices): `auto [v, i] = sort(x, 1, true);`.
ValuesIndices sort(const Tensor& x, int64_t dim = -1, bool descending = false);
ValuesIndices topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true,
                   bool sorted = true);
Tensor flip(const Tensor& x, const Shape& dims, CallSite site = CallSite::current());
Tensor roll(const Tensor& x, const Shape& shifts, const Shape& dims = {},
            CallSite site = CallSite::current());
Tensor masked_select(const Tensor& x, const Tensor& mask, CallSite site = CallSite::current());
// In place, not recorded by autograd (as the Python item assignment): x[mask] = source's
// elements in order; x[mask] = value; scatter_, index_add_, index_fill_ (ops::).
using ops::index_add_;
using ops::index_fill_;
using ops::masked_fill_;
using ops::masked_scatter_;
using ops::scatter_;

}  // namespace tally
