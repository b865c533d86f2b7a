// cuDNN's fused flash attention (its Hopper kernels use wgmma and TMA), reached through the
// backend graph API (tensor/cuda/cudnn_graph.h): the forward graph
//   S = Q K^T * scale [-> causal mask] -> softmax (Stats = max + log(sum exp)) -> O = P V
// and its backward (dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO * O)) * scale,
// dK = dS^T Q, dQ = dS K), written as the operation pattern cuDNN recognises (the pattern
// its frontend builds for scaled_dot_product_flash_attention; no dropout, no bias, causal
// mask top-left aligned like PyTorch's is_causal; an optional additive bias after the
// scale, the frontend's set_bias without dBias).
//
// Grouped-query attention is native: K and V (and dK, dV) have h_kv heads dividing Q's h, query
// head i reading key/value head i / (h / h_kv) (the batched matmuls broadcast the group); the
// backward's dK and dV are computed per query head in a virtual [b, h, s_kv, d] tensor and
// summed over each group by a reduction in the same graph (the frontend's pattern for GQA).
//
// Layouts are [b, h, s, d] with arbitrary strides in elements (the last dim dense,
// 16-byte aligned): GPT's split-head views of a [B, T, 3C] projection are read in place.
// Stats is float32 [b, h, s_q] contiguous, the natural-log log-sum-exp of the scaled scores:
// the same quantity Tally's own kernels save, so either backward takes either forward's.
// No Tally types here: tensor/attention/cuda_cudnn.cpp is the glue.
#pragma once

#include <array>
#include <memory>

#include "tensor/cuda/cudnn_graph.h"

namespace tally::cuda::cudnn_sdpa {

using Strides = std::array<int64_t, 4>;  // of a [b, h, s, d] view, in elements

struct Problem {
  cudnnDataType_t dtype = CUDNN_DATA_BFLOAT16;  // HALF or BFLOAT16
  int64_t b = 0, h = 0, s_q = 0, s_kv = 0, d = 0;
  int64_t h_kv = 0;  // K's and V's heads, dividing h (0: h)
  // An additive bias on the scaled scores (before the softmax), in dtype: dims [bias_b, bias_h,
  // s_q, s_kv] with bias_b 1 or b, bias_h 1 or h (0: no bias), strides `bias` (0 along
  // broadcast rows or columns).
  int64_t bias_b = 0, bias_h = 0;
  Strides bias{};
  bool causal = false;
  float scale = 1.f;
  Strides q{}, k{}, v{}, o{};
  Strides dout{}, dq{}, dk{}, dv{};  // backward only
};

class Forward {
 public:
  // config: which of cuDNN's usable engine configurations (0: the heuristics' first).
  Forward(cudnnHandle_t handle, const Problem& p, int config = 0);
  int64_t workspace_size() const { return graph_.workspace_size(); }
  int64_t engine_id() const { return graph_.engine_id(); }
  // bias: the problem's bias (null without one).
  void run(cudnnHandle_t handle, const void* q, const void* k, const void* v, const void* bias,
           void* o, float* stats, void* workspace) const;

 private:
  cudnn_graph::Graph graph_{"cuDNN SDPA forward"};
  int64_t q_, k_, v_, o_, stats_, bias_ = 0;
};

class Backward {
 public:
  Backward(cudnnHandle_t handle, const Problem& p, int config = 0);
  // The plan's workspace plus the float32 dQ accumulator and rowsum(dO * O) it reads back.
  int64_t workspace_size() const { return accum_offset_ + accum_bytes_ + sum_bytes_; }
  int64_t engine_id() const { return graph_.engine_id(); }
  void run(cudnnHandle_t handle, const void* q, const void* k, const void* v, const void* bias,
           const void* o, const void* dout, const float* stats, void* dq, void* dk, void* dv,
           void* workspace) const;

 private:
  cudnn_graph::Graph graph_{"cuDNN SDPA backward"};
  int64_t q_, k_, v_, o_, dout_, stats_, dq_, dk_, dv_, accum_, sum_, bias_ = 0;
  int64_t accum_offset_ = 0, accum_bytes_ = 0, sum_bytes_ = 0;
};

}  // namespace tally::cuda::cudnn_sdpa
