// CUDA kernels of the reduce family. Every kernel is a row reduction (tensor/cuda/
// reduce.cuh): a row is the set of elements reduced into one output, walked by a thread, a
// warp, a block or a column tile depending on its length and layout, read through the
// input's strides.
// Selections (max/min with indices, amax/amin) compare in the accumulation type and follow
// the CPU's order exactly (NaN first, then the first of equal values); statistics (var/std,
// logsumexp) accumulate in double with the CPU's two passes.
#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/reduce.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/reduce/kernels.h"

namespace tally::cuda {
namespace {

using rows::Mode;
using rows::Pair;
using rows::RowIter;
using rows::RowOffsets;
using rows::Walk;

std::vector<bool> only_dim(int64_t rank, int64_t dim) {
  std::vector<bool> reduce(static_cast<size_t>(rank), false);
  reduce[static_cast<size_t>(dim)] = true;
  return reduce;
}

// The rows of a reduction of x over the dims in `reduce`.
struct RowPlan {
  Shape kept;        // x's sizes with the reduced dims set to 1
  int64_t rows = 0;  // positions of the kept dims
  int64_t n = 0;     // elements a row
  RowOffsets red;    // element offsets inside a row (x's strides)
  Mode mode = Mode::thread;
};

RowPlan row_plan(const Tensor& x, const std::vector<bool>& reduce) {
  RowPlan p;
  p.kept = x.sizes();
  Shape rsz, rst;
  for (size_t d = 0; d < p.kept.size(); ++d) {
    if (!reduce[d]) continue;
    rsz.push_back(x.sizes()[d]);
    rst.push_back(x.strides()[d]);
    p.kept[d] = 1;
  }
  p.rows = shape_numel(p.kept);
  p.n = shape_numel(rsz);
  p.red = rows::row_offsets(rsz, rst);
  p.mode = rows::choose(p.rows, p.n, p.red.inner_contiguous());
  return p;
}

// ------------------------------------------------------------------ selections

// values[row] (optional) <- the selected element, indices[row] (optional) <- its row index.
// kept operands: x, values (or indices), indices (or values).
template <typename T, bool IsMax, Mode M>
__global__ void select_kernel(T* values, int64_t* indices, const T* x, int64_t nrows, int64_t n,
                              RowOffsets red, Indexer<3> kept) {
  using A = dacc_t<T>;
  using V = std::conditional_t<std::is_same_v<A, bool>, int, A>;
  constexpr int G = Walk<M>::kLanes;
  const int lane = Walk<M>::lane();
  rows::for_each_row<M>(nrows, n, kept, [&](const RowIter<M>& it, const int64_t* o, int64_t len) {
    Pair<V> best{V{}, -1};  // this lane's selection, its elements in increasing order
    for (int64_t i = lane; i < len; i += G) {
      const V v = static_cast<V>(load(x[o[0] + red(i)]));
      if (best.i < 0 || rows::replaces<IsMax>(v, best.v)) best = {v, i};
    }
    best = rows::group_reduce<M>(best, rows::SelectOp<IsMax>{});
    if (it.active && lane == 0 && best.i >= 0) {
      if (values) values[o[1]] = x[o[0] + red(best.i)];
      if (indices) indices[o[2]] = best.i;
    }
  });
}

template <bool IsMax>
void select(const char* name, const Tensor& values, const Tensor& indices, const Tensor& x,
            const std::vector<bool>& reduce) {
  const RowPlan p = row_plan(x, reduce);
  if (p.rows == 0) return;
  NvtxRange range(name);
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  const Tensor& a = values.defined() ? values : indices;
  const Tensor& b = indices.defined() ? indices : values;
  const Indexer<3> kept =
      make_indexer<3>(p.kept, {&x.strides(), &a.strides(), &b.strides()},
                      {x.storage_offset(), a.storage_offset(), b.storage_offset()});
  int64_t* pi = indices.defined() ? static_cast<int64_t*>(indices.storage().data()) : nullptr;
  TALLY_DISPATCH_ALL(x.dtype(), name, [&] {
    using T = dev_t<scalar_t>;
    T* pv = values.defined() ? dptr<scalar_t>(values) : nullptr;
    const T* px = dptr<scalar_t>(x);
    rows::launch_rows(p.mode, p.rows, [&](auto mode, unsigned grid) {
      constexpr Mode M = decltype(mode)::value;
      select_kernel<T, IsMax, M>
          <<<grid, Walk<M>::kThreads, 0, stream(dev)>>>(pv, pi, px, p.rows, p.n, p.red, kept);
    });
  });
  check_launch(name);
}

// ------------------------------------------------------------------ statistics

template <typename T, Mode M>
__global__ void var_kernel(T* out, const T* x, int64_t nrows, int64_t n, RowOffsets red,
                           Indexer<2> kept, double divisor, bool take_sqrt) {
  using A = dacc_t<T>;
  constexpr int G = Walk<M>::kLanes;
  const int lane = Walk<M>::lane();
  rows::for_each_row<M>(nrows, n, kept, [&](const RowIter<M>& it, const int64_t* o, int64_t len) {
    // Two passes, as the CPU: the mean, then the squared deviations from it.
    double s = 0.0;
    for (int64_t i = lane; i < len; i += G) s += static_cast<double>(load(x[o[0] + red(i)]));
    s = rows::group_reduce<M>(s, rows::SumOp{});
    const double mean = s / static_cast<double>(n);
    double ss = 0.0;
    for (int64_t i = lane; i < len; i += G) {
      const double dv = static_cast<double>(load(x[o[0] + red(i)])) - mean;
      ss += dv * dv;
    }
    ss = rows::group_reduce<M>(ss, rows::SumOp{});
    if (it.active && lane == 0) {
      double v = ss / divisor;
      if (take_sqrt) v = sqrt(v);
      out[o[1]] = store<T>(static_cast<A>(v));
    }
  });
}

template <typename T, Mode M>
__global__ void logsumexp_kernel(T* out, const T* x, int64_t nrows, int64_t n, RowOffsets red,
                                 Indexer<2> kept) {
  using A = dacc_t<T>;
  constexpr int G = Walk<M>::kLanes;
  const int lane = Walk<M>::lane();
  rows::for_each_row<M>(nrows, n, kept, [&](const RowIter<M>& it, const int64_t* o, int64_t len) {
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t i = lane; i < len; i += G) {
      const auto v = static_cast<double>(load(x[o[0] + red(i)]));
      if (v > m) m = v;
    }
    m = rows::group_reduce<M>(m, rows::MaxOp{});
    // An infinite max (all -inf, or some +inf) shifts by 0: -inf, +inf.
    const double shift = isfinite(m) ? m : 0.0;
    double s = 0.0;
    for (int64_t i = lane; i < len; i += G)
      s += exp(static_cast<double>(load(x[o[0] + red(i)])) - shift);
    s = rows::group_reduce<M>(s, rows::SumOp{});
    if (it.active && lane == 0) out[o[1]] = store<T>(static_cast<A>(log(s) + shift));
  });
}

Indexer<2> kept_indexer(const RowPlan& p, const Tensor& x, const Tensor& out) {
  return make_indexer<2>(p.kept, {&x.strides(), &out.strides()},
                         {x.storage_offset(), out.storage_offset()});
}

// ------------------------------------------------------------------ backward

template <typename T>
__global__ void scatter_kernel(T* grad_input, const T* grad, const int64_t* indices, int64_t total,
                               Indexer<3> ix, int64_t n, int64_t gs) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t o[3];
    ix.get(k, o);
    const int64_t i = indices[o[2]];
    if (i < 0 || i >= n) continue;  // cannot throw from here: the gradient stays 0
    grad_input[o[0] + i * gs] = grad[o[1]];
  }
}

void max_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim) {
  select<true>("max", values, indices, x, only_dim(x.dim(), dim));
}

void min_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim) {
  select<false>("min", values, indices, x, only_dim(x.dim(), dim));
}

void amax(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce) {
  select<true>("amax", out, Tensor(), x, reduce);
}

void amin(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce) {
  select<false>("amin", out, Tensor(), x, reduce);
}

void var(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce, double correction,
         bool take_sqrt) {
  const char* name = take_sqrt ? "std" : "var";
  const RowPlan p = row_plan(x, reduce);
  if (p.rows == 0) return;
  NvtxRange range(name);
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  const double divisor = std::max(0.0, static_cast<double>(p.n) - correction);
  const Indexer<2> kept = kept_indexer(p, x, out);
  TALLY_DISPATCH_FLOAT(x.dtype(), name, [&] {
    using T = dev_t<scalar_t>;
    rows::launch_rows(p.mode, p.rows, [&](auto mode, unsigned grid) {
      constexpr Mode M = decltype(mode)::value;
      var_kernel<T, M><<<grid, Walk<M>::kThreads, 0, stream(dev)>>>(
          dptr<scalar_t>(out), dptr<scalar_t>(x), p.rows, p.n, p.red, kept, divisor, take_sqrt);
    });
  });
  check_launch(name);
}

void logsumexp(const Tensor& out, const Tensor& x, const std::vector<bool>& reduce) {
  const RowPlan p = row_plan(x, reduce);
  if (p.rows == 0) return;
  NvtxRange range("logsumexp");
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  const Indexer<2> kept = kept_indexer(p, x, out);
  TALLY_DISPATCH_FLOAT(x.dtype(), "logsumexp", [&] {
    using T = dev_t<scalar_t>;
    rows::launch_rows(p.mode, p.rows, [&](auto mode, unsigned grid) {
      constexpr Mode M = decltype(mode)::value;
      logsumexp_kernel<T, M><<<grid, Walk<M>::kThreads, 0, stream(dev)>>>(
          dptr<scalar_t>(out), dptr<scalar_t>(x), p.rows, p.n, p.red, kept);
    });
  });
  check_launch("logsumexp");
}

void value_selecting_reduction_backward(const Tensor& grad_input, const Tensor& grad,
                                        const Tensor& indices, int64_t dim) {
  const auto d = static_cast<size_t>(dim);
  Shape kept = grad_input.sizes();
  kept[d] = 1;
  const int64_t total = shape_numel(kept);
  if (total == 0) return;
  NvtxRange range("value_selecting_reduction_backward");
  const int dev = grad_input.device().index;
  DeviceGuard guard(dev);
  const Indexer<3> ix = make_indexer<3>(
      kept, {&grad_input.strides(), &grad.strides(), &indices.strides()},
      {grad_input.storage_offset(), grad.storage_offset(), indices.storage_offset()});
  const int64_t n = grad_input.sizes()[d], gs = grad_input.strides()[d];
  constexpr int kThreads = 256;
  const auto grid = static_cast<unsigned>(
      std::clamp<int64_t>((total + kThreads - 1) / kThreads, 1, rows::kMaxGrid));
  TALLY_DISPATCH_FLOAT(grad_input.dtype(), "value_selecting_reduction_backward", [&] {
    using T = dev_t<scalar_t>;
    scatter_kernel<T><<<grid, kThreads, 0, stream(dev)>>>(
        dptr<scalar_t>(grad_input), dptr<scalar_t>(grad),
        static_cast<const int64_t*>(indices.storage().data()), total, ix, n, gs);
  });
  check_launch("value_selecting_reduction_backward");
}

}  // namespace

const ReduceKernels reduce_kernels{TALLY_REDUCE_KERNELS};

}  // namespace tally::cuda
