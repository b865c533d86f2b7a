// CPU 2-D pooling: one loop nest per op over (plane, output row, output column), each
// window clipped to the input exactly as PyTorch's CPU kernels clip it. Large inputs run in
// parallel over the planes (tensor/cpu/parallel.h): each plane's outputs, and in the
// backward its input gradient, belong to one thread, computed as serially. interpolate runs
// over rows of outputs (forward) or inputs (its gathering backward) the same way.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "tensor/cpu/parallel.h"
#include "tensor/pool/kernels.h"
#include "tensor/pool/math.h"

namespace tally::cpu {

namespace {

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

using math::adaptive_window;
using math::avg_window;
using math::AvgWindow;

void max_pool2d_forward(const Tensor& out, const Tensor& indices, const Tensor& input,
                        const ops::Pool2dParams& p) {
  const Planes g = planes_of(input, out);
  TALLY_DISPATCH_FLOAT(input.dtype(), "max_pool2d", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* x = ptr<scalar_t>(input);
    scalar_t* y = ptr<scalar_t>(out);
    int64_t* idx = ptr<int64_t>(indices);
    parallel_for(g.planes, grain_of(g.H * g.W), [&](int64_t pl0, int64_t pl1) {
      for (int64_t pl = pl0; pl < pl1; ++pl) {
        const scalar_t* xp = x + pl * g.H * g.W;
        for (int64_t oh = 0; oh < g.OH; ++oh) {
          int64_t h0 = oh * p.sH - p.pH;
          const int64_t h1 = std::min(h0 + (p.kH - 1) * p.dH + 1, g.H);
          while (h0 < 0) h0 += p.dH;
          for (int64_t ow = 0; ow < g.OW; ++ow) {
            int64_t w0 = ow * p.sW - p.pW;
            const int64_t w1 = std::min(w0 + (p.kW - 1) * p.dW + 1, g.W);
            while (w0 < 0) w0 += p.dW;
            int64_t best = h0 * g.W + w0;
            A best_v = -std::numeric_limits<A>::infinity();
            for (int64_t h = h0; h < h1; h += p.dH)
              for (int64_t w = w0; w < w1; w += p.dW) {
                const A v = static_cast<A>(xp[h * g.W + w]);
                if (v > best_v || std::isnan(v)) {  // NaN propagates (as PyTorch: the last one)
                  best_v = v;
                  best = h * g.W + w;
                }
              }
            const int64_t o = (pl * g.OH + oh) * g.OW + ow;
            y[o] = scalar_t(best_v);
            idx[o] = best;
          }
        }
      }
    });
  });
}

namespace {
// Whether flat index j of an H x W plane is a position max pool window (oh, ow) could choose.
bool in_window(int64_t j, int64_t oh, int64_t ow, const Planes& g, const ops::Pool2dParams& p) {
  if (j < 0 || j >= g.H * g.W) return false;
  const int64_t rh = j / g.W - (oh * p.sH - p.pH), rw = j % g.W - (ow * p.sW - p.pW);
  return rh >= 0 && rw >= 0 && rh % p.dH == 0 && rw % p.dW == 0 && rh / p.dH < p.kH &&
         rw / p.dW < p.kW;
}
}  // namespace

void max_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output, const Tensor& indices,
                         const ops::Pool2dParams& p) {
  const Planes g = planes_of(grad_input, grad_output);
  TALLY_DISPATCH_FLOAT(grad_output.dtype(), "max_pool2d_backward", [&] {
    using A = acc_t<scalar_t>;
    scalar_t* gx = ptr<scalar_t>(grad_input);
    const scalar_t* gy = ptr<scalar_t>(grad_output);
    const int64_t* idx = ptr<int64_t>(indices);
    const int64_t n = g.OH * g.OW, plane = g.H * g.W;
    parallel_for(g.planes, grain_of(plane), [&](int64_t pl0, int64_t pl1) {
      for (int64_t pl = pl0; pl < pl1; ++pl) {
        const int64_t* ip = idx + pl * n;
        const scalar_t* gp = gy + pl * n;
        for (int64_t o = 0; o < n; ++o)
          if (!in_window(ip[o], o / g.OW, o % g.OW, g, p))
            throw std::out_of_range(fmt::format(
                "max_pool2d_backward: index {} of output ({}, {}) is not a position of its "
                "window in an input plane of {}x{}",
                ip[o], o / g.OW, o % g.OW, g.H, g.W));
        for (int64_t h = 0; h < g.H; ++h)
          for (int64_t w = 0; w < g.W; ++w) {
            A s = 0;
            math::covering_rows<int64_t>(h, g.OH, p.kH, p.sH, p.pH, p.dH, [&](int64_t oh) {
              math::covering_rows<int64_t>(w, g.OW, p.kW, p.sW, p.pW, p.dW, [&](int64_t ow) {
                const int64_t o = oh * g.OW + ow;
                if (ip[o] == h * g.W + w) s += static_cast<A>(gp[o]);
              });
            });
            gx[pl * plane + h * g.W + w] = scalar_t(s);
          }
      }
    });
  });
}

// The average pools over their windows: window(oh, ow, g) is output (oh, ow)'s AvgWindow (an
// empty one averages to 0 forward and takes no gradient). Each plane runs its outputs in
// (oh, ow) order; the backward accumulates in A (acc_t, float for 16-bit inputs: the grad_input
// it writes is A, see PoolKernels).
template <typename Window>
void window_avg_forward(const char* op, const Tensor& out, const Tensor& input, Window window) {
  const Planes g = planes_of(input, out);
  TALLY_DISPATCH_FLOAT(input.dtype(), op, [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* x = ptr<scalar_t>(input);
    scalar_t* y = ptr<scalar_t>(out);
    parallel_for(g.planes, grain_of(g.H * g.W), [&](int64_t pl0, int64_t pl1) {
      for (int64_t pl = pl0; pl < pl1; ++pl) {
        const scalar_t* xp = x + pl * g.H * g.W;
        for (int64_t oh = 0; oh < g.OH; ++oh)
          for (int64_t ow = 0; ow < g.OW; ++ow) {
            const AvgWindow win = window(oh, ow, g);
            A s = 0;
            if (!win.empty()) {
              for (int64_t h = win.h0; h < win.h1; ++h)
                for (int64_t w = win.w0; w < win.w1; ++w) s += static_cast<A>(xp[h * g.W + w]);
              s /= static_cast<A>(win.divisor);
            }
            y[(pl * g.OH + oh) * g.OW + ow] = scalar_t(s);
          }
      }
    });
  });
}

template <typename Window>
void window_avg_backward(const char* op, const Tensor& grad_input, const Tensor& grad_output,
                         Window window) {
  const Planes g = planes_of(grad_input, grad_output);
  TALLY_DISPATCH_FLOAT(grad_output.dtype(), op, [&] {
    using A = acc_t<scalar_t>;
    A* gx = ptr<A>(grad_input);
    const scalar_t* gy = ptr<scalar_t>(grad_output);
    std::fill(gx, gx + grad_input.numel(), A(0));
    parallel_for(g.planes, grain_of(g.H * g.W), [&](int64_t pl0, int64_t pl1) {
      for (int64_t pl = pl0; pl < pl1; ++pl) {
        A* gp = gx + pl * g.H * g.W;
        for (int64_t oh = 0; oh < g.OH; ++oh)
          for (int64_t ow = 0; ow < g.OW; ++ow) {
            const AvgWindow win = window(oh, ow, g);
            if (win.empty()) continue;
            const A v =
                static_cast<A>(gy[(pl * g.OH + oh) * g.OW + ow]) / static_cast<A>(win.divisor);
            for (int64_t h = win.h0; h < win.h1; ++h)
              for (int64_t w = win.w0; w < win.w1; ++w) gp[h * g.W + w] += v;
          }
      }
    });
  });
}

void avg_pool2d_forward(const Tensor& out, const Tensor& input, const ops::Pool2dParams& p) {
  window_avg_forward("avg_pool2d", out, input, [&](int64_t oh, int64_t ow, const Planes& g) {
    return avg_window(oh, ow, g.H, g.W, p);
  });
}

void avg_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output,
                         const ops::Pool2dParams& p) {
  window_avg_backward(
      "avg_pool2d_backward", grad_input, grad_output,
      [&](int64_t oh, int64_t ow, const Planes& g) { return avg_window(oh, ow, g.H, g.W, p); });
}

void adaptive_avg_pool2d_forward(const Tensor& out, const Tensor& input) {
  window_avg_forward("adaptive_avg_pool2d", out, input,
                     [](int64_t oh, int64_t ow, const Planes& g) {
                       return adaptive_window(oh, ow, g.OH, g.OW, g.H, g.W);
                     });
}

void adaptive_avg_pool2d_backward(const Tensor& grad_input, const Tensor& grad_output) {
  window_avg_backward("adaptive_avg_pool2d_backward", grad_input, grad_output,
                      [](int64_t oh, int64_t ow, const Planes& g) {
                        return adaptive_window(oh, ow, g.OH, g.OW, g.H, g.W);
                      });
}

// fn(std::integral_constant<int, K>) for the interpolation's K spatial dims.
template <typename F>
void with_dims(int k, F&& fn) {
  if (k == 1)
    fn(std::integral_constant<int, 1>{});
  else if (k == 2)
    fn(std::integral_constant<int, 2>{});
  else
    fn(std::integral_constant<int, 3>{});
}

// Each axis' taps (forward) or readers (backward), made once a call for the loops to look up:
// of(axis, i) for i < n[axis].
template <typename E, typename Ax, typename F>
std::array<std::vector<E>, 3> per_axis(const Ax& ax, const int64_t* n, F&& of) {
  std::array<std::vector<E>, 3> t;
  for (size_t j = 0; j < 3; ++j)
    for (int64_t i = 0; i < n[j]; ++i) t[j].push_back(of(ax.a[j], i));
  return t;
}

// fn(r, plane, a, b) for every row r = (plane, a, b) of a [planes, na, nb, len] grid, in
// parallel (each row one thread's).
template <typename F>
void for_rows(int64_t planes, int64_t na, int64_t nb, int64_t len, F&& fn) {
  parallel_for(planes * na * nb, grain_of(len), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(r, r / (na * nb), (r / nb) % na, r % nb);
  });
}

// interpolate: over output rows (plane, od, oh), each output computed by math::interp_point
// from the axes' taps, as the CUDA kernel computes each.
void upsample_forward(const Tensor& out, const Tensor& input, const ops::InterpParams& p) {
  TALLY_DISPATCH_FLOAT(input.dtype(), "upsample", [&] {
    using A = acc_t<scalar_t>;
    const auto ax = math::interp_axes<int64_t, A>(p);
    const auto taps = per_axis<math::Tap<int64_t, A>>(
        ax, p.out, [](const auto& a, int64_t o) { return a.tap(o); });
    const scalar_t* x = ptr<scalar_t>(input);
    scalar_t* y = ptr<scalar_t>(out);
    const int64_t H = p.in[1], W = p.in[2], OW = p.out[2];
    with_dims(p.dims, [&](auto k) {
      for_rows(p.planes, p.out[0], p.out[1], OW,
               [&](int64_t r, int64_t pl, int64_t od, int64_t oh) {
                 const scalar_t* xp = x + pl * p.in[0] * H * W;
                 math::PointTaps<int64_t, A> t{taps[0][static_cast<size_t>(od)],
                                               taps[1][static_cast<size_t>(oh)], taps[2][0]};
                 for (int64_t ow = 0; ow < OW; ++ow) {
                   t.w = taps[2][static_cast<size_t>(ow)];
                   y[r * OW + ow] = scalar_t(math::interp_point<decltype(k)::value>(
                       t, p.linear, [&](int64_t d, int64_t h, int64_t w) {
                         return static_cast<A>(xp[(d * H + h) * W + w]);
                       }));
                 }
               });
    });
  });
}

// Its gradient: over input rows (plane, d, h), each input element gathering from the outputs
// that read it (math::interp_gather with the axes' readers).
void upsample_backward(const Tensor& grad_input, const Tensor& grad_output,
                       const ops::InterpParams& p) {
  TALLY_DISPATCH_FLOAT(grad_output.dtype(), "upsample_backward", [&] {
    using A = acc_t<scalar_t>;
    const auto ax = math::interp_axes<int64_t, A>(p);
    const auto readers = per_axis<math::Readers<int64_t, A>>(
        ax, p.in, [](const auto& a, int64_t i) { return math::readers_of(a, i); });
    scalar_t* gx = ptr<scalar_t>(grad_input);
    const scalar_t* gy = ptr<scalar_t>(grad_output);
    const int64_t OH = p.out[1], OW = p.out[2], W = p.in[2];
    with_dims(p.dims, [&](auto k) {
      for_rows(p.planes, p.in[0], p.in[1], W, [&](int64_t r, int64_t pl, int64_t d, int64_t h) {
        const scalar_t* gp = gy + pl * p.out[0] * OH * OW;
        const auto grad = [&](int64_t od, int64_t oh, int64_t ow) {
          return static_cast<A>(gp[(od * OH + oh) * OW + ow]);
        };
        math::GatherPlan<int64_t, A> plan{readers[0][static_cast<size_t>(d)],
                                          readers[1][static_cast<size_t>(h)], readers[2][0]};
        for (int64_t w = 0; w < W; ++w) {
          plan.w = readers[2][static_cast<size_t>(w)];
          gx[r * W + w] = scalar_t(math::interp_gather<decltype(k)::value>(ax, plan, grad));
        }
      });
    });
  });
}

}  // namespace

const PoolKernels pool_kernels{TALLY_POOL_KERNELS};

}  // namespace tally::cpu
