// Fused attention on CUDA after FlashAttention-2, bfloat16/float16 in, float32 accumulation.
// Namespace fa2 (the default): raw mma.sync m16n8k16 tensor-core instructions fed by ldmatrix
// from padded (bank-conflict-free) shared memory, cp.async double-buffered tiles, softmax on
// the accumulator registers and P / dS reused as MMA operands straight from registers.
// Forward: 8 warps x 16 query rows a block, 64-key tiles; saves O and the log-sum-exp.
// Backward: D = rowsum(dO * O); one block of 4 warps per 64 keys walks the query tiles,
// recomputes P from the lse, accumulates dK, dV in registers and dQ with float atomics into a
// float32 buffer, converted at the end. No L x S matrix exists anywhere.
// The previous kernels (WMMA, scores through shared memory; outside namespace fa2) stay
// available with TALLY_FLASH_LEGACY=1 for A/B runs and as a fallback.
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "tensor/cuda/attention.h"
#include "tensor/cuda/attention_fp32.h"
#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/runtime.h"

namespace tally::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTile = 64;  // query rows and key columns per tile
constexpr int kWarps = 4;  // each warp owns 16 rows of its block's tile
constexpr int kThreadsA = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// [B, H, T, E] operand: base pointer (offset applied) and element strides of b, h, t.
template <typename T>
struct Operand {
  const T* p;
  int64_t sb, sh, st;
  __device__ __forceinline__ const T* rows(int bh, int H) const {
    return p + static_cast<int64_t>(bh / H) * sb + static_cast<int64_t>(bh % H) * sh;
  }
};

template <typename T>
Operand<T> operand(const Tensor& t) {
  return {static_cast<const T*>(t.storage().data()) + t.storage_offset(), t.strides()[0],
          t.strides()[1], t.strides()[2]};
}

// Shared-memory leading dimensions (elements): 16-bit tiles padded by 8 (16 bytes) against
// bank conflicts, float tiles by 4; every fragment pointer stays 32-byte aligned.
template <int D>
struct Layout {
  static constexpr int ldT = D + 8;                        // 16-bit [64][D] tiles
  static constexpr int ldP = kTile + 8;                    // 16-bit [rows][64] tiles
  static constexpr int ldS = (D > kTile ? D : kTile) + 4;  // float scratch rows
  static constexpr int ldF = kTile + 4;                    // float [16][64] scratch
  static constexpr int ldQ = D + 4;                        // float [64][D] scratch
};

// rows [r0, r0 + 64) x cols [0, D) of a [T, E] matrix (row stride st) into shared memory
// (leading dim ld), zero beyond T rows and E columns. 16-byte vector loads.
template <typename T, int D>
__device__ __forceinline__ void load_tile(T* dst, int ld, const T* src, int64_t st, int r0, int T_,
                                          int E) {
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < kTile * kChunks; c += blockDim.x) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < T_ && col < E)
      v = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r0 + r) * st + col);
    *reinterpret_cast<uint4*>(dst + r * ld + col) = v;
  }
}

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragAc = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <typename T>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBc = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

template <typename T>
struct FwdParams {
  Operand<T> q, k, v;
  T* o;        // [B, H, L, E] contiguous
  float* lse;  // [B, H, L]
  int H, L, S, E;
  float scale_log2;
  bool causal;
};

template <typename T, int D>
constexpr size_t fwd_smem() {
  using Ly = Layout<D>;
  return sizeof(T) * 3 * kTile * Ly::ldT + sizeof(float) * kWarps * 16 * Ly::ldS +
         sizeof(T) * kWarps * 16 * Ly::ldP;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreadsA) flash_fwd_kernel(FwdParams<T> p) {
  using Ly = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kTile * Ly::ldT;
  T* sV = sK + kTile * Ly::ldT;
  float* sS = reinterpret_cast<float*>(sV + kTile * Ly::ldT);
  T* sP = reinterpret_cast<T*>(sS + kWarps * 16 * Ly::ldS);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* sSw = sS + warp * 16 * Ly::ldS;
  T* sPw = sP + warp * 16 * Ly::ldP;
  // Causal: the heaviest query tiles (the last ones) start first.
  const int qt = p.causal ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
  const int bh = blockIdx.x;
  const int q0 = qt * kTile;
  const T* qrows = p.q.rows(bh, p.H);
  const T* krows = p.k.rows(bh, p.H);
  const T* vrows = p.v.rows(bh, p.H);

  load_tile<T, D>(sQ, Ly::ldT, qrows, p.q.st, q0, p.L, p.E);
  __syncthreads();
  FragA<T> qf[D / 16];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wmma::load_matrix_sync(qf[kk], sQ + warp * 16 * Ly::ldT + kk * 16, Ly::ldT);

  // Lane owns row r of the warp's 16 and half of the columns.
  const int r = lane / 2, half = lane % 2;
  const int qrow = q0 + warp * 16 + r;
  float m = -INFINITY, l = 0.f;
  float o[D / 2];
#pragma unroll
  for (int d = 0; d < D / 2; ++d) o[d] = 0.f;

  int ntiles = (p.S + kTile - 1) / kTile;
  if (p.causal) ntiles = min(ntiles, (q0 + kTile - 1) / kTile + 1);
  for (int kt = 0; kt < ntiles; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // everyone is done with the previous K, V
    load_tile<T, D>(sK, Ly::ldT, krows, p.k.st, k0, p.S, p.E);
    load_tile<T, D>(sV, Ly::ldT, vrows, p.v.st, k0, p.S, p.E);
    __syncthreads();
    // S_w = Q_w K^T: [16 x 64]
#pragma unroll
    for (int n = 0; n < kTile / 16; ++n) {
      FragC acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        FragBc<T> kf;
        wmma::load_matrix_sync(kf, sK + n * 16 * Ly::ldT + kk * 16, Ly::ldT);
        wmma::mma_sync(acc, qf[kk], kf, acc);
      }
      wmma::store_matrix_sync(sSw + n * 16, acc, Ly::ldS, wmma::mem_row_major);
    }
    __syncwarp();
    // Online softmax over this lane's 32 columns, combined with the other half-row lane.
    const float* srow = sSw + r * Ly::ldS + half * 32;
    float s[32];
    float tmax = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int col = k0 + half * 32 + c;
      const bool ok = col < p.S && (!p.causal || col <= qrow);
      s[c] = ok ? srow[c] * p.scale_log2 : -INFINITY;
      tmax = fmaxf(tmax, s[c]);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    const float mnew = fmaxf(m, tmax);
    const float mref = mnew == -INFINITY ? 0.f : mnew;
    const float alpha = exp2f(m - mref);
    float tsum = 0.f;
    T* prow = sPw + r * Ly::ldP + half * 32;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const float e = exp2f(s[c] - mref);
      tsum += e;
      prow[c] = store<T>(e);
    }
    tsum += __shfl_xor_sync(0xffffffffu, tsum, 1);
    l = l * alpha + tsum;
    m = mnew;
#pragma unroll
    for (int d = 0; d < D / 2; ++d) o[d] *= alpha;
    __syncwarp();
    // PV_w = P_w V: [16 x D] into the float scratch, then added to this lane's o.
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      FragC acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        FragA<T> pf;
        FragB<T> vf;
        wmma::load_matrix_sync(pf, sPw + kk * 16, Ly::ldP);
        wmma::load_matrix_sync(vf, sV + kk * 16 * Ly::ldT + n * 16, Ly::ldT);
        wmma::mma_sync(acc, pf, vf, acc);
      }
      wmma::store_matrix_sync(sSw + n * 16, acc, Ly::ldS, wmma::mem_row_major);
    }
    __syncwarp();
    const float* pv = sSw + r * Ly::ldS + half * (D / 2);
#pragma unroll
    for (int d = 0; d < D / 2; ++d) o[d] += pv[d];
    __syncwarp();
  }

  if (qrow < p.L) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t row = static_cast<int64_t>(bh) * p.L + qrow;
    T* orow = p.o + row * p.E;
    const int c0 = half * (D / 2);
#pragma unroll
    for (int d = 0; d < D / 2; d += 8) {
      if (c0 + d < p.E) {
        alignas(16) T tmp[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) tmp[e] = store<T>(o[d + e] * inv);
        *reinterpret_cast<uint4*>(orow + c0 + d) = *reinterpret_cast<const uint4*>(tmp);
      }
    }
    if (half == 0) p.lse[row] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
  }
}

// ------------------------------------------------------------------ backward

// Dv[row] = sum_d dO[row, d] * O[row, d] (float), one warp a row.
template <typename T>
__global__ void flash_bwd_dot_kernel(Operand<T> dout, Operand<T> out, float* dvec, int H, int L,
                                     int E, int64_t rows) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int bh = static_cast<int>(row / L), i = static_cast<int>(row % L);
  const T* g = dout.rows(bh, H) + static_cast<int64_t>(i) * dout.st;
  const T* o = out.rows(bh, H) + static_cast<int64_t>(i) * out.st;
  float acc = 0.f;
  for (int d = lane; d < E; d += 32) acc += load(g[d]) * load(o[d]);
  for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (lane == 0) dvec[row] = acc;
}

template <typename T>
__global__ void flash_bwd_convert_kernel(T* dst, const float* src, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = store<T>(src[i]);
}

template <typename T>
struct BwdParams {
  Operand<T> q, k, v, dout;
  const float* lse;   // [B, H, L]
  const float* dvec;  // [B, H, L]
  float* dq_acc;      // [B, H, L, E] float, zeroed
  T* dk;              // [B, H, S, E] contiguous
  T* dv;
  int H, L, S, E;
  float scale, scale_log2;
  bool causal;
};

template <typename T, int D>
constexpr size_t bwd_scratch_bytes() {
  using Ly = Layout<D>;
  const size_t sp = sizeof(float) * kWarps * 2 * 16 * Ly::ldF;  // S^T and dP^T per warp
  const size_t dq = sizeof(float) * kTile * Ly::ldQ;            // dQ tile; dK/dV staging
  return sp > dq ? sp : dq;
}

template <typename T, int D>
constexpr size_t bwd_smem() {
  using Ly = Layout<D>;
  return sizeof(T) * 4 * kTile * Ly::ldT + bwd_scratch_bytes<T, D>() +
         sizeof(T) * 2 * kTile * Ly::ldP + sizeof(float) * 2 * kTile;
}

// Stores a warp's [16 x D] accumulator rows (key rows k0 + 16 warp ...) to global as T.
template <typename T, int D>
__device__ __forceinline__ void store_rows(T* dst, FragC* acc, float* stage, int row0, int S,
                                           int E) {
  using Ly = Layout<D>;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < D / 16; ++n)
    wmma::store_matrix_sync(stage + n * 16, acc[n], Ly::ldQ, wmma::mem_row_major);
  __syncwarp();
  constexpr int kChunks = D / 8;
  for (int c = lane; c < 16 * kChunks; c += 32) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    if (row0 + r < S && col < E) {
      alignas(16) T tmp[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) tmp[e] = store<T>(stage[r * Ly::ldQ + col + e]);
      *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(row0 + r) * E + col) =
          *reinterpret_cast<const uint4*>(tmp);
    }
  }
  __syncwarp();
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreadsA) flash_bwd_kernel(BwdParams<T> p) {
  using Ly = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kTile * Ly::ldT;
  T* sQ = sV + kTile * Ly::ldT;
  T* sdO = sQ + kTile * Ly::ldT;
  float* scratch = reinterpret_cast<float*>(sdO + kTile * Ly::ldT);
  T* sPt =
      reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(scratch) + bwd_scratch_bytes<T, D>());
  T* sdSt = sPt + kTile * Ly::ldP;
  float* sLse = reinterpret_cast<float*>(sdSt + kTile * Ly::ldP);  // lse * log2(e)
  float* sDv = sLse + kTile;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* sSw = scratch + warp * 2 * 16 * Ly::ldF;  // S^T of the warp's 16 keys
  float* sdPw = sSw + 16 * Ly::ldF;                // dP^T
  float* sdQ = scratch;                            // [64][ldQ] after S^T/dP^T are consumed
  const int kt = blockIdx.y, bh = blockIdx.x;
  const int k0 = kt * kTile;
  const T* qrows = p.q.rows(bh, p.H);
  const T* dorows = p.dout.rows(bh, p.H);
  const int64_t row_base = static_cast<int64_t>(bh) * p.L;

  load_tile<T, D>(sK, Ly::ldT, p.k.rows(bh, p.H), p.k.st, k0, p.S, p.E);
  load_tile<T, D>(sV, Ly::ldT, p.v.rows(bh, p.H), p.v.st, k0, p.S, p.E);

  FragC dk[D / 16], dv[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.f);
    wmma::fill_fragment(dv[n], 0.f);
  }
  const int r = lane / 2, half = lane % 2;
  const int key = k0 + warp * 16 + r;
  const int qtiles = (p.L + kTile - 1) / kTile;
  for (int qt = p.causal ? kt : 0; qt < qtiles; ++qt) {
    const int q0 = qt * kTile;
    __syncthreads();  // previous tile's Q, dO, dQ scratch are free
    load_tile<T, D>(sQ, Ly::ldT, qrows, p.q.st, q0, p.L, p.E);
    load_tile<T, D>(sdO, Ly::ldT, dorows, p.dout.st, q0, p.L, p.E);
    for (int i = threadIdx.x; i < kTile; i += blockDim.x) {
      const bool ok = q0 + i < p.L;
      sLse[i] = ok ? p.lse[row_base + q0 + i] * kLog2e : 0.f;
      sDv[i] = ok ? p.dvec[row_base + q0 + i] : 0.f;
    }
    __syncthreads();
    // S^T_w = K_w Q^T and dP^T_w = V_w dO^T: [16 keys x 64 queries]
#pragma unroll
    for (int n = 0; n < kTile / 16; ++n) {
      FragC s, dp;
      wmma::fill_fragment(s, 0.f);
      wmma::fill_fragment(dp, 0.f);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        FragA<T> a;
        FragBc<T> b;
        wmma::load_matrix_sync(a, sK + warp * 16 * Ly::ldT + kk * 16, Ly::ldT);
        wmma::load_matrix_sync(b, sQ + n * 16 * Ly::ldT + kk * 16, Ly::ldT);
        wmma::mma_sync(s, a, b, s);
        wmma::load_matrix_sync(a, sV + warp * 16 * Ly::ldT + kk * 16, Ly::ldT);
        wmma::load_matrix_sync(b, sdO + n * 16 * Ly::ldT + kk * 16, Ly::ldT);
        wmma::mma_sync(dp, a, b, dp);
      }
      wmma::store_matrix_sync(sSw + n * 16, s, Ly::ldF, wmma::mem_row_major);
      wmma::store_matrix_sync(sdPw + n * 16, dp, Ly::ldF, wmma::mem_row_major);
    }
    __syncwarp();
    // P^T = exp(S^T - lse), dS^T = P^T (dP^T - Dv) * scale
    {
      const float* srow = sSw + r * Ly::ldF + half * 32;
      const float* dprow = sdPw + r * Ly::ldF + half * 32;
      T* prow = sPt + (warp * 16 + r) * Ly::ldP + half * 32;
      T* dsrow = sdSt + (warp * 16 + r) * Ly::ldP + half * 32;
#pragma unroll 8
      for (int c = 0; c < 32; ++c) {
        const int qi = half * 32 + c, q = q0 + qi;
        const bool ok = key < p.S && q < p.L && (!p.causal || key <= q);
        const float pr = ok ? exp2f(srow[c] * p.scale_log2 - sLse[qi]) : 0.f;
        prow[c] = store<T>(pr);
        dsrow[c] = store<T>(pr * (dprow[c] - sDv[qi]) * p.scale);
      }
    }
    __syncwarp();
    // dV_w += P^T_w dO, dK_w += dS^T_w Q
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      FragA<T> pa, sa;
      wmma::load_matrix_sync(pa, sPt + warp * 16 * Ly::ldP + kk * 16, Ly::ldP);
      wmma::load_matrix_sync(sa, sdSt + warp * 16 * Ly::ldP + kk * 16, Ly::ldP);
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        FragB<T> b;
        wmma::load_matrix_sync(b, sdO + kk * 16 * Ly::ldT + n * 16, Ly::ldT);
        wmma::mma_sync(dv[n], pa, b, dv[n]);
        wmma::load_matrix_sync(b, sQ + kk * 16 * Ly::ldT + n * 16, Ly::ldT);
        wmma::mma_sync(dk[n], sa, b, dk[n]);
      }
    }
    __syncthreads();  // all of dS^T written; S^T/dP^T scratch free for dQ
    // dQ tile = dS K: warp takes queries [16 warp, 16 warp + 16); dS(q, key) = dS^T[key][q].
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      FragC acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        FragAc<T> a;
        FragB<T> b;
        wmma::load_matrix_sync(a, sdSt + kk * 16 * Ly::ldP + warp * 16, Ly::ldP);
        wmma::load_matrix_sync(b, sK + kk * 16 * Ly::ldT + n * 16, Ly::ldT);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(sdQ + warp * 16 * Ly::ldQ + n * 16, acc, Ly::ldQ,
                              wmma::mem_row_major);
    }
    __syncthreads();
    const int rows = min(kTile, p.L - q0);
    float* dst = p.dq_acc + (row_base + q0) * p.E;
    for (int i = threadIdx.x; i < rows * p.E; i += blockDim.x) {
      const int rr = i / p.E, cc = i % p.E;
      atomicAdd(dst + i, sdQ[rr * Ly::ldQ + cc]);
    }
  }
  __syncthreads();  // the scratch becomes the dK/dV staging area
  float* stage = scratch + warp * 16 * Ly::ldQ;
  const int64_t kbase = static_cast<int64_t>(bh) * p.S * p.E;
  store_rows<T, D>(p.dv + kbase, dv, stage, k0 + warp * 16, p.S, p.E);
  store_rows<T, D>(p.dk + kbase, dk, stage, k0 + warp * 16, p.S, p.E);
}

// ================================================ FlashAttention-2 kernels (mma.sync PTX)
//
// Register layouts of mma.sync.aligned.m16n8k16 (16-bit A/B, float C), PTX ISA "Matrix
// Fragments for mma.m16n8k16". Per lane: g = lane / 4 (group), t = lane % 4 (thread in group).
//   A (16 x 16, row-major, 4 x b32 = 8 elements):
//     a0 = A[g    ][2t, 2t+1]     a1 = A[g + 8][2t, 2t+1]
//     a2 = A[g    ][2t+8, 2t+9]   a3 = A[g + 8][2t+8, 2t+9]
//   B (16 x 8, "col", 2 x b32):    b0 = B[2t, 2t+1][g]       b1 = B[2t+8, 2t+9][g]
//   C (16 x 8, float, 4 regs):     c0, c1 = C[g][2t, 2t+1]   c2, c3 = C[g + 8][2t, 2t+1]
//   In every b32 the lower-indexed element sits in the low 16 bits.
// Consequence used throughout: the C fragments of two neighbouring n8 tiles (columns
// 16kk..16kk+7 and 16kk+8..16kk+15), rounded to 16 bits and packed in pairs, are exactly the
// A fragment of the k16 step kk: a0 = C[2kk](c0,c1), a1 = C[2kk](c2,c3), a2 = C[2kk+1](c0,c1),
// a3 = C[2kk+1](c2,c3). So P (forward) and P^T, dS^T (backward) feed the next MMA straight
// from registers.
//
// ldmatrix.m8n8.x4: lanes 8i..8i+7 give the row addresses of 8 x 8 matrix i (16 bytes a row);
// register i of a lane receives row lane/4, columns 2(lane%4), +1 of matrix i; with .trans it
// receives rows 2(lane%4), +1 of column lane/4 instead. Hence, for a tile stored row-major in
// shared memory (row stride ld):
//   A fragment of rows r0.., cols c0..:  lane address (r0 + (lane&7) + ((lane>>3)&1)*8,
//                                                      c0 + (lane>>4)*8)            [no trans]
//   B fragments of two n8 tiles where B[k][n] = M[n][k] (M = K or Q, [key][d]):
//     lane address (n0 + (lane&7) + (lane>>4)*8, k0 + ((lane>>3)&1)*8)  [no trans]
//     -> regs {b0, b1} of n-tile n0, {b0, b1} of n-tile n0 + 8
//   B fragments of two n8 tiles where B[k][n] = M[k][n] (M = V, dO, Q, K, [row][d]):
//     lane address (k0 + (lane&7) + ((lane>>3)&1)*8, n0 + (lane>>4)*8)  [.trans]
//     -> same register order
//   A fragment where A[m][k] = M[k][m] (dS from dS^T stored [key][query]):
//     lane address (k0 + (lane&7) + (lane>>4)*8, m0 + ((lane>>3)&1)*8)  [.trans]
// Shared-memory rows are padded by 8 elements (16 bytes): the 8 row addresses of one
// ldmatrix matrix then start 4 banks apart and cover all 32 banks (no conflicts), and the
// 16-byte cp.async chunks stay aligned.

namespace fa2 {

constexpr int kPad = 8;
constexpr int kFwdM = 128;  // query rows per forward block: 8 warps x 16
constexpr int kFwdWarps = 8;
constexpr int kFwdThreads = kFwdWarps * 32;
constexpr int kN = 64;      // key (forward) / query (backward) columns per tile
constexpr int kBwdN = 64;   // keys per backward block: 4 warps x 16
constexpr int kBwdWarps = 4;
constexpr int kBwdThreads = kBwdWarps * 32;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; src_bytes 0 writes zeros.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// c += a * b (m16n8k16, float accumulators).
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to T and packed, lo in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Inverse of pack2.
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  }
}

// The A fragment of k16 step kk from C fragments c[2kk], c[2kk+1] (see above).
template <typename T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4],
                                       const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

// ROWS rows from row r0 of a [n, E] matrix (row stride st) into shared memory [ROWS][D + 8]
// with cp.async; rows >= n and columns >= E are zero-filled. NT threads share the work.
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void cp_tile(T* dst, const T* src, int64_t st, int r0, int n, int E) {
  constexpr int kChunks = D / 8;
  constexpr int ld = D + kPad;
  static_assert((ROWS * kChunks) % NT == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int i = 0; i < ROWS * kChunks / NT; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * NT;
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const bool ok = r0 + r < n && col < E;
    const T* s = ok ? src + static_cast<int64_t>(r0 + r) * st + col : src;
    cp_async16(smem_addr(dst + r * ld + col), s, ok);
  }
}

template <typename T, int D>
constexpr size_t fwd_smem() {
  return sizeof(T) * (kFwdM + 4 * kN) * (D + kPad);  // Q, K[2], V[2]
}

// Forward: one block of 8 warps per 128 query rows; warp w owns rows 16w..16w+15 and keeps
// the O accumulator and the softmax state (row max m, row sum l, base 2,
// scores pre-multiplied by scale * log2 e) in registers. K/V tiles of 64 keys are
// double-buffered with cp.async. Causal: tiles past the diagonal are never loaded, tiles
// past a warp's last row are skipped by that warp, and only tiles crossing a warp's
// diagonal (or the end of S) are masked.
template <typename T, int D>
__global__ void __launch_bounds__(kFwdThreads, D <= 64 ? 2 : 1) fwd_kernel(FwdParams<T> p) {
  constexpr int ld = D + kPad;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kFwdM * ld;  // [2][kN][ld]
  T* sV = sK + 2 * kN * ld;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int qt = p.causal ? gridDim.y - 1 - blockIdx.y : blockIdx.y;  // heaviest first
  const int bh = blockIdx.x;
  const int q0 = qt * kFwdM;
  const int wr0 = q0 + warp * 16;  // the warp's first query row
  const T* qrows = p.q.rows(bh, p.H);
  const T* krows = p.k.rows(bh, p.H);
  const T* vrows = p.v.rows(bh, p.H);

  int ntiles = (p.S + kN - 1) / kN;
  if (p.causal) ntiles = min(ntiles, (min(q0 + kFwdM, p.L) - 1) / kN + 1);

  cp_tile<T, D, kFwdM, kFwdThreads>(sQ, qrows, p.q.st, q0, p.L, p.E);
  if (ntiles > 0) {
    cp_tile<T, D, kN, kFwdThreads>(sK, krows, p.k.st, 0, p.S, p.E);
    cp_tile<T, D, kN, kFwdThreads>(sV, vrows, p.v.st, 0, p.S, p.E);
  }
  cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // rows g, g + 8 (scaled, base 2)
  float l[2] = {0.f, 0.f};              // this lane's partial row sums
  const bool warp_live = wr0 < p.L;

  for (int j = 0; j < ntiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < ntiles) {
      cp_tile<T, D, kN, kFwdThreads>(sK + (buf ^ 1) * kN * ld, krows, p.k.st, (j + 1) * kN, p.S,
                                     p.E);
      cp_tile<T, D, kN, kFwdThreads>(sV + (buf ^ 1) * kN * ld, vrows, p.v.st, (j + 1) * kN, p.S,
                                     p.E);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int k0 = j * kN;
    if (warp_live && !(p.causal && k0 > wr0 + 15)) {
      const T* kb = sK + buf * kN * ld;
      const T* vb = sV + buf * kN * ld;
      // S = Q K^T: [16 x 64] as 8 n8 tiles.
      float s[kN / 8][4];
#pragma unroll
      for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];  // Q fragments re-read from shared memory: fewer live registers
        ldsm_x4(a, smem_addr(sQ + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld +
                             kk * 16 + (lane >> 4) * 8));
#pragma unroll
        for (int np = 0; np < kN / 16; ++np) {
          uint32_t b[4];
          ldsm_x4(b, smem_addr(kb + (np * 16 + (lane & 7) + (lane >> 4) * 8) * ld + kk * 16 +
                               ((lane >> 3) & 1) * 8));
          mma<T>(s[2 * np], a, b[0], b[1]);
          mma<T>(s[2 * np + 1], a, b[2], b[3]);
        }
      }
      const bool masked = k0 + kN > p.S || (p.causal && k0 + kN - 1 > wr0);
#pragma unroll
      for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[n][e] * p.scale_log2;
          if (masked) {
            const int col = k0 + n * 8 + 2 * t + (e & 1);
            const int row = wr0 + g + (e >> 1) * 8;
            if (col >= p.S || (p.causal && col > row)) v = -INFINITY;
          }
          s[n][e] = v;
        }
      }
      // Online softmax, rows g (r = 0) and g + 8 (r = 1); a row lives on the 4 lanes of a group.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = m[r];
#pragma unroll
        for (int n = 0; n < kN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mref = mx == -INFINITY ? 0.f : mx;
        const float alpha = exp2f(m[r] - mref);
        m[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kN / 8; ++n) {
          s[n][2 * r] = exp2f(s[n][2 * r] - mref);
          s[n][2 * r + 1] = exp2f(s[n][2 * r + 1] - mref);
          sum += s[n][2 * r] + s[n][2 * r + 1];
        }
        l[r] = l[r] * alpha + sum;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          o[n][2 * r] *= alpha;
          o[n][2 * r + 1] *= alpha;
        }
      }
      // O += P V, P straight from the score registers.
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        uint32_t a[4];
        c_to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          ldsm_x4_trans(b, smem_addr(vb + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld +
                                     dp * 16 + (lane >> 4) * 8));
          mma<T>(o[2 * dp], a, b[0], b[1]);
          mma<T>(o[2 * dp + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // buffer buf is refilled by the next iteration's prefetch
  }
  cp_async_wait<0>();  // (ntiles == 0: the Q copies of all threads are still in flight)
  __syncthreads();

  // Epilogue: full row sums, O / l staged through the warp's own Q rows, 16-byte stores.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  if (!warp_live) return;
  const float inv0 = l[0] > 0.f ? 1.f / l[0] : 0.f;
  const float inv1 = l[1] > 0.f ? 1.f / l[1] : 0.f;
  T* sO = sQ + warp * 16 * ld;
  __syncwarp();
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    *reinterpret_cast<uint32_t*>(sO + g * ld + n * 8 + 2 * t) =
        pack2<T>(o[n][0] * inv0, o[n][1] * inv0);
    *reinterpret_cast<uint32_t*>(sO + (g + 8) * ld + n * 8 + 2 * t) =
        pack2<T>(o[n][2] * inv1, o[n][3] * inv1);
  }
  __syncwarp();
  constexpr int kChunks = D / 8;
  const int64_t row_base = static_cast<int64_t>(bh) * p.L;
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int c = lane + i * 32;
    const int r = c / kChunks, col = (c % kChunks) * 8;
    if (wr0 + r < p.L && col < p.E)
      *reinterpret_cast<uint4*>(p.o + (row_base + wr0 + r) * p.E + col) =
          *reinterpret_cast<const uint4*>(sO + r * ld + col);
  }
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wr0 + g + r * 8;
      if (row < p.L)
        p.lse[row_base + row] = l[r] > 0.f ? (m[r] + log2f(l[r])) * kLn2 : -INFINITY;
    }
  }
}

template <typename T, int D>
constexpr size_t bwd_smem() {
  return sizeof(T) * (6 * kN * (D + kPad) + kBwdN * (kN + kPad)) +  // K, V, Q[2], dO[2], dS^T
         sizeof(float) * 4 * kN;                                     // lse[2], D[2]
}

// Backward: one block of 4 warps per 64 keys; warp w owns keys 16w..16w+15 and keeps dK, dV
// of them in float registers. It walks the query tiles (64 rows, Q and dO double-buffered
// with cp.async; causal: from the diagonal tile on), recomputes S^T = K Q^T and
// P^T = exp2(S^T * scale log2 e - lse log2 e), dP^T = V dO^T, dS^T = P^T (dP^T - D) scale,
// dV += P^T dO and dK += dS^T Q with P^T, dS^T as register A operands. dQ needs all keys of
// the block: dS^T goes to shared memory once and each warp computes dQ of 16 query rows,
// dQ = dS K, added with float atomics to a float32 buffer (converted by a final kernel);
// that keeps one pass over the keys and no second kernel re-reading K, V, Q, dO.
// Head dim 64: capped at 168 registers for 3 blocks (12 warps) an SM; ptxas (nvcc 13, sm_90)
// then reports 0 (float16) / 8 (bfloat16) bytes of spill, against 244 registers and 2 blocks
// uncapped. Head dim 128 (255 registers, 112 KB of shared memory: 2 blocks an SM) spills
// 16-32 bytes.
template <typename T, int D>
__global__ void __launch_bounds__(kBwdThreads, D <= 64 ? 3 : 1) bwd_kernel(BwdParams<T> p) {
  constexpr int ld = D + kPad;
  constexpr int ldS = kN + kPad;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // [kBwdN][ld]
  T* sV = sK + kBwdN * ld;
  T* sQ = sV + kBwdN * ld;     // [2][kN][ld]
  T* sdO = sQ + 2 * kN * ld;   // [2][kN][ld]
  T* sdS = sdO + 2 * kN * ld;  // [kBwdN][ldS]: dS^T, keys x queries
  float* sLse = reinterpret_cast<float*>(sdS + kBwdN * ldS);  // [2][kN], lse * log2 e
  float* sDv = sLse + 2 * kN;                                  // [2][kN]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int kt = blockIdx.y, bh = blockIdx.x;  // causal: low key tiles (most work) first
  const int k0 = kt * kBwdN;
  const int wk0 = k0 + warp * 16;  // the warp's first key
  const T* qrows = p.q.rows(bh, p.H);
  const T* dorows = p.dout.rows(bh, p.H);
  const int64_t row_base = static_cast<int64_t>(bh) * p.L;
  const int qtiles = (p.L + kN - 1) / kN;
  const int qt0 = p.causal ? k0 / kN : 0;

  auto load_rows = [&](int qt, int buf) {
    cp_tile<T, D, kN, kBwdThreads>(sQ + buf * kN * ld, qrows, p.q.st, qt * kN, p.L, p.E);
    cp_tile<T, D, kN, kBwdThreads>(sdO + buf * kN * ld, dorows, p.dout.st, qt * kN, p.L, p.E);
    for (int i = threadIdx.x; i < kN; i += kBwdThreads) {
      const int q = qt * kN + i;
      const bool ok = q < p.L;
      sLse[buf * kN + i] = ok ? p.lse[row_base + q] * kLog2e : 0.f;
      sDv[buf * kN + i] = ok ? p.dvec[row_base + q] : 0.f;
    }
  };
  cp_tile<T, D, kBwdN, kBwdThreads>(sK, p.k.rows(bh, p.H), p.k.st, k0, p.S, p.E);
  cp_tile<T, D, kBwdN, kBwdThreads>(sV, p.v.rows(bh, p.H), p.v.st, k0, p.S, p.E);
  if (qt0 < qtiles) load_rows(qt0, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dk[n][e] = 0.f;
      dv[n][e] = 0.f;
    }

  for (int qt = qt0; qt < qtiles; ++qt) {
    const int buf = (qt - qt0) & 1;
    if (qt + 1 < qtiles) {
      load_rows(qt + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int q0 = qt * kN;
    const T* qb = sQ + buf * kN * ld;
    const T* dob = sdO + buf * kN * ld;
    const float* lse2 = sLse + buf * kN;
    const float* dvec = sDv + buf * kN;

    // S^T = K_w Q^T: [16 keys x 64 queries].
    float s[kN / 8][4];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll 1  // bounds the hoisted ldmatrix registers
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      ldsm_x4(a, smem_addr(sK + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + kk * 16 +
                           (lane >> 4) * 8));
#pragma unroll
      for (int np = 0; np < kN / 16; ++np) {
        uint32_t b[4];
        ldsm_x4(b, smem_addr(qb + (np * 16 + (lane & 7) + (lane >> 4) * 8) * ld + kk * 16 +
                             ((lane >> 3) & 1) * 8));
        mma<T>(s[2 * np], a, b[0], b[1]);
        mma<T>(s[2 * np + 1], a, b[2], b[3]);
      }
    }
    // P^T, masked on the diagonal tile and at the ends of L and S.
    const bool masked = q0 + kN > p.L || k0 + kBwdN > p.S || (p.causal && k0 + kBwdN - 1 > q0);
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = n * 8 + 2 * t + (e & 1);
        float pr = exp2f(s[n][e] * p.scale_log2 - lse2[qc]);
        if (masked) {
          const int key = wk0 + g + (e >> 1) * 8, q = q0 + qc;
          if (key >= p.S || q >= p.L || (p.causal && key > q)) pr = 0.f;
        }
        s[n][e] = pr;
      }
    }
    // dV += P^T dO. P^T stays only in its packed 16-bit form (the A operand), which dS
    // reads back: the float scores die here (fewer live registers; dS is rounded to 16
    // bits for its MMAs anyway).
    uint32_t pa[kN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      c_to_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldsm_x4_trans(b, smem_addr(dob + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld +
                                   dp * 16 + (lane >> 4) * 8));
        mma<T>(dv[2 * dp], pa[kk], b[0], b[1]);
        mma<T>(dv[2 * dp + 1], pa[kk], b[2], b[3]);
      }
    }
    // dP^T = V_w dO^T, then dS^T = P^T (dP^T - D) * scale in place.
    float ds[kN / 8][4];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[n][e] = 0.f;
#pragma unroll 1  // bounds the hoisted ldmatrix registers
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      ldsm_x4(a, smem_addr(sV + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + kk * 16 +
                           (lane >> 4) * 8));
#pragma unroll
      for (int np = 0; np < kN / 16; ++np) {
        uint32_t b[4];
        ldsm_x4(b, smem_addr(dob + (np * 16 + (lane & 7) + (lane >> 4) * 8) * ld + kk * 16 +
                             ((lane >> 3) & 1) * 8));
        mma<T>(ds[2 * np], a, b[0], b[1]);
        mma<T>(ds[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) {
      // C tile n holds (c0, c1) in pa[n / 2][n % 2 * 2] and (c2, c3) in the next register.
      const float2 p01 = unpack2<T>(pa[n / 2][(n % 2) * 2]);
      const float2 p23 = unpack2<T>(pa[n / 2][(n % 2) * 2 + 1]);
      const float d0 = dvec[n * 8 + 2 * t], d1 = dvec[n * 8 + 2 * t + 1];
      ds[n][0] = p01.x * (ds[n][0] - d0) * p.scale;
      ds[n][1] = p01.y * (ds[n][1] - d1) * p.scale;
      ds[n][2] = p23.x * (ds[n][2] - d0) * p.scale;
      ds[n][3] = p23.y * (ds[n][3] - d1) * p.scale;
    }
    // dK += dS^T Q; dS^T also to shared memory for dQ.
    T* sdSw = sdS + warp * 16 * ldS;
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[4];
      c_to_a<T>(a, ds[2 * kk], ds[2 * kk + 1]);
      *reinterpret_cast<uint32_t*>(sdSw + g * ldS + kk * 16 + 2 * t) = a[0];
      *reinterpret_cast<uint32_t*>(sdSw + (g + 8) * ldS + kk * 16 + 2 * t) = a[1];
      *reinterpret_cast<uint32_t*>(sdSw + g * ldS + kk * 16 + 8 + 2 * t) = a[2];
      *reinterpret_cast<uint32_t*>(sdSw + (g + 8) * ldS + kk * 16 + 8 + 2 * t) = a[3];
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldsm_x4_trans(b, smem_addr(qb + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld +
                                   dp * 16 + (lane >> 4) * 8));
        mma<T>(dk[2 * dp], a, b[0], b[1]);
        mma<T>(dk[2 * dp + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // dS^T complete; Q, dO of this tile no longer read
    // dQ rows q0 + 16w .. + 15 = dS K: A from dS^T (transposed), B = K [key][d] (.trans).
    // Head dim 128 goes in two column halves so that dK, dV and dQ fit the registers.
    const int wq = q0 + warp * 16;
    if (wq < p.L) {
      constexpr int kParts = D > 64 ? 2 : 1;
      constexpr int kCols = D / kParts;  // columns per part
      float* dst = p.dq_acc + (row_base + wq) * p.E;
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        const int c0 = part * kCols;
        float dq[kCols / 8][4];
#pragma unroll
        for (int n = 0; n < kCols / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) dq[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kBwdN / 16; ++kk) {
          uint32_t a[4];
          ldsm_x4_trans(a, smem_addr(sdS + (kk * 16 + (lane & 7) + (lane >> 4) * 8) * ldS +
                                     warp * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
          for (int dp = 0; dp < kCols / 16; ++dp) {
            uint32_t b[4];
            ldsm_x4_trans(b, smem_addr(sK + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld +
                                       c0 + dp * 16 + (lane >> 4) * 8));
            mma<T>(dq[2 * dp], a, b[0], b[1]);
            mma<T>(dq[2 * dp + 1], a, b[2], b[3]);
          }
        }
#pragma unroll
        for (int n = 0; n < kCols / 8; ++n) {
          const int col = c0 + n * 8 + 2 * t;
          if (c0 + n * 8 < p.E) {
            if (wq + g < p.L) {
              atomicAdd(dst + static_cast<int64_t>(g) * p.E + col, dq[n][0]);
              atomicAdd(dst + static_cast<int64_t>(g) * p.E + col + 1, dq[n][1]);
            }
            if (wq + g + 8 < p.L) {
              atomicAdd(dst + static_cast<int64_t>(g + 8) * p.E + col, dq[n][2]);
              atomicAdd(dst + static_cast<int64_t>(g + 8) * p.E + col + 1, dq[n][3]);
            }
          }
        }
      }
    }
    // The next iteration's __syncthreads (after its prefetch wait) orders these reads of
    // sdS before its writes; its prefetch targets the buffers read before the barrier above.
  }
  cp_async_wait<0>();  // (no query tile: the K, V copies are still in flight)

  // dK, dV of the warp's keys, T, straight from the accumulators (4-byte stores).
  const int64_t kbase = static_cast<int64_t>(bh) * p.S;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int col = n * 8 + 2 * t;
    if (n * 8 >= p.E) continue;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = wk0 + g + r * 8;
      if (key < p.S) {
        const int64_t off = (kbase + key) * p.E + col;
        *reinterpret_cast<uint32_t*>(p.dk + off) = pack2<T>(dk[n][2 * r], dk[n][2 * r + 1]);
        *reinterpret_cast<uint32_t*>(p.dv + off) = pack2<T>(dv[n][2 * r], dv[n][2 * r + 1]);
      }
    }
  }
}

// D[row] = sum_d dO[row, d] * O[row, d] (float): 16 lanes a row, one 16-byte chunk each.
template <typename T>
__global__ void dot_kernel(Operand<T> dout, Operand<T> out, float* dvec, int H, int L, int E,
                           int64_t rows) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 16;
  const int c = static_cast<int>(threadIdx.x % 16) * 8;
  float acc = 0.f;
  if (row < rows && c < E) {
    const int bh = static_cast<int>(row / L), i = static_cast<int>(row % L);
    const uint4 gv = *reinterpret_cast<const uint4*>(dout.rows(bh, H) +
                                                     static_cast<int64_t>(i) * dout.st + c);
    const uint4 ov = *reinterpret_cast<const uint4*>(out.rows(bh, H) +
                                                     static_cast<int64_t>(i) * out.st + c);
    const uint32_t gw[4] = {gv.x, gv.y, gv.z, gv.w}, ow[4] = {ov.x, ov.y, ov.z, ov.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 a = unpack2<T>(gw[w]), b = unpack2<T>(ow[w]);
      acc += a.x * b.x + a.y * b.y;
    }
  }
#pragma unroll
  for (int s = 8; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (row < rows && c == 0) dvec[row] = acc;
}

}  // namespace fa2

// TALLY_FLASH_LEGACY=1 selects the previous WMMA kernels (for A/B runs and as a fallback);
// read once.
bool use_legacy_kernels() {
  static const bool legacy = [] {
    const char* e = std::getenv("TALLY_FLASH_LEGACY");
    return e != nullptr && std::string(e) == "1";
  }();
  return legacy;
}

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes, const char* what) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes)),
        what);
}

template <typename T, int D>
void forward_impl(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                  const Tensor& v, bool causal, double scale) {
  FwdParams<T> p{operand<T>(q),
                 operand<T>(k),
                 operand<T>(v),
                 static_cast<T*>(out.storage().data()),
                 static_cast<float*>(lse.storage().data()),
                 static_cast<int>(q.size(1)),
                 static_cast<int>(q.size(2)),
                 static_cast<int>(k.size(2)),
                 static_cast<int>(q.size(3)),
                 static_cast<float>(scale) * kLog2e,
                 causal};
  if (use_legacy_kernels()) {
    constexpr size_t smem = fwd_smem<T, D>();
    set_smem(flash_fwd_kernel<T, D>, smem, "flash_attention_forward");
    const dim3 grid(static_cast<unsigned>(q.size(0) * q.size(1)),
                    static_cast<unsigned>((p.L + kTile - 1) / kTile));
    flash_fwd_kernel<T, D><<<grid, kThreadsA, smem, stream(q.device().index)>>>(p);
    check_launch("flash_attention_forward (legacy)");
    return;
  }
  constexpr size_t smem = fa2::fwd_smem<T, D>();
  set_smem(fa2::fwd_kernel<T, D>, smem, "flash_attention_forward");
  const dim3 grid(static_cast<unsigned>(q.size(0) * q.size(1)),
                  static_cast<unsigned>((p.L + fa2::kFwdM - 1) / fa2::kFwdM));
  fa2::fwd_kernel<T, D><<<grid, fa2::kFwdThreads, smem, stream(q.device().index)>>>(p);
  check_launch("flash_attention_forward");
}

template <typename T, int D>
void backward_impl(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                   const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                   const Tensor& lse, bool causal, double scale) {
  const int dev = q.device().index;
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), S = k.size(2);
  const int64_t rows = B * H * L;
  Tensor dvec = ops::empty({B, H, L}, DType::float32, q.device());
  Tensor dq_acc = ops::empty({B, H, L, E}, DType::float32, q.device());
  check(cudaMemsetAsync(dq_acc.data_ptr(), 0, dq_acc.nbytes(), stream(dev)),
        "flash_attention_backward");
  if (rows > 0 && !use_legacy_kernels()) {
    fa2::dot_kernel<T><<<static_cast<unsigned>((rows * 16 + 255) / 256), 256, 0, stream(dev)>>>(
        operand<T>(dout), operand<T>(out), static_cast<float*>(dvec.data_ptr()),
        static_cast<int>(H), static_cast<int>(L), static_cast<int>(E), rows);
    check_launch("flash_attention_backward (dO . O)");
  } else if (rows > 0) {
    flash_bwd_dot_kernel<T>
        <<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, stream(dev)>>>(
            operand<T>(dout), operand<T>(out), static_cast<float*>(dvec.data_ptr()),
            static_cast<int>(H), static_cast<int>(L), static_cast<int>(E), rows);
    check_launch("flash_attention_backward (dO . O)");
  }
  BwdParams<T> p{operand<T>(q),
                 operand<T>(k),
                 operand<T>(v),
                 operand<T>(dout),
                 static_cast<const float*>(lse.data_ptr()),
                 static_cast<const float*>(dvec.data_ptr()),
                 static_cast<float*>(dq_acc.data_ptr()),
                 static_cast<T*>(dk.storage().data()),
                 static_cast<T*>(dv.storage().data()),
                 static_cast<int>(H),
                 static_cast<int>(L),
                 static_cast<int>(S),
                 static_cast<int>(E),
                 static_cast<float>(scale),
                 static_cast<float>(scale) * kLog2e,
                 causal};
  if (S > 0 && use_legacy_kernels()) {
    constexpr size_t smem = bwd_smem<T, D>();
    set_smem(flash_bwd_kernel<T, D>, smem, "flash_attention_backward");
    const dim3 grid(static_cast<unsigned>(B * H), static_cast<unsigned>((S + kTile - 1) / kTile));
    flash_bwd_kernel<T, D><<<grid, kThreadsA, smem, stream(dev)>>>(p);
    check_launch("flash_attention_backward (legacy)");
  } else if (S > 0) {
    constexpr size_t smem = fa2::bwd_smem<T, D>();
    set_smem(fa2::bwd_kernel<T, D>, smem, "flash_attention_backward");
    const dim3 grid(static_cast<unsigned>(B * H),
                    static_cast<unsigned>((S + fa2::kBwdN - 1) / fa2::kBwdN));
    fa2::bwd_kernel<T, D><<<grid, fa2::kBwdThreads, smem, stream(dev)>>>(p);
    check_launch("flash_attention_backward");
  }
  const int64_t n = dq_acc.numel();
  if (n > 0) {
    const int64_t blocks = std::min<int64_t>((n + 255) / 256, 132 * 16);
    flash_bwd_convert_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream(dev)>>>(
        static_cast<T*>(dq.storage().data()), static_cast<const float*>(dq_acc.data_ptr()), n);
    check_launch("flash_attention_backward (dQ)");
  }
}

void check_cuda_inputs(const char* op, const Tensor& q, const Tensor& v) {
  const int64_t E = q.size(3);
  if ((q.dtype() != DType::float16 && q.dtype() != DType::bfloat16) || E > 128 || E % 8 != 0 ||
      v.size(3) != E)
    throw std::invalid_argument(
        std::string(op) +
        ": the CUDA kernel takes float16/bfloat16 with head dim E == Ev <= 128, "
        "E % 8 == 0");
  const int64_t tiles = (std::max(q.size(2), v.size(2)) + kTile - 1) / kTile;
  if (tiles > 65535 || q.size(0) * q.size(1) > INT32_MAX)
    throw std::invalid_argument(std::string(op) + ": sequence longer than 65535 * 64 on CUDA");
}

template <typename F>
void with_type_and_dim(const Tensor& q, F&& f) {
  const bool wide = q.size(3) > 64;
  if (q.dtype() == DType::bfloat16) {
    if (wide)
      f.template operator()<__nv_bfloat16, 128>();
    else
      f.template operator()<__nv_bfloat16, 64>();
  } else {
    if (wide)
      f.template operator()<__half, 128>();
    else
      f.template operator()<__half, 64>();
  }
}

}  // namespace

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, bool causal, double scale) {
  if (q.dtype() == DType::float32)
    return flash_attention_forward_fp32(out, lse, q, k, v, causal, scale);
  check_cuda_inputs("flash_attention_forward", q, v);
  if (out.numel() == 0) return;
  NvtxRange range("flash_attention_forward");
  DeviceGuard g(q.device().index);
  with_type_and_dim(
      q, [&]<typename T, int D>() { forward_impl<T, D>(out, lse, q, k, v, causal, scale); });
}

void flash_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, bool causal, double scale) {
  if (q.dtype() == DType::float32)
    return flash_attention_backward_fp32(dq, dk, dv, dout, q, k, v, out, lse, causal, scale);
  check_cuda_inputs("flash_attention_backward", q, v);
  if (dq.numel() == 0 && dk.numel() == 0) return;
  NvtxRange range("flash_attention_backward");
  DeviceGuard g(q.device().index);
  with_type_and_dim(q, [&]<typename T, int D>() {
    backward_impl<T, D>(dq, dk, dv, dout, q, k, v, out, lse, causal, scale);
  });
}

}  // namespace tally::cuda
