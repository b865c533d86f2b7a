// CPU kernels of the softmax family. Each walks the rows along the softmax (class) dim
// through the operands' strides, subtracts the row max before exponentiating, and does its
// arithmetic in acc_t; the losses add their rows up in double. softmax and its backward run
// in parallel over the rows of large inputs (parallel_for_each_kept); the losses, which
// total over their rows, stay serial.
#include "tensor/reduce/cpu.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "tensor/softmax/kernels.h"

namespace tally::cpu {

namespace {

template <typename T>
T* base(const Tensor& t) {
  return static_cast<T*>(t.storage().data());
}

std::vector<bool> only_dim(int64_t rank, int64_t dim) {
  std::vector<bool> reduce(static_cast<size_t>(rank), false);
  reduce[static_cast<size_t>(dim)] = true;
  return reduce;
}

// One row of n elements, stride s, starting at p: its max and sum(exp(x - max)).
template <typename T, typename A = acc_t<T>>
struct RowStats {
  A max;
  A sum;
};

template <typename T, typename A = acc_t<T>>
RowStats<T> row_stats(const T* p, int64_t n, int64_t s) {
  A m = -std::numeric_limits<A>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const A v = static_cast<A>(p[i * s]);
    if (v > m) m = v;
  }
  A sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<A>(p[i * s]) - m);
  return {m, sum};
}

void check_target(int64_t t, int64_t classes) {
  if (t < 0 || t >= classes)
    throw std::out_of_range(fmt::format("target {} is out of bounds for {} classes", t, classes));
}

void softmax(const Tensor& out, const Tensor& x, int64_t dim, bool log) {
  const auto d = static_cast<size_t>(dim);
  const int64_t n = x.sizes()[d], xs = x.strides()[d], os = out.strides()[d];
  TALLY_DISPATCH_FLOAT(x.dtype(), log ? "log_softmax" : "softmax", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = base<T>(x);
    T* po = base<T>(out);
    parallel_for_each_kept<2>(only_dim(x.dim(), dim), {&x, &out}, n, [&](std::array<int64_t, 2> o) {
      const RowStats<T> st = row_stats(px + o[0], n, xs);
      if (log) {
        // (x - max) - log(sum): accurate for large logits, unlike x - (max + log(sum)).
        const A log_sum = std::log(st.sum);
        for (int64_t i = 0; i < n; ++i)
          po[o[1] + i * os] =
              static_cast<T>((static_cast<A>(px[o[0] + i * xs]) - st.max) - log_sum);
      } else {
        const A inv = A(1) / st.sum;
        for (int64_t i = 0; i < n; ++i)
          po[o[1] + i * os] =
              static_cast<T>(std::exp(static_cast<A>(px[o[0] + i * xs]) - st.max) * inv);
      }
    });
  });
}

void softmax_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& y, int64_t dim,
                      bool log) {
  const auto d = static_cast<size_t>(dim);
  const int64_t n = y.sizes()[d];
  const int64_t gis = grad_input.strides()[d], gs = grad.strides()[d], ys = y.strides()[d];
  TALLY_DISPATCH_FLOAT(y.dtype(), log ? "log_softmax_backward" : "softmax_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    T* pgi = base<T>(grad_input);
    const T* pg = base<T>(grad);
    const T* py = base<T>(y);
    parallel_for_each_kept<3>(
        only_dim(y.dim(), dim), {&grad_input, &grad, &y}, n, [&](std::array<int64_t, 3> o) {
          auto g = [&](int64_t i) { return static_cast<A>(pg[o[1] + i * gs]); };
          auto yv = [&](int64_t i) { return static_cast<A>(py[o[2] + i * ys]); };
          A acc = 0;
          if (log) {
            for (int64_t i = 0; i < n; ++i) acc += g(i);  // sum(g)
            for (int64_t i = 0; i < n; ++i)
              pgi[o[0] + i * gis] = static_cast<T>(g(i) - std::exp(yv(i)) * acc);
          } else {
            for (int64_t i = 0; i < n; ++i) acc += g(i) * yv(i);  // sum(g * y)
            for (int64_t i = 0; i < n; ++i)
              pgi[o[0] + i * gis] = static_cast<T>(yv(i) * (g(i) - acc));
          }
        });
  });
}

// Walks the rows of a loss over `like` [N, C, d...] (the class dim 1 kept at 0): fn(o) with o[k]
// operands[k]'s element offset; a null operand (one the call does not read: out or grad of a
// reduced loss, an absent lse) stays at offset 0.
template <size_t N, typename Fn>
void for_each_loss_offsets(const Tensor& like, const std::array<const Tensor*, N>& operands,
                           Fn&& fn) {
  const Shape zero(static_cast<size_t>(like.dim()), 0);
  std::array<const int64_t*, N> strides;
  std::array<int64_t, N> offsets;
  for (size_t k = 0; k < N; ++k) {
    strides[k] = operands[k] ? operands[k]->strides().data() : zero.data();
    offsets[k] = operands[k] ? operands[k]->storage_offset() : 0;
  }
  for_each_kept<N>(like.sizes(), only_dim(like.dim(), 1), strides, offsets, std::forward<Fn>(fn));
}

// The rows of a loss: fn(input offset, target value, out offset) per row, the out offset
// following `out_none` when it is defined (reduction none), 0 otherwise. Rows whose target is
// ignore_index are visited too.
template <typename Fn>
void for_each_loss_row(const Tensor& input, const Tensor& target, const Tensor& out_none, Fn&& fn) {
  const int64_t* pt = base<int64_t>(target);
  for_each_loss_offsets<3>(input, {&input, &target, out_none.defined() ? &out_none : nullptr},
                           [&](std::array<int64_t, 3> o) { fn(o[0], pt[o[1]], o[2]); });
}

int64_t count_targets(const Tensor& input, const Tensor& target, int64_t ignore_index) {
  int64_t count = 0;
  for_each_loss_row(input, target, Tensor(),
                    [&](int64_t, int64_t t, int64_t) { count += t != ignore_index; });
  return count;
}

// The gradient each counted element gets from a sum or mean loss's 0-dim gradient grad
// (divided by the targets counted in `like`'s rows for mean); 0 for reduction none, whose
// gradient is per element.
template <typename A, typename T>
A reduced_grad(const Tensor& grad, const Tensor& like, const Tensor& target, int64_t ignore_index,
               ops::LossReduction reduction) {
  if (reduction == ops::LossReduction::none) return A(0);
  const int64_t count =
      reduction == ops::LossReduction::mean ? count_targets(like, target, ignore_index) : 1;
  return static_cast<A>(base<T>(grad)[grad.storage_offset()]) / static_cast<A>(count);
}

// Writes the reduced loss: the row sum (sum) or the row sum / counted rows (mean).
template <typename T>
void write_total(const Tensor& out, double total, int64_t count, ops::LossReduction reduction) {
  using A = acc_t<T>;
  const double v =
      reduction == ops::LossReduction::sum ? total : total / static_cast<double>(count);
  base<T>(out)[out.storage_offset()] = static_cast<T>(static_cast<A>(v));
}

void cross_entropy(const Tensor& out, const Tensor& lse, const Tensor& input, const Tensor& target,
                   int64_t ignore_index, double label_smoothing, ops::LossReduction reduction) {
  const int64_t C = input.sizes()[1], cs = input.strides()[1];
  const bool none = reduction == ops::LossReduction::none;
  TALLY_DISPATCH_FLOAT(input.dtype(), "cross_entropy", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = base<T>(input);
    const bool float_out = out.dtype() != input.dtype();  // float32 loss from 16-bit logits
    auto put = [&](int64_t off, double v) {
      if (float_out)
        base<float>(out)[off] = static_cast<float>(v);
      else
        base<T>(out)[off] = static_cast<T>(static_cast<A>(v));
    };
    A* plse = lse.defined() ? base<A>(lse) : nullptr;
    const A eps = static_cast<A>(label_smoothing);
    const A uniform = C > 0 ? eps / static_cast<A>(C) : A(0);
    double total = 0.0;
    int64_t count = 0;
    const int64_t* pt = base<int64_t>(target);
    for_each_loss_offsets<4>(input, {&input, &target, none ? &out : nullptr, plse ? &lse : nullptr},
                             [&](std::array<int64_t, 4> o) {
                               const int64_t xo = o[0], t = pt[o[1]], oo = o[2];
                               A loss = 0, row_lse = 0;
                               if (t != ignore_index) {
                                 check_target(t, C);
                                 const RowStats<T> st = row_stats(px + xo, C, cs);
                                 // -log_softmax_c = (max - x_c) + log(sum): no cancellation against
                                 // a large max.
                                 const A log_sum = std::log(st.sum);
                                 row_lse = st.max + log_sum;
                                 loss = (st.max - static_cast<A>(px[xo + t * cs])) + log_sum;
                                 if (label_smoothing > 0.0) {
                                   A smooth = 0;  // sum_c -log_softmax_c, term by term
                                   for (int64_t c = 0; c < C; ++c)
                                     smooth += (st.max - static_cast<A>(px[xo + c * cs])) + log_sum;
                                   loss = (A(1) - eps) * loss + uniform * smooth;
                                 }
                                 total += static_cast<double>(loss);
                                 ++count;
                               }
                               if (plse) plse[o[3]] = row_lse;
                               if (none) put(oo, static_cast<double>(loss));
                             });
    if (!none)
      put(out.storage_offset(),
          reduction == ops::LossReduction::sum ? total : total / static_cast<double>(count));
  });
}

void cross_entropy_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& input,
                            const Tensor& target, const Tensor& lse, int64_t ignore_index,
                            double label_smoothing, ops::LossReduction reduction) {
  const int64_t C = input.sizes()[1], cs = input.strides()[1], gcs = grad_input.strides()[1];
  const bool none = reduction == ops::LossReduction::none;
  TALLY_DISPATCH_FLOAT(input.dtype(), "cross_entropy_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = base<T>(input);
    const T* pg = base<T>(grad);
    T* pgi = base<T>(grad_input);
    const A eps = static_cast<A>(label_smoothing);
    const A uniform = C > 0 ? eps / static_cast<A>(C) : A(0);
    const A g_all = reduced_grad<A, T>(grad, input, target, ignore_index, reduction);
    const int64_t* pt = base<int64_t>(target);
    const A* plse = lse.defined() ? base<A>(lse) : nullptr;
    for_each_loss_offsets<5>(
        input, {&input, &target, none ? &grad : nullptr, &grad_input, plse ? &lse : nullptr},
        [&](std::array<int64_t, 5> o) {
          const int64_t t = pt[o[1]];
          if (t == ignore_index) {
            for (int64_t c = 0; c < C; ++c) pgi[o[3] + c * gcs] = static_cast<T>(A(0));
            return;
          }
          check_target(t, C);
          const A g = none ? static_cast<A>(pg[o[2]]) : g_all;
          RowStats<T> st{};
          if (plse) {
            st.max = plse[o[4]];  // p = exp(x - lse)
            st.sum = A(1);
          } else {
            st = row_stats(px + o[0], C, cs);
          }
          const A inv = A(1) / st.sum;
          for (int64_t c = 0; c < C; ++c) {
            const A p = std::exp(static_cast<A>(px[o[0] + c * cs]) - st.max) * inv;
            const A q = (c == t ? A(1) - eps : A(0)) + uniform;
            pgi[o[3] + c * gcs] = static_cast<T>((p - q) * g);
          }
        });
  });
}

void nll_loss(const Tensor& out, const Tensor& input, const Tensor& target, int64_t ignore_index,
              ops::LossReduction reduction) {
  const int64_t C = input.sizes()[1], cs = input.strides()[1];
  const bool none = reduction == ops::LossReduction::none;
  TALLY_DISPATCH_FLOAT(input.dtype(), "nll_loss", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = base<T>(input);
    T* po = base<T>(out);
    double total = 0.0;
    int64_t count = 0;
    for_each_loss_row(input, target, none ? out : Tensor(), [&](int64_t xo, int64_t t, int64_t oo) {
      A loss = 0;
      if (t != ignore_index) {
        check_target(t, C);
        loss = -static_cast<A>(px[xo + t * cs]);
        total += static_cast<double>(loss);
        ++count;
      }
      if (none) po[oo] = static_cast<T>(loss);
    });
    if (!none) write_total<T>(out, total, count, reduction);
  });
}

void nll_loss_backward(const Tensor& grad_input, const Tensor& grad, const Tensor& target,
                       int64_t ignore_index, ops::LossReduction reduction) {
  const int64_t C = grad_input.sizes()[1], gcs = grad_input.strides()[1];
  const bool none = reduction == ops::LossReduction::none;
  TALLY_DISPATCH_FLOAT(grad_input.dtype(), "nll_loss_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* pg = base<T>(grad);
    T* pgi = base<T>(grad_input);
    const A g_all = reduced_grad<A, T>(grad, grad_input, target, ignore_index, reduction);
    const int64_t* pt = base<int64_t>(target);
    for_each_loss_offsets<3>(grad_input, {&grad_input, &target, none ? &grad : nullptr},
                             [&](std::array<int64_t, 3> o) {
                               const int64_t t = pt[o[1]];
                               if (t == ignore_index) return;
                               check_target(t, C);
                               const A g = none ? static_cast<A>(pg[o[2]]) : g_all;
                               pgi[o[0] + t * gcs] = static_cast<T>(-g);
                             });
  });
}

// The forward, then the backward from its lse (which reads each logit before writing it, so
// grad_input may be input itself).
void cross_entropy_and_backward(const Tensor& out, const Tensor& lse, const Tensor& grad_input,
                                const Tensor& grad, const Tensor& input, const Tensor& target,
                                int64_t ignore_index, double label_smoothing,
                                ops::LossReduction reduction) {
  cross_entropy(out, lse, input, target, ignore_index, label_smoothing, reduction);
  cross_entropy_backward(grad_input, grad, input, target, lse, ignore_index, label_smoothing,
                         reduction);
}

}  // namespace

const SoftmaxKernels softmax_kernels{TALLY_SOFTMAX_KERNELS};

}  // namespace tally::cpu
