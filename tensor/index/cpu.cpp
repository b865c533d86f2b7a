// CPU reference kernels of the index family: plain serial loops over row-major coordinates,
// every operand read and written through its strides. Sums run in double (int64 for
// integers); sort is std::stable_sort with NaN the largest value.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "tensor/index/kernels.h"

namespace tally::cpu {

namespace {

template <typename T>
T* base(const Tensor& t) {
  return static_cast<T*>(t.storage().data()) + t.storage_offset();
}

// Calls fn(coords) for every coordinate of `sizes` in row-major order.
template <typename Fn>
void for_each_coord(const Shape& sizes, Fn&& fn) {
  if (shape_numel(sizes) == 0) return;
  Shape c(sizes.size(), 0);
  while (true) {
    fn(c);
    int64_t d = static_cast<int64_t>(sizes.size()) - 1;
    for (; d >= 0; --d) {
      const auto u = static_cast<size_t>(d);
      if (++c[u] < sizes[u]) break;
      c[u] = 0;
    }
    if (d < 0) return;
  }
}

int64_t offset_of(const Tensor& t, const Shape& c) {
  int64_t o = 0;
  for (size_t d = 0; d < c.size(); ++d) o += c[d] * t.strides()[d];
  return o;
}

int64_t checked_index(int64_t i, int64_t n, const char* op, int64_t dim) {
  if (i < -n || i >= n)
    throw std::out_of_range(
        fmt::format("{}: index {} is out of bounds for dim {} of size {}", op, i, dim, n));
  return i < 0 ? i + n : i;
}

template <typename A>
bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>)
    return std::isnan(v);
  else
    return (void)v, false;
}

void gather(const Tensor& out, const Tensor& x, const Tensor& index, int64_t dim) {
  const auto d = static_cast<size_t>(dim);
  const int64_t n = x.sizes()[d];
  const int64_t* pi = base<int64_t>(index);
  TALLY_DISPATCH_ALL(x.dtype(), "gather", [&] {
    const scalar_t* px = base<scalar_t>(x);
    scalar_t* po = base<scalar_t>(out);
    for_each_coord(out.sizes(), [&](Shape& c) {
      const int64_t i = checked_index(pi[offset_of(index, c)], n, "gather", dim);
      const int64_t oo = offset_of(out, c);
      const int64_t keep = c[d];
      c[d] = i;
      po[oo] = px[offset_of(x, c)];
      c[d] = keep;
    });
  });
}

void scatter(const Tensor& out, const Tensor& src, const Tensor& index, int64_t dim,
             ScatterReduce reduce, double alpha) {
  const auto d = static_cast<size_t>(dim);
  const int64_t n = out.sizes()[d];
  const int64_t* pi = base<int64_t>(index);
  const char* name = reduce == ScatterReduce::add ? "scatter_add" : "scatter";
  TALLY_DISPATCH_ALL(out.dtype(), name, [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* ps = base<scalar_t>(src);
    scalar_t* po = base<scalar_t>(out);
    for_each_coord(index.sizes(), [&](Shape& c) {
      const int64_t i = checked_index(pi[offset_of(index, c)], n, name, dim);
      const scalar_t v = ps[offset_of(src, c)];
      const int64_t keep = c[d];
      c[d] = i;
      scalar_t& dst = po[offset_of(out, c)];
      c[d] = keep;
      const auto cur = static_cast<double>(static_cast<A>(dst));
      const auto val = static_cast<double>(static_cast<A>(v));
      if (reduce == ScatterReduce::add)
        dst = static_cast<scalar_t>(static_cast<A>(cur + alpha * val));
      else if (reduce == ScatterReduce::multiply)
        dst = static_cast<scalar_t>(static_cast<A>(cur * val));
      else
        dst = v;
    });
  });
}

void scan(const Tensor& out, const Tensor& x, int64_t dim, bool reverse, bool prod) {
  const auto d = static_cast<size_t>(dim);
  const RowsAlong ra = rows_along(x, dim);
  const Shape& rows = ra.shape;
  const int64_t n = ra.n;
  const int64_t xs = x.strides()[d], os = out.strides()[d];
  TALLY_DISPATCH_ALL(x.dtype(), "cumsum", [&] {
    using X = scalar_t;
    using S = std::conditional_t<std::is_floating_point_v<acc_t<X>>, double, int64_t>;
    const X* px = base<scalar_t>(x);
    TALLY_DISPATCH_ALL(out.dtype(), "cumsum", [&] {
      using O = scalar_t;
      O* po = base<O>(out);
      for_each_coord(rows, [&](const Shape& c) {
        const int64_t xo = offset_of(x, c), oo = offset_of(out, c);
        S s = prod ? 1 : 0;
        for (int64_t k = 0; k < n; ++k) {
          const int64_t j = reverse ? n - 1 - k : k;
          const auto v = static_cast<S>(static_cast<acc_t<X>>(px[xo + j * xs]));
          s = prod ? s * v : s + v;
          po[oo + j * os] = static_cast<O>(static_cast<acc_t<O>>(s));
        }
      });
    });
  });
}

void sort(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim,
          bool descending) {
  const auto d = static_cast<size_t>(dim);
  const RowsAlong ra = rows_along(x, dim);
  const Shape& rows = ra.shape;
  const int64_t n = ra.n;
  const int64_t xs = x.strides()[d], vs = values.strides()[d], is = indices.strides()[d];
  std::vector<int64_t> order(static_cast<size_t>(n));
  TALLY_DISPATCH_ALL(x.dtype(), "sort", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* px = base<scalar_t>(x);
    scalar_t* pv = base<scalar_t>(values);
    int64_t* pidx = base<int64_t>(indices);
    for_each_coord(rows, [&](const Shape& c) {
      const int64_t xo = offset_of(x, c), vo = offset_of(values, c), io = offset_of(indices, c);
      std::iota(order.begin(), order.end(), int64_t{0});
      auto key = [&](int64_t i) { return static_cast<A>(px[xo + i * xs]); };
      std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) {
        const A a = key(i), b = key(j);
        if (descending) return (is_nan(a) && !is_nan(b)) || a > b;
        return !is_nan(a) && (is_nan(b) || a < b);
      });
      for (int64_t k = 0; k < n; ++k) {
        pv[vo + k * vs] = px[xo + order[static_cast<size_t>(k)] * xs];
        pidx[io + k * is] = order[static_cast<size_t>(k)];
      }
    });
  });
}

void remap(const Tensor& out, const Tensor& x, const std::vector<bool>& flip,
           const std::vector<int64_t>& shift) {
  TALLY_DISPATCH_ALL(x.dtype(), "flip", [&] {
    const scalar_t* px = base<scalar_t>(x);
    scalar_t* po = base<scalar_t>(out);
    Shape s(x.sizes().size());
    for_each_coord(out.sizes(), [&](const Shape& c) {
      for (size_t k = 0; k < c.size(); ++k) {
        const int64_t n = x.sizes()[k];
        s[k] = flip[k] ? n - 1 - c[k] : (c[k] - shift[k] + n) % n;
      }
      po[offset_of(out, c)] = px[offset_of(x, s)];
    });
  });
}

// Over dense's (the mask's) shape in row-major order: select copies dense into
// flat[positions - 1] where mask is set; otherwise flat[positions - 1] goes into dense.
template <bool Select>
void masked(const Tensor& a, const Tensor& b, const Tensor& mask, const Tensor& positions) {
  const MaskedOperands m = masked_operands<Select>(a, b);
  const bool* pm = base<bool>(mask);
  const int64_t* pp = base<int64_t>(positions);
  const int64_t fs = m.flat.strides()[0];
  TALLY_DISPATCH_ALL(m.dense.dtype(), m.name, [&] {
    scalar_t* pd = base<scalar_t>(m.dense);
    scalar_t* pf = base<scalar_t>(m.flat);
    int64_t lin = 0;
    for_each_coord(m.dense.sizes(), [&](const Shape& c) {
      if (pm[offset_of(mask, c)]) {
        scalar_t& f = pf[(pp[lin] - 1) * fs];
        scalar_t& d = pd[offset_of(m.dense, c)];
        if constexpr (Select)
          f = d;
        else
          d = f;
      }
      ++lin;
    });
  });
}

}  // namespace

const IndexKernels index_kernels{TALLY_INDEX_KERNELS};

}  // namespace tally::cpu
