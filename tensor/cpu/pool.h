// CPU kernels of 2-D pooling. Tensors arrive 4-D [N, C, H, W] and contiguous, shapes
// checked by tensor/pool.cpp. Forward kernels read and write the input's dtype
// (accumulating in acc_t); backward kernels write a float32/float64 gradient (acc_t of
// the grad_output's dtype), which they zero first, so overlapping windows add exactly.
#pragma once

#include "tensor/ops/pool.h"

namespace tally::cpu {

void max_pool2d_forward(const Tensor& out, const Tensor& indices, const Tensor& input,
                        const ops::Pool2dParams& p);
void max_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output,
                         const Tensor& indices);
void avg_pool2d_forward(const Tensor& out, const Tensor& input, const ops::Pool2dParams& p);
void avg_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output,
                         const ops::Pool2dParams& p);
void adaptive_avg_pool2d_forward(const Tensor& out, const Tensor& input);
void adaptive_avg_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output);

}  // namespace tally::cpu
