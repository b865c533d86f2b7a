// Meta kernels of the attention family (tensor/meta/target.h). The CPU kernels allocate
// nothing. On CUDA the 16-bit backward takes a float32 accumulator the size of q plus one
// float a row (dO . O), in Tally's kernels (tensor/attention/cuda.cu) and in the same amount
// in cuDNN's workspace; the float32 backward (tensor/attention/cuda_fp32.cu) takes the row
// vector only. A 16-bit call cuDNN's route takes is charged what that route allocates more:
// a mask as a bias in q's dtype (forward and backward) and, in the backward, a float a row,
// and grouped heads' full-head dK and dV (where cuDNN declines the problem, Tally's kernels
// allocate none of these: the estimate is that much high).
#include "tensor/attention/kernels.h"
#include "tensor/meta/target.h"

namespace tally::meta {

namespace {

// The forward's FLOPs: QK^T and PV, 4 B H L S E (half of it under a causal mask).
double attention_flops(const Tensor& q, const Tensor& k, bool causal) {
  const double f = 4.0 * static_cast<double>(q.size(0) * q.size(1) * q.size(2)) *
                   static_cast<double>(k.size(2)) * static_cast<double>(q.size(3));
  return causal ? f / 2 : f;
}

// Whether a CUDA call takes cuDNN's route (the dry run takes cuDNN to have a plan for it).
bool cudnn_route(const Tensor& q, const Tensor& k, const Tensor& v) {
  return replays_cuda(q) && cudnn_sdp_shapes(q, k, v);
}

// The cuDNN route's bias: the mask's own part (mask_own_sizes) in q's dtype
// (tensor/attention/cuda_cudnn.cpp); nothing without a mask or off that route.
Tensor cudnn_bias(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask) {
  if (!mask.defined() || !cudnn_route(q, k, v)) return Tensor();
  const std::array<int64_t, 4> own = mask_own_sizes(mask);
  return alloc_scratch(own[0] * own[1] * own[2] * own[3], q.dtype(), q.device());
}

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, bool causal, double /*scale*/, const Tensor& mask) {
  cost(q, attention_flops(q, k, causal), tensor_bytes(out, lse, q, k, v));
  const Tensor bias = cudnn_bias(q, k, v, mask);
}

void flash_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, bool causal, double /*scale*/,
                              const Tensor& mask) {
  // The backward recomputes the probabilities: 2.5 times the forward's FLOPs.
  cost(q, 2.5 * attention_flops(q, k, causal), tensor_bytes(dq, dk, dv, dout, q, k, v, out, lse));
  if (!replays_cuda(q)) return;
  const int64_t rows = q.size(0) * q.size(1) * q.size(2);
  if (q.dtype() == DType::float32) {
    alloc_scratch(rows, DType::float32, q.device());
    return;
  }
  if (dq.numel() == 0 && dk.numel() == 0) return;
  // A masked call: the bias and the statistics cuDNN reads (one float a row).
  const Tensor bias = cudnn_bias(q, k, v, mask);
  const Tensor stats = bias.defined() ? alloc_scratch(rows, DType::float32, q.device()) : Tensor();
  const Tensor dvec = alloc_scratch(rows, DType::float32, q.device());
  const Tensor acc = alloc_scratch(rows * q.size(3), DType::float32, q.device());
  if (!cudnn_route(q, k, v)) return;
  // cuDNN's workspace beside those: grouped heads' full-head dK and dV in q's dtype, which its
  // graph sums over each group (cuda_cudnn_sdpa.cpp, grouped_matmul), and with a bias a few
  // bytes more (512 with the allocator's rounding; both measured on an H100, cuDNN 9).
  const Tensor full =
      k.size(1) < q.size(1)
          ? alloc_scratch(2 * q.size(0) * q.size(1) * k.size(2) * q.size(3), q.dtype(), q.device())
          : Tensor();
  if (bias.defined()) alloc_scratch_bytes(512, q.device());
}

// One read of x and one write of out (the tables are small beside them: broadcast views).
void rotary_embedding(const Tensor& out, const Tensor& x, const Tensor& /*cos*/,
                      const Tensor& /*sin*/, bool /*backward*/) {
  cost(out, 3.0 * static_cast<double>(out.numel()), tensor_bytes(out, x));
}

}  // namespace

const AttentionKernels attention_kernels{
    .flash_attention_forward = &flash_attention_forward,
    .flash_attention_backward = &flash_attention_backward,
    // Every head dim up to 128 fits a block on the CUDA targets (Hopper: 227 KB of shared
    // memory a block; the float32 backward needs 169 KB at E = 128).
    .flash_attention_fp32_fits = [](int, int64_t E) { return E > 0 && E <= 128; },
    .rotary_embedding = &rotary_embedding,
};

}  // namespace tally::meta
