// The offloaded optimizer's update on the host (optim/cpu_offload.h): Adam(W) and AdamW8bit over
// every core. The lists are those of the fused ops (optim/multi_tensor.h) and the element math is
// update_math.h's, so the result equals the CPU backend's fused_adam_ / fused_adamw8bit_ bit for
// bit, whatever the thread count: each tensor is cut into runs of kChunkSize elements (whole
// quantization blocks), each run updated by one thread as the serial kernel updates it.
// float32 runs and 8-bit blocks are vectorised (AVX-512, AVX2 or SSE2, chosen at load time); the
// file compiles without FMA contraction and with a sqrt that sets no errno, so the vector code
// rounds each operation exactly as the scalar one does.
#pragma once

#include <vector>

#include "optim/multi_tensor.h"

namespace tally::optim {

// fused_adam_'s update (lists: param, grad, exp_avg, exp_avg_sq[, max_exp_avg_sq]) of CPU
// tensors, float32 or float64, multi-threaded. Not capturable; found_inf is honoured.
void parallel_adam_(const TensorLists& l, const AdamHyper& h);
// parallel_adam_ (no amsgrad) of float32 masters whose gradients (list 1) are `grad` (bfloat16
// or float16); with `out` (one pointer per tensor, possibly the gradient's own), the updated
// weights are also written rounded to `grad`'s dtype (a null pointer: not that tensor's). Equal
// bit for bit to widening the gradient, parallel_adam_ and a cast, in one pass over memory. A
// `grad_scale` other than 1 updates with each gradient times it, rounded to `grad`'s dtype, as
// clip_grad_norm_ leaves it (CpuOffload::clip_grad_norm_ folds its coefficient in so).
void parallel_adam_16_(const TensorLists& l, const AdamHyper& h, DType grad,
                       const std::vector<void*>& out, float grad_scale = 1.0f);
// fused_adamw8bit_'s update of CPU tensors (lists as AdamW8bitHyper's), multi-threaded.
void parallel_adamw8bit_(const TensorLists& l, const AdamW8bitHyper& h);
// parallel_adamw8bit_ of float32 masters whose gradients (list 1) are `grad` (bfloat16 or
// float16), the new weights written rounded to `grad`'s dtype through `out` as parallel_adam_16_
// writes them. Block by block in the cache: the gradient widened, the moments dequantized,
// updated, requantized (a branch-free search of the code book) and the weights rounded, each
// loop vectorised (the code book read from registers with AVX-512, by permutes and gathers with
// AVX2, by GCC's vectorised loops otherwise), so one pass over memory. Equal bit for bit to
// widening the gradient, parallel_adamw8bit_ and a cast. No amsgrad or capturable; found_inf is
// honoured. `grad_scale` as parallel_adam_16_'s.
void parallel_adamw8bit_16_(const TensorLists& l, const AdamW8bitHyper& h, DType grad,
                            const std::vector<void*>& out, float grad_scale = 1.0f);

namespace detail {
// Tests: caps the hand-written code-book loops of AdamW8bit's host update (2: AVX-512, 1: AVX2,
// 0: none, GCC's vectorised loops) below what the CPU has, so that an AVX-512 machine runs the
// AVX2 ones too. Returns the previous cap; std::invalid_argument outside [0, 2].
int set_host_simd_cap(int cap);
}  // namespace detail

}  // namespace tally::optim
