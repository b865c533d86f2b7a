// The core ops on CUDA against the CPU reference (label gpu: skipped without a device).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "testing/cuda_testing.h"

namespace tally {
namespace {

using testing::kGpu;
using testing::max_pointwise_error_lenient;
using testing::pointwise_tol;
using testing::rand_tensor;
using testing::to_gpu;

TEST(CudaElementwise, RandomNumbersMatchTheCpu) {
  REQUIRE_GPU();
  for (auto kind : {0, 1, 2}) {
    Generator g1(5), g2(5);
    const Tensor c = kind == 0   ? ops::rand({1003}, DType::float32, Device::cpu(), &g1)
                     : kind == 1 ? ops::randn({1003}, DType::float32, Device::cpu(), &g1)
                                 : ops::randint(-5, 100, {1003}, DType::int64, Device::cpu(), &g1);
    const Tensor d = kind == 0   ? ops::rand({1003}, DType::float32, kGpu, &g2)
                     : kind == 1 ? ops::randn({1003}, DType::float32, kGpu, &g2)
                                 : ops::randint(-5, 100, {1003}, DType::int64, kGpu, &g2);
    EXPECT_LT(max_pointwise_error_lenient(d, c), 1e-6) << kind;
  }
}

TEST(CudaElementwise, CopiesRoundTripAllDtypesAndLayouts) {
  REQUIRE_GPU();
  const Tensor src = rand_tensor({3, 4, 5}, DType::float64, 1);
  for (DType d : {DType::float32, DType::float16, DType::bfloat16, DType::float64, DType::int32,
                  DType::int64, DType::bool_}) {
    const Tensor c = ops::to(src, d);
    const Tensor g = ops::to(c, kGpu, d);
    EXPECT_EQ(max_pointwise_error_lenient(g, c), 0.0) << dtype_name(d);
    // strided device-side copy with a dtype change
    const Tensor gt = ops::contiguous(ops::permute(g, {2, 0, 1}));
    EXPECT_EQ(max_pointwise_error_lenient(gt, ops::contiguous(ops::permute(c, {2, 0, 1}))), 0.0)
        << dtype_name(d);
  }
  // host -> device into a non-contiguous destination
  Tensor dst = ops::zeros({5, 4}, DType::float32, kGpu);
  ops::copy_(ops::transpose(dst, 0, 1),
             ops::to(rand_tensor({4, 5}, DType::float64, 2), DType::float32));
  EXPECT_EQ(
      max_pointwise_error_lenient(ops::transpose(dst, 0, 1),
                                  ops::to(rand_tensor({4, 5}, DType::float64, 2), DType::float32)),
      0.0);
}

// Contiguous casts among float32 / float16 / bfloat16 take the vectorised path (8 elements a
// step, 16-byte accesses); a length that is not a multiple of 8 exercises its tail, a view
// starting 2 elements in (not 16-byte aligned) the general path. Both round like the CPU.
TEST(CudaElementwise, VectorisedCastsMatchTheCpu) {
  REQUIRE_GPU();
  const DType family[] = {DType::float32, DType::float16, DType::bfloat16};
  for (const int64_t n : {int64_t{8}, int64_t{1003}, int64_t{1 << 20} + 5}) {
    const Tensor src64 = ops::mul(rand_tensor({n}, DType::float64, 7), 300.0);
    for (DType from : family) {
      const Tensor c_from = ops::to(src64, from);
      const Tensor g_from = ops::to(c_from, kGpu, from);
      for (DType to : family) {
        if (to == from) continue;
        const Tensor want = ops::to(c_from, to);
        EXPECT_EQ(max_pointwise_error_lenient(ops::to(g_from, to), want), 0.0)
            << dtype_name(from) << " -> " << dtype_name(to) << " n " << n;
        const Tensor off = ops::narrow(g_from, 0, 2, n - 2);  // misaligned start
        EXPECT_EQ(max_pointwise_error_lenient(ops::to(off, to), ops::narrow(want, 0, 2, n - 2)),
                  0.0)
            << dtype_name(from) << " -> " << dtype_name(to) << " (offset) n " << n;
      }
    }
  }
}

TEST(CudaElementwise, BinaryUnaryMatchTheCpu) {
  REQUIRE_GPU();
  using ops::BinaryOp;
  using ops::UnaryOp;
  for (DType d : {DType::float32, DType::float16, DType::bfloat16, DType::float64}) {
    const Tensor a = rand_tensor({4, 1, 33}, d, 3), b = rand_tensor({5, 33}, d, 4, 0.5, 2);
    const Tensor ga = ops::to(a, kGpu, d), gb = ops::to(b, kGpu, d);
    for (auto op : {BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div, BinaryOp::maximum,
                    BinaryOp::minimum, BinaryOp::relu_backward, BinaryOp::gelu_backward,
                    BinaryOp::gelu_tanh_backward, BinaryOp::lt, BinaryOp::eq}) {
      EXPECT_LT(max_pointwise_error_lenient(ops::binary(op, ga, gb), ops::binary(op, a, b)),
                pointwise_tol(d))
          << dtype_name(d) << " " << ops::binary_op_name(op);
    }
    EXPECT_LT(max_pointwise_error_lenient(ops::binary(BinaryOp::pow, ops::to(b, kGpu, d), ga),
                                          ops::binary(BinaryOp::pow, b, a)),
              pointwise_tol(d) * 10);
    for (auto op :
         {UnaryOp::neg, UnaryOp::exp, UnaryOp::abs, UnaryOp::relu, UnaryOp::sigmoid, UnaryOp::tanh,
          UnaryOp::silu, UnaryOp::gelu, UnaryOp::gelu_tanh, UnaryOp::square, UnaryOp::erf}) {
      EXPECT_LT(max_pointwise_error_lenient(ops::unary(op, ga), ops::unary(op, a)),
                pointwise_tol(d))
          << dtype_name(d) << " " << ops::unary_op_name(op);
    }
    for (auto op : {UnaryOp::log, UnaryOp::sqrt, UnaryOp::rsqrt}) {
      EXPECT_LT(max_pointwise_error_lenient(ops::unary(op, gb), ops::unary(op, b)),
                pointwise_tol(d))
          << dtype_name(d) << " " << ops::unary_op_name(op);
    }
    EXPECT_LT(max_pointwise_error_lenient(ops::binary_scalar(BinaryOp::mul, ga, 3.5),
                                          ops::binary_scalar(BinaryOp::mul, a, 3.5)),
              pointwise_tol(d));
    EXPECT_LT(max_pointwise_error_lenient(ops::scalar_binary(BinaryOp::sub, 1.0, ga),
                                          ops::scalar_binary(BinaryOp::sub, 1.0, a)),
              pointwise_tol(d));
    EXPECT_LT(max_pointwise_error_lenient(ops::affine(ga, 2.0, -1.0), ops::affine(a, 2.0, -1.0)),
              pointwise_tol(d));
    EXPECT_LT(max_pointwise_error_lenient(ops::clamp(ga, -0.5, 0.7), ops::clamp(a, -0.5, 0.7)),
              pointwise_tol(d));
    const Tensor cond = ops::binary_scalar(BinaryOp::gt, a, 0.0);
    EXPECT_LT(max_pointwise_error_lenient(ops::where(ops::to(cond, kGpu, DType::bool_), ga, gb),
                                          ops::where(cond, a, b)),
              pointwise_tol(d));
    // non-contiguous operand
    EXPECT_LT(max_pointwise_error_lenient(ops::mul(ops::transpose(gb, 0, 1), 2.0),
                                          ops::mul(ops::transpose(b, 0, 1), 2.0)),
              pointwise_tol(d));
  }
}

// float16 / bfloat16 GELU (exact and tanh) take their own float32 formulas on CUDA (one exp2, no
// erff / tanhf; elementwise.cu). Every one of the 65,536 bit patterns, through the contiguous fast
// path and the strided path: each finite result within one ulp of the 16-bit type of a long-double
// reference (or 1e-9 absolute, where float32's 1 + erf saturates to 0), non-finite inputs as the
// CPU kernel gives them. The textbook float32 formula fails this in the tail (x near -5, where
// 1 + erf(x / sqrt 2) cancels).
TEST(CudaElementwise, SixteenBitGeluIsWithinOneUlpOnEveryInput) {
  REQUIRE_GPU();
  for (const DType d : {DType::bfloat16, DType::float16}) {
    const int mantissa = d == DType::bfloat16 ? 7 : 10, min_exp = d == DType::bfloat16 ? -126 : -14;
    Tensor x = ops::empty({65536}, d), wide = ops::empty({65536, 2}, d);
    auto* xb = static_cast<uint16_t*>(x.data_ptr());
    auto* wb = static_cast<uint16_t*>(wide.data_ptr());
    for (uint32_t i = 0; i < 65536; ++i)
      xb[i] = wb[2 * i] = wb[2 * i + 1] = static_cast<uint16_t>(i);
    const std::vector<double> xs = ops::to_vector(x);
    for (const ops::UnaryOp op : {ops::UnaryOp::gelu, ops::UnaryOp::gelu_tanh}) {
      const std::vector<double> cpu = ops::to_vector(ops::unary(op, x));
      for (const bool strided : {false, true}) {
        const Tensor xg = strided ? ops::select(to_gpu(wide), 1, 0) : to_gpu(x);
        ASSERT_EQ(xg.is_contiguous(), !strided);
        const std::vector<double> got =
            ops::to_vector(ops::to(ops::unary(op, xg), Device::cpu(), d));
        int bad = 0;
        std::string first;
        for (size_t i = 0; i < xs.size(); ++i) {
          const long double v = xs[i];
          bool ok;
          long double ref = 0;
          if (!std::isfinite(xs[i])) {
            ok = std::isnan(cpu[i]) ? std::isnan(got[i]) : got[i] == cpu[i];
          } else {
            if (op == ops::UnaryOp::gelu) {
              ref = v * 0.5L * std::erfc(-v / std::sqrt(2.0L));
            } else {
              const long double z = 0.7978845608028654L * (v + 0.044715L * v * v * v);
              ref = v / (1 + std::exp(-2 * z));
            }
            const int e = ref == 0 ? min_exp : std::max(std::ilogb(ref), min_exp);
            const long double ulp = std::ldexp(1.0L, e - mantissa);
            ok = std::fabs(got[i] - ref) <= std::max(ulp, 1e-9L);
          }
          if (!ok && bad++ == 0)
            first = "x = " + std::to_string(xs[i]) + ": got " + std::to_string(got[i]) +
                    ", reference " + std::to_string(static_cast<double>(ref)) + ", cpu " +
                    std::to_string(cpu[i]);
        }
        EXPECT_EQ(bad, 0) << dtype_name(d) << " " << ops::unary_op_name(op)
                          << (strided ? " strided" : " contiguous") << ": first " << first;
      }
    }
  }
}

TEST(CudaElementwise, SumMatchesTheCpu) {
  REQUIRE_GPU();
  for (DType d : {DType::float32, DType::bfloat16, DType::float64, DType::int64}) {
    const Tensor a =
        d == DType::int64 ? ops::randint(-50, 50, {6, 7, 300}) : rand_tensor({6, 7, 300}, d, 9);
    const Tensor g = ops::to(a, kGpu, a.dtype());
    const double t = d == DType::bfloat16 ? 2e-2 : 1e-5;
    EXPECT_LT(max_pointwise_error_lenient(ops::sum(g), ops::sum(a)), t) << dtype_name(d);
    EXPECT_LT(max_pointwise_error_lenient(ops::sum(g, {2}), ops::sum(a, {2})), t) << dtype_name(d);
    EXPECT_LT(max_pointwise_error_lenient(ops::sum(g, {0, 2}, true), ops::sum(a, {0, 2}, true)), t)
        << dtype_name(d);
    EXPECT_LT(max_pointwise_error_lenient(ops::sum(ops::transpose(g, 0, 2), {1}),
                                          ops::sum(ops::transpose(a, 0, 2), {1})),
              t);
  }
  // A large full reduction (many blocks per output).
  const Tensor big = rand_tensor({1 << 22}, DType::float32, 11);
  EXPECT_LT(
      max_pointwise_error_lenient(ops::sum(ops::to(big, kGpu, DType::float32)), ops::sum(big)),
      1e-5);
}

// The fast paths of a contiguous input: column sums (the outer dims reduced: a Linear's
// bias gradient, [B, T, N] -> [N]) and full sums, at widths around the 32-column tile, with
// many rows (several splits; {2, 4099, 64} and the full sums take the block-per-column reduction
// of the partials) and a storage offset; and they repeat bit for bit (no atomics).
TEST(CudaElementwise, ColumnAndFullSumsMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 60;
  for (DType d : {DType::float32, DType::bfloat16, DType::float16, DType::float64}) {
    const double tol = d == DType::float32 ? 1e-5 : d == DType::float64 ? 1e-12 : 2e-2;
    for (const Shape& shape : std::vector<Shape>{
             {4, 1000, 33}, {3, 517, 768}, {2, 4099, 64}, {2, 4099, 1}, {64, 3, 5}, {100003}}) {
      const Tensor a = rand_tensor(shape, d, ++seed);
      const Tensor g = to_gpu(a);
      const std::string what = std::string(dtype_name(d)) + " " + a.shape_string();
      if (shape.size() == 3) {
        EXPECT_LT(max_pointwise_error_lenient(ops::sum(g, {0, 1}), ops::sum(a, {0, 1})), tol)
            << what;
        EXPECT_LT(max_pointwise_error_lenient(ops::sum(g, {0}, true), ops::sum(a, {0}, true)), tol)
            << what;
        const Tensor once = ops::sum(g, {0, 1}), twice = ops::sum(g, {0, 1});
        EXPECT_EQ(max_pointwise_error_lenient(once, twice), 0.0) << what << " is deterministic";
      }
      EXPECT_LT(max_pointwise_error_lenient(ops::sum(g), ops::sum(a)), tol) << what;
      EXPECT_EQ(max_pointwise_error_lenient(ops::sum(g), ops::sum(g)), 0.0)
          << what << " full sum is deterministic";
      // A view starting 7 elements into its storage.
      const Tensor flat = ops::reshape(a, {-1});
      const int64_t n = flat.numel() - 7;
      EXPECT_LT(max_pointwise_error_lenient(ops::sum(ops::narrow(to_gpu(flat), 0, 7, n)),
                                            ops::sum(ops::narrow(flat, 0, 7, n))),
                tol)
          << what << " offset 7";
    }
  }
}

TEST(CudaAutograd, GradientsMatchTheCpu) {
  REQUIRE_GPU();
  auto f = [](const Tensor& x, const Tensor& w) {
    return sum(mul(gelu(mul(x, w)), tanh(x)) / 3.0);
  };
  Tensor xc = rand_tensor({8, 16}, DType::float32, 12), wc = rand_tensor({16}, DType::float32, 13);
  xc.requires_grad_();
  wc.requires_grad_();
  Tensor xg = ops::to(xc, kGpu, DType::float32), wg = ops::to(wc, kGpu, DType::float32);
  xg.requires_grad_();
  wg.requires_grad_();
  f(xc, wc).backward();
  f(xg, wg).backward();
  EXPECT_LT(max_pointwise_error_lenient(xg.grad(), xc.grad()), 1e-5);
  EXPECT_LT(max_pointwise_error_lenient(wg.grad(), wc.grad()), 1e-5);
  EXPECT_EQ(xg.grad().device(), kGpu);
  // Everything stayed on the device's allocator, tagged.
  const auto& stats = memory::get_allocator(kGpu).stats();
  EXPECT_EQ(stats.cat_bytes(memory::Category::unknown).current, 0);
  EXPECT_GT(stats.cat_bytes(memory::Category::gradient).current, 0);
}

}  // namespace
}  // namespace tally
