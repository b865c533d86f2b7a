// Differentiable shape ops (namespace tally): cat and stack (allocate; backward slices the
// gradient back to each input), split and chunk (views, no allocation; backward joins the
// pieces' gradients, a piece nobody used contributing zeros). None saves a tensor.
#pragma once

#include "tensor/elementwise/autograd.h"
#include "tensor/shape/ops.h"

namespace tally {

// torch.cat. dtypes promote as in PyTorch (each input's gradient comes back in its own
// dtype); 1-D empty tensors ([0]) are skipped as PyTorch does.
Tensor cat(const TensorList& tensors, int64_t dim = 0, CallSite site = CallSite::current());
// torch.stack: equal shapes, joined along a new dimension `dim`.
Tensor stack(const TensorList& tensors, int64_t dim = 0, CallSite site = CallSite::current());
// torch.split with an int: views split_size long along `dim` (the last may be shorter).
TensorList split(const Tensor& t, int64_t split_size, int64_t dim = 0,
                 CallSite site = CallSite::current());
// torch.split with a list of sizes (they must sum to t.size(dim)). split(t, {2}) picks
// the int overload above, as a plain int would.
TensorList split(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim = 0,
                 CallSite site = CallSite::current());
// torch.chunk: ceil(n / chunks)-long views (possibly fewer than `chunks` pieces).
TensorList chunk(const Tensor& t, int64_t chunks, int64_t dim = 0,
                 CallSite site = CallSite::current());

}  // namespace tally
