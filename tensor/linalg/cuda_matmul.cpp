// The CUDA matrix products of the linear-algebra family (cuda::matmul, cuda::linear): the
// row-major tensors are handed to cuBLASLt as column-major transposes (C^T = B^T A^T), so
// transposed, narrowed and broadcast operands go as they are, never copied here. Batch
// dims fold into one strided-batched call where one stride per operand addresses them;
// the rest are looped over on the host. The output's row stride is the ldc (ops::output_ld: N,
// or a padded mm_out output's). Where cuBLASLt's heuristic offers no algorithm
// (an odd alignment, say) the product goes through classic cuBLAS instead. Each call
// takes the library workspace from the caching allocator (alloc_scratch_bytes), tagged
// `workspace`. Both are entries of cuda::linalg_kernels (tensor/linalg/cuda.cu).
#include "tensor/linalg/cuda_matmul.h"

#include <fmt/format.h>

#include <atomic>
#include <vector>

#include "memory/memory.h"
#include "tensor/cuda/blas.h"
#include "tensor/cuda/runtime.h"
#include "tensor/linalg/cuda.h"
#include "tensor/linalg/ops.h"
#include "tensor/op_alloc.h"

namespace tally::cuda {

namespace {

std::atomic<uint64_t> g_bias_epilogue{0}, g_bias_fallback{0}, g_gelu_epilogue{0},
    g_gelu_fallback{0};

// cuBLASLt's workspace for one product: scratch from the caching allocator on Tally's stream
// (alloc_scratch_bytes: tagged `workspace` and, through the enclosing DispatchScope, with the
// op), returned when the Storage goes out of scope. Returning it right after the enqueue is
// safe: the block is reused only by work queued later on the same stream. Empty (no
// workspace) when the size is 0, and under memory pressure: cuBLASLt then picks an
// algorithm that needs none.
Storage workspace(int device) {
  try {
    return alloc_scratch_bytes(matmul_workspace_bytes(), Device::cuda(device));
  } catch (const memory::OutOfMemoryError&) {
    return {};
  }
}

using Operand = ops::GemmOperand;

// The row-major product out[M, N] = a[M, K] @ b[K, N] as cuBLASLt's column-major
// D^T[N, M] = op(B^T)[N, K] op(A^T)[K, M]: cuBLAS's "A" is our b, its "B" our a. A
// row-major matrix (trans = false) read column-major is its own transpose, which is what
// this formulation wants, so blas_layout's trans flag maps straight to the op.
blas::Gemm make_gemm(DType dtype, DType out_dtype, const Operand& oa, const Operand& ob, int64_t M,
                     int64_t N, int64_t K, int64_t ldd, bool accumulate) {
  blas::Gemm g;
  g.dtype = dtype;
  g.out_dtype = out_dtype;
  g.m = N;
  g.n = M;
  g.k = K;
  g.trans_a = ob.trans;
  g.lda = ob.ld;
  g.trans_b = oa.trans;
  g.ldb = oa.ld;
  g.ldd = ldd;
  g.accumulate = accumulate;
  return g;
}

// PyTorch's conditions on the dimensions for cuBLASLt's epilogues (addmm), which keep
// degenerate shapes off them.
bool epilogue_dims(int64_t M, int64_t N, int64_t K) {
  constexpr int64_t kMaxDim = 65535LL * 32;
  return M > 1 && N > 1 && K > 1 && M < kMaxDim && N < kMaxDim && K < kMaxDim;
}

// out[M, N] = x[M, K] @ b[K, N] (+ bias where defined, by the epilogue) as one cuBLASLt call,
// the operands named x_name and b_name in errors; the caller sets any other epilogue.
blas::Gemm epilogue_gemm(const Tensor& out, const Tensor& x, const char* x_name, const Tensor& b,
                         const char* b_name, const Tensor& bias) {
  const Operand ox = ops::gemm_operand(x, {}, "matmul kernel (CUDA)", x_name);
  const Operand ob = ops::gemm_operand(b, {}, "matmul kernel (CUDA)", b_name);
  const int64_t N = out.size(1);
  blas::Gemm g = make_gemm(out.dtype(), out.dtype(), ox, ob, out.size(0), N, x.size(1), N, false);
  g.a = b.data_ptr();
  g.b = x.data_ptr();
  g.d = out.data_ptr();
  g.bias = bias.defined() ? bias.data_ptr() : nullptr;
  return g;
}

// The op name of the enclosing DispatchScope ("matmul", "mm", "bmm", "linear").
const char* current_op_name() {
  const memory::AllocTag tag = memory::current_tag();
  return tag.op ? memory::interned(tag.op).c_str() : "matmul";
}

const char* byte_ptr(const Tensor& t) {
  return static_cast<const char*>(t.data_ptr());
}

}  // namespace

void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate) {
  const char* op = current_op_name();
  NvtxRange range("matmul (cuBLASLt)");
  const int device = out.device().index;
  DeviceGuard guard(device);
  if (a.size(-2) > INT32_MAX || a.size(-1) > INT32_MAX || b.size(-1) > INT32_MAX)
    throw std::invalid_argument(
        fmt::format("{}: matrix dimensions of {} and {} exceed the BLAS "
                    "int range",
                    op, a.shape_string(), b.shape_string()));
  // The operands have out's dtype, or are float16/bfloat16 with a float32 out (mm_out).
  const bool widened = out.dtype() == DType::float32 &&
                       (a.dtype() == DType::float16 || a.dtype() == DType::bfloat16);
  if (b.dtype() != a.dtype() || (a.dtype() != out.dtype() && !widened))
    throw std::logic_error(
        fmt::format("{} (CUDA): operand dtypes {} and {} do not fit the "
                    "output's {}",
                    op, dtype_name(a.dtype()), dtype_name(b.dtype()), dtype_name(out.dtype())));
  const int64_t M = out.size(-2), N = out.size(-1), K = a.size(-1);
  const Shape batch(out.sizes().begin(), out.sizes().end() - 2);
  const int64_t count = shape_numel(batch);
  if (M == 0 || N == 0 || count == 0) return;
  const int64_t esize = static_cast<int64_t>(out.element_size());
  const int64_t in_esize = static_cast<int64_t>(a.element_size());
  const int64_t ldd = ops::output_ld(out);  // N, or a padded output's row stride (mm_out)
  if (K == 0) {  // an empty sum: out = 0 (or unchanged when accumulating); padding untouched
    if (!accumulate)
      check(cudaMemset2DAsync(out.data_ptr(), static_cast<size_t>(ldd * esize), 0,
                              static_cast<size_t>(N * esize), static_cast<size_t>(count * M),
                              stream(device)),
            "matmul: cudaMemset2DAsync");
    return;
  }
  const Operand oa = ops::gemm_operand(a, batch, "matmul kernel (CUDA)", "a");
  const Operand ob = ops::gemm_operand(b, batch, "matmul kernel (CUDA)", "b");

  // Fold the innermost batch dims that both operands step through with one stride each
  // into one strided batch (out is contiguous, so it always folds); loop over the rest.
  const int64_t nb = static_cast<int64_t>(batch.size());
  int64_t inner = 1, inner_sa = 0, inner_sb = 0;
  int64_t split = nb;  // dims [split, nb) are inside the strided batch
  for (int64_t d = nb - 1; d >= 0; --d) {
    const auto ud = static_cast<size_t>(d);
    if (batch[ud] == 1) {
      split = d;
    } else if (inner == 1) {
      inner = batch[ud];
      inner_sa = oa.batch_strides[ud];
      inner_sb = ob.batch_strides[ud];
      split = d;
    } else if (oa.batch_strides[ud] == inner_sa * inner &&
               ob.batch_strides[ud] == inner_sb * inner) {
      inner *= batch[ud];
      split = d;
    } else {
      break;
    }
  }
  const int64_t outer = count / inner;

  blas::Gemm g = make_gemm(a.dtype(), out.dtype(), oa, ob, M, N, K, ldd, accumulate);
  const Storage ws = workspace(device);
  std::vector<int64_t> idx(static_cast<size_t>(split), 0);
  int64_t off_a = 0, off_b = 0;
  for (int64_t e = 0; e < outer; ++e) {
    char* d_base = static_cast<char*>(out.data_ptr()) + e * inner * M * ldd * esize;
    const char* a_base = byte_ptr(a) + off_a * in_esize;
    const char* b_base = byte_ptr(b) + off_b * in_esize;
    g.a = b_base;  // cuBLAS's A is our b (see make_gemm)
    g.b = a_base;
    g.d = d_base;
    g.batch = inner;
    g.stride_a = inner_sb;
    g.stride_b = inner_sa;
    g.stride_d = M * ldd;
    if (blas::gemm(device, g, ws.data(), ws.nbytes(), op) != CUBLAS_STATUS_SUCCESS)
      blas::gemm_classic(device, g, ws.data(), ws.nbytes(), op);  // no cuBLASLt algorithm
    // Odometer over the outer batch dims.
    ops::advance_batch(idx, batch, static_cast<size_t>(split), oa, ob, off_a, off_b);
  }
}

void linear(const Tensor& out, const Tensor& x, const Tensor& wt, const Tensor& bias) {
  const char* op = current_op_name();
  NvtxRange range("linear (cuBLASLt)");
  const int device = out.device().index;
  DeviceGuard guard(device);
  const int64_t M = out.size(0), N = out.size(1), K = x.size(1);
  if (M == 0 || N == 0) return;
  if (bias.dtype() != out.dtype() || x.dtype() != out.dtype() || wt.dtype() != out.dtype())
    throw std::logic_error(
        fmt::format("{} (CUDA): dtypes differ: x {}, weight {}, bias {}, "
                    "output {}",
                    op, dtype_name(x.dtype()), dtype_name(wt.dtype()), dtype_name(bias.dtype()),
                    dtype_name(out.dtype())));
  // The bias epilogue wants a dense bias vector.
  if (epilogue_dims(M, N, K) && bias.stride(0) == 1) {
    const blas::Gemm g = epilogue_gemm(out, x, "x", wt, "weight^T", bias);
    const Storage ws = workspace(device);
    if (blas::gemm(device, g, ws.data(), ws.nbytes(), op) == CUBLAS_STATUS_SUCCESS) {
      ++g_bias_epilogue;
      return;
    }
  }
  // The bias in every row, then the product accumulated onto it (the CPU path).
  ++g_bias_fallback;
  broadcast_rows(out, bias);
  matmul(out, x, wt, /*accumulate=*/true);
}

namespace {

// One product with a GELU epilogue (linear_gelu: act gelu_aux, aux = pre; matmul_dgelu: act
// dgelu, aux = the GELU's input), or false where it does not apply. It applies to float16 and
// bfloat16 (cuBLASLt has no float64 GELU epilogue, and float32's products with it measured 1%
// slower in GPT-2's float32 step on the H200, where the product outweighs the GELU kernels),
// N a multiple of 8 (the aux leading dimension), PyTorch's limits of the bias epilogue on the
// dimensions, a dense bias, and an algorithm for the problem.
bool gelu_gemm(const char* kernel, blas::Gemm::Act act, const Tensor& out, const Tensor& aux,
               const Tensor& x, const Tensor& b, const Tensor& bias) {
  const char* op = current_op_name();
  NvtxRange range(kernel);
  const int device = out.device().index;
  DeviceGuard guard(device);
  const int64_t M = out.size(0), N = out.size(1), K = x.size(1);
  if (x.dtype() != out.dtype() || b.dtype() != out.dtype() || aux.dtype() != out.dtype() ||
      (bias.defined() && bias.dtype() != out.dtype()))
    throw std::logic_error(fmt::format("{} (CUDA): dtypes differ: {}, {}, {}, output {}", op,
                                       dtype_name(x.dtype()), dtype_name(b.dtype()),
                                       dtype_name(aux.dtype()), dtype_name(out.dtype())));
  const bool sixteen = out.dtype() == DType::float16 || out.dtype() == DType::bfloat16;
  const bool applies = sixteen && N % 8 == 0 && epilogue_dims(M, N, K) &&
                       (!bias.defined() || bias.stride(0) == 1) && out.is_contiguous() &&
                       aux.is_contiguous();
  if (!applies) {
    ++g_gelu_fallback;
    return false;
  }
  blas::Gemm g = epilogue_gemm(out, x, "a", b, "b", bias);
  g.act = act;
  g.aux = aux.data_ptr();
  g.ldaux = N;
  const Storage ws = workspace(device);
  if (blas::gemm(device, g, ws.data(), ws.nbytes(), op) != CUBLAS_STATUS_SUCCESS) {
    ++g_gelu_fallback;
    return false;
  }
  ++g_gelu_epilogue;
  return true;
}

}  // namespace

bool linear_gelu(const Tensor& out, const Tensor& pre, const Tensor& x, const Tensor& wt,
                 const Tensor& bias) {
  return gelu_gemm("linear_gelu (cuBLASLt)", blas::Gemm::Act::gelu_aux, out, pre, x, wt, bias);
}

bool matmul_dgelu(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& pre) {
  return gelu_gemm("mm_dgelu (cuBLASLt)", blas::Gemm::Act::dgelu, out, pre, a, b, Tensor());
}

MatmulStats matmul_stats() {
  MatmulStats s;
  s.lt_calls = blas::lt_calls();
  s.heuristic_queries = blas::heuristic_queries();
  s.bias_epilogue = g_bias_epilogue.load();
  s.bias_fallback = g_bias_fallback.load();
  s.classic_calls = blas::classic_calls();
  s.gelu_epilogue = g_gelu_epilogue.load();
  s.gelu_fallback = g_gelu_fallback.load();
  s.tuned = blas::tuned_problems();
  return s;
}

void set_force_cublas_fallback(bool force) {
  blas::set_force_fallback(force);
}

}  // namespace tally::cuda
