// CPU 2-D convolution: for each sample and group, im2col unrolls the receptive fields
// into a [C/g * kH * kW, OH * OW] matrix so the convolution is one GEMM with the weight
// [O/g, C/g * kH * kW]. The input gradient is the transposed GEMM followed by col2im
// (which adds the overlapping windows back); the weight gradient is a GEMM with the
// unrolled input, accumulated over samples. A 1x1, stride-1, unpadded convolution needs
// no unrolling: the input plane already is the matrix.
//
// The unrolled matrix is library workspace: it comes from alloc_scratch, tagged
// `workspace` under the op's scope, so it shows up in memory reports like cuDNN's would.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>

#include "tensor/conv/kernels.h"
#include "tensor/cpu/blas.h"
#include "tensor/op_alloc.h"

namespace tally::cpu {

namespace {

// Sizes of one convolution, read off the (checked) tensors.
struct Geom {
  int64_t N, C, H, W, O, G, Cg, Og, kH, kW, OH, OW;
  int64_t sH, sW, pH, pW, dH, dW;
  int64_t K() const { return Cg * kH * kW; }  // rows of the unrolled matrix
  int64_t L() const { return OH * OW; }       // its columns
  // The input plane is already the unrolled matrix.
  bool direct() const { return kH == 1 && kW == 1 && sH == 1 && sW == 1 && pH == 0 && pW == 0; }
};

Geom geometry(const Shape& in, const Shape& w, const Shape& out, const ops::Conv2dParams& p) {
  Geom g{};
  g.N = in[0], g.C = in[1], g.H = in[2], g.W = in[3];
  g.O = w[0], g.Cg = w[1], g.kH = w[2], g.kW = w[3];
  g.OH = out[2], g.OW = out[3];
  g.G = p.groups;
  g.Og = g.O / g.G;
  g.sH = p.stride.h, g.sW = p.stride.w, g.pH = p.padding.h, g.pW = p.padding.w;
  g.dH = p.dilation.h, g.dW = p.dilation.w;
  // BLAS takes int dimensions.
  for (int64_t v : {g.K(), g.L(), g.Og})
    if (v > INT_MAX)
      throw std::invalid_argument(fmt::format(
          "conv2d: a GEMM dimension of {} exceeds the BLAS int range (input {}, weight {})", v,
          shape_str(in), shape_str(w)));
  return g;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}  // a >= 0, b > 0

// Columns [lo, hi) of an output row whose input column ow * s + off lies in [0, W).
void valid_range(int64_t off, int64_t s, int64_t W, int64_t OW, int64_t& lo, int64_t& hi) {
  lo = off >= 0 ? 0 : ceil_div(-off, s);
  hi = W - off <= 0 ? 0 : ceil_div(W - off, s);
  lo = std::min(lo, OW);
  hi = std::clamp(hi, lo, OW);
}

// The walk of im2col and col2im: for each row (c, kh, kw) of col [K, L] and each output row
// oh, f(col_off, x_off, lo, hi, inside): col_off the offset in col of that row's OW entries,
// x_off the offset in x [Cg, H, W] of input column kw dW - pW of input row ih = oh sH - pH +
// kh dH (an address only when inside: ih within [0, H)), [lo, hi) the output columns whose
// input column is within [0, W).
template <typename F>
void for_each_col_row(const Geom& g, F&& f) {
  const int64_t L = g.L();
  for (int64_t c = 0; c < g.Cg; ++c)
    for (int64_t kh = 0; kh < g.kH; ++kh)
      for (int64_t kw = 0; kw < g.kW; ++kw) {
        const int64_t row = ((c * g.kH + kh) * g.kW + kw) * L;
        const int64_t off_w = kw * g.dW - g.pW;
        int64_t lo, hi;
        valid_range(off_w, g.sW, g.W, g.OW, lo, hi);
        for (int64_t oh = 0; oh < g.OH; ++oh) {
          const int64_t ih = oh * g.sH - g.pH + kh * g.dH;
          f(row + oh * g.OW, (c * g.H + ih) * g.W + off_w, lo, hi, ih >= 0 && ih < g.H);
        }
      }
}

// col[K, L] <- receptive fields of x [Cg, H, W] (zeros where the window is in padding).
template <typename T>
void im2col(const T* x, T* col, const Geom& g) {
  for_each_col_row(g, [&](int64_t col_off, int64_t x_off, int64_t lo, int64_t hi, bool inside) {
    T* r = col + col_off;
    if (!inside) {
      std::fill(r, r + g.OW, T(0));
      return;
    }
    std::fill(r, r + lo, T(0));
    std::fill(r + hi, r + g.OW, T(0));
    const T* xr = x + x_off;
    if (g.sW == 1) {
      if (hi > lo) std::memcpy(r + lo, xr + lo, static_cast<size_t>(hi - lo) * sizeof(T));
    } else {
      for (int64_t ow = lo; ow < hi; ++ow) r[ow] = xr[ow * g.sW];
    }
  });
}

// x [Cg, H, W] += the columns of col[K, L] folded back onto their input positions.
template <typename T>
void col2im(const T* col, T* x, const Geom& g) {
  for_each_col_row(g, [&](int64_t col_off, int64_t x_off, int64_t lo, int64_t hi, bool inside) {
    if (!inside) return;
    const T* r = col + col_off;
    T* xr = x + x_off;
    for (int64_t ow = lo; ow < hi; ++ow) xr[ow * g.sW] += r[ow];
  });
}

template <typename T>
T* ptr(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

template <typename F>
void dispatch_blas(DType dt, const char* op, F&& f) {
  if (dt == DType::float32)
    f(float{});
  else if (dt == DType::float64)
    f(double{});
  else
    unsupported_dtype(op, dt);
}

// The scratch column matrix [K, L] of one (image, group) plane, in `like`'s dtype and device;
// none when the plane already is that matrix (Geom::direct()).
Tensor col_scratch(const Geom& g, const Tensor& like) {
  return g.direct() ? Tensor() : alloc_scratch(g.K() * g.L(), like.dtype(), like.device());
}

// A kernel's frame: the geometry g of the call x [N, C, H, W], w, y [N, O, OH, OW], then
// body(T{}, g, ws) in the dtype T of `like` with ws the im2col scratch (undefined when direct).
template <typename Body>
void conv_call(const char* op, const Tensor& like, const Tensor& x, const Tensor& w,
               const Tensor& y, const ops::Conv2dParams& p, Body&& body) {
  const Geom g = geometry(x.sizes(), w.sizes(), y.sizes(), p);
  dispatch_blas(like.dtype(), op, [&](auto tag) { body(tag, g, col_scratch(g, like)); });
}

// Calls f(n, grp, cols) for each (image, group) plane of the input x, with cols the plane's
// unrolled [K, L] matrix: the plane itself when direct, else im2col'd into `col`.
template <typename T, typename F>
void for_each_plane_cols(const Geom& g, const T* x, T* col, F&& f) {
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t grp = 0; grp < g.G; ++grp) {
      const T* xs = x + (n * g.C + grp * g.Cg) * g.H * g.W;
      const T* cols = xs;
      if (!g.direct()) {
        im2col(xs, col, g);
        cols = col;
      }
      f(n, grp, cols);
    }
}

void conv2d_forward(const Tensor& out, const Tensor& input, const Tensor& weight,
                    const Tensor& bias, const ops::Conv2dParams& p) {
  conv_call("conv2d", input, input, weight, out, p, [&](auto tag, const Geom& g, const Tensor& ws) {
    using T = decltype(tag);
    const T* w = ptr<T>(weight);
    const T* b = ptr<T>(bias);
    T* y = ptr<T>(out);
    const int64_t K = g.K(), L = g.L();
    for_each_plane_cols(g, ptr<T>(input), ptr<T>(ws), [&](int64_t n, int64_t grp, const T* cols) {
      T* ys = y + (n * g.O + grp * g.Og) * L;
      if (b)
        for (int64_t o = 0; o < g.Og; ++o)
          std::fill(ys + o * L, ys + (o + 1) * L, b[grp * g.Og + o]);
      gemm<T>(false, false, g.Og, L, K, T(1), w + grp * g.Og * K, K, cols, L, b ? T(1) : T(0), ys,
              L);
    });
  });
}

void conv2d_backward_input(const Tensor& grad_input, const Tensor& grad_output,
                           const Tensor& weight, const ops::Conv2dParams& p) {
  const auto body = [&](auto tag, const Geom& g, const Tensor& ws) {
    using T = decltype(tag);
    T* col = ptr<T>(ws);
    T* gx = ptr<T>(grad_input);
    const T* gy = ptr<T>(grad_output);
    const T* w = ptr<T>(weight);
    const int64_t K = g.K(), L = g.L();
    if (!g.direct()) std::fill(gx, gx + grad_input.numel(), T(0));
    for (int64_t n = 0; n < g.N; ++n)
      for (int64_t grp = 0; grp < g.G; ++grp) {
        T* gxs = gx + (n * g.C + grp * g.Cg) * g.H * g.W;
        const T* gys = gy + (n * g.O + grp * g.Og) * L;
        // cols [K, L] = weight_g^T [K, Og] @ grad_output_g [Og, L]
        gemm<T>(true, false, K, L, g.Og, T(1), w + grp * g.Og * K, K, gys, L, T(0),
                g.direct() ? gxs : col, L);
        if (!g.direct()) col2im(col, gxs, g);
      }
  };
  conv_call("conv2d_backward_input", weight, grad_input, weight, grad_output, p, body);
}

void conv2d_backward_weight(const Tensor& grad_weight, const Tensor& grad_output,
                            const Tensor& input, const ops::Conv2dParams& p) {
  const auto body = [&](auto tag, const Geom& g, const Tensor& ws) {
    using T = decltype(tag);
    T* gw = ptr<T>(grad_weight);
    const T* gy = ptr<T>(grad_output);
    const int64_t K = g.K(), L = g.L();
    std::fill(gw, gw + grad_weight.numel(), T(0));
    for_each_plane_cols(g, ptr<T>(input), ptr<T>(ws), [&](int64_t n, int64_t grp, const T* cols) {
      // grad_weight_g [Og, K] += grad_output_g [Og, L] @ cols^T [L, K]
      gemm<T>(false, true, g.Og, K, L, T(1), gy + (n * g.O + grp * g.Og) * L, L, cols, L, T(1),
              gw + grp * g.Og * K, K);
    });
  };
  conv_call("conv2d_backward_weight", input, input, grad_weight, grad_output, p, body);
}

}  // namespace

int64_t conv_col_scratch_numel(const Shape& input, const Shape& weight, const Shape& out,
                               const ops::Conv2dParams& p) {
  const Geom g = geometry(input, weight, out, p);
  return g.direct() ? 0 : g.K() * g.L();
}

const ConvKernels conv_kernels{TALLY_CONV_KERNELS};

}  // namespace tally::cpu
