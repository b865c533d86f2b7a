// The linear-algebra family on CUDA against the CPU reference (label gpu: skipped without a
// device): matmul/mm/bmm/linear through cuBLASLt in every shape class the CPU tests cover
// (2-D, 1-D promotions, broadcast batches, folded batches, transposed, strided, narrowed
// and misaligned operands, empty dims), float32 with TF32 off, float16/bfloat16, float64;
// the backward of the differentiable products; embedding gather and scatter-add with
// repeated indices and padding; the TF32 switch; the bias epilogue; and cuBLASLt's
// workspace showing up in the allocator tagged `workspace` with the op that asked.
//
// Products are compared with the CPU result computed in float64 from the same (rounded)
// inputs: max |gpu - ref| / max |ref| below 1e-5 * sqrt(K) (float32), 1e-12 * sqrt(K)
// (float64), 2e-2 (float16/bfloat16).
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>

#include "tensor/linalg/autograd.h"
#include "tensor/linalg/kernels.h"
#include "testing/cuda_testing.h"
#if defined(TALLY_WITH_CUDA)
#include "tensor/linalg/cuda.h"
#endif

namespace tally {
namespace {

using testing::both;
using testing::close_scaled;
using testing::kGpu;
using testing::max_scaled_error;
using testing::Pair;
using testing::rand_tensor;

constexpr DType kF32 = DType::float32, kF64 = DType::float64, kF16 = DType::float16,
                kBF16 = DType::bfloat16;

std::string dname(DType d) {
  return dtype_name(d);
}

// The same view of both.
template <typename F>
Pair view(const Pair& p, F f) {
  return {f(p.cpu), f(p.gpu)};
}
Pair tr(const Pair& p, int64_t d0 = -2, int64_t d1 = -1) {
  return view(p, [&](const Tensor& t) { return ops::transpose(t, d0, d1); });
}

std::string layout_of(const Tensor& t) {
  return t.shape_string() + " strides " + shape_str(t.strides()) + " offset " +
         std::to_string(t.storage_offset());
}

double product_tol(DType d, int64_t K) {
  const double k = std::sqrt(static_cast<double>(std::max<int64_t>(K, 1)));
  if (d == kF32) return 1e-5 * k;
  if (d == kF64) return 1e-12 * k;
  return 2e-2;
}

Tensor f64(const Tensor& t) {
  return ops::to(t, Device::cpu(), kF64);
}

using BinOp = std::function<Tensor(const Tensor&, const Tensor&)>;

// op on the GPU operands against op on float64 copies of the CPU operands.
void check_product(const std::string& what, const BinOp& op, const Pair& a, const Pair& b,
                   int64_t K) {
  SCOPED_TRACE(what + " " + dname(a.gpu.dtype()) + ": a " + layout_of(a.gpu) + ", b " +
               layout_of(b.gpu));
  Tensor got;
  try {
    got = op(a.gpu, b.gpu);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw: " << e.what();
    return;
  }
  EXPECT_EQ(got.device(), kGpu);
  EXPECT_EQ(got.dtype(), a.gpu.dtype());
  const Tensor ref = op(f64(a.cpu), f64(b.cpu));
  EXPECT_TRUE(close_scaled(got, ref, product_tol(a.gpu.dtype(), K)));
}

const BinOp kMatmul = [](const Tensor& a, const Tensor& b) { return ops::matmul(a, b); };
const BinOp kMm = [](const Tensor& a, const Tensor& b) { return ops::mm(a, b); };
const BinOp kBmm = [](const Tensor& a, const Tensor& b) { return ops::bmm(a, b); };

class CudaLinalgDtype : public ::testing::TestWithParam<DType> {};

TEST_P(CudaLinalgDtype, MatrixProductsMatchTheCpu) {
  REQUIRE_GPU();
  const DType d = GetParam();
  uint64_t seed = 100;
  auto P = [&](const Shape& s) { return both(s, d, seed++); };

  // 2-D, odd sizes.
  {
    const Pair a = P({37, 53}), b = P({53, 29});
    check_product("mm", kMm, a, b, 53);
    check_product("matmul 2-D", kMatmul, a, b, 53);
  }
  // Transposed operands (opA/opB = T): a @ w^T, a^T @ b, a^T @ w^T.
  {
    const Pair a = P({37, 53}), w = P({29, 53}), at = P({53, 37}), b = P({53, 29});
    check_product("mm a @ w^T", kMm, a, tr(w), 53);
    check_product("mm a^T @ b", kMm, tr(at), b, 53);
    check_product("mm a^T @ w^T", kMm, tr(at), tr(w), 53);
  }
  // Narrowed operands: leading dimension larger than the row, misaligned base pointers.
  {
    const Pair a = view(P({37, 64}), [](const Tensor& t) { return ops::narrow(t, 1, 3, 53); });
    const Pair b = view(P({53, 40}), [](const Tensor& t) { return ops::narrow(t, 1, 1, 29); });
    check_product("mm narrowed", kMm, a, b, 53);
    const Pair bt = view(P({33, 53}), [](const Tensor& t) {
      return ops::transpose(ops::narrow(t, 0, 1, 29), 0, 1);  // [53, 29], column stride 53
    });
    check_product("mm narrowed transposed", kMm, a, bt, 53);
  }
  // Not BLAS-readable (every other column): the raw op copies it first.
  {
    const Pair a = view(P({37, 106}), [](const Tensor& t) { return ops::slice(t, 1, 0, 106, 2); });
    check_product("matmul strided columns", kMatmul, a, P({53, 29}), 53);
  }
  // 1-D cases: dot, matrix-vector, vector-matrix, vector with batches on either side,
  // a strided vector.
  {
    check_product("dot", kMatmul, P({101}), P({101}), 101);
    check_product("matrix-vector", kMatmul, P({37, 53}), P({53}), 53);
    check_product("vector-matrix", kMatmul, P({53}), P({53, 29}), 53);
    check_product("vector @ batch", kMatmul, P({53}), P({3, 53, 29}), 53);
    check_product("batch @ vector", kMatmul, P({2, 3, 37, 53}), P({53}), 53);
    const Pair col = view(P({53, 7}), [](const Tensor& t) { return ops::select(t, 1, 2); });
    check_product("matrix @ strided vector", kMatmul, P({37, 53}), col, 53);
    check_product("strided vector @ matrix", kMatmul, col, P({53, 29}), 53);
  }
  // Batches: bmm, broadcast batch dims, folded batch @ matrix, matrix @ batch, expanded
  // (stride-0) batches, transposed batched operands, batch dims that need a host loop.
  {
    check_product("bmm", kBmm, P({6, 19, 35}), P({6, 35, 23}), 35);
    check_product("bmm transposed", kBmm, tr(P({6, 35, 19})), tr(P({6, 23, 35})), 35);
    check_product("broadcast [3,1,5,7] @ [4,7,6]", kMatmul, P({3, 1, 5, 7}), P({4, 7, 6}), 7);
    check_product("broadcast [2,1,33,47] @ [5,47,19]", kMatmul, P({2, 1, 33, 47}), P({5, 47, 19}),
                  47);
    check_product("broadcast [5,1,9,11] @ [1,4,11,8]", kMatmul, P({5, 1, 9, 11}), P({1, 4, 11, 8}),
                  11);
    check_product("batch @ matrix (folded)", kMatmul, P({4, 17, 33}), P({33, 21}), 33);
    check_product("batch @ matrix^T (folded)", kMatmul, P({4, 17, 33}), tr(P({21, 33})), 33);
    check_product("matrix @ batch", kMatmul, P({17, 33}), P({3, 33, 21}), 33);
    const Pair ex = view(P({1, 9, 11}), [](const Tensor& t) { return ops::expand(t, {5, 9, 11}); });
    check_product("expanded batch", kMatmul, ex, P({5, 11, 8}), 11);
    // As the CPU test: transposed layouts of [3,1,5,7] and [4,7,6].
    auto transposed_layout = [](const Tensor& t) {
      return ops::transpose(ops::contiguous(ops::transpose(t, -1, -2)), -1, -2);
    };
    check_product("broadcast, transposed layouts", kMatmul,
                  view(P({3, 1, 5, 7}), transposed_layout), view(P({4, 7, 6}), transposed_layout),
                  7);
    // Batch strides [99, 396]: not one stride, so 4 strided-batched calls of 3.
    const Pair perm = view(P({3, 4, 9, 11}), [](const Tensor& t) {
      return ops::permute(t, {1, 0, 2, 3});
    });
    check_product("permuted batch dims", kMatmul, perm, P({4, 3, 11, 8}), 11);
  }
  // Larger and long-K problems (split-K algorithms, workspace).
  {
    check_product("[2,128,256] @ [256,96]", kMatmul, P({2, 128, 256}), P({256, 96}), 256);
    check_product("[16,4096] @ [4096,16]", kMm, P({16, 4096}), P({4096, 16}), 4096);
    check_product("[3,70,130] @ [3,130,90]", kBmm, P({3, 70, 130}), P({3, 130, 90}), 130);
  }
}

TEST_P(CudaLinalgDtype, LinearMatchesTheCpu) {
  REQUIRE_GPU();
  const DType d = GetParam();
  uint64_t seed = 300;
  auto P = [&](const Shape& s) { return both(s, d, seed++); };
  auto check = [&](const std::string& what, const Pair& x, const Pair& w, const Pair* b) {
    SCOPED_TRACE(what + " " + dname(d) + ": x " + layout_of(x.gpu) + ", w " + layout_of(w.gpu) +
                 (b ? ", bias " + layout_of(b->gpu) : std::string(", no bias")));
    Tensor got;
    try {
      got = ops::linear(x.gpu, w.gpu, b ? b->gpu : Tensor());
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw: " << e.what();
      return;
    }
    EXPECT_EQ(got.device(), kGpu);
    const Tensor ref = ops::linear(f64(x.cpu), f64(w.cpu), b ? f64(b->cpu) : Tensor());
    EXPECT_TRUE(close_scaled(got, ref, product_tol(d, w.cpu.size(1))));
  };
  const Pair x3 = P({4, 13, 37}), w = P({29, 37}), b = P({29});
  check("3-D input with bias", x3, w, &b);
  check("3-D input without bias", x3, w, nullptr);
  check("2-D input with bias", P({50, 37}), w, &b);
  check("1-D input with bias (one row)", P({37}), w, &b);
  const Pair xp = view(P({37, 13, 4}), [](const Tensor& t) { return ops::permute(t, {2, 1, 0}); });
  check("permuted 3-D input", xp, w, &b);
  const Pair xn = view(P({26, 50}), [](const Tensor& t) { return ops::narrow(t, 1, 5, 37); });
  check("narrowed input (ld 50, misaligned)", xn, w, &b);
  const Pair bs = view(P({58}), [](const Tensor& t) { return ops::slice(t, 0, 0, 58, 2); });
  check("strided bias", P({50, 37}), w, &bs);
  const Pair wt = tr(P({37, 29}));  // [29, 37] with strides [1, 29]
  check("transposed weight", P({50, 37}), wt, &b);
  const Pair b1 = P({1});
  check("one output feature", P({50, 37}), P({1, 37}), &b1);
  const Pair b7 = P({7});
  check("one input feature", P({10, 1}), P({7, 1}), &b7);
  const Pair xl = P({8, 64, 256}), wl = P({384, 256}), bl = P({384});
  check("larger", xl, wl, &bl);
}

TEST_P(CudaLinalgDtype, EmptyDimensions) {
  REQUIRE_GPU();
  const DType d = GetParam();
  const Tensor c = ops::matmul(ops::zeros({5, 0}, d, kGpu), ops::zeros({0, 3}, d, kGpu));
  EXPECT_EQ(c.sizes(), (Shape{5, 3}));
  EXPECT_EQ(ops::to_vector(c), std::vector<double>(15, 0.0));
  EXPECT_EQ(ops::matmul(ops::zeros({0, 4}, d, kGpu), ops::zeros({4, 3}, d, kGpu)).sizes(),
            (Shape{0, 3}));
  EXPECT_EQ(ops::matmul(ops::zeros({2, 0, 4}, d, kGpu), ops::zeros({4, 3}, d, kGpu)).sizes(),
            (Shape{2, 0, 3}));
  EXPECT_EQ(ops::bmm(ops::zeros({0, 2, 4}, d, kGpu), ops::zeros({0, 4, 3}, d, kGpu)).sizes(),
            (Shape{0, 2, 3}));
  const Tensor lin = ops::linear(ops::zeros({5, 0}, d, kGpu), ops::zeros({3, 0}, d, kGpu),
                                 ops::from_vector({1, 2, 3}, {3}, d, kGpu));
  EXPECT_EQ(ops::to_vector(lin),
            (std::vector<double>{1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3}));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaLinalgDtype, ::testing::Values(kF32, kF16, kBF16, kF64),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

// ------------------------------------------------------------------ backward

using ListFn = std::function<Tensor(const TensorList&)>;

// fn on GPU leaves of dtype d vs fn on float64 CPU leaves with the same values: the
// output, and the gradients of sum(out * w) for a random w.
void check_grads(const std::string& what, const ListFn& fn, const std::vector<Shape>& shapes,
                 DType d, double tol, uint64_t seed) {
  SCOPED_TRACE(what + " " + dname(d));
  TensorList cpu, gpu;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Tensor v = rand_tensor(shapes[i], d, seed + i, -1, 1);
    Tensor c = ops::to(v, Device::cpu(), kF64, /*copy=*/true);
    Tensor g = ops::to(v, kGpu, d, /*copy=*/true);
    c.requires_grad_();
    g.requires_grad_();
    cpu.push_back(c);
    gpu.push_back(g);
  }
  const Tensor out_c = fn(cpu);
  const Tensor w = rand_tensor(out_c.sizes(), d, seed + 50, -1, 1);
  sum(mul(out_c, f64(w))).backward();
  Tensor out_g;
  try {
    out_g = fn(gpu);
    sum(mul(out_g, ops::to(w, kGpu, d))).backward();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw: " << e.what();
    return;
  }
  EXPECT_EQ(out_g.device(), kGpu);
  EXPECT_TRUE(close_scaled(out_g, out_c, tol)) << "forward";
  for (size_t i = 0; i < gpu.size(); ++i) {
    ASSERT_TRUE(gpu[i].grad().defined()) << "input " << i << " got no gradient";
    EXPECT_EQ(gpu[i].grad().device(), kGpu) << "input " << i;
    EXPECT_EQ(gpu[i].grad().dtype(), d) << "input " << i;
    EXPECT_TRUE(close_scaled(gpu[i].grad(), cpu[i].grad(), tol))
        << "gradient of input " << i << " " << shape_str(shapes[i]);
  }
}

TEST(CudaLinalg, ProductGradientsMatchTheCpu) {
  REQUIRE_GPU();
  auto mm2 = [](const TensorList& x) { return matmul(x[0], x[1]); };
  for (DType d : {kF32, kF64, kBF16}) {
    const double tol = d == kF32 ? 1e-4 : d == kF64 ? 1e-10 : 3e-2;
    check_grads("broadcast batches", mm2, {{2, 1, 13, 17}, {5, 17, 11}}, d, tol, 1);
    check_grads("matrix @ batch", mm2, {{13, 17}, {3, 17, 11}}, d, tol, 3);
    check_grads("batch @ matrix", mm2, {{3, 13, 17}, {17, 11}}, d, tol, 5);
    check_grads("dot", mm2, {{17}, {17}}, d, tol, 7);
    check_grads("matrix-vector", mm2, {{13, 17}, {17}}, d, tol, 9);
    check_grads("vector-matrix", mm2, {{17}, {17, 11}}, d, tol, 11);
    check_grads("vector @ batch", mm2, {{17}, {2, 17, 11}}, d, tol, 13);
    check_grads("batch @ vector", mm2, {{2, 1, 13, 17}, {17}}, d, tol, 15);
    check_grads(
        "transposed views in the graph",
        [](const TensorList& x) { return matmul(x[0].t(), x[1].transpose(-1, -2)); },
        {{17, 13}, {2, 11, 17}}, d, tol, 17);
    check_grads(
        "mm", [](const TensorList& x) { return mm(x[0], x[1]); }, {{13, 17}, {17, 11}}, d, tol, 19);
    check_grads(
        "bmm with a transposed operand",
        [](const TensorList& x) { return bmm(x[0], x[1].transpose(1, 2)); },
        {{3, 13, 17}, {3, 11, 17}}, d, tol, 21);
    check_grads(
        "linear 3-D with bias", [](const TensorList& x) { return linear(x[0], x[1], x[2]); },
        {{4, 13, 37}, {29, 37}, {29}}, d, tol, 23);
    check_grads(
        "linear without bias", [](const TensorList& x) { return linear(x[0], x[1]); },
        {{4, 13, 37}, {29, 37}}, d, tol, 26);
    check_grads(
        "linear 1-D input", [](const TensorList& x) { return linear(x[0], x[1], x[2]); },
        {{37}, {29, 37}, {29}}, d, tol, 28);
  }
}

// ------------------------------------------------------------------ TF32, epilogue

#if defined(TALLY_WITH_CUDA)
TEST(CudaLinalg, Float32IsExactUnlessTf32IsAllowed) {
  REQUIRE_GPU();
  EXPECT_FALSE(cuda::allow_tf32()) << "TF32 must be off by default";
  const Pair a = both({512, 512}, kF32, 1), b = both({512, 512}, kF32, 2);
  const Tensor ref = ops::mm(f64(a.cpu), f64(b.cpu));
  const double fp32 = max_scaled_error(ops::mm(a.gpu, b.gpu), ref);
  cuda::set_allow_tf32(true);
  double tf32 = 0;
  try {
    tf32 = max_scaled_error(ops::mm(a.gpu, b.gpu), ref);
  } catch (...) {
    cuda::set_allow_tf32(false);
    throw;
  }
  cuda::set_allow_tf32(false);
  const double again = max_scaled_error(ops::mm(a.gpu, b.gpu), ref);
  std::printf(
      "512^3 float32 GEMM, error relative to max|ref|: TF32 off %.3g, on %.3g, off again %.3g\n",
      fp32, tf32, again);
  // Inputs uniform in [-2, 2), K = 512: float32 accumulation errs by about 1e-6 of
  // max|ref| at worst; TF32 (inputs rounded to a 10-bit mantissa) by about 4e-4.
  EXPECT_LT(fp32, 2e-5);
  EXPECT_LT(again, 2e-5);
  EXPECT_GT(tf32, 5e-5) << "allow_tf32 had no effect";
  EXPECT_LT(tf32, 1e-2);
}

TEST(CudaLinalg, LinearUsesTheBiasEpilogue) {
  REQUIRE_GPU();
  for (DType d : {kF32, kF16, kBF16, kF64}) {
    const Pair x = both({64, 96}, d, 1), w = both({48, 96}, d, 2), b = both({48}, d, 3);
    const cuda::MatmulStats before = cuda::matmul_stats();
    const Tensor y = ops::linear(x.gpu, w.gpu, b.gpu);
    const cuda::MatmulStats after = cuda::matmul_stats();
    std::printf("linear %s: bias epilogue %llu, fallback %llu, cublasLtMatmul calls %llu\n",
                dtype_name(d),
                static_cast<unsigned long long>(after.bias_epilogue - before.bias_epilogue),
                static_cast<unsigned long long>(after.bias_fallback - before.bias_fallback),
                static_cast<unsigned long long>(after.lt_calls - before.lt_calls));
    EXPECT_EQ(
        after.bias_epilogue + after.bias_fallback - before.bias_epilogue - before.bias_fallback,
        1u);
    if (d != kF64) {
      EXPECT_EQ(after.bias_epilogue - before.bias_epilogue, 1u) << dtype_name(d);
    }
    EXPECT_TRUE(
        close_scaled(y, ops::linear(f64(x.cpu), f64(w.cpu), f64(b.cpu)), product_tol(d, 96)))
        << dtype_name(d);
  }
  // One row: PyTorch's conditions keep degenerate shapes off the epilogue.
  const Pair x1 = both({96}, kF32, 4), w = both({48, 96}, kF32, 5), b = both({48}, kF32, 6);
  const cuda::MatmulStats before = cuda::matmul_stats();
  const Tensor y1 = ops::linear(x1.gpu, w.gpu, b.gpu);
  EXPECT_EQ(cuda::matmul_stats().bias_fallback - before.bias_fallback, 1u);
  EXPECT_TRUE(
      close_scaled(y1, ops::linear(f64(x1.cpu), f64(w.cpu), f64(b.cpu)), product_tol(kF32, 96)));
  // The algorithm of a repeated problem comes from the plan cache.
  const Pair p = both({40, 50}, kF32, 7), q = both({50, 60}, kF32, 8);
  (void)ops::mm(p.gpu, q.gpu);
  const uint64_t queries = cuda::matmul_stats().heuristic_queries;
  (void)ops::mm(p.gpu, q.gpu);
  EXPECT_EQ(cuda::matmul_stats().heuristic_queries, queries);
}

// Every product through the fallbacks (classic cuBLAS, the bias kernel), as happens when
// cuBLASLt's heuristic offers no algorithm for a problem.
TEST(CudaLinalg, ClassicCublasFallbackMatchesTheCpu) {
  REQUIRE_GPU();
  struct Force {
    Force() { cuda::set_force_cublas_fallback(true); }
    ~Force() { cuda::set_force_cublas_fallback(false); }
  } force;
  for (DType d : {kF32, kF16, kBF16, kF64}) {
    uint64_t seed = 700;
    auto P = [&](const Shape& s) { return both(s, d, seed++); };
    const cuda::MatmulStats before = cuda::matmul_stats();
    check_product("fallback mm", kMm, P({37, 53}), P({53, 29}), 53);
    check_product("fallback a^T @ w^T", kMm, tr(P({53, 37})), tr(P({29, 53})), 53);
    check_product("fallback narrowed", kMm,
                  view(P({37, 64}), [](const Tensor& t) { return ops::narrow(t, 1, 3, 53); }),
                  P({53, 29}), 53);
    check_product("fallback broadcast", kMatmul, P({2, 1, 33, 47}), P({5, 47, 19}), 47);
    const Pair ex = view(P({1, 9, 11}), [](const Tensor& t) { return ops::expand(t, {5, 9, 11}); });
    check_product("fallback expanded batch", kMatmul, ex, P({5, 11, 8}), 11);
    check_product("fallback vector @ batch", kMatmul, P({53}), P({3, 53, 29}), 53);
    const Pair x = P({4, 13, 37}), w = P({29, 37}), b = P({29});
    const Tensor y = ops::linear(x.gpu, w.gpu, b.gpu);
    EXPECT_TRUE(
        close_scaled(y, ops::linear(f64(x.cpu), f64(w.cpu), f64(b.cpu)), product_tol(d, 37)))
        << "fallback linear " << dname(d);
    const cuda::MatmulStats after = cuda::matmul_stats();
    EXPECT_GE(after.classic_calls - before.classic_calls, 7u) << dname(d);
    EXPECT_EQ(after.lt_calls, before.lt_calls) << dname(d);
    EXPECT_EQ(after.bias_fallback - before.bias_fallback, 1u) << dname(d);
  }
}
#endif

// ------------------------------------------------------------------ allocator categories

#if defined(TALLY_WITH_CUDA)
TEST(CudaLinalg, CublasLtWorkspaceIsTaggedWorkspace) {
  REQUIRE_GPU();
  memory::CachingAllocator& alloc = memory::get_allocator(kGpu);
  const size_t ws_bytes = cuda::matmul_workspace_bytes();
  ASSERT_GT(ws_bytes, 0u) << "CUBLASLT_WORKSPACE_SIZE=0 in the environment?";
  const Pair a = both({64, 96}, kF32, 1), b = both({96, 48}, kF32, 2), bias = both({48}, kF32, 3);
  const Pair a3 = both({2, 64, 96}, kF32, 4);
  const Tensor w = ops::contiguous(ops::transpose(b.gpu, 0, 1));  // [48, 96]

  alloc.record_memory_history(true);
  const Tensor y1 = ops::mm(a.gpu, b.gpu);
  const Tensor y2 = ops::matmul(a3.gpu, b.gpu);
  const Tensor y3 = ops::linear(a.gpu, w, bias.gpu);
  const Tensor y4 = ops::bmm(a3.gpu, ops::expand(ops::unsqueeze(b.gpu, 0), {2, 96, 48}));
  const std::vector<memory::TraceEntry> history = alloc.history();
  alloc.record_memory_history(false);

  std::map<std::string, int> workspace_allocs;
  std::set<uint64_t> live;
  for (const memory::TraceEntry& e : history) {
    if (e.action == memory::TraceAction::alloc && e.tag.category == memory::Category::workspace) {
      const std::string op = e.tag.op ? memory::interned(e.tag.op) : std::string("<none>");
      ++workspace_allocs[op];
      EXPECT_GE(e.size, ws_bytes) << "workspace block for " << op;
      live.insert(e.addr);
    }
    if (e.action == memory::TraceAction::free_requested) live.erase(e.addr);
  }
  std::string seen;
  for (const auto& [op, n] : workspace_allocs) seen += op + ":" + std::to_string(n) + " ";
  SCOPED_TRACE("workspace allocations by op: " + seen);
  EXPECT_GE(workspace_allocs["mm"], 1);
  EXPECT_GE(workspace_allocs["matmul"], 1);
  EXPECT_GE(workspace_allocs["linear"], 1);
  EXPECT_GE(workspace_allocs["bmm"], 1);
  EXPECT_EQ(workspace_allocs.count("<none>"), 0u);
  EXPECT_TRUE(live.empty()) << live.size() << " workspace blocks were not returned";
  // Nothing stays tagged workspace between ops; nothing is untagged.
  const memory::DeviceStats stats = alloc.stats();
  EXPECT_EQ(stats.cat_bytes(memory::Category::workspace).current, 0);
  EXPECT_GE(stats.cat_bytes(memory::Category::workspace).peak, static_cast<int64_t>(ws_bytes));
  EXPECT_EQ(stats.cat_bytes(memory::Category::unknown).current, 0);
  EXPECT_TRUE(close_scaled(y1, ops::mm(f64(a.cpu), f64(b.cpu)), 1e-4));
  EXPECT_TRUE(close_scaled(y4, ops::matmul(f64(a3.cpu), f64(b.cpu)), 1e-4));
  (void)y2;
  (void)y3;

  // With the workspace off, products allocate none and stay right.
  cuda::set_matmul_workspace_bytes(0);
  alloc.record_memory_history(true);
  const Tensor z = ops::matmul(a3.gpu, b.gpu);
  const Tensor zl = ops::linear(a.gpu, w, bias.gpu);
  const std::vector<memory::TraceEntry> h2 = alloc.history();
  alloc.record_memory_history(false);
  cuda::set_matmul_workspace_bytes(ws_bytes);
  for (const memory::TraceEntry& e : h2)
    EXPECT_FALSE(e.action == memory::TraceAction::alloc &&
                 e.tag.category == memory::Category::workspace)
        << "workspace allocated with the workspace disabled";
  EXPECT_TRUE(close_scaled(z, ops::matmul(f64(a3.cpu), f64(b.cpu)), 1e-4));
  EXPECT_TRUE(close_scaled(
      zl, ops::linear(f64(a.cpu), f64(ops::transpose(b.cpu, 0, 1)), f64(bias.cpu)), 1e-4));
}
#endif

// ------------------------------------------------------------------ embedding

Tensor rnd_weight(const Shape& s, DType d, uint64_t seed) {
  if (d == DType::int64 || d == DType::int32) {
    Generator g(seed);
    return ops::randint(-1000, 1000, s, d, Device::cpu(), &g);
  }
  return rand_tensor(s, d, seed);
}

Tensor rnd_indices(int64_t V, const Shape& s, DType d, uint64_t seed) {
  Generator g(seed);
  return ops::randint(0, V, s, d, Device::cpu(), &g);
}

void expect_identical(const Tensor& got, const Tensor& ref, const std::string& what) {
  ASSERT_EQ(got.sizes(), ref.sizes()) << what;
  EXPECT_EQ(got.device(), kGpu) << what;
  EXPECT_EQ(got.dtype(), ref.dtype()) << what;
  const std::vector<double> a = ops::to_vector(got), b = ops::to_vector(ref);
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && !(std::isnan(a[i]) && std::isnan(b[i]))) {
      if (bad++ == 0) first = i;
    }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements differ, first at flat index " << first
                     << " (got " << (bad ? a[first] : 0) << ", expected " << (bad ? b[first] : 0)
                     << ")";
}

TEST(CudaLinalg, EmbeddingGatherMatchesTheCpu) {
  REQUIRE_GPU();
  const int64_t V = 50;
  uint64_t seed = 1;
  for (DType d : {kF32, kF16, kBF16, kF64, DType::int64}) {
    // D = 64: 16-byte vector path; 37: element path; 8: one vector per bf16/fp16 row.
    for (int64_t D : {64, 37, 8}) {
      const Tensor wc = rnd_weight({V, D}, d, seed++);
      const Tensor wg = ops::to(wc, kGpu, d);
      for (DType id : {DType::int64, DType::int32}) {
        const Tensor ic = rnd_indices(V, {7, 13}, id, seed++);  // 91 lookups: repeats
        const Tensor ig = ops::to(ic, kGpu, id);
        const std::string what = dname(d) + " D=" + std::to_string(D) + " indices " + dname(id);
        expect_identical(ops::embedding(wg, ig), ops::embedding(wc, ic), what);
        // Transposed (non-contiguous) indices.
        expect_identical(ops::embedding(wg, ops::transpose(ig, 0, 1)),
                         ops::embedding(wc, ops::transpose(ic, 0, 1)),
                         what + " transposed indices");
      }
      // A transposed weight (column stride V), a narrowed one (offset, row stride > D).
      const Tensor wtc = rnd_weight({D, V}, d, seed++);
      const Tensor wtg = ops::to(wtc, kGpu, d);
      const Tensor ic = rnd_indices(V, {33}, DType::int64, seed++),
                   ig = ops::to(ic, kGpu, DType::int64);
      expect_identical(ops::embedding(ops::transpose(wtg, 0, 1), ig),
                       ops::embedding(ops::transpose(wtc, 0, 1), ic),
                       dname(d) + " transposed weight");
      const Tensor widec = rnd_weight({V, D + 24}, d, seed++);
      const Tensor wideg = ops::to(widec, kGpu, d);
      for (int64_t start : {int64_t{3}, int64_t{16}}) {
        expect_identical(ops::embedding(ops::narrow(wideg, 1, start, D), ig),
                         ops::embedding(ops::narrow(widec, 1, start, D), ic),
                         dname(d) + " narrowed weight, start " + std::to_string(start) +
                             " D=" + std::to_string(D));
      }
    }
  }
  // A 0-D index.
  const Tensor wc = rand_tensor({V, 5}, kF32, 99);
  const Tensor i0 = ops::from_vector({7}, {}, DType::int64);
  const Tensor e0 = ops::embedding(ops::to(wc, kGpu, kF32), ops::to(i0, kGpu, DType::int64));
  EXPECT_EQ(e0.sizes(), (Shape{5}));
  expect_identical(e0, ops::embedding(wc, i0), "0-D index");
}

TEST(CudaLinalg, EmbeddingOutOfRangeIndicesGiveNanRows) {
  REQUIRE_GPU();
  // The CPU throws; the GPU cannot without a host synchronisation, so the row is NaN.
  const Tensor wc = rand_tensor({4, 3}, kF32, 1);
  const Tensor idx = ops::from_vector({1, 4, -1, 3}, {4}, DType::int64, kGpu);
  const std::vector<double> got = ops::to_vector(ops::embedding(ops::to(wc, kGpu, kF32), idx));
  const std::vector<double> w = ops::to_vector(wc);
  ASSERT_EQ(got.size(), 12u);
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(got[static_cast<size_t>(j)], w[static_cast<size_t>(3 + j)]);
    EXPECT_TRUE(std::isnan(got[static_cast<size_t>(3 + j)]));
    EXPECT_TRUE(std::isnan(got[static_cast<size_t>(6 + j)]));
    EXPECT_EQ(got[static_cast<size_t>(9 + j)], w[static_cast<size_t>(9 + j)]);
  }
  // Backward skips them.
  const Tensor gw = ops::embedding_backward(ops::ones({4, 3}, kF32, kGpu), idx, 4, -1);
  EXPECT_EQ(ops::to_vector(gw), (std::vector<double>{0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1}));
}

TEST(CudaLinalg, EmbeddingBackwardMatchesTheCpu) {
  REQUIRE_GPU();
  const int64_t V = 37;
  uint64_t seed = 500;
  for (DType d : {kF32, kF16, kBF16, kF64}) {
    const double tol = d == kF32 ? 1e-5 : d == kF64 ? 1e-12 : 1e-2;
    for (int64_t D : {64, 37}) {
      for (int64_t pad : {int64_t{-1}, int64_t{5}}) {
        for (DType id : {DType::int64, DType::int32}) {
          const std::string what = dname(d) + " D=" + std::to_string(D) + " padding_idx " +
                                   std::to_string(pad) + " indices " + dname(id);
          SCOPED_TRACE(what);
          const Tensor ic = rnd_indices(V, {9, 23}, id, seed++);  // 207 lookups into 37 rows
          const Tensor ig = ops::to(ic, kGpu, id);
          const Tensor gc = rand_tensor({9, 23, D}, d, seed++);
          const Tensor gg = ops::to(gc, kGpu, d);
          const Tensor got = ops::embedding_backward(gg, ig, V, pad);
          const Tensor ref = ops::embedding_backward(f64(gc), ic, V, pad);
          EXPECT_EQ(got.dtype(), d);
          EXPECT_EQ(got.device(), kGpu);
          EXPECT_TRUE(close_scaled(got, ref, tol));
          if (pad >= 0) {
            const std::vector<double> row = ops::to_vector(ops::select(got, 0, pad));
            EXPECT_EQ(row, std::vector<double>(static_cast<size_t>(D), 0.0)) << "padding row";
          }
        }
      }
      // A non-contiguous gradient (columns 207 apart).
      const Tensor ic = rnd_indices(V, {207}, DType::int64, seed++);
      const Tensor gc = ops::transpose(rand_tensor({D, 207}, d, seed++), 0, 1);
      const Tensor gg = ops::transpose(ops::to(ops::transpose(gc, 0, 1), kGpu, d), 0, 1);
      ASSERT_FALSE(gg.is_contiguous());
      EXPECT_TRUE(close_scaled(ops::embedding_backward(gg, ops::to(ic, kGpu, DType::int64), V, 3),
                               ops::embedding_backward(f64(gc), ic, V, 3), tol))
          << dname(d) << " transposed grad, D=" << D;
    }
  }
  // 16-bit weights accumulate in float32: 300 ones into one row is exactly 300.
  const Tensor many = ops::zeros({300}, DType::int64, kGpu);
  const Tensor g300 = ops::embedding_backward(ops::full({300, 2}, 1.0, kBF16, kGpu), many, 2, -1);
  EXPECT_EQ(ops::to_vector(g300), (std::vector<double>{300, 300, 0, 0}));
}

#if defined(TALLY_WITH_CUDA)
TEST(CudaLinalg, EmbeddingBackwardKernelTakesNarrowGradIntoFloat32) {
  REQUIRE_GPU();
  // The kernel contract allows grad narrower than grad_weight (bf16 into float32).
  const Tensor ic = rnd_indices(11, {300}, DType::int64, 3);
  const Tensor gc = rand_tensor({300, 19}, kBF16, 4);
  Tensor gw = ops::zeros({11, 19}, kF32, kGpu);
  cuda::linalg_kernels.embedding_backward(gw, ops::to(gc, kGpu, kBF16),
                                          ops::to(ic, kGpu, DType::int64), 2);
  Tensor ref = ops::zeros({11, 19}, kF32);
  cpu::linalg_kernels.embedding_backward(ref, ops::to(gc, kF32), ic, 2);
  EXPECT_TRUE(close_scaled(gw, ref, 1e-5));
}
#endif

TEST(CudaLinalg, EmbeddingGradientThroughAutograd) {
  REQUIRE_GPU();
  for (DType d : {kF32, kBF16}) {
    const Tensor wv = rand_tensor({23, 40}, d, 1);
    Tensor wc = ops::to(wv, Device::cpu(), kF64, true);
    Tensor wg = ops::to(wv, kGpu, d, true);
    wc.requires_grad_();
    wg.requires_grad_();
    const Tensor ic = rnd_indices(23, {6, 50}, DType::int64, 2);
    const Tensor g = rand_tensor({6, 50, 40}, d, 3);
    embedding(wc, ic, 4).backward(f64(g));
    embedding(wg, ops::to(ic, kGpu, DType::int64), 4).backward(ops::to(g, kGpu, d));
    ASSERT_TRUE(wg.grad().defined());
    EXPECT_EQ(wg.grad().dtype(), d);
    EXPECT_TRUE(close_scaled(wg.grad(), wc.grad(), d == kF32 ? 1e-5 : 1e-2)) << dname(d);
  }
}

}  // namespace
}  // namespace tally
