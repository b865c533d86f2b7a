// CUDA kernels of the index family: one thread per element (per row for strided
// cumsum/cumprod), a grid-stride loop over row-major coordinates, every operand read and
// written through its strides; a block a row where rows are contiguous (cumsum/cumprod along
// the last dim, and index_select / index_add_ / index_fill_ of rows of 64 elements or more).
// scatter_add, index_add and scatter(reduce='multiply') update with atomics (the order of duplicate
// indices' updates is unspecified, as in PyTorch). sort is stable with NaN the largest value: a
// bitonic sort in shared memory, one block a row, for rows of up to 2048 elements; cub's segmented
// radix sort (scratch: keys, positions, cub's temp) beyond.
#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/index/kernels.h"
#include "tensor/op_alloc.h"

// After cuda_fp16.h / cuda_bf16.h (device_types.cuh): cub then sorts __half and __nv_bfloat16.
#include <cub/device/device_segmented_sort.cuh>

namespace tally::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535LL * 16;

// The Indexer of N operands over `sizes` (rank <= kMaxDims), dims kept as they are (not merged:
// the kernels address dims by number).
template <int N>
Indexer<N> layout(const char* op, const Shape& sizes, std::initializer_list<const Tensor*> ts) {
  if (sizes.size() > static_cast<size_t>(kMaxDims))
    throw std::invalid_argument(std::string(op) + ": the CUDA kernel takes at most " +
                                std::to_string(kMaxDims) + " dims, got " + shape_str(sizes));
  Indexer<N> l;
  l.ndim = static_cast<int>(sizes.size());
  int j = 0;
  for (const Tensor* t : ts) {
    for (size_t d = 0; d < sizes.size(); ++d) l.strides[j][d] = t->strides()[d];
    l.base[j] = t->storage_offset();
    ++j;
  }
  for (size_t d = 0; d < sizes.size(); ++d) l.sizes[d] = sizes[d];
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

// *p = f(*p) atomically for an element of 1, 2, 4 or 8 bytes: a compare-and-swap loop on the
// aligned word that holds it.
template <typename T, typename F>
__device__ void atomic_update(T* p, F f) {
  using W = std::conditional_t<sizeof(T) == 8, unsigned long long, unsigned int>;
  constexpr unsigned kBits = 8 * sizeof(T);
  const size_t addr = reinterpret_cast<size_t>(p);
  W* word = reinterpret_cast<W*>(addr & ~(sizeof(W) - 1));
  const unsigned shift = sizeof(T) >= sizeof(W) ? 0 : (addr & (sizeof(W) - 1)) * 8;
  const W low = kBits >= 8 * sizeof(W) ? ~W{0} : ((W{1} << kBits) - 1);
  W old = *word, assumed;
  do {
    assumed = old;
    const W bits = (assumed >> shift) & low;
    T cur;
    memcpy(&cur, &bits, sizeof(T));
    const T next = f(cur);
    W nb = 0;
    memcpy(&nb, &next, sizeof(T));
    old = atomicCAS(word, assumed, (assumed & ~(low << shift)) | (nb << shift));
  } while (assumed != old);
}

template <typename T>
__device__ __forceinline__ void atomic_add(T* p, T v) {
  if constexpr (std::is_same_v<T, int64_t>)
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
  else if constexpr (sizeof(T) == 1)  // uint8 (bool never comes: the ops refuse it)
    atomic_update(p, [v](T cur) { return static_cast<T>(cur + v); });
  else
    atomicAdd(p, v);
}

// ------------------------------------------------------------------ gather / scatter

// operands: out, index, x (x's stride at dim zeroed: the index supplies it)
template <typename T>
__global__ void gather_kernel(T* out, const int64_t* index, const T* x, int64_t total, Indexer<3> l,
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
                               Indexer<3> l, int64_t n, int64_t os, ScatterReduce reduce,
                               double alpha) {
  TALLY_GRID_STRIDE(k, total) {
    int64_t o[3];
    l.get(k, o);
    int64_t i = index[o[0]];
    if (i < 0) i += n;
    if (i < 0 || i >= n) continue;
    T* dst = out + o[2] + i * os;
    const T v = src[o[1]];
    if (reduce == ScatterReduce::none) {
      *dst = v;
    } else if (reduce == ScatterReduce::multiply) {
      atomic_update(dst, [v](T cur) { return store<T>(load(cur) * load(v)); });
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

// ---- rows: the index varies only along dim (index_select, index_add_, index_fill_: the 1-D
// index viewed over the whole shape) and the dense operands are contiguous, so each selected
// row of `inner` elements (the dims after dim) is one contiguous run: a block a row, no
// per-element index arithmetic, 16-byte copies where the rows allow. Rows are (o, r) pairs of
// the `outer` leading positions and the m index entries.
struct Rows {
  int64_t outer = 0, m = 0, inner = 0, n = 0;  // n: the indexed tensor's size at dim
  int64_t ioff = 0, istride = 0;               // the index's offset and stride along dim
};

constexpr int64_t kRowMinInner = 64;  // shorter rows keep the element kernels

// The Rows of `shape` (out's for gather, index's for scatter) when the layout allows them.
std::optional<Rows> rows_of(const Shape& shape, const Tensor& index, int64_t dim,
                            const Tensor& dense, int64_t n) {
  const auto d = static_cast<size_t>(dim);
  if (!dense.is_contiguous() || dense.sizes().size() != shape.size()) return std::nullopt;
  for (size_t k = 0; k < shape.size(); ++k)
    if (k != d && (index.strides()[k] != 0 || dense.sizes()[k] != shape[k])) return std::nullopt;
  Rows r;
  r.outer = 1;
  r.inner = 1;
  for (size_t k = 0; k < d; ++k) r.outer *= shape[k];
  for (size_t k = d + 1; k < shape.size(); ++k) r.inner *= shape[k];
  if (r.inner < kRowMinInner) return std::nullopt;
  r.m = shape[d];
  r.n = n;
  r.ioff = index.storage_offset();
  r.istride = index.strides()[d];
  return r;
}

template <typename T>
__global__ void gather_rows_kernel(T* out, const int64_t* index, const T* x, Rows r, bool vec16) {
  for (int64_t row = blockIdx.x; row < r.outer * r.m; row += gridDim.x) {
    const int64_t o = row / r.m, j = row - o * r.m;
    int64_t i = index[r.ioff + j * r.istride];
    if (i < 0) i += r.n;
    T* dst = out + row * r.inner;
    if (i < 0 || i >= r.n) {  // out of range: 0 (cannot throw), as gather_kernel
      for (int64_t e = threadIdx.x; e < r.inner; e += blockDim.x) dst[e] = T{};
      continue;
    }
    const T* src = x + (o * r.n + i) * r.inner;
    if (vec16) {
      const int64_t words = r.inner * static_cast<int64_t>(sizeof(T)) / 16;
      for (int64_t e = threadIdx.x; e < words; e += blockDim.x)
        reinterpret_cast<uint4*>(dst)[e] = reinterpret_cast<const uint4*>(src)[e];
    } else {
      for (int64_t e = threadIdx.x; e < r.inner; e += blockDim.x) dst[e] = src[e];
    }
  }
}

// src_scalar: src is one value broadcast (index_fill_), else contiguous like the index's shape.
template <typename T>
__global__ void scatter_rows_kernel(T* out, const T* src, bool src_scalar, const int64_t* index,
                                    Rows r, ScatterReduce reduce, double alpha) {
  for (int64_t row = blockIdx.x; row < r.outer * r.m; row += gridDim.x) {
    const int64_t o = row / r.m, j = row - o * r.m;
    int64_t i = index[r.ioff + j * r.istride];
    if (i < 0) i += r.n;
    if (i < 0 || i >= r.n) continue;
    T* dst = out + (o * r.n + i) * r.inner;
    const T* s = src_scalar ? src : src + row * r.inner;
    for (int64_t e = threadIdx.x; e < r.inner; e += blockDim.x) {
      const T v = s[src_scalar ? 0 : e];
      if (reduce == ScatterReduce::none)
        dst[e] = v;
      else if (alpha == 1.0)
        atomic_add(dst + e, v);
      else
        atomic_add(dst + e, store<T>(static_cast<double>(load(v)) * alpha));
    }
  }
}

unsigned grid_for_rows(int64_t rows) {
  return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, kMaxGrid));
}

template <typename T>
bool aligned16(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

void gather(const Tensor& out, const Tensor& x, const Tensor& index, int64_t dim) {
  const auto d = static_cast<size_t>(dim);
  const int64_t total = out.numel();
  Indexer<3> l = layout<3>("gather", out.sizes(), {&out, &index, &x});
  l.strides[2][d] = 0;
  NvtxRange range("gather");
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  if (out.is_contiguous() && total > 0) {
    if (const std::optional<Rows> r = rows_of(out.sizes(), index, dim, x, x.sizes()[d])) {
      TALLY_DISPATCH_ALL(x.dtype(), "gather", [&] {
        using T = dev_t<scalar_t>;
        T* o = dptr<scalar_t>(out) + out.storage_offset();
        const T* src = dptr<scalar_t>(x) + x.storage_offset();
        const bool vec16 = (r->inner * static_cast<int64_t>(sizeof(T))) % 16 == 0 && aligned16(o) &&
                           aligned16(src);
        gather_rows_kernel<T><<<grid_for_rows(r->outer * r->m), kThreads, 0, stream(dev)>>>(
            o, iptr<int64_t>(index), src, *r, vec16);
      });
      check_launch("gather");
      return;
    }
  }
  TALLY_DISPATCH_ALL(x.dtype(), "gather", [&] {
    gather_kernel<dev_t<scalar_t>><<<grid_for(total), kThreads, 0, stream(dev)>>>(
        dptr<scalar_t>(out), iptr<int64_t>(index), dptr<scalar_t>(x), total, l, x.sizes()[d],
        x.strides()[d]);
  });
  check_launch("gather");
}

void scatter(const Tensor& out, const Tensor& src, const Tensor& index, int64_t dim,
             ScatterReduce reduce, double alpha) {
  const char* name = reduce == ScatterReduce::add ? "scatter_add" : "scatter";
  const auto d = static_cast<size_t>(dim);
  const int64_t total = index.numel();
  Indexer<3> l = layout<3>(name, index.sizes(), {&index, &src, &out});
  l.strides[2][d] = 0;
  NvtxRange range(name);
  const int dev = out.device().index;
  DeviceGuard guard(dev);
  const bool src_scalar =
      std::all_of(src.strides().begin(), src.strides().end(), [](int64_t st) { return st == 0; });
  if (total > 0 && reduce != ScatterReduce::multiply &&
      (src_scalar || (src.is_contiguous() && src.sizes() == index.sizes()))) {
    if (const std::optional<Rows> r = rows_of(index.sizes(), index, dim, out, out.sizes()[d])) {
      TALLY_DISPATCH_ALL(out.dtype(), name, [&] {
        using T = dev_t<scalar_t>;
        scatter_rows_kernel<T><<<grid_for_rows(r->outer * r->m), kThreads, 0, stream(dev)>>>(
            dptr<scalar_t>(out) + out.storage_offset(), dptr<scalar_t>(src) + src.storage_offset(),
            src_scalar, iptr<int64_t>(index), *r, reduce, alpha);
      });
      check_launch(name);
      return;
    }
  }
  TALLY_DISPATCH_ALL(out.dtype(), name, [&] {
    scatter_kernel<dev_t<scalar_t>><<<grid_for(total), kThreads, 0, stream(dev)>>>(
        dptr<scalar_t>(out), dptr<scalar_t>(src), iptr<int64_t>(index), total, l, out.sizes()[d],
        out.strides()[d], reduce, alpha);
  });
  check_launch(name);
}

// ------------------------------------------------------------------ cumsum / cumprod

// One thread a row; operands x, out over the rows (dim's size 1). S: double or int64.
template <typename X, typename O, typename S>
__global__ void scan_kernel(O* out, const X* x, int64_t rows, Indexer<2> l, int64_t n, int64_t xs,
                            int64_t os, bool reverse, bool prod) {
  TALLY_GRID_STRIDE(r, rows) {
    int64_t o[2];
    l.get(r, o);
    S s = prod ? 1 : 0;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t j = reverse ? n - 1 - k : k;
      const auto v = static_cast<S>(load(x[o[0] + j * xs]));
      s = prod ? s * v : s + v;
      out[o[1] + j * os] = store<O>(s);
    }
  }
}

// Rows contiguous along the scanned dim: one block a row, tiles of kScanThreads consecutive
// elements (coalesced), a warp-shuffle scan, then a scan of the warp totals, each tile
// starting from the total of those before it. The one-thread-a-row kernel above reads a row
// per thread (a warp's loads hit 32 rows): [4096, 4096] along dim 1 took 1.27 ms on the H100,
// against PyTorch's 0.18.
constexpr int kScanThreads = 256, kScanWarps = kScanThreads / 32;

template <typename S>
__device__ __forceinline__ S combine(S a, S b, bool prod) {
  return prod ? a * b : a + b;
}

template <typename X, typename O, typename S>
__global__ void __launch_bounds__(kScanThreads)
    scan_rows_kernel(O* out, const X* x, int64_t rows, Indexer<2> l, int64_t n, bool reverse,
                     bool prod) {
  __shared__ S warp_total[kScanWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const S identity = prod ? S(1) : S(0);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    int64_t o[2];
    l.get(row, o);
    S carry = identity;
    for (int64_t base = 0; base < n; base += kScanThreads) {
      const int64_t k = base + threadIdx.x;
      const int64_t j = reverse ? n - 1 - k : k;
      S v = k < n ? static_cast<S>(load(x[o[0] + j])) : identity;
      for (int off = 1; off < 32; off <<= 1) {
        const S t = __shfl_up_sync(0xffffffffu, v, off);
        if (lane >= off) v = combine(t, v, prod);
      }
      if (lane == 31) warp_total[warp] = v;
      __syncthreads();
      if (warp == 0) {
        S t = lane < kScanWarps ? warp_total[lane] : identity;
        for (int off = 1; off < kScanWarps; off <<= 1) {
          const S u = __shfl_up_sync(0xffffffffu, t, off);
          if (lane >= off) t = combine(u, t, prod);
        }
        if (lane < kScanWarps) warp_total[lane] = t;
      }
      __syncthreads();
      const S before = warp > 0 ? combine(carry, warp_total[warp - 1], prod) : carry;
      if (k < n) out[o[1] + j] = store<O>(combine(before, v, prod));
      carry = combine(carry, warp_total[kScanWarps - 1], prod);
      __syncthreads();  // warp_total is written again by the next tile
    }
  }
}

void scan(const Tensor& out, const Tensor& x, int64_t dim, bool reverse, bool prod) {
  const auto d = static_cast<size_t>(dim);
  const RowsAlong ra = rows_along(x, dim);
  const Shape& rows_shape = ra.shape;
  const int64_t n = ra.n, rows = ra.count;
  const Indexer<2> l = layout<2>("cumsum", rows_shape, {&x, &out});
  NvtxRange range("cumsum");
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  const bool contiguous_rows = x.strides()[d] == 1 && out.strides()[d] == 1 && n >= 64;
  if (contiguous_rows) {
    const unsigned grid = static_cast<unsigned>(std::clamp<int64_t>(rows, 1, kMaxGrid));
    TALLY_DISPATCH_ALL(x.dtype(), "cumsum", [&] {
      using X = dev_t<scalar_t>;
      if constexpr (std::is_floating_point_v<acc_t<scalar_t>>)
        scan_rows_kernel<X, X, double><<<grid, kScanThreads, 0, stream(dev)>>>(
            dptr<scalar_t>(out), dptr<scalar_t>(x), rows, l, n, reverse, prod);
      else
        scan_rows_kernel<X, int64_t, long long><<<grid, kScanThreads, 0, stream(dev)>>>(
            dptr<int64_t>(out), dptr<scalar_t>(x), rows, l, n, reverse, prod);
    });
    check_launch("cumsum");
    return;
  }
  TALLY_DISPATCH_ALL(x.dtype(), "cumsum", [&] {
    using X = dev_t<scalar_t>;
    if constexpr (std::is_floating_point_v<acc_t<scalar_t>>) {
      scan_kernel<X, X, double><<<grid_for(rows), kThreads, 0, stream(dev)>>>(
          dptr<scalar_t>(out), dptr<scalar_t>(x), rows, l, n, x.strides()[d], out.strides()[d],
          reverse, prod);
    } else {
      scan_kernel<X, int64_t, int64_t><<<grid_for(rows), kThreads, 0, stream(dev)>>>(
          dptr<int64_t>(out), dptr<scalar_t>(x), rows, l, n, x.strides()[d], out.strides()[d],
          reverse, prod);
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

// Whether (a, ia) sorts before (b, ib): by value, ties by index (so the sort is stable);
// ia or ib >= n is padding, after everything.
template <typename A>
__device__ __forceinline__ bool sorts_before(A a, int ia, A b, int ib, int n, bool descending) {
  if (ib >= n) return ia < n;
  if (ia >= n) return false;
  if (before(a, b, descending)) return true;
  if (before(b, a, descending)) return false;
  return ia < ib;
}

// Rows of up to kCudaBlockSortMax elements: one block a row, a bitonic sort of (value, index)
// pairs in shared memory, padded to p (a power of two) with elements that sort last.
// operands over the rows: x, values, indices.

template <typename T>
__global__ void block_sort_kernel(T* values, int64_t* indices, const T* x, int64_t rows,
                                  Indexer<3> l, int n, int p, int64_t xs, int64_t vs, int64_t is,
                                  bool descending) {
  using A = dacc_t<T>;
  extern __shared__ unsigned char smem[];
  A* key = reinterpret_cast<A*>(smem);
  int* idx = reinterpret_cast<int*>(key + p);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    int64_t o[3];
    l.get(row, o);
    for (int i = threadIdx.x; i < p; i += blockDim.x) {
      idx[i] = i;
      if (i < n) key[i] = load(x[o[0] + i * xs]);
    }
    __syncthreads();
    for (int k = 2; k <= p; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = threadIdx.x; i < p; i += blockDim.x) {
          const int m = i ^ j;
          if (m <= i) continue;
          const bool up = (i & k) == 0;  // this run ascends (in sort order)
          const bool swap = up ? sorts_before(key[m], idx[m], key[i], idx[i], n, descending)
                               : sorts_before(key[i], idx[i], key[m], idx[m], n, descending);
          if (swap) {
            const A tk = key[i];
            key[i] = key[m];
            key[m] = tk;
            const int ti = idx[i];
            idx[i] = idx[m];
            idx[m] = ti;
          }
        }
        __syncthreads();
      }
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      values[o[1] + i * vs] = x[o[0] + idx[i] * xs];
      indices[o[2] + i * is] = idx[i];
    }
    __syncthreads();
  }
}

// Longer rows: cub's stable segmented radix sort of contiguous keys. Radix order is the bits'
// order, so keys are canonical first: every NaN the positive quiet NaN (after +inf, as
// PyTorch's NaN-largest), -0 as +0 (equal to it, as the comparison sort has it). bool sorts
// as uint8.
template <typename T>
using radix_key_t = std::conditional_t<std::is_same_v<T, bool>, uint8_t, T>;

// k over rows * n: keys[k] = canonical x[row][i], positions[k] = i.
template <typename T>
__global__ void radix_keys_kernel(radix_key_t<T>* keys, int64_t* positions, const T* x,
                                  int64_t total, Indexer<3> l, int64_t n, int64_t xs) {
  TALLY_GRID_STRIDE(k, total) {
    const int64_t row = k / n, i = k % n;
    int64_t o[3];
    l.get(row, o);
    const T v = x[o[0] + i * xs];
    if constexpr (std::is_floating_point_v<dacc_t<T>>) {
      const auto a = load(v);
      keys[k] = is_nan(a) ? store<T>(NAN) : a == 0 ? store<T>(0.0f) : v;
    } else {
      keys[k] = static_cast<radix_key_t<T>>(v);
    }
    positions[k] = i;
  }
}

__global__ void segment_offsets_kernel(int64_t* offsets, int64_t rows, int64_t n) {
  TALLY_GRID_STRIDE(r, rows + 1) {
    offsets[r] = r * n;
  }
}

// values[row][i] = x[row][order[k]], indices[row][i] = order[k] for k = row * n + i.
template <typename T>
__global__ void sorted_out_kernel(T* values, int64_t* indices, const T* x, const int64_t* order,
                                  int64_t total, Indexer<3> l, int64_t n, int64_t xs, int64_t vs,
                                  int64_t is) {
  TALLY_GRID_STRIDE(k, total) {
    const int64_t row = k / n, i = k % n;
    int64_t o[3];
    l.get(row, o);
    const int64_t j = order[k];
    values[o[1] + i * vs] = x[o[0] + j * xs];
    indices[o[2] + i * is] = j;
  }
}

template <typename T>
void radix_sort(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t rows,
                const Indexer<3>& l, int64_t n, int64_t dim, bool descending) {
  using D = dev_t<T>;
  using K = radix_key_t<D>;
  const auto d = static_cast<size_t>(dim);
  const int64_t total = rows * n;
  const int dev = x.device().index;
  cudaStream_t st = stream(dev);
  const Tensor keys =
      alloc_scratch(2 * total, x.dtype() == DType::bool_ ? DType::uint8 : x.dtype(), x.device());
  const Tensor pos = alloc_scratch(2 * total, DType::int64, x.device());
  const Tensor offsets = alloc_scratch(rows + 1, DType::int64, x.device());
  K* kin = static_cast<K*>(keys.storage().data());
  int64_t* pin = static_cast<int64_t*>(pos.storage().data());
  int64_t* off = static_cast<int64_t*>(offsets.storage().data());
  radix_keys_kernel<D>
      <<<grid_for(total), kThreads, 0, st>>>(kin, pin, dptr<T>(x), total, l, n, x.strides()[d]);
  segment_offsets_kernel<<<grid_for(rows + 1), kThreads, 0, st>>>(off, rows, n);
  check_launch("sort");
  auto run = [&](void* temp, size_t& bytes) {
    return descending
               ? cub::DeviceSegmentedSort::StableSortPairsDescending(
                     temp, bytes, kin, kin + total, pin, pin + total, total, rows, off, off + 1, st)
               : cub::DeviceSegmentedSort::StableSortPairs(temp, bytes, kin, kin + total, pin,
                                                           pin + total, total, rows, off, off + 1,
                                                           st);
  };
  size_t bytes = 0;
  check(run(nullptr, bytes), "sort (cub temp size)");
  const Tensor temp = alloc_scratch(static_cast<int64_t>(bytes) + 1, DType::uint8, x.device());
  check(run(temp.storage().data(), bytes), "sort (cub)");
  sorted_out_kernel<D><<<grid_for(total), kThreads, 0, st>>>(
      dptr<T>(values), dptr<int64_t>(indices), dptr<T>(x), pin + total, total, l, n, x.strides()[d],
      values.strides()[d], indices.strides()[d]);
  check_launch("sort");
}

void sort(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim,
          bool descending) {
  const auto d = static_cast<size_t>(dim);
  const RowsAlong ra = rows_along(x, dim);
  const Shape& rows_shape = ra.shape;
  const int64_t n = ra.n, rows = ra.count;
  const Indexer<3> l = layout<3>("sort", rows_shape, {&x, &values, &indices});
  NvtxRange range("sort");
  const int dev = x.device().index;
  DeviceGuard guard(dev);
  TALLY_DISPATCH_ALL(x.dtype(), "sort", [&] {
    using D = dev_t<scalar_t>;
    if (n > kCudaBlockSortMax)
      return radix_sort<scalar_t>(values, indices, x, rows, l, n, dim, descending);
    int p = 1;
    while (p < n) p <<= 1;
    const int threads = std::clamp(p / 2, 32, 1024);
    const size_t smem = static_cast<size_t>(p) * (sizeof(dacc_t<D>) + sizeof(int));
    const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, kMaxGrid));
    block_sort_kernel<D><<<blocks, threads, smem, stream(dev)>>>(
        dptr<scalar_t>(values), dptr<int64_t>(indices), dptr<scalar_t>(x), rows, l,
        static_cast<int>(n), p, x.strides()[d], values.strides()[d], indices.strides()[d],
        descending);
    check_launch("sort");
  });
}

// ------------------------------------------------------------------ flip / roll

struct Remap {
  int64_t shift[kMaxDims];  // -1: flip
};

// operands over out's shape: out, x (x read at the remapped coordinates).
template <typename T>
__global__ void remap_kernel(T* out, const T* x, int64_t total, Indexer<2> l, Remap m) {
  TALLY_GRID_STRIDE(k, total) {
    int64_t oo = l.base[0], xo = l.base[1], rest = k;
    for (int d = l.ndim - 1; d >= 0; --d) {
      const int64_t n = l.sizes[d], c = rest % n;
      rest /= n;
      const int64_t s = m.shift[d] < 0 ? n - 1 - c : (c - m.shift[d] + n) % n;
      oo += c * l.strides[0][d];
      xo += s * l.strides[1][d];
    }
    out[oo] = x[xo];
  }
}

void remap(const Tensor& out, const Tensor& x, const std::vector<bool>& flip,
           const std::vector<int64_t>& shift) {
  const int64_t total = out.numel();
  const Indexer<2> l = layout<2>("flip", out.sizes(), {&out, &x});
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
                              int64_t total, Indexer<2> l, int64_t fs) {
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
void masked(const Tensor& a, const Tensor& b, const Tensor& mask, const Tensor& positions) {
  const MaskedOperands m = masked_operands<Select>(a, b);
  const int64_t total = m.dense.numel();
  const Indexer<2> l = layout<2>(m.name, m.dense.sizes(), {&m.dense, &mask});
  NvtxRange range(m.name);
  const int dev = m.dense.device().index;
  DeviceGuard guard(dev);
  TALLY_DISPATCH_ALL(m.dense.dtype(), m.name, [&] {
    masked_kernel<dev_t<scalar_t>, Select><<<grid_for(total), kThreads, 0, stream(dev)>>>(
        dptr<scalar_t>(m.dense), dptr<scalar_t>(m.flat) + m.flat.storage_offset(),
        static_cast<const bool*>(mask.storage().data()),
        iptr<int64_t>(positions) + positions.storage_offset(), total, l, m.flat.strides()[0]);
  });
  check_launch(m.name);
}

}  // namespace

const IndexKernels index_kernels{TALLY_INDEX_KERNELS};

}  // namespace tally::cuda
