// CUDA kernels of the linear-algebra family: the embedding gather and atomic scatter-add,
// and the row broadcast linear's fallback path uses. The matrix products themselves run
// through cuBLASLt (tensor/linalg/cuda_matmul.cpp, tensor/cuda/blas.cpp). The file ends with
// the family's CUDA table, cuda::linalg_kernels (tensor/linalg/kernels.h).
#include <cstring>
#include <string>

#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/grid.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/linalg/cuda_matmul.h"
#include "tensor/linalg/kernels.h"

namespace tally::cuda {

namespace {

template <typename T>
__global__ void broadcast_rows_kernel(T* __restrict__ out, const T* __restrict__ row,
                                      int64_t row_stride, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = row[(i % cols) * row_stride];
}

}  // namespace

void broadcast_rows(const Tensor& out, const Tensor& row) {
  NvtxRange range("broadcast_rows");
  const int device = out.device().index;
  DeviceGuard guard(device);
  const int64_t rows = out.size(0), cols = out.size(1);
  if (rows == 0 || cols == 0) return;
  if (!out.is_contiguous() || row.dim() != 1 || row.size(0) != cols || row.dtype() != out.dtype())
    throw std::logic_error(
        "broadcast_rows (CUDA): expected a contiguous [rows, cols] output and a [cols] row of its "
        "dtype, got " +
        out.shape_string() + " and " + row.shape_string());
  TALLY_DISPATCH_ALL(out.dtype(), "broadcast_rows", [&] {
    using T = dev_t<scalar_t>;
    broadcast_rows_kernel<T><<<blocks_for(rows * cols), kThreads, 0, stream(device)>>>(
        static_cast<T*>(out.data_ptr()), static_cast<const T*>(row.data_ptr()),
        cols == 1 ? 0 : row.stride(0), rows, cols);
  });
  check_launch("broadcast_rows");
}

// ------------------------------------------------------------------ embedding

namespace {

// Rows are copied as raw elements of E (the dtype's bits, or 16-byte vectors); `poison`
// fills the row of an out-of-range index.
template <typename E, typename I>
__global__ void gather_rows_kernel(E* __restrict__ out, const E* __restrict__ w, int64_t ws0,
                                   int64_t ws1, const I* __restrict__ idx, Indexer<1> ix, int64_t n,
                                   int64_t D, int64_t V, E poison) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    int64_t off;
    ix.get(e, &off);
    const int64_t i = static_cast<int64_t>(idx[off]);
    E* dst = out + e * D;
    if (i < 0 || i >= V) {
      for (int64_t j = threadIdx.x; j < D; j += blockDim.x) dst[j] = poison;
      continue;
    }
    const E* row = w + i * ws0;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) dst[j] = row[j * ws1];
  }
}

template <typename A, typename G, typename I>
__global__ void scatter_add_rows_kernel(A* __restrict__ gw, const G* __restrict__ g, int64_t gs0,
                                        int64_t gs1, const I* __restrict__ idx, Indexer<1> ix,
                                        int64_t n, int64_t D, int64_t V, int64_t padding_idx) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    int64_t off;
    ix.get(e, &off);
    const int64_t i = static_cast<int64_t>(idx[off]);
    if (i < 0 || i >= V || i == padding_idx) continue;
    A* dst = gw + i * D;
    const G* src = g + e * gs0;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
      atomicAdd(dst + j, store<A>(load(src[j * gs1])));
  }
}

// Threads across a row (x) and rows per block (y), for rows of `width` elements.
dim3 row_block(int64_t width) {
  int tx = 32;
  while (tx < kThreads && tx < width) tx *= 2;
  return dim3(static_cast<unsigned>(tx), static_cast<unsigned>(kThreads / tx));
}

Indexer<1> index_walker(const Tensor& indices) {
  return make_indexer<1>(indices.sizes(), {&indices.strides()}, {indices.storage_offset()});
}

// The bit pattern written for an out-of-range index: NaN for floating dtypes, else 0.
uint64_t poison_bits(DType d) {
  switch (d) {
    case DType::float32:
      return 0x7fc00000u;
    case DType::float64:
      return 0x7ff8000000000000ull;
    case DType::float16:
      return 0x7e00u;
    case DType::bfloat16:
      return 0x7fc0u;
    default:
      return 0;
  }
}

template <typename I>
void gather(const Tensor& out, const Tensor& weight, const Tensor& indices, int device) {
  const int64_t D = weight.size(1);
  const size_t es = weight.element_size();
  const uint64_t bits = poison_bits(weight.dtype());
  const auto addr = reinterpret_cast<uintptr_t>(weight.data_ptr());
  // 16-byte vectors when every row is a dense, 16-byte aligned run.
  const bool dense = weight.stride(1) == 1 || D == 1;
  if (dense && (D * static_cast<int64_t>(es)) % 16 == 0 &&
      (weight.stride(0) * static_cast<int64_t>(es)) % 16 == 0 && addr % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0) {
    uint4 poison;
    unsigned char* p = reinterpret_cast<unsigned char*>(&poison);
    for (size_t k = 0; k < 16; k += es) std::memcpy(p + k, &bits, es);  // little-endian
    // Rows are addressed from data_ptr() in units of 16 bytes.
    const int64_t vec = static_cast<int64_t>(16 / es);
    const int64_t n = indices.numel();
    const dim3 block = row_block(D / vec);
    gather_rows_kernel<uint4, I><<<blocks_for(n, block.y), block, 0, stream(device)>>>(
        static_cast<uint4*>(out.data_ptr()), reinterpret_cast<const uint4*>(addr),
        weight.stride(0) / vec, 1, static_cast<const I*>(indices.storage().data()),
        index_walker(indices), n, D / vec, weight.size(0), poison);
    return;
  }
  // Element by element, as the dtype's bits.
  const int64_t n = indices.numel();
  const dim3 block = row_block(D);
  // Launches with E, the unsigned integer of the element's size; false for another size.
  auto run = [&](auto tag) {
    using E = decltype(tag);
    if (sizeof(E) != es) return false;
    E poison;
    std::memcpy(&poison, &bits, sizeof(E));
    gather_rows_kernel<E, I><<<blocks_for(n, block.y), block, 0, stream(device)>>>(
        static_cast<E*>(out.data_ptr()), reinterpret_cast<const E*>(addr), weight.stride(0),
        weight.stride(1), static_cast<const I*>(indices.storage().data()), index_walker(indices), n,
        D, weight.size(0), poison);
    return true;
  };
  if (!(run(uint8_t{}) || run(uint16_t{}) || run(uint32_t{}) || run(uint64_t{})))
    throw std::logic_error("embedding (CUDA): element size " + std::to_string(es) + " unsupported");
}

void embedding(const Tensor& out, const Tensor& weight, const Tensor& indices) {
  NvtxRange range("embedding");
  const int device = out.device().index;
  DeviceGuard guard(device);
  if (indices.numel() == 0 || weight.size(1) == 0) return;
  if (indices.dtype() == DType::int64)
    gather<int64_t>(out, weight, indices, device);
  else if (indices.dtype() == DType::int32)
    gather<int32_t>(out, weight, indices, device);
  else
    unsupported_dtype("embedding", indices.dtype());
  check_launch("embedding");
}

void embedding_backward(const Tensor& grad_weight, const Tensor& grad, const Tensor& indices,
                        int64_t padding_idx) {
  NvtxRange range("embedding_backward");
  const int device = grad_weight.device().index;
  DeviceGuard guard(device);
  const int64_t V = grad_weight.size(0), D = grad_weight.size(1), n = indices.numel();
  if (n == 0 || D == 0) return;
  if (!grad_weight.is_contiguous())
    throw std::logic_error("embedding_backward (CUDA): grad_weight must be contiguous");
  const dim3 block = row_block(D);
  const int grid = blocks_for(n, block.y);
  TALLY_DISPATCH_FLOAT(grad_weight.dtype(), "embedding_backward", [&] {
    using A = dev_t<scalar_t>;
    TALLY_DISPATCH_FLOAT(grad.dtype(), "embedding_backward", [&] {
      using G = dev_t<scalar_t>;
      auto run = [&](auto index_tag) {
        using I = decltype(index_tag);
        scatter_add_rows_kernel<A, G, I><<<grid, block, 0, stream(device)>>>(
            static_cast<A*>(grad_weight.data_ptr()), static_cast<const G*>(grad.data_ptr()),
            grad.stride(0), grad.stride(1), static_cast<const I*>(indices.storage().data()),
            index_walker(indices), n, D, V, padding_idx);
      };
      if (indices.dtype() == DType::int64)
        run(int64_t{});
      else if (indices.dtype() == DType::int32)
        run(int32_t{});
      else
        unsupported_dtype("embedding_backward", indices.dtype());
    });
  });
  check_launch("embedding_backward");
}

}  // namespace

const LinalgKernels linalg_kernels{
    .matmul = &matmul,
    .linear = &linear,
    .linear_gelu = &linear_gelu,
    .matmul_dgelu = &matmul_dgelu,
    .embedding = &embedding,
    .embedding_backward = &embedding_backward,
};

}  // namespace tally::cuda
