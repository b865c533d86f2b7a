// The per-element update equations shared by the CPU loops (optim/multi_tensor.cpp) and the
// CUDA kernels (optim/cuda_multi_tensor.cu), so both devices compute the very same
// expressions. They follow PyTorch's single-tensor paths (torch/optim/sgd.py, adam.py):
// scalars are prepared in double on the host and rounded to the element type, the element
// math runs in the element type, in PyTorch's operation order. Products and sums go through
// mul/add, which on the device are the round-to-nearest intrinsics nvcc never fuses into an
// FMA: the GPU then rounds exactly like the CPU (x86-64 has no FMA contraction here), and
// the CUDA results equal the CPU reference bit for bit.
#pragma once

#include <cmath>
#include <limits>

#include "optim/multi_tensor.h"

#if defined(__CUDACC__)
#define TALLY_OPTIM_HD __host__ __device__ __forceinline__
#else
#define TALLY_OPTIM_HD inline
#endif

namespace tally::optim::detail {

// a * b (Rn::mul) or a + b (Rn::add) in T, rounded to nearest and never fused (see above).
enum class Rn { mul, add };
template <Rn op, typename T>
TALLY_OPTIM_HD T rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4)
    return op == Rn::mul ? __fmul_rn(a, b) : __fadd_rn(a, b);
  else
    return op == Rn::mul ? __dmul_rn(a, b) : __dadd_rn(a, b);
#else
  return op == Rn::mul ? a * b : a + b;
#endif
}
template <typename T>
TALLY_OPTIM_HD T mul(T a, T b) {
  return rn<Rn::mul>(a, b);
}
template <typename T>
TALLY_OPTIM_HD T add(T a, T b) {
  return rn<Rn::add>(a, b);
}

template <typename T>
struct SGDScalars {
  T lr_neg, momentum, one_minus_dampening, weight_decay;
  bool nesterov, maximize, first_step;
  explicit SGDScalars(const SGDHyper& h)
      : lr_neg(static_cast<T>(-h.lr)),
        momentum(static_cast<T>(h.momentum)),
        one_minus_dampening(static_cast<T>(1.0 - h.dampening)),
        weight_decay(static_cast<T>(h.weight_decay)),
        nesterov(h.nesterov),
        maximize(h.maximize),
        first_step(h.first_step) {}
  TALLY_OPTIM_HD void set_lr(double lr) { lr_neg = static_cast<T>(-lr); }
};

// grad = -grad if maximize; grad += wd * param; buf = grad (first) or buf * momentum +
// (1 - dampening) * grad; grad = grad + momentum * buf (nesterov) or buf; param -= lr * grad.
template <typename T>
TALLY_OPTIM_HD void sgd_element(const SGDScalars<T>& s, T& p, T g, T* buf) {
  T d = s.maximize ? -g : g;
  if (s.weight_decay != T(0)) d = add(d, mul(s.weight_decay, p));
  if (buf) {
    const T b = s.first_step ? d : add(mul(*buf, s.momentum), mul(s.one_minus_dampening, d));
    *buf = b;
    d = s.nesterov ? add(d, mul(s.momentum, b)) : b;
  }
  p = add(p, mul(s.lr_neg, d));
}

template <typename T>
struct AdamScalars {
  T weight_decay, decay_factor, lerp_weight, beta2, one_minus_beta2, eps, step_size_neg,
      bias_correction2_sqrt;
  bool decoupled, amsgrad, maximize;
  double lr_d, beta1_d, beta2_d, wd_d;  // what set_step and set_lr need
  explicit AdamScalars(const AdamHyper& h)
      : weight_decay(static_cast<T>(h.weight_decay)),
        decay_factor(static_cast<T>(1.0 - h.lr * h.weight_decay)),
        lerp_weight(static_cast<T>(1.0 - h.beta1)),
        beta2(static_cast<T>(h.beta2)),
        one_minus_beta2(static_cast<T>(1.0 - h.beta2)),
        eps(static_cast<T>(h.eps)),
        decoupled(h.decoupled),
        amsgrad(h.amsgrad),
        maximize(h.maximize),
        lr_d(h.lr),
        beta1_d(h.beta1),
        beta2_d(h.beta2),
        wd_d(h.weight_decay) {
    set_step(static_cast<double>(h.step));
  }
  // The lr read on the device (capturable updates); set_step after it.
  TALLY_OPTIM_HD void set_lr(double lr) {
    lr_d = lr;
    decay_factor = static_cast<T>(1.0 - lr * wd_d);
  }
  // The bias corrections of step `step` (capturable updates call it with the device's count).
  TALLY_OPTIM_HD void set_step(double step) {
    const double bc1 = 1.0 - std::pow(beta1_d, step);
    const double bc2 = 1.0 - std::pow(beta2_d, step);
    step_size_neg = static_cast<T>(-(lr_d / bc1));
    bias_correction2_sqrt = static_cast<T>(std::sqrt(bc2));
  }
};

// torch.lerp's formula (exact at both ends).
template <typename T>
TALLY_OPTIM_HD T lerp(T self, T end, T w) {
  return (w < T(0.5) && w > T(-0.5)) ? add(self, mul(w, end - self))
                                     : end - mul(end - self, T(1) - w);
}

// Adam:  grad += wd * param.       AdamW: param *= 1 - lr * wd.
// exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad;
// denom = sqrt(exp_avg_sq or its running max) / sqrt(bias_correction2) + eps;
// param += -(lr / bias_correction1) * exp_avg / denom.
template <typename T>
TALLY_OPTIM_HD void adam_element(const AdamScalars<T>& s, T& p, T g, T& m, T& v, T* vmax) {
  T gr = s.maximize ? -g : g;
  if (s.weight_decay != T(0)) {
    if (s.decoupled)
      p = mul(p, s.decay_factor);
    else
      gr = add(gr, mul(s.weight_decay, p));
  }
  m = lerp(m, gr, s.lerp_weight);
  v = add(mul(v, s.beta2), mul(mul(s.one_minus_beta2, gr), gr));
  T vv = v;
  if (vmax) {
    const T mx = *vmax;
    vv = (mx != mx || mx > v) ? mx : v;  // torch.maximum propagates NaN
    *vmax = vv;
  }
  const T denom = add(std::sqrt(vv) / s.bias_correction2_sqrt, s.eps);
  p = add(p, mul(s.step_size_neg, m) / denom);
}

// ---- AdamW8bit's block-wise 8-bit states (multi_tensor.h: AdamW8bitHyper) ----

// The value code q stands for in a block scaled by absmax.
TALLY_OPTIM_HD float dequantize8(const float* map, uint8_t q, float absmax) {
  return mul(map[q], absmax);
}

// The running block scale: max(acc, |x|), a NaN x ignored (as fmaxf). Exact in any order, so
// the CUDA block reduction and the CPU loop agree.
TALLY_OPTIM_HD float absmax_step(float acc, float x) {
  const float a = x < 0.f ? -x : x;
  return a > acc ? a : acc;
}

// The code of x in a block of scale absmax: the map entry nearest to x / absmax (the lower one
// on a tie), by binary search over the sorted 256-entry map; a block of zeros (absmax 0)
// codes its zeros as the map's 0. |x| <= absmax, so x / absmax lies in [-1, 1].
TALLY_OPTIM_HD uint8_t quantize8(const float* map, float x, float absmax) {
  const float y = absmax > 0.f ? x / absmax : 0.f;
  if (!(y > map[0])) return 0;  // NaN too
  if (y >= map[255]) return 255;
  int lo = 0, hi = 255;  // map[lo] <= y < map[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (map[mid] <= y)
      lo = mid;
    else
      hi = mid;
  }
  return static_cast<uint8_t>(y - map[lo] <= map[hi] - y ? lo : hi);
}

// One element of AdamW8bit before its block is requantized: the moments dequantized from
// codes qm, qv (scales am, av), then adam_element in float; m and v receive the updated
// moments.
TALLY_OPTIM_HD void adam8bit_element(const AdamScalars<float>& s, const DynamicMaps& maps, float& p,
                                     float g, uint8_t qm, uint8_t qv, float am, float av, float& m,
                                     float& v) {
  m = dequantize8(maps.signed_map, qm, am);
  v = dequantize8(maps.unsigned_map, qv, av);
  adam_element(s, p, g, m, v, static_cast<float*>(nullptr));
}

// One element's contribution to sum |x|^p (p = inf: |x|, combined with nan_max; p = 0: x != 0).
TALLY_OPTIM_HD double norm_term(double x, double p) {
  const double a = x < 0 ? -x : x;
  if (p == 2.0) return x * x;
  if (p == 1.0 || p == std::numeric_limits<double>::infinity()) return a;
  if (p == 0.0) return x != 0 ? 1.0 : 0.0;
  return std::pow(a, p);
}

TALLY_OPTIM_HD double nan_max(double a, double b) {
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
}

// The total norm from the combined power sum: sum^(1/p) (p = inf or 0: the sum itself).
TALLY_OPTIM_HD double finish_norm(double s, double p) {
  if (p == 2.0) return std::sqrt(s);
  if (p == 1.0 || p == 0.0 || p == std::numeric_limits<double>::infinity()) return s;
  return std::pow(s, 1.0 / p);
}

// min(1, max_norm / (total + 1e-6)) in the element type, NaN propagating (torch.clamp(max=1)).
template <typename T>
TALLY_OPTIM_HD T clip_coef(T total, T max_norm) {
  const T c = max_norm / (total + T(1e-6));
  return c > T(1) ? T(1) : c;
}

// torch's _amp_update_scale_ (MultiTensorKernels::update_scale), one thread: float32 arithmetic
// as GradScaler::update()'s host rule, so both give the same scales.
TALLY_OPTIM_HD void update_scale(float* scale, int64_t* growth_tracker, const float* found_inf,
                                 float growth_factor, float backoff_factor,
                                 int64_t growth_interval) {
  if (*found_inf != 0.0f) {
    *scale = *scale * backoff_factor;
    *growth_tracker = 0;
    return;
  }
  const int64_t successful = *growth_tracker + 1;
  if (successful == growth_interval) {
    const float grown = *scale * growth_factor;
    if (std::isfinite(grown)) *scale = grown;
    *growth_tracker = 0;
  } else {
    *growth_tracker = successful;
  }
}

}  // namespace tally::optim::detail
