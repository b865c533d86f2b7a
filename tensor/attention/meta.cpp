// Meta kernels of the attention family (tensor/meta/target.h). The CPU kernels allocate
// nothing. On CUDA the 16-bit backward takes a float32 accumulator the size of q plus one
// float a row (dO . O), in Tally's kernels (tensor/attention/cuda.cu) and in the same amount
// in cuDNN's workspace; the float32 backward (tensor/attention/cuda_fp32.cu) takes the row
// vector only.
#include "tensor/attention/kernels.h"
#include "tensor/meta/target.h"

namespace tally::meta {

namespace {

void flash_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& /*dv*/,
                              const Tensor& /*dout*/, const Tensor& q, const Tensor& /*k*/,
                              const Tensor& /*v*/, const Tensor& /*out*/, const Tensor& /*lse*/,
                              bool /*causal*/, double /*scale*/) {
  if (!replays_cuda(q)) return;
  const int64_t rows = q.size(0) * q.size(1) * q.size(2);
  if (q.dtype() == DType::float32) {
    alloc_scratch(rows, DType::float32, q.device());
    return;
  }
  if (dq.numel() == 0 && dk.numel() == 0) return;
  const Tensor dvec = alloc_scratch(rows, DType::float32, q.device());
  alloc_scratch(rows * q.size(3), DType::float32, q.device());
}

}  // namespace

const AttentionKernels attention_kernels{
    .flash_attention_forward = nothing,
    .flash_attention_backward = &flash_attention_backward,
    // Every head dim up to 128 fits a block on the CUDA targets (Hopper: 227 KB of shared
    // memory a block; the float32 backward needs 169 KB at E = 128).
    .flash_attention_fp32_fits = [](int, int64_t E) { return E > 0 && E <= 128; },
};

}  // namespace tally::meta
