#include "tensor/attention/cuda_cudnn_sdpa.h"

#include <limits>
#include <vector>

namespace tally::cuda::cudnn_sdpa {

namespace {

using Dims = std::vector<int64_t>;
using cudnn_graph::Graph;

Dims vec(const Strides& s) {
  return Dims(s.begin(), s.end());
}
// The strides of a [b, h, s, d] view seen as [b, h, d, s].
Dims swapped(const Strides& s) {
  return {s[0], s[1], s[3], s[2]};
}

// Scores where row (query) < col (key) become -inf: PyTorch's is_causal, top-left aligned.
int64_t causal_mask(Graph& g, int64_t scores, const Dims& dims) {
  const int64_t row = g.virt(CUDNN_DATA_INT32, dims);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, 0, 0, row, CUDNN_DATA_FLOAT, 2);
  const int64_t col = g.virt(CUDNN_DATA_INT32, dims);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, 0, 0, col, CUDNN_DATA_FLOAT, 3);
  const int64_t keep = g.virt(CUDNN_DATA_BOOLEAN, dims);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, 0, keep, CUDNN_DATA_BOOLEAN);
  const int64_t ninf = g.scalar(-std::numeric_limits<float>::infinity());
  const int64_t out = g.virt(CUDNN_DATA_FLOAT, dims);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, scores, ninf, keep, out);
  return out;
}

int64_t kv_heads(const Problem& p) {
  return p.h_kv > 0 ? p.h_kv : p.h;
}

// out [b, h_kv, s_kv, d] = the product a b [b, h, s_kv, d] summed over each group of h / h_kv
// query heads: straight into out for equal heads, else through a virtual full-head tensor
// and a reduction.
void grouped_matmul(Graph& g, const Problem& p, int64_t a, int64_t b, int64_t out) {
  if (kv_heads(p) == p.h) {
    g.matmul(a, b, out);
    return;
  }
  const int64_t full = g.virt(p.dtype, {p.b, p.h, p.s_kv, p.d});
  g.matmul(a, b, full);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
}

// scores + the problem's bias (when it has one).
int64_t add_bias(Graph& g, const Problem& p, int64_t scores, const Dims& dims, int64_t& bias) {
  if (p.bias_b == 0) return scores;
  bias = g.tensor(p.dtype, {p.bias_b, p.bias_h, p.s_q, p.s_kv}, vec(p.bias), false);
  const int64_t out = g.virt(CUDNN_DATA_FLOAT, dims);
  g.pointwise(CUDNN_POINTWISE_ADD, scores, bias, 0, out);
  return out;
}

// The execute call's pointers, with the bias's where the plan has one.
std::vector<std::pair<int64_t, void*>> with_bias(std::vector<std::pair<int64_t, void*>> ptrs,
                                                 int64_t uid, const void* bias) {
  if (uid != 0) ptrs.emplace_back(uid, const_cast<void*>(bias));
  return ptrs;
}

}  // namespace

Forward::Forward(cudnnHandle_t handle, const Problem& p, int config) {
  Graph& g = graph_;
  const int64_t b = p.b, h = p.h, hkv = kv_heads(p), sq = p.s_q, skv = p.s_kv, d = p.d;
  const Dims scores{b, h, sq, skv}, rows{b, h, sq, 1};
  q_ = g.tensor(p.dtype, {b, h, sq, d}, vec(p.q), false);
  k_ = g.tensor(p.dtype, {b, hkv, d, skv}, swapped(p.k), false);  // K^T
  v_ = g.tensor(p.dtype, {b, hkv, skv, d}, vec(p.v), false);
  o_ = g.tensor(p.dtype, {b, h, sq, d}, vec(p.o), false);
  stats_ = g.tensor(CUDNN_DATA_FLOAT, rows, {h * sq, sq, 1, 1}, false);

  const int64_t s = g.virt(CUDNN_DATA_FLOAT, scores);
  g.matmul(q_, k_, s);
  int64_t last = g.virt(CUDNN_DATA_FLOAT, scores);
  g.pointwise(CUDNN_POINTWISE_MUL, s, g.scalar(p.scale), 0, last);
  last = add_bias(g, p, last, scores, bias_);
  if (p.causal) last = causal_mask(g, last, scores);
  // Softmax with its statistics.
  const int64_t mx = g.virt(CUDNN_DATA_FLOAT, rows);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, last, mx);
  const int64_t sub = g.virt(CUDNN_DATA_FLOAT, scores);
  g.pointwise(CUDNN_POINTWISE_SUB, last, mx, 0, sub);
  const int64_t e = g.virt(CUDNN_DATA_FLOAT, scores);
  g.pointwise(CUDNN_POINTWISE_EXP, sub, 0, 0, e);
  const int64_t sum = g.virt(CUDNN_DATA_FLOAT, rows);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  const int64_t lg = g.virt(CUDNN_DATA_FLOAT, rows);
  g.pointwise(CUDNN_POINTWISE_LOG, sum, 0, 0, lg);
  g.pointwise(CUDNN_POINTWISE_ADD, mx, lg, 0, stats_);
  const int64_t prob = g.virt(p.dtype, scores);
  g.pointwise(CUDNN_POINTWISE_DIV, e, sum, 0, prob);
  g.matmul(prob, v_, o_);
  g.build(handle, {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}, {}, config);
}

void Forward::run(cudnnHandle_t handle, const void* q, const void* k, const void* v,
                  const void* bias, void* o, float* stats, void* workspace) const {
  graph_.execute(handle,
                 with_bias({{q_, const_cast<void*>(q)},
                            {k_, const_cast<void*>(k)},
                            {v_, const_cast<void*>(v)},
                            {o_, o},
                            {stats_, stats}},
                           bias_, bias),
                 workspace);
}

Backward::Backward(cudnnHandle_t handle, const Problem& p, int config) {
  Graph& g = graph_;
  const int64_t b = p.b, h = p.h, hkv = kv_heads(p), sq = p.s_q, skv = p.s_kv, d = p.d;
  const Dims scores{b, h, sq, skv}, rows{b, h, sq, 1};
  const Dims scores_t_strides{h * sq * skv, sq * skv, 1, skv};  // [b, h, skv, sq] view of scores
  q_ = g.tensor(p.dtype, {b, h, sq, d}, vec(p.q), false);
  k_ = g.tensor(p.dtype, {b, hkv, d, skv}, swapped(p.k), false);  // K^T
  v_ = g.tensor(p.dtype, {b, hkv, d, skv}, swapped(p.v), false);  // V^T
  o_ = g.tensor(p.dtype, {b, h, sq, d}, vec(p.o), false);
  dout_ = g.tensor(p.dtype, {b, h, sq, d}, vec(p.dout), false);
  stats_ = g.tensor(CUDNN_DATA_FLOAT, rows, {h * sq, sq, 1, 1}, false);
  dq_ = g.tensor(p.dtype, {b, h, sq, d}, vec(p.dq), false);
  dk_ = g.tensor(p.dtype, {b, hkv, skv, d}, vec(p.dk), false);
  dv_ = g.tensor(p.dtype, {b, hkv, skv, d}, vec(p.dv), false);
  const int64_t scale = g.scalar(p.scale);

  // rowsum(dO * O), kept in the workspace.
  const int64_t prod =
      g.tensor(CUDNN_DATA_FLOAT, {b, h, sq, d}, {h * sq * d, sq * d, h * d, 1}, true);
  g.pointwise(CUDNN_POINTWISE_MUL, dout_, o_, 0, prod);
  const int64_t rsum = g.virt(CUDNN_DATA_FLOAT, rows);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, prod, rsum);
  sum_ = g.tensor(CUDNN_DATA_FLOAT, rows, {h * sq, sq, 1, 1}, false);
  g.pointwise(CUDNN_POINTWISE_MUL, rsum, g.scalar(1.f), 0, sum_);

  // P = exp(Q K^T * scale - Stats), masked.
  const int64_t s = g.virt(CUDNN_DATA_FLOAT, scores);
  g.matmul(q_, k_, s);
  const int64_t s1 = g.virt(CUDNN_DATA_FLOAT, scores);
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, 0, s1);
  const int64_t s2 = add_bias(g, p, s1, scores, bias_);
  int64_t last = g.virt(CUDNN_DATA_FLOAT, scores);
  g.pointwise(CUDNN_POINTWISE_SUB, s2, stats_, 0, last);
  if (p.causal) last = causal_mask(g, last, scores);
  const int64_t prob = g.virt(CUDNN_DATA_FLOAT, scores);
  g.pointwise(CUDNN_POINTWISE_EXP, last, 0, 0, prob);

  // dV = P^T dO (summed over each group of query heads).
  const int64_t prob_t = g.tensor(p.dtype, {b, h, skv, sq}, scores_t_strides, true);
  g.reshape(prob, prob_t);
  grouped_matmul(g, p, prob_t, dout_, dv_);

  // dS = P * (dO V^T - rowsum(dO * O)) * scale.
  const int64_t dp = g.virt(CUDNN_DATA_FLOAT, scores);
  g.matmul(dout_, v_, dp);
  const int64_t dp1 = g.virt(CUDNN_DATA_FLOAT, scores);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, sum_, 0, dp1);
  const int64_t ds = g.virt(CUDNN_DATA_FLOAT, scores);
  g.pointwise(CUDNN_POINTWISE_MUL, dp1, prob, 0, ds);
  const int64_t ds1 = g.virt(CUDNN_DATA_FLOAT, scores);
  g.pointwise(CUDNN_POINTWISE_MUL, ds, scale, 0, ds1);

  // dK = dS^T Q (summed over each group of query heads).
  const int64_t ds_t = g.tensor(p.dtype, {b, h, skv, sq}, scores_t_strides, true);
  g.reshape(ds1, ds_t);
  grouped_matmul(g, p, ds_t, q_, dk_);

  // dQ = dS K, accumulated in float32 in the workspace, then converted.
  const int64_t k_rows = g.tensor(p.dtype, {b, hkv, skv, d}, vec(p.k), true);
  g.reshape(k_, k_rows);
  accum_ = g.tensor(CUDNN_DATA_FLOAT, {b, h, sq, d}, {h * sq * d, sq * d, d, 1}, false);
  g.matmul(ds1, k_rows, accum_);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, accum_, 0, 0, dq_);
  g.build(handle, {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}, {}, config);

  accum_offset_ = (g.workspace_size() + 255) / 256 * 256;
  accum_bytes_ = b * h * sq * d * static_cast<int64_t>(sizeof(float));
  sum_bytes_ = b * h * sq * static_cast<int64_t>(sizeof(float));
}

void Backward::run(cudnnHandle_t handle, const void* q, const void* k, const void* v,
                   const void* bias, const void* o, const void* dout, const float* stats, void* dq,
                   void* dk, void* dv, void* workspace) const {
  char* ws = static_cast<char*>(workspace);
  graph_.execute(handle,
                 with_bias({{q_, const_cast<void*>(q)},
                            {k_, const_cast<void*>(k)},
                            {v_, const_cast<void*>(v)},
                            {o_, const_cast<void*>(o)},
                            {dout_, const_cast<void*>(dout)},
                            {stats_, const_cast<float*>(stats)},
                            {dq_, dq},
                            {dk_, dk},
                            {dv_, dv},
                            {accum_, ws + accum_offset_},
                            {sum_, ws + accum_offset_ + accum_bytes_}},
                           bias_, bias),
                 ws);
}

}  // namespace tally::cuda::cudnn_sdpa
