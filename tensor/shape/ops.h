// Raw shape ops (namespace tally::ops, no autograd): joining tensors (cat, stack: allocate
// the result) and cutting them (split, chunk: views into the input, no allocation). The
// differentiable versions live in tensor/shape/autograd.h.
#pragma once

#include "tensor/elementwise/ops.h"

namespace tally::ops {

// Concatenates along `dim`; all tensors have the same rank and sizes except in `dim`.
// dtypes promote as in PyTorch (promote_types over all inputs), e.g. float32 with float64
// gives float64. As in PyTorch, 1-D empty tensors (shape [0]) are skipped whatever the
// others' rank. All tensors on one device; an empty list is an error.
Tensor cat(const TensorList& tensors, int64_t dim = 0);
// Joins equal-shaped tensors along a new dimension `dim` (in [-(rank+1), rank]); dtypes
// promote as in cat.
Tensor stack(const TensorList& tensors, int64_t dim = 0);
// Views of t along `dim`, each split_size long (the last may be shorter). split_size 0 is
// allowed only for a dimension of size 0.
TensorList split(const Tensor& t, int64_t split_size, int64_t dim = 0);
// Views of t along `dim` with the given sizes (which must sum to t.size(dim)). Note: a
// braced single value, split(t, {2}), picks the split_size overload, as an int would.
TensorList split(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim = 0);
// torch.chunk: split into ceil(n / chunks)-long views (so possibly fewer than `chunks`
// pieces, the last one shorter); a dimension of size 0 gives `chunks` empty views.
TensorList chunk(const Tensor& t, int64_t chunks, int64_t dim = 0);

// The dimension cat uses for `tensors` (wrapped against the first tensor that is not
// skipped), and which inputs the legacy rule skips (shape [0] with other ranks present).
int64_t cat_dim(const TensorList& tensors, int64_t dim);
bool cat_skips(const TensorList& tensors, size_t i);

}  // namespace tally::ops
