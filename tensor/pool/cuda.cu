// CUDA 2-D pooling: one thread per output element for the forward kernels, one thread per
// input element for the backward kernels (a gather over the windows that cover it, visited in
// the CPU's order, so the sums round exactly as the CPU's do; max_pool2d's backward takes a
// stride cell of elements a thread where its windows allow). Window rules, divisors, tie and NaN
// handling are the CPU kernels' (tensor/pool/cpu.cpp), line for line. max_pool2d and
// adaptive_avg_pool2d have channels_last (NHWC) twins: the same windows, orders and indices over
// channels_last tensors, a thread an element in memory order. interpolate: a thread a spatial
// position of the output (forward) or of the input (its gathering backward), over many planes.
#include <algorithm>

#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/fast_div.h"
#include "tensor/cuda/grid.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/pool/kernels.h"
#include "tensor/pool/math.h"

namespace tally::cuda {

namespace {

#define TALLY_GRID_LOOP(i, n)                                                            \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

using math::adaptive_end;
using math::adaptive_start;
using math::avg_window;
using math::AvgWindow;

// A grid-stride loop in index type I (int32_t where every index fits): this thread's first
// index and the stride.
template <typename I>
__device__ __forceinline__ I grid_start() {
  return static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.x) + static_cast<I>(threadIdx.x);
}
template <typename I>
__device__ __forceinline__ I grid_step() {
  return static_cast<I>(gridDim.x) * static_cast<I>(blockDim.x);
}

// Flat index i of a channels_last [B, Y, X, C] tensor as its coordinates.
template <typename I>
struct NhwcAt {
  I b, y, x, c;
};
template <typename I>
__device__ __forceinline__ NhwcAt<I> nhwc_at(I i, I C, I X, I Y) {
  const I c = i % C, rest = i / C;
  const I x = rest % X, rest2 = rest / X;
  return {rest2 / Y, rest2 % Y, x, c};
}

// ------------------------------------------------------------------ kernels

// A max-pooling window's geometry in index type I (int64_t, or int32_t when every index fits).
template <typename I>
struct MaxWindow {
  I H, W, kH, kW, sH, sW, pH, pW, dH, dW;
};

// Output cell (oh, ow) of plane `xp`: the window's largest value and its flat index in the plane.
// es: the distance between two positions of the plane in memory (1, or C for channels_last).
template <typename T, typename I>
__device__ __forceinline__ void max_of_window(const T* __restrict__ xp, I oh, I ow,
                                              const MaxWindow<I>& g, T& y, int64_t& idx, I es = 1) {
  using A = dacc_t<T>;
  I h0 = oh * g.sH - g.pH;
  const I h1 = min(h0 + (g.kH - 1) * g.dH + 1, g.H);
  while (h0 < 0) h0 += g.dH;
  I w0 = ow * g.sW - g.pW;
  const I w1 = min(w0 + (g.kW - 1) * g.dW + 1, g.W);
  while (w0 < 0) w0 += g.dW;
  I best = h0 * g.W + w0;
  A best_v = -static_cast<A>(INFINITY);
  for (I h = h0; h < h1; h += g.dH)
    for (I w = w0; w < w1; w += g.dW) {
      const A v = load(xp[(h * g.W + w) * es]);
      if (v > best_v || v != v) {  // NaN propagates (as PyTorch: the last one)
        best_v = v;
        best = h * g.W + w;
      }
    }
  y = store<T>(best_v);
  idx = best;
}

template <typename T>
__global__ void max_pool_forward_kernel(const T* __restrict__ x, T* __restrict__ y,
                                        int64_t* __restrict__ idx, Planes g, ops::Pool2dParams p,
                                        int64_t n) {
  const MaxWindow<int64_t> win{g.H, g.W, p.kH, p.kW, p.sH, p.sW, p.pH, p.pW, p.dH, p.dW};
  TALLY_GRID_LOOP(o, n) {
    const int64_t ow = o % g.OW, oh = (o / g.OW) % g.OH, pl = o / (g.OW * g.OH);
    max_of_window(x + pl * g.H * g.W, oh, ow, win, y[o], idx[o]);
  }
}

// The same forward in 32-bit index arithmetic, for tensors whose every flat index fits in 31
// bits (all of ResNet's): the flat output index splits into (plane, oh, ow) through two
// multiply-high divisions instead of three 64-bit divisions, which held the 64-bit kernel's
// [64,64,112,112] call at 0.237 ms against PyTorch's 0.210 on the H200.
struct Planes32 {
  FastDiv by_ow, by_oh;
  MaxWindow<int32_t> win;
};

template <typename T>
__global__ void max_pool_forward_kernel32(const T* __restrict__ x, T* __restrict__ y,
                                          int64_t* __restrict__ idx, Planes32 g, uint32_t n) {
  for (uint32_t o = blockIdx.x * blockDim.x + threadIdx.x; o < n; o += gridDim.x * blockDim.x) {
    uint32_t rest, ow, pl, oh;
    g.by_ow.divmod(o, rest, ow);
    g.by_oh.divmod(rest, pl, oh);
    max_of_window(x + pl * static_cast<uint32_t>(g.win.H * g.win.W), static_cast<int32_t>(oh),
                  static_cast<int32_t>(ow), g.win, y[o], idx[o]);
  }
}

// Whether max_pool_forward_kernel32 applies: every flat index of input and output, and every
// window coordinate, below 2^31.
bool fits_32(const Tensor& input, const Tensor& out, const ops::Pool2dParams& p) {
  constexpr int64_t kMax = FastDiv::kMaxNumerator;
  const int64_t params[] = {p.kH, p.kW, p.sH, p.sW, p.pH, p.pW, p.dH, p.dW};
  for (int64_t v : params)
    if (v < 0 || v > (int64_t{1} << 15)) return false;
  // the largest row/column a window reaches, with its padding
  const int64_t reach_h = (out.size(2) - 1) * p.sH + (p.kH - 1) * p.dH + 1 + p.pH;
  const int64_t reach_w = (out.size(3) - 1) * p.sW + (p.kW - 1) * p.dW + 1 + p.pW;
  return input.numel() <= kMax && out.numel() <= kMax &&
         reach_h * input.size(3) + reach_w <= kMax && out.size(2) >= 1 && out.size(3) >= 1;
}

Planes32 planes32_of(const Tensor& input, const Tensor& out, const ops::Pool2dParams& p) {
  auto i32 = [](int64_t v) { return static_cast<int32_t>(v); };
  return {FastDiv(out.size(3)),
          FastDiv(out.size(2)),
          {i32(input.size(2)), i32(input.size(3)), i32(p.kH), i32(p.kW), i32(p.sH), i32(p.sW),
           i32(p.pH), i32(p.pW), i32(p.dH), i32(p.dW)}};
}

// One thread per input element: the sum, in the CPU's output order, of grad_output over the
// windows that cover the element and chose it. I: the index arithmetic, int32_t where every
// flat index and coordinate fits (max_pool_backward_fits_32), else int64_t.
template <typename T, typename I>
__global__ void max_pool_backward_kernel(T* __restrict__ gx, const T* __restrict__ gy,
                                         const int64_t* __restrict__ idx, Planes g,
                                         ops::Pool2dParams p, I n) {
  const I W = static_cast<I>(g.W), H = static_cast<I>(g.H), OH = static_cast<I>(g.OH),
          OW = static_cast<I>(g.OW);
  const I kH = static_cast<I>(p.kH), kW = static_cast<I>(p.kW), sH = static_cast<I>(p.sH),
          sW = static_cast<I>(p.sW), pH = static_cast<I>(p.pH), pW = static_cast<I>(p.pW),
          dH = static_cast<I>(p.dH), dW = static_cast<I>(p.dW);
  for (I i = grid_start<I>(); i < n; i += grid_step<I>()) {
    const I row = i / W, w = i - row * W, pl = row / H, h = row - pl * H;
    const I base = pl * OH * OW;
    const int64_t self = static_cast<int64_t>(h) * g.W + w;
    dacc_t<T> s = 0;
    math::covering_rows<I>(h, OH, kH, sH, pH, dH, [&](I oh) {
      math::covering_rows<I>(w, OW, kW, sW, pW, dW, [&](I ow) {
        const I o = base + oh * OW + ow;
        if (idx[o] == self) s += load(gy[o]);
      });
    });
    gx[i] = store<T>(s);
  }
}

// The same gather a cell of sH x sW input elements a thread (undilated windows, strides up to
// 4, 32-bit indices): the windows that can cover the cell are found once (a 3x3 stride-2 pool's
// cell of 2 x 2 has 4) and each window's argmax is compared with the cell's elements, so a
// window's index and gradient are read once a cell, not once an element, and no element needs
// a division. Each element still sums its windows in (oh, ow) order: the same sums as the CPU.
struct Cells32 {
  FastDiv by_cw, by_ch;  // cells a row, cell rows a plane
  int32_t H, W, OH, OW, kH, kW, sH, sW, pH, pW;
};
constexpr int kMaxCell = 4;

// One cell's gather, in either layout (G: Cells32 or CellsNhwc32): the cell at cell row ch,
// column cw of its plane sums, per element, the gradients gy[at(oh * OW + ow)] of the windows
// (oh, ow) whose argmax idx[...] (the position in the plane) is that element, in (oh, ow)
// order, and stores each through put(position in the plane, value). S: the cell's side bound
// at compile time (sH, sW <= S), so a 2 x 2 cell compares 4 positions a window, not 16.
template <typename T, int S, typename G, typename At, typename Put>
__device__ __forceinline__ void gather_cell(const G& g, uint32_t ch, uint32_t cw,
                                            const T* __restrict__ gy,
                                            const int64_t* __restrict__ idx, At at, Put put) {
  const int32_t h0 = static_cast<int32_t>(ch) * g.sH, w0 = static_cast<int32_t>(cw) * g.sW;
  const int32_t nh = min(g.sH, g.H - h0), nw = min(g.sW, g.W - w0);
  // Window oh covers row h when oh * sH <= h + pH and oh * sH >= h + pH - (kH - 1).
  const int32_t rh = h0 + g.pH - (g.kH - 1), rw = w0 + g.pW - (g.kW - 1);
  const int32_t oh0 = rh <= 0 ? 0 : (rh + g.sH - 1) / g.sH;
  const int32_t oh1 = min((h0 + nh - 1 + g.pH) / g.sH, g.OH - 1);
  const int32_t ow0 = rw <= 0 ? 0 : (rw + g.sW - 1) / g.sW;
  const int32_t ow1 = min((w0 + nw - 1 + g.pW) / g.sW, g.OW - 1);
  const int64_t corner = static_cast<int64_t>(h0) * g.W + w0;  // in the plane
  dacc_t<T> acc[S][S];
#pragma unroll
  for (int a = 0; a < S; ++a)
#pragma unroll
    for (int b = 0; b < S; ++b) acc[a][b] = 0;
  for (int32_t oh = oh0; oh <= oh1; ++oh)
    for (int32_t ow = ow0; ow <= ow1; ++ow) {
      const uint32_t o = at(static_cast<uint32_t>(oh * g.OW + ow));
      const int64_t j = idx[o] - corner;
      const dacc_t<T> v = load(gy[o]);
#pragma unroll
      for (int a = 0; a < S; ++a)
#pragma unroll
        for (int b = 0; b < S; ++b)
          if (a < nh && b < nw && j == static_cast<int64_t>(a) * g.W + b) acc[a][b] += v;
    }
#pragma unroll
  for (int a = 0; a < S; ++a)
#pragma unroll
    for (int b = 0; b < S; ++b)
      if (a < nh && b < nw) put(corner + static_cast<int64_t>(a) * g.W + b, store<T>(acc[a][b]));
}

template <typename T, int S>
__global__ void max_pool_backward_cells_kernel(T* __restrict__ gx, const T* __restrict__ gy,
                                               const int64_t* __restrict__ idx, Cells32 g,
                                               uint32_t n) {
  for (uint32_t c = blockIdx.x * blockDim.x + threadIdx.x; c < n; c += gridDim.x * blockDim.x) {
    uint32_t rest, cw, pl, ch;
    g.by_cw.divmod(c, rest, cw);
    g.by_ch.divmod(rest, pl, ch);
    const uint32_t plane_out = pl * static_cast<uint32_t>(g.OH * g.OW);
    T* out = gx + static_cast<size_t>(pl) * static_cast<uint32_t>(g.H * g.W);
    gather_cell<T, S>(
        g, ch, cw, gy, idx, [&](uint32_t w) { return plane_out + w; },
        [&](int64_t pos, T v) { out[pos] = v; });
  }
}

// The cells gather in channels_last: a thread a (sample, cell, channel), consecutive threads
// consecutive channels (their indices, gradients and results adjacent in memory); the same
// windows, comparisons and (oh, ow) order as max_pool_backward_cells_kernel.
struct CellsNhwc32 {
  FastDiv by_c, by_cw, by_ch;  // channels, cells a row, cell rows a plane
  int32_t C, H, W, OH, OW, kH, kW, sH, sW, pH, pW;
};

template <typename T, int S>
__global__ void max_pool_backward_cells_nhwc_kernel(T* __restrict__ gx, const T* __restrict__ gy,
                                                    const int64_t* __restrict__ idx, CellsNhwc32 g,
                                                    uint32_t n) {
  for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x) {
    uint32_t r1, c, r2, cw, b, ch;
    g.by_c.divmod(t, r1, c);
    g.by_cw.divmod(r1, r2, cw);
    g.by_ch.divmod(r2, b, ch);
    const uint32_t C = static_cast<uint32_t>(g.C);
    const uint32_t sample_out = b * static_cast<uint32_t>(g.OH * g.OW);
    T* out = gx + static_cast<size_t>(b) * static_cast<uint32_t>(g.H * g.W) * C + c;
    gather_cell<T, S>(
        g, ch, cw, gy, idx, [&](uint32_t w) { return (sample_out + w) * C + c; },
        [&](int64_t pos, T v) { out[static_cast<size_t>(pos) * C] = v; });
  }
}

// Whether max_pool_backward_cells_kernel applies: no dilation, strides of 1 to kMaxCell, every
// flat index of input, output and cells below 2^31.
bool max_pool_backward_cells_fit(const Tensor& grad_input, const Tensor& grad_output,
                                 const ops::Pool2dParams& p) {
  constexpr int64_t kMax = FastDiv::kMaxNumerator;
  if (p.dH != 1 || p.dW != 1 || p.sH < 1 || p.sW < 1 || p.sH > kMaxCell || p.sW > kMaxCell)
    return false;
  const int64_t params[] = {p.kH, p.kW, p.pH, p.pW};
  for (int64_t v : params)
    if (v < 0 || v > (int64_t{1} << 15)) return false;
  return grad_input.numel() <= kMax && grad_output.numel() <= kMax &&
         grad_input.size(2) + p.pH + p.kH <= kMax && grad_input.size(3) + p.pW + p.kW <= kMax &&
         grad_output.size(2) >= 1 && grad_output.size(3) >= 1;
}

// go(std::integral_constant<int, S>{}) with S the cells kernels' cell side for pool p: 1, 2,
// or kMaxCell for strides of 3 and 4 (max_pool_backward_cells_fit holds).
template <typename F>
void with_cell_side(const ops::Pool2dParams& p, F&& go) {
  const int64_t side = std::max(p.sH, p.sW);
  if (side == 1)
    go(std::integral_constant<int, 1>{});
  else if (side == 2)
    go(std::integral_constant<int, 2>{});
  else
    go(std::integral_constant<int, kMaxCell>{});
}

Cells32 cells32_of(const Tensor& grad_input, const Tensor& grad_output,
                   const ops::Pool2dParams& p) {
  auto i32 = [](int64_t v) { return static_cast<int32_t>(v); };
  const int64_t CH = (grad_input.size(2) + p.sH - 1) / p.sH,
                CW = (grad_input.size(3) + p.sW - 1) / p.sW;
  return {FastDiv(CW),
          FastDiv(CH),
          i32(grad_input.size(2)),
          i32(grad_input.size(3)),
          i32(grad_output.size(2)),
          i32(grad_output.size(3)),
          i32(p.kH),
          i32(p.kW),
          i32(p.sH),
          i32(p.sW),
          i32(p.pH),
          i32(p.pW)};
}

// Whether max_pool_backward_kernel's int32_t arithmetic holds: every flat index of the input
// and the output, and every padded coordinate, below 2^30 (the grid-stride step added to an
// index stays below 2^31).
bool max_pool_backward_fits_32(const Tensor& grad_input, const Tensor& grad_output,
                               const ops::Pool2dParams& p) {
  constexpr int64_t kMax = int64_t{1} << 30;
  const int64_t params[] = {p.kH, p.kW, p.sH, p.sW, p.pH, p.pW, p.dH, p.dW};
  for (int64_t v : params)
    if (v < 0 || v > (int64_t{1} << 15)) return false;
  return grad_input.numel() <= kMax && grad_output.numel() <= kMax &&
         grad_input.size(2) + p.pH <= kMax && grad_input.size(3) + p.pW <= kMax;
}

template <typename T>
__global__ void avg_pool_forward_kernel(const T* __restrict__ x, T* __restrict__ y, Planes g,
                                        ops::Pool2dParams p, int64_t n) {
  using A = dacc_t<T>;
  TALLY_GRID_LOOP(o, n) {
    const int64_t ow = o % g.OW, oh = (o / g.OW) % g.OH, pl = o / (g.OW * g.OH);
    const T* xp = x + pl * g.H * g.W;
    const AvgWindow win = avg_window(oh, ow, g.H, g.W, p);
    A s = 0;
    if (!win.empty()) {
      for (int64_t h = win.h0; h < win.h1; ++h)
        for (int64_t w = win.w0; w < win.w1; ++w) s += load(xp[h * g.W + w]);
      s /= static_cast<A>(win.divisor);
    }
    y[o] = store<T>(s);
  }
}

// One thread per input element: the sum, in the CPU's (oh, ow) order, of the gradient
// shares of every window that covers it.
template <typename T>
__global__ void avg_pool_backward_kernel(dacc_t<T>* __restrict__ gx, const T* __restrict__ gy,
                                         Planes g, ops::Pool2dParams p, int64_t n) {
  using A = dacc_t<T>;
  TALLY_GRID_LOOP(i, n) {
    const int64_t w = i % g.W, h = (i / g.W) % g.H, pl = i / (g.W * g.H);
    const T* gp = gy + pl * g.OH * g.OW;
    // Windows start at oh * sH - pH and span kH rows: those with start <= h < start + kH.
    const int64_t oh0 = h + p.pH < p.kH ? 0 : (h + p.pH - p.kH) / p.sH + 1;
    const int64_t oh1 = min((h + p.pH) / p.sH + 1, g.OH);
    const int64_t ow0 = w + p.pW < p.kW ? 0 : (w + p.pW - p.kW) / p.sW + 1;
    const int64_t ow1 = min((w + p.pW) / p.sW + 1, g.OW);
    A s = 0;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        const AvgWindow win = avg_window(oh, ow, g.H, g.W, p);
        if (win.empty() || h < win.h0 || h >= win.h1 || w < win.w0 || w >= win.w1) continue;
        s += load(gp[oh * g.OW + ow]) / static_cast<A>(win.divisor);
      }
    gx[i] = s;
  }
}

// ---- channels_last (NHWC) twins: element (n, c, h, w) at ((n * H + h) * W + w) * C + c; a
// thread an element in memory order (consecutive threads, consecutive channels: coalesced),
// the same windows, orders and indices (h * W + w) as the NCHW kernels. I: int32_t when every
// flat index fits, else int64_t.

template <typename I>
struct Nhwc {
  I C, H, W, OH, OW;
};

template <typename T, typename I>
__global__ void max_pool_forward_nhwc_kernel(const T* __restrict__ x, T* __restrict__ y,
                                             int64_t* __restrict__ idx, Nhwc<I> g, MaxWindow<I> win,
                                             I n) {
  for (I o = grid_start<I>(); o < n; o += grid_step<I>()) {
    const NhwcAt<I> at = nhwc_at<I>(o, g.C, g.OW, g.OH);
    const I c = at.c;
    const I ow = at.x, oh = at.y, b = at.b;
    max_of_window(x + b * g.H * g.W * g.C + c, oh, ow, win, y[o], idx[o], g.C);
  }
}

// The per-element gather of max_pool_backward_kernel in NHWC.
template <typename T, typename I>
__global__ void max_pool_backward_nhwc_kernel(T* __restrict__ gx, const T* __restrict__ gy,
                                              const int64_t* __restrict__ idx, Nhwc<I> g,
                                              MaxWindow<I> win, I n) {
  for (I i = grid_start<I>(); i < n; i += grid_step<I>()) {
    const NhwcAt<I> at = nhwc_at<I>(i, g.C, g.W, g.H);
    const I c = at.c;
    const I w = at.x, h = at.y, b = at.b;
    const I base = b * g.OH * g.OW;
    const int64_t self = static_cast<int64_t>(h) * g.W + w;
    dacc_t<T> s = 0;
    math::covering_rows<I>(h, g.OH, win.kH, win.sH, win.pH, win.dH, [&](I oh) {
      math::covering_rows<I>(w, g.OW, win.kW, win.sW, win.pW, win.dW, [&](I ow) {
        const I o = (base + oh * g.OW + ow) * g.C + c;
        if (idx[o] == self) s += load(gy[o]);
      });
    });
    gx[i] = store<T>(s);
  }
}

template <typename T, typename I>
__global__ void adaptive_forward_nhwc_kernel(const T* __restrict__ x, T* __restrict__ y, Nhwc<I> g,
                                             I n) {
  using A = dacc_t<T>;
  for (I o = grid_start<I>(); o < n; o += grid_step<I>()) {
    const NhwcAt<I> at = nhwc_at<I>(o, g.C, g.OW, g.OH);
    const I c = at.c;
    const I ow = at.x, oh = at.y, b = at.b;
    const T* xp = x + b * g.H * g.W * g.C + c;
    const int64_t h0 = adaptive_start(oh, g.OH, g.H), h1 = adaptive_end(oh, g.OH, g.H);
    const int64_t w0 = adaptive_start(ow, g.OW, g.W), w1 = adaptive_end(ow, g.OW, g.W);
    A s = 0;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t w = w0; w < w1; ++w) s += load(xp[(h * g.W + w) * g.C]);
    y[o] = store<T>(s / static_cast<A>((h1 - h0) * (w1 - w0)));
  }
}

// adaptive_avg_pool2d's gradient at input element (h, w) of a plane: the sum, in (oh, ow)
// order, of the gradients grad(oh * OW + ow) (as dacc_t) of the cells whose window holds it,
// each divided by its window's area.
template <typename G>
__device__ __forceinline__ auto adaptive_gather(int64_t h, int64_t w, int64_t H, int64_t W,
                                                int64_t OH, int64_t OW, G grad) {
  using A = decltype(grad(int64_t{0}));
  // Cells whose window [start, end) holds h: start(oh) <= h  <=>  oh < (h + 1) * OH / H,
  // end(oh) > h  <=>  oh >= floor(h * OH / H). Checked again below.
  const int64_t oh0 = (h * OH) / H, oh1 = min(((h + 1) * OH + H - 1) / H, OH);
  const int64_t ow0 = (w * OW) / W, ow1 = min(((w + 1) * OW + W - 1) / W, OW);
  A s = 0;
  for (int64_t oh = oh0; oh < oh1; ++oh) {
    const int64_t h0 = adaptive_start(oh, OH, H), h1 = adaptive_end(oh, OH, H);
    if (h < h0 || h >= h1) continue;
    for (int64_t ow = ow0; ow < ow1; ++ow) {
      const int64_t w0 = adaptive_start(ow, OW, W), w1 = adaptive_end(ow, OW, W);
      if (w < w0 || w >= w1) continue;
      s += grad(oh * OW + ow) / static_cast<A>((h1 - h0) * (w1 - w0));
    }
  }
  return s;
}

template <typename T, typename I>
__global__ void adaptive_backward_nhwc_kernel(dacc_t<T>* __restrict__ gx, const T* __restrict__ gy,
                                              Nhwc<I> g, I n) {
  for (I i = grid_start<I>(); i < n; i += grid_step<I>()) {
    const NhwcAt<I> at = nhwc_at<I>(i, g.C, g.W, g.H);
    const I c = at.c;
    const int64_t w = at.x, h = at.y, b = at.b;
    const T* gp = gy + b * g.OH * g.OW * g.C + c;
    gx[i] = adaptive_gather(h, w, g.H, g.W, g.OH, g.OW,
                            [&](int64_t cell) { return load(gp[cell * g.C]); });
  }
}

template <typename T>
__global__ void adaptive_forward_kernel(const T* __restrict__ x, T* __restrict__ y, Planes g,
                                        int64_t n) {
  using A = dacc_t<T>;
  TALLY_GRID_LOOP(o, n) {
    const int64_t ow = o % g.OW, oh = (o / g.OW) % g.OH, pl = o / (g.OW * g.OH);
    const T* xp = x + pl * g.H * g.W;
    const int64_t h0 = adaptive_start(oh, g.OH, g.H), h1 = adaptive_end(oh, g.OH, g.H);
    const int64_t w0 = adaptive_start(ow, g.OW, g.W), w1 = adaptive_end(ow, g.OW, g.W);
    A s = 0;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t w = w0; w < w1; ++w) s += load(xp[h * g.W + w]);
    y[o] = store<T>(s / static_cast<A>((h1 - h0) * (w1 - w0)));
  }
}

template <typename T>
__global__ void adaptive_backward_kernel(dacc_t<T>* __restrict__ gx, const T* __restrict__ gy,
                                         Planes g, int64_t n) {
  TALLY_GRID_LOOP(i, n) {
    const int64_t w = i % g.W, h = (i / g.W) % g.H, pl = i / (g.W * g.H);
    const T* gp = gy + pl * g.OH * g.OW;
    gx[i] =
        adaptive_gather(h, w, g.H, g.W, g.OH, g.OW, [&](int64_t cell) { return load(gp[cell]); });
  }
}

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// The launch of one pooling kernel on Tally's stream for `t`'s device.
struct Launch {
  explicit Launch(const char* name, const Tensor& t)
      : name_(name), range_(name), guard_(t.device().index), stream_(stream(t.device().index)) {}
  const char* name_;
  NvtxRange range_;
  DeviceGuard guard_;
  cudaStream_t stream_;
};

// The dtype of a backward kernel's gradient must be acc_t of grad_output's.
void check_grad_dtype(const char* op, const Tensor& grad_input, const Tensor& grad_output) {
  const DType want = grad_output.dtype() == DType::float64 ? DType::float64 : DType::float32;
  if (grad_input.dtype() != want)
    throw std::invalid_argument(std::string(op) + ": grad_input must be " + dtype_name(want) +
                                " for a " + dtype_name(grad_output.dtype()) + " grad_output, got " +
                                dtype_name(grad_input.dtype()));
}

// Whether a pooling kernel's tensor is channels_last (the NHWC kernels run).
bool nhwc(const Tensor& t) {
  return t.suggest_memory_format() == MemoryFormat::channels_last;
}

// go(Nhwc<I>, MaxWindow<I>, I n) with I = int32_t when every flat index of `in` and `out` (and
// a window's reach) fits in 31 bits, else int64_t.
template <typename F>
void with_nhwc(const Tensor& in, const Tensor& out, const ops::Pool2dParams& p, F&& go) {
  const int64_t reach_h = (out.size(2) - 1) * p.sH + (p.kH - 1) * p.dH + 1 + p.pH;
  const int64_t reach_w = (out.size(3) - 1) * p.sW + (p.kW - 1) * p.dW + 1 + p.pW;
  const int64_t most =
      std::max({in.numel(), out.numel(), (reach_h * in.size(3) + reach_w) * in.size(1)});
  auto run = [&]<typename I>() {
    auto i = [](int64_t v) { return static_cast<I>(v); };
    go(Nhwc<I>{i(in.size(1)), i(in.size(2)), i(in.size(3)), i(out.size(2)), i(out.size(3))},
       MaxWindow<I>{i(in.size(2)), i(in.size(3)), i(p.kH), i(p.kW), i(p.sH), i(p.sW), i(p.pH),
                    i(p.pW), i(p.dH), i(p.dW)});
  };
  if (most < (int64_t{1} << 31))
    run.template operator()<int32_t>();
  else
    run.template operator()<int64_t>();
}

void max_pool2d_forward(const Tensor& out, const Tensor& indices, const Tensor& input,
                        const ops::Pool2dParams& p) {
  const Planes g = planes_of(input, out);
  const int64_t n = out.numel();
  if (n == 0) return;
  if (nhwc(input)) {
    Launch l("max_pool2d (CUDA, channels_last)", input);
    TALLY_DISPATCH_FLOAT(input.dtype(), "max_pool2d", [&] {
      using T = dev_t<scalar_t>;
      with_nhwc(input, out, p, [&]<typename I>(Nhwc<I> d, MaxWindow<I> win) {
        max_pool_forward_nhwc_kernel<T, I><<<blocks_for(n), kThreads, 0, l.stream_>>>(
            ptr<const T>(input), ptr<T>(out), ptr<int64_t>(indices), d, win, static_cast<I>(n));
      });
    });
    check_launch(l.name_);
    return;
  }
  const bool use32 = fits_32(input, out, p);
  Launch l("max_pool2d (CUDA)", input);
  TALLY_DISPATCH_FLOAT(input.dtype(), "max_pool2d", [&] {
    using T = dev_t<scalar_t>;
    if (use32)
      max_pool_forward_kernel32<T><<<blocks_for(n), kThreads, 0, l.stream_>>>(
          ptr<const T>(input), ptr<T>(out), ptr<int64_t>(indices), planes32_of(input, out, p),
          static_cast<uint32_t>(n));
    else
      max_pool_forward_kernel<T><<<blocks_for(n), kThreads, 0, l.stream_>>>(
          ptr<const T>(input), ptr<T>(out), ptr<int64_t>(indices), g, p, n);
  });
  check_launch(l.name_);
}

void max_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output, const Tensor& indices,
                         const ops::Pool2dParams& p) {
  const Planes g = planes_of(grad_input, grad_output);
  const int64_t n = grad_input.numel();
  if (n == 0) return;
  Launch l("max_pool2d_backward (CUDA)", grad_output);
  if (grad_output.numel() == 0) {
    check(cudaMemsetAsync(grad_input.data_ptr(), 0, grad_input.nbytes(), l.stream_),
          "max_pool2d_backward (zero)");
    return;
  }
  if (nhwc(grad_input) && max_pool_backward_cells_fit(grad_input, grad_output, p)) {
    // The cells gather (ResNet's 3x3 stride-2 pool: 4 elements a thread).
    auto i32 = [](int64_t v) { return static_cast<int32_t>(v); };
    const int64_t CH = (g.H + p.sH - 1) / p.sH, CW = (g.W + p.sW - 1) / p.sW;
    const int64_t C = grad_input.size(1), nthreads = grad_input.size(0) * CH * CW * C;
    const CellsNhwc32 cg{FastDiv(C), FastDiv(CW), FastDiv(CH), i32(C),    i32(g.H),
                         i32(g.W),   i32(g.OH),   i32(g.OW),   i32(p.kH), i32(p.kW),
                         i32(p.sH),  i32(p.sW),   i32(p.pH),   i32(p.pW)};
    TALLY_DISPATCH_FLOAT(grad_output.dtype(), "max_pool2d_backward", [&] {
      using T = dev_t<scalar_t>;
      with_cell_side(p, [&](auto side) {
        max_pool_backward_cells_nhwc_kernel<T, decltype(side)::value>
            <<<blocks_for(nthreads), kThreads, 0, l.stream_>>>(
                ptr<T>(grad_input), ptr<const T>(grad_output), ptr<const int64_t>(indices), cg,
                static_cast<uint32_t>(nthreads));
      });
    });
    check_launch(l.name_);
    return;
  }
  if (nhwc(grad_input)) {
    TALLY_DISPATCH_FLOAT(grad_output.dtype(), "max_pool2d_backward", [&] {
      using T = dev_t<scalar_t>;
      with_nhwc(grad_input, grad_output, p, [&]<typename I>(Nhwc<I> d, MaxWindow<I> win) {
        max_pool_backward_nhwc_kernel<T, I><<<blocks_for(n), kThreads, 0, l.stream_>>>(
            ptr<T>(grad_input), ptr<const T>(grad_output), ptr<const int64_t>(indices), d, win,
            static_cast<I>(n));
      });
    });
    check_launch(l.name_);
    return;
  }
  const bool use32 = max_pool_backward_fits_32(grad_input, grad_output, p);
  const bool cells = max_pool_backward_cells_fit(grad_input, grad_output, p);
  TALLY_DISPATCH_FLOAT(grad_output.dtype(), "max_pool2d_backward", [&] {
    using T = dev_t<scalar_t>;
    if (cells) {
      const Cells32 c = cells32_of(grad_input, grad_output, p);
      const int64_t ncells = g.planes * ((g.H + p.sH - 1) / p.sH) * ((g.W + p.sW - 1) / p.sW);
      with_cell_side(p, [&](auto side) {
        max_pool_backward_cells_kernel<T, decltype(side)::value>
            <<<blocks_for(ncells), kThreads, 0, l.stream_>>>(
                ptr<T>(grad_input), ptr<const T>(grad_output), ptr<const int64_t>(indices), c,
                static_cast<uint32_t>(ncells));
      });
    } else if (use32)
      max_pool_backward_kernel<T, int32_t><<<blocks_for(n), kThreads, 0, l.stream_>>>(
          ptr<T>(grad_input), ptr<const T>(grad_output), ptr<const int64_t>(indices), g, p,
          static_cast<int32_t>(n));
    else
      max_pool_backward_kernel<T, int64_t><<<blocks_for(n), kThreads, 0, l.stream_>>>(
          ptr<T>(grad_input), ptr<const T>(grad_output), ptr<const int64_t>(indices), g, p, n);
  });
  check_launch(l.name_);
}

// The average poolings' launches (avg_pool2d, adaptive_avg_pool2d) over n threads: one an
// output element forward, one a grad_input element backward (each writes its element whole,
// so grad_input needs no zeroing). launch.template operator()<T>(n, stream) enqueues the kernel
// for device type T, the dtype of `in` (input, or grad_output).
template <typename F>
void launch_average(const char* name, const char* op, int64_t n, const Tensor& in, F&& launch) {
  if (n == 0) return;
  Launch l(name, in);
  TALLY_DISPATCH_FLOAT(in.dtype(), op,
                       [&] { launch.template operator()<dev_t<scalar_t>>(n, l.stream_); });
  check_launch(l.name_);
}

void avg_pool2d_forward(const Tensor& out, const Tensor& input, const ops::Pool2dParams& p) {
  const Planes g = planes_of(input, out);
  launch_average("avg_pool2d (CUDA)", "avg_pool2d", out.numel(), input,
                 [&]<typename T>(int64_t n, cudaStream_t st) {
                   avg_pool_forward_kernel<T><<<blocks_for(n), kThreads, 0, st>>>(
                       ptr<const T>(input), ptr<T>(out), g, p, n);
                 });
}

void avg_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output,
                         const ops::Pool2dParams& p) {
  const Planes g = planes_of(grad_input, grad_output);
  check_grad_dtype("avg_pool2d_backward", grad_input, grad_output);
  launch_average("avg_pool2d_backward (CUDA)", "avg_pool2d_backward", grad_input.numel(),
                 grad_output, [&]<typename T>(int64_t n, cudaStream_t st) {
                   avg_pool_backward_kernel<T><<<blocks_for(n), kThreads, 0, st>>>(
                       ptr<dacc_t<T>>(grad_input), ptr<const T>(grad_output), g, p, n);
                 });
}

// The adaptive pools' channels_last launches: with_nhwc's index type over a window of 1 (the
// adaptive windows never reach past the plane).
void adaptive_nhwc(const char* name, const char* op, const Tensor& in, const Tensor& out,
                   const Tensor& dtype_of, bool backward) {
  ops::Pool2dParams unit;
  unit.kH = unit.kW = unit.sH = unit.sW = unit.dH = unit.dW = 1;
  unit.pH = unit.pW = 0;
  const int64_t n = backward ? in.numel() : out.numel();
  launch_average(name, op, n, dtype_of, [&]<typename T>(int64_t, cudaStream_t st) {
    with_nhwc(in, out, unit, [&]<typename I>(Nhwc<I> d, MaxWindow<I>) {
      if (backward)
        adaptive_backward_nhwc_kernel<T, I><<<blocks_for(n), kThreads, 0, st>>>(
            ptr<dacc_t<T>>(in), ptr<const T>(out), d, static_cast<I>(n));
      else
        adaptive_forward_nhwc_kernel<T, I><<<blocks_for(n), kThreads, 0, st>>>(
            ptr<const T>(in), ptr<T>(out), d, static_cast<I>(n));
    });
  });
}

void adaptive_avg_pool2d_forward(const Tensor& out, const Tensor& input) {
  if (nhwc(input)) {
    adaptive_nhwc("adaptive_avg_pool2d (CUDA, channels_last)", "adaptive_avg_pool2d", input, out,
                  input, false);
    return;
  }
  const Planes g = planes_of(input, out);
  launch_average("adaptive_avg_pool2d (CUDA)", "adaptive_avg_pool2d", out.numel(), input,
                 [&]<typename T>(int64_t n, cudaStream_t st) {
                   adaptive_forward_kernel<T>
                       <<<blocks_for(n), kThreads, 0, st>>>(ptr<const T>(input), ptr<T>(out), g, n);
                 });
}

void adaptive_avg_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output) {
  const Planes g = planes_of(grad_input, grad_output);
  check_grad_dtype("adaptive_avg_pool2d_backward", grad_input, grad_output);
  if (nhwc(grad_input)) {
    adaptive_nhwc("adaptive_avg_pool2d_backward (CUDA, channels_last)",
                  "adaptive_avg_pool2d_backward", grad_input, grad_output, grad_output, true);
    return;
  }
  launch_average("adaptive_avg_pool2d_backward (CUDA)", "adaptive_avg_pool2d_backward",
                 grad_input.numel(), grad_output, [&]<typename T>(int64_t n, cudaStream_t st) {
                   adaptive_backward_kernel<T><<<blocks_for(n), kThreads, 0, st>>>(
                       ptr<dacc_t<T>>(grad_input), ptr<const T>(grad_output), g, n);
                 });
}

// ---- interpolate: a thread a spatial position of the output (forward) or of the input (the
// backward's gather), its taps or readers computed once, then the planes blockIdx.y,
// blockIdx.y + gridDim.y, ... (PyTorch's kernels loop over N and C alike); index type I
// (int32_t where every flat index fits); the CPU's math (math::interp_point,
// math::interp_gather) element for element.

// kBackward false: dst the output, src the input, a thread an output position computing its
// taps; true: dst grad_input, src grad_output, a thread an input position computing its readers.
template <int K, bool kBackward, typename T, typename I>
__global__ void upsample_kernel(T* __restrict__ dst, const T* __restrict__ src,
                                math::InterpAxes<I, dacc_t<T>> ax, I planes, bool linear) {
  const I H = ax.a[1].in, W = ax.a[2].in, in_plane = ax.a[0].in * H * W;
  const I OH = ax.a[1].out, OW = ax.a[2].out, out_plane = ax.a[0].out * OH * OW;
  const I dst_plane = kBackward ? in_plane : out_plane,
          src_plane = kBackward ? out_plane : in_plane;
  // Its position (a, b, c) in dst's plane of [?, Y, X].
  const I X = kBackward ? W : OW, Y = kBackward ? H : OH;
  const I s = static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.x) + static_cast<I>(threadIdx.x);
  if (s >= dst_plane) return;
  const I c = s % X, b = (s / X) % Y, a = s / X / Y;
  if constexpr (kBackward) {
    const auto plan = math::interp_plan<K>(ax, a, b, c);
    for (I pl = blockIdx.y; pl < planes; pl += gridDim.y) {
      const T* gp = src + pl * src_plane;
      dst[pl * dst_plane + s] = store<T>(math::interp_gather<K>(
          ax, plan, [&](I d, I h, I w) { return load(gp[(d * OH + h) * OW + w]); }));
    }
  } else {
    const auto taps = math::interp_taps<K>(ax, a, b, c);
    for (I pl = blockIdx.y; pl < planes; pl += gridDim.y) {
      const T* xp = src + pl * src_plane;
      dst[pl * dst_plane + s] = store<T>(math::interp_point<K>(
          taps, linear, [&](I d, I h, I w) { return load(xp[(d * H + h) * W + w]); }));
    }
  }
}

// The grid of an interpolation kernel over `spatial` positions and `planes` planes: enough
// blocks along y (plane groups) for about 2^21 threads, as many planes a thread as that leaves.
dim3 upsample_grid(int64_t spatial, int64_t planes) {
  const int64_t bx = (spatial + kThreads - 1) / kThreads;
  const int64_t by = std::clamp<int64_t>(((int64_t{1} << 21) + bx * kThreads - 1) / (bx * kThreads),
                                         1, std::min<int64_t>(planes, 65535));
  return dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by));
}

// go.template operator()<K, T, I>() for the interpolation's spatial dims K, the device type T of
// `dtype_of` and the index type I (int32_t when both tensors' elements, plus a grid's stride,
// fit in 31 bits).
template <typename F>
void with_upsample(const char* name, const char* op, const Tensor& a, const Tensor& b,
                   const Tensor& dtype_of, const ops::InterpParams& p, F&& go) {
  Launch l(name, dtype_of);
  const bool small = std::max(a.numel(), b.numel()) < (int64_t{1} << 30);
  TALLY_DISPATCH_FLOAT(dtype_of.dtype(), op, [&] {
    using T = dev_t<scalar_t>;
    auto run = [&]<int K>() {
      if (small)
        go.template operator()<K, T, int32_t>(l.stream_);
      else
        go.template operator()<K, T, int64_t>(l.stream_);
    };
    if (p.dims == 1)
      run.template operator()<1>();
    else if (p.dims == 2)
      run.template operator()<2>();
    else
      run.template operator()<3>();
  });
  check_launch(l.name_);
}

// One interpolation kernel's launch: dst from src, a thread a position of dst's planes.
template <bool kBackward>
void launch_upsample(const char* name, const char* op, const Tensor& dst, const Tensor& src,
                     const ops::InterpParams& p) {
  const int64_t spatial = kBackward ? p.in[0] * p.in[1] * p.in[2] : p.out[0] * p.out[1] * p.out[2];
  with_upsample(name, op, dst, src, src, p, [&]<int K, typename T, typename I>(cudaStream_t st) {
    upsample_kernel<K, kBackward, T, I><<<upsample_grid(spatial, p.planes), kThreads, 0, st>>>(
        ptr<T>(dst), ptr<const T>(src), math::interp_axes<I, dacc_t<T>>(p),
        static_cast<I>(p.planes), p.linear);
  });
}

void upsample_forward(const Tensor& out, const Tensor& input, const ops::InterpParams& p) {
  launch_upsample<false>("upsample (CUDA)", "upsample", out, input, p);
}

void upsample_backward(const Tensor& grad_input, const Tensor& grad_output,
                       const ops::InterpParams& p) {
  launch_upsample<true>("upsample_backward (CUDA)", "upsample_backward", grad_input, grad_output,
                        p);
}

}  // namespace

const PoolKernels pool_kernels{TALLY_POOL_KERNELS};

}  // namespace tally::cuda
