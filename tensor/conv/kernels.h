// The kernel table of the 2-D convolution family (conv2d and its two gradients): each
// kernel's signature, once. The CPU reference (tensor/conv/cpu.cpp) and the CUDA kernels
// (tensor/conv/cuda_conv.cpp, cuDNN host code) each define one ConvKernels;
// tensor/backends.cpp registers them.
// The signatures' conventions: docs/notes.md §23.
#pragma once

#include <initializer_list>

#include "tensor/conv/ops.h"
#include "tensor/dispatch.h"
#include "tensor/tensor.h"

namespace tally {

struct ConvKernels {
  // out [N, O, OH, OW] = conv(input [N, C, H, W], weight [O, C/g, kH, kW]) + bias [O]
  // (bias may be undefined).
  void (*conv2d_forward)(const Tensor& out, const Tensor& input, const Tensor& weight,
                         const Tensor& bias, const ops::Conv2dParams& p);

  // grad_input [N, C, H, W] (overwritten) from grad_output [N, O, OH, OW] and weight.
  void (*conv2d_backward_input)(const Tensor& grad_input, const Tensor& grad_output,
                                const Tensor& weight, const ops::Conv2dParams& p);

  // grad_weight [O, C/g, kH, kW] (overwritten) from grad_output and the forward input.
  void (*conv2d_backward_weight)(const Tensor& grad_weight, const Tensor& grad_output,
                                 const Tensor& input, const ops::Conv2dParams& p);
};

// cpu::conv_kernels (tensor/conv/cpu.cpp), cuda::conv_kernels (tensor/conv/cuda_conv.cpp),
// conv_backends (tensor/backends.cpp).
TALLY_DECLARE_KERNELS(ConvKernels, conv_kernels, conv_backends);

// The table's entries in member order, each the backend's kernel of the member's name: each
// backend (cpu, cuda, meta) defines `const ConvKernels conv_kernels{TALLY_CONV_KERNELS};`.
#define TALLY_CONV_KERNELS                                                            \
  .conv2d_forward = &conv2d_forward, .conv2d_backward_input = &conv2d_backward_input, \
  .conv2d_backward_weight = &conv2d_backward_weight

// The layout a convolution runs in (PyTorch's rule): channels_last when any of its defined 4-D
// tensors is (Tensor::suggest_memory_format), else contiguous. ops::conv2d, the CUDA kernels
// (a caller of a kernel directly may mix layouts) and the meta replay of their workspaces.
MemoryFormat conv_memory_format(std::initializer_list<const Tensor*> ts);

// One cuDNN convolution call of the CUDA backend's default route (an execution plan of
// cuDNN's graph API, tensor/conv/cuda_conv.cpp) and the workspace its plan takes: a row of a
// CUDA target's table (tensor/conv/workspaces_h200.inc), recorded on that GPU by
// bench/record_workspaces. The meta kernels replay a call's workspace from its target's table.
struct ConvWorkspace {
  int kind;   // 0 forward, 1 backward data, 2 backward filter
  int dtype;  // a DType
  int tf32;   // float32 with cudnn_allow_tf32() on (the default)
  int x[4], w[4], y[4];
  int pad[2], stride[2], dilation[2], groups;
  int accumulate;  // backward filter into an existing gradient (a batch split in slices)
  int64_t bytes;
  // channels_last: NHWC tensors and filter (cuDNN plans those apart from NCHW ones). Last, so
  // that a table recorded before it existed (every row NCHW) still reads.
  int nhwc = 0;

  // Everything but the bytes: the call a row describes.
  bool same_call(const ConvWorkspace& o) const;
};

namespace cpu {
// The CPU kernels' im2col scratch for one call (tensor/conv/cpu.cpp): the [K, L] column
// matrix of one (image, group) plane, in elements; 0 when the plane already is that matrix
// (a 1x1, stride-1, unpadded convolution). The meta kernels replay it.
int64_t conv_col_scratch_numel(const Shape& input, const Shape& weight, const Shape& out,
                               const ops::Conv2dParams& p);
}  // namespace cpu

}  // namespace tally
