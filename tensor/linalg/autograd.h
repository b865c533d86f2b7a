// Differentiable linear algebra (namespace tally): matmul with PyTorch's full semantics,
// mm, bmm, linear and embedding. Each records one node whose backward is written next to
// its forward in tensor/linalg/autograd.cpp; products save only the operand the other
// one's gradient needs (dA = dC B^T needs B, dB = A^T dC needs A).
#pragma once

#include "tensor/elementwise/autograd.h"
#include "tensor/linalg/ops.h"

namespace tally {

// torch.matmul: dot (1-D x 1-D -> 0-D), matrix-vector, vector-matrix, mm, and batched
// products whose batch dimensions broadcast ([2, 1, 3, 4] x [5, 4, 2] -> [2, 5, 3, 2]).
// Operands: same floating dtype and device.
Tensor matmul(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
// [M, K] x [K, N] -> [M, N]; both 2-D.
Tensor mm(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
// [B, M, K] x [B, K, N] -> [B, M, N]; both 3-D, same B (no broadcasting).
Tensor bmm(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
// torch.nn.functional.linear: y = x W^T + b. x [..., in], weight [out, in], bias [out]
// or undefined -> [..., out].
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              CallSite site = CallSite::current());
// A GELU(tanh) MLP as one autograd node: linear(gelu(linear(x, fc_weight, fc_bias),
// approximate="tanh"), proj_weight, proj_bias), x [..., in] -> [..., out] (biases optional;
// autocast casts the five as linear does). Forward is ops::linear_gelu then ops::linear; it
// saves x, fc_weight, the GELU's input and output and proj_weight (what the three separate
// ops would save), before the second product, so a checkpoint recompute stops there.
// Backward computes the GELU's gradient inside the product that makes its
// output's gradient (ops::mm_dgelu), so the [..., hidden] gradient of the GELU's output is
// never made: on CUDA the GELU's forward and backward both run in cuBLASLt epilogues. The
// values are those of the three ops to rounding. Errors: as linear's.
Tensor linear_gelu_linear(const Tensor& x, const Tensor& fc_weight, const Tensor& fc_bias,
                          const Tensor& proj_weight, const Tensor& proj_bias,
                          CallSite site = CallSite::current());
// Rows of weight [V, D] picked by int64 (or int32) indices of any shape -> [..., D].
// padding_idx in [0, V): that row receives no gradient; -1 (the default) means none. An
// index outside [0, V) throws std::out_of_range. Saves only the indices for backward.
// (Argument order as ATen's at::embedding(weight, indices, padding_idx).)
Tensor embedding(const Tensor& weight, const Tensor& indices, int64_t padding_idx = -1,
                 CallSite site = CallSite::current());

}  // namespace tally
