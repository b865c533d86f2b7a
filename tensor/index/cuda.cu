// CUDA kernels of the index family: one thread per element (per row for cumsum), a
// grid-stride loop over row-major coordinates, every operand read and written through its
// strides. scatter_add and index_add add with atomics (the order of duplicate indices'
// additions is unspecified, as in PyTorch); sort ranks each element against its row (stable,
// NaN the largest value, O(n^2) work a row: right for rows of up to some thousands).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/index/kernels.h"

namespace tally::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535LL * 16;

// Sizes of an iteration space and the strides of N operands over it (rank <= kMaxDims).
template <int N>
struct Layout {
  int nd = 0;
  int64_t size[kMaxDims];
  int64_t st[N][kMaxDims];
  int64_t base[N];

  // Offsets of the operands at linear index k; coords written to c when given.
  __device__ void get(int64_t k, int64_t* off, int64_t* c = nullptr) const {
    for (int j = 0; j < N; ++j) off[j] = base[j];
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t i = k % size[d];
      k /= size[d];
      if (c) c[d] = i;
      for (int j = 0; j < N; ++j) off[j] += i * st[j][d];
    }
  }
};

template <int N>
Layout<N> layout(const char* op, const Shape& sizes, std::initializer_list<const Tensor*> ts) {
  if (sizes.size() > static_cast<size_t>(kMaxDims))
    throw std::invalid_argument(std::string(op) + ": the CUDA kernel takes at most " +
                                std::to_string(kMaxDims) + " dims, got " + shape_str(sizes));
  Layout<N> l;
  l.nd = static_cast<int>(sizes.size());
  int j = 0;
  for (const Tensor* t : ts) {
    for (size_t d = 0; d < sizes.size(); ++d) l.st[j][d] = t->strides()[d];
    l.base[j] = t->storage_offset();
    ++j;
  }
  for (size_t d = 0; d < sizes.size(); ++d) l.size[d] = sizes[d];
  return l;
}

unsigned grid_for(int64_t total) {
  return static_cast<unsigned>(std::clamp<int64_t>((total + kThreads - 1) / kThreads, 1, kMaxGrid));
}

#define TALLY_GRID_STRIDE(k, total)                                                          \
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < (total); \
       k += static_cast<int64_t>(gridDim.x) * blockDim.x)

template <typename T>
__device__ __forceinline__ bool is_nan(T v) {
  if constexpr (std::is_floating_point_v<T>)
    return isnan(v);
  else
    return (void)v, false;
}

template <typename T>
__device__ __forceinline__ void atomic_add(T* p, T v) {
  if constexpr (std::is_same_v<T, int64_t>)
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
  else if constexpr (sizeof(T) == 1) {  // uint8 (bool never comes: the ops refuse it)
    auto* word = reinterpret_cast<unsigned int*>(reinterpret_cast<size_t>(p) & ~size_t{3});
    const unsigned shift = (reinterpret_cast<size_t>(p) & 3) * 8;
    unsigned int old = *word, assumed;
    do {
      assumed = old;
      const auto cur = static_cast<uint8_t>((assumed >> shift) & 0xffu);
      const auto sum = static_cast<uint8_t>(cur + static_cast<uint8_t>(v));
      old = atomicCAS(word, assumed,
                      (assumed & ~(0xffu << shift)) | (static_cast<unsigned>(sum) << shift));
    } while (assumed != old);
  } else
    atomicAdd(p, v);
}

// ------------------------------------------------------------------ gather / scatter

// operands: out, index, x (x's stride at dim zeroed: the index supplies it)
template <typename T>
__global__ void gather_kernel(T* out, const int64_t* index, const T* x, int64_t total, Layout<3> l,
                              int64_t n, int64_t xs) {
  TALLY_GRID_STRIDE(k, total) {
    int64_t o[3];
    l.get(k, o);
    int64_t i = index[o[1]];
    if (i < 0) i += n;
    out[o[0]] = i < 0 || i >= n ? T{} : x[o[2] + i * xs];  // out of range: 0 (cannot throw)
  }
}

// operands: index, src, out (out's stride at dim zeroed)
template <typename T>
__global__ void scatter_kernel(T* out, const T* src, const int64_t* index, int64_t total,
                               Layout<3> l, int64_t n, int64_t os, bool add, double alpha) {
  TALLY_GRID_STRIDE(k, total) {
    int64_t o[3];
    l.get(k, o);
    int64_t i = index[o[0]];
    if (i < 0) i += n;
    if (i < 0 || i >= n) continue;
    T* dst = out + o[2] + i * os;
    const T v = src[o[1]];
    if (!add) {
      *dst = v;
    } else if (alpha == 1.0) {
      atomic_add(dst, v);
    } else {
      atomic_add(dst, store<T>(static_cast<double>(load(v)) * alpha));
    }
  }
}

template <typename T>
const T* iptr(const Tensor& t) {
  return static_cast<const T*>(t.storage().data());
}

void gather(const Tensor& out, const Tensor& x, const Tensor& index, int64_t dim) {
  const auto d = static_cast<size_t>(dim);
  const int64_t total = out.numel();
  Layout<3> l = layout<3>("gather", out.sizes(), {&out, &index, &x});
  l.st[2][d] = 0;
  NvtxRange range("gather");
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  TALLY_DISPATCH_ALL(x.dtype(), "gather", [&] {
    gather_kernel<dev_t<scalar_t>><<<grid_for(total), kThreads, 0, stream(dev)>>>(
        dptr<scalar_t>(out), iptr<int64_t>(index), dptr<scalar_t>(x), total, l, x.sizes()[d],
        x.strides()[d]);
  });
  check_launch("gather");
}

void scatter(const Tensor& out, const Tensor& src, const Tensor& index, int64_t dim, bool add,
             double alpha) {
  const char* name = add ? "scatter_add" : "scatter";
  const auto d = static_cast<size_t>(dim);
  const int64_t total = index.numel();
  Layout<3> l = layout<3>(name, index.sizes(), {&index, &src, &out});
  l.st[2][d] = 0;
  NvtxRange range(name);
  const int dev = out.device().index;
  DeviceGuard guard(dev);
  TALLY_DISPATCH_ALL(out.dtype(), name, [&] {
    scatter_kernel<dev_t<scalar_t>><<<grid_for(total), kThreads, 0, stream(dev)>>>(
        dptr<scalar_t>(out), dptr<scalar_t>(src), iptr<int64_t>(index), total, l, out.sizes()[d],
        out.strides()[d], add, alpha);
  });
  check_launch(name);
}

// ------------------------------------------------------------------ cumsum

// One thread a row; operands x, out over the rows (dim's size 1). S: double or int64.
template <typename X, typename O, typename S>
__global__ void cumsum_kernel(O* out, const X* x, int64_t rows, Layout<2> l, int64_t n, int64_t xs,
                              int64_t os, bool reverse) {
  TALLY_GRID_STRIDE(r, rows) {
    int64_t o[2];
    l.get(r, o);
    S s = 0;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t j = reverse ? n - 1 - k : k;
      s += static_cast<S>(load(x[o[0] + j * xs]));
      out[o[1] + j * os] = store<O>(s);
    }
  }
}

void cumsum(const Tensor& out, const Tensor& x, int64_t dim, bool reverse) {
  const auto d = static_cast<size_t>(dim);
  Shape rows_shape = x.sizes();
  const int64_t n = rows_shape[d];
  rows_shape[d] = 1;
  const int64_t rows = shape_numel(rows_shape);
  const Layout<2> l = layout<2>("cumsum", rows_shape, {&x, &out});
  NvtxRange range("cumsum");
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  TALLY_DISPATCH_ALL(x.dtype(), "cumsum", [&] {
    using X = dev_t<scalar_t>;
    if constexpr (std::is_floating_point_v<acc_t<scalar_t>>) {
      cumsum_kernel<X, X, double><<<grid_for(rows), kThreads, 0, stream(dev)>>>(
          dptr<scalar_t>(out), dptr<scalar_t>(x), rows, l, n, x.strides()[d], out.strides()[d],
          reverse);
    } else {
      cumsum_kernel<X, int64_t, int64_t><<<grid_for(rows), kThreads, 0, stream(dev)>>>(
          dptr<int64_t>(out), dptr<scalar_t>(x), rows, l, n, x.strides()[d], out.strides()[d],
          reverse);
    }
  });
  check_launch("cumsum");
}

// ------------------------------------------------------------------ sort

// Whether a comes before b (ascending: NaN last; descending: NaN first).
template <typename A>
__device__ __forceinline__ bool before(A a, A b, bool descending) {
  if (descending) return (is_nan(a) && !is_nan(b)) || a > b;
  return !is_nan(a) && (is_nan(b) || a < b);
}

// One thread an element: its rank in its row is the count of elements before it (ties: the
// earlier index first, so the sort is stable). operands over the rows: x, values, indices.
template <typename T>
__global__ void sort_kernel(T* values, int64_t* indices, const T* x, int64_t total, Layout<3> l,
                            int64_t n, int64_t xs, int64_t vs, int64_t is, bool descending) {
  using A = dacc_t<T>;
  TALLY_GRID_STRIDE(k, total) {
    const int64_t row = k / n, i = k % n;
    int64_t o[3];
    l.get(row, o);
    const A a = load(x[o[0] + i * xs]);
    int64_t rank = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (j == i) continue;
      const A b = load(x[o[0] + j * xs]);
      if (before(b, a, descending) || (j < i && !before(a, b, descending))) ++rank;
    }
    values[o[1] + rank * vs] = x[o[0] + i * xs];
    indices[o[2] + rank * is] = i;
  }
}

void sort(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim,
          bool descending) {
  const auto d = static_cast<size_t>(dim);
  Shape rows_shape = x.sizes();
  const int64_t n = rows_shape[d];
  rows_shape[d] = 1;
  const int64_t total = shape_numel(rows_shape) * n;
  const Layout<3> l = layout<3>("sort", rows_shape, {&x, &values, &indices});
  NvtxRange range("sort");
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  TALLY_DISPATCH_ALL(x.dtype(), "sort", [&] {
    sort_kernel<dev_t<scalar_t>><<<grid_for(total), kThreads, 0, stream(dev)>>>(
        dptr<scalar_t>(values), dptr<int64_t>(indices), dptr<scalar_t>(x), total, l, n,
        x.strides()[d], values.strides()[d], indices.strides()[d], descending);
  });
  check_launch("sort");
}

// ------------------------------------------------------------------ flip / roll

struct Remap {
  int64_t shift[kMaxDims];  // -1: flip
};

// operands over out's shape: out, x (x read at the remapped coordinates).
template <typename T>
__global__ void remap_kernel(T* out, const T* x, int64_t total, Layout<2> l, Remap m) {
  TALLY_GRID_STRIDE(k, total) {
    int64_t o[2], c[kMaxDims];
    l.get(k, o, c);
    int64_t xo = l.base[1];
    for (int d = 0; d < l.nd; ++d) {
      const int64_t n = l.size[d];
      const int64_t s = m.shift[d] < 0 ? n - 1 - c[d] : (c[d] - m.shift[d] + n) % n;
      xo += s * l.st[1][d];
    }
    out[o[0]] = x[xo];
  }
}

void remap(const Tensor& out, const Tensor& x, const std::vector<bool>& flip,
           const std::vector<int64_t>& shift) {
  const int64_t total = out.numel();
  const Layout<2> l = layout<2>("flip", out.sizes(), {&out, &x});
  Remap m{};
  for (size_t d = 0; d < flip.size(); ++d) m.shift[d] = flip[d] ? -1 : shift[d];
  NvtxRange range("flip");
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  TALLY_DISPATCH_ALL(x.dtype(), "flip", [&] {
    remap_kernel<dev_t<scalar_t>><<<grid_for(total), kThreads, 0, stream(dev)>>>(
        dptr<scalar_t>(out), dptr<scalar_t>(x), total, l, m);
  });
  check_launch("flip");
}

// ------------------------------------------------------------------ masks

// operands over the mask's shape: x (or out), mask. select: out1d[pos - 1] = x; else
// x[...] = src1d[pos - 1].
template <typename T, bool Select>
__global__ void masked_kernel(T* dense, T* flat, const bool* mask, const int64_t* positions,
                              int64_t total, Layout<2> l, int64_t fs) {
  TALLY_GRID_STRIDE(k, total) {
    int64_t o[2];
    l.get(k, o);
    if (!mask[o[1]]) continue;
    const int64_t p = (positions[k] - 1) * fs;
    if constexpr (Select)
      flat[p] = dense[o[0]];
    else
      dense[o[0]] = flat[p];
  }
}

template <bool Select>
void masked(const char* name, const Tensor& dense, const Tensor& flat, const Tensor& mask,
            const Tensor& positions) {
  const int64_t total = dense.numel();
  const Layout<2> l = layout<2>(name, dense.sizes(), {&dense, &mask});
  NvtxRange range(name);
  const int dev = dense.device().index;
  DeviceGuard guard(dev);
  TALLY_DISPATCH_ALL(dense.dtype(), name, [&] {
    masked_kernel<dev_t<scalar_t>, Select><<<grid_for(total), kThreads, 0, stream(dev)>>>(
        dptr<scalar_t>(dense), dptr<scalar_t>(flat) + flat.storage_offset(),
        static_cast<const bool*>(mask.storage().data()),
        iptr<int64_t>(positions) + positions.storage_offset(), total, l, flat.strides()[0]);
  });
  check_launch(name);
}

void masked_select(const Tensor& out1d, const Tensor& x, const Tensor& mask,
                   const Tensor& positions) {
  masked<true>("masked_select", x, out1d, mask, positions);
}

void masked_scatter(const Tensor& out, const Tensor& src1d, const Tensor& mask,
                    const Tensor& positions) {
  masked<false>("masked_scatter", out, src1d, mask, positions);
}

}  // namespace

const IndexKernels index_kernels{TALLY_INDEX_KERNELS};

}  // namespace tally::cuda
