// CPU elementwise kernels: copies with dtype conversion, fills, random fills, binary and
// unary maps, where, clamp. Arithmetic runs in acc_t (float for the 16-bit types); the
// scalar formulas are those of tensor/elementwise/math.h, shared with the CUDA kernels.
#include <cmath>

#include "tensor/cpu/loops.h"
#include "tensor/elementwise/kernels.h"
#include "tensor/elementwise/math.h"

namespace tally::cpu {

Shape broadcast_strides(const Tensor& t, const Shape& shape) {
  Shape st(shape.size(), 0);
  const int64_t off = static_cast<int64_t>(shape.size()) - t.dim();
  for (int64_t i = 0; i < t.dim(); ++i) {
    const auto j = static_cast<size_t>(i + off);
    st[j] = t.sizes()[static_cast<size_t>(i)] == 1 && shape[j] != 1
                ? 0
                : t.strides()[static_cast<size_t>(i)];
  }
  return st;
}

namespace {

template <typename T>
T* base(const Tensor& t) {
  return static_cast<T*>(t.storage().data());
}

// Applies f(dst&, src) over dst (dtype D) and src (dtype S) of the same shape.
template <typename D, typename S, typename F>
void map2(const Tensor& dst, const Tensor& src, F f) {
  D* d = base<D>(dst);
  const S* s = base<S>(src);
  strided_runs<2>(dst.sizes(), {dst.strides().data(), src.strides().data()},
                  {dst.storage_offset(), src.storage_offset()},
                  [&](std::array<int64_t, 2> o, int64_t n, std::array<int64_t, 2> st) {
                    for (int64_t i = 0; i < n; ++i) f(d[o[0] + i * st[0]], s[o[1] + i * st[1]]);
                  });
}

template <typename D, typename S>
D convert(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (std::is_same_v<D, bool>) {
    return static_cast<double>(static_cast<acc_t<S>>(v)) != 0.0;
  } else if constexpr (std::is_same_v<D, Half> || std::is_same_v<D, BFloat16>) {
    return D(static_cast<float>(static_cast<acc_t<S>>(v)));
  } else {
    return static_cast<D>(static_cast<acc_t<S>>(v));
  }
}

void copy(const Tensor& dst, const Tensor& src) {
  TALLY_DISPATCH_ALL(dst.dtype(), "copy_", [&] {
    using D = scalar_t;
    TALLY_DISPATCH_ALL(src.dtype(), "copy_", [&] {
      using S = scalar_t;
      map2<D, S>(dst, src, [](D& d, const S& s) { d = convert<D, S>(s); });
    });
  });
}

void fill(const Tensor& dst, double value) {
  TALLY_DISPATCH_ALL(dst.dtype(), "fill_", [&] {
    const scalar_t v = convert<scalar_t, double>(value);
    map2<scalar_t, scalar_t>(dst, dst, [&](scalar_t& d, const scalar_t&) { d = v; });
  });
}

// Element i of a random fill: the Philox block (offset + i / 4), lane i % 4.
template <typename F>
void philox_fill(const Tensor& dst, PhiloxState state, F f) {
  // dst is contiguous (factories and dropout allocate it so).
  const int64_t n = dst.numel();
  TALLY_DISPATCH_ALL(dst.dtype(), "random", [&] {
    scalar_t* d = base<scalar_t>(dst) + dst.storage_offset();
    for (int64_t i = 0; i < n; i += 4) {
      const auto r = philox4x32(state.offset + static_cast<uint64_t>(i / 4), 0, state.seed);
      for (int64_t j = 0; j < 4 && i + j < n; ++j)
        d[i + j] = convert<scalar_t, double>(f(r, static_cast<int>(j)));
    }
  });
}

void rand_uniform(const Tensor& dst, PhiloxState state) {
  philox_fill(dst, state, [](const Philox4& r, int j) {
    return static_cast<double>(uniform_from_bits(r[static_cast<size_t>(j)]));
  });
}

void rand_normal(const Tensor& dst, PhiloxState state) {
  philox_fill(dst, state, [](const Philox4& r, int j) { return math::normal_from_philox(r, j); });
}

void rand_int(const Tensor& dst, int64_t low, int64_t high, PhiloxState state) {
  const auto span = static_cast<uint64_t>(high - low);
  philox_fill(dst, state, [&](const Philox4& r, int j) {
    return static_cast<double>(low + static_cast<int64_t>(r[static_cast<size_t>(j)] % span));
  });
}

void binary(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  TALLY_DISPATCH_ALL(a.dtype(), ops::binary_op_name(op), [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* pa = base<T>(a);
    const T* pb = base<T>(b);
    const Shape& sz = out.sizes();
    if (math::is_compare(op)) {
      bool* po = base<bool>(out);
      strided_runs<3>(sz, {out.strides().data(), a.strides().data(), b.strides().data()},
                      {out.storage_offset(), a.storage_offset(), b.storage_offset()},
                      [&](std::array<int64_t, 3> o, int64_t n, std::array<int64_t, 3> s) {
                        for (int64_t i = 0; i < n; ++i)
                          po[o[0] + i * s[0]] = math::compare_value(
                              op, static_cast<double>(static_cast<A>(pa[o[1] + i * s[1]])),
                              static_cast<double>(static_cast<A>(pb[o[2] + i * s[2]])));
                      });
      return;
    }
    T* po = base<T>(out);
    strided_runs<3>(sz, {out.strides().data(), a.strides().data(), b.strides().data()},
                    {out.storage_offset(), a.storage_offset(), b.storage_offset()},
                    [&](std::array<int64_t, 3> o, int64_t n, std::array<int64_t, 3> s) {
                      for (int64_t i = 0; i < n; ++i)
                        po[o[0] + i * s[0]] =
                            T(math::binary_value<A>(op, static_cast<A>(pa[o[1] + i * s[1]]),
                                                    static_cast<A>(pb[o[2] + i * s[2]])));
                    });
  });
}

void binary_scalar(ops::BinaryOp op, const Tensor& out, const Tensor& a, double b, bool reverse) {
  TALLY_DISPATCH_ALL(a.dtype(), ops::binary_op_name(op), [&] {
    using T = scalar_t;
    using A = std::conditional_t<std::is_floating_point_v<acc_t<T>>, acc_t<T>, double>;
    const A s = static_cast<A>(b);
    if (math::is_compare(op)) {
      bool* po = base<bool>(out);
      const T* pa = base<T>(a);
      strided_runs<2>(out.sizes(), {out.strides().data(), a.strides().data()},
                      {out.storage_offset(), a.storage_offset()},
                      [&](std::array<int64_t, 2> o, int64_t n, std::array<int64_t, 2> st) {
                        for (int64_t i = 0; i < n; ++i) {
                          const double x =
                              static_cast<double>(static_cast<acc_t<T>>(pa[o[1] + i * st[1]]));
                          po[o[0] + i * st[0]] = reverse ? math::compare_value(op, b, x)
                                                         : math::compare_value(op, x, b);
                        }
                      });
      return;
    }
    map2<T, T>(out, a, [&](T& d, const T& x) {
      const A v = static_cast<A>(static_cast<acc_t<T>>(x));
      d = convert<T, A>(reverse ? math::binary_value<A>(op, s, v)
                                : math::binary_value<A>(op, v, s));
    });
  });
}

void unary(ops::UnaryOp op, const Tensor& out, const Tensor& a) {
  TALLY_DISPATCH_FLOAT(a.dtype(), ops::unary_op_name(op), [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    map2<T, T>(out, a,
               [&](T& d, const T& x) { d = T(math::unary_value<A>(op, static_cast<A>(x))); });
  });
}

void affine(const Tensor& out, const Tensor& x, double a, double b) {
  TALLY_DISPATCH_FLOAT(x.dtype(), "affine", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    map2<T, T>(out, x,
               [&](T& d, const T& v) { d = T(math::affine_value(static_cast<A>(v), a, b)); });
  });
}

void clamp(const Tensor& out, const Tensor& a, std::optional<double> lo, std::optional<double> hi) {
  TALLY_DISPATCH_ALL(a.dtype(), "clamp", [&] {
    using T = scalar_t;
    using A = std::conditional_t<std::is_floating_point_v<acc_t<T>>, acc_t<T>, double>;
    const bool has_lo = lo.has_value(), has_hi = hi.has_value();
    const double lo_v = lo.value_or(0.0), hi_v = hi.value_or(0.0);
    map2<T, T>(out, a, [&](T& d, const T& x) {
      const A v = static_cast<A>(static_cast<acc_t<T>>(x));
      if constexpr (std::is_floating_point_v<A>) {
        if (std::isnan(v)) {
          d = x;
          return;
        }
      }
      d = convert<T, A>(math::clamp_value(v, has_lo, lo_v, has_hi, hi_v));
    });
  });
}

void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  TALLY_DISPATCH_ALL(out.dtype(), "where", [&] {
    using T = scalar_t;
    T* po = base<T>(out);
    const bool* pc = base<bool>(cond);
    const T* pa = base<T>(a);
    const T* pb = base<T>(b);
    strided_runs<4>(
        out.sizes(),
        {out.strides().data(), cond.strides().data(), a.strides().data(), b.strides().data()},
        {out.storage_offset(), cond.storage_offset(), a.storage_offset(), b.storage_offset()},
        [&](std::array<int64_t, 4> o, int64_t n, std::array<int64_t, 4> s) {
          for (int64_t i = 0; i < n; ++i)
            po[o[0] + i * s[0]] = pc[o[1] + i * s[1]] ? pa[o[2] + i * s[2]] : pb[o[3] + i * s[3]];
        });
  });
}

void sum(const Tensor& out, const Tensor& t) {
  // Accumulate in double (int64 for integers) into a scratch buffer shaped like out, then
  // cast: exact enough to be the reference.
  const int64_t n_out = out.numel();
  const bool integral = !is_floating(t.dtype());
  std::vector<double> acc(static_cast<size_t>(integral ? 0 : n_out), 0.0);
  std::vector<int64_t> iacc(static_cast<size_t>(integral ? n_out : 0), 0);
  // out is contiguous with reduced dims of size 1: its strides with 0 on reduced dims index
  // the scratch buffer.
  Shape ost = contiguous_strides(out.sizes());
  for (size_t d = 0; d < ost.size(); ++d)
    if (out.sizes()[d] == 1 && t.sizes()[d] != 1) ost[d] = 0;
  TALLY_DISPATCH_ALL(t.dtype(), "sum", [&] {
    using T = scalar_t;
    const T* p = base<T>(t);
    strided_runs<2>(t.sizes(), {ost.data(), t.strides().data()}, {0, t.storage_offset()},
                    [&](std::array<int64_t, 2> o, int64_t n, std::array<int64_t, 2> s) {
                      if (integral) {
                        for (int64_t i = 0; i < n; ++i)
                          iacc[static_cast<size_t>(o[0] + i * s[0])] +=
                              static_cast<int64_t>(static_cast<acc_t<T>>(p[o[1] + i * s[1]]));
                      } else {
                        for (int64_t i = 0; i < n; ++i)
                          acc[static_cast<size_t>(o[0] + i * s[0])] +=
                              static_cast<double>(static_cast<acc_t<T>>(p[o[1] + i * s[1]]));
                      }
                    });
  });
  TALLY_DISPATCH_ALL(out.dtype(), "sum", [&] {
    using T = scalar_t;
    T* po = base<T>(out) + out.storage_offset();
    for (int64_t i = 0; i < n_out; ++i)
      po[i] = integral ? convert<T, int64_t>(iacc[static_cast<size_t>(i)])
                       : convert<T, double>(acc[static_cast<size_t>(i)]);
  });
}

}  // namespace

const ElementwiseKernels elementwise_kernels{TALLY_ELEMENTWISE_KERNELS};

}  // namespace tally::cpu
