// Multi-threaded, vectorised Adam(W) and AdamW8bit on the host (see cpu_adam.h). Compiled with
// -ffp-contract=off -fno-math-errno (CMakeLists.txt): no a * b + c becomes an FMA in the AVX2 and
// AVX-512 clones, and std::sqrt is the correctly rounded vector square root.
#include "optim/cpu_adam.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "optim/update_math.h"
#include "tensor/cpu/parallel.h"

// One body, compiled for the widest vectors the CPU has (the loader picks the clone).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define TALLY_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define TALLY_HOST_SIMD 1  // AdamW8bit's code books in AVX-512 / AVX2 loops (see CodeBook)
#include <immintrin.h>
#else
#define TALLY_VECTOR_CLONES
#endif

namespace tally::optim {
namespace {

#if defined(__GNUC__)
#define TALLY_ALWAYS_INLINE [[gnu::always_inline]] inline
#else
#define TALLY_ALWAYS_INLINE inline
#endif

// adam_element (update_math.h) without amsgrad, its uniform choices made at compile time so
// that the loop has no branch and vectorises: kDecay 0 (no weight decay), 1 (decoupled: AdamW),
// 2 (L2: Adam); kLow: lerp's weight in (-0.5, 0.5). The same operations in the same order.
template <bool kMaximize, int kDecay, bool kLow>
TALLY_ALWAYS_INLINE void adam_loop(const detail::AdamScalars<float>& s, float* __restrict p,
                                   const float* __restrict g, float* __restrict m,
                                   float* __restrict v, int64_t n) {
  const float wd = s.weight_decay, decay = s.decay_factor, w = s.lerp_weight, b2 = s.beta2,
              omb2 = s.one_minus_beta2, eps = s.eps, step = s.step_size_neg,
              bc2 = s.bias_correction2_sqrt, one_minus_w = 1.0f - w;
  TALLY_SIMD
  for (int64_t i = 0; i < n; ++i) {
    float gr = kMaximize ? -g[i] : g[i];
    float pi = p[i];
    if constexpr (kDecay == 1) pi = pi * decay;
    if constexpr (kDecay == 2) gr = gr + wd * pi;
    const float mo = m[i];
    const float mi = kLow ? mo + w * (gr - mo) : gr - (gr - mo) * one_minus_w;
    const float vi = v[i] * b2 + (omb2 * gr) * gr;
    const float denom = std::sqrt(vi) / bc2 + eps;
    p[i] = pi + (step * mi) / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

template <bool kMaximize, int kDecay>
TALLY_ALWAYS_INLINE void adam_loop_w(const detail::AdamScalars<float>& s, float* p, const float* g,
                                     float* m, float* v, int64_t n) {
  if (s.lerp_weight < 0.5f && s.lerp_weight > -0.5f)
    adam_loop<kMaximize, kDecay, true>(s, p, g, m, v, n);
  else
    adam_loop<kMaximize, kDecay, false>(s, p, g, m, v, n);
}

template <bool kMaximize>
TALLY_ALWAYS_INLINE void adam_loop_d(const detail::AdamScalars<float>& s, float* p, const float* g,
                                     float* m, float* v, int64_t n) {
  if (s.weight_decay == 0.0f)
    adam_loop_w<kMaximize, 0>(s, p, g, m, v, n);
  else if (s.decoupled)
    adam_loop_w<kMaximize, 1>(s, p, g, m, v, n);
  else
    adam_loop_w<kMaximize, 2>(s, p, g, m, v, n);
}

// Adam(W) without amsgrad, float32: the offloaded optimizer's hot loop, one clone per ISA.
TALLY_VECTOR_CLONES void adam_run_f32(const detail::AdamScalars<float>& s, float* p, const float* g,
                                      float* m, float* v, int64_t n) {
  if (s.maximize)
    adam_loop_d<true>(s, p, g, m, v, n);
  else
    adam_loop_d<false>(s, p, g, m, v, n);
}

// g[0..k) widened to float32 into `out`; with `scale` other than 1, times `scale` rounded to G
// first: the gradient clip_grad_norm_ would have left (optim/clip_grad.h: scaled in float32,
// stored back rounded), which CpuOffload::clip_grad_norm_ folds into the update.
template <typename G>
TALLY_ALWAYS_INLINE void widen(const G* __restrict g, float scale, float* __restrict out,
                               int64_t k) {
  if (scale == 1.0f) {
    TALLY_SIMD
    for (int64_t i = 0; i < k; ++i) out[i] = static_cast<float>(g[i]);
  } else if constexpr (std::is_same_v<G, float>) {
    TALLY_SIMD
    for (int64_t i = 0; i < k; ++i) out[i] = g[i] * scale;
  } else {
    TALLY_SIMD
    for (int64_t i = 0; i < k; ++i)
      out[i] = static_cast<float>(G(static_cast<float>(g[i]) * scale));
  }
}

// adam_run_f32 over float32 masters whose gradients are 16-bit (G: BFloat16 or Half), in blocks
// that stay in the L1 cache: each block's gradient widened into a buffer, updated, and the new
// weights rounded into `out` (which may be the gradient's own memory: the block was read
// first). Widening is exact and the rounding is G's own, so the result equals a cast, the
// float32 update and a cast back, with two fewer passes over memory.
template <typename G>
void adam_run_16(const detail::AdamScalars<float>& s, float* p, const G* g, float scale, float* m,
                 float* v, G* out, int64_t n) {
  constexpr int64_t kBlock = 2048;
  float buf[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t k = std::min(kBlock, n - b);
    widen(g + b, scale, buf, k);
    adam_run_f32(s, p + b, buf, m + b, v + b, k);
    if (out)
      for (int64_t i = 0; i < k; ++i) out[b + i] = G(p[b + i]);
  }
}

// One step of quantize8_flat's search: map[lo] <= y < map[lo + 2 * step] (or lo + 2 * step =
// 256) before, the same with `step` after; below, above: the entries at its ends, as read.
TALLY_ALWAYS_INLINE void halve(const float* __restrict map, float y, int step, int& lo,
                               float& below, float& above) {
  const float c = map[lo + step];
  const bool le = c <= y;
  lo = le ? lo + step : lo;
  below = le ? c : below;
  above = le ? above : c;
}

// quantize8 (update_math.h) without a branch, so that a block's codes vectorise (the map read
// by gathers): the same code. Eight halving steps find the largest entry <= y, the entries
// around y kept as the steps read them (a second read of either would be a masked gather, which
// GCC does not vectorise); then the nearer of the two, the lower on a tie; 0 for y <= map[0] or
// NaN, 255 from map[255].
TALLY_ALWAYS_INLINE uint8_t quantize8_flat(const float* __restrict map, float x, float absmax) {
  const float y = x / absmax;
  int lo = 0;
  float below = map[0], above = map[255];
  // Written out: GCC vectorises no loop around an inner loop.
  halve(map, y, 128, lo, below, above);
  halve(map, y, 64, lo, below, above);
  halve(map, y, 32, lo, below, above);
  halve(map, y, 16, lo, below, above);
  halve(map, y, 8, lo, below, above);
  halve(map, y, 4, lo, below, above);
  halve(map, y, 2, lo, below, above);
  halve(map, y, 1, lo, below, above);
  int q = y - below <= above - y ? lo : lo + 1;
  q = y >= map[255] ? 255 : q;
  q = y > map[0] ? q : 0;
  return static_cast<uint8_t>(q);
}

// The codes of a block's k values x of scale absmax. A block of zeros (absmax 0) is one code,
// quantize8's; apart, so that the loop has no condition (which GCC's clones would not
// if-convert).
TALLY_ALWAYS_INLINE void quantize8_block(const float* __restrict map, const float* __restrict x,
                                         float absmax, uint8_t* __restrict q, int64_t k) {
  if (!(absmax > 0.f)) {
    std::fill(q, q + k, detail::quantize8(map, 0.f, absmax));
    return;
  }
  TALLY_SIMD
  for (int64_t i = 0; i < k; ++i) q[i] = quantize8_flat(map, x[i], absmax);
}

#if defined(TALLY_HOST_SIMD)
// GCC 12's intrinsics start results from _mm512_undefined_*, which -Wmaybe-uninitialized flags.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The code books for the hand-written loops below, where GCC's vectorised loops read them with a
// scalar load per element. With AVX-512 they are held in registers and read with vpermi2ps (32
// entries an instruction), 16 elements of a block at a time; with AVX2, 8 at a time, by vpermps
// (8 entries) for the search's first levels and by gathers beyond. The same operations as
// dequantize8 and quantize8_flat, so the same results. levels[k][j] = map[s + 2 s j] (s = 2^k,
// j < 128 / s): the entries step s of the search may read, indexed by lo / 2s.
struct CodeBook {
  alignas(64) float all[256];
  alignas(64) float levels[8][128];
};
struct CodeBooks {
  CodeBook signed_map, unsigned_map;
};

const CodeBooks& code_books() {
  static const CodeBooks maps = [] {
    CodeBooks m{};
    const DynamicMaps& d = dynamic_maps();
    for (auto [src, dst] :
         {std::pair{d.signed_map, &m.signed_map}, std::pair{d.unsigned_map, &m.unsigned_map}}) {
      std::copy(src, src + 256, dst->all);
      for (int k = 0; k < 8; ++k)
        for (int j = 0; j < (128 >> k); ++j) dst->levels[k][j] = src[(1 << k) + (2 << k) * j];
    }
    return m;
  }();
  return maps;
}

int cpu_simd() {
  static const int level = __builtin_cpu_supports("avx512f") ? 2
                           : __builtin_cpu_supports("avx2")  ? 1
                                                             : 0;
  return level;
}

// t[j] for each lane, j < N (16 or fewer, or a multiple of 32 up to 256). N is a constant, so
// the loop unrolls into N / 32 vpermi2ps with no branch.
template <int N>
__attribute__((target("avx512f"))) TALLY_ALWAYS_INLINE __m512 lookup512(const float* t, __m512i j) {
  if constexpr (N <= 16) {
    return _mm512_permutexvar_ps(j, _mm512_load_ps(t));
  } else {
    __m512 r = _mm512_permutex2var_ps(_mm512_load_ps(t), j, _mm512_load_ps(t + 16));
#pragma GCC unroll 8
    for (int b = 32; b < N; b += 32) {
      const __m512 rb =
          _mm512_permutex2var_ps(_mm512_load_ps(t + b), j, _mm512_load_ps(t + b + 16));
      r = _mm512_mask_mov_ps(r, _mm512_cmpge_epi32_mask(j, _mm512_set1_epi32(b)), rb);
    }
    return r;
  }
}

// dequantize8 of k codes: x[i] = map[q[i]] * absmax.
__attribute__((target("avx512f"))) void dequantize8_avx512(const CodeBook& map, const uint8_t* q,
                                                           float absmax, float* x, int64_t k) {
  const __m512 a = _mm512_set1_ps(absmax);
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512i j =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    _mm512_storeu_ps(x + i, _mm512_mul_ps(lookup512<256>(map.all, j), a));
  }
  for (; i < k; ++i) x[i] = detail::dequantize8(map.all, q[i], absmax);
}

// halve() of 16 lanes, step 2^kLev: its entries are levels[kLev][lo / 2^(kLev + 1)].
template <int kLev>
__attribute__((target("avx512f"))) TALLY_ALWAYS_INLINE void halve512(const CodeBook& map, __m512 y,
                                                                     __m512i& lo, __m512& below,
                                                                     __m512& above) {
  const __m512 c = lookup512<(128 >> kLev)>(map.levels[kLev], _mm512_srli_epi32(lo, kLev + 1));
  const __mmask16 le = _mm512_cmp_ps_mask(c, y, _CMP_LE_OQ);
  lo = _mm512_mask_add_epi32(lo, le, lo, _mm512_set1_epi32(1 << kLev));
  below = _mm512_mask_mov_ps(below, le, c);
  above = _mm512_mask_mov_ps(c, le, above);
}

// quantize8_flat of k values (absmax > 0).
__attribute__((target("avx512f"))) void quantize8_avx512(const CodeBook& map, const float* x,
                                                         float absmax, uint8_t* q, int64_t k) {
  const __m512 a = _mm512_set1_ps(absmax), first = _mm512_set1_ps(map.all[0]),
               last = _mm512_set1_ps(map.all[255]);
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + i), a);
    __m512i lo = _mm512_setzero_si512();
    __m512 below = first, above = last;
    halve512<7>(map, y, lo, below, above);
    halve512<6>(map, y, lo, below, above);
    halve512<5>(map, y, lo, below, above);
    halve512<4>(map, y, lo, below, above);
    halve512<3>(map, y, lo, below, above);
    halve512<2>(map, y, lo, below, above);
    halve512<1>(map, y, lo, below, above);
    halve512<0>(map, y, lo, below, above);
    const __mmask16 nearer_below =
        _mm512_cmp_ps_mask(_mm512_sub_ps(y, below), _mm512_sub_ps(above, y), _CMP_LE_OQ);
    __m512i code =
        _mm512_mask_mov_epi32(_mm512_add_epi32(lo, _mm512_set1_epi32(1)), nearer_below, lo);
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(y, last, _CMP_GE_OQ),
                                 _mm512_set1_epi32(255));
    code = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, first, _CMP_GT_OQ), code);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(code));
  }
  for (; i < k; ++i) q[i] = quantize8_flat(map.all, x[i], absmax);
}

// t[j] for each of 8 lanes, j < N: vpermps from one register (N <= 8) or two and a blend (16),
// a gather beyond (AVX2 has no two-register permute).
template <int N>
__attribute__((target("avx2"))) TALLY_ALWAYS_INLINE __m256 lookup256(const float* t, __m256i j) {
  if constexpr (N <= 8) {
    return _mm256_permutevar8x32_ps(_mm256_load_ps(t), j);
  } else if constexpr (N == 16) {
    const __m256 low = _mm256_permutevar8x32_ps(_mm256_load_ps(t), j);
    const __m256 high = _mm256_permutevar8x32_ps(_mm256_load_ps(t + 8), j);
    return _mm256_blendv_ps(low, high,
                            _mm256_castsi256_ps(_mm256_cmpgt_epi32(j, _mm256_set1_epi32(7))));
  } else {
    return _mm256_i32gather_ps(t, j, 4);
  }
}

// dequantize8 of k codes, 8 at a time: x[i] = map[q[i]] * absmax.
__attribute__((target("avx2"))) void dequantize8_avx2(const CodeBook& map, const uint8_t* q,
                                                      float absmax, float* x, int64_t k) {
  const __m256 a = _mm256_set1_ps(absmax);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256i j =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_i32gather_ps(map.all, j, 4), a));
  }
  for (; i < k; ++i) x[i] = detail::dequantize8(map.all, q[i], absmax);
}

// halve512's step for 8 lanes (a comparison's mask is all ones or zeros in each lane).
template <int kLev>
__attribute__((target("avx2"))) TALLY_ALWAYS_INLINE void halve256(const CodeBook& map, __m256 y,
                                                                  __m256i& lo, __m256& below,
                                                                  __m256& above) {
  const __m256 c = lookup256<(128 >> kLev)>(map.levels[kLev], _mm256_srli_epi32(lo, kLev + 1));
  const __m256 le = _mm256_cmp_ps(c, y, _CMP_LE_OQ);
  lo =
      _mm256_add_epi32(lo, _mm256_and_si256(_mm256_castps_si256(le), _mm256_set1_epi32(1 << kLev)));
  below = _mm256_blendv_ps(below, c, le);
  above = _mm256_blendv_ps(c, above, le);
}

// quantize8_flat of k values (absmax > 0), 8 at a time.
__attribute__((target("avx2"))) void quantize8_avx2(const CodeBook& map, const float* x,
                                                    float absmax, uint8_t* q, int64_t k) {
  const __m256 a = _mm256_set1_ps(absmax), first = _mm256_set1_ps(map.all[0]),
               last = _mm256_set1_ps(map.all[255]);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + i), a);
    __m256i lo = _mm256_setzero_si256();
    __m256 below = first, above = last;
    halve256<7>(map, y, lo, below, above);
    halve256<6>(map, y, lo, below, above);
    halve256<5>(map, y, lo, below, above);
    halve256<4>(map, y, lo, below, above);
    halve256<3>(map, y, lo, below, above);
    halve256<2>(map, y, lo, below, above);
    halve256<1>(map, y, lo, below, above);
    halve256<0>(map, y, lo, below, above);
    const __m256 nearer_below =
        _mm256_cmp_ps(_mm256_sub_ps(y, below), _mm256_sub_ps(above, y), _CMP_LE_OQ);
    __m256i code = _mm256_blendv_epi8(_mm256_add_epi32(lo, _mm256_set1_epi32(1)), lo,
                                      _mm256_castps_si256(nearer_below));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(255),
                              _mm256_castps_si256(_mm256_cmp_ps(y, last, _CMP_GE_OQ)));
    code = _mm256_and_si256(code, _mm256_castps_si256(_mm256_cmp_ps(y, first, _CMP_GT_OQ)));
    const __m128i words =
        _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packus_epi16(words, words));
  }
  for (; i < k; ++i) q[i] = quantize8_flat(map.all, x[i], absmax);
}
#pragma GCC diagnostic pop
#endif

std::atomic<int> simd_cap{2};  // detail::set_host_simd_cap's

// The hand-written loops AdamW8bit's blocks use: 2 AVX-512, 1 AVX2, 0 GCC's vectorised ones.
int host_simd() {
#if defined(TALLY_HOST_SIMD)
  return std::min(cpu_simd(), simd_cap.load(std::memory_order_relaxed));
#else
  return 0;
#endif
}

// Scratch of one AdamW8bit block (kMax8bitBlock elements at most): the widened gradient and the
// moments between their dequantization and requantization.
struct Block8 {
  alignas(64) float g[kMax8bitBlock];
  alignas(64) float m[kMax8bitBlock];
  alignas(64) float v[kMax8bitBlock];
};

// One AdamW8bit block of k elements over a float32 or 16-bit gradient, as the serial kernel
// (multi_tensor.cpp: adamw8bit) computes it: the moments dequantized, adam_loop (the operations
// of adam8bit_element), the block's new absmax (exact in any order: lanes, then across them),
// the codes, and (16-bit) the new weights rounded into `out` (may be g: it has been read). Each
// loop branch-free, so each vectorises.
template <typename G, bool kMaximize>
TALLY_ALWAYS_INLINE void adam8bit_block(const detail::AdamScalars<float>& s,
                                        const DynamicMaps& maps, float* __restrict p, const G* g,
                                        float scale, uint8_t* __restrict qm, uint8_t* __restrict qv,
                                        float& am, float& av, G* out, int64_t k, Block8& b) {
  const float am0 = am, av0 = av;
  const int simd = host_simd();
  widen(g, scale, b.g, k);
#if defined(TALLY_HOST_SIMD)
  if (simd == 2) {
    dequantize8_avx512(code_books().signed_map, qm, am0, b.m, k);
    dequantize8_avx512(code_books().unsigned_map, qv, av0, b.v, k);
  } else if (simd == 1) {
    dequantize8_avx2(code_books().signed_map, qm, am0, b.m, k);
    dequantize8_avx2(code_books().unsigned_map, qv, av0, b.v, k);
  } else
#endif
  {
    TALLY_SIMD
    for (int64_t i = 0; i < k; ++i) {
      b.m[i] = detail::dequantize8(maps.signed_map, qm[i], am0);
      b.v[i] = detail::dequantize8(maps.unsigned_map, qv[i], av0);
    }
  }
  adam_loop_d<kMaximize>(s, p, b.g, b.m, b.v, k);
  constexpr int64_t kLanes = 16;
  float lm[kLanes] = {}, lv[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      lm[j] = detail::absmax_step(lm[j], b.m[i + j]);
      lv[j] = detail::absmax_step(lv[j], b.v[i + j]);
    }
  for (int64_t j = 0; i < k; ++i, ++j) {
    lm[j] = detail::absmax_step(lm[j], b.m[i]);
    lv[j] = detail::absmax_step(lv[j], b.v[i]);
  }
  float max_m = 0.f, max_v = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) {
    max_m = detail::absmax_step(max_m, lm[j]);
    max_v = detail::absmax_step(max_v, lv[j]);
  }
  am = max_m;
  av = max_v;
#if defined(TALLY_HOST_SIMD)
  if (simd == 2 && max_m > 0.f && max_v > 0.f) {
    quantize8_avx512(code_books().signed_map, b.m, max_m, qm, k);
    quantize8_avx512(code_books().unsigned_map, b.v, max_v, qv, k);
  } else if (simd == 1 && max_m > 0.f && max_v > 0.f) {
    quantize8_avx2(code_books().signed_map, b.m, max_m, qm, k);
    quantize8_avx2(code_books().unsigned_map, b.v, max_v, qv, k);
  } else
#endif
  {
    quantize8_block(maps.signed_map, b.m, max_m, qm, k);
    quantize8_block(maps.unsigned_map, b.v, max_v, qv, k);
  }
  if constexpr (!std::is_same_v<G, float>) {
    if (out) {
      TALLY_SIMD
      for (int64_t j = 0; j < k; ++j)
        out[j].bits = G(p[j]).bits;  // (a struct copy does not vectorise)
    }
  }
}

// The blocks of one run (n elements from a block's start) of adam8bit_run_16.
template <typename G>
TALLY_ALWAYS_INLINE void adam8bit_run_body(const detail::AdamScalars<float>& s, int64_t bs,
                                           float* p, const G* g, float scale, uint8_t* qm,
                                           uint8_t* qv, float* am, float* av, G* out, int64_t n) {
  const DynamicMaps& maps = dynamic_maps();
  Block8 b;
  for (int64_t begin = 0, k = 0; begin < n; begin += bs, ++k) {
    const int64_t e = std::min(bs, n - begin);
    G* o = out ? out + begin : nullptr;
    if (s.maximize)
      adam8bit_block<G, true>(s, maps, p + begin, g + begin, scale, qm + begin, qv + begin, am[k],
                              av[k], o, e, b);
    else
      adam8bit_block<G, false>(s, maps, p + begin, g + begin, scale, qm + begin, qv + begin, am[k],
                               av[k], o, e, b);
  }
}

// One clone per ISA and gradient dtype (target_clones takes no templates).
TALLY_VECTOR_CLONES void adam8bit_run_bf16(const detail::AdamScalars<float>& s, int64_t bs,
                                           float* p, const BFloat16* g, float scale, uint8_t* qm,
                                           uint8_t* qv, float* am, float* av, BFloat16* out,
                                           int64_t n) {
  adam8bit_run_body(s, bs, p, g, scale, qm, qv, am, av, out, n);
}
TALLY_VECTOR_CLONES void adam8bit_run_f16(const detail::AdamScalars<float>& s, int64_t bs, float* p,
                                          const Half* g, float scale, uint8_t* qm, uint8_t* qv,
                                          float* am, float* av, Half* out, int64_t n) {
  adam8bit_run_body(s, bs, p, g, scale, qm, qv, am, av, out, n);
}
TALLY_VECTOR_CLONES void adam8bit_run_f32(const detail::AdamScalars<float>& s, int64_t bs, float* p,
                                          const float* g, uint8_t* qm, uint8_t* qv, float* am,
                                          float* av, int64_t n) {
  adam8bit_run_body<float>(s, bs, p, g, 1.0f, qm, qv, am, av, nullptr, n);
}
void adam8bit_run_16(const detail::AdamScalars<float>& s, int64_t bs, float* p, const BFloat16* g,
                     float scale, uint8_t* qm, uint8_t* qv, float* am, float* av, BFloat16* out,
                     int64_t n) {
  adam8bit_run_bf16(s, bs, p, g, scale, qm, qv, am, av, out, n);
}
void adam8bit_run_16(const detail::AdamScalars<float>& s, int64_t bs, float* p, const Half* g,
                     float scale, uint8_t* qm, uint8_t* qv, float* am, float* av, Half* out,
                     int64_t n) {
  adam8bit_run_f16(s, bs, p, g, scale, qm, qv, am, av, out, n);
}

template <typename T>
void adam_run(const detail::AdamScalars<T>& s, T* p, const T* g, T* m, T* v, T* vmax, int64_t n) {
  if constexpr (sizeof(T) == 4) {
    if (!vmax) return adam_run_f32(s, p, g, m, v, n);
  }
  for (int64_t i = 0; i < n; ++i)
    detail::adam_element(s, p[i], g[i], m[i], v[i], vmax ? &vmax[i] : nullptr);
}

// The runs of l's tensors: (tensor, first element, elements), kChunkSize elements each.
struct Run {
  size_t tensor;
  int64_t begin, n;
};
// List k's pointer at run x's first element, as T*.
template <typename T>
T* at(const TensorLists& l, const Run& x, int k) {
  return static_cast<T*>(l.ptrs[x.tensor][static_cast<size_t>(k)]) + x.begin;
}

// f(run) for every run of l, the runs spread over the CPU threads.
template <typename F>
void for_each_run(const TensorLists& l, F&& f) {
  std::vector<Run> runs;
  for (size_t t = 0; t < l.size(); ++t)
    for (int64_t b = 0; b < l.numels[t]; b += kChunkSize)
      runs.push_back({t, b, std::min(kChunkSize, l.numels[t] - b)});
  tally::cpu::parallel_for(static_cast<int64_t>(runs.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) f(runs[static_cast<size_t>(r)]);
  });
}

void check_cpu(const TensorLists& l, const char* op) {
  if (l.device != Device::cpu())
    throw std::invalid_argument(
        fmt::format("{}: the host update takes CPU tensors, got {}", op, l.device.str()));
}

// AdamW8bit's lists (float32, depth 6) on the CPU, and its block size.
void check_8bit(const TensorLists& l, const AdamW8bitHyper& h, const char* op) {
  check_cpu(l, op);
  if (l.depth != 6 || l.dtype != DType::float32)
    throw std::invalid_argument(
        fmt::format("{}: float32 lists of depth 6 expected, got {} of depth {}", op,
                    dtype_name(l.dtype), l.depth));
  if (h.block_size < kMin8bitBlock || h.block_size > kMax8bitBlock ||
      (h.block_size & (h.block_size - 1)) != 0)
    throw std::invalid_argument(fmt::format("{}: block_size {} is not a power of two from {} to {}",
                                            op, h.block_size, kMin8bitBlock, kMax8bitBlock));
}

// The 16-bit paths' gradient dtype and output pointers.
void check_16(const TensorLists& l, DType grad, const std::vector<void*>& out, const char* op) {
  if (grad != DType::bfloat16 && grad != DType::float16)
    throw std::invalid_argument(
        fmt::format("{}: gradients must be bfloat16 or float16, got {}", op, dtype_name(grad)));
  if (!out.empty() && out.size() != l.size())
    throw std::invalid_argument(
        fmt::format("{}: {} output pointers for {} tensors", op, out.size(), l.size()));
}

// Run x's output pointer: none where `out` is empty or its tensor's entry null.
template <typename G>
G* out_at(const std::vector<void*>& out, const Run& x) {
  return out.empty() || !out[x.tensor] ? nullptr : static_cast<G*>(out[x.tensor]) + x.begin;
}

}  // namespace

void parallel_adam_(const TensorLists& l, const AdamHyper& h) {
  check_cpu(l, "parallel_adam_");
  if (h.capturable)
    throw std::invalid_argument("parallel_adam_: capturable updates run on the device");
  if (l.depth != 4 + (h.amsgrad ? 1 : 0))
    throw std::invalid_argument(
        fmt::format("parallel_adam_: lists of depth {} (amsgrad {})", l.depth, h.amsgrad));
  if (h.found_inf && *h.found_inf != 0) return;
  auto run_all = [&](auto zero) {
    using T = decltype(zero);
    const detail::AdamScalars<T> s(h);
    for_each_run(l, [&](const Run& x) {
      adam_run<T>(s, at<T>(l, x, 0), at<T>(l, x, 1), at<T>(l, x, 2), at<T>(l, x, 3),
                  h.amsgrad ? at<T>(l, x, 4) : nullptr, x.n);
    });
  };
  if (l.dtype == DType::float32)
    run_all(float{});
  else if (l.dtype == DType::float64)
    run_all(double{});
  else
    throw std::invalid_argument(fmt::format(
        "parallel_adam_: parameters must be float32 or float64, got {}", dtype_name(l.dtype)));
}

void parallel_adam_16_(const TensorLists& l, const AdamHyper& h, DType grad,
                       const std::vector<void*>& out, float grad_scale) {
  check_cpu(l, "parallel_adam_16_");
  if (h.capturable || h.amsgrad || l.depth != 4 || l.dtype != DType::float32)
    throw std::invalid_argument(fmt::format(
        "parallel_adam_16_: float32 lists of depth 4 without amsgrad or capturable expected, "
        "got {} of depth {} (amsgrad {})",
        dtype_name(l.dtype), l.depth, h.amsgrad));
  check_16(l, grad, out, "parallel_adam_16_");
  if (h.found_inf && *h.found_inf != 0) return;
  auto run_all = [&](auto zero) {
    using G = decltype(zero);
    const detail::AdamScalars<float> s(h);
    for_each_run(l, [&](const Run& x) {
      adam_run_16<G>(s, at<float>(l, x, 0), at<const G>(l, x, 1), grad_scale, at<float>(l, x, 2),
                     at<float>(l, x, 3), out_at<G>(out, x), x.n);
    });
  };
  if (grad == DType::bfloat16)
    run_all(BFloat16{});
  else
    run_all(Half{});
}

void parallel_adamw8bit_(const TensorLists& l, const AdamW8bitHyper& h) {
  check_8bit(l, h, "parallel_adamw8bit_");
  // The vectorised blocks of the 16-bit path with float32 gradients (the code-book search
  // without a branch: the serial kernel's binary search mispredicts on real moments, 24 ns an
  // element against 2.9 on constant ones); amsgrad, capturable and found_inf keep the serial
  // kernel.
  const bool vectorised = !h.adam.amsgrad && !h.adam.capturable && !h.adam.found_inf;
  const detail::AdamScalars<float> s(h.adam);
  // Each run is whole blocks (kChunkSize % block == 0).
  for_each_run(l, [&](const Run& x) {
    const auto& q = l.ptrs[x.tensor];
    if (vectorised) {
      adam8bit_run_f32(s, h.block_size, at<float>(l, x, 0), at<const float>(l, x, 1),
                       at<uint8_t>(l, x, 2), at<uint8_t>(l, x, 3),
                       static_cast<float*>(q[4]) + x.begin / h.block_size,
                       static_cast<float*>(q[5]) + x.begin / h.block_size, x.n);
      return;
    }
    TensorLists one(l.device, l.dtype, 6);
    one.add({at<float>(l, x, 0), at<float>(l, x, 1), at<uint8_t>(l, x, 2), at<uint8_t>(l, x, 3),
             static_cast<float*>(q[4]) + x.begin / h.block_size,
             static_cast<float*>(q[5]) + x.begin / h.block_size},
            x.n);
    cpu::serial_multi_tensor_kernels.adamw8bit(one, h);
  });
}

void parallel_adamw8bit_16_(const TensorLists& l, const AdamW8bitHyper& h, DType grad,
                            const std::vector<void*>& out, float grad_scale) {
  check_8bit(l, h, "parallel_adamw8bit_16_");
  if (h.adam.capturable || h.adam.amsgrad)
    throw std::invalid_argument(
        fmt::format("parallel_adamw8bit_16_: amsgrad ({}) and capturable ({}) are not supported",
                    h.adam.amsgrad, h.adam.capturable));
  check_16(l, grad, out, "parallel_adamw8bit_16_");
  if (h.adam.found_inf && *h.adam.found_inf != 0) return;
  auto run_all = [&](auto zero) {
    using G = decltype(zero);
    const detail::AdamScalars<float> s(h.adam);
    // Each run is whole blocks (kChunkSize % block == 0).
    for_each_run(l, [&](const Run& x) {
      const auto& q = l.ptrs[x.tensor];
      adam8bit_run_16(s, h.block_size, at<float>(l, x, 0), at<const G>(l, x, 1), grad_scale,
                      at<uint8_t>(l, x, 2), at<uint8_t>(l, x, 3),
                      static_cast<float*>(q[4]) + x.begin / h.block_size,
                      static_cast<float*>(q[5]) + x.begin / h.block_size, out_at<G>(out, x), x.n);
    });
  };
  if (grad == DType::bfloat16)
    run_all(BFloat16{});
  else
    run_all(Half{});
}

namespace detail {
int set_host_simd_cap(int cap) {
  if (cap < 0 || cap > 2)
    throw std::invalid_argument(fmt::format(
        "set_host_simd_cap: cap must be 0 (none), 1 (AVX2) or 2 (AVX-512), got {}", cap));
  return simd_cap.exchange(cap);
}
}  // namespace detail

}  // namespace tally::optim
