// Differentiable ops built from other ops (namespace tally), each under PyTorch's name and
// defaults: tril/triu (a masked_fill with a small [rows, cols] mask), repeat (an expanded
// view copied once), pad (constant: one copy into a filled tensor; reflect: an index_select
// per padded dim), one_hot, the vector norm and einsum (permute/reshape around one bmm). They
// run on every backend their parts run on, and their gradients are their parts'.
#pragma once

#include <string>

#include "autograd/ops.h"

namespace tally {

// torch.tril / torch.triu over the last two dims: x's elements on and below (above) the
// `diagonal`-th diagonal, zeros elsewhere.
Tensor tril(const Tensor& x, int64_t diagonal = 0, CallSite site = CallSite::current());
Tensor triu(const Tensor& x, int64_t diagonal = 0, CallSite site = CallSite::current());
// torch.Tensor.repeat: x tiled sizes[i] times along dim i (len(sizes) >= x.dim(); extra
// leading sizes add dims).
Tensor repeat(const Tensor& x, const Shape& sizes, CallSite site = CallSite::current());
// torch.nn.functional.pad: `pad` holds (left, right) pairs from the last dim backwards.
// mode "constant" (value fills; negative pads crop) or "reflect" (pads < the dim's size).
Tensor pad(const Tensor& x, const Shape& pad, const std::string& mode = "constant",
           double value = 0.0, CallSite site = CallSite::current());
// torch.nn.functional.one_hot: int64 [..., num_classes]; num_classes -1 takes max + 1 (a
// read back to the host). Values outside [0, num_classes) are an error on the CPU; CUDA
// leaves their rows zero (checking would read the tensor back).
Tensor one_hot(const Tensor& x, int64_t num_classes = -1, CallSite site = CallSite::current());
// torch.norm / torch.linalg.vector_norm: (sum |x|^p)^(1/p) over `dims` (empty = all); p
// may be +-inf (max / min of |x|) or 0 (the count of non-zeros). The gradient at a zero norm
// is 0, as in PyTorch.
Tensor norm(const Tensor& x, double p = 2.0, const Shape& dims = {}, bool keepdim = false,
            CallSite site = CallSite::current());
// torch.einsum for one or two operands, explicit ("ij,jk->ik") or implicit ("ij,jk") output:
// letters shared by both operands and the output are batch dims, shared letters absent from
// the output are contracted, a letter in one operand only is summed away unless the output
// keeps it. Repeated letters within an operand (diagonals), "..." and more than two operands
// are refused with an error naming the equation.
Tensor einsum(const std::string& equation, const TensorList& operands,
              CallSite site = CallSite::current());

}  // namespace tally
