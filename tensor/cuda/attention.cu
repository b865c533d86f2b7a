// Fused attention on CUDA after FlashAttention-2. Forward: one block of 4 warps per 64 query
// rows (16 a warp) walks the 64-key tiles, S = Q K^T on tensor cores (WMMA), an online
// softmax in float32 (base-2 exponentials), O += P V, and writes O and the log-sum-exp.
// Backward: D = rowsum(dO * O); one block per 64-key tile walks the query tiles,
// recomputes P = exp(S - lse), dV += P^T dO and dK += dS^T Q in WMMA accumulators,
// dQ += dS K into a float32 buffer with atomics; dQ is converted at the end. No L x S
// matrix exists anywhere: per block only 64 x 64 tiles in shared memory.
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <string>

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
  constexpr size_t smem = fwd_smem<T, D>();
  set_smem(flash_fwd_kernel<T, D>, smem, "flash_attention_forward");
  const dim3 grid(static_cast<unsigned>(q.size(0) * q.size(1)),
                  static_cast<unsigned>((p.L + kTile - 1) / kTile));
  flash_fwd_kernel<T, D><<<grid, kThreadsA, smem, stream(q.device().index)>>>(p);
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
  if (rows > 0) {
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
  constexpr size_t smem = bwd_smem<T, D>();
  set_smem(flash_bwd_kernel<T, D>, smem, "flash_attention_backward");
  if (S > 0) {
    const dim3 grid(static_cast<unsigned>(B * H), static_cast<unsigned>((S + kTile - 1) / kTile));
    flash_bwd_kernel<T, D><<<grid, kThreadsA, smem, stream(dev)>>>(p);
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
