// CPU linear-algebra kernels: batched GEMM through OpenBLAS's cblas (strides passed to
// BLAS as leading dimensions and transpose flags, never copied here), embedding gather
// and scatter-add.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "tensor/cpu/blas.h"
#include "tensor/cpu/parallel.h"
#include "tensor/linalg/kernels.h"
#include "tensor/linalg/ops.h"

namespace tally::cpu {

namespace {

template <typename T>
void matmul_blas(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate) {
  const int64_t M = out.size(-2), N = out.size(-1), K = a.size(-1);
  const Shape batch(out.sizes().begin(), out.sizes().end() - 2);
  const int64_t count = shape_numel(batch);
  T* c = out.data<T>();
  if (M == 0 || N == 0 || count == 0) return;
  const int64_t ldc = ops::output_ld(out);  // N, or a padded output's row stride
  if (K == 0) {  // an empty sum: out = 0 (or unchanged when accumulating)
    if (!accumulate)
      for (int64_t r = 0; r < count * M; ++r)
        for (int64_t j = 0; j < N; ++j) c[r * ldc + j] = T(0);
    return;
  }
  const ops::GemmOperand oa = ops::gemm_operand(a, batch, "matmul kernel", "a");
  const ops::GemmOperand ob = ops::gemm_operand(b, batch, "matmul kernel", "b");
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  const T beta = accumulate ? T(1) : T(0);
  // Odometer over the batch entries: offsets of a and b move by their batch strides.
  std::vector<int64_t> idx(batch.size(), 0);
  std::vector<std::pair<int64_t, int64_t>> offsets(static_cast<size_t>(count));
  int64_t off_a = 0, off_b = 0;
  for (int64_t e = 0; e < count; ++e) {
    offsets[static_cast<size_t>(e)] = {off_a, off_b};
    ops::advance_batch(idx, batch, batch.size(), oa, ob, off_a, off_b);
  }
  // Entries over the threads (each product then stays in its thread); one entry's product is
  // split by cpu::gemm itself.
  const double flops =
      2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>(4e6 / flops) + 1);
  parallel_for(count, grain, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const auto [oa_e, ob_e] = offsets[static_cast<size_t>(e)];
      gemm<T>(oa.trans, ob.trans, M, N, K, T(1), pa + oa_e, oa.ld, pb + ob_e, ob.ld, beta,
              c + e * M * ldc, ldc);
    }
  });
}

void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate) {
  if (a.size(-2) > INT32_MAX || a.size(-1) > INT32_MAX || b.size(-1) > INT32_MAX)
    throw std::invalid_argument(
        fmt::format("matmul: matrix dimensions of {} and {} exceed the "
                    "BLAS int range",
                    a.shape_string(), b.shape_string()));
  switch (out.dtype()) {
    case DType::float32:
      if (a.dtype() == DType::float32) {
        matmul_blas<float>(out, a, b, accumulate);
      } else {  // float16/bfloat16 operands, a float32 product (mm_out): no rounding
        // a widened before b (in the order the meta kernel replays), not as arguments of one
        // call, whose evaluation order is unspecified.
        const Tensor a32 = ops::to(a, DType::float32);
        const Tensor b32 = ops::to(b, DType::float32);
        matmul_blas<float>(out, a32, b32, accumulate);
      }
      break;
    case DType::float64:
      matmul_blas<double>(out, a, b, accumulate);
      break;
    case DType::float16:
    case DType::bfloat16: {
      // Multiply in float32: widen the operands (their own, unbroadcast shapes) and the
      // output, then round the result back once.
      const Tensor a32 = ops::to(a, DType::float32), b32 = ops::to(b, DType::float32);
      const Tensor o32 = accumulate ? ops::to(out, DType::float32)
                                    : ops::empty(out.sizes(), DType::float32, out.device());
      matmul_blas<float>(o32, a32, b32, accumulate);
      ops::copy_(out, o32);
      break;
    }
    default:
      unsupported_dtype("matmul", out.dtype());
  }
}

// The linear layer with bias: the bias broadcast into out, then the GEMM accumulates x W^T.
void linear(const Tensor& out, const Tensor& x, const Tensor& wt, const Tensor& bias) {
  ops::copy_(out, bias);
  matmul(out, x, wt, /*accumulate=*/true);
}

// Index e of `indices` (any layout) as int64, walking it in row-major order.
template <typename I>
void for_each_index(const Tensor& indices, const std::function<void(int64_t, int64_t)>& fn) {
  const I* base = static_cast<const I*>(indices.storage().data());
  const int64_t rank = indices.dim();
  std::vector<int64_t> idx(static_cast<size_t>(rank), 0);
  int64_t off = indices.storage_offset();
  const int64_t n = indices.numel();
  for (int64_t e = 0; e < n; ++e) {
    fn(e, static_cast<int64_t>(base[off]));
    for (int64_t d = rank; d-- > 0;) {
      const auto ud = static_cast<size_t>(d);
      off += indices.strides()[ud];
      if (++idx[ud] < indices.sizes()[ud]) break;
      off -= indices.strides()[ud] * indices.sizes()[ud];
      idx[ud] = 0;
    }
  }
}

void visit_indices(const Tensor& indices, const std::function<void(int64_t, int64_t)>& fn) {
  if (indices.dtype() == DType::int64) {
    for_each_index<int64_t>(indices, fn);
  } else if (indices.dtype() == DType::int32) {
    for_each_index<int32_t>(indices, fn);
  } else {
    unsupported_dtype("embedding", indices.dtype());
  }
}

void check_index(int64_t i, int64_t V, const Tensor& weight_or_grad, const char* what) {
  if (i < 0 || i >= V)
    throw std::out_of_range(fmt::format("embedding: index {} is out of range for {} rows ({} {})",
                                        i, V, what, weight_or_grad.shape_string()));
}

void embedding(const Tensor& out, const Tensor& weight, const Tensor& indices) {
  const int64_t V = weight.size(0), D = weight.size(1);
  const int64_t ws0 = weight.stride(0), ws1 = weight.stride(1);
  TALLY_DISPATCH_ALL(weight.dtype(), "embedding", [&] {
    const scalar_t* w =
        static_cast<const scalar_t*>(weight.storage().data()) + weight.storage_offset();
    scalar_t* o = out.data<scalar_t>();
    visit_indices(indices, [&](int64_t e, int64_t i) {
      check_index(i, V, weight, "weight");
      const scalar_t* row = w + i * ws0;
      scalar_t* dst = o + e * D;
      for (int64_t j = 0; j < D; ++j) dst[j] = row[j * ws1];
    });
  });
}

void embedding_backward(const Tensor& grad_weight, const Tensor& grad, const Tensor& indices,
                        int64_t padding_idx) {
  const int64_t V = grad_weight.size(0), D = grad_weight.size(1);
  const int64_t gs0 = grad.stride(0), gs1 = grad.stride(1);
  TALLY_DISPATCH_FLOAT(grad_weight.dtype(), "embedding_backward", [&] {
    using A = acc_t<scalar_t>;
    scalar_t* gw = grad_weight.data<scalar_t>();
    const scalar_t* g = static_cast<const scalar_t*>(grad.storage().data()) + grad.storage_offset();
    visit_indices(indices, [&](int64_t e, int64_t i) {
      check_index(i, V, grad_weight, "grad_weight");
      if (i == padding_idx) return;
      scalar_t* dst = gw + i * D;
      const scalar_t* src = g + e * gs0;
      for (int64_t j = 0; j < D; ++j)
        dst[j] = static_cast<scalar_t>(static_cast<A>(dst[j]) + static_cast<A>(src[j * gs1]));
    });
  });
}

}  // namespace

const LinalgKernels linalg_kernels{
    .matmul = &matmul,
    .linear = &linear,
    .linear_gelu = [](const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      const Tensor&) { return false; },
    .matmul_dgelu = [](const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&) { return false; },
    .embedding = &embedding,
    .embedding_backward = &embedding_backward,
};

}  // namespace tally::cpu
