// Raw index ops (namespace tally::ops, no autograd): gather/scatter along a dim,
// index_select/index_add, cumsum, sort/topk, flip/roll and boolean-mask reads and writes.
// The differentiable versions live in tensor/index/autograd.h. Indices are int64 (int32 is
// converted); negative indices count from the end, as in PyTorch.
#pragma once

#include <string>

#include "tensor/elementwise/ops.h"
#include "tensor/reduce/ops.h"

namespace tally::ops {

// torch.gather: out[i][j][k] = x[i][index[i][j][k]][k] (dim 1); index has x's rank and
// index.size(d) <= x.size(d) for d != dim; the result has index's shape.
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
// torch.scatter / scatter_add: a copy of x with, for every position of index,
// out[...index[i][j]...] = src[i][j] (scatter_add: += src[i][j]). src has at least index's
// sizes; index.size(d) <= x.size(d) for d != dim. Duplicate indices in scatter: one of the
// values wins (unspecified which on CUDA, as in PyTorch); scatter_add sums them.
// reduce (PyTorch's scatter_ argument): "" replaces, "add" (or "sum") adds, "multiply"
// multiplies what x holds by src.
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
               const std::string& reduce = "");
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, double value,
               const std::string& reduce = "");
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// In place: x itself is written (bumps its version).
void scatter_(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
              const std::string& reduce = "");
void scatter_(const Tensor& x, int64_t dim, const Tensor& index, double value,
              const std::string& reduce = "");
void scatter_add_(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// torch.index_select: the entries of x at the 1-D `index` along dim.
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
// torch.index_add: a copy of x with alpha * source's slices added at `index` along dim
// (source has x's shape but index.numel() at dim).
Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& source,
                 double alpha = 1.0);
void index_add_(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& source,
                double alpha = 1.0);
// torch.index_fill: a copy of x with its slices at the 1-D `index` along dim set to value;
// index_fill_ writes x itself (bumps its version).
Tensor index_fill(const Tensor& x, int64_t dim, const Tensor& index, double value);
void index_fill_(const Tensor& x, int64_t dim, const Tensor& index, double value);

// torch.cumsum along dim: x's dtype for floating x, int64 for integral or bool x.
// reverse: sums from the end (the backward of cumsum).
Tensor cumsum(const Tensor& x, int64_t dim, bool reverse = false);
// torch.cumprod along dim: the running product, dtypes as cumsum.
Tensor cumprod(const Tensor& x, int64_t dim);

// torch.sort (stable; NaN is the largest value) and torch.topk (the k largest or smallest
// along dim, sorted). indices are int64.
ValuesIndices sort(const Tensor& x, int64_t dim = -1, bool descending = false);
ValuesIndices topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true,
                   bool sorted = true);

// torch.flip over `dims`; torch.roll by `shifts` over `dims` (empty dims: the flattened
// tensor rolled by the one shift, shape kept). Both one strided copy.
Tensor flip(const Tensor& x, const Shape& dims);
Tensor roll(const Tensor& x, const Shape& shifts, const Shape& dims = {});

// torch.masked_select: the elements of x where mask (bool, broadcast with x) is true, 1-D
// in row-major order. Reads the count back to the host (the result's size depends on it).
Tensor masked_select(const Tensor& x, const Tensor& mask);
// torch.Tensor.masked_scatter_: x's elements where mask (bool, broadcast to x's shape) is
// true are taken, in order, from source's elements (read row-major; at least as many as
// mask's true count). x is written in place (bumps its version).
void masked_scatter_(const Tensor& x, const Tensor& mask, const Tensor& source);
// masked_fill in place: x[mask] = value (mask broadcast to x's shape).
void masked_fill_(const Tensor& x, const Tensor& mask, double value);

}  // namespace tally::ops
