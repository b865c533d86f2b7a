// The contiguous, 16-byte-vector fast path of the CUDA elementwise kernels (label gpu:
// skipped without a device), against the CPU: every floating dtype, sizes around the pack
// width (tails of 1..15 elements), sizes above the grid cap (grid-stride loop with two packs
// in flight), a misaligned view (falls back to the strided path), binary/scalar/unary maps,
// affine, and a same-dtype contiguous copy.
#include <cmath>

#include "testing/cuda_testing.h"

namespace tally {
namespace {

using testing::kGpu;
using testing::max_pointwise_error_lenient;
using testing::pointwise_tol;
using testing::rand_tensor;
using testing::to_gpu;

TEST(CudaVectorized, MapsMatchTheCpuAcrossSizesAndAlignments) {
  REQUIRE_GPU();
  uint64_t seed = 10;
  for (const DType d : testing::kFloatDtypes) {
    for (const int64_t n :
         std::initializer_list<int64_t>{1, 7, 8, 9, 17, 1000003, (int64_t{3} << 20) + 5}) {
      for (const bool misaligned : {false, true}) {
        const Tensor a0 = rand_tensor({n + 1}, d, ++seed, 0.1, 2),
                     b0 = rand_tensor({n + 1}, d, ++seed, 0.1, 2);
        // misaligned: a view one element in, so the data pointer is not 16-byte aligned
        const int64_t off = misaligned ? 1 : 0;
        const Tensor a = ops::narrow(a0, 0, off, n), b = ops::narrow(b0, 0, off, n);
        const Tensor ag = ops::narrow(to_gpu(a0), 0, off, n),
                     bg = ops::narrow(to_gpu(b0), 0, off, n);
        const double tol = pointwise_tol(d) * 2;
        const std::string what = std::string(dtype_name(d)) + " n=" + std::to_string(n) +
                                 (misaligned ? " misaligned" : "");
        for (const ops::BinaryOp op :
             {ops::BinaryOp::add, ops::BinaryOp::sub, ops::BinaryOp::mul, ops::BinaryOp::div,
              ops::BinaryOp::maximum, ops::BinaryOp::relu_backward, ops::BinaryOp::gelu_backward,
              ops::BinaryOp::gelu_tanh_backward, ops::BinaryOp::add_relu,
              ops::BinaryOp::silu_backward, ops::BinaryOp::sigmoid_backward,
              ops::BinaryOp::tanh_backward, ops::BinaryOp::silu_mul}) {
          EXPECT_LE(max_pointwise_error_lenient(ops::binary(op, ag, bg), ops::binary(op, a, b)),
                    tol)
              << ops::binary_op_name(op) << " " << what;
        }
        EXPECT_LE(max_pointwise_error_lenient(ops::scalar_binary(ops::BinaryOp::sub, 3.0, ag),
                                              ops::scalar_binary(ops::BinaryOp::sub, 3.0, a)),
                  tol)
            << what;
        EXPECT_LE(max_pointwise_error_lenient(ops::binary_scalar(ops::BinaryOp::div, ag, 3.0),
                                              ops::binary_scalar(ops::BinaryOp::div, a, 3.0)),
                  tol)
            << what;
        for (const ops::UnaryOp op :
             {ops::UnaryOp::relu, ops::UnaryOp::gelu, ops::UnaryOp::gelu_tanh, ops::UnaryOp::exp,
              ops::UnaryOp::sqrt, ops::UnaryOp::neg}) {
          EXPECT_LE(max_pointwise_error_lenient(ops::unary(op, ag), ops::unary(op, a)), tol)
              << ops::unary_op_name(op) << " " << what;
        }
        EXPECT_LE(
            max_pointwise_error_lenient(ops::affine(ag, 0.5, -1.0), ops::affine(a, 0.5, -1.0)), tol)
            << what;
        EXPECT_EQ(max_pointwise_error_lenient(ops::clone(ag), a), 0.0) << what;
      }
    }
  }
}

TEST(CudaVectorized, BroadcastAndMixedLayoutsStayOnTheGeneralPath) {
  REQUIRE_GPU();
  const Tensor a = rand_tensor({64, 33}, DType::bfloat16, 1),
               b = rand_tensor({33}, DType::bfloat16, 2);
  const Tensor t = ops::transpose(rand_tensor({33, 64}, DType::bfloat16, 3), 0, 1);
  EXPECT_LE(max_pointwise_error_lenient(ops::add(to_gpu(a), to_gpu(b)), ops::add(a, b)), 1e-2);
  EXPECT_LE(max_pointwise_error_lenient(
                ops::mul(to_gpu(a),
                         ops::transpose(to_gpu(ops::contiguous(ops::transpose(t, 0, 1))), 0, 1)),
                ops::mul(a, t)),
            1e-2);
}

}  // namespace
}  // namespace tally
