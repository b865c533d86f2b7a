// The kernel table of the index family (gather/scatter, cumsum, sort, flip/roll, boolean
// masks): each kernel's signature, once. The CPU reference (tensor/index/cpu.cpp) and the
// CUDA kernels (tensor/index/cuda.cu) each define one IndexKernels; tensor/backends.cpp
// registers them. Called only by the raw ops (tensor/index/ops.cpp), which check every
// argument first. Only CUDA's sort of long rows allocates (kCudaBlockSortMax).
//
// Indices out of range: the CPU kernels throw std::out_of_range naming the op; the CUDA
// kernels cannot throw without reading the indices back, so they skip such an entry (as
// value_selecting_reduction_backward does; gather writes 0 there).
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/dispatch.h"
#include "tensor/tensor.h"

namespace tally {

// How scatter combines src with what out holds: replace it, add alpha * src, multiply.
enum class ScatterReduce : uint8_t { none, add, multiply };

struct IndexKernels {
  // out[c] = x[c with c[dim] = index[c]]; index (int64) has out's shape (it may be an
  // expanded view); x has out's rank.
  void (*gather)(const Tensor& out, const Tensor& x, const Tensor& index, int64_t dim);
  // For every c in index's shape: out[c with c[dim] = index[c]] = src[c] (add: += alpha *
  // src[c]; multiply: *= src[c]). out is written in place; src has at least index's sizes.
  void (*scatter)(const Tensor& out, const Tensor& src, const Tensor& index, int64_t dim,
                  ScatterReduce reduce, double alpha);
  // out = cumulative sum (prod: product) of x along dim (reverse: from the end), same shape,
  // out's dtype (x's, or int64 for an integral x), accumulated in double (int64 for integers).
  void (*scan)(const Tensor& out, const Tensor& x, int64_t dim, bool reverse, bool prod);
  // A stable sort of each row along dim: values (x's dtype) and indices (int64), both
  // contiguous with x's shape. NaN counts as the largest value, as in PyTorch.
  void (*sort)(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim,
               bool descending);
  // out (contiguous, x's shape) [c] = x[src(c)], per dim d: src = n-1-c if flip[d], else
  // (c - shift[d]) mod n (shift in [0, n)). Rank <= 10.
  void (*remap)(const Tensor& out, const Tensor& x, const std::vector<bool>& flip,
                const std::vector<int64_t>& shift);
  // mask (bool) and x or out share one shape; positions (int64, contiguous, that shape's
  // numel) is the inclusive running count of mask in row-major order.
  // masked_select: out1d[positions[i] - 1] = x[i] where mask[i].
  void (*masked_select)(const Tensor& out1d, const Tensor& x, const Tensor& mask,
                        const Tensor& positions);
  // masked_scatter: out[i] = src1d[positions[i] - 1] where mask[i] (src1d may have stride 0).
  void (*masked_scatter)(const Tensor& out, const Tensor& src1d, const Tensor& mask,
                         const Tensor& positions);
};

// CUDA sorts a row of up to this many elements in one block (shared memory, no scratch); a
// longer row takes a segmented radix sort through scratch: keys and positions twice over, the
// row offsets and cub's temporary storage (tensor/index/cuda.cu), which the meta kernel charges.
inline constexpr int64_t kCudaBlockSortMax = 2048;

// The rows a scan or sort along dim runs over: x's shape with dim's size set to 1 (shape),
// how many there are (count) and each row's length (n).
struct RowsAlong {
  Shape shape;
  int64_t count = 0, n = 0;
};
inline RowsAlong rows_along(const Tensor& x, int64_t dim) {
  RowsAlong r{x.sizes(), 0, x.sizes()[static_cast<size_t>(dim)]};
  r.shape[static_cast<size_t>(dim)] = 1;
  r.count = shape_numel(r.shape);
  return r;
}

// masked_select(out1d, x, ...) and masked_scatter(out, src1d, ...) are one kernel
// masked<Select>(a, b, mask, positions) in each backend: its op name, its dense operand (x or
// out, of the mask's shape) and its flat one (out1d or src1d).
struct MaskedOperands {
  const char* name;
  const Tensor& dense;
  const Tensor& flat;
};
template <bool Select>
MaskedOperands masked_operands(const Tensor& a, const Tensor& b) {
  return Select ? MaskedOperands{"masked_select", b, a} : MaskedOperands{"masked_scatter", a, b};
}

// cpu::index_kernels (tensor/index/cpu.cpp), cuda::index_kernels (tensor/index/cuda.cu),
// index_backends (tensor/backends.cpp).
TALLY_DECLARE_KERNELS(IndexKernels, index_kernels, index_backends);

#define TALLY_INDEX_KERNELS                                                              \
  .gather = &gather, .scatter = &scatter, .scan = &scan, .sort = &sort, .remap = &remap, \
  .masked_select = &masked<true>, .masked_scatter = &masked<false>

}  // namespace tally
