// CUDA kernels of the softmax family. softmax/log_softmax and their backwards are row
// reductions (tensor/cuda/reduce.cuh): a thread, a warp, a block or a column tile per row,
// one statistics pass (online max and sum of exponentials, in float; double for float64),
// then the write pass.
//
// cross_entropy is llm.c's fused classifier: one kernel computes each row's max,
// log-sum-exp and loss straight from the logits (one read of the row: online statistics per
// lane, see row_stats; label smoothing reads it twice); its backward recomputes the softmax from
// the logits and writes (softmax - target distribution) * g in the same pass, so no
// probabilities are ever stored. Reductions "sum"/"mean" write the row losses (and whether
// each row counted) into a scratch buffer that a second kernel adds up in double, in a fixed
// order (deterministic: chunks a block, then one block over the chunks); the backward's
// "mean" counts the non-ignored targets on the device. Nothing is read back to the host.
#include <algorithm>

#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/reduce.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/op_alloc.h"
#include "tensor/softmax/kernels.h"

namespace tally::cuda {
namespace {

using rows::Mode;
using rows::RowIter;
using rows::Walk;

template <typename A>
__device__ __forceinline__ A neg_inf() {
  return -std::numeric_limits<A>::infinity();
}
template <typename A>
__device__ __forceinline__ A quiet_nan() {
  return std::numeric_limits<A>::quiet_NaN();
}
// exp/log in the accumulation type (float or double), never through the other. float's exp is
// 2^(v log2 e) on the special-function unit (ex2.approx: relative error under 2^-22, results below
// 2^-126 flushed to 0, exp(-inf) = 0): one multiply and one MUFU.EX2 where expf's range
// reduction takes ten instructions, which made the cross-entropy rows (50,257 exponentials each)
// instruction-bound. double keeps exp.
template <typename A>
__device__ __forceinline__ A exp_(A v) {
  if constexpr (std::is_same_v<A, float>) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v * 1.4426950408889634f));
    return r;
  } else {
    return exp(v);
  }
}
template <typename A>
__device__ __forceinline__ A log_(A v) {
  if constexpr (std::is_same_v<A, float>)
    return logf(v);
  else
    return log(v);
}

// One lane's online softmax statistics: the running max m and e = sum(exp(x - m)) over the
// lane's elements, rescaled when the max grows; -inf elements add nothing (so a row of -inf
// and finite values is exact), NaN makes e NaN, as the two-pass form does.
template <typename A>
__device__ __forceinline__ void online_add(A v, A& m, A& e) {
  if (v > m) {
    e = e * exp_(m - v) + A(1);
    m = v;
  } else if (v != neg_inf<A>()) {
    e += exp_(v - m);
  }
}

// The row's max and sum(exp(x - max)) over n elements of stride s (n = 0 for a lane group
// with no row: every lane of a block must still come here), in ONE read of the row: each
// lane keeps online statistics, then the group takes the max and adds the lanes' sums
// rescaled to it. Every lane gets both.
template <Mode M, typename T, typename A = dacc_t<T>>
__device__ __forceinline__ void row_stats(const T* p, int64_t n, int64_t s, A& max, A& sum) {
  constexpr int G = Walk<M>::kLanes;
  const int lane = Walk<M>::lane();
  A m = neg_inf<A>(), e = 0;
  int64_t i = lane;
  // Four elements a step: their loads are independent (in flight together), the running max
  // moves at most once per step, then one exponential each.
  for (; i + 3 * G < n; i += 4 * G) {
    A v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = static_cast<A>(load(p[(i + j * G) * s]));
    const A a = v[1] > v[0] ? v[1] : v[0], b = v[3] > v[2] ? v[3] : v[2];
    const A mc = b > a ? b : a;  // a NaN may hide here; it still reaches e below
    if (mc > m) {
      e *= exp_(m - mc);  // m = -inf: e is 0 and stays 0
      m = mc;
    }
    const A ms = m == neg_inf<A>() ? A(0) : m;  // as in row_stats_contig below
#pragma unroll
    for (int j = 0; j < 4; ++j) e += exp_(v[j] - ms);
  }
  for (; i < n; i += G) online_add(static_cast<A>(load(p[i * s])), m, e);
  const A mr = rows::group_reduce<M>(m, rows::MaxOp{});
  const A scaled = e == A(0) ? A(0) : e * exp_(m - mr);
  sum = rows::group_reduce<M>(scaled, rows::SumOp{});
  max = mr;
}

// A row of n contiguous elements as an unaligned head (fewer than one 16-byte pack), whole
// 16-byte packs of V = 16 / sizeof(T) elements and a tail: head elements before the first
// 16-byte boundary (p must be sizeof(T)-aligned, as every tensor element is).
template <typename T>
struct RowSplit {
  static constexpr int V = 16 / sizeof(T);
  int64_t head, packs;
  __device__ __forceinline__ RowSplit(const T* p, int64_t n) {
    const auto misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 16);
    head = misalign == 0 ? 0 : (16 - misalign) / static_cast<int64_t>(sizeof(T));
    if (head > n) head = n;
    packs = (n - head) / V;
  }
};

template <typename T>
struct alignas(16) RowPack {
  T v[16 / sizeof(T)];
};

// row_stats for a contiguous row (stride 1): 16-byte loads, two packs in flight a lane.
template <Mode M, typename T, typename A = dacc_t<T>>
__device__ __forceinline__ void row_stats_contig(const T* p, int64_t n, A& max, A& sum) {
  constexpr int G = Walk<M>::kLanes;
  using P = RowPack<T>;
  constexpr int V = RowSplit<T>::V;
  const int lane = Walk<M>::lane();
  const RowSplit<T> sp(p, n);
  A m = neg_inf<A>(), e = 0;
  for (int64_t i = lane; i < sp.head; i += G) online_add(static_cast<A>(load(p[i])), m, e);
  const P* pp = reinterpret_cast<const P*>(p + sp.head);
  int64_t j = lane;
  for (; j + G < sp.packs; j += 2 * G) {
    const P x0 = pp[j], x1 = pp[j + G];
    A mc = m;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const A a = static_cast<A>(load(x0.v[k])), b = static_cast<A>(load(x1.v[k]));
      mc = a > mc ? a : mc;
      mc = b > mc ? b : mc;
    }
    if (mc > m) {
      e *= exp_(m - mc);  // m = -inf: e is 0 and stays 0
      m = mc;
    }
    // While m is -inf every value so far is -inf: shift by 0 instead, so that -inf - m is -inf
    // (exp 0) rather than NaN, with no test an element.
    const A ms = m == neg_inf<A>() ? A(0) : m;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const A a = static_cast<A>(load(x0.v[k])), b = static_cast<A>(load(x1.v[k]));
      e += exp_(a - ms);
      e += exp_(b - ms);
    }
  }
  for (; j < sp.packs; j += G) {
    const P x0 = pp[j];
#pragma unroll
    for (int k = 0; k < V; ++k) online_add(static_cast<A>(load(x0.v[k])), m, e);
  }
  for (int64_t i = sp.head + sp.packs * V + lane; i < n; i += G)
    online_add(static_cast<A>(load(p[i])), m, e);
  const A mr = rows::group_reduce<M>(m, rows::MaxOp{});
  const A scaled = e == A(0) ? A(0) : e * exp_(m - mr);
  sum = rows::group_reduce<M>(scaled, rows::SumOp{});
  max = mr;
}

// ------------------------------------------------------------------ softmax

template <typename T, Mode M>
__global__ void softmax_kernel(T* out, const T* x, int64_t nrows, int64_t n, int64_t xs, int64_t os,
                               Indexer<2> kept, bool take_log) {
  using A = dacc_t<T>;
  constexpr int G = Walk<M>::kLanes;
  const int lane = Walk<M>::lane();
  rows::for_each_row<M>(nrows, n, kept, [&](const RowIter<M>& it, const int64_t* o, int64_t len) {
    const T* px = x + o[0];
    T* po = out + o[1];
    A m, s;
    row_stats<M>(px, len, xs, m, s);
    if (take_log) {
      // (x - max) - log(sum): accurate for large logits, as the CPU.
      const A log_sum = log_(s);
      for (int64_t i = lane; i < len; i += G)
        po[i * os] = store<T>((load(px[i * xs]) - m) - log_sum);
    } else {
      const A inv = A(1) / s;
      for (int64_t i = lane; i < len; i += G)
        po[i * os] = store<T>(exp_(load(px[i * xs]) - m) * inv);
    }
  });
}

template <typename T, Mode M>
__global__ void softmax_backward_kernel(T* grad_input, const T* grad, const T* y, int64_t nrows,
                                        int64_t n, int64_t gis, int64_t gs, int64_t ys,
                                        Indexer<3> kept, bool take_log) {
  using A = dacc_t<T>;
  constexpr int G = Walk<M>::kLanes;
  const int lane = Walk<M>::lane();
  rows::for_each_row<M>(nrows, n, kept, [&](const RowIter<M>& it, const int64_t* o, int64_t len) {
    T* pgi = grad_input + o[0];
    const T* pg = grad + o[1];
    const T* py = y + o[2];
    A acc = 0;  // sum(g) (log) or sum(g * y)
    for (int64_t i = lane; i < len; i += G) {
      const A g = load(pg[i * gs]);
      acc += take_log ? g : g * load(py[i * ys]);
    }
    acc = rows::group_reduce<M>(acc, rows::SumOp{});
    for (int64_t i = lane; i < len; i += G) {
      const A g = load(pg[i * gs]), yv = load(py[i * ys]);
      pgi[i * gis] = store<T>(take_log ? g - exp_(yv) * acc : yv * (g - acc));
    }
  });
}

// ------------------------------------------------------------------ losses

// Per row: the loss into out (reduction none: out offsets from kept operand 2) or into
// partial[r] with partial[nrows + r] = 1 when the row counts (sum/mean; out is null), and
// the row's log-sum-exp into lse when asked (0 for a row that does not count).
// kept operands: input, target, out, lse.
template <typename T, typename OutT, Mode M>
__global__ void cross_entropy_kernel(OutT* out, double* partial, dacc_t<T>* lse, const T* x,
                                     const int64_t* target, int64_t nrows, int64_t C, int64_t cs,
                                     Indexer<4> kept, int64_t ignore_index, dacc_t<T> eps,
                                     dacc_t<T> uniform, bool smoothing) {
  using A = dacc_t<T>;
  constexpr int G = Walk<M>::kLanes;
  const int lane = Walk<M>::lane();
  for (RowIter<M> it(nrows); it.more(); it.next()) {
    int64_t o[4] = {0, 0, 0, 0};
    if (it.active) kept.get(it.row, o);
    const int64_t t = it.active ? target[o[1]] : ignore_index;
    const bool counted = t != ignore_index;
    const bool valid = counted && t >= 0 && t < C;
    const int64_t len = valid ? C : 0;  // the reductions run in every lane, over nothing here
    const T* px = x + o[0];
    A m, e, gap = 0;  // max, sum(exp(x - max)), sum(max - x)
    if (!smoothing) {
      if (cs == 1 && G > 1)
        row_stats_contig<M>(px, len, m, e);  // one read of the row
      else
        row_stats<M>(px, len, cs, m, e);
    } else {
      m = neg_inf<A>();
      for (int64_t c = lane; c < len; c += G) {
        const A v = load(px[c * cs]);
        if (v > m) m = v;
      }
      m = rows::group_reduce<M>(m, rows::MaxOp{});
      e = 0;
      for (int64_t c = lane; c < len; c += G) {
        const A v = load(px[c * cs]);
        e += exp_(v - m);
        gap += m - v;
      }
      e = rows::group_reduce<M>(e, rows::SumOp{});
      gap = rows::group_reduce<M>(gap, rows::SumOp{});
    }
    A loss = 0;
    if (valid) {
      const A log_sum = log_(e);
      // -log_softmax_t = (max - x_t) + log(sum): no cancellation against a large max.
      loss = (m - load(px[t * cs])) + log_sum;
      // sum_c -log_softmax_c = sum_c (max - x_c) + C * log(sum), both terms >= 0.
      if (smoothing) loss = (A(1) - eps) * loss + uniform * (gap + static_cast<A>(C) * log_sum);
    } else if (counted) {
      loss = quiet_nan<A>();  // out of bounds: cannot throw from the device
    }
    if (it.active && lane == 0) {
      if (lse) lse[o[3]] = valid ? m + log_(e) : A(0);
      if (out) {
        out[o[2]] = store<OutT>(loss);
      } else {
        partial[it.row] = static_cast<double>(loss);
        partial[nrows + it.row] = counted ? 1.0 : 0.0;
      }
    }
  }
}

template <typename T>
__global__ void nll_loss_kernel(T* out, double* partial, const T* x, const int64_t* target,
                                int64_t nrows, int64_t C, int64_t cs, Indexer<3> kept,
                                int64_t ignore_index) {
  using A = dacc_t<T>;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < nrows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t o[3];
    kept.get(r, o);
    const int64_t t = target[o[1]];
    const bool counted = t != ignore_index;
    A loss = 0;
    if (counted) loss = (t < 0 || t >= C) ? quiet_nan<A>() : -load(x[o[0] + t * cs]);
    if (out) {
      out[o[2]] = store<T>(loss);
    } else {
      partial[r] = static_cast<double>(loss);
      partial[nrows + r] = counted ? 1.0 : 0.0;
    }
  }
}

constexpr int kSumThreads = 512;
constexpr int64_t kSumChunk = 8192;  // rows a block of the first summing level
constexpr int kCountThreads = 256;

// in holds n values then n counts; block b adds up its chunk [b * chunk, (b + 1) * chunk)
// of each into out[b] and out[gridDim.x + b].
__global__ void partial_sums_kernel(double* out, const double* in, int64_t n, int64_t chunk) {
  const int64_t lo = blockIdx.x * chunk, hi = lo + chunk < n ? lo + chunk : n;
  double total = 0.0, count = 0.0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kSumThreads) {
    total += in[i];
    count += in[n + i];
  }
  total = rows::block_sum<kSumThreads>(total);
  count = rows::block_sum<kSumThreads>(count);
  if (threadIdx.x == 0) {
    out[blockIdx.x] = total;
    out[gridDim.x + blockIdx.x] = count;
  }
}

// One block: out[0] <- the sum of the n values (sum) or that sum / the sum of the n counts
// (mean; 0 / 0 = NaN when every row was ignored, as the CPU).
template <typename T>
__global__ void loss_total_kernel(T* out, const double* in, int64_t n, bool mean) {
  using A = dacc_t<T>;
  double total = 0.0, count = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kSumThreads) {
    total += in[i];
    count += in[n + i];
  }
  total = rows::block_sum<kSumThreads>(total);
  count = rows::block_sum<kSumThreads>(count);
  if (threadIdx.x == 0) out[0] = store<T>(static_cast<A>(mean ? total / count : total));
}

// *count (zeroed first) += the number of rows whose target is not ignore_index.
__global__ void count_targets_kernel(unsigned long long* count, const int64_t* target,
                                     int64_t nrows, Indexer<1> ix, int64_t ignore_index) {
  long long c = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kCountThreads) + threadIdx.x; i < nrows;
       i += static_cast<int64_t>(gridDim.x) * kCountThreads) {
    int64_t off;
    ix.get(i, &off);
    c += target[off] != ignore_index ? 1 : 0;
  }
  c = rows::block_sum<kCountThreads>(c);
  if (threadIdx.x == 0 && c != 0) atomicAdd(count, static_cast<unsigned long long>(c));
}

// kept operands: input, target, grad (zero strides unless reduction none), grad_input, lse
// (the forward's row log-sum-exp; null: recomputed here from a first read of the row).
// Contiguous rows of input and grad_input that share their 16-byte alignment are read and
// written 16 bytes at a time.
template <typename T, Mode M>
__global__ void cross_entropy_backward_kernel(T* grad_input, const T* grad, const T* x,
                                              const dacc_t<T>* lse, const int64_t* target,
                                              const int64_t* count, int64_t nrows, int64_t C,
                                              int64_t cs, int64_t gcs, Indexer<5> kept,
                                              int64_t grad_offset, bool none, int64_t ignore_index,
                                              dacc_t<T> eps, dacc_t<T> uniform) {
  using A = dacc_t<T>;
  constexpr int G = Walk<M>::kLanes;
  const int lane = Walk<M>::lane();
  A g_all = 0;
  if (!none) {
    g_all = load(grad[grad_offset]);
    if (count) g_all = g_all / static_cast<A>(*count);
  }
  for (RowIter<M> it(nrows); it.more(); it.next()) {
    int64_t o[5] = {0, 0, 0, 0, 0};
    if (it.active) kept.get(it.row, o);
    const int64_t t = it.active ? target[o[1]] : ignore_index;
    const bool ignored = t == ignore_index;
    const bool valid = !ignored && t >= 0 && t < C;
    const T* px = x + o[0];
    T* pgi = grad_input + o[3];
    A m, s = A(1);
    if (lse) {
      if (!it.active) continue;      // no group reduction below: lanes may leave
      m = valid ? lse[o[4]] : A(0);  // p = exp(x - lse)
    } else {
      row_stats<M>(px, valid ? C : 0, cs, m, s);  // every lane of a block comes here
      if (!it.active) continue;
    }
    if (!valid) {
      const A fill = ignored ? A(0) : quiet_nan<A>();  // NaN: target out of bounds
      for (int64_t c = lane; c < C; c += G) pgi[c * gcs] = store<T>(fill);
      continue;
    }
    const A g = none ? load(grad[o[2]]) : g_all;
    const A inv = A(1) / s;
    auto value = [&](A xv, int64_t c) {
      const A p = exp_(xv - m) * inv;
      const A q = (c == t ? A(1) - eps : A(0)) + uniform;
      return store<T>((p - q) * g);
    };
    if (cs == 1 && gcs == 1 && G > 1 &&
        reinterpret_cast<uintptr_t>(px) % 16 == reinterpret_cast<uintptr_t>(pgi) % 16) {
      using P = RowPack<T>;
      constexpr int V = RowSplit<T>::V;
      const RowSplit<T> sp(px, C);
      for (int64_t c = lane; c < sp.head; c += G) pgi[c] = value(load(px[c]), c);
      const P* xp = reinterpret_cast<const P*>(px + sp.head);
      P* gp = reinterpret_cast<P*>(pgi + sp.head);
      int64_t j = lane;
      for (; j + G < sp.packs; j += 2 * G) {
        const P x0 = xp[j], x1 = xp[j + G];
        P y0, y1;
        const int64_t c0 = sp.head + j * V, c1 = sp.head + (j + G) * V;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          y0.v[k] = value(load(x0.v[k]), c0 + k);
          y1.v[k] = value(load(x1.v[k]), c1 + k);
        }
        gp[j] = y0;
        gp[j + G] = y1;
      }
      for (; j < sp.packs; j += G) {
        const P x0 = xp[j];
        P y0;
        const int64_t c0 = sp.head + j * V;
#pragma unroll
        for (int k = 0; k < V; ++k) y0.v[k] = value(load(x0.v[k]), c0 + k);
        gp[j] = y0;
      }
      for (int64_t c = sp.head + sp.packs * V + lane; c < C; c += G) pgi[c] = value(load(px[c]), c);
    } else {
      for (int64_t c = lane; c < C; c += G) pgi[c * gcs] = value(load(px[c * cs]), c);
    }
  }
}

// cross_entropy and its backward for a 0-D incoming gradient in one pass over the logits
// (the fused classifier's chunks: [rows, C] with contiguous, 16-byte aligned rows). One row a
// block at a time, grid-strided: the row is copied into shared memory with cp.async (every
// 16-byte load of the row in flight at once, no registers held), then read from there three
// times (max, sum of exponentials, gradient), so the logits cross DRAM once each way where the
// two kernels read them twice. Two blocks share an SM (a GPT-2 row of 50,304 bf16 is 98 KB), so
// one block's copy overlaps the other's exponentials. (Two row buffers a block, the next row's
// copy in flight during this one's arithmetic, measured slower on the H200 at one block an SM:
// 1.29 against 1.09 ms for GPT-2's 16,384 rows.)
// grad_input may be x itself: a row is in shared memory before any of its gradient is
// written, and no other block touches it. Per row: the loss into partial[r] with
// partial[nrows + r] = 1 when it counts (summed by sum_partials), lse[r * lse_s] = its
// log-sum-exp (0 when ignored).
constexpr int kFusedThreads = Walk<Mode::block>::kThreads;

struct FusedRows {
  double* partial;
  float* lse;
  const int64_t* target;
  const int64_t* count;
  int64_t nrows, C, xrs, grs, ts, lse_s, ignore_index;
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}

template <typename T>
__global__ void __launch_bounds__(kFusedThreads)
    cross_entropy_fused_kernel(T* grad_input, const T* x, const T* grad, FusedRows a) {
  using A = float;
  using P = RowPack<T>;
  constexpr int V = RowSplit<T>::V;
  extern __shared__ uint4 row_smem[];
  const int tid = threadIdx.x;
  const int64_t packs = a.C / V, C = a.C;
  A g = load(grad[0]);
  if (a.count) g = g / static_cast<A>(*a.count);
  char* buf = reinterpret_cast<char*>(row_smem);
  for (int64_t r = blockIdx.x; r < a.nrows; r += gridDim.x) {
    const int64_t t = a.target[r * a.ts];
    const bool counted = t != a.ignore_index;
    const bool valid = counted && t >= 0 && t < C;  // the same for the whole block
    T* gi = grad_input + r * a.grs;
    const T* px = x + r * a.xrs;
    if (!valid) {  // ignored: loss 0, gradient 0; out of bounds: NaN (cannot throw here)
      const A fill = counted ? quiet_nan<A>() : A(0);
      for (int64_t c = tid; c < C; c += kFusedThreads) gi[c] = store<T>(fill);
      if (tid == 0) {
        a.lse[r * a.lse_s] = A(0);
        a.partial[r] = counted ? quiet_nan<double>() : 0.0;
        a.partial[a.nrows + r] = counted ? 1.0 : 0.0;
      }
      continue;
    }
    // The row's whole 16-byte packs by cp.async, the tail by plain loads; the buffer was freed
    // by the previous row's closing barrier.
    const P* xp = reinterpret_cast<const P*>(px);
    P* sp = reinterpret_cast<P*>(buf);
    for (int64_t j = tid; j < packs; j += kFusedThreads) cp_async16(sp + j, xp + j);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    T* st = reinterpret_cast<T*>(buf);
    for (int64_t c = packs * V + tid; c < C; c += kFusedThreads) st[c] = px[c];
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();

    A m = neg_inf<A>();
    for (int64_t j = tid; j < packs; j += kFusedThreads) {
      const P v = sp[j];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A e = load(v.v[k]);
        m = e > m ? e : m;  // a NaN is skipped here and reaches the sum below
      }
    }
    for (int64_t c = packs * V + tid; c < C; c += kFusedThreads) {
      const A e = load(st[c]);
      m = e > m ? e : m;
    }
    m = rows::group_reduce<Mode::block>(m, rows::MaxOp{});
    // A row of -inf: shift by 0 so that -inf - m is -inf (exp 0), not NaN.
    const A ms = m == neg_inf<A>() ? A(0) : m;
    A e = 0;
    for (int64_t j = tid; j < packs; j += kFusedThreads) {
      const P v = sp[j];
#pragma unroll
      for (int k = 0; k < V; ++k) e += exp_(load(v.v[k]) - ms);
    }
    for (int64_t c = packs * V + tid; c < C; c += kFusedThreads) e += exp_(load(st[c]) - ms);
    e = rows::group_reduce<Mode::block>(e, rows::SumOp{});
    const A log_sum = log_(e);
    if (tid == 0) {
      a.lse[r * a.lse_s] = m + log_sum;
      // -log_softmax_t = (max - x_t) + log(sum), as cross_entropy_kernel.
      a.partial[r] = static_cast<double>((m - load(st[t])) + log_sum);
      a.partial[a.nrows + r] = 1.0;
    }
    // d/dx = (softmax - onehot(t)) * g, the softmax as exp(x - max) / sum.
    const A inv = A(1) / e;
    auto value = [&](A xv, int64_t c) {
      const A p = exp_(xv - ms) * inv;
      return store<T>((c == t ? p - A(1) : p) * g);
    };
    P* gp = reinterpret_cast<P*>(gi);
    for (int64_t j = tid; j < packs; j += kFusedThreads) {
      const P v = sp[j];
      P y;
#pragma unroll
      for (int k = 0; k < V; ++k) y.v[k] = value(load(v.v[k]), j * V + k);
      gp[j] = y;
    }
    for (int64_t c = packs * V + tid; c < C; c += kFusedThreads) gi[c] = value(load(st[c]), c);
    __syncthreads();  // everyone is done with buf before it is refilled
  }
}

// grad_input is zero-filled by the caller. kept operands: grad_input, target, grad.
template <typename T>
__global__ void nll_loss_backward_kernel(T* grad_input, const T* grad, const int64_t* target,
                                         const int64_t* count, int64_t nrows, int64_t C,
                                         int64_t gcs, Indexer<3> kept, int64_t grad_offset,
                                         bool none, int64_t ignore_index) {
  using A = dacc_t<T>;
  A g_all = 0;
  if (!none) {
    g_all = load(grad[grad_offset]);
    if (count) g_all = g_all / static_cast<A>(*count);
  }
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < nrows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t o[3];
    kept.get(r, o);
    const int64_t t = target[o[1]];
    if (t == ignore_index) continue;
    if (t < 0 || t >= C) {
      for (int64_t c = 0; c < C; ++c) grad_input[o[0] + c * gcs] = store<T>(quiet_nan<A>());
      continue;
    }
    const A g = none ? load(grad[o[2]]) : g_all;
    grad_input[o[0] + t * gcs] = store<T>(-g);
  }
}

// ------------------------------------------------------------------ host helpers

// The loss rows: input's sizes with the class dim (1) set to 1.
Shape loss_rows(const Tensor& input) {
  Shape kept = input.sizes();
  kept[1] = 1;
  return kept;
}

// The indexer over the loss rows `kept` of `operands`; a null operand (one the call does not
// read: out or grad of a reduced loss, an absent lse) walks with zero strides from offset 0.
template <int N>
Indexer<N> loss_indexer(const Shape& kept, std::initializer_list<const Tensor*> operands) {
  const Shape zero(kept.size(), 0);
  std::vector<const Shape*> strides;
  std::vector<int64_t> offsets;
  for (const Tensor* t : operands) {
    strides.push_back(t ? &t->strides() : &zero);
    offsets.push_back(t ? t->storage_offset() : 0);
  }
  return make_indexer<N>(kept, strides, offsets);
}

// The frame of a loss's forward over input [N, C, d...] (the classes at dim 1): its rows, an
// NVTX range and input's device current while it lives, and for a reduced loss the per-row
// (loss, counted) partials sum_partials adds up (pp null for reduction none).
struct LossForward {
  bool none;
  Shape kept;
  int64_t nrows, C, cs;
  NvtxRange range;
  int dev;
  DeviceGuard guard;
  Tensor partial;
  double* pp;

  LossForward(const char* name, const Tensor& input, ops::LossReduction reduction)
      : none(reduction == ops::LossReduction::none),
        kept(loss_rows(input)),
        nrows(shape_numel(kept)),
        C(input.sizes()[1]),
        cs(input.strides()[1]),
        range(name),
        dev(input.device().index),
        guard(dev),
        partial(none ? Tensor() : alloc_scratch(2 * nrows, DType::float64, input.device())),
        pp(none ? nullptr : static_cast<double*>(partial.data_ptr())) {}
};

unsigned grid_for(int64_t n, int threads, int64_t max_blocks = rows::kMaxGrid) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + threads - 1) / threads, 1, max_blocks));
}

// out[0] (a T) <- the sum or mean of the per-row partials (2 * nrows doubles), in two levels
// when there are many rows, in a fixed order.
template <typename T>
void sum_partials(T* out, const double* partial, int64_t nrows, bool mean, const Device& device,
                  const char* name) {
  const int dev = device.index;
  if (nrows <= kSumChunk) {
    loss_total_kernel<T><<<1, kSumThreads, 0, stream(dev)>>>(out, partial, nrows, mean);
    check_launch(name);
    return;
  }
  const int64_t blocks = (nrows + kSumChunk - 1) / kSumChunk;
  Tensor second = alloc_scratch(2 * blocks, DType::float64, device);
  auto* ps = static_cast<double*>(second.data_ptr());
  partial_sums_kernel<<<static_cast<unsigned>(blocks), kSumThreads, 0, stream(dev)>>>(
      ps, partial, nrows, kSumChunk);
  check_launch(name);
  loss_total_kernel<T><<<1, kSumThreads, 0, stream(dev)>>>(out, ps, blocks, mean);
  check_launch(name);
}

// A device int64 holding the number of rows whose target is not ignore_index.
Tensor count_targets(const Tensor& target, const Shape& kept, int64_t nrows, int64_t ignore_index,
                     int dev, const char* name) {
  Tensor count = alloc_scratch(1, DType::int64, target.device());
  check(cudaMemsetAsync(count.data_ptr(), 0, sizeof(int64_t), stream(dev)), name);
  const Indexer<1> ix = loss_indexer<1>(kept, {&target});
  count_targets_kernel<<<grid_for(nrows, kCountThreads * 16, 1024), kCountThreads, 0,
                         stream(dev)>>>(static_cast<unsigned long long*>(count.data_ptr()),
                                        static_cast<const int64_t*>(target.storage().data()), nrows,
                                        ix, ignore_index);
  check_launch(name);
  return count;
}

// The divisor of a mean reduction (the targets counted by count_targets); undefined for the
// other reductions.
Tensor mean_count(ops::LossReduction reduction, const Tensor& target, const Shape& kept,
                  int64_t nrows, int64_t ignore_index, int dev, const char* name) {
  return reduction == ops::LossReduction::mean
             ? count_targets(target, kept, nrows, ignore_index, dev, name)
             : Tensor();
}

// ------------------------------------------------------------------ entry points

// The frame of softmax and its backward over x's rows along dim: nothing for no elements;
// otherwise, in an NVTX range on x's device, launch(kept, nrows, n, dev) (kept: x's shape with
// dim of size 1, nrows rows of n), then the launch check.
template <typename Launch>
void over_rows(const char* name, const Tensor& x, int64_t dim, Launch&& launch) {
  Shape kept = x.sizes();
  kept[static_cast<size_t>(dim)] = 1;
  const int64_t nrows = shape_numel(kept), n = x.size(dim);
  if (nrows == 0 || n == 0) return;
  NvtxRange range(name);
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  launch(kept, nrows, n, dev);
  check_launch(name);
}

void softmax(const Tensor& out, const Tensor& x, int64_t dim, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  over_rows(name, x, dim, [&](const Shape& kept, int64_t nrows, int64_t n, int dev) {
    const Indexer<2> ix = make_indexer<2>(kept, {&x.strides(), &out.strides()},
                                          {x.storage_offset(), out.storage_offset()});
    const int64_t xs = x.stride(dim), os = out.stride(dim);
    const Mode mode = rows::choose(nrows, n, xs == 1);
    TALLY_DISPATCH_FLOAT(x.dtype(), name, [&] {
      using T = dev_t<scalar_t>;
      rows::launch_rows(mode, nrows, [&](auto mode_c, unsigned grid) {
        constexpr Mode M = decltype(mode_c)::value;
        softmax_kernel<T, M><<<grid, Walk<M>::kThreads, 0, stream(dev)>>>(
            dptr<scalar_t>(out), dptr<scalar_t>(x), nrows, n, xs, os, ix, log);
      });
    });
  });
}

void softmax_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& y, int64_t dim,
                      bool log) {
  const char* name = log ? "log_softmax_backward" : "softmax_backward";
  over_rows(name, y, dim, [&](const Shape& kept, int64_t nrows, int64_t n, int dev) {
    const Indexer<3> ix =
        make_indexer<3>(kept, {&grad_input.strides(), &grad.strides(), &y.strides()},
                        {grad_input.storage_offset(), grad.storage_offset(), y.storage_offset()});
    const int64_t gis = grad_input.stride(dim), gs = grad.stride(dim), ys = y.stride(dim);
    const Mode mode = rows::choose(nrows, n, ys == 1 && gs == 1);
    TALLY_DISPATCH_FLOAT(y.dtype(), name, [&] {
      using T = dev_t<scalar_t>;
      rows::launch_rows(mode, nrows, [&](auto mode_c, unsigned grid) {
        constexpr Mode M = decltype(mode_c)::value;
        softmax_backward_kernel<T, M><<<grid, Walk<M>::kThreads, 0, stream(dev)>>>(
            dptr<scalar_t>(grad_input), dptr<scalar_t>(grad), dptr<scalar_t>(y), nrows, n, gis, gs,
            ys, ix, log);
      });
    });
  });
}

void cross_entropy(const Tensor& out, const Tensor& lse, const Tensor& input, const Tensor& target,
                   int64_t ignore_index, double label_smoothing, ops::LossReduction reduction) {
  const LossForward f("cross_entropy", input, reduction);
  const Indexer<4> ix = loss_indexer<4>(
      f.kept, {&input, &target, f.none ? &out : nullptr, lse.defined() ? &lse : nullptr});
  const Mode mode = rows::choose(f.nrows, f.C, f.cs == 1);
  TALLY_DISPATCH_FLOAT(input.dtype(), "cross_entropy", [&] {
    using T = dev_t<scalar_t>;
    using A = acc_t<scalar_t>;
    const A eps = static_cast<A>(label_smoothing);
    const A uniform = f.C > 0 ? eps / static_cast<A>(f.C) : A(0);
    A* plse = lse.defined() ? static_cast<A*>(lse.storage().data()) : nullptr;
    // The loss in the input's dtype, or float32 (autocast: float16/bfloat16 logits).
    auto run = [&]<typename OutT>() {
      OutT* po = static_cast<OutT*>(out.storage().data());
      if (f.nrows > 0) {
        rows::launch_rows(mode, f.nrows, [&](auto mode_c, unsigned grid) {
          constexpr Mode M = decltype(mode_c)::value;
          cross_entropy_kernel<T, OutT, M><<<grid, Walk<M>::kThreads, 0, stream(f.dev)>>>(
              f.none ? po : nullptr, f.pp, plse, dptr<scalar_t>(input),
              static_cast<const int64_t*>(target.storage().data()), f.nrows, f.C, f.cs, ix,
              ignore_index, eps, uniform, label_smoothing > 0.0);
        });
        check_launch("cross_entropy");
      }
      if (!f.none)
        sum_partials<OutT>(po + out.storage_offset(), f.pp, f.nrows,
                           reduction == ops::LossReduction::mean, input.device(),
                           "cross_entropy (total)");
    };
    if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
      if (out.dtype() == DType::float32) return run.template operator()<float>();
    }
    run.template operator()<T>();
  });
}

void cross_entropy_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& input,
                            const Tensor& target, const Tensor& lse, int64_t ignore_index,
                            double label_smoothing, ops::LossReduction reduction) {
  const bool none = reduction == ops::LossReduction::none;
  const Shape kept = loss_rows(input);
  const int64_t nrows = shape_numel(kept), C = input.sizes()[1], cs = input.strides()[1];
  const int64_t gcs = grad_input.strides()[1];
  if (nrows == 0) return;
  NvtxRange range("cross_entropy_backward");
  const int dev = input.device().index;
  DeviceGuard guard(dev);
  const Tensor count = mean_count(reduction, target, kept, nrows, ignore_index, dev,
                                  "cross_entropy_backward (count)");
  const int64_t* pc = count.defined() ? static_cast<const int64_t*>(count.data_ptr()) : nullptr;
  const Indexer<5> ix = loss_indexer<5>(
      kept, {&input, &target, none ? &grad : nullptr, &grad_input, lse.defined() ? &lse : nullptr});
  const Mode mode = rows::choose(nrows, C, cs == 1);
  TALLY_DISPATCH_FLOAT(input.dtype(), "cross_entropy_backward", [&] {
    using T = dev_t<scalar_t>;
    using A = acc_t<scalar_t>;
    const A eps = static_cast<A>(label_smoothing);
    const A uniform = C > 0 ? eps / static_cast<A>(C) : A(0);
    rows::launch_rows(mode, nrows, [&](auto mode_c, unsigned grid) {
      constexpr Mode M = decltype(mode_c)::value;
      cross_entropy_backward_kernel<T, M><<<grid, Walk<M>::kThreads, 0, stream(dev)>>>(
          dptr<scalar_t>(grad_input), dptr<scalar_t>(grad), dptr<scalar_t>(input),
          lse.defined() ? static_cast<const A*>(lse.storage().data()) : nullptr,
          static_cast<const int64_t*>(target.storage().data()), pc, nrows, C, cs, gcs, ix,
          grad.storage_offset(), none, ignore_index, eps, uniform);
    });
  });
  check_launch("cross_entropy_backward");
}

namespace {

// The shared memory the fused kernel needs for a row of C elements of `size` bytes (the row
// rounded up to 16 bytes), or 0 when the layout does not qualify: 16-bit or float32 logits,
// rank 2 (the classes contiguous, rows 16-byte aligned, grad_input's too), a 0-D grad, no
// label smoothing.
size_t fused_row_bytes(const Tensor& grad_input, const Tensor& input, double label_smoothing,
                       ops::LossReduction reduction) {
  const DType dt = input.dtype();
  if (reduction == ops::LossReduction::none || label_smoothing != 0.0 || input.dim() != 2 ||
      !(dt == DType::float32 || dt == DType::float16 || dt == DType::bfloat16))
    return 0;
  const int64_t C = input.sizes()[1], size = static_cast<int64_t>(dtype_size(dt));
  auto aligned = [&](const Tensor& t) {
    return (C <= 1 || t.strides()[1] == 1) &&
           (t.sizes()[0] <= 1 || (t.strides()[0] * size) % 16 == 0) &&
           reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  if (C == 0 || input.sizes()[0] == 0 || !aligned(input) || !aligned(grad_input)) return 0;
  return static_cast<size_t>((C * size + 15) / 16 * 16);
}

}  // namespace

void cross_entropy_and_backward(const Tensor& out, const Tensor& lse, const Tensor& grad_input,
                                const Tensor& grad, const Tensor& input, const Tensor& target,
                                int64_t ignore_index, double label_smoothing,
                                ops::LossReduction reduction) {
  const int dev = input.device().index;
  const size_t smem = fused_row_bytes(grad_input, input, label_smoothing, reduction);
  if (smem == 0 || smem > max_block_smem_optin(dev)) {
    cross_entropy(out, lse, input, target, ignore_index, label_smoothing, reduction);
    cross_entropy_backward(grad_input, grad, input, target, lse, ignore_index, label_smoothing,
                           reduction);
    return;
  }
  NvtxRange range("cross_entropy_and_backward");
  DeviceGuard guard(dev);
  const int64_t nrows = input.sizes()[0], C = input.sizes()[1];
  const Tensor count = mean_count(reduction, target, loss_rows(input), nrows, ignore_index, dev,
                                  "cross_entropy_and_backward (count)");
  Tensor partial = alloc_scratch(2 * nrows, DType::float64, input.device());
  double* pp = static_cast<double*>(partial.data_ptr());
  const FusedRows rows_args{
      pp,
      static_cast<float*>(lse.data_ptr()),
      static_cast<const int64_t*>(target.data_ptr()),
      count.defined() ? static_cast<const int64_t*>(count.data_ptr()) : nullptr,
      nrows,
      C,
      input.strides()[0],
      grad_input.strides()[0],
      target.strides()[0],
      lse.strides()[0],
      ignore_index};
  auto run = [&]<typename T>() {
    auto kernel = cross_entropy_fused_kernel<T>;
    const size_t bytes = smem;
    set_max_dynamic_smem(kernel, bytes, "cross_entropy_and_backward");
    int per_sm = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kFusedThreads, bytes),
          "cross_entropy_and_backward (occupancy)");
    const int64_t blocks =
        std::clamp<int64_t>(static_cast<int64_t>(sm_count(dev)) * std::max(per_sm, 1), 1, nrows);
    kernel<<<static_cast<unsigned>(blocks), kFusedThreads, bytes, stream(dev)>>>(
        static_cast<T*>(grad_input.data_ptr()), static_cast<const T*>(input.data_ptr()),
        static_cast<const T*>(grad.data_ptr()), rows_args);
    check_launch("cross_entropy_and_backward");
  };
  const bool mean = reduction == ops::LossReduction::mean;
  const char* total = "cross_entropy_and_backward (total)";
  switch (input.dtype()) {  // fused_row_bytes admits these three
    case DType::bfloat16:
      run.template operator()<__nv_bfloat16>();
      break;
    case DType::float16:
      run.template operator()<__half>();
      break;
    default:
      run.template operator()<float>();
      break;
  }
  // The loss: float32 for 16-bit logits under autocast, else the logits' dtype.
  switch (out.dtype()) {
    case DType::bfloat16:
      sum_partials(static_cast<__nv_bfloat16*>(out.data_ptr()), pp, nrows, mean, input.device(),
                   total);
      break;
    case DType::float16:
      sum_partials(static_cast<__half*>(out.data_ptr()), pp, nrows, mean, input.device(), total);
      break;
    default:
      sum_partials(static_cast<float*>(out.data_ptr()), pp, nrows, mean, input.device(), total);
      break;
  }
}

void nll_loss(const Tensor& out, const Tensor& input, const Tensor& target, int64_t ignore_index,
              ops::LossReduction reduction) {
  const LossForward f("nll_loss", input, reduction);
  const Indexer<3> ix = loss_indexer<3>(f.kept, {&input, &target, f.none ? &out : nullptr});
  TALLY_DISPATCH_FLOAT(input.dtype(), "nll_loss", [&] {
    using T = dev_t<scalar_t>;
    if (f.nrows > 0) {
      nll_loss_kernel<T><<<grid_for(f.nrows, 256), 256, 0, stream(f.dev)>>>(
          f.none ? dptr<scalar_t>(out) : nullptr, f.pp, dptr<scalar_t>(input),
          static_cast<const int64_t*>(target.storage().data()), f.nrows, f.C, f.cs, ix,
          ignore_index);
      check_launch("nll_loss");
    }
    if (!f.none)
      sum_partials<T>(dptr<scalar_t>(out) + out.storage_offset(), f.pp, f.nrows,
                      reduction == ops::LossReduction::mean, input.device(), "nll_loss (total)");
  });
}

void nll_loss_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& target,
                       int64_t ignore_index, ops::LossReduction reduction) {
  const bool none = reduction == ops::LossReduction::none;
  const Shape kept = loss_rows(grad_input);
  const int64_t nrows = shape_numel(kept), C = grad_input.sizes()[1];
  const int64_t gcs = grad_input.strides()[1];
  if (nrows == 0) return;
  NvtxRange range("nll_loss_backward");
  const int dev = grad_input.device().index;
  DeviceGuard guard(dev);
  const Tensor count =
      mean_count(reduction, target, kept, nrows, ignore_index, dev, "nll_loss_backward (count)");
  const int64_t* pc = count.defined() ? static_cast<const int64_t*>(count.data_ptr()) : nullptr;
  const Indexer<3> ix = loss_indexer<3>(kept, {&grad_input, &target, none ? &grad : nullptr});
  TALLY_DISPATCH_FLOAT(grad_input.dtype(), "nll_loss_backward", [&] {
    using T = dev_t<scalar_t>;
    nll_loss_backward_kernel<T><<<grid_for(nrows, 256), 256, 0, stream(dev)>>>(
        dptr<scalar_t>(grad_input), dptr<scalar_t>(grad),
        static_cast<const int64_t*>(target.storage().data()), pc, nrows, C, gcs, ix,
        grad.storage_offset(), none, ignore_index);
  });
  check_launch("nll_loss_backward");
}

}  // namespace

const SoftmaxKernels softmax_kernels{TALLY_SOFTMAX_KERNELS};

}  // namespace tally::cuda
