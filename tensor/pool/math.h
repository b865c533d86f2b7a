// The window geometry of 2-D pooling, written once for the CPU reference (tensor/pool/cpu.cpp)
// and the CUDA kernels (tensor/pool/cuda.cu, in device code): PyTorch's window rules for the
// average and adaptive average poolings.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tensor/elementwise/math.h"
#include "tensor/pool/ops.h"

namespace tally::math {

// Window [start, end) of output cell i of an adaptive pool from `in` to `out` cells.
TALLY_HOST_DEVICE TALLY_FORCE_INLINE int64_t adaptive_start(int64_t i, int64_t out, int64_t in) {
  return (i * in) / out;
}
TALLY_HOST_DEVICE TALLY_FORCE_INLINE int64_t adaptive_end(int64_t i, int64_t out, int64_t in) {
  return ((i + 1) * in + out - 1) / out;
}

// An average window: its clipped bounds and divisor (PyTorch's avg_pool2d rules).
struct AvgWindow {
  int64_t h0, h1, w0, w1, divisor;
  TALLY_HOST_DEVICE bool empty() const { return h0 >= h1 || w0 >= w1; }
};

TALLY_HOST_DEVICE TALLY_FORCE_INLINE AvgWindow avg_window(int64_t oh, int64_t ow, int64_t H,
                                                          int64_t W, const ops::Pool2dParams& p) {
  int64_t h0 = oh * p.sH - p.pH, w0 = ow * p.sW - p.pW;
  int64_t h1 = min(h0 + p.kH, H + p.pH), w1 = min(w0 + p.kW, W + p.pW);
  const int64_t padded_size = (h1 - h0) * (w1 - w0);
  h0 = max(h0, int64_t{0}), w0 = max(w0, int64_t{0});
  h1 = min(h1, H), w1 = min(w1, W);
  const int64_t divisor =
      p.divisor > 0 ? p.divisor : (p.count_include_pad ? padded_size : (h1 - h0) * (w1 - w0));
  return {h0, h1, w0, w1, divisor};
}

// adaptive_avg_pool2d's window of output (oh, ow) over an H x W input pooled to OH x OW: never
// empty (H, W >= 1), its divisor the window's size.
TALLY_HOST_DEVICE TALLY_FORCE_INLINE AvgWindow adaptive_window(int64_t oh, int64_t ow, int64_t OH,
                                                               int64_t OW, int64_t H, int64_t W) {
  const int64_t h0 = adaptive_start(oh, OH, H), h1 = adaptive_end(oh, OH, H);
  const int64_t w0 = adaptive_start(ow, OW, W), w1 = adaptive_end(ow, OW, W);
  return {h0, h1, w0, w1, (h1 - h0) * (w1 - w0)};
}

// The output rows (or columns) of a max pool whose windows cover input row h: oh with
// oh * s - pad + kk * d == h for some kk in [0, k), 0 <= oh < OH. visit(oh) is called in
// ascending oh, the order the CPU's sums run in. The candidates lie between two divisions
// (a window starting at or before h, and reaching it), so a 3x3 stride-2 pool tries at most
// two rows. I: int64_t, or int32_t where every coordinate fits (fewer instructions on a GPU).
template <typename I, typename F>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE void covering_rows(I h, I OH, I k, I s, I pad, I d,
                                                        F&& visit) {
  const I top = h + pad;              // oh * s <= top: the window starts at or before h
  const I reach = top - (k - 1) * d;  // oh * s >= reach: the window reaches h
  const I lo = reach <= 0 ? I{0} : (reach + s - 1) / s;
  const I hi = min(top / s, OH - 1);
  for (I oh = lo; oh <= hi; ++oh)
    if (d == 1 || (top - oh * s) % d == 0) visit(oh);
}

// ---- interpolate (PyTorch's upsample kernels' source indices and weights)

// Output position o along one axis reads inputs i0 and i1 with weights l0 and l1 (nearest:
// i0 == i1, l0 = 1, l1 = 0).
template <typename I, typename A>
struct Tap {
  I i0, i1;
  A l0, l1;
};

// One axis of an interpolation in index type I (int32_t where every index fits) and
// accumulation type A (float; double for float64).
template <typename I, typename A>
struct InterpAxis {
  I in, out;
  A scale;        // linear: area_pixel_compute_scale
  float nearest;  // nearest: compute_scales_value<float>
  bool linear, align_corners;

  // PyTorch's source of output o: nearest_idx (exact at out == in and out == 2 in, else
  // floor(o * scale) in float), or area_pixel_compute_source_index clamped at 0 with
  // guard_index_and_lambda (the index at most in - 1, the weight in [0, 1]).
  TALLY_HOST_DEVICE TALLY_FORCE_INLINE Tap<I, A> tap(I o) const {
    if (!linear) {
      I s = out == in ? o : out == 2 * in ? o / 2 : static_cast<I>(static_cast<float>(o) * nearest);
      if (s > in - 1) s = in - 1;
      return {s, s, A(1), A(0)};
    }
    A src = align_corners ? scale * static_cast<A>(o)
                          : scale * (static_cast<A>(o) + static_cast<A>(0.5)) - static_cast<A>(0.5);
    if (src < A(0)) src = A(0);
    I i0 = static_cast<I>(src);  // floor: src >= 0
    if (i0 > in - 1) i0 = in - 1;
    A l1 = src - static_cast<A>(i0);
    l1 = l1 < A(0) ? A(0) : l1 > A(1) ? A(1) : l1;
    return {i0, i0 < in - 1 ? static_cast<I>(i0 + 1) : i0, A(1) - l1, l1};
  }
  // The weight output o gives input i (0 when o does not read i).
  TALLY_HOST_DEVICE TALLY_FORCE_INLINE A weight(I o, I i) const {
    const Tap<I, A> t = tap(o);
    return (t.i0 == i ? t.l0 : A(0)) + (t.i1 == i ? t.l1 : A(0));
  }
  // The outputs [lo, hi] that read input i (none when hi < lo): i0(o) and i1(o) never decrease
  // with o, so they are those with i1(o) >= i and i0(o) <= i. An estimate from the inverse of
  // the source formula, moved to the exact bounds with tap itself.
  TALLY_HOST_DEVICE TALLY_FORCE_INLINE void readers(I i, I& lo, I& hi) const {
    lo = 0;
    hi = out - 1;
    const A step = linear ? scale : static_cast<A>(out == in ? 1.0f : nearest);
    if (step > A(0) && (linear || (out != in && out != 2 * in))) {
      const A off = linear && !align_corners ? static_cast<A>(0.5) : A(0);
      const A first = (static_cast<A>(i) - (linear ? A(1) : A(0)) + off) / step - off;
      const A last = (static_cast<A>(i) + A(1) + off) / step - off - A(1);
      const A top = static_cast<A>(out - 1);
      lo = first <= A(0) ? I(0) : first >= top ? out - 1 : static_cast<I>(first);
      hi = last <= A(0) ? I(0) : last >= top ? out - 1 : static_cast<I>(last);
    } else if (out == in) {
      lo = hi = i;
    } else if (out == 2 * in) {
      lo = 2 * i;
      hi = 2 * i + 1;
    }
    while (lo > 0 && tap(lo - 1).i1 >= i) --lo;
    while (lo < out && tap(lo).i1 < i) ++lo;
    if (hi < lo) hi = lo < out ? lo : out - 1;
    while (hi + 1 < out && tap(hi + 1).i0 <= i) ++hi;
    while (hi >= lo && tap(hi).i0 > i) --hi;
  }
};

// The axes of an interpolation (unit axes in front for fewer than 3 spatial dims).
template <typename I, typename A>
struct InterpAxes {
  InterpAxis<I, A> a[3];
};

template <typename I, typename A>
InterpAxes<I, A> interp_axes(const ops::InterpParams& p) {
  InterpAxes<I, A> r{};
  for (int j = 0; j < 3; ++j) {
    A scale;
    if constexpr (std::is_same_v<A, double>)
      scale = p.linear_scale_d[j];
    else
      scale = p.linear_scale_f[j];
    r.a[j] = {
        static_cast<I>(p.in[j]), static_cast<I>(p.out[j]), scale, p.nearest_scale[j], p.linear,
        p.align_corners};
  }
  return r;
}

// One E for each axis (depth, height, width), and of(axis, index) for the axes a K-D
// interpolation has (`none` for the others).
template <typename E>
struct PerAxis {
  E d, h, w;
};
template <int K, typename E, typename I, typename A, typename Of>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE PerAxis<E> for_axes(const InterpAxes<I, A>& ax, I d, I h, I w,
                                                         const E& none, Of&& of) {
  return {K >= 3 ? of(ax.a[0], d) : none, K >= 2 ? of(ax.a[1], h) : none, of(ax.a[2], w)};
}

// Output (od, oh, ow)'s taps (unit taps for the axes it lacks): the same in every plane, so the
// CUDA kernel computes them once for all.
template <typename I, typename A>
using PointTaps = PerAxis<Tap<I, A>>;
template <int K, typename I, typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE PointTaps<I, A> interp_taps(const InterpAxes<I, A>& ax, I od,
                                                                 I oh, I ow) {
  return for_axes<K>(ax, od, oh, ow, Tap<I, A>{0, 0, A(1), A(0)},
                     [](const InterpAxis<I, A>& a, I o) { return a.tap(o); });
}

// The output at taps t of one plane: load(d, h, w) reads the plane's input in A. The linear
// modes nest as PyTorch's kernels do: depth of (height of (width)).
template <int K, typename I, typename A, typename Load>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A interp_point(const PointTaps<I, A>& t, bool linear,
                                                    Load&& load) {
  if (!linear) return load(t.d.i0, t.h.i0, t.w.i0);
  auto line = [&](I d, I h) { return t.w.l0 * load(d, h, t.w.i0) + t.w.l1 * load(d, h, t.w.i1); };
  if constexpr (K == 1) return line(0, 0);
  auto plane = [&](I d) { return t.h.l0 * line(d, t.h.i0) + t.h.l1 * line(d, t.h.i1); };
  if constexpr (K == 2) return plane(0);
  return t.d.l0 * plane(t.d.i0) + t.d.l1 * plane(t.d.i1);
}

#if defined(__CUDA_ARCH__)
#define TALLY_INTERP_UNROLL _Pragma("unroll")
#else
#define TALLY_INTERP_UNROLL
#endif

// The outputs [lo, hi] along one axis that read input i, and their weights when there are at
// most kReadersCached of them (else weight() computes each again).
inline constexpr int kReadersCached = 8;
template <typename I, typename A>
struct Readers {
  I i, lo, hi;
  bool cached;
  A w[kReadersCached];
  TALLY_HOST_DEVICE TALLY_FORCE_INLINE A weight(const InterpAxis<I, A>& ax, I o) const {
    return cached ? w[o - lo] : ax.weight(o, i);
  }
};
template <typename I, typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE Readers<I, A> readers_of(const InterpAxis<I, A>& ax, I i) {
  Readers<I, A> r;
  r.i = i;
  ax.readers(i, r.lo, r.hi);
  r.cached = r.hi - r.lo < kReadersCached;
  if (r.cached)
    for (I o = r.lo; o <= r.hi; ++o) r.w[o - r.lo] = ax.weight(o, i);
  return r;
}

// Input (id, ih, iw)'s readers along its K axes: the same in every plane.
template <typename I, typename A>
using GatherPlan = PerAxis<Readers<I, A>>;
template <int K, typename I, typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE GatherPlan<I, A> interp_plan(const InterpAxes<I, A>& ax, I id,
                                                                  I ih, I iw) {
  return for_axes<K>(ax, id, ih, iw, Readers<I, A>{},
                     [](const InterpAxis<I, A>& a, I i) { return readers_of(a, i); });
}

// One plane's gradient at the input of plan p: the sum over the outputs that read it (depth,
// then height, then width ascending) of their gradient, g(d, h, w) in A, times the weight each
// gave it.
template <int K, typename I, typename A, typename Grad>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A interp_gather(const InterpAxes<I, A>& ax,
                                                     const GatherPlan<I, A>& p, Grad&& g) {
  auto row = [&](I od, I oh) {
    A s = 0;
    if (p.w.cached) {
      // A fixed trip count, unrolled on the device, keeps the width weights in registers.
      const I n = p.w.hi - p.w.lo + 1;
      TALLY_INTERP_UNROLL
      for (int j = 0; j < kReadersCached; ++j)
        if (j < n) s += p.w.w[j] * g(od, oh, p.w.lo + j);
      return s;
    }
    for (I ow = p.w.lo; ow <= p.w.hi; ++ow) s += ax.a[2].weight(ow, p.w.i) * g(od, oh, ow);
    return s;
  };
  if constexpr (K == 1) return row(0, 0);
  auto plane = [&](I od) {
    A s = 0;
    for (I oh = p.h.lo; oh <= p.h.hi; ++oh) s += p.h.weight(ax.a[1], oh) * row(od, oh);
    return s;
  };
  if constexpr (K == 2) return plane(0);
  A s = 0;
  for (I od = p.d.lo; od <= p.d.hi; ++od) s += p.d.weight(ax.a[0], od) * plane(od);
  return s;
}

}  // namespace tally::math
