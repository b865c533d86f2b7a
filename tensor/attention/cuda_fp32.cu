// Fused float32 attention on CUDA (memory-efficient attention after FlashAttention-2), two
// kinds of kernels. Both match the float64 CPU reference to ~1e-5.
// - Head dim 64 (GPT-2's): on the tensor cores in 3xTF32, as PyTorch's float32
//   memory-efficient attention does on sm_80+. See "3xTF32" below.
// - Other head dims (up to 128): on the CUDA cores in plain float32 FMA, described here.
// Tiles, forward and backward of the CUDA-core kernels: docs/notes.md §17.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "tensor/attention/cuda_fp32.h"
#include "tensor/attention/cuda_rows.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/op_alloc.h"

namespace tally::cuda {
namespace {

constexpr int kBM = 64;  // query rows a tile
constexpr int kBN = 64;  // keys a tile
constexpr int kThreads = 128;
constexpr int kLdP = kBN + 8;  // probability tiles' leading dim
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// [B, H, T, E] float operand: b, h, t addressing plus the last dim's element stride sd.
struct Operand : BhtRows<const float> {
  int64_t sd;
};

// A [B, H, T, E] float output (last dim dense).
using OutOperand = BhtRows<float>;

template <int D>
struct Cfg {
  static constexpr int ld = D + 4;        // Q/K/V/dO tiles' leading dim
  static constexpr int kCols = D / 32;    // float4 column groups of an output tile per thread
  static constexpr int kTileF = 64 * ld;  // floats of a [64][D] tile
};

__device__ __forceinline__ float comp(const float4& v, int c) {
  return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}

__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// Rows [r0, r0 + R) x cols [0, D) of a [n, E] matrix (row stride st, col stride sd) into
// shared memory (leading dim D + 4), zero beyond n rows and E columns.
template <int D, int R = 64>
__device__ __forceinline__ void load_tile(float* dst, const float* src, int64_t st, int64_t sd,
                                          int r0, int n, int E, bool vec) {
  constexpr int ld = Cfg<D>::ld;
  if (vec) {
    constexpr int kChunks = D / 4;
    for (int c = threadIdx.x; c < R * kChunks; c += kThreads) {
      const int r = c / kChunks, col = (c % kChunks) * 4;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (r0 + r < n && col < E)
        v = *reinterpret_cast<const float4*>(src + static_cast<int64_t>(r0 + r) * st + col);
      *reinterpret_cast<float4*>(dst + r * ld + col) = v;
    }
  } else {
    for (int c = threadIdx.x; c < R * D; c += kThreads) {
      const int r = c / D, col = c % D;
      float v = 0.f;
      if (r0 + r < n && col < E) v = src[static_cast<int64_t>(r0 + r) * st + col * sd];
      dst[r * ld + col] = v;
    }
  }
}

// acc[i][j] += A[ra + 16 i] . B[rb + 8 j] over [0, D): the 4 x NJ score tile of a thread,
// A and B row-major [rows][ld] tiles in shared memory.
template <int D, int NJ = 8>
__device__ __forceinline__ void score_tile(float (&acc)[4][NJ], const float* A, const float* B,
                                           int ra, int rb) {
  constexpr int ld = Cfg<D>::ld;
#pragma unroll 4
  for (int d = 0; d < D; d += 4) {
    float4 a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<const float4*>(A + (ra + 16 * i) * ld + d);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float4 b = *reinterpret_cast<const float4*>(B + (rb + 8 * j) * ld + d);
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i][j] = dot4(a[i], b, acc[i][j]);
    }
  }
}

// acc[i][4 c + e] += sum_k P[r + 16 i][k] * V[k][4 tx + 32 c + e] over the NK k: P a
// [64][LdP] tile, V a [NK][ld] tile in shared memory.
template <int D, int NK = kBN, int LdP = kLdP>
__device__ __forceinline__ void pv_tile(float (&acc)[4][4 * Cfg<D>::kCols], const float* P,
                                        const float* V, int r, int tx) {
  constexpr int ld = Cfg<D>::ld, kCols = Cfg<D>::kCols;
#pragma unroll 2
  for (int kk = 0; kk < NK; kk += 4) {
    float4 a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      a[i] = *reinterpret_cast<const float4*>(P + (r + 16 * i) * LdP + kk);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const float4 b = *reinterpret_cast<const float4*>(V + (kk + e) * ld + 4 * tx + 32 * c);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float av = comp(a[i], e);
          acc[i][4 * c + 0] = fmaf(av, b.x, acc[i][4 * c + 0]);
          acc[i][4 * c + 1] = fmaf(av, b.y, acc[i][4 * c + 1]);
          acc[i][4 * c + 2] = fmaf(av, b.z, acc[i][4 * c + 2]);
          acc[i][4 * c + 3] = fmaf(av, b.w, acc[i][4 * c + 3]);
        }
      }
    }
  }
}

// Writes a thread's output rows (acc[i] * mul[i], columns 4 tx + 32 c + e) to the
// contiguous [n, E] matrix dst, rows row0 + 16 i.
template <int D>
__device__ __forceinline__ void store_rows(float* dst, int64_t st,
                                           const float (&acc)[4][4 * Cfg<D>::kCols],
                                           const float (&mul)[4], int row0, int n, int E, int tx,
                                           bool vec) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = row0 + 16 * i;
    if (row >= n) continue;
    float* out = dst + static_cast<int64_t>(row) * st;
#pragma unroll
    for (int c = 0; c < Cfg<D>::kCols; ++c) {
      const int col = 4 * tx + 32 * c;
      if (col >= E) continue;
      if (vec) {
        *reinterpret_cast<float4*>(out + col) =
            make_float4(acc[i][4 * c] * mul[i], acc[i][4 * c + 1] * mul[i],
                        acc[i][4 * c + 2] * mul[i], acc[i][4 * c + 3] * mul[i]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (col + e < E) out[col + e] = acc[i][4 * c + e] * mul[i];
      }
    }
  }
}

// Butterfly max and sum over the Lanes lanes (consecutive, a power of two) that share a row.
template <int Lanes>
__device__ __forceinline__ float lanes_max(float v) {
#pragma unroll
  for (int w = 1; w < Lanes; w *= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, w));
  return v;
}
template <int Lanes>
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
  for (int w = 1; w < Lanes; w *= 2) v += __shfl_xor_sync(0xffffffffu, v, w);
  return v;
}

// A forward score of query row `row` and key `col` in log2 units (s * scale log2 e), -inf where
// masked (need_mask: the tile reaches past S, or the causal diagonal): past S or, causal, a key
// after the query.
// The mask's base-2 term of (row, col) (0 without a mask), at slice offset mbase; row < L and
// col < S.
template <typename P>
__device__ __forceinline__ float mask_log2(const P& p, int64_t mbase, int row, int col) {
  if (p.mask_kind == kBoolMask)
    return p.mask.template log2_bias<kBoolMask>(mbase, row, col, kLog2e);
  if (p.mask_kind == kBiasMask)
    return p.mask.template log2_bias<kBiasMask>(mbase, row, col, kLog2e);
  return 0.f;
}

// With an attention mask every tile is masked (need_mask) and the mask's term is added.
template <typename P>
__device__ __forceinline__ float scaled_score(float s, const P& p, bool need_mask, int row, int col,
                                              int64_t mbase) {
  if (need_mask && (col >= p.S || (p.causal && col > row))) return -INFINITY;
  if (need_mask && p.mask_kind != kNoMask && row < p.L)
    return s * p.scale_log2 + mask_log2(p, mbase, row, col);
  return s * p.scale_log2;
}

// lse in base 2 as the backward's P = exp2(s - lse) takes it: +inf for a row without any
// allowed key (lse -inf), so that all its P are 0.
__device__ __forceinline__ float lse_log2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// The online softmax's step for a row whose new tile has the max mx: the running max m
// updated, the reference the tile's exponentials take (0 while the row is all -inf) and
// alpha, the factor that rescales what was accumulated against the old max.
struct OnlineStep {
  float mref, alpha;
};
__device__ __forceinline__ OnlineStep online_step(float& m, float mx) {
  const float mnew = fmaxf(m, mx);
  const float mref = mnew == -INFINITY ? 0.f : mnew;
  const float alpha = exp2f(m - mref);
  m = mnew;
  return {mref, alpha};
}

// ------------------------------------------------------------------ forward

struct FwdArgs {
  Operand q, k, v;  // k, v [B, Hk, S, E]: query head h reads key/value head h / (H / Hk)
  OutOperand o;     // [B, H, L, E]
  float* lse;       // [B, H, L] contiguous
  MaskRows mask;    // [B, H, L, S], of kind mask_kind (cuda_rows.cuh)
  int mask_kind;
  int H, Hk, L, S, E;
  float scale_log2;
  bool causal, vec_in, vec_out;
};

template <int D>
constexpr size_t fwd_smem_floats() {
  constexpr int kp = Cfg<D>::kTileF > kBM * kLdP ? Cfg<D>::kTileF : kBM * kLdP;
  return 2 * static_cast<size_t>(Cfg<D>::kTileF) + kp;
}

template <int D>
__global__ void __launch_bounds__(kThreads) attention_fwd_fp32_kernel(FwdArgs p) {
  using C = Cfg<D>;
  constexpr int kKP = C::kTileF > kBM * kLdP ? C::kTileF : kBM * kLdP;
  extern __shared__ float4 smem_f4[];
  float* sQ = reinterpret_cast<float*>(smem_f4);
  float* sK = sQ + C::kTileF;  // K, then P of the same tile
  float* sP = sK;
  float* sV = sK + kKP;

  const int tx = threadIdx.x % 8, ty = threadIdx.x / 8;
  const int qt = p.causal ? gridDim.y - 1 - blockIdx.y : blockIdx.y;  // heaviest first
  const int bh = blockIdx.x;
  const int q0 = qt * kBM;

  load_tile<D>(sQ, p.q.rows(bh, p.H), p.q.st, p.q.sd, q0, p.L, p.E, p.vec_in);

  float m[4], l[4], o[4][4 * C::kCols];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < 4 * C::kCols; ++c) o[i][c] = 0.f;
  }

  int ntiles = (p.S + kBN - 1) / kBN;
  if (p.causal) ntiles = min(ntiles, qt + 1);  // keys <= q0 + 63
  const int bkv = kv_slice(bh, p.H, p.Hk);
  const float* krows = p.k.rows(bkv, p.Hk);
  const float* vrows = p.v.rows(bkv, p.Hk);
  const int64_t mbase = p.mask_kind != kNoMask ? p.mask.base(bh, p.H) : 0;
  for (int kt = 0; kt < ntiles; ++kt) {
    const int k0 = kt * kBN;
    __syncthreads();  // everyone is done with the previous P (in sK) and V
    load_tile<D>(sK, krows, p.k.st, p.k.sd, k0, p.S, p.E, p.vec_in);
    load_tile<D>(sV, vrows, p.v.st, p.v.sd, k0, p.S, p.E, p.vec_in);
    __syncthreads();

    float s[4][8];
    zero_tile(s);
    score_tile<D>(s, sQ, sK, ty, tx);

    const bool need_mask =
        p.mask_kind != kNoMask || k0 + kBN > p.S || (p.causal && k0 + kBN - 1 > q0);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = q0 + ty + 16 * i;
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[i][j] = scaled_score(s[i][j], p, need_mask, row, k0 + tx + 8 * j, mbase);
        mx = fmaxf(mx, s[i][j]);
      }
      // the row's 8 lanes are lanes 8 g .. 8 g + 7 of the warp
      const OnlineStep st = online_step(m[i], lanes_max<8>(mx));
      const float mref = st.mref, alpha = st.alpha;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float e = exp2f(s[i][j] - mref);
        s[i][j] = e;
        sum += e;
      }
      l[i] = l[i] * alpha + sum;  // this lane's part of the row sum
#pragma unroll
      for (int c = 0; c < 4 * C::kCols; ++c) o[i][c] *= alpha;
    }
    __syncthreads();  // all scores read from sK: P may overwrite it
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) sP[(ty + 16 * i) * kLdP + tx + 8 * j] = s[i][j];
    __syncthreads();
    pv_tile<D>(o, sP, sV, ty, tx);
  }

  float inv[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float li = lanes_sum<8>(l[i]);
    inv[i] = li > 0.f ? 1.f / li : 0.f;
    const int row = q0 + ty + 16 * i;
    if (tx == 0 && row < p.L)
      p.lse[static_cast<int64_t>(bh) * p.L + row] =
          li > 0.f ? (m[i] + log2f(li)) * kLn2 : -INFINITY;
  }
  store_rows<D>(p.o.rows(bh, p.H), p.o.st, o, inv, q0 + ty, p.L, p.E, tx, p.vec_out);
}

// ------------------------------------------------------------------ backward

// dvec[row] = sum_d dO[row, d] * O[row, d], one warp a row; also zeroes dq's row.
__global__ void attention_bwd_prep_fp32_kernel(Operand dout, Operand out, float* dvec,
                                               OutOperand dq, int H, int L, int E, int64_t rows) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int bh = static_cast<int>(row / L), i = static_cast<int>(row % L);
  const float* g = dout.rows(bh, H) + static_cast<int64_t>(i) * dout.st;
  const float* o = out.rows(bh, H) + static_cast<int64_t>(i) * out.st;
  float* dqrow = dq.rows(bh, H) + static_cast<int64_t>(i) * dq.st;
  float acc = 0.f;
  for (int d = lane; d < E; d += 32) {
    acc = fmaf(g[d * dout.sd], o[d * out.sd], acc);
    dqrow[d] = 0.f;
  }
  for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (lane == 0) dvec[row] = acc;
}

// The same for rows of 16-byte aligned float4s (dO, O and dq): D / 4 lanes a row, each one
// float4 of the three, so a warp covers 32 / (D / 4) rows with one load of each operand.
template <int D>
__global__ void attention_bwd_prep_fp32_vec_kernel(Operand dout, Operand out, float* dvec,
                                                   OutOperand dq, int H, int L, int E,
                                                   int64_t rows) {
  constexpr int kLanes = D / 4;  // divides 32: a row's lanes sit in one warp
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = tid / kLanes;
  const int col = static_cast<int>(tid % kLanes) * 4;
  float acc = 0.f;
  if (row < rows && col < E) {
    const int bh = static_cast<int>(row / L), i = static_cast<int>(row % L);
    const float4 g = *reinterpret_cast<const float4*>(dout.rows(bh, H) +
                                                      static_cast<int64_t>(i) * dout.st + col);
    const float4 o =
        *reinterpret_cast<const float4*>(out.rows(bh, H) + static_cast<int64_t>(i) * out.st + col);
    acc = dot4(g, o, 0.f);
    *reinterpret_cast<float4*>(dq.rows(bh, H) + static_cast<int64_t>(i) * dq.st + col) =
        make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // Every lane takes part (no early exit), so the full mask holds.
#pragma unroll
  for (int s = kLanes / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (row < rows && col == 0) dvec[row] = acc;
}

// Grouped-query heads: the block of a key/value head's key tile walks the query tiles of each
// of its H / Hk query heads in turn (dK, dV summed in registers, no atomics).
struct BwdArgs {
  Operand q, k, v, dout;  // k, v [B, Hk, S, E]
  const float* lse;       // [B, H, L]
  const float* dvec;      // [B, H, L]
  OutOperand dq;          // [B, H, L, E], zeroed by the prep kernel
  OutOperand dk;          // [B, Hk, S, E]
  OutOperand dv;
  MaskRows mask;  // [B, H, L, S]
  int mask_kind;
  int H, Hk, L, S, E;
  float scale, scale_log2;
  bool causal, vec_in, vec_out;
};

// A backward step's query tile: Q and dO rows q0 .. q0 + QM - 1 of query slice bh into shared
// memory with their lse (base 2, lse_log2) and D = dO . O (rows past L: zeros).
template <int D, int QM>
__device__ __forceinline__ void load_query_tile(float* sQ, float* sdO, float* sLse, float* sDv,
                                                const BwdArgs& p, int bh, int q0) {
  const int64_t row_base = static_cast<int64_t>(bh) * p.L;
  load_tile<D, QM>(sQ, p.q.rows(bh, p.H), p.q.st, p.q.sd, q0, p.L, p.E, p.vec_in);
  load_tile<D, QM>(sdO, p.dout.rows(bh, p.H), p.dout.st, p.dout.sd, q0, p.L, p.E, p.vec_in);
  for (int i = threadIdx.x; i < QM; i += kThreads) {
    const bool ok = q0 + i < p.L;
    sLse[i] = ok ? lse_log2(p.lse[row_base + q0 + i]) : 0.f;
    sDv[i] = ok ? p.dvec[row_base + q0 + i] : 0.f;
  }
}

// The backward's query tile: QM rows (64, or 32 to fit three blocks an SM at D = 64).
template <int D, int QM>
constexpr size_t bwd_smem_floats() {
  return 2 * static_cast<size_t>(Cfg<D>::kTileF) + 2 * static_cast<size_t>(QM) * Cfg<D>::ld +
         2 * kBN * (QM + 8) + 2 * QM;
}

template <int D, int QM>
__global__ void __launch_bounds__(kThreads, QM == 32 ? 3 : 0) attention_bwd_fp32_kernel(BwdArgs p) {
  using C = Cfg<D>;
  constexpr int kCols = C::kCols;
  constexpr int kNJ = QM / 8;       // query columns of a thread's score tile
  constexpr int kLdT = QM + 8;      // P^T / dS^T leading dim
  constexpr int kQG = QM / 4;       // dQ: groups of 4 query rows
  constexpr int kSplit = 16 / kQG;  // dQ: threads sharing a group's columns
  constexpr int kColsQ = D / (32 * kSplit);
  static_assert(kColsQ >= 1, "the 32-row query tile needs D >= 64");
  extern __shared__ float4 smem_f4[];
  float* sK = reinterpret_cast<float*>(smem_f4);
  float* sV = sK + C::kTileF;
  float* sQ = sV + C::kTileF;
  float* sdO = sQ + QM * C::ld;
  float* sPt = sdO + QM * C::ld;    // P^T [64 keys][kLdT]
  float* sdSt = sPt + kBN * kLdT;   // dS^T [64 keys][kLdT]
  float* sLse = sdSt + kBN * kLdT;  // lse * log2(e) of the tile's queries
  float* sDv = sLse + QM;

  const int tx = threadIdx.x % 8, ty = threadIdx.x / 8;
  const int kt = blockIdx.y, bkv = blockIdx.x;  // causal: key tile 0 has the most work
  const int k0 = kt * kBN;
  const int G = p.H / p.Hk, bh0 = (bkv / p.Hk) * p.H + (bkv % p.Hk) * G;

  load_tile<D>(sK, p.k.rows(bkv, p.Hk), p.k.st, p.k.sd, k0, p.S, p.E, p.vec_in);
  load_tile<D>(sV, p.v.rows(bkv, p.Hk), p.v.st, p.v.sd, k0, p.S, p.E, p.vec_in);

  // rows: keys k0 + ty + 16 i; columns 4 tx + 32 c + e
  float dk[4][4 * kCols], dv[4][4 * kCols];
  zero_tile(dk);
  zero_tile(dv);

  const int qtiles = (p.L + QM - 1) / QM;
  for (int bh = bh0; bh < bh0 + G; ++bh) {  // the key/value head's query heads
    const int64_t mbase = p.mask_kind != kNoMask ? p.mask.base(bh, p.H) : 0;
    for (int qt = p.causal ? kt * (kBN / QM) : 0; qt < qtiles; ++qt) {
      const int q0 = qt * QM;
      __syncthreads();  // the previous tile's Q, dO, P^T, dS^T are free
      load_query_tile<D, QM>(sQ, sdO, sLse, sDv, p, bh, q0);
      __syncthreads();

      // S^T and dP^T: rows keys ty + 16 i, columns queries tx + 8 j
      {
        float s[4][kNJ], dp[4][kNJ];
        zero_tile(s);
        zero_tile(dp);
        score_tile<D, kNJ>(s, sK, sQ, ty, tx);
        score_tile<D, kNJ>(dp, sV, sdO, ty, tx);
        const bool need_mask = p.mask_kind != kNoMask || q0 + QM > p.L || k0 + kBN > p.S ||
                               (p.causal && k0 + kBN - 1 > q0);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = k0 + ty + 16 * i;
#pragma unroll
          for (int j = 0; j < kNJ; ++j) {
            const int qi = tx + 8 * j, q = q0 + qi;
            const bool ok = !need_mask || (key < p.S && q < p.L && (!p.causal || key <= q));
            float x = fmaf(s[i][j], p.scale_log2, -sLse[qi]);
            if (ok && need_mask) x += mask_log2(p, mbase, q, key);
            const float pr = ok ? exp2f(x) : 0.f;
            sPt[(ty + 16 * i) * kLdT + qi] = pr;
            sdSt[(ty + 16 * i) * kLdT + qi] = pr * (dp[i][j] - sDv[qi]) * p.scale;
          }
        }
      }
      __syncthreads();
      pv_tile<D, QM, kLdT>(dv, sPt, sdO, ty, tx);  // dV += P^T dO
      pv_tile<D, QM, kLdT>(dk, sdSt, sQ, ty, tx);  // dK += dS^T Q
      // dQ tile = dS K: rows queries 4 qg + i, columns 4 (tx + 8 cs + 8 kSplit c) + e;
      // dS[q][k] = dS^T[k][q]
      {
        const int qg = kSplit == 1 ? ty : ty % kQG, cs = kSplit == 1 ? 0 : ty / kQG;
        float acc[4][4 * kColsQ];
        zero_tile(acc);
#pragma unroll 4
        for (int kk = 0; kk < kBN; ++kk) {
          const float4 a = *reinterpret_cast<const float4*>(sdSt + kk * kLdT + 4 * qg);
#pragma unroll
          for (int c = 0; c < kColsQ; ++c) {
            const float4 b = *reinterpret_cast<const float4*>(sK + kk * C::ld +
                                                              4 * (tx + 8 * cs + 8 * kSplit * c));
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float av = comp(a, i);
              acc[i][4 * c + 0] = fmaf(av, b.x, acc[i][4 * c + 0]);
              acc[i][4 * c + 1] = fmaf(av, b.y, acc[i][4 * c + 1]);
              acc[i][4 * c + 2] = fmaf(av, b.z, acc[i][4 * c + 2]);
              acc[i][4 * c + 3] = fmaf(av, b.w, acc[i][4 * c + 3]);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int q = q0 + 4 * qg + i;
          if (q >= p.L) continue;
          float* dst = p.dq.rows(bh, p.H) + static_cast<int64_t>(q) * p.dq.st;
#pragma unroll
          for (int c = 0; c < kColsQ; ++c) {
            const int col = 4 * (tx + 8 * cs + 8 * kSplit * c);
            if (col >= p.E) continue;
            if (p.vec_out) {
              add4(dst + col, acc[i][4 * c], acc[i][4 * c + 1], acc[i][4 * c + 2],
                   acc[i][4 * c + 3]);
            } else {
#pragma unroll
              for (int e = 0; e < 4; ++e)
                if (col + e < p.E) atomicAdd(dst + col + e, acc[i][4 * c + e]);
            }
          }
        }
      }
    }
  }
  const float one[4] = {1.f, 1.f, 1.f, 1.f};
  store_rows<D>(p.dv.rows(bkv, p.Hk), p.dv.st, dv, one, k0 + ty, p.S, p.E, tx, p.vec_out);
  store_rows<D>(p.dk.rows(bkv, p.Hk), p.dk.st, dk, one, k0 + ty, p.S, p.E, tx, p.vec_out);
}

// ------------------------------------------------------------------ 3xTF32 (D = 64)
//
// The same forward and backward on the tensor cores (mma.sync m16n8k8 in TF32), with float32
// accuracy kept by splitting each operand x into big = tf32(x) and small = tf32(x - big) and
// summing big * big + big * small + small * big (3xTF32; the small * small term is below
// float32's rounding). This is the arithmetic of PyTorch's float32 memory-efficient attention
// on sm_80+ (CUTLASS's OpMultiplyAddFastF32).
//
// Backward: a block: 64 keys, 4 warps; warp w owns keys 16 w .. 16 w + 15. Per 64-row query tile:
// S^T = K Q^T and dP^T = V dO^T in registers (a warp's 16 keys x 64 queries), P^T and dS^T
// from them in registers, dV += P^T dO and dK += dS^T Q straight from those registers (the
// accumulator's columns 2t, 2t + 1 are taken as the A operand's k-columns t, t + 4, and dO's /
// Q's rows are read in the same order), dS^T through shared memory for dQ = dS K (warp w:
// queries 16 w .. 16 w + 15), added to dq with float2 atomics. Fragment layouts (PTX ISA,
// mma.m16n8k8 .tf32): lane = 4 g + t; A a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
// a3 (g + 8, t + 4); B b0 (k t, n g), b1 (k t + 4, n g); C c0 (g, 2t), c1 (g, 2t + 1),
// c2 (g + 8, 2t), c3 (g + 8, 2t + 1). Leading dims 68 (K, V, Q, dO) and 72 (dS^T) keep every
// fragment load but dQ's K operand (two-way) free of bank conflicts.

constexpr int kTcQM = 64;          // query rows a tile
constexpr int kTcLdT = kTcQM + 8;  // dS^T's leading dim

struct Tf32Pair {
  uint32_t big, small;
};

__device__ __forceinline__ Tf32Pair split_tf32(float x) {
  Tf32Pair r{0u, 0u};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r.big) : "f"(x));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r.small) : "f"(x - __uint_as_float(r.big)));
#endif
  return r;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// d += a b in 3xTF32 (the small terms first).
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const Tf32Pair (&a)[4],
                                           const Tf32Pair (&b)[2]) {
  mma_tf32(d, a[0].big, a[1].big, a[2].big, a[3].big, b[0].small, b[1].small);
  mma_tf32(d, a[0].small, a[1].small, a[2].small, a[3].small, b[0].big, b[1].big);
  mma_tf32(d, a[0].big, a[1].big, a[2].big, a[3].big, b[0].big, b[1].big);
}

constexpr size_t bwd_tc_smem_floats() {
  constexpr int ld = Cfg<64>::ld;
  return 4 * static_cast<size_t>(64) * ld + static_cast<size_t>(kBN) * kTcLdT + 2 * kTcQM;
}

// The forward on the tensor cores: warp w owns query rows 16 w + g (c0, c1) and + 8 (c2, c3)
// of the block's 64; S = Q K^T and O += P V as above (P stays in registers), the online
// softmax's row max and sum over the row's 4 lanes (t) with shuffles.
constexpr size_t fwd_tc_smem_floats() {
  return 3 * static_cast<size_t>(64) * Cfg<64>::ld;
}

__global__ void __launch_bounds__(kThreads) attention_fwd_tf32x3_kernel(FwdArgs p) {
  constexpr int D = 64, ld = Cfg<D>::ld;
  constexpr int kNT = 4 * Cfg<D>::kCols;  // 8-column tiles of the head dim
  extern __shared__ float4 smem_f4[];
  float* sQ = reinterpret_cast<float*>(smem_f4);
  float* sK = sQ + kBM * ld;
  float* sV = sK + kBN * ld;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int qt = p.causal ? gridDim.y - 1 - blockIdx.y : blockIdx.y;  // heaviest first
  const int bh = blockIdx.x;
  const int q0 = qt * kBM;
  const int qr = 16 * warp + g;  // this lane's query rows in the tile: qr, qr + 8

  load_tile<D>(sQ, p.q.rows(bh, p.H), p.q.st, p.q.sd, q0, p.L, p.E, p.vec_in);

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[kNT][4];
  zero_tile(o);

  int ntiles = (p.S + kBN - 1) / kBN;
  if (p.causal) ntiles = min(ntiles, qt + 1);  // keys <= q0 + 63
  const int bkv = kv_slice(bh, p.H, p.Hk);
  const float* krows = p.k.rows(bkv, p.Hk);
  const float* vrows = p.v.rows(bkv, p.Hk);
  const int64_t mbase = p.mask_kind != kNoMask ? p.mask.base(bh, p.H) : 0;
  for (int kt = 0; kt < ntiles; ++kt) {
    const int k0 = kt * kBN;
    __syncthreads();  // everyone is done with the previous K and V
    load_tile<D>(sK, krows, p.k.st, p.k.sd, k0, p.S, p.E, p.vec_in);
    load_tile<D>(sV, vrows, p.v.st, p.v.sd, k0, p.S, p.E, p.vec_in);
    __syncthreads();

    // S: [j] = keys 8 j .. 8 j + 7 of the tile
    float s[8][4];
    zero_tile(s);
#pragma unroll 2
    for (int kk = 0; kk < D; kk += 8) {
      const float* qa = sQ + qr * ld + kk + t;
      const Tf32Pair fq[4] = {split_tf32(qa[0]), split_tf32(qa[8 * ld]), split_tf32(qa[4]),
                              split_tf32(qa[8 * ld + 4])};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float* kb = sK + (8 * j + g) * ld + kk + t;
        const Tf32Pair fk[2] = {split_tf32(kb[0]), split_tf32(kb[4])};
        mma_3xtf32(s[j], fq, fk);
      }
    }

    const bool need_mask =
        p.mask_kind != kNoMask || k0 + kBN > p.S || (p.causal && k0 + kBN - 1 > q0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = q0 + qr + 8 * h;
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[j][e] = scaled_score(s[j][e], p, need_mask, row, k0 + 8 * j + 2 * t + (e & 1), mbase);
          mx = fmaxf(mx, s[j][e]);
        }
      }
      // the row's 4 lanes are 4 g .. 4 g + 3
      const OnlineStep st = online_step(m[h], lanes_max<4>(mx));
      const float mref = st.mref, alpha = st.alpha;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const float pe = exp2f(s[j][e] - mref);
          s[j][e] = pe;
          sum += pe;
        }
      }
      l[h] = l[h] * alpha + sum;  // this lane's part of the row sum
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        o[n][2 * h] *= alpha;
        o[n][2 * h + 1] *= alpha;
      }
    }

    // O += P V: k-step j over keys 8 j .. 8 j + 7 in the order (2t, 2t + 1)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const Tf32Pair fp[4] = {split_tf32(s[j][0]), split_tf32(s[j][2]), split_tf32(s[j][1]),
                              split_tf32(s[j][3])};
      const float* vb = sV + (8 * j + 2 * t) * ld + g;
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        const Tf32Pair fv[2] = {split_tf32(vb[8 * n]), split_tf32(vb[ld + 8 * n])};
        mma_3xtf32(o[n], fp, fv);
      }
    }
  }

  float* orows = p.o.rows(bh, p.H);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float li = lanes_sum<4>(l[h]);
    const float inv = li > 0.f ? 1.f / li : 0.f;
    const int row = q0 + qr + 8 * h;
    if (row >= p.L) continue;
    if (t == 0)
      p.lse[static_cast<int64_t>(bh) * p.L + row] =
          li > 0.f ? (m[h] + log2f(li)) * kLn2 : -INFINITY;
    float* out = orows + static_cast<int64_t>(row) * p.o.st;
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const int col = 8 * n + 2 * t;
      if (col >= p.E) continue;
      if (p.vec_out) {
        *reinterpret_cast<float2*>(out + col) =
            make_float2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
      } else {
        out[col] = o[n][2 * h] * inv;
        if (col + 1 < p.E) out[col + 1] = o[n][2 * h + 1] * inv;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, 2) attention_bwd_tf32x3_kernel(BwdArgs p) {
  constexpr int D = 64, ld = Cfg<D>::ld, QM = kTcQM, kLdT = kTcLdT;
  constexpr int kNT = 4 * Cfg<D>::kCols;  // 8-column tiles of the head dim
  extern __shared__ float4 smem_f4[];
  float* sK = reinterpret_cast<float*>(smem_f4);
  float* sV = sK + 64 * ld;
  float* sQ = sV + 64 * ld;
  float* sdO = sQ + QM * ld;
  float* sdSt = sdO + QM * ld;  // dS^T [64 keys][kLdT]
  float* sLse = sdSt + kBN * kLdT;
  float* sDv = sLse + QM;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int kt = blockIdx.y, bkv = blockIdx.x;
  const int k0 = kt * kBN;
  const int kr = 16 * warp + g;  // this lane's key rows in the tile: kr, kr + 8
  const int G = p.H / p.Hk, bh0 = (bkv / p.Hk) * p.H + (bkv % p.Hk) * G;

  load_tile<D>(sK, p.k.rows(bkv, p.Hk), p.k.st, p.k.sd, k0, p.S, p.E, p.vec_in);
  load_tile<D>(sV, p.v.rows(bkv, p.Hk), p.v.st, p.v.sd, k0, p.S, p.E, p.vec_in);

  // dv[n], dk[n]: keys kr (c0, c1) and kr + 8 (c2, c3), columns 8 n + 2 t, + 1
  float dv[kNT][4], dk[kNT][4];
  zero_tile(dv);
  zero_tile(dk);

  const int qtiles = (p.L + QM - 1) / QM;
  for (int bh = bh0; bh < bh0 + G; ++bh) {  // the key/value head's query heads
    const int64_t mbase = p.mask_kind != kNoMask ? p.mask.base(bh, p.H) : 0;
    for (int qt = p.causal ? kt : 0; qt < qtiles; ++qt) {
      const int q0 = qt * QM;
      __syncthreads();  // the previous tile's Q, dO, dS^T are free
      load_query_tile<D, QM>(sQ, sdO, sLse, sDv, p, bh, q0);
      __syncthreads();

      // S^T and dP^T: [j] = queries 8 j .. 8 j + 7 of the tile
      float s[8][4], dp[8][4];
      zero_tile(s);
      zero_tile(dp);
#pragma unroll 2
      for (int kk = 0; kk < D; kk += 8) {
        const float* ka = sK + kr * ld + kk + t;
        const float* va = sV + kr * ld + kk + t;
        const Tf32Pair fk[4] = {split_tf32(ka[0]), split_tf32(ka[8 * ld]), split_tf32(ka[4]),
                                split_tf32(ka[8 * ld + 4])};
        const Tf32Pair fv[4] = {split_tf32(va[0]), split_tf32(va[8 * ld]), split_tf32(va[4]),
                                split_tf32(va[8 * ld + 4])};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float* qb = sQ + (8 * j + g) * ld + kk + t;
          const float* ob = sdO + (8 * j + g) * ld + kk + t;
          const Tf32Pair fq[2] = {split_tf32(qb[0]), split_tf32(qb[4])};
          const Tf32Pair fo[2] = {split_tf32(ob[0]), split_tf32(ob[4])};
          mma_3xtf32(s[j], fk, fq);
          mma_3xtf32(dp[j], fv, fo);
        }
      }

      // P^T into s, dS^T into dp (and shared memory)
      const bool need_mask = p.mask_kind != kNoMask || q0 + QM > p.L || k0 + kBN > p.S ||
                             (p.causal && k0 + kBN - 1 > q0);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + kr + (e >= 2 ? 8 : 0);
          const int qi = 8 * j + 2 * t + (e & 1), q = q0 + qi;
          const bool ok = !need_mask || (key < p.S && q < p.L && (!p.causal || key <= q));
          float x = fmaf(s[j][e], p.scale_log2, -sLse[qi]);
          if (ok && need_mask) x += mask_log2(p, mbase, q, key);
          const float pr = ok ? exp2f(x) : 0.f;
          s[j][e] = pr;
          dp[j][e] = pr * (dp[j][e] - sDv[qi]) * p.scale;
        }
        *reinterpret_cast<float2*>(sdSt + kr * kLdT + 8 * j + 2 * t) =
            make_float2(dp[j][0], dp[j][1]);
        *reinterpret_cast<float2*>(sdSt + (kr + 8) * kLdT + 8 * j + 2 * t) =
            make_float2(dp[j][2], dp[j][3]);
      }

      // dV += P^T dO, dK += dS^T Q: k-step j over queries 8 j .. 8 j + 7, in the order
      // (2t, 2t + 1) for the A operand's columns (t, t + 4)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const Tf32Pair fp[4] = {split_tf32(s[j][0]), split_tf32(s[j][2]), split_tf32(s[j][1]),
                                split_tf32(s[j][3])};
        const Tf32Pair fs[4] = {split_tf32(dp[j][0]), split_tf32(dp[j][2]), split_tf32(dp[j][1]),
                                split_tf32(dp[j][3])};
        const float* ob = sdO + (8 * j + 2 * t) * ld + g;
        const float* qb = sQ + (8 * j + 2 * t) * ld + g;
#pragma unroll
        for (int n = 0; n < kNT; ++n) {
          const Tf32Pair fo[2] = {split_tf32(ob[8 * n]), split_tf32(ob[ld + 8 * n])};
          const Tf32Pair fq[2] = {split_tf32(qb[8 * n]), split_tf32(qb[ld + 8 * n])};
          mma_3xtf32(dv[n], fp, fo);
          mma_3xtf32(dk[n], fs, fq);
        }
      }
      __syncthreads();  // dS^T complete

      // dQ = dS K: warp w's queries 16 w + g (c0, c1) and + 8 (c2, c3), columns 8 n + 2 t, + 1
      {
        float dq[kNT][4];
        zero_tile(dq);
        const int qr = 16 * warp + g;
#pragma unroll 2
        for (int kk = 0; kk < kBN; kk += 8) {
          const float* da = sdSt + (kk + t) * kLdT + qr;
          const Tf32Pair fa[4] = {split_tf32(da[0]), split_tf32(da[8]), split_tf32(da[4 * kLdT]),
                                  split_tf32(da[4 * kLdT + 8])};
          const float* kb = sK + (kk + t) * ld + g;
#pragma unroll
          for (int n = 0; n < kNT; ++n) {
            const Tf32Pair fb[2] = {split_tf32(kb[8 * n]), split_tf32(kb[4 * ld + 8 * n])};
            mma_3xtf32(dq[n], fa, fb);
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int q = q0 + qr + 8 * h;
          if (q >= p.L) continue;
          float* dst = p.dq.rows(bh, p.H) + static_cast<int64_t>(q) * p.dq.st;
#pragma unroll
          for (int n = 0; n < kNT; ++n) {
            const int col = 8 * n + 2 * t;
            if (col >= p.E) continue;
            if (p.vec_out) {
              add2(dst + col, dq[n][2 * h], dq[n][2 * h + 1]);
            } else {
              atomicAdd(dst + col, dq[n][2 * h]);
              if (col + 1 < p.E) atomicAdd(dst + col + 1, dq[n][2 * h + 1]);
            }
          }
        }
      }
    }
  }

  // dV and dK rows k0 + kr (+ 8)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = k0 + kr + 8 * h;
    if (key >= p.S) continue;
    float* dvr = p.dv.rows(bkv, p.Hk) + static_cast<int64_t>(key) * p.dv.st;
    float* dkr = p.dk.rows(bkv, p.Hk) + static_cast<int64_t>(key) * p.dk.st;
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const int col = 8 * n + 2 * t;
      if (col >= p.E) continue;
      if (p.vec_out) {
        *reinterpret_cast<float2*>(dvr + col) = make_float2(dv[n][2 * h], dv[n][2 * h + 1]);
        *reinterpret_cast<float2*>(dkr + col) = make_float2(dk[n][2 * h], dk[n][2 * h + 1]);
      } else {
        dvr[col] = dv[n][2 * h];
        dkr[col] = dk[n][2 * h];
        if (col + 1 < p.E) {
          dvr[col + 1] = dv[n][2 * h + 1];
          dkr[col + 1] = dk[n][2 * h + 1];
        }
      }
    }
  }
}

// ------------------------------------------------------------------ launchers

Operand operand(const Tensor& t) {
  return {bht_rows<const float>(t), t.strides()[3]};
}

// Outputs are allocated by tensor/attention/ops.cpp with a dense last dim.
OutOperand out_operand(const Tensor& t) {
  if (t.size(3) > 1 && t.strides()[3] != 1)
    throw std::invalid_argument("flash_attention (float32): outputs need a dense last dim");
  return bht_rows<float>(t);
}

// Whether every row of t starts 16-byte aligned with a dense last dim (float4 loads).
bool rows_aligned(const Tensor& t) {
  if (t.size(3) % 4 != 0 || (t.strides()[3] != 1 && t.size(3) > 1)) return false;
  if (t.storage_offset() % 4 != 0) return false;
  if (reinterpret_cast<uintptr_t>(t.storage().data()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && t.strides()[static_cast<size_t>(d)] % 4 != 0) return false;
  return true;
}

void check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t E = q.size(3);
  if (q.dtype() != DType::float32 || k.dtype() != DType::float32 || v.dtype() != DType::float32 ||
      E < 1 || E > 128 || v.size(3) != E)
    throw std::invalid_argument(std::string(op) +
                                ": the float32 CUDA kernel takes float32 q, k, v with head dim "
                                "E == Ev, 1 <= E <= 128; got E " +
                                std::to_string(E) + ", Ev " + std::to_string(v.size(3)));
  const int64_t tiles = (std::max(q.size(2), k.size(2)) + kBM - 1) / kBM;
  if (tiles > 65535 || q.size(0) * q.size(1) > INT32_MAX || q.size(2) > INT32_MAX / 2 ||
      k.size(2) > INT32_MAX / 2)
    throw std::invalid_argument(std::string(op) + ": sequence longer than 65535 * 64 on CUDA");
}

template <typename F>
void with_dim(int64_t E, F&& f) {
  if (E <= 32)
    f.template operator()<32>();
  else if (E <= 64)
    f.template operator()<64>();
  else
    f.template operator()<128>();
}

// The CUDA-core backward's query tile (head dims 32 and 128).
constexpr int kBwdQM = 64;

// Which kernels a head dim takes (the 3xTF32 ones at 64, the CUDA-core ones otherwise) and
// the dynamic shared memory their launches ask for.
template <int D>
constexpr bool kTf32x3 = D == 64;
template <int D>
constexpr size_t fwd_smem_bytes() {
  return sizeof(float) * (kTf32x3<D> ? fwd_tc_smem_floats() : fwd_smem_floats<D>());
}
template <int D>
constexpr size_t bwd_smem_bytes() {
  return sizeof(float) * (kTf32x3<D> ? bwd_tc_smem_floats() : bwd_smem_floats<D, kBwdQM>());
}

template <int D>
void forward_impl(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                  const Tensor& v, bool causal, double scale, const Tensor& mask) {
  const bool vec_out = q.size(3) % 4 == 0;
  FwdArgs p{operand(q),
            operand(k),
            operand(v),
            out_operand(out),
            static_cast<float*>(lse.storage().data()) + lse.storage_offset(),
            mask_rows(mask),
            mask_kind(mask),
            static_cast<int>(q.size(1)),
            static_cast<int>(k.size(1)),
            static_cast<int>(q.size(2)),
            static_cast<int>(k.size(2)),
            static_cast<int>(q.size(3)),
            static_cast<float>(scale * 1.4426950408889634),
            causal,
            rows_aligned(q) && rows_aligned(k) && rows_aligned(v),
            vec_out && rows_aligned(out)};
  const dim3 grid(static_cast<unsigned>(q.size(0) * q.size(1)),
                  static_cast<unsigned>((p.L + kBM - 1) / kBM));
  constexpr size_t smem = fwd_smem_bytes<D>();
  if constexpr (kTf32x3<D>) {
    set_max_dynamic_smem(attention_fwd_tf32x3_kernel, smem, "flash_attention_forward (float32)");
    attention_fwd_tf32x3_kernel<<<grid, kThreads, smem, stream(q.device().index)>>>(p);
  } else {
    set_max_dynamic_smem(attention_fwd_fp32_kernel<D>, smem, "flash_attention_forward (float32)");
    attention_fwd_fp32_kernel<D><<<grid, kThreads, smem, stream(q.device().index)>>>(p);
  }
  check_launch("flash_attention_forward (float32)");
}

template <int D>
void backward_impl(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                   const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                   const Tensor& lse, bool causal, double scale, const Tensor& mask) {
  const auto [dev, B, H, L, E, S, rows, dvec] = bwd_frame(q, k);
  const OutOperand dqp = out_operand(dq);
  if (rows > 0) {
    float* dv_ptr = static_cast<float*>(dvec.data_ptr());
    if (rows_aligned(dout) && rows_aligned(out) && rows_aligned(dq)) {
      const int64_t threads = rows * (D / 4);
      attention_bwd_prep_fp32_vec_kernel<D>
          <<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream(dev)>>>(
              operand(dout), operand(out), dv_ptr, dqp, static_cast<int>(H), static_cast<int>(L),
              static_cast<int>(E), rows);
    } else {
      attention_bwd_prep_fp32_kernel<<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0,
                                       stream(dev)>>>(operand(dout), operand(out), dv_ptr, dqp,
                                                      static_cast<int>(H), static_cast<int>(L),
                                                      static_cast<int>(E), rows);
    }
    check_launch("flash_attention_backward (float32, dO . O)");
  }
  if (S == 0) return;
  BwdArgs p{operand(q),
            operand(k),
            operand(v),
            operand(dout),
            static_cast<const float*>(lse.storage().data()) + lse.storage_offset(),
            static_cast<const float*>(dvec.data_ptr()),
            dqp,
            out_operand(dk),
            out_operand(dv),
            mask_rows(mask),
            mask_kind(mask),
            static_cast<int>(H),
            static_cast<int>(k.size(1)),
            static_cast<int>(L),
            static_cast<int>(S),
            static_cast<int>(E),
            static_cast<float>(scale),
            static_cast<float>(scale * 1.4426950408889634),
            causal,
            rows_aligned(q) && rows_aligned(k) && rows_aligned(v) && rows_aligned(dout),
            rows_aligned(dq) && rows_aligned(dk) && rows_aligned(dv)};
  // One block per key tile of each key/value head (grouped-query: it serves H / Hk query heads).
  const dim3 grid(static_cast<unsigned>(B * k.size(1)), static_cast<unsigned>((S + kBN - 1) / kBN));
  constexpr size_t smem = bwd_smem_bytes<D>();
  if constexpr (kTf32x3<D>) {
    set_max_dynamic_smem(attention_bwd_tf32x3_kernel, smem, "flash_attention_backward (float32)");
    attention_bwd_tf32x3_kernel<<<grid, kThreads, smem, stream(dev)>>>(p);
  } else {
    set_max_dynamic_smem(attention_bwd_fp32_kernel<D, kBwdQM>, smem,
                         "flash_attention_backward (float32)");
    attention_bwd_fp32_kernel<D, kBwdQM><<<grid, kThreads, smem, stream(dev)>>>(p);
  }
  check_launch("flash_attention_backward (float32)");
}

}  // namespace

bool flash_attention_fp32_fits(int device, int64_t E) {
  size_t need = 0;
  with_dim(E, [&]<int D>() { need = std::max(fwd_smem_bytes<D>(), bwd_smem_bytes<D>()); });
  return need <= max_block_smem_optin(device);
}

void flash_attention_forward_fp32(const Tensor& out, const Tensor& lse, const Tensor& q,
                                  const Tensor& k, const Tensor& v, bool causal, double scale,
                                  const Tensor& mask) {
  check_inputs("flash_attention_forward", q, k, v);
  if (out.numel() == 0) return;
  NvtxRange range("flash_attention_forward");
  DeviceGuard g(q.device().index);
  with_dim(q.size(3), [&]<int D>() { forward_impl<D>(out, lse, q, k, v, causal, scale, mask); });
}

void flash_attention_backward_fp32(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                   const Tensor& dout, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& out, const Tensor& lse,
                                   bool causal, double scale, const Tensor& mask) {
  check_inputs("flash_attention_backward", q, k, v);
  if (dq.numel() == 0 && dk.numel() == 0) return;
  NvtxRange range("flash_attention_backward");
  DeviceGuard g(q.device().index);
  with_dim(q.size(3), [&]<int D>() {
    backward_impl<D>(dq, dk, dv, dout, q, k, v, out, lse, causal, scale, mask);
  });
}

}  // namespace tally::cuda
