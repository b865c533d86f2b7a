// CPU normalization kernels: layer_norm / rms_norm over rows, batch_norm over channels,
// group_norm over (sample, group) rows.
// Sums over a row or a channel run in double; elementwise arithmetic in acc_t (float for
// the 16-bit types, double for float64), as the statistics are stored.
//
// Large inputs run in parallel over independent outputs (tensor/cpu/parallel.h): rows, or
// channels, or (sample, channel) planes, each computed by one thread exactly as the serial
// loop computes it, so the results do not depend on the thread count. layer_norm's
// backward sums dweight and dbias over the rows: those sums run over columns, each column's
// rows added in order.
#include <cmath>

#include "tensor/cpu/parallel.h"
#include "tensor/norm/kernels.h"
#include "tensor/norm/math.h"

namespace tally::cpu {

namespace {

// Element pointer of a contiguous tensor (null when undefined).
template <typename T>
T* ptr(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.storage().data()) + t.storage_offset() : nullptr;
}

// The element pointers both backward kernels read and write: x, dx in T, dy in G (T, or a
// 16-bit type beside a float32 T for layer_norm); dweight, dbias, mean, rstd (invstd), weight
// in the statistics dtype.
template <typename T, typename G = T, typename A = acc_t<T>>
struct BackwardPtrs {
  const T* x;
  const G* dy;
  T* dx;
  A* dweight;
  A* dbias;
  const A* mean;
  const A* rstd;
  const A* weight;
};
template <typename T, typename G = T>
BackwardPtrs<T, G> backward_ptrs(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                 const Tensor& dy, const Tensor& x, const Tensor& mean,
                                 const Tensor& rstd, const Tensor& weight) {
  using A = acc_t<T>;
  return {ptr<const T>(x), ptr<const G>(dy),   ptr<T>(dx),         ptr<A>(dweight),
          ptr<A>(dbias),   ptr<const A>(mean), ptr<const A>(rstd), ptr<const A>(weight)};
}

// The mean (0 unless center) and rstd = 1 / sqrt(biased var + eps) of a row of cols values,
// summed in double (two passes: the variance around the mean), rounded to A once. An empty
// row gives mean 0 and var 0.
template <typename A>
struct RowStats {
  A mean, rstd;
};
template <typename A, typename T>
RowStats<A> row_stats(const T* xr, int64_t cols, bool center, double eps) {
  double mu = 0.0;
  if (center) {
    double s = 0.0;
    for (int64_t j = 0; j < cols; ++j) s += static_cast<double>(static_cast<A>(xr[j]));
    mu = cols > 0 ? s / static_cast<double>(cols) : 0.0;
  }
  double ss = 0.0;
  for (int64_t j = 0; j < cols; ++j) {
    const double d = static_cast<double>(static_cast<A>(xr[j])) - mu;
    ss += d * d;
  }
  const double var = cols > 0 ? ss / static_cast<double>(cols) : 0.0;
  return {static_cast<A>(mu), static_cast<A>(1.0 / std::sqrt(var + eps))};
}

void layer_norm(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols, double eps,
                const Tensor& residual, const Tensor& sum) {
  dispatch_row_pair(x.dtype(), out.dtype(), "layer_norm", [&]<typename T, typename O>() {
    using A = acc_t<T>;
    const T* px = residual.defined() ? ptr<const T>(sum) : ptr<const T>(x);
    if (residual.defined()) {  // sum = x + residual, rounded to x's dtype, then normalized
      const T* xs = ptr<const T>(x);
      T* ps = ptr<T>(sum);
      const bool as_x = residual.dtype() == x.dtype();
      const T* rt = as_x ? ptr<const T>(residual) : nullptr;
      const O* ro = as_x ? nullptr : ptr<const O>(residual);
      parallel_for(rows * cols, grain_of(1), [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i)
          ps[i] = T(static_cast<A>(xs[i]) + (rt ? static_cast<A>(rt[i]) : static_cast<A>(ro[i])));
      });
    }
    O* po = ptr<O>(out);
    A* pm = ptr<A>(mean);
    A* pr = ptr<A>(rstd);
    const A* pw = ptr<const A>(weight);
    const A* pb = ptr<const A>(bias);
    const bool center = pm != nullptr;
    parallel_for(rows, grain_of(cols), [&](int64_t row0, int64_t row1) {
      for (int64_t i = row0; i < row1; ++i) {
        const T* xr = px + i * cols;
        O* orow = po + i * cols;
        const RowStats<A> st = row_stats<A>(xr, cols, center, eps);
        const A m = st.mean, r = st.rstd;
        if (center) pm[i] = m;
        pr[i] = r;
        for (int64_t j = 0; j < cols; ++j) {
          orow[j] = O(math::scale_shift(math::xhat(static_cast<A>(xr[j]), m, r), pw, pb, j));
        }
      }
    });
  });
}

void layer_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                         const Tensor& weight, int64_t rows, int64_t cols, const Tensor& dx_add,
                         const Tensor& dx_low) {
  dispatch_row_pair(x.dtype(), dy.dtype(), "layer_norm_backward", [&]<typename T, typename G>() {
    using A = acc_t<T>;
    const BackwardPtrs<T, G> p = backward_ptrs<T, G>(dx, dweight, dbias, dy, x, mean, rstd, weight);
    const bool center = p.mean != nullptr;
    // dweight += dy * xhat, dbias += dy: per column, the rows in order.
    if (p.dweight || p.dbias) {
      parallel_for(cols, grain_of(rows), [&](int64_t col0, int64_t col1) {
        for (int64_t j = col0; j < col1; ++j) {
          A sw = A(0), sb = A(0);
          for (int64_t i = 0; i < rows; ++i) {
            const A g = static_cast<A>(p.dy[i * cols + j]);
            if (p.dweight)
              sw += g * math::xhat(static_cast<A>(p.x[i * cols + j]), center ? p.mean[i] : A(0),
                                   p.rstd[i]);
            sb += g;
          }
          if (p.dweight) p.dweight[j] = sw;
          if (p.dbias) p.dbias[j] = sb;
        }
      });
    }
    if (!p.dx) return;
    const T* pa = dx_add.defined() ? ptr<const T>(dx_add) : nullptr;
    G* pl = dx_low.defined() ? ptr<G>(dx_low) : nullptr;
    const double inv_n = cols > 0 ? 1.0 / static_cast<double>(cols) : 0.0;
    parallel_for(rows, grain_of(cols), [&](int64_t row0, int64_t row1) {
      for (int64_t i = row0; i < row1; ++i) {
        const T* xr = p.x + i * cols;
        const G* gr = p.dy + i * cols;
        const A m = center ? p.mean[i] : A(0);
        const A r = p.rstd[i];
        // With g = dy * weight and xhat = (x - mean) * rstd:
        //   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (rms_norm: no mean(g) term)
        double sg = 0.0, sgx = 0.0;
        for (int64_t j = 0; j < cols; ++j) {
          const A xh = math::xhat(static_cast<A>(xr[j]), m, r);
          const A g = static_cast<A>(gr[j]);
          const A gw = p.weight ? g * p.weight[j] : g;
          sg += static_cast<double>(gw);
          sgx += static_cast<double>(gw) * static_cast<double>(xh);
        }
        const A mg = center ? static_cast<A>(sg * inv_n) : A(0);
        const A mgx = static_cast<A>(sgx * inv_n);
        T* dr = p.dx + i * cols;
        const T* ar = pa ? pa + i * cols : nullptr;
        G* lr = pl ? pl + i * cols : nullptr;
        for (int64_t j = 0; j < cols; ++j) {
          const A xh = math::xhat(static_cast<A>(xr[j]), m, r);
          const A g = static_cast<A>(gr[j]);
          const A gw = p.weight ? g * p.weight[j] : g;
          const A d = math::norm_input_grad(r, gw, mg, xh, mgx);
          dr[j] = T(ar ? d + static_cast<A>(ar[j]) : d);
          if (lr) lr[j] = G(dr[j]);
        }
      }
    });
  });
}

void batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& invstd, const Tensor& x,
                      double eps, const Tensor& running_mean, const Tensor& running_var,
                      double momentum) {
  TALLY_DISPATCH_FLOAT(x.dtype(), "batch_norm", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = ptr<const T>(x);
    A* pm = ptr<A>(mean);
    A* pv = ptr<A>(var);
    A* pi = ptr<A>(invstd);
    A* prm = running_mean.defined() ? ptr<A>(running_mean) : nullptr;
    A* prv = running_var.defined() ? ptr<A>(running_var) : nullptr;
    const NCS dims = ncs(x);  // not a structured binding: clang 14 cannot capture one
    const int64_t n = dims.n, c = dims.c, s = dims.s;
    const int64_t count = n * s;
    parallel_for(c, grain_of(count), [&](int64_t ch0, int64_t ch1) {
      for (int64_t ch = ch0; ch < ch1; ++ch) {
        double sum = 0.0;
        for (int64_t b = 0; b < n; ++b) {
          const T* p = px + (b * c + ch) * s;
          for (int64_t k = 0; k < s; ++k) sum += static_cast<double>(static_cast<A>(p[k]));
        }
        const double mu = count > 0 ? sum / static_cast<double>(count) : 0.0;
        double ss = 0.0;
        for (int64_t b = 0; b < n; ++b) {
          const T* p = px + (b * c + ch) * s;
          for (int64_t k = 0; k < s; ++k) {
            const double d = static_cast<double>(static_cast<A>(p[k])) - mu;
            ss += d * d;
          }
        }
        const double v = count > 0 ? ss / static_cast<double>(count) : 0.0;
        pm[ch] = static_cast<A>(mu);
        pv[ch] = static_cast<A>(v);
        pi[ch] = static_cast<A>(1.0 / std::sqrt(v + eps));
        if (prm && count > 0) {
          prm[ch] = static_cast<A>(math::running_stat(prm[ch], mu, momentum));
          prv[ch] = static_cast<A>(math::running_stat(prv[ch], math::unbiased(v, count), momentum));
        }
      }
    });
  });
}

void batch_norm_elemt(const Tensor& out, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                      const Tensor& weight, const Tensor& bias) {
  TALLY_DISPATCH_FLOAT(x.dtype(), "batch_norm", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = ptr<const T>(x);
    T* po = ptr<T>(out);
    const A* pm = ptr<const A>(mean);
    const A* pi = ptr<const A>(invstd);
    const A* pw = ptr<const A>(weight);
    const A* pb = ptr<const A>(bias);
    const NCS dims = ncs(x);  // not a structured binding: clang 14 cannot capture one
    const int64_t n = dims.n, c = dims.c, s = dims.s;
    parallel_for(n * c, grain_of(s), [&](int64_t plane0, int64_t plane1) {
      for (int64_t plane = plane0; plane < plane1; ++plane) {
        const int64_t ch = plane % c;
        // y = x * scale + shift, scale = invstd * weight, shift = bias - mean * scale
        const A scale = pw ? pi[ch] * pw[ch] : pi[ch];
        const A m = pm[ch];
        const A shift = pb ? pb[ch] : A(0);
        const int64_t base = plane * s;
        for (int64_t k = 0; k < s; ++k)
          po[base + k] = T(math::batch_norm_value(static_cast<A>(px[base + k]), m, scale, shift));
      }
    });
  });
}

void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean,
                         const Tensor& invstd, const Tensor& weight, bool training) {
  TALLY_DISPATCH_FLOAT(dy.dtype(), "batch_norm_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const BackwardPtrs<T> p = backward_ptrs<T>(dx, dweight, dbias, dy, x, mean, invstd, weight);
    const NCS dims = ncs(dy);  // not a structured binding: clang 14 cannot capture one
    const int64_t n = dims.n, c = dims.c, s = dims.s;
    const int64_t count = n * s;
    const bool need_xhat = p.dweight || (p.dx && training);
    parallel_for(c, grain_of(count), [&](int64_t ch0, int64_t ch1) {
      for (int64_t ch = ch0; ch < ch1; ++ch) {
        const A r = p.rstd[ch];
        const A m = need_xhat ? p.mean[ch] : A(0);
        // sum(dy) and sum(dy * xhat) over the channel's elements, xhat = (x - mean) * invstd
        double sdy = 0.0, sdyx = 0.0;
        if (p.dbias || need_xhat) {
          for (int64_t b = 0; b < n; ++b) {
            const int64_t base = (b * c + ch) * s;
            for (int64_t k = 0; k < s; ++k) {
              const A g = static_cast<A>(p.dy[base + k]);
              sdy += static_cast<double>(g);
              if (need_xhat) {
                const A xh = math::xhat(static_cast<A>(p.x[base + k]), m, r);
                sdyx += static_cast<double>(g) * static_cast<double>(xh);
              }
            }
          }
        }
        if (p.dweight) p.dweight[ch] = static_cast<A>(sdyx);
        if (p.dbias) p.dbias[ch] = static_cast<A>(sdy);
        if (!p.dx) continue;
        // training: dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))
        // eval:     dx = w * invstd * dy
        const A scale = p.weight ? r * p.weight[ch] : r;
        const double inv_count = count > 0 ? 1.0 / static_cast<double>(count) : 0.0;
        const A mdy = static_cast<A>(sdy * inv_count);
        const A mdyx = static_cast<A>(sdyx * inv_count);
        for (int64_t b = 0; b < n; ++b) {
          const int64_t base = (b * c + ch) * s;
          for (int64_t k = 0; k < s; ++k) {
            const A g = static_cast<A>(p.dy[base + k]);
            if (training) {
              const A xh = math::xhat(static_cast<A>(p.x[base + k]), m, r);
              p.dx[base + k] = T(math::norm_input_grad(scale, g, mdy, xh, mdyx));
            } else {
              p.dx[base + k] = T(scale * g);
            }
          }
        }
      }
    });
  });
}

// group_norm: a (sample, group) is a contiguous row of d = C / groups channels of s elements
// each; one thread a row. out (forward) and dy (backward) in x's dtype T or float beside a
// 16-bit T (dispatch_widened_pair).
void group_norm(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                const Tensor& weight, const Tensor& bias, int64_t groups, double eps) {
  dispatch_widened_pair(x.dtype(), out.dtype(), "group_norm", [&]<typename T, typename O>() {
    using A = acc_t<T>;
    const T* px = ptr<const T>(x);
    O* po = ptr<O>(out);
    A* pm = ptr<A>(mean);
    A* pr = ptr<A>(rstd);
    const A* pw = ptr<const A>(weight);
    const A* pb = ptr<const A>(bias);
    const NCS dims = ncs(x);  // not a structured binding: clang 14 cannot capture one
    const int64_t c = dims.c, s = dims.s, d = c / groups, cols = d * s;
    parallel_for(dims.n * groups, grain_of(cols), [&](int64_t row0, int64_t row1) {
      for (int64_t row = row0; row < row1; ++row) {
        const T* xr = px + row * cols;
        const RowStats<A> st = row_stats<A>(xr, cols, true, eps);
        const A m = st.mean, r = st.rstd;
        pm[row] = m;
        pr[row] = r;
        const int64_t c0 = (row % groups) * d;
        for (int64_t k = 0; k < d; ++k) {
          const T* xc = xr + k * s;
          O* oc = po + row * cols + k * s;
          for (int64_t e = 0; e < s; ++e)
            oc[e] = O(math::scale_shift(math::xhat(static_cast<A>(xc[e]), m, r), pw, pb, c0 + k));
        }
      }
    });
  });
}

// dx per (sample, group) row: with g = dy * weight[c] and xhat = (x - mean) * rstd,
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) over the row's d * s elements;
// dweight[c] = sum over samples and the plane of dy * xhat, dbias[c] = sum of dy, per channel
// (the samples in order).
void group_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                         const Tensor& weight, int64_t groups) {
  dispatch_widened_pair(
      x.dtype(), dy.dtype(), "group_norm_backward", [&]<typename T, typename G>() {
        using A = acc_t<T>;
        const BackwardPtrs<T, G> p =
            backward_ptrs<T, G>(dx, dweight, dbias, dy, x, mean, rstd, weight);
        const NCS dims = ncs(x);  // not a structured binding: clang 14 cannot capture one
        const int64_t n = dims.n, c = dims.c, s = dims.s, d = c / groups, cols = d * s;
        if (p.dweight || p.dbias) {
          parallel_for(c, grain_of(n * s), [&](int64_t ch0, int64_t ch1) {
            for (int64_t ch = ch0; ch < ch1; ++ch) {
              double sw = 0.0, sb = 0.0;
              for (int64_t b = 0; b < n; ++b) {
                const int64_t row = b * groups + ch / d;
                const int64_t base = (b * c + ch) * s;
                for (int64_t e = 0; e < s; ++e) {
                  const A g = static_cast<A>(p.dy[base + e]);
                  if (p.dweight)
                    sw += static_cast<double>(g) *
                          static_cast<double>(
                              math::xhat(static_cast<A>(p.x[base + e]), p.mean[row], p.rstd[row]));
                  sb += static_cast<double>(g);
                }
              }
              if (p.dweight) p.dweight[ch] = static_cast<A>(sw);
              if (p.dbias) p.dbias[ch] = static_cast<A>(sb);
            }
          });
        }
        if (!p.dx) return;
        const double inv_n = cols > 0 ? 1.0 / static_cast<double>(cols) : 0.0;
        parallel_for(n * groups, grain_of(cols), [&](int64_t row0, int64_t row1) {
          for (int64_t row = row0; row < row1; ++row) {
            const int64_t c0 = (row % groups) * d, base = row * cols;
            const A m = p.mean[row], r = p.rstd[row];
            double sg = 0.0, sgx = 0.0;
            for (int64_t k = 0; k < d; ++k) {
              const A w = p.weight ? p.weight[c0 + k] : A(1);
              for (int64_t e = 0; e < s; ++e) {
                const int64_t i = base + k * s + e;
                const A g = static_cast<A>(p.dy[i]) * w;
                sg += static_cast<double>(g);
                sgx += static_cast<double>(g) *
                       static_cast<double>(math::xhat(static_cast<A>(p.x[i]), m, r));
              }
            }
            const A mg = static_cast<A>(sg * inv_n), mgx = static_cast<A>(sgx * inv_n);
            for (int64_t k = 0; k < d; ++k) {
              const A w = p.weight ? p.weight[c0 + k] : A(1);
              for (int64_t e = 0; e < s; ++e) {
                const int64_t i = base + k * s + e;
                p.dx[i] = T(math::norm_input_grad(r, static_cast<A>(p.dy[i]) * w, mg,
                                                  math::xhat(static_cast<A>(p.x[i]), m, r), mgx));
              }
            }
          }
        });
      });
}

}  // namespace

const NormKernels norm_kernels{TALLY_NORM_KERNELS};

}  // namespace tally::cpu
