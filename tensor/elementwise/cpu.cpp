// CPU elementwise kernels: copies with dtype conversion, fills, random fills, binary and
// unary maps, where, clamp. Arithmetic runs in acc_t (float for the 16-bit types); the
// scalar formulas are those of tensor/elementwise/math.h, shared with the CUDA kernels.
//
// Every map runs in parallel over large tensors (parallel_strided_runs: each element is
// written by one thread, computed as the serial loop computes it). A run whose operands are
// all contiguous takes a loop the compiler vectorizes (TALLY_SIMD); the common unary and
// binary ops are instantiated with the op fixed at compile time, so that loop has no switch
// and no branch on the data (a ReLU's `x > 0` over random signs mispredicts every other
// element as a branch). sum cuts a full reduction into fixed blocks (tensor/cpu/parallel.h),
// so its result does not depend on the thread count.
#include <cmath>

#include "tensor/cpu/convert.h"
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

// parallel_strided_runs over the operands ts (the first's shape), with their strides and
// storage offsets in the order given.
template <size_t N, typename Fn>
void strided_runs(const std::array<const Tensor*, N>& ts, Fn&& fn) {
  std::array<const int64_t*, N> strides;
  std::array<int64_t, N> offsets;
  for (size_t i = 0; i < N; ++i) {
    strides[i] = ts[i]->strides().data();
    offsets[i] = ts[i]->storage_offset();
  }
  parallel_strided_runs<N>(ts[0]->sizes(), strides, offsets, std::forward<Fn>(fn));
}

// Applies f(dst&, src) over dst (dtype D) and src (dtype S) of the same shape, in parallel
// over large tensors.
template <typename D, typename S, typename F>
void map2(const Tensor& dst, const Tensor& src, F f) {
  D* d = base<D>(dst);
  const S* s = base<S>(src);
  strided_runs<2>({&dst, &src},
                  [&](std::array<int64_t, 2> o, int64_t n, std::array<int64_t, 2> st) {
                    D* dr = d + o[0];
                    const S* sr = s + o[1];
                    if (st[0] == 1 && st[1] == 1) {
                      TALLY_SIMD
                      for (int64_t i = 0; i < n; ++i) f(dr[i], sr[i]);
                    } else {
                      for (int64_t i = 0; i < n; ++i) f(dr[i * st[0]], sr[i * st[1]]);
                    }
                  });
}

template <typename D, typename S>
D convert(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (std::is_same_v<D, bool>) {
    return static_cast<double>(static_cast<acc_t<S>>(v)) != 0.0;
  } else if constexpr (std::is_same_v<D, Half> && std::is_same_v<S, float>) {
    Half h;  // Half(v) exactly, inline and branch-free (tensor/cpu/convert.h)
    h.bits = float_to_half_bits(v);
    return h;
  } else if constexpr (std::is_same_v<D, float> && std::is_same_v<S, Half>) {
    return half_bits_to_float(v.bits);
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

void copy_many(const TensorList& dsts, const TensorList& srcs) {
  for (size_t i = 0; i < dsts.size(); ++i) copy(dsts[i], srcs[i]);
}

void fill(const Tensor& dst, double value) {
  TALLY_DISPATCH_ALL(dst.dtype(), "fill_", [&] {
    const scalar_t v = convert<scalar_t, double>(value);
    map2<scalar_t, scalar_t>(dst, dst, [&](scalar_t& d, const scalar_t&) { d = v; });
  });
}

// Element i of a random fill: the Philox block (offset + i / 4), lane i % 4 (so any range
// of elements fills the same wherever it starts: the fill runs in parallel).
template <typename F>
void philox_fill(const Tensor& dst, PhiloxState state, F f) {
  // dst is contiguous (factories and dropout allocate it so).
  const int64_t n = dst.numel();
  TALLY_DISPATCH_ALL(dst.dtype(), "random", [&] {
    scalar_t* d = base<scalar_t>(dst) + dst.storage_offset();
    parallel_for(n, kParallelGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin - begin % 4; i < end; i += 4) {
        const auto r = philox4x32(state.offset + static_cast<uint64_t>(i / 4), 0, state.seed);
        for (int64_t j = std::max<int64_t>(0, begin - i); j < 4 && i + j < end; ++j)
          d[i + j] = convert<scalar_t, double>(f(r, static_cast<int>(j)));
      }
    });
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

// out = f(a, b) elementwise (broadcast strides), in parallel over large tensors; a run
// with every operand contiguous takes the vectorizable loop. b's elements are B (T but for
// a widened 16-bit b: ops::binary_widens).
template <typename O, typename T, typename F, typename B = T>
void binary_map(const Tensor& out, const Tensor& a, const Tensor& b, F f) {
  O* po = base<O>(out);
  const T* pa = base<T>(a);
  const B* pb = base<B>(b);
  strided_runs<3>({&out, &a, &b},
                  [&](std::array<int64_t, 3> o, int64_t n, std::array<int64_t, 3> s) {
                    O* ro = po + o[0];
                    const T* ra = pa + o[1];
                    const B* rb = pb + o[2];
                    if (s[0] == 1 && s[1] == 1 && s[2] == 1) {
                      TALLY_SIMD
                      for (int64_t i = 0; i < n; ++i) ro[i] = f(ra[i], rb[i]);
                    } else {
                      for (int64_t i = 0; i < n; ++i) ro[i * s[0]] = f(ra[i * s[1]], rb[i * s[2]]);
                    }
                  });
}

// binary_map with the arithmetic op fixed at compile time (math::binary_value's switch folds
// away).
template <ops::BinaryOp Op, typename T>
void binary_fixed(const Tensor& out, const Tensor& a, const Tensor& b) {
  using A = acc_t<T>;
  binary_map<T, T>(out, a, b, [](const T& x, const T& y) {
    return T(math::binary_value<A>(Op, static_cast<A>(x), static_cast<A>(y)));
  });
}

// binary_fixed for op where it is one of Ops (each with its own compiled loop); false otherwise.
template <typename T, ops::BinaryOp... Ops>
bool binary_fixed_of(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  return ((op == Ops && (binary_fixed<Ops, T>(out, a, b), true)) || ...);
}

// out = a (op) b with a float32 a and out and a 16-bit b (ops::binary_widens): b widened
// exactly, so the result is a (op) to(b, float32).
template <typename B>
void binary_widened(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  using ops::BinaryOp;
  auto run = [&]<BinaryOp Op>() {
    const auto f = [](const float& x, const B& y) {
      return math::binary_value<float>(Op, x, convert<float, B>(y));
    };
    binary_map<float, float, decltype(f), B>(out, a, b, f);
  };
  // Fixed at compile time, as binary_fixed, so the loops vectorise.
  if (op == BinaryOp::add) return run.template operator()<BinaryOp::add>();
  if (op == BinaryOp::sub) return run.template operator()<BinaryOp::sub>();
  run.template operator()<BinaryOp::mul>();
}

void binary(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  if (ops::binary_mixed<BFloat16, Half>(
          op, out, a, b, [&](auto b16) { binary_widened<decltype(b16)>(op, out, a, b); }))
    return;
  TALLY_DISPATCH_ALL(a.dtype(), ops::binary_op_name(op), [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    if (math::is_compare(op)) {
      binary_map<bool, T>(out, a, b, [op](const T& x, const T& y) {
        return math::compare_value(op, static_cast<double>(static_cast<A>(x)),
                                   static_cast<double>(static_cast<A>(y)));
      });
      return;
    }
    if constexpr (std::is_floating_point_v<A>) {
      using ops::BinaryOp;
      // The ops of a training step.
      if (binary_fixed_of<T, BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div,
                          BinaryOp::relu_backward, BinaryOp::add_relu, BinaryOp::silu_backward,
                          BinaryOp::silu_mul>(op, out, a, b))
        return;
    }
    binary_map<T, T>(out, a, b, [op](const T& x, const T& y) {
      return T(math::binary_value<A>(op, static_cast<A>(x), static_cast<A>(y)));
    });
  });
}

void binary_scalar(ops::BinaryOp op, const Tensor& out, const Tensor& a, double b, bool reverse) {
  TALLY_DISPATCH_ALL(a.dtype(), ops::binary_op_name(op), [&] {
    using T = scalar_t;
    using A = std::conditional_t<std::is_floating_point_v<acc_t<T>>, acc_t<T>, double>;
    const A s = static_cast<A>(b);
    if (math::is_compare(op)) {
      map2<bool, T>(out, a, [&](bool& d, const T& v) {
        const double x = static_cast<double>(static_cast<acc_t<T>>(v));
        d = reverse ? math::compare_value(op, b, x) : math::compare_value(op, x, b);
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

// unary with the op fixed at compile time (math::unary_value's switch folds away).
template <ops::UnaryOp Op, typename T>
void unary_fixed(const Tensor& out, const Tensor& a) {
  using A = acc_t<T>;
  map2<T, T>(out, a, [](T& d, const T& x) { d = T(math::unary_value<A>(Op, static_cast<A>(x))); });
}

// unary_fixed for op where it is one of Ops; false otherwise.
template <typename T, ops::UnaryOp... Ops>
bool unary_fixed_of(ops::UnaryOp op, const Tensor& out, const Tensor& a) {
  return ((op == Ops && (unary_fixed<Ops, T>(out, a), true)) || ...);
}

void unary(ops::UnaryOp op, const Tensor& out, const Tensor& a) {
  TALLY_DISPATCH_FLOAT(a.dtype(), ops::unary_op_name(op), [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    using ops::UnaryOp;
    // The cheap ops, where the switch and branches would cost the most.
    if (unary_fixed_of<T, UnaryOp::relu, UnaryOp::neg, UnaryOp::abs, UnaryOp::square, UnaryOp::sqrt,
                       UnaryOp::rsqrt>(op, out, a))
      return;
    map2<T, T>(out, a,
               [&](T& d, const T& x) { d = T(math::unary_value<A>(op, static_cast<A>(x))); });
  });
}

void lerp(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& w, double w_scalar) {
  TALLY_DISPATCH_FLOAT(out.dtype(), "lerp", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    T* po = base<T>(out);
    const T* pa = base<T>(a);
    const T* pb = base<T>(b);
    auto at = [](const T* p, int64_t i) { return static_cast<A>(p[i]); };
    if (!w.defined()) {
      const A ws = static_cast<A>(w_scalar);
      strided_runs<3>(
          {&out, &a, &b}, [&](std::array<int64_t, 3> o, int64_t n, std::array<int64_t, 3> s) {
            for (int64_t i = 0; i < n; ++i)
              po[o[0] + i * s[0]] =
                  T(math::lerp_value<A>(at(pa, o[1] + i * s[1]), at(pb, o[2] + i * s[2]), ws));
          });
      return;
    }
    const T* pw = base<T>(w);
    strided_runs<4>(
        {&out, &a, &b, &w}, [&](std::array<int64_t, 4> o, int64_t n, std::array<int64_t, 4> s) {
          for (int64_t i = 0; i < n; ++i)
            po[o[0] + i * s[0]] = T(math::lerp_value<A>(
                at(pa, o[1] + i * s[1]), at(pb, o[2] + i * s[2]), at(pw, o[3] + i * s[3])));
        });
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
        {&out, &cond, &a, &b}, [&](std::array<int64_t, 4> o, int64_t n, std::array<int64_t, 4> s) {
          for (int64_t i = 0; i < n; ++i)
            po[o[0] + i * s[0]] = pc[o[1] + i * s[1]] ? pa[o[2] + i * s[2]] : pb[o[3] + i * s[3]];
        });
  });
}

// Adds the elements [begin, end) of `loop` (operands: the scratch accumulator, t) into acc,
// in order: element e into acc[its accumulator offset], as Acc (double, or int64 for the
// integers).
template <typename Acc, typename T>
void sum_range(const StridedLoop<2>& loop, int64_t begin, int64_t end, int64_t t_offset, const T* p,
               Acc* acc) {
  loop.runs(begin, end, {0, t_offset},
            [&](std::array<int64_t, 2> o, int64_t n, std::array<int64_t, 2> s) {
              const T* r = p + o[1];
              if (s[0] == 0) {  // one accumulator for the run: keep it in a register
                Acc a = acc[o[0]];
                for (int64_t i = 0; i < n; ++i)
                  a += static_cast<Acc>(static_cast<acc_t<T>>(r[i * s[1]]));
                acc[o[0]] = a;
              } else {
                for (int64_t i = 0; i < n; ++i)
                  acc[o[0] + i * s[0]] += static_cast<Acc>(static_cast<acc_t<T>>(r[i * s[1]]));
              }
            });
}

// sum into the scratch accumulator acc [n_out] through `ost` (out's contiguous strides, 0 on
// reduced dims). Over large tensors in parallel, with a result that does not depend on the
// thread count:
// - several outputs: the tensor is split along its outermost kept dim, so each output is
//   summed by one thread in the serial loop's order (the same bits as serially);
// - one output: fixed blocks of kParallelGrain elements summed separately, then added in
//   order (block_partials).
template <typename Acc, typename T>
void sum_into(std::vector<Acc>& acc, const Shape& ost, const Tensor& t) {
  const T* p = base<T>(t);
  const Shape& sizes = t.sizes();
  const StridedLoop<2> loop(sizes, {ost.data(), t.strides().data()});
  const int64_t numel = loop.numel();
  if (acc.size() == 1) {
    const std::vector<Acc> partial =
        block_partials<Acc>(numel, kParallelGrain, [&](int64_t begin, int64_t end) {
          Acc a{};
          sum_range<Acc, T>(loop, begin, end, t.storage_offset(), p, &a);
          return a;
        });
    for (const Acc& a : partial) acc[0] += a;
    return;
  }
  size_t d = 0;  // the outermost kept dim of more than one element (n_out > 1: one exists)
  while (d < sizes.size() && (ost[d] == 0 || sizes[d] == 1)) ++d;
  if (numel < 2 * kParallelGrain || d == sizes.size()) {
    sum_range<Acc, T>(loop, 0, numel, t.storage_offset(), p, acc.data());
    return;
  }
  const int64_t per_index = numel / sizes[d];  // elements under one index of dim d
  parallel_for(sizes[d], grain_of(per_index), [&](int64_t begin, int64_t end) {
    Shape part = sizes;
    part[d] = end - begin;
    const StridedLoop<2> sub(part, {ost.data(), t.strides().data()});
    sum_range<Acc, T>(sub, 0, sub.numel(), t.storage_offset() + begin * t.strides()[d], p,
                      acc.data() + begin * ost[d]);
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
  if (n_out > 0) {
    TALLY_DISPATCH_ALL(t.dtype(), "sum", [&] {
      if (integral)
        sum_into<int64_t, scalar_t>(iacc, ost, t);
      else
        sum_into<double, scalar_t>(acc, ost, t);
    });
  }
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
