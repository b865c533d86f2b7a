// Fused attention on CUDA after FlashAttention-2, bfloat16/float16 in, float32 accumulation:
// raw mma.sync m16n8k16 tensor-core instructions fed by ldmatrix from padded
// (bank-conflict-free) shared memory, cp.async double-buffered tiles, softmax on the
// accumulator registers and P / dS reused as MMA operands straight from registers.
// Forward: 8 warps x 16 query rows a block, 64-key tiles; saves O and the log-sum-exp.
// Backward: D = rowsum(dO * O); one block of 4 warps per 64 keys walks the query tiles,
// recomputes P from the lse, accumulates dK, dV in registers and dQ with float atomics into a
// float32 buffer, converted at the end. No L x S matrix exists anywhere.
// Inputs and outputs are [B, H, T, E] with any b/h/t strides (last dim dense): GPT's heads are
// read from and written to [B, T, H, E] memory in place (see tensor/attention/ops.cpp).
// Masks (bool or float32 bias, read through their broadcast strides) and grouped-query heads
// (k, v with H / G heads; the backward's key block loops over the G query heads) run here
// where cuDNN's route declines them (it takes both: tensor/attention/cuda_cudnn.cpp).
// The launchers try cuDNN's route first (tensor/attention/cuda_cudnn.cpp) and hand float32 to
// tensor/attention/cuda_fp32.cu; the file ends with the family's CUDA table,
// cuda::attention_kernels (tensor/attention/kernels.h).
#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <type_traits>

#include "tensor/attention/cuda_cudnn.h"
#include "tensor/attention/cuda_fp32.h"
#include "tensor/attention/cuda_rows.cuh"
#include "tensor/attention/kernels.h"
#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/grid.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/op_alloc.h"

namespace tally::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// [B, H, T, E] inputs and outputs (last dim dense), addressed through b, h, t strides.
template <typename T>
using Operand = BhtRows<const T>;
template <typename T>
using OutOperand = BhtRows<T>;

template <typename T>
Operand<T> operand(const Tensor& t) {
  return bht_rows<const T>(t);
}
template <typename T>
OutOperand<T> out_operand(const Tensor& t) {
  return bht_rows<T>(t);
}

// Shared-memory leading dimensions (elements): 16-bit tiles padded by 8 (16 bytes) against
// bank conflicts, float tiles by 4; every fragment pointer stays 32-byte aligned.

template <typename T>
struct FwdParams {
  Operand<T> q, k, v;  // k, v [B, Hk, S, E]: query head h reads key/value head h / (H / Hk)
  OutOperand<T> o;     // [B, H, L, E]
  float* lse;          // [B, H, L] contiguous
  MaskRows mask;       // [B, H, L, S] (kernel template M says which kind)
  int H, Hk, L, S, E;
  float scale_log2;
  bool causal;
};

template <typename T>
struct BwdParams {
  Operand<T> q, k, v, dout;  // k, v [B, Hk, S, E]
  const float* lse;          // [B, H, L]
  const float* dvec;         // [B, H, L]
  float* dq_acc;             // [B, H, L, E] float contiguous, zeroed
  OutOperand<T> dk;          // [B, Hk, S, E]
  OutOperand<T> dv;
  MaskRows mask;  // [B, H, L, S]
  int H, Hk, L, S, E;
  float scale, scale_log2;
  bool causal;
};

// dQ: the float32 accumulator [B, H, L, E] (contiguous) rounded into dst (any b/h/t strides).
template <typename T>
__global__ void dq_convert_kernel(OutOperand<T> dst, const float* src, int H, int L, int E,
                                  int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / E;
    const int e = static_cast<int>(i - row * E);
    const int bh = static_cast<int>(row / L),
              t = static_cast<int>(row - static_cast<int64_t>(bh) * L);
    dst.rows(bh, H)[static_cast<int64_t>(t) * dst.st + e] = store<T>(src[i]);
  }
}

// ================================================ FlashAttention-2 kernels (mma.sync PTX)
// mma.sync and ldmatrix register layouts, shared-memory padding: docs/notes.md §9.

namespace fa2 {

constexpr int kPad = 8;
constexpr int kFwdM = 128;  // query rows per forward block: 8 warps x 16
constexpr int kFwdWarps = 8;
constexpr int kFwdThreads = kFwdWarps * 32;
constexpr int kN = 64;     // key (forward) / query (backward) columns per tile
constexpr int kBwdN = 64;  // keys per backward block: 4 warps x 16
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

// A double-buffered loop's step: issues load_next() (the next tile's cp.async copies into the
// other buffer) when has_next, waits for the current tile's copies, then syncs the block.
template <typename LoadNext>
__device__ __forceinline__ void next_tile_then_wait(bool has_next, LoadNext&& load_next) {
  if (has_next) {
    load_next();
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
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
// acc = A_w B^T, 16 x kN (S = Q_w K^T; the backward's S^T = K_w Q^T, dP^T = V_w dO^T): A_w
// this warp's 16 rows of a, B the kN rows of b, both in shared memory D + kPad apart, through
// ldmatrix fragments over D / 16 k-steps. RolledK keeps the k loop rolled (the backward: it
// bounds the hoisted ldmatrix registers); the forward unrolls it.
template <typename T, int D, bool RolledK>
__device__ __forceinline__ void warp_scores(float (&acc)[kN / 8][4], const T* a, const T* b,
                                            int warp, int lane) {
  constexpr int ld = D + kPad;
  zero_tile(acc);
  const auto step = [&](int kk) {
    uint32_t af[4];
    ldsm_x4(af, smem_addr(a + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + kk * 16 +
                          (lane >> 4) * 8));
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t bf[4];
      ldsm_x4(bf, smem_addr(b + (np * 16 + (lane & 7) + (lane >> 4) * 8) * ld + kk * 16 +
                            ((lane >> 3) & 1) * 8));
      mma<T>(acc[2 * np], af, bf[0], bf[1]);
      mma<T>(acc[2 * np + 1], af, bf[2], bf[3]);
    }
  };
  if constexpr (RolledK) {
#pragma unroll 1
    for (int kk = 0; kk < D / 16; ++kk) step(kk);
  } else {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) step(kk);
  }
}

// acc[Cols / 8][4] += a (a 16 x 16 A fragment) times rows kk * 16 .. kk * 16 + 15 of b, the
// Cols columns from b on, in shared memory D + kPad apart: transposed ldmatrix, Cols / 16
// n-steps.
template <typename T, int D, int Cols>
__device__ __forceinline__ void mma_rows(float (&acc)[Cols / 8][4], const uint32_t (&a)[4],
                                         const T* b, int kk, int lane) {
  constexpr int ld = D + kPad;
#pragma unroll
  for (int dp = 0; dp < Cols / 16; ++dp) {
    uint32_t bf[4];
    ldsm_x4_trans(bf, smem_addr(b + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + dp * 16 +
                                (lane >> 4) * 8));
    mma<T>(acc[2 * dp], a, bf[0], bf[1]);
    mma<T>(acc[2 * dp + 1], a, bf[2], bf[3]);
  }
}

// M: the mask's kind (kNoMask, kBoolMask, kBiasMask; cuda_rows.cuh): a masked kernel masks
// every tile, adding the mask's base-2 bias to the scaled scores before the online softmax; a
// row whose keys are all masked keeps m = -inf and l = 0: out 0, lse -inf.
template <typename T, int D, int M>
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
  const int bkv = kv_slice(bh, p.H, p.Hk);
  const T* krows = p.k.rows(bkv, p.Hk);
  const T* vrows = p.v.rows(bkv, p.Hk);
  // The mask's offsets of this lane's rows g and g + 8 (clamped to L - 1: never read past).
  int64_t mrow[2] = {0, 0};
  if constexpr (M != kNoMask) {
    const int64_t mbase = p.mask.base(bh, p.H);
#pragma unroll
    for (int r = 0; r < 2; ++r)
      mrow[r] = mbase + static_cast<int64_t>(min(wr0 + g + 8 * r, p.L - 1)) * p.mask.sl;
  }

  int ntiles = (p.S + kN - 1) / kN;
  if (p.causal) ntiles = min(ntiles, (min(q0 + kFwdM, p.L) - 1) / kN + 1);

  cp_tile<T, D, kFwdM, kFwdThreads>(sQ, qrows, p.q.st, q0, p.L, p.E);
  if (ntiles > 0) {
    cp_tile<T, D, kN, kFwdThreads>(sK, krows, p.k.st, 0, p.S, p.E);
    cp_tile<T, D, kN, kFwdThreads>(sV, vrows, p.v.st, 0, p.S, p.E);
  }
  cp_async_commit();

  float o[D / 8][4];
  zero_tile(o);
  float m[2] = {-INFINITY, -INFINITY};  // rows g, g + 8 (scaled, base 2)
  float l[2] = {0.f, 0.f};              // this lane's partial row sums
  const bool warp_live = wr0 < p.L;

  for (int j = 0; j < ntiles; ++j) {
    const int buf = j & 1;
    next_tile_then_wait(j + 1 < ntiles, [&] {
      cp_tile<T, D, kN, kFwdThreads>(sK + (buf ^ 1) * kN * ld, krows, p.k.st, (j + 1) * kN, p.S,
                                     p.E);
      cp_tile<T, D, kN, kFwdThreads>(sV + (buf ^ 1) * kN * ld, vrows, p.v.st, (j + 1) * kN, p.S,
                                     p.E);
    });
    const int k0 = j * kN;
    if (warp_live && !(p.causal && k0 > wr0 + 15)) {
      const T* kb = sK + buf * kN * ld;
      const T* vb = sV + buf * kN * ld;
      // S = Q K^T: [16 x 64] as 8 n8 tiles.
      // Q fragments re-read from shared memory each k-step: fewer live registers.
      float s[kN / 8][4];
      warp_scores<T, D, false>(s, sQ, kb, warp, lane);
      const bool masked = M != kNoMask || k0 + kN > p.S || (p.causal && k0 + kN - 1 > wr0);
#pragma unroll
      for (int n = 0; n < kN / 8; ++n) {
        // The mask's terms of columns 2t, 2t + 1 in rows g, g + 8: one load for the pair when
        // aligned, and rows g + 8 reuse rows g's when the mask does not vary along L (key
        // padding).
        float2 bias[2] = {make_float2(0.f, 0.f), make_float2(0.f, 0.f)};
        if constexpr (M != kNoMask) {
          const int col = k0 + n * 8 + 2 * t;
          bias[0] = p.mask.template log2_two<M>(mrow[0], col, p.S, kLog2e);
          bias[1] =
              p.mask.sl == 0 ? bias[0] : p.mask.template log2_two<M>(mrow[1], col, p.S, kLog2e);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[n][e] * p.scale_log2;
          if (masked) {
            const int col = k0 + n * 8 + 2 * t + (e & 1);
            const int row = wr0 + g + (e >> 1) * 8;
            if (col >= p.S || (p.causal && col > row))
              v = -INFINITY;
            else if constexpr (M != kNoMask)
              v += (e & 1) ? bias[e >> 1].y : bias[e >> 1].x;
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
        mma_rows<T, D, D>(o, a, vb, kk, lane);
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
  T* orows = p.o.rows(bh, p.H);
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int c = lane + i * 32;
    const int r = c / kChunks, col = (c % kChunks) * 8;
    if (wr0 + r < p.L && col < p.E)
      *reinterpret_cast<uint4*>(orows + static_cast<int64_t>(wr0 + r) * p.o.st + col) =
          *reinterpret_cast<const uint4*>(sO + r * ld + col);
  }
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wr0 + g + r * 8;
      if (row < p.L) p.lse[row_base + row] = l[r] > 0.f ? (m[r] + log2f(l[r])) * kLn2 : -INFINITY;
    }
  }
}

template <typename T, int D>
constexpr size_t bwd_smem() {
  return sizeof(T) * (6 * kN * (D + kPad) + kBwdN * (kN + kPad)) +  // K, V, Q[2], dO[2], dS^T
         sizeof(float) * 4 * kN;                                    // lse[2], D[2]
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
// Grouped-query heads: the block of a key/value head's key tile walks the query tiles of each
// of the head's G query heads in turn (dK, dV summed in registers: deterministic, no atomics).
// M: the mask's kind, as in the forward; a row without any allowed key (lse -inf) gets P = 0.
template <typename T, int D, int M>
__global__ void __launch_bounds__(kBwdThreads, D <= 64 ? 3 : 1) bwd_kernel(BwdParams<T> p) {
  constexpr int ld = D + kPad;
  constexpr int ldS = kN + kPad;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);  // [kBwdN][ld]
  T* sV = sK + kBwdN * ld;
  T* sQ = sV + kBwdN * ld;                                    // [2][kN][ld]
  T* sdO = sQ + 2 * kN * ld;                                  // [2][kN][ld]
  T* sdS = sdO + 2 * kN * ld;                                 // [kBwdN][ldS]: dS^T, keys x queries
  float* sLse = reinterpret_cast<float*>(sdS + kBwdN * ldS);  // [2][kN], lse * log2 e
  float* sDv = sLse + 2 * kN;                                 // [2][kN]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int kt = blockIdx.y, bkv = blockIdx.x;  // causal: low key tiles (most work) first
  const int G = p.H / p.Hk;
  const int k0 = kt * kBwdN;
  const int wk0 = k0 + warp * 16;  // the warp's first key
  const int qtiles = (p.L + kN - 1) / kN;
  const int qt0 = p.causal ? k0 / kN : 0;
  const int per_head = max(qtiles - qt0, 0);
  // Step i: query slice bh_of(i) (query head (bkv % Hk) * G + i / per_head of batch bkv / Hk),
  // query tile qt0 + i % per_head.
  const int steps = G * per_head;
  const int bh0 = (bkv / p.Hk) * p.H + (bkv % p.Hk) * G;
  auto bh_of = [&](int i) { return bh0 + i / per_head; };
  auto qt_of = [&](int i) { return qt0 + i % per_head; };

  auto load_rows = [&](int i, int buf) {
    const int bh = bh_of(i), qt = qt_of(i);
    const int64_t rb = static_cast<int64_t>(bh) * p.L;
    cp_tile<T, D, kN, kBwdThreads>(sQ + buf * kN * ld, p.q.rows(bh, p.H), p.q.st, qt * kN, p.L,
                                   p.E);
    cp_tile<T, D, kN, kBwdThreads>(sdO + buf * kN * ld, p.dout.rows(bh, p.H), p.dout.st, qt * kN,
                                   p.L, p.E);
    for (int r = threadIdx.x; r < kN; r += kBwdThreads) {
      const int q = qt * kN + r;
      const bool ok = q < p.L;
      const float lv = ok ? p.lse[rb + q] : 0.f;
      // lse -inf (a row without any allowed key): +inf makes every P of the row 0.
      sLse[buf * kN + r] = lv == -INFINITY ? INFINITY : lv * kLog2e;
      sDv[buf * kN + r] = ok ? p.dvec[rb + q] : 0.f;
    }
  };
  cp_tile<T, D, kBwdN, kBwdThreads>(sK, p.k.rows(bkv, p.Hk), p.k.st, k0, p.S, p.E);
  cp_tile<T, D, kBwdN, kBwdThreads>(sV, p.v.rows(bkv, p.Hk), p.v.st, k0, p.S, p.E);
  if (steps > 0) load_rows(0, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
  zero_tile(dk);
  zero_tile(dv);
  // The mask's column offsets of this lane's keys g and g + 8 (clamped to S - 1).
  int64_t mkey[2] = {0, 0};
  if constexpr (M != kNoMask) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
      mkey[r] = static_cast<int64_t>(min(wk0 + g + 8 * r, p.S - 1)) * p.mask.ss;
  }

  for (int step = 0; step < steps; ++step) {
    const int buf = step & 1;
    next_tile_then_wait(step + 1 < steps, [&] { load_rows(step + 1, buf ^ 1); });
    const int bh = bh_of(step);
    const int q0 = qt_of(step) * kN;
    const int64_t row_base = static_cast<int64_t>(bh) * p.L;
    // The mask's offset of (query q0, key 0) of this slice. A mask that does not vary along
    // L (key padding) has one value per key: two loads a lane for the whole tile.
    const int64_t mq0 =
        M != kNoMask ? p.mask.base(bh, p.H) + static_cast<int64_t>(q0) * p.mask.sl : 0;
    float key_bias[2] = {0.f, 0.f};
    if constexpr (M != kNoMask) {
      if (p.mask.sl == 0) {
        key_bias[0] = p.mask.template log2_at<M>(mq0 + mkey[0], kLog2e);
        key_bias[1] = p.mask.template log2_at<M>(mq0 + mkey[1], kLog2e);
      }
    }
    const T* qb = sQ + buf * kN * ld;
    const T* dob = sdO + buf * kN * ld;
    const float* lse2 = sLse + buf * kN;
    const float* dvec = sDv + buf * kN;

    // S^T = K_w Q^T: [16 keys x 64 queries].
    float s[kN / 8][4];
    warp_scores<T, D, true>(s, sK, qb, warp, lane);
    // P^T, masked on the diagonal tile and at the ends of L and S.
    const bool masked =
        M != kNoMask || q0 + kN > p.L || k0 + kBwdN > p.S || (p.causal && k0 + kBwdN - 1 > q0);
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = n * 8 + 2 * t + (e & 1);
        float x = s[n][e] * p.scale_log2 - lse2[qc];
        if (masked) {
          const int key = wk0 + g + (e >> 1) * 8, q = q0 + qc;
          if (key >= p.S || q >= p.L || (p.causal && key > q))
            x = -INFINITY;
          else if constexpr (M != kNoMask)
            x += p.mask.sl == 0
                     ? key_bias[e >> 1]
                     : p.mask.template log2_at<M>(
                           mq0 + static_cast<int64_t>(qc) * p.mask.sl + mkey[e >> 1], kLog2e);
        }
        s[n][e] = exp2f(x);
      }
    }
    // dV += P^T dO. P^T stays only in its packed 16-bit form (the A operand), which dS
    // reads back: the float scores die here (fewer live registers; dS is rounded to 16
    // bits for its MMAs anyway).
    uint32_t pa[kN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      c_to_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
      mma_rows<T, D, D>(dv, pa[kk], dob, kk, lane);
    }
    // dP^T = V_w dO^T, then dS^T = P^T (dP^T - D) * scale in place.
    float ds[kN / 8][4];
    warp_scores<T, D, true>(ds, sV, dob, warp, lane);
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
      mma_rows<T, D, D>(dk, a, qb, kk, lane);
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
        zero_tile(dq);
#pragma unroll
        for (int kk = 0; kk < kBwdN / 16; ++kk) {
          uint32_t a[4];
          ldsm_x4_trans(a, smem_addr(sdS + (kk * 16 + (lane & 7) + (lane >> 4) * 8) * ldS +
                                     warp * 16 + ((lane >> 3) & 1) * 8));
          mma_rows<T, D, kCols>(dq, a, sK + c0, kk, lane);
        }
#pragma unroll
        for (int n = 0; n < kCols / 8; ++n) {
          const int col = c0 + n * 8 + 2 * t;
          if (c0 + n * 8 < p.E) {
            // Two neighbouring columns a lane: one 8-byte vector atomic each (sm_90), half the
            // atomic instructions of scalar adds (col is even and E a multiple of 8).
            if (wq + g < p.L) add2(dst + static_cast<int64_t>(g) * p.E + col, dq[n][0], dq[n][1]);
            if (wq + g + 8 < p.L)
              add2(dst + static_cast<int64_t>(g + 8) * p.E + col, dq[n][2], dq[n][3]);
          }
        }
      }
    }
    // The next iteration's __syncthreads (after its prefetch wait) orders these reads of
    // sdS before its writes; its prefetch targets the buffers read before the barrier above.
  }
  cp_async_wait<0>();  // (no query tile: the K, V copies are still in flight)

  // dK, dV of the warp's keys, T, straight from the accumulators (4-byte stores).
  T* dkrows = p.dk.rows(bkv, p.Hk);
  T* dvrows = p.dv.rows(bkv, p.Hk);
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int col = n * 8 + 2 * t;
    if (n * 8 >= p.E) continue;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = wk0 + g + r * 8;
      if (key < p.S) {
        *reinterpret_cast<uint32_t*>(dkrows + static_cast<int64_t>(key) * p.dk.st + col) =
            pack2<T>(dk[n][2 * r], dk[n][2 * r + 1]);
        *reinterpret_cast<uint32_t*>(dvrows + static_cast<int64_t>(key) * p.dv.st + col) =
            pack2<T>(dv[n][2 * r], dv[n][2 * r + 1]);
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
    const uint4 gv =
        *reinterpret_cast<const uint4*>(dout.rows(bh, H) + static_cast<int64_t>(i) * dout.st + c);
    const uint4 ov =
        *reinterpret_cast<const uint4*>(out.rows(bh, H) + static_cast<int64_t>(i) * out.st + c);
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

template <typename T, int D, int M>
void forward_impl(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                  const Tensor& v, bool causal, double scale, const Tensor& mask) {
  FwdParams<T> p{operand<T>(q),
                 operand<T>(k),
                 operand<T>(v),
                 out_operand<T>(out),
                 static_cast<float*>(lse.storage().data()) + lse.storage_offset(),
                 mask_rows(mask),
                 static_cast<int>(q.size(1)),
                 static_cast<int>(k.size(1)),
                 static_cast<int>(q.size(2)),
                 static_cast<int>(k.size(2)),
                 static_cast<int>(q.size(3)),
                 static_cast<float>(scale) * kLog2e,
                 causal};
  constexpr size_t smem = fa2::fwd_smem<T, D>();
  set_max_dynamic_smem(fa2::fwd_kernel<T, D, M>, smem, "flash_attention_forward");
  const dim3 grid(static_cast<unsigned>(q.size(0) * q.size(1)),
                  static_cast<unsigned>((p.L + fa2::kFwdM - 1) / fa2::kFwdM));
  fa2::fwd_kernel<T, D, M><<<grid, fa2::kFwdThreads, smem, stream(q.device().index)>>>(p);
  check_launch("flash_attention_forward");
}

template <typename T, int D, int M>
void backward_impl(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                   const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                   const Tensor& lse, bool causal, double scale, const Tensor& mask) {
  const auto [dev, B, H, L, E, S, rows, dvec] = bwd_frame(q, k);
  Tensor dq_acc = alloc_scratch(B * H * L * E, DType::float32, q.device());  // [B, H, L, E]
  check(cudaMemsetAsync(dq_acc.data_ptr(), 0, dq_acc.nbytes(), stream(dev)),
        "flash_attention_backward");
  if (rows > 0) {
    fa2::dot_kernel<T><<<static_cast<unsigned>((rows * 16 + 255) / 256), 256, 0, stream(dev)>>>(
        operand<T>(dout), operand<T>(out), static_cast<float*>(dvec.data_ptr()),
        static_cast<int>(H), static_cast<int>(L), static_cast<int>(E), rows);
    check_launch("flash_attention_backward (dO . O)");
  }
  BwdParams<T> p{operand<T>(q),
                 operand<T>(k),
                 operand<T>(v),
                 operand<T>(dout),
                 static_cast<const float*>(lse.storage().data()) + lse.storage_offset(),
                 static_cast<const float*>(dvec.data_ptr()),
                 static_cast<float*>(dq_acc.data_ptr()),
                 out_operand<T>(dk),
                 out_operand<T>(dv),
                 mask_rows(mask),
                 static_cast<int>(H),
                 static_cast<int>(k.size(1)),
                 static_cast<int>(L),
                 static_cast<int>(S),
                 static_cast<int>(E),
                 static_cast<float>(scale),
                 static_cast<float>(scale) * kLog2e,
                 causal};
  if (S > 0) {
    constexpr size_t smem = fa2::bwd_smem<T, D>();
    set_max_dynamic_smem(fa2::bwd_kernel<T, D, M>, smem, "flash_attention_backward");
    // One block per key tile of each key/value head (grouped-query: it serves G query heads).
    const dim3 grid(static_cast<unsigned>(B * k.size(1)),
                    static_cast<unsigned>((S + fa2::kBwdN - 1) / fa2::kBwdN));
    fa2::bwd_kernel<T, D, M><<<grid, fa2::kBwdThreads, smem, stream(dev)>>>(p);
    check_launch("flash_attention_backward");
  }
  const int64_t n = dq_acc.numel();
  if (n > 0) {
    const int64_t blocks = std::min<int64_t>((n + 255) / 256, int64_t{16} * sm_count(dev));
    dq_convert_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream(dev)>>>(
        out_operand<T>(dq), static_cast<const float*>(dq_acc.data_ptr()), static_cast<int>(H),
        static_cast<int>(L), static_cast<int>(E), n);
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
  const int64_t tiles = (std::max(q.size(2), v.size(2)) + fa2::kN - 1) / fa2::kN;
  if (tiles > 65535 || q.size(0) * q.size(1) > INT32_MAX)
    throw std::invalid_argument(std::string(op) + ": sequence longer than 65535 * 64 on CUDA");
}

// f<T, D, M>() for q's dtype, its head dim (64 or 128 instantiations) and the mask's kind.
template <typename T, int D, typename F>
void with_mask_kind(const Tensor& mask, F&& f) {
  switch (mask_kind(mask)) {
    case kBoolMask:
      f.template operator()<T, D, kBoolMask>();
      break;
    case kBiasMask:
      f.template operator()<T, D, kBiasMask>();
      break;
    default:
      f.template operator()<T, D, kNoMask>();
  }
}

template <typename F>
void with_type_and_dim(const Tensor& q, const Tensor& mask, F&& f) {
  const bool wide = q.size(3) > 64;
  if (q.dtype() == DType::bfloat16) {
    if (wide)
      with_mask_kind<__nv_bfloat16, 128>(mask, f);
    else
      with_mask_kind<__nv_bfloat16, 64>(mask, f);
  } else {
    if (wide)
      with_mask_kind<__half, 128>(mask, f);
    else
      with_mask_kind<__half, 64>(mask, f);
  }
}

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, bool causal, double scale, const Tensor& mask) {
  if (q.dtype() == DType::float32)
    return flash_attention_forward_fp32(out, lse, q, k, v, causal, scale, mask);
  check_cuda_inputs("flash_attention_forward", q, v);
  if (out.numel() == 0) return;
  if (cudnn_flash_attention_forward(out, lse, q, k, v, causal, scale, mask)) return;
  NvtxRange range("flash_attention_forward");
  DeviceGuard g(q.device().index);
  with_type_and_dim(q, mask, [&]<typename T, int D, int M>() {
    forward_impl<T, D, M>(out, lse, q, k, v, causal, scale, mask);
  });
}

void flash_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, bool causal, double scale,
                              const Tensor& mask) {
  if (q.dtype() == DType::float32)
    return flash_attention_backward_fp32(dq, dk, dv, dout, q, k, v, out, lse, causal, scale, mask);
  check_cuda_inputs("flash_attention_backward", q, v);
  if (dq.numel() == 0 && dk.numel() == 0) return;
  if (cudnn_flash_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, causal, scale, mask))
    return;
  NvtxRange range("flash_attention_backward");
  DeviceGuard g(q.device().index);
  with_type_and_dim(q, mask, [&]<typename T, int D, int M>() {
    backward_impl<T, D, M>(dq, dk, dv, dout, q, k, v, out, lse, causal, scale, mask);
  });
}

// ------------------------------------------------------------ the cuDNN route's masks

// The four sizes and element strides of a mask view.
struct View4 {
  int64_t size[4], stride[4];
};

// bias[i] (contiguous over the view's sizes) = the mask element i as an additive bias: a bool
// true 0 and false `lowest`; a float32 value clamped below at `lowest` (-inf included).
template <typename T, bool kBool>
__global__ void mask_to_bias_kernel(T* bias, const void* mask, View4 v, int64_t n, float lowest) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = i, o = 0;
    for (int d = 3; d >= 0; --d) {
      o += rest % v.size[d] * v.stride[d];
      rest /= v.size[d];
    }
    float x;
    if constexpr (kBool)
      x = static_cast<const unsigned char*>(mask)[o] ? 0.f : lowest;
    else
      x = fmaxf(static_cast<const float*>(mask)[o], lowest);
    bias[i] = store<T>(x);
  }
}

// Rows whose log-sum-exp is below `below` (every score carried the lowest bias: no key took
// part) get out 0 and lse -inf; one warp a row.
template <typename T>
__global__ void clear_dead_rows_kernel(OutOperand<T> o, float* lse, int H, int L, int E,
                                       int64_t rows, float below) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; r < rows;
       r += warps) {
    if (!(lse[r] < below)) continue;
    const int bh = static_cast<int>(r / L), t = static_cast<int>(r % L);
    T* row = o.rows(bh, H) + static_cast<int64_t>(t) * o.st;
    for (int e = static_cast<int>(threadIdx.x % 32); e < E; e += 32) row[e] = store<T>(0.f);
    __syncwarp();
    if (threadIdx.x % 32 == 0) lse[r] = -INFINITY;
  }
}

// dst = lse with -inf as +inf: cuDNN's backward recomputes P = exp(s - stats), 0 on a row
// without keys.
__global__ void backward_stats_kernel(float* dst, const float* lse, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = lse[i];
    dst[i] = x == -INFINITY ? INFINITY : x;
  }
}

// ------------------------------------------------------------ rotary position embedding

// The step from element i to element i + h of a row, in each of out, x, cos, sin.
struct PartnerSteps {
  int64_t v[4];
};

// One thread a pair (i, i + h) of a row: offsets from the indexer over [lead..., h] for out,
// x, cos, sin; the partner element `half.v[k]` further on in each.
template <typename T>
__global__ void rotary_kernel(T* out, const T* x, const T* c, const T* s, int64_t pairs,
                              Indexer<4> ix, PartnerSteps half, bool backward) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t o[4];
    ix.get(p, o);
    using A = dacc_t<T>;
    const A x1 = load(x[o[1]]), x2 = load(x[o[1] + half.v[1]]);
    const A c1 = load(c[o[2]]), c2 = load(c[o[2] + half.v[2]]);
    const A s1 = load(s[o[3]]), s2 = load(s[o[3] + half.v[3]]);
    out[o[0]] = store<T>(backward ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
    out[o[0] + half.v[0]] = store<T>(backward ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
  }
}

void rotary_embedding(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin,
                      bool backward) {
  if (out.numel() == 0) return;
  NvtxRange range(backward ? "rotary_embedding_backward" : "rotary_embedding");
  DeviceGuard g(out.device().index);
  const size_t last = static_cast<size_t>(out.dim() - 1);
  const int64_t h = out.sizes()[last] / 2, pairs = out.numel() / 2;
  Shape sizes = out.sizes();
  sizes[last] = h;
  const std::array<const Tensor*, 4> ts{&out, &x, &cos, &sin};
  std::vector<const Shape*> strides;
  std::vector<int64_t> offsets;
  PartnerSteps half;
  for (size_t k = 0; k < 4; ++k) {
    strides.push_back(&ts[k]->strides());
    offsets.push_back(ts[k]->storage_offset());
    half.v[k] = h * ts[k]->strides()[last];
  }
  const Indexer<4> ix = make_indexer<4>(sizes, strides, offsets);
  const cudaStream_t st = stream(out.device().index);
  TALLY_DISPATCH_FLOAT(out.dtype(), "rotary_embedding", [&] {
    using T = dev_t<scalar_t>;
    rotary_kernel<T><<<blocks_for(pairs), kThreads, 0, st>>>(
        static_cast<T*>(out.storage().data()), static_cast<const T*>(x.storage().data()),
        static_cast<const T*>(cos.storage().data()), static_cast<const T*>(sin.storage().data()),
        pairs, ix, half, backward);
  });
  check_launch("rotary_embedding");
}

}  // namespace

float cudnn_mask_lowest(DType dtype) {
  return dtype == DType::float16 ? -65504.f : -1e30f;
}

void cudnn_mask_to_bias(const Tensor& bias, const Tensor& mask) {
  const int64_t n = bias.numel();
  if (n == 0) return;
  DeviceGuard g(bias.device().index);
  const std::array<int64_t, 4> own = mask_own_sizes(mask);
  View4 v{};
  for (size_t d = 0; d < 4; ++d) {
    v.size[d] = own[d];
    v.stride[d] = mask.strides()[d];
  }
  const char* m = static_cast<const char*>(mask.storage().data()) +
                  mask.storage_offset() * static_cast<int64_t>(mask.element_size());
  const float lowest = cudnn_mask_lowest(bias.dtype());
  const cudaStream_t st = stream(bias.device().index);
  auto run = [&]<typename T>() {
    T* out = static_cast<T*>(bias.storage().data()) + bias.storage_offset();
    if (mask.dtype() == DType::bool_)
      mask_to_bias_kernel<T, true><<<blocks_for(n), kThreads, 0, st>>>(out, m, v, n, lowest);
    else
      mask_to_bias_kernel<T, false><<<blocks_for(n), kThreads, 0, st>>>(out, m, v, n, lowest);
  };
  if (bias.dtype() == DType::bfloat16)
    run.template operator()<__nv_bfloat16>();
  else
    run.template operator()<__half>();
  check_launch("flash_attention_forward (cuDNN mask as bias)");
}

void cudnn_clear_dead_rows(const Tensor& out, const Tensor& lse) {
  const int64_t rows = lse.numel();
  if (rows == 0) return;
  DeviceGuard g(out.device().index);
  const float below = cudnn_mask_lowest(out.dtype()) / 2;
  const int64_t blocks =
      std::min<int64_t>((rows + 7) / 8, int64_t{16} * sm_count(out.device().index));
  auto run = [&]<typename T>() {
    clear_dead_rows_kernel<T>
        <<<static_cast<unsigned>(blocks), 256, 0, stream(out.device().index)>>>(
            out_operand<T>(out), static_cast<float*>(lse.storage().data()) + lse.storage_offset(),
            static_cast<int>(out.size(1)), static_cast<int>(out.size(2)),
            static_cast<int>(out.size(3)), rows, below);
  };
  if (out.dtype() == DType::bfloat16)
    run.template operator()<__nv_bfloat16>();
  else
    run.template operator()<__half>();
  check_launch("flash_attention_forward (cuDNN rows without keys)");
}

void cudnn_backward_stats(float* dst, const Tensor& lse) {
  const int64_t n = lse.numel();
  if (n == 0) return;
  DeviceGuard g(lse.device().index);
  backward_stats_kernel<<<blocks_for(n), kThreads, 0, stream(lse.device().index)>>>(
      dst, static_cast<const float*>(lse.storage().data()) + lse.storage_offset(), n);
  check_launch("flash_attention_backward (cuDNN statistics)");
}

const AttentionKernels attention_kernels{
    .flash_attention_forward = &flash_attention_forward,
    .flash_attention_backward = &flash_attention_backward,
    .flash_attention_fp32_fits = &flash_attention_fp32_fits,
    .rotary_embedding = &rotary_embedding,
};

}  // namespace tally::cuda
