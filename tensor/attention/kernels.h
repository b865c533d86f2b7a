// The kernel table of the fused (flash) attention op: each kernel's signature, once. The CPU
// reference (tensor/attention/cpu.cpp: plain loops over [B, H, T, D] views with any strides,
// math in double, computing the same log-sum-exp the CUDA kernels save) and the CUDA kernels
// (tensor/attention/cuda.cu) each define one AttentionKernels; tensor/backends.cpp
// registers them.
// Routes (cuDNN, FlashAttention-2, float32) and what CUDA inputs must be: docs/notes.md §26.
#pragma once

#include <array>
#include <cstdint>

#include "tensor/dispatch.h"
#include "tensor/tensor.h"

namespace tally {

// The forward's and the backward's signature, with R their return type: the kernels' (void)
// and that of the CUDA routes a CUDA kernel chooses between (tensor/attention/cuda_fp32.h,
// cuda_cudnn.h), which declare their functions with these types.
// mask: undefined (none), or a [B, H, L, S] view (stride 0 on broadcast dims, never
// materialised) of bool (true = take part; false adds -inf) or of a float bias in lse's
// dtype, added to scale * q.k before the softmax. A row with no allowed key gives out 0 and
// lse -inf, and zero gradients. k and v may have Hk = H / G heads (grouped-query attention):
// query head h reads key/value head h / G, and dk, dv sum over the G query heads of a group.
template <typename R>
using AttentionForwardFn = R(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, bool causal, double scale, const Tensor& mask);
template <typename R>
using AttentionBackwardFn = R(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, bool causal, double scale,
                              const Tensor& mask);

// A [B, H, L, S] mask view's own part: its sizes with 1 along the broadcast (stride 0) dims.
// The cuDNN route's bias holds this much of it (tensor/attention/cuda_cudnn.cpp, cuda.cu), and
// the meta kernels charge it (tensor/attention/meta.cpp).
inline std::array<int64_t, 4> mask_own_sizes(const Tensor& mask) {
  std::array<int64_t, 4> own{};
  for (size_t d = 0; d < 4; ++d)
    own[d] = mask.strides()[d] == 0 ? 1 : mask.size(static_cast<int64_t>(d));
  return own;
}

// The shapes and dtypes cuDNN's fused route takes (tensor/attention/cuda_cudnn.cpp, which also
// asks for sm_80+ and the route switched on; the meta kernels charge what it allocates):
// float16 / bfloat16 [B, H, T, D], one head dim D, a multiple of 8 up to 128, and k and v
// with heads dividing q's.
inline bool cudnn_sdp_shapes(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dim() != 4 || (q.dtype() != DType::bfloat16 && q.dtype() != DType::float16)) return false;
  const int64_t d = q.size(3), hkv = k.size(1);
  return v.size(3) == d && k.size(3) == d && d % 8 == 0 && d <= 128 && v.size(1) == hkv &&
         hkv > 0 && q.size(1) % hkv == 0;
}

struct AttentionKernels {
  // q [B, H, L, E], k [B, Hk, S, E], v [B, Hk, S, Ev] (any strides, H % Hk == 0); out [B, H, L, Ev]
  // in q's dtype and lse [B, H, L] (float32, float64 for float64 inputs), both contiguous.
  AttentionForwardFn<void>* flash_attention_forward;

  // dq, dk, dv (contiguous, the inputs' shapes and dtype) <- the gradients from dout (out's
  // shape) and what the forward saved (q, k, v, out, lse).
  // CUDA (Tally's kernels): a preprocessing kernel (D = rowsum(dO * O)), one block per key
  // tile that recomputes the probabilities tile by tile from lse and accumulates dK, dV in
  // registers and dQ (float32, atomically, a temporary the size of q in float), and a final
  // conversion of dQ.
  AttentionBackwardFn<void>* flash_attention_backward;

  // CUDA only (null on CPU, which takes any head dim): whether the float32 kernels' shared
  // memory for head dim E fits a block on `device` (E > 64 needs 169 KB in the backward:
  // Hopper yes, A100's 163 KB no). ops::flash_attention_supported asks it.
  bool (*flash_attention_fp32_fits)(int device, int64_t E);

  // Rotary position embedding in the rotate-half layout (HF's apply_rotary_pos_emb) along the
  // last dim (D even, h = D / 2), with c = cos and s = sin. For each i < h:
  //   forward:  out[i] = x[i] c[i] - x[i+h] s[i],    out[i+h] = x[i+h] c[i+h] + x[i] s[i+h]
  //   backward: out[i] = x[i] c[i] + x[i+h] s[i+h],  out[i+h] = x[i+h] c[i+h] - x[i] s[i]
  // (the forward's transpose, x then holding the incoming gradient). out is contiguous; x, cos
  // and sin have out's shape (any strides, 0 where broadcast) and its dtype.
  void (*rotary_embedding)(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin,
                           bool backward);
};

// cpu::attention_kernels (tensor/attention/cpu.cpp), cuda::attention_kernels
// (tensor/attention/cuda.cu), attention_backends (tensor/backends.cpp).
TALLY_DECLARE_KERNELS(AttentionKernels, attention_kernels, attention_backends);

}  // namespace tally
