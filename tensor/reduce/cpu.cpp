// CPU kernels of the reduce family: selections (max/min with indices, amax/amin) compare in
// acc_t, statistics (var/std, logsumexp) accumulate in double. Every kernel reads its input
// through its strides; outputs are written through theirs. Large inputs run in parallel over
// the outputs (parallel_for_each_kept), each computed as the serial loop computes it.
#include "tensor/reduce/cpu.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "tensor/reduce/kernels.h"

namespace tally::cpu {

namespace {

template <typename T>
T* base(const Tensor& t) {
  return static_cast<T*>(t.storage().data());
}

template <typename A>
bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) {
    return std::isnan(v);
  } else {
    (void)v;
    return false;
  }
}

// Whether v replaces best as the running max (IsMax) or min: NaN wins and stays; ties keep
// the earlier element.
template <bool IsMax, typename A>
bool better(A v, A best) {
  if (is_nan(best)) return false;
  if (is_nan(v)) return true;
  return IsMax ? v > best : v < best;
}

std::vector<bool> only_dim(int64_t rank, int64_t dim) {
  std::vector<bool> reduce(static_cast<size_t>(rank), false);
  reduce[static_cast<size_t>(dim)] = true;
  return reduce;
}

template <bool IsMax>
void select_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim) {
  const auto d = static_cast<size_t>(dim);
  const int64_t n = x.sizes()[d], xs = x.strides()[d];
  const std::vector<bool> reduce = only_dim(x.dim(), dim);
  const Tensor& v_or_i = values.defined() ? values : indices;
  TALLY_DISPATCH_ALL(x.dtype(), IsMax ? "max" : "min", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = base<T>(x);
    T* pv = values.defined() ? base<T>(values) : nullptr;
    int64_t* pi = base<int64_t>(indices);
    parallel_for_each_kept<3>(reduce, {&x, &v_or_i, &indices}, n, [&](std::array<int64_t, 3> o) {
      A best = static_cast<A>(px[o[0]]);
      int64_t bi = 0;
      for (int64_t i = 1; i < n; ++i) {
        const A v = static_cast<A>(px[o[0] + i * xs]);
        if (better<IsMax>(v, best)) {
          best = v;
          bi = i;
        }
      }
      if (pv) pv[o[1]] = px[o[0] + bi * xs];
      pi[o[2]] = bi;
    });
  });
}

// out at each kept position = row(the offset of its block's first element in x), in
// parallel over the kept positions (x reduced over `reduce` as block walks it).
template <typename T, typename Row>
void reduce_kept(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce,
                 const ReducedBlock& block, Row row) {
  T* po = base<T>(out);
  parallel_for_each_kept<2>(reduce, {&x, &out}, block.numel(),
                            [&](std::array<int64_t, 2> o) { po[o[1]] = row(o[0]); });
}

template <bool IsMax>
void extreme(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce) {
  const ReducedBlock block(x.sizes(), x.strides(), reduce);
  TALLY_DISPATCH_ALL(x.dtype(), IsMax ? "amax" : "amin", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = base<T>(x);
    reduce_kept<T>(out, x, reduce, block, [&](int64_t xo) {
      bool first = true;
      T best{};
      block.for_each(xo, [&](int64_t off) {
        if (first || better<IsMax>(static_cast<A>(px[off]), static_cast<A>(best))) {
          best = px[off];
          first = false;
        }
      });
      return best;
    });
  });
}

void max_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim) {
  select_dim<true>(values, indices, x, dim);
}
void min_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim) {
  select_dim<false>(values, indices, x, dim);
}
void amax(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce) {
  extreme<true>(out, x, reduce);
}
void amin(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce) {
  extreme<false>(out, x, reduce);
}

void var(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce, double correction,
         bool take_sqrt) {
  const ReducedBlock block(x.sizes(), x.strides(), reduce);
  const auto n = static_cast<double>(block.numel());
  const double divisor = std::max(0.0, n - correction);
  TALLY_DISPATCH_FLOAT(x.dtype(), take_sqrt ? "std" : "var", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = base<T>(x);
    reduce_kept<T>(out, x, reduce, block, [&](int64_t xo) {
      // Two passes: the mean, then the squared deviations from it.
      double s = 0.0;
      block.for_each(xo, [&](int64_t off) { s += static_cast<double>(static_cast<A>(px[off])); });
      const double mean = s / n;
      double ss = 0.0;
      block.for_each(xo, [&](int64_t off) {
        const double dv = static_cast<double>(static_cast<A>(px[off])) - mean;
        ss += dv * dv;
      });
      double r = ss / divisor;
      if (take_sqrt) r = std::sqrt(r);
      return static_cast<T>(static_cast<A>(r));
    });
  });
}

void logsumexp(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce) {
  const ReducedBlock block(x.sizes(), x.strides(), reduce);
  TALLY_DISPATCH_FLOAT(x.dtype(), "logsumexp", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* px = base<T>(x);
    reduce_kept<T>(out, x, reduce, block, [&](int64_t xo) {
      double m = -std::numeric_limits<double>::infinity();
      block.for_each(xo, [&](int64_t off) {
        const auto v = static_cast<double>(static_cast<A>(px[off]));
        if (v > m) m = v;
      });
      // An infinite max (all -inf, or some +inf) shifts by 0: -inf, +inf.
      const double shift = std::isfinite(m) ? m : 0.0;
      double s = 0.0;
      block.for_each(xo, [&](int64_t off) {
        s += std::exp(static_cast<double>(static_cast<A>(px[off])) - shift);
      });
      return static_cast<T>(static_cast<A>(std::log(s) + shift));
    });
  });
}

void value_selecting_reduction_backward(const Tensor& grad_input, const Tensor& grad,
                                        const Tensor& indices, int64_t dim) {
  const auto d = static_cast<size_t>(dim);
  const int64_t n = grad_input.sizes()[d], gs = grad_input.strides()[d];
  const std::vector<bool> reduce = only_dim(grad_input.dim(), dim);
  TALLY_DISPATCH_FLOAT(grad_input.dtype(), "value_selecting_reduction_backward", [&] {
    using T = scalar_t;
    T* pgi = base<T>(grad_input);
    const T* pg = base<T>(grad);
    const int64_t* pi = base<int64_t>(indices);
    parallel_for_each_kept<3>(
        reduce, {&grad_input, &grad, &indices}, 1, [&](std::array<int64_t, 3> o) {
          const int64_t i = pi[o[2]];
          if (i < 0 || i >= n)
            throw std::out_of_range(
                fmt::format("value_selecting_reduction_backward: index {} is out of bounds for "
                            "dim {} of size {}",
                            i, dim, n));
          pgi[o[0] + i * gs] = pg[o[1]];
        });
  });
}

}  // namespace

const ReduceKernels reduce_kernels{TALLY_REDUCE_KERNELS};

}  // namespace tally::cpu
