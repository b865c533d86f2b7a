// The window geometry of 2-D pooling, written once for the CPU reference (tensor/pool/cpu.cpp)
// and the CUDA kernels (tensor/pool/cuda.cu, in device code): PyTorch's window rules for the
// average and adaptive average poolings.
#pragma once

#include <cstdint>

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

}  // namespace tally::math
