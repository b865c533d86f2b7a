// Meta kernels of the conv family (tensor/meta/target.h). CPU: each call's im2col column
// matrix of one plane (cpu::conv_col_scratch_numel), in the dtype the CPU kernel computes in.
// CUDA: cuDNN's workspace depends on the engine its heuristics pick on the device and is not
// replayed yet (the dry run counts none).
#include "tensor/conv/kernels.h"
#include "tensor/meta/target.h"

namespace tally::meta {

namespace {

void col_scratch(const Shape& input, const Shape& weight, const Shape& out,
                 const ops::Conv2dParams& p, const Tensor& like) {
  if (replays_cuda(like)) return;
  const int64_t n = cpu::conv_col_scratch_numel(input, weight, out, p);
  if (n > 0) alloc_scratch(n, like.dtype(), like.device());
}

void conv2d_forward(const Tensor& out, const Tensor& input, const Tensor& weight,
                    const Tensor& /*bias*/, const ops::Conv2dParams& p) {
  col_scratch(input.sizes(), weight.sizes(), out.sizes(), p, input);
}

void conv2d_backward_input(const Tensor& grad_input, const Tensor& grad_output,
                           const Tensor& weight, const ops::Conv2dParams& p) {
  col_scratch(grad_input.sizes(), weight.sizes(), grad_output.sizes(), p, weight);
}

void conv2d_backward_weight(const Tensor& grad_weight, const Tensor& grad_output,
                            const Tensor& input, const ops::Conv2dParams& p) {
  col_scratch(input.sizes(), grad_weight.sizes(), grad_output.sizes(), p, input);
}

}  // namespace

const ConvKernels conv_kernels{
    .conv2d_forward = &conv2d_forward,
    .conv2d_backward_input = &conv2d_backward_input,
    .conv2d_backward_weight = &conv2d_backward_weight,
};

}  // namespace tally::meta
