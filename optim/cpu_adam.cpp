// Multi-threaded, vectorised Adam(W) and AdamW8bit on the host (see cpu_adam.h). Compiled with
// -ffp-contract=off -fno-math-errno (CMakeLists.txt): no a * b + c becomes an FMA in the AVX2 and
// AVX-512 clones, and std::sqrt is the correctly rounded vector square root.
#include "optim/cpu_adam.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "optim/update_math.h"
#include "tensor/cpu/parallel.h"

// One body, compiled for the widest vectors the CPU has (the loader picks the clone).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define TALLY_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
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

// adam_run_f32 over float32 masters whose gradients are 16-bit (G: BFloat16 or Half), in blocks
// that stay in the L1 cache: each block's gradient widened into a buffer, updated, and the new
// weights rounded into `out` (which may be the gradient's own memory: the block was read
// first). Widening is exact and the rounding is G's own, so the result equals a cast, the
// float32 update and a cast back, with two fewer passes over memory.
template <typename G>
void adam_run_16(const detail::AdamScalars<float>& s, float* p, const G* g, float* m, float* v,
                 G* out, int64_t n) {
  constexpr int64_t kBlock = 2048;
  float buf[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t k = std::min(kBlock, n - b);
    for (int64_t i = 0; i < k; ++i) buf[i] = static_cast<float>(g[b + i]);
    adam_run_f32(s, p + b, buf, m + b, v + b, k);
    if (out)
      for (int64_t i = 0; i < k; ++i) out[b + i] = G(p[b + i]);
  }
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
                       const std::vector<void*>& out) {
  check_cpu(l, "parallel_adam_16_");
  if (h.capturable || h.amsgrad || l.depth != 4 || l.dtype != DType::float32)
    throw std::invalid_argument(fmt::format(
        "parallel_adam_16_: float32 lists of depth 4 without amsgrad or capturable expected, "
        "got {} of depth {} (amsgrad {})",
        dtype_name(l.dtype), l.depth, h.amsgrad));
  if (grad != DType::bfloat16 && grad != DType::float16)
    throw std::invalid_argument(fmt::format(
        "parallel_adam_16_: gradients must be bfloat16 or float16, got {}", dtype_name(grad)));
  if (!out.empty() && out.size() != l.size())
    throw std::invalid_argument(
        fmt::format("parallel_adam_16_: {} output pointers for {} tensors", out.size(), l.size()));
  if (h.found_inf && *h.found_inf != 0) return;
  auto run_all = [&](auto zero) {
    using G = decltype(zero);
    const detail::AdamScalars<float> s(h);
    for_each_run(l, [&](const Run& x) {
      G* o = out.empty() ? nullptr : static_cast<G*>(out[x.tensor]) + x.begin;
      adam_run_16<G>(s, at<float>(l, x, 0), at<const G>(l, x, 1), at<float>(l, x, 2),
                     at<float>(l, x, 3), o, x.n);
    });
  };
  if (grad == DType::bfloat16)
    run_all(BFloat16{});
  else
    run_all(Half{});
}

void parallel_adamw8bit_(const TensorLists& l, const AdamW8bitHyper& h) {
  check_cpu(l, "parallel_adamw8bit_");
  if (l.depth != 6 || l.dtype != DType::float32)
    throw std::invalid_argument(
        fmt::format("parallel_adamw8bit_: float32 lists of depth 6 expected, got {} of depth {}",
                    dtype_name(l.dtype), l.depth));
  if (h.block_size < kMin8bitBlock || h.block_size > kMax8bitBlock ||
      (h.block_size & (h.block_size - 1)) != 0)
    throw std::invalid_argument(
        fmt::format("parallel_adamw8bit_: block_size {} is not a power of two from {} to {}",
                    h.block_size, kMin8bitBlock, kMax8bitBlock));
  // Each run is whole blocks (kChunkSize % block == 0).
  for_each_run(l, [&](const Run& x) {
    const auto& q = l.ptrs[x.tensor];
    TensorLists one(l.device, l.dtype, 6);
    one.add({at<float>(l, x, 0), at<float>(l, x, 1), at<uint8_t>(l, x, 2), at<uint8_t>(l, x, 3),
             static_cast<float*>(q[4]) + x.begin / h.block_size,
             static_cast<float*>(q[5]) + x.begin / h.block_size},
            x.n);
    cpu::multi_tensor_kernels.adamw8bit(one, h);
  });
}

}  // namespace tally::optim
