// Linear algebra: matmul (all of PyTorch's cases), mm, bmm, linear, embedding, written once
// against the device under test (tests/testing/devices.h).
// What the cases cover: docs/notes.md §20.
#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <string>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "tensor/linalg/autograd.h"
#include "tensor/linalg/kernels.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"
#if defined(TALLY_WITH_CUDA)
#include "tensor/cuda/graph.h"
#include "tensor/linalg/cuda.h"
#include "tensor/precision.h"
#endif

namespace tally {
namespace {

using namespace testing;

constexpr DType kF32 = DType::float32, kF64 = DType::float64, kF16 = DType::float16,
                kBF16 = DType::bfloat16;

std::string dname(DType d) {
  return dtype_name(d);
}

// Naive batched product of a [batch..., M, K] and b [batch..., K, N] already expanded to a
// common batch shape, row-major over the result.
std::vector<double> naive_matmul(const Tensor& a, const Tensor& b) {
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  const std::vector<double> va = ops::to_vector(a), vb = ops::to_vector(b);
  const int64_t count = a.numel() / (M * K);
  std::vector<double> out;
  for (int64_t e = 0; e < count; ++e)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k)
          s += va[static_cast<size_t>(e * M * K + m * K + k)] *
               vb[static_cast<size_t>(e * K * N + k * N + n)];
        out.push_back(s);
      }
  return out;
}

// gradcheck_on copies the leaves to the device as contiguous tensors, so a non-contiguous
// operand is made inside the checked function: the leaf holds the reversed shape
// (noncontig_leaf, the values rand_input_noncontig would give) and rev() permutes it back.
Tensor noncontig_leaf(const Shape& shape, uint64_t seed) {
  return rand_input(Shape(shape.rbegin(), shape.rend()), -1, 1, seed);
}
Tensor rev(const Tensor& t) {
  Shape perm;
  for (int64_t i = t.dim() - 1; i >= 0; --i) perm.push_back(i);
  return t.permute(perm);
}

class Linalg : public OnDevice {};
TALLY_ON_DEVICES(Linalg);

TEST_P(Linalg, MatmulValues) {
  const Tensor a = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, on({}));
  const Tensor b = from_vector({7, 8, 9, 10, 11, 12}, {3, 2}, on({}));
  EXPECT_TRUE(values_near(mm(a, b), {58, 64, 139, 154}));
  EXPECT_TRUE(values_near(matmul(a, b), {58, 64, 139, 154}));
  EXPECT_EQ(matmul(a, b).sizes(), (Shape{2, 2}));
  EXPECT_EQ(matmul(a, b).device(), dev());
  // 1-D x 1-D: a dot product, 0-D.
  const Tensor d = matmul(tensor({1, 2, 3}, on({})), tensor({4, 5, 6}, on({})));
  EXPECT_EQ(d.dim(), 0);
  EXPECT_DOUBLE_EQ(d.item(), 32.0);
  // matrix-vector and vector-matrix.
  const Tensor mv = matmul(a, tensor({1, 0, -1}, on({})));
  EXPECT_EQ(mv.sizes(), (Shape{2}));
  EXPECT_TRUE(values_near(mv, {-2, -2}));
  const Tensor vm = matmul(tensor({1, -1}, on({})), a);
  EXPECT_EQ(vm.sizes(), (Shape{3}));
  EXPECT_TRUE(values_near(vm, {-3, -3, -3}));
  // Broadcast batches: [2, 1, 2, 2] x [3, 2, 1] -> [2, 3, 2, 1].
  const Tensor ba = ops::reshape(arange(0, 8, 1, on(f64)), {2, 1, 2, 2});
  const Tensor bb = ops::reshape(arange(0, 6, 1, on(f64)), {3, 2, 1});
  const Tensor bc = matmul(ba, bb);
  EXPECT_EQ(bc.sizes(), (Shape{2, 3, 2, 1}));
  EXPECT_TRUE(values_near(bc, {1, 3, 3, 13, 5, 23, 5, 7, 23, 33, 41, 59}));
  // bmm.
  const Tensor x = ops::reshape(arange(0, 8, 1, on(f64)), {2, 2, 2});
  EXPECT_TRUE(values_near(bmm(x, x), {2, 3, 6, 11, 46, 55, 66, 79}));
  // 1-D with a batch: [2] x [3, 2, 2] -> [3, 2]; [2, 2, 3] x [3] -> [2, 2].
  const Tensor v = tensor({1, 2}, on(f64));
  const Tensor b3 = ops::reshape(arange(0, 12, 1, on(f64)), {3, 2, 2});
  EXPECT_EQ(matmul(v, b3).sizes(), (Shape{3, 2}));
  EXPECT_TRUE(values_near(matmul(v, b3), {4, 7, 16, 19, 28, 31}));
  const Tensor a3 = ops::reshape(arange(0, 12, 1, on(f64)), {2, 2, 3});
  EXPECT_EQ(matmul(a3, tensor({1, 0, 2}, on(f64))).sizes(), (Shape{2, 2}));
  EXPECT_TRUE(values_near(matmul(a3, tensor({1, 0, 2}, on(f64))), {4, 13, 22, 31}));
}

TEST_P(Linalg, MatmulAgreesWithNaiveLoops) {
  Generator g(7);
  for (DType dt : {kF32, kF64}) {
    const double tol = dt == kF32 ? 1e-4 : 1e-12;
    const Tensor a = put(ops::randn({3, 1, 5, 7}, dt, Device::cpu(), &g));
    const Tensor b = put(ops::randn({4, 7, 6}, dt, Device::cpu(), &g));
    const Tensor c = matmul(a, b);
    EXPECT_EQ(c.sizes(), (Shape{3, 4, 5, 6}));
    const std::vector<double> ref = naive_matmul(ops::contiguous(ops::expand(a, {3, 4, 5, 7})),
                                                 ops::contiguous(ops::expand(b, {3, 4, 7, 6})));
    EXPECT_TRUE(values_near(c, ref, tol));
    // Transposed and strided operands give the same numbers.
    const Tensor at = ops::transpose(ops::contiguous(ops::transpose(a, -1, -2)), -1, -2);
    const Tensor bt = ops::transpose(ops::contiguous(ops::transpose(b, -1, -2)), -1, -2);
    EXPECT_FALSE(at.is_contiguous());
    EXPECT_TRUE(values_near(matmul(at, bt), ref, tol));
    // Every other column of a wider matrix: not BLAS-readable, copied.
    const Tensor wide = put(ops::randn({5, 14}, dt, Device::cpu(), &g));
    const Tensor strided = ops::slice(wide, 1, 0, 14, 2);  // [5, 7], strides [14, 2]
    EXPECT_FALSE(ops::blas_layout(strided).has_value());
    EXPECT_TRUE(values_near(
        matmul(strided, b),
        naive_matmul(ops::contiguous(ops::expand(strided, {4, 5, 7})), ops::contiguous(b)), tol));
  }
}

// Every floating dtype, as both backends take them.
TEST_P(Linalg, EmptyDimensions) {
  for (DType dt : {kF32, kF64, kF16, kBF16}) {
    SCOPED_TRACE(dname(dt));
    const TensorOptions o = on(TensorOptions{}.with_dtype(dt));
    const Tensor c = matmul(zeros({2, 0}, o), zeros({0, 3}, o));
    EXPECT_EQ(c.sizes(), (Shape{2, 3}));
    EXPECT_EQ(c.dtype(), dt);
    EXPECT_TRUE(values_near(c, {0, 0, 0, 0, 0, 0}));
    EXPECT_EQ(matmul(zeros({0, 4}, o), zeros({4, 3}, o)).sizes(), (Shape{0, 3}));
    EXPECT_EQ(matmul(zeros({2, 0, 4}, o), zeros({4, 3}, o)).sizes(), (Shape{2, 0, 3}));
    EXPECT_EQ(bmm(zeros({0, 2, 4}, o), zeros({0, 4, 3}, o)).sizes(), (Shape{0, 2, 3}));
    // K = 0: the bias alone.
    const Tensor lin = linear(zeros({5, 0}, o), zeros({3, 0}, o), from_vector({1, 2, 3}, {3}, o));
    EXPECT_TRUE(values_near(lin, {1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3}));
  }
}

TEST_P(Linalg, BlasLayout) {
  const Tensor m = zeros({3, 4}, on({}));
  auto l = ops::blas_layout(m);
  ASSERT_TRUE(l);
  EXPECT_FALSE(l->trans);
  EXPECT_EQ(l->ld, 4);
  l = ops::blas_layout(ops::transpose(m, 0, 1));  // [4, 3] strides [1, 4]
  ASSERT_TRUE(l);
  EXPECT_TRUE(l->trans);
  EXPECT_EQ(l->ld, 4);
  l = ops::blas_layout(ops::narrow(m, 1, 1, 2));  // [3, 2] strides [4, 1]
  ASSERT_TRUE(l);
  EXPECT_EQ(l->ld, 4);
  EXPECT_FALSE(ops::blas_layout(ops::expand(zeros({1, 4}, on({})), {3, 4})).has_value());
  // A strided vector seen as [1, K] is the transpose of a column: no copy.
  l = ops::blas_layout(ops::unsqueeze(ops::select(m, 1, 2), 0));  // [1, 3] strides [., 4]
  ASSERT_TRUE(l);
  EXPECT_TRUE(l->trans);
  EXPECT_EQ(l->ld, 4);
}

// Bytes the op allocated at its peak, beyond what was allocated before it.
template <typename F>
size_t peak_bytes_of(F f) {
  const Device cpu = Device::cpu();
  const size_t before = memory::memory_allocated(cpu);
  memory::reset_peak_memory_stats(cpu);
  f();
  return memory::max_memory_allocated(cpu) - before;
}

TEST_P(Linalg, TransposedAndBroadcastOperandsAreNotCopied) {
  if (!on_cpu())
    GTEST_SKIP() << "the CPU BLAS path's layouts; cuBLASLt also allocates a workspace "
                    "(LinalgVsCpu.CublasLtWorkspaceIsTaggedWorkspace)";
  const Tensor a = ops::randn({64, 32}, kF32);
  const Tensor w = ops::randn({48, 32}, kF32);
  Tensor out;
  // a @ w^T: the transposed view goes to BLAS as CblasTrans; only the output is allocated.
  size_t peak = peak_bytes_of([&] { out = ops::mm(a, ops::transpose(w, 0, 1)); });
  EXPECT_EQ(peak, out.storage().block_bytes());
  peak = peak_bytes_of([&] { out = ops::linear(a, w); });
  EXPECT_EQ(peak, out.storage().block_bytes());
  // A batch times one matrix: folded into one GEMM over a's rows, no copy.
  const Tensor x = ops::randn({4, 16, 32}, kF32);
  peak = peak_bytes_of([&] { out = ops::matmul(x, ops::transpose(w, 0, 1)); });
  EXPECT_EQ(peak, out.storage().block_bytes());
  EXPECT_EQ(out.sizes(), (Shape{4, 16, 48}));
  // Broadcast batch dims are walked with stride 0, never materialised.
  const Tensor p = ops::randn({2, 1, 8, 32}, kF32), q = ops::randn({5, 32, 8}, kF32);
  peak = peak_bytes_of([&] { out = ops::matmul(p, q); });
  EXPECT_EQ(peak, out.storage().block_bytes());
}

TEST_P(Linalg, LinearValues) {
  const Tensor x = from_vector({1, 2, 3, 4}, {2, 2}, on({}));
  const Tensor w = from_vector({1, 0, 0, 1, 1, 1}, {3, 2}, on({}));
  const Tensor b = tensor({0.5, -0.5, 1}, on({}));
  EXPECT_TRUE(values_near(linear(x, w, b), {1.5, 1.5, 4, 3.5, 3.5, 8}));
  EXPECT_TRUE(values_near(linear(x, w), {1, 2, 3, 3, 4, 7}));
  const Tensor y = linear(tensor({1, 2}, on({})), w, b);  // 1-D input
  EXPECT_EQ(y.sizes(), (Shape{3}));
  EXPECT_TRUE(values_near(y, {1.5, 1.5, 4}));
  const Tensor x3 = ops::reshape(from_vector({1, 2, 3, 4, 1, 2, 3, 4}, {8}, on({})), {2, 2, 2});
  EXPECT_EQ(linear(x3, w, b).sizes(), (Shape{2, 2, 3}));
  EXPECT_TRUE(values_near(linear(x3, w, b), {1.5, 1.5, 4, 3.5, 3.5, 8, 1.5, 1.5, 4, 3.5, 3.5, 8}));
}

TEST_P(Linalg, SixteenBitDtypesMultiplyInFloat32) {
  Generator g(3);
  const Tensor a = put(ops::randn({3, 4, 5}, kF32, Device::cpu(), &g));
  const Tensor b = put(ops::randn({5, 6}, kF32, Device::cpu(), &g));
  const Tensor bias = put(ops::randn({6}, kF32, Device::cpu(), &g));
  for (DType dt : {kF16, kBF16}) {
    const double tol = dt == kF16 ? 2e-2 : 1e-1;
    const Tensor ah = a.to(dt), bh = b.to(dt);
    // Reference: the rounded inputs multiplied in float32.
    const Tensor ref = matmul(ah.to(kF32), bh.to(kF32));
    const Tensor c = matmul(ah, bh);
    EXPECT_EQ(c.dtype(), dt);
    EXPECT_TRUE(values_near(c, ops::to_vector(ref), tol));
    const Tensor l = linear(ah, ops::transpose(bh, 0, 1), bias.to(dt));
    EXPECT_EQ(l.dtype(), dt);
    EXPECT_TRUE(values_near(l, ops::to_vector(ops::add(ref, bias.to(dt).to(kF32))), tol));
    // Backward runs in the same dtype.
    const Tensor ag = ah.detach().requires_grad_(), bg = bh.detach().requires_grad_();
    matmul(ag, bg).sum().backward();
    EXPECT_EQ(ag.grad().dtype(), dt);
    EXPECT_EQ(bg.grad().sizes(), (Shape{5, 6}));
  }
}

// The CPU multiplies 16-bit operands in float32 (sgemm over widened copies) and rounds once:
// sizes past BLAS's blocking, transposed and strided operands, batches, linear's bias, the
// backward's products, and accumulating into an existing output.
TEST_P(Linalg, SixteenBitProductsAreTheFloat32ProductRoundedOnce) {
  if (!on_cpu()) GTEST_SKIP() << "the CPU's float32 path; cuBLAS: LinalgVsCpu";
  for (DType dt : {kF16, kBF16}) {
    const Tensor a = rand_input({3, 70, 300}, -1, 1, 31).to(dt);
    const Tensor b = rand_input({300, 90}, -1, 1, 32).to(dt);
    const auto f32 = [](const Tensor& t) { return t.to(kF32); };
    // Batched, b broadcast over the batch.
    EXPECT_TRUE(rounded_once_from(ops::matmul(a, b), ops::matmul(f32(a), f32(b))));
    // Transposed operands (BLAS transpose flags) and a strided one (every other column).
    const Tensor at = ops::transpose(rand_input({300, 70}, -1, 1, 33).to(dt), 0, 1);
    const Tensor bt = ops::transpose(rand_input({90, 300}, -1, 1, 34).to(dt), 0, 1);
    EXPECT_TRUE(rounded_once_from(ops::matmul(at, bt), ops::matmul(f32(at), f32(bt))));
    const Tensor bs = ops::slice(rand_input({300, 180}, -1, 1, 35).to(dt), 1, 0, 180, 2);
    EXPECT_TRUE(rounded_once_from(ops::matmul(at, bs), ops::matmul(f32(at), f32(bs))));
    // linear: x W^T + bias, the bias added in float32 before the rounding.
    const Tensor x = rand_input({130, 300}, -1, 1, 36).to(dt);
    const Tensor w = rand_input({90, 300}, -1, 1, 37).to(dt);
    const Tensor bias = rand_input({90}, -1, 1, 38).to(dt);
    EXPECT_TRUE(
        rounded_once_from(ops::linear(x, w, bias),
                          ops::add(ops::matmul(f32(x), ops::transpose(f32(w), 0, 1)), f32(bias))));
    // The backward's products: grad_a = g @ b^T, grad_b = a^T @ g (batched, summed).
    const Tensor ag = a.detach().requires_grad_(), bg = b.detach().requires_grad_();
    const Tensor gout = rand_input({3, 70, 90}, -1, 1, 39).to(dt);
    matmul(ag, bg).backward(gout);
    EXPECT_TRUE(rounded_once_from(ag.grad(), ops::matmul(f32(gout), ops::transpose(f32(b), 0, 1))));
    EXPECT_EQ(bg.grad().dtype(), dt);
  }
}

// One gradient check: what it covers, the function, its CPU leaves.
struct GradCase {
  const char* what;
  Fn fn;
  TensorList inputs;
};

TEST_P(Linalg, ProductGradients) {
  const Fn mat = [](const TensorList& x) { return matmul(x[0], x[1]); };
  const Fn mat_rev = [](const TensorList& x) { return matmul(rev(x[0]), rev(x[1])); };
  const Tensor v4 = rand_input({4}, -1, 1, 7), w4 = rand_input({4}, -1, 1, 8);
  const std::vector<GradCase> cases = {
      // matmul: batched with broadcasting of batch dims, [2, 1, 3, 4] x [5, 4, 2]; 2-D x
      // batched (a broadcast along the batch), and batched x 2-D (folded).
      {"broadcast batches",
       mat,
       {rand_input({2, 1, 3, 4}, -1, 1, 1), rand_input({5, 4, 2}, -1, 1, 2)}},
      {"matrix @ batch", mat, {rand_input({3, 4}, -1, 1, 3), rand_input({2, 4, 2}, -1, 1, 4)}},
      {"batch @ matrix", mat, {rand_input({2, 3, 4}, -1, 1, 5), rand_input({4, 2}, -1, 1, 6)}},
      // 1-D cases: dot, matrix-vector, vector-matrix, vector with batches on either side.
      {"dot", mat, {v4, w4}},
      {"matrix-vector", mat, {rand_input({3, 4}, -1, 1, 9), v4}},
      {"vector-matrix", mat, {v4, rand_input({4, 2}, -1, 1, 10)}},
      {"vector @ batch", mat, {v4, rand_input({2, 4, 3}, -1, 1, 11)}},
      {"batch @ vector", mat, {rand_input({2, 1, 3, 4}, -1, 1, 12), w4}},
      // Non-contiguous operands and transposed views taken inside the graph.
      {"non-contiguous 2-D", mat_rev, {noncontig_leaf({3, 4}, 13), noncontig_leaf({4, 2}, 14)}},
      {"transposed views",
       [](const TensorList& x) { return matmul(x[0].t(), x[1].transpose(-1, -2)); },
       {rand_input({4, 3}, -1, 1, 15), rand_input({2, 5, 4}, -1, 1, 16)}},
      {"non-contiguous 3-D",
       mat_rev,
       {noncontig_leaf({2, 3, 4}, 17), noncontig_leaf({2, 4, 3}, 18)}},
      // Only one operand requires grad.
      {"one operand", mat, {rand_input({3, 4}, -1, 1, 19), ops::randn({2, 4, 2}, kF64)}},
      // mm and bmm, with transposed and non-contiguous operands.
      {"mm",
       [](const TensorList& x) { return mm(x[0], rev(x[1])); },
       {rand_input({3, 4}, -1, 1, 1), noncontig_leaf({4, 2}, 2)}},
      {"mm transposed",
       [](const TensorList& x) { return mm(x[0].t(), x[1]); },
       {rand_input({4, 3}, -1, 1, 3), rand_input({4, 2}, -1, 1, 4)}},
      {"bmm",
       [](const TensorList& x) { return bmm(x[0], x[1]); },
       {rand_input({2, 3, 4}, -1, 1, 5), rand_input({2, 4, 2}, -1, 1, 6)}},
      {"bmm transposed",
       [](const TensorList& x) { return bmm(rev(x[0]), x[1].transpose(1, 2)); },
       {noncontig_leaf({2, 3, 4}, 7), rand_input({2, 2, 4}, -1, 1, 8)}},
  };
  for (const GradCase& c : cases) EXPECT_TRUE(gradcheck_on(dev(), c.fn, c.inputs)) << c.what;
}

TEST_P(Linalg, LinearGradients) {
  const Fn lin = [](const TensorList& t) { return linear(t[0], t[1], t[2]); };
  const Tensor x = rand_input({2, 3, 4}, -1, 1, 1);
  const Tensor w = rand_input({5, 4}, -1, 1, 2);
  const Tensor b = rand_input({5}, -1, 1, 3);
  const std::vector<GradCase> cases = {
      {"3-D input with bias", lin, {x, w, b}},
      {"no bias", [](const TensorList& t) { return linear(t[0], t[1]); }, {x, w}},
      {"non-contiguous input and weight",
       [](const TensorList& t) { return linear(rev(t[0]), rev(t[1]), t[2]); },
       {noncontig_leaf({3, 4}, 4), noncontig_leaf({5, 4}, 5), b}},
      {"1-D input", lin, {rand_input({4}, -1, 1, 6), w, b}},
      // A permuted (non-viewable) 3-D input.
      {"permuted 3-D input",
       [](const TensorList& t) { return linear(rev(t[0]), t[1], t[2]); },
       {noncontig_leaf({2, 3, 4}, 7), w, b}},
  };
  for (const GradCase& c : cases) EXPECT_TRUE(gradcheck_on(dev(), c.fn, c.inputs)) << c.what;
}

// The node that produced `t`.
autograd::Node* node_of(const Tensor& t) {
  return t.autograd_meta()->grad_fn.get();
}

std::vector<bool> saved_defined(const Tensor& t) {
  std::vector<bool> out;
  for (const SavedTensor* s : node_of(t)->saved_tensors()) out.push_back(s->defined());
  return out;
}

// linear(gelu(linear(x, w1, b1), "tanh"), w2, b2), three ops: the fused node's reference.
Tensor mlp_composite(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                     const Tensor& b2) {
  return linear(gelu(linear(x, w1, b1), "tanh"), w2, b2);
}

TEST_P(Linalg, LinearGeluLinearIsTheThreeOps) {
  const Tensor x = put(rand_input({2, 3, 4}, -2, 2, 41)), w1 = put(rand_input({6, 4}, -1, 1, 42));
  const Tensor b1 = put(rand_input({6}, -1, 1, 43)), w2 = put(rand_input({5, 6}, -1, 1, 44));
  const Tensor b2 = put(rand_input({5}, -1, 1, 45));
  const Tensor y = linear_gelu_linear(x, w1, b1, w2, b2);
  EXPECT_EQ(y.sizes(), (Shape{2, 3, 5}));
  EXPECT_TRUE(values_near(y, ops::to_vector(mlp_composite(x, w1, b1, w2, b2)), 1e-12));
  // The raw ops: {gelu(pre), pre}, and the GELU's backward inside a product.
  auto [h, pre] = ops::linear_gelu(x, w1, b1);
  EXPECT_EQ(h.sizes(), (Shape{2, 3, 6}));
  EXPECT_TRUE(values_near(pre, ops::to_vector(ops::linear(x, w1, b1)), 1e-12));
  EXPECT_TRUE(values_near(h, ops::to_vector(ops::unary(ops::UnaryOp::gelu_tanh, pre)), 1e-12));
  auto [h0, pre0] = ops::linear_gelu(x, w1);  // no bias
  EXPECT_TRUE(values_near(pre0, ops::to_vector(ops::linear(x, w1)), 1e-12));
  const Tensor g = put(rand_input({6, 5}, -1, 1, 46));
  const Tensor p2 = ops::reshape(pre, {6, 6});
  const Tensor dp = ops::mm_dgelu(g, w2, p2);
  EXPECT_TRUE(values_near(
      dp, ops::to_vector(ops::binary(ops::BinaryOp::gelu_tanh_backward, ops::mm(g, w2), p2)),
      1e-12));
  // pre in any layout.
  const Tensor p2t = ops::transpose(ops::contiguous(ops::transpose(p2, 0, 1)), 0, 1);
  EXPECT_TRUE(values_near(ops::mm_dgelu(g, w2, p2t), ops::to_vector(dp), 1e-12));
  // One node, saving x, w1, the GELU's input and output, and w2.
  const Tensor xl = leaf(rand_input({3, 4}, -1, 1, 47));
  const Tensor yl = linear_gelu_linear(xl, w1, b1, w2, b2);
  EXPECT_EQ(node_of(yl)->name(), "LinearGeluLinearBackward");
  EXPECT_EQ(saved_defined(yl), (std::vector<bool>(5, true)));
}

TEST_P(Linalg, LinearGeluLinearGradients) {
  const Fn mlp = [](const TensorList& t) {
    return linear_gelu_linear(t[0], t[1], t[2], t[3], t[4]);
  };
  const Tensor x = rand_input({2, 3, 4}, -2, 2, 51), w1 = rand_input({6, 4}, -1, 1, 52);
  const Tensor b1 = rand_input({6}, -1, 1, 53), w2 = rand_input({5, 6}, -1, 1, 54);
  const Tensor b2 = rand_input({5}, -1, 1, 55);
  const std::vector<GradCase> cases = {
      {"3-D input with biases", mlp, {x, w1, b1, w2, b2}},
      {"no biases",
       [](const TensorList& t) { return linear_gelu_linear(t[0], t[1], Tensor(), t[2], Tensor()); },
       {x, w1, w2}},
      {"1-D input", mlp, {rand_input({4}, -2, 2, 56), w1, b1, w2, b2}},
      {"non-contiguous input",
       [](const TensorList& t) { return linear_gelu_linear(rev(t[0]), t[1], t[2], t[3], t[4]); },
       {noncontig_leaf({3, 4}, 57), w1, b1, w2, b2}},
      // Only the second layer's weight needs a gradient: no d(pre) is made.
      {"proj weight only",
       [=, this](const TensorList& t) {
         return linear_gelu_linear(put(x), put(w1), put(b1), t[0], put(b2));
       },
       {w2}},
      {"input only",
       [=, this](const TensorList& t) {
         return linear_gelu_linear(t[0], put(w1), put(b1), put(w2), put(b2));
       },
       {x}},
  };
  for (const GradCase& c : cases) EXPECT_TRUE(gradcheck_on(dev(), c.fn, c.inputs)) << c.what;
}

TEST_P(Linalg, LinearGeluLinearErrors) {
  const Tensor x = put(rand_input({3, 4})), w1 = put(rand_input({6, 4}));
  const Tensor w2 = put(rand_input({5, 7}));
  expect_error<std::invalid_argument>(
      [&] { linear_gelu_linear(x, w1, Tensor(), w2, Tensor()); },
      {"linear_gelu_linear: fc_weight [6, 4] makes 6 features but proj_weight [5, 7] expects 7"});
  expect_error<std::invalid_argument>(
      [&] {
        linear_gelu_linear(put(rand_input({3, 5})), w1, Tensor(), put(rand_input({5, 6})),
                           Tensor());
      },
      {"linear_gelu: input [3, 5] has 5 features but weight [6, 4] expects 4"});
  expect_error<std::invalid_argument>([&] { ops::linear_gelu(x, w1, put(rand_input({5}))); },
                                      {"linear_gelu: bias must have shape [6]"});
  const Tensor a = put(rand_input({3, 5})), b = put(rand_input({5, 6}));
  expect_error<std::invalid_argument>(
      [&] {
        ops::mm_dgelu(a, b, put(rand_input({3, 5})));
      },
      {"mm_dgelu: a [3, 5] @ b [5, 6] does not fit pre [3, 5]"});
  expect_error<std::invalid_argument>([&] { ops::mm_dgelu(a, b, put(rand_input({18}))); },
                                      {"mm_dgelu: expected 2-D"});
  expect_error<std::invalid_argument>(
      [&] {
        ops::mm_dgelu(a, b, ops::to(put(rand_input({3, 6})), kF32));
      },
      {"mm_dgelu", "dtype"});
}

TEST_P(Linalg, SavesOnlyWhatThePartnerNeeds) {
  const Tensor a = leaf(rand_input({3, 4})), b = put(ops::randn({4, 2}, kF64));
  // Only a needs grad: dA = dC B^T needs b; a itself is not kept.
  EXPECT_EQ(saved_defined(matmul(a, b)), (std::vector<bool>{false, true}));
  EXPECT_EQ(saved_defined(matmul(b.t(), a.t())), (std::vector<bool>{true, false}));
  const Tensor bb = leaf(rand_input({4, 2}));
  EXPECT_EQ(saved_defined(mm(a, bb)), (std::vector<bool>{true, true}));
  EXPECT_EQ(node_of(mm(a, bb))->name(), "MmBackward");
  // linear saves x only for dW and W only for dx; the bias needs nothing.
  const Tensor x = put(ops::randn({2, 4}, kF64));
  const Tensor w = leaf(rand_input({3, 4})), bias = leaf(rand_input({3}));
  EXPECT_EQ(saved_defined(linear(x, w, bias)), (std::vector<bool>{true, false}));
  const Tensor xg = leaf(rand_input({2, 4}));
  const Tensor wn = put(ops::randn({3, 4}, kF64));
  EXPECT_EQ(saved_defined(linear(xg, wn)), (std::vector<bool>{false, true}));
  // embedding saves the indices only.
  const Tensor idx = from_vector({0, 2}, {2}, on(i64));
  EXPECT_EQ(saved_defined(embedding(leaf(rand_input({3, 2})), idx)), (std::vector<bool>{true}));
}

TEST_P(Linalg, EmbeddingValues) {
  const Tensor w = from_vector({0, 1, 2, 3, 4, 5, 6, 7}, {4, 2}, on({}));
  const Tensor idx = from_vector({1, 3, 0, 1}, {2, 2}, on(i64));
  const Tensor e = embedding(w, idx);
  EXPECT_EQ(e.sizes(), (Shape{2, 2, 2}));
  EXPECT_TRUE(values_near(e, {2, 3, 6, 7, 0, 1, 2, 3}));
  // int32 indices, a 0-D index, a transposed weight.
  EXPECT_TRUE(values_near(
      embedding(w, from_vector({2}, {1}, on(TensorOptions{}.with_dtype(DType::int32)))), {4, 5}));
  const Tensor e0 = embedding(w, from_vector({3}, {}, on(i64)));
  EXPECT_EQ(e0.sizes(), (Shape{2}));
  EXPECT_TRUE(values_near(e0, {6, 7}));
  const Tensor wt = ops::transpose(from_vector({0, 2, 4, 6, 1, 3, 5, 7}, {2, 4}, on({})), 0, 1);
  EXPECT_TRUE(values_near(embedding(wt, idx), {2, 3, 6, 7, 0, 1, 2, 3}));
}

TEST_P(Linalg, EmbeddingBackwardScatterAddsAndSkipsPadding) {
  const Tensor w = from_vector({0, 1, 2, 3, 4, 5, 6, 7}, {4, 2}, on(f64)).requires_grad_();
  const Tensor idx = from_vector({1, 3, 1, 0}, {4}, on(i64));
  const Tensor g = from_vector({1, 2, 3, 4, 5, 6, 7, 8}, {4, 2}, on(f64));
  // Repeated index 1 sums its rows; padding row 0 gets nothing although index 0 is used.
  const Tensor e = embedding(w, idx, /*padding_idx=*/0);
  EXPECT_TRUE(values_near(e, {2, 3, 6, 7, 2, 3, 0, 1}));  // the padding row is still looked up
  e.backward(g);
  EXPECT_TRUE(values_near(w.grad(), {0, 0, 6, 8, 0, 0, 3, 4}));
  // Without padding, row 0 gets its gradient.
  w.set_grad(Tensor());
  embedding(w, idx).backward(g);
  EXPECT_TRUE(values_near(w.grad(), {7, 8, 6, 8, 0, 0, 3, 4}));
  // 16-bit weights accumulate in float32 and come back in their dtype.
  const Tensor wh = zeros({2, 2}, on(TensorOptions{}.with_dtype(kBF16))).requires_grad_();
  const Tensor many = zeros({300}, on(i64));
  embedding(wh, many).backward(ops::full({300, 2}, 1.0, kBF16, dev()));
  EXPECT_EQ(wh.grad().dtype(), kBF16);
  EXPECT_TRUE(values_near(wh.grad(), {300, 300, 0, 0}));  // bfloat16 adds would stall at 256
}

TEST_P(Linalg, EmbeddingGradients) {
  const Tensor w = rand_input({5, 3}, -1, 1, 1);
  const Tensor idx = from_vector({4, 1, 1, 0, 4, 4}, {2, 3}, on(i64));  // repeated indices
  EXPECT_TRUE(gradcheck_on(dev(), [&](const TensorList& x) { return embedding(x[0], idx); }, {w}));
  EXPECT_TRUE(gradcheck_on(dev(), [&](const TensorList& x) { return embedding(rev(x[0]), idx); },
                           {noncontig_leaf({5, 3}, 2)}));
  // padding_idx: the padding row's lookups are masked out of the function, so the
  // numeric gradient agrees with "no gradient into the padding row".
  const Tensor keep = from_vector({1, 0, 0, 1, 1, 1}, {2, 3, 1}, on(f64));  // idx != 1
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& x) { return mul(embedding(x[0], idx, 1), keep); }, {w}));
}

// mm_out into the first N columns of a wider (padded) buffer: the values of mm, the padding
// (a sentinel) untouched, accumulate adds, and the other layouts out may have.
TEST_P(Linalg, MmOutWritesIntoPaddedRows) {
  constexpr double kSentinel = 1024.0;  // exact in every dtype
  const int64_t M = 5, K = 7, N = 13, Np = 16;
  for (DType dt : {kF32, kF64, kBF16}) {
    SCOPED_TRACE(dname(dt));
    const double tol = dt == kBF16 ? 5e-2 : dt == kF32 ? 1e-5 : 1e-12;
    Generator g(11);
    const Tensor a = put(ops::to(ops::randn({M, K}, kF32, Device::cpu(), &g), dt));
    const Tensor b = put(ops::to(ops::randn({K, N}, kF32, Device::cpu(), &g), dt));
    const std::vector<double> ref = ops::to_vector(mm(a, b));
    std::vector<double> twice = ref;
    for (double& v : twice) v *= 2;
    const Tensor buf = ops::full({M, Np}, kSentinel, dt, dev());
    const Tensor out = ops::narrow(buf, 1, 0, N);  // [M, N], strides [Np, 1]
    const Tensor pad = ops::narrow(buf, 1, N, Np - N);
    const std::vector<double> sentinels(static_cast<size_t>(M * (Np - N)), kSentinel);
    ops::mm_out(out, a, b);
    EXPECT_TRUE(values_near(out, ref, tol));
    EXPECT_TRUE(values_near(pad, sentinels, 0.0));
    ops::mm_out(out, a, b, /*accumulate=*/true);
    EXPECT_TRUE(values_near(out, twice, 2 * tol));
    EXPECT_TRUE(values_near(pad, sentinels, 0.0));
    // A transposed operand (CblasTrans / cuBLAS op T), and a padded operand read with ld = Np.
    const Tensor bt = ops::transpose(ops::contiguous(ops::transpose(b, 0, 1)), 0, 1);
    ops::mm_out(out, a, bt);
    EXPECT_TRUE(values_near(out, ref, tol));
    const Tensor out2 = ops::narrow(ops::full({M, Np}, kSentinel, dt, dev()), 1, 0, N);
    const Tensor a_padded = ops::narrow(ops::full({M, 8}, kSentinel, dt, dev()), 1, 0, K);
    ops::copy_(a_padded, a);
    ops::mm_out(out2, a_padded, b);
    EXPECT_TRUE(values_near(out2, ref, tol));
    EXPECT_TRUE(values_near(pad, sentinels, 0.0));
    // A row range of a contiguous matrix: the rows around it untouched.
    const Tensor whole = ops::full({M + 2, N}, kSentinel, dt, dev());
    ops::mm_out(ops::narrow(whole, 0, 1, M), a, b);
    EXPECT_TRUE(values_near(ops::narrow(whole, 0, 1, M), ref, tol));
    const std::vector<double> row(static_cast<size_t>(N), kSentinel);
    EXPECT_TRUE(values_near(ops::narrow(whole, 0, 0, 1), row, 0.0));
    EXPECT_TRUE(values_near(ops::narrow(whole, 0, M + 1, 1), row, 0.0));
    // K = 0: zeros (accumulate: unchanged), the padding untouched.
    const Tensor e0 = ops::zeros({M, 0}, dt, dev()), e1 = ops::zeros({0, N}, dt, dev());
    ops::mm_out(out, e0, e1, /*accumulate=*/true);
    EXPECT_TRUE(values_near(out, ref, tol));
    ops::mm_out(out, e0, e1);
    EXPECT_TRUE(values_near(out, std::vector<double>(ref.size(), 0.0), 0.0));
    EXPECT_TRUE(values_near(pad, sentinels, 0.0));
  }
}

// mm_out with float16/bfloat16 operands and a float32 out (torch.mm's out_dtype=float32): the
// float32 product of the 16-bit values, with no 16-bit rounding (a 16-bit result would be
// off by up to ~0.1 at these magnitudes), accumulating onto float32 values a 16-bit sum
// could not hold; a transposed operand and a padded out as the fused classifier uses them.
TEST_P(Linalg, MmOutFloat32OfSixteenBitOperands) {
  const int64_t M = 6, K = 256, N = 40, Np = 48;
  for (DType dt : {kBF16, kF16}) {
    SCOPED_TRACE(dname(dt));
    Generator g(12);
    const Tensor a16 = ops::to(ops::randn({K, M}, kF32, Device::cpu(), &g), dt);  // [K, M]
    const Tensor b16 = ops::to(ops::randn({K, N}, kF32, Device::cpu(), &g), dt);
    const std::vector<double> ref =
        naive_matmul(ops::to(ops::contiguous(ops::transpose(a16, 0, 1)), kF64), ops::to(b16, kF64));
    const Tensor a = ops::transpose(put(a16), 0, 1);  // [M, K], read transposed
    const Tensor b = put(b16);
    const Tensor buf = ops::full({M, Np}, 7.0, kF32, dev());
    const Tensor out = ops::narrow(buf, 1, 0, N);
    ops::mm_out(out, a, b);
    EXPECT_EQ(out.dtype(), kF32);
    EXPECT_TRUE(values_near(out, ref, 1e-3));
    EXPECT_TRUE(values_near(ops::narrow(buf, 1, N, Np - N),
                            std::vector<double>(static_cast<size_t>(M * (Np - N)), 7.0), 0.0));
    ops::fill_(out, 1000.125);  // not a 16-bit value
    ops::mm_out(out, a, b, /*accumulate=*/true);
    std::vector<double> shifted = ref;
    for (double& v : shifted) v += 1000.125;
    EXPECT_TRUE(values_near(out, shifted, 1e-3));
  }
}

// linear_backward (aten::linear_backward) against its composite (g W, g^T x, the sums of g) for
// every output mask, with leading batch dims, an undefined weight when grad_input is not
// asked for, and its errors.
TEST_P(Linalg, LinearBackwardMatchesTheComposite) {
  const Tensor x = put(rand_input({2, 3, 5}, -1, 1, 31));
  const Tensor w = put(rand_input({4, 5}, -1, 1, 32));
  const Tensor g = put(rand_input({2, 3, 4}, -1, 1, 33));
  const Tensor g2 = ops::reshape(g, {6, 4});
  const std::vector<double> ref_x = ops::to_vector(ops::matmul(g, w));
  const std::vector<double> ref_w =
      ops::to_vector(ops::mm(ops::transpose(g2, 0, 1), ops::reshape(x, {6, 5})));
  const std::vector<double> ref_b = ops::to_vector(ops::sum(g2, {0}));
  for (int m = 0; m < 8; ++m) {
    const std::array<bool, 3> mask{(m & 1) != 0, (m & 2) != 0, (m & 4) != 0};
    SCOPED_TRACE(m);
    auto [gx, gw, gb] = ops::linear_backward(x, g, mask[0] ? w : Tensor(), mask);
    EXPECT_EQ(gx.defined(), mask[0]);
    EXPECT_EQ(gw.defined(), mask[1]);
    EXPECT_EQ(gb.defined(), mask[2]);
    if (gx.defined()) {
      EXPECT_EQ(gx.sizes(), x.sizes());
      EXPECT_TRUE(values_near(gx, ref_x, 1e-12));
    }
    if (gw.defined()) {
      EXPECT_EQ(gw.sizes(), w.sizes());
      EXPECT_TRUE(values_near(gw, ref_w, 1e-12));
    }
    if (gb.defined()) {
      EXPECT_EQ(gb.sizes(), Shape{4});
      EXPECT_TRUE(values_near(gb, ref_b, 1e-12));
    }
  }
  const std::array<bool, 3> all{true, true, true};
  expect_error<std::invalid_argument>([&] { ops::linear_backward(x, g, Tensor(), all); },
                                      {"linear_backward", "weight too for grad_input"});
  expect_error<std::invalid_argument>(
      [&] {
        ops::linear_backward(x, ops::reshape(g, {3, 2, 4}), w, all);
      },
      {"linear_backward: input [2, 3, 5] and grad_output [3, 2, 4] do not fit weight [4, 5]"});
  expect_error<std::invalid_argument>(
      [&] { ops::linear_backward(ops::narrow(x, 2, 0, 4), g, w, all); },
      {"linear_backward", "do not fit weight [4, 5]"});
  expect_error<std::invalid_argument>([&] { ops::linear_backward(x, ops::to(g, kF32), w, all); },
                                      {"linear_backward", "dtype"});
  // weight_grad_dtype: grad_output's, or float32 for 16-bit gradients only.
  expect_error<std::invalid_argument>(
      [&] { ops::linear_backward(x, g, w, all, DType::float32); },
      {"linear_backward: weight_grad_dtype float32 must be grad_output's dtype float64"});
  const Tensor x16 = ops::to(x, kBF16), g16 = ops::to(g, kBF16), w16 = ops::to(w, kBF16);
  expect_error<std::invalid_argument>(
      [&] { ops::linear_backward(x16, g16, w16, all, DType::float64); },
      {"weight_grad_dtype float64 must be grad_output's dtype bfloat16 or float32"});
  auto [gx32, gw32, gb32] = ops::linear_backward(x16, g16, w16, all, DType::float32);
  EXPECT_EQ(gw32.dtype(), kF32);
  EXPECT_EQ(gx32.dtype(), kBF16);
  EXPECT_TRUE(values_near(gw32, ref_w, 5e-2));
}

TEST_P(Linalg, MmOutErrors) {
  const TensorOptions o = on({});
  const Tensor a = zeros({2, 3}, o), b = zeros({3, 5}, o);
  const Tensor wide = zeros({2, 8}, o);
  struct Case {
    std::function<void()> op;
    const char* part;
  };
  const std::vector<Case> cases = {
      {[&] {
         ops::mm_out(zeros({2, 4}, o), a, b);
       },
       "mm_out: out must have shape [2, 5] (out [2, 4] strides [4, 1], a [2, 3], b [3, 5])"},
      {[&] {
         ops::mm_out(zeros({5, 2}, o).t(), a, b);
       },
       "mm_out: out must have unit column stride and rows at least 5"},
      {[&] {
         ops::mm_out(ops::as_strided(wide, {2, 5}, {3, 1}, 0), a, b);
       },
       "rows at least 5 (and at most"},
      {[&] {
         ops::mm_out(zeros({2, 5}, on(f64)), a, b);
       },
       "mm_out: out must have the operands' dtype float32, got float64"},
      {[&] {
         ops::mm_out(zeros({2, 5}, on(f64)), ops::to(a, kBF16), ops::to(b, kBF16));
       },
       "mm_out: out must have the operands' dtype bfloat16 or float32, got float64"},
      {[&] {
         ops::mm_out(zeros({2, 5}, o), ops::to(a, kF64), ops::to(b, kF64));
       },
       "mm_out: out must have the operands' dtype float64, got float32"},
      {[&] {
         ops::mm_out(zeros({2, 5}, o), zeros({1, 2, 3}, o), b);
       },
       "mm_out: expected two 2-D tensors, got shapes [1, 2, 3] and [3, 5]"},
      {[&] {
         ops::mm_out(zeros({2, 5}, o), a, zeros({4, 5}, o));
       },
       "mm_out: shapes [2, 3] and [4, 5] cannot be multiplied"},
      {[&] {
         ops::mm_out(zeros({2, 5}, o), a, zeros({3, 5}, on(f64)));
       },
       "same dtype"},
      {[&] {
         ops::mm_out(ops::narrow(wide, 1, 0, 2), ops::narrow(wide, 1, 2, 2), zeros({2, 2}, o));
       },
       "mm_out: out must not share storage with a or b"},
  };
  for (const Case& c : cases) expect_error<std::invalid_argument>(c.op, {c.part});
}

TEST_P(Linalg, Errors) {
  const TensorOptions o = on({});
  const Tensor a = zeros({2, 3}, o), b = zeros({4, 5}, o), w = zeros({4, 2}, o);
  // An op call that must throw std::invalid_argument, and a part of its message.
  struct Case {
    std::function<void()> op;
    const char* part;
  };
  const std::vector<Case> cases = {
      {[&] { (void)matmul(a, b); },
       "matmul: shapes [2, 3] and [4, 5] cannot be multiplied (2x3 and 4x5)"},
      {[&] { (void)matmul(zeros({3}, o), zeros({4}, o)); }, "matmul: shapes [3] and [4]"},
      {[&] { (void)matmul(zeros({}, o), a); }, "at least 1-D"},
      {[&] {
         (void)matmul(zeros({2, 2, 3}, o), zeros({3, 3, 1}, o));
       },
       "matmul: batch dimensions of [2, 2, 3] and [3, 3, 1] cannot be broadcast"},
      {[&] {
         (void)matmul(a, zeros({3, 2}, on(f64)));
       },
       "same dtype"},
      {[&] {
         (void)matmul(zeros({2, 3}, on(i64)), zeros({3, 2}, on(i64)));
       },
       "floating"},
      {[&] {
         (void)mm(zeros({2, 2, 3}, o), zeros({3, 2}, o));
       },
       "mm: expected two 2-D tensors, got shapes [2, 2, 3] and [3, 2]"},
      {[&] {
         (void)mm(a, zeros({2, 3}, o));
       },
       "mm: shapes [2, 3] and [2, 3] cannot be multiplied"},
      {[&] { (void)bmm(a, a); }, "bmm: expected two 3-D tensors, got shapes [2, 3] and [2, 3]"},
      {[&] {
         (void)bmm(zeros({2, 2, 3}, o), zeros({3, 3, 2}, o));
       },
       "bmm: batch sizes differ: shapes [2, 2, 3] and [3, 3, 2]"},
      {[&] {
         (void)bmm(zeros({2, 2, 3}, o), zeros({2, 2, 2}, o));
       },
       "bmm: shapes [2, 2, 3] and [2, 2, 2] cannot be multiplied"},
      {[&] {
         (void)linear(zeros({2, 3}, o), zeros({4, 5}, o));
       },
       "linear: input [2, 3] has 3 features but weight [4, 5] expects 5"},
      {[&] {
         (void)linear(zeros({2, 5}, o), zeros({4, 5}, o), zeros({3}, o));
       },
       "linear: bias must have shape [4]"},
      {[&] {
         (void)linear(zeros({2, 5}, o), zeros({5}, o));
       },
       "linear: weight must be 2-D"},
      {[&] { (void)embedding(w, from_vector({1}, {1}, o)); },
       "embedding: indices must be int64 or int32, got float32"},
      {[&] { (void)embedding(zeros({4}, o), from_vector({1}, {1}, on(i64))); },
       "embedding: weight must be 2-D"},
      {[&] { (void)embedding(w, from_vector({1}, {1}, on(i64)), 4); },
       "embedding: padding_idx 4 must be -1 (none) or in [0, 4)"},
  };
  for (const Case& c : cases) expect_error<std::invalid_argument>(c.op, {c.part});
  if (on_cpu()) {
    // The GPU cannot throw without a host synchronisation: it gives NaN rows instead
    // (LinalgVsCpu.EmbeddingOutOfRangeIndicesGiveNanRows).
    expect_error<std::out_of_range>(
        [&] {
          (void)embedding(w, from_vector({1, 7}, {2}, on(i64)));
        },
        {"embedding: index 7 is out of range for 4 rows"});
    expect_error<std::out_of_range>([&] { (void)embedding(w, from_vector({-1}, {1}, on(i64))); },
                                    {"index -1 is out of range for 4 rows"});
  }
  // The allocator is consistent after the failures: ops still run.
  EXPECT_TRUE(values_near(mm(ones({1, 2}, o), ones({2, 1}, o)), {2}));
}

// ================================================================== CUDA against the CPU

using BinOp = std::function<Tensor(const TensorList&)>;

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

// A float64 copy on the CPU: the reference's operands.
Tensor cpu64(const Tensor& t) {
  return ops::to(t, Device::cpu(), kF64);
}

// The same view of both.
template <typename F>
Pair view(const Pair& p, F f) {
  return {f(p.cpu), f(p.gpu)};
}
Pair tr(const Pair& p, int64_t d0 = -2, int64_t d1 = -1) {
  return view(p, [&](const Tensor& t) { return ops::transpose(t, d0, d1); });
}
Pair narrowed(const Pair& p, int64_t dim, int64_t start, int64_t length) {
  return view(p, [&](const Tensor& t) { return ops::narrow(t, dim, start, length); });
}

const BinOp kMatmul = [](const TensorList& x) { return ops::matmul(x[0], x[1]); };
const BinOp kMm = [](const TensorList& x) { return ops::mm(x[0], x[1]); };
const BinOp kBmm = [](const TensorList& x) { return ops::bmm(x[0], x[1]); };
const BinOp kLinear = [](const TensorList& x) {
  return ops::linear(x[0], x[1], x.size() > 2 ? x[2] : Tensor());
};

class LinalgVsCpu : public VsCpu {
 protected:
  // The same random values (rand_tensor) on the CPU and on the device under test.
  Pair pair(const Shape& s, DType d, uint64_t seed) const {
    const Tensor c = rand_tensor(s, d, seed);
    return {c, put(c)};
  }

  // op on the device's operands against op on float64 copies of the CPU operands; K is the
  // length of the reduction (for the tolerance).
  void check_product(const std::string& what, const BinOp& op, const std::vector<Pair>& in,
                     int64_t K) const {
    std::string layouts;
    TensorList on_dev, ref_in;
    for (const Pair& p : in) {
      layouts += ", " + layout_of(p.gpu);
      on_dev.push_back(p.gpu);
      ref_in.push_back(cpu64(p.cpu));
    }
    const DType d = in[0].gpu.dtype();
    SCOPED_TRACE(what + " " + dname(d) + layouts);
    Tensor got;
    try {
      got = op(on_dev);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw: " << e.what();
      return;
    }
    EXPECT_EQ(got.device(), dev());
    EXPECT_EQ(got.dtype(), d);
    EXPECT_TRUE(close_scaled(got, op(ref_in), product_tol(d, K)));
  }

  // fn on device leaves of dtype d vs fn on float64 CPU leaves with the same values: the
  // output, and the gradients of sum(out * w) for a random w.
  void check_grads(const std::string& what, const Fn& fn, const std::vector<Shape>& shapes, DType d,
                   double tol, uint64_t seed) const {
    SCOPED_TRACE(what + " " + dname(d));
    TensorList cpu, gpu;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Tensor v = rand_tensor(shapes[i], d, seed + i, -1, 1);
      cpu.push_back(ops::to(v, Device::cpu(), kF64, /*copy=*/true).requires_grad_());
      gpu.push_back(leaf(v));
    }
    const Tensor out_c = fn(cpu);
    const Tensor w = rand_tensor(out_c.sizes(), d, seed + 50, -1, 1);
    sum(mul(out_c, cpu64(w))).backward();
    Tensor out_g;
    try {
      out_g = fn(gpu);
      sum(mul(out_g, put(w))).backward();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw: " << e.what();
      return;
    }
    EXPECT_EQ(out_g.device(), dev());
    EXPECT_TRUE(close_scaled(out_g, out_c, tol)) << "forward";
    for (size_t i = 0; i < gpu.size(); ++i) {
      ASSERT_TRUE(gpu[i].grad().defined()) << "input " << i << " got no gradient";
      EXPECT_EQ(gpu[i].grad().device(), dev()) << "input " << i;
      EXPECT_EQ(gpu[i].grad().dtype(), d) << "input " << i;
      EXPECT_TRUE(close_scaled(gpu[i].grad(), cpu[i].grad(), tol))
          << "gradient of input " << i << " " << shape_str(shapes[i]);
    }
  }
};
TALLY_VS_CPU(LinalgVsCpu);

TEST_P(LinalgVsCpu, MatrixProductsMatchTheCpu) {
  for (DType d : kFloatDtypes) {
    uint64_t seed = 100;
    auto P = [&](const Shape& s) { return pair(s, d, seed++); };
    // 2-D, odd sizes.
    {
      const Pair a = P({37, 53}), b = P({53, 29});
      check_product("mm", kMm, {a, b}, 53);
      check_product("matmul 2-D", kMatmul, {a, b}, 53);
    }
    // Transposed operands (opA/opB = T): a @ w^T, a^T @ b, a^T @ w^T.
    {
      const Pair a = P({37, 53}), w = P({29, 53}), at = P({53, 37}), b = P({53, 29});
      check_product("mm a @ w^T", kMm, {a, tr(w)}, 53);
      check_product("mm a^T @ b", kMm, {tr(at), b}, 53);
      check_product("mm a^T @ w^T", kMm, {tr(at), tr(w)}, 53);
    }
    // Narrowed operands: leading dimension larger than the row, misaligned base pointers.
    {
      const Pair a = narrowed(P({37, 64}), 1, 3, 53), b = narrowed(P({53, 40}), 1, 1, 29);
      check_product("mm narrowed", kMm, {a, b}, 53);
      const Pair bt = tr(narrowed(P({33, 53}), 0, 1, 29), 0, 1);  // [53, 29], column stride 53
      check_product("mm narrowed transposed", kMm, {a, bt}, 53);
    }
    // Not BLAS-readable (every other column): the raw op copies it first.
    {
      const Pair a =
          view(P({37, 106}), [](const Tensor& t) { return ops::slice(t, 1, 0, 106, 2); });
      check_product("matmul strided columns", kMatmul, {a, P({53, 29})}, 53);
    }
    // 1-D cases: dot, matrix-vector, vector-matrix, vector with batches on either side,
    // a strided vector.
    {
      check_product("dot", kMatmul, {P({101}), P({101})}, 101);
      check_product("matrix-vector", kMatmul, {P({37, 53}), P({53})}, 53);
      check_product("vector-matrix", kMatmul, {P({53}), P({53, 29})}, 53);
      check_product("vector @ batch", kMatmul, {P({53}), P({3, 53, 29})}, 53);
      check_product("batch @ vector", kMatmul, {P({2, 3, 37, 53}), P({53})}, 53);
      const Pair col = view(P({53, 7}), [](const Tensor& t) { return ops::select(t, 1, 2); });
      check_product("matrix @ strided vector", kMatmul, {P({37, 53}), col}, 53);
      check_product("strided vector @ matrix", kMatmul, {col, P({53, 29})}, 53);
    }
    // Batches: bmm, broadcast batch dims, folded batch @ matrix, matrix @ batch, expanded
    // (stride-0) batches, transposed batched operands, batch dims that need a host loop.
    {
      check_product("bmm", kBmm, {P({6, 19, 35}), P({6, 35, 23})}, 35);
      check_product("bmm transposed", kBmm, {tr(P({6, 35, 19})), tr(P({6, 23, 35}))}, 35);
      check_product("broadcast [3,1,5,7] @ [4,7,6]", kMatmul, {P({3, 1, 5, 7}), P({4, 7, 6})}, 7);
      check_product("broadcast [2,1,33,47] @ [5,47,19]", kMatmul,
                    {P({2, 1, 33, 47}), P({5, 47, 19})}, 47);
      check_product("broadcast [5,1,9,11] @ [1,4,11,8]", kMatmul,
                    {P({5, 1, 9, 11}), P({1, 4, 11, 8})}, 11);
      check_product("batch @ matrix (folded)", kMatmul, {P({4, 17, 33}), P({33, 21})}, 33);
      check_product("batch @ matrix^T (folded)", kMatmul, {P({4, 17, 33}), tr(P({21, 33}))}, 33);
      check_product("matrix @ batch", kMatmul, {P({17, 33}), P({3, 33, 21})}, 33);
      const Pair ex = view(P({1, 9, 11}), [](const Tensor& t) {
        return ops::expand(t, {5, 9, 11});
      });
      check_product("expanded batch", kMatmul, {ex, P({5, 11, 8})}, 11);
      // As Linalg.MatmulAgreesWithNaiveLoops: transposed layouts of [3,1,5,7] and [4,7,6].
      auto transposed_layout = [](const Tensor& t) {
        return ops::transpose(ops::contiguous(ops::transpose(t, -1, -2)), -1, -2);
      };
      check_product(
          "broadcast, transposed layouts", kMatmul,
          {view(P({3, 1, 5, 7}), transposed_layout), view(P({4, 7, 6}), transposed_layout)}, 7);
      // Batch strides [99, 396]: not one stride, so 4 strided-batched calls of 3.
      const Pair perm = view(P({3, 4, 9, 11}), [](const Tensor& t) {
        return ops::permute(t, {1, 0, 2, 3});
      });
      check_product("permuted batch dims", kMatmul, {perm, P({4, 3, 11, 8})}, 11);
    }
    // Larger and long-K problems (split-K algorithms, workspace).
    {
      check_product("[2,128,256] @ [256,96]", kMatmul, {P({2, 128, 256}), P({256, 96})}, 256);
      check_product("[16,4096] @ [4096,16]", kMm, {P({16, 4096}), P({4096, 16})}, 4096);
      check_product("[3,70,130] @ [3,130,90]", kBmm, {P({3, 70, 130}), P({3, 130, 90})}, 130);
    }
  }
}

TEST_P(LinalgVsCpu, LinearMatchesTheCpu) {
  for (DType d : kFloatDtypes) {
    uint64_t seed = 300;
    auto P = [&](const Shape& s) { return pair(s, d, seed++); };
    const Pair x3 = P({4, 13, 37}), w = P({29, 37}), b = P({29});
    check_product("linear 3-D input with bias", kLinear, {x3, w, b}, 37);
    check_product("linear 3-D input without bias", kLinear, {x3, w}, 37);
    check_product("linear 2-D input with bias", kLinear, {P({50, 37}), w, b}, 37);
    check_product("linear 1-D input with bias (one row)", kLinear, {P({37}), w, b}, 37);
    const Pair xp = view(P({37, 13, 4}), [](const Tensor& t) {
      return ops::permute(t, {2, 1, 0});
    });
    check_product("linear permuted 3-D input", kLinear, {xp, w, b}, 37);
    const Pair xn = narrowed(P({26, 50}), 1, 5, 37);
    check_product("linear narrowed input (ld 50, misaligned)", kLinear, {xn, w, b}, 37);
    const Pair bs = view(P({58}), [](const Tensor& t) { return ops::slice(t, 0, 0, 58, 2); });
    check_product("linear strided bias", kLinear, {P({50, 37}), w, bs}, 37);
    const Pair wt = tr(P({37, 29}));  // [29, 37] with strides [1, 29]
    check_product("linear transposed weight", kLinear, {P({50, 37}), wt, b}, 37);
    const Pair b1 = P({1});
    check_product("linear one output feature", kLinear, {P({50, 37}), P({1, 37}), b1}, 37);
    const Pair b7 = P({7});
    check_product("linear one input feature", kLinear, {P({10, 1}), P({7, 1}), b7}, 1);
    const Pair xl = P({8, 64, 256}), wl = P({384, 256}), bl = P({384});
    check_product("linear larger", kLinear, {xl, wl, bl}, 256);
  }
}

TEST_P(LinalgVsCpu, ProductGradientsMatchTheCpu) {
  const Fn mat = [](const TensorList& x) { return matmul(x[0], x[1]); };
  const Fn lin = [](const TensorList& x) { return linear(x[0], x[1], x[2]); };
  for (DType d : {kF32, kF64, kBF16}) {
    const double tol = d == kF32 ? 1e-4 : d == kF64 ? 1e-10 : 3e-2;
    check_grads("broadcast batches", mat, {{2, 1, 13, 17}, {5, 17, 11}}, d, tol, 1);
    check_grads("matrix @ batch", mat, {{13, 17}, {3, 17, 11}}, d, tol, 3);
    check_grads("batch @ matrix", mat, {{3, 13, 17}, {17, 11}}, d, tol, 5);
    check_grads("dot", mat, {{17}, {17}}, d, tol, 7);
    check_grads("matrix-vector", mat, {{13, 17}, {17}}, d, tol, 9);
    check_grads("vector-matrix", mat, {{17}, {17, 11}}, d, tol, 11);
    check_grads("vector @ batch", mat, {{17}, {2, 17, 11}}, d, tol, 13);
    check_grads("batch @ vector", mat, {{2, 1, 13, 17}, {17}}, d, tol, 15);
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
    check_grads("linear 3-D with bias", lin, {{4, 13, 37}, {29, 37}, {29}}, d, tol, 23);
    check_grads(
        "linear without bias", [](const TensorList& x) { return linear(x[0], x[1]); },
        {{4, 13, 37}, {29, 37}}, d, tol, 26);
    check_grads("linear 1-D input", lin, {{37}, {29, 37}, {29}}, d, tol, 28);
  }
}

// ------------------------------------------------------------------ cuBLAS(Lt) internals

#if defined(TALLY_WITH_CUDA)
// Allows TF32 for the scope; exact float32 again after it, also when the op throws.
struct AllowTf32 {
  AllowTf32() { cuda::set_allow_tf32(true); }
  ~AllowTf32() { cuda::set_allow_tf32(false); }
};

TEST_P(LinalgVsCpu, Float32IsExactUnlessTf32IsAllowed) {
  EXPECT_FALSE(cuda::allow_tf32()) << "TF32 must be off by default";
  const Pair a = pair({512, 512}, kF32, 1), b = pair({512, 512}, kF32, 2);
  const Tensor ref = ops::mm(cpu64(a.cpu), cpu64(b.cpu));
  const double fp32 = max_scaled_error(ops::mm(a.gpu, b.gpu), ref);
  double tf32 = 0;
  {
    AllowTf32 allow;
    tf32 = max_scaled_error(ops::mm(a.gpu, b.gpu), ref);
  }
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

TEST_P(LinalgVsCpu, LinearUsesTheBiasEpilogue) {
  for (DType d : kFloatDtypes) {
    const Pair x = pair({64, 96}, d, 1), w = pair({48, 96}, d, 2), b = pair({48}, d, 3);
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
        close_scaled(y, ops::linear(cpu64(x.cpu), cpu64(w.cpu), cpu64(b.cpu)), product_tol(d, 96)))
        << dtype_name(d);
  }
  // One row: PyTorch's conditions keep degenerate shapes off the epilogue.
  const Pair x1 = pair({96}, kF32, 4), w = pair({48, 96}, kF32, 5), b = pair({48}, kF32, 6);
  const cuda::MatmulStats before = cuda::matmul_stats();
  const Tensor y1 = ops::linear(x1.gpu, w.gpu, b.gpu);
  EXPECT_EQ(cuda::matmul_stats().bias_fallback - before.bias_fallback, 1u);
  EXPECT_TRUE(close_scaled(y1, ops::linear(cpu64(x1.cpu), cpu64(w.cpu), cpu64(b.cpu)),
                           product_tol(kF32, 96)));
  // The algorithm of a repeated problem comes from the plan cache.
  const Pair p = pair({40, 50}, kF32, 7), q = pair({50, 60}, kF32, 8);
  (void)ops::mm(p.gpu, q.gpu);
  const uint64_t queries = cuda::matmul_stats().heuristic_queries;
  (void)ops::mm(p.gpu, q.gpu);
  EXPECT_EQ(cuda::matmul_stats().heuristic_queries, queries);
}

// linear_gelu_linear's GELU epilogues (cuBLASLt GELU_AUX_BIAS forward, DGELU backward) against
// the three ops in float64 on the CPU, and where they do not apply (float32, float64, a hidden
// size not a multiple of 8, no algorithm): the product and the GELU kernel.
TEST_P(LinalgVsCpu, GeluEpiloguesMatchTheCpu) {
  const Fn mlp = [](const TensorList& t) {
    return linear_gelu_linear(t[0], t[1], t[2], t[3], t[4]);
  };
  const Fn three = [](const TensorList& t) { return mlp_composite(t[0], t[1], t[2], t[3], t[4]); };
  for (DType d : {kF32, kF16, kBF16, kF64}) {
    for (int64_t hidden : {128, 100}) {
      const double tol = d == kF16 || d == kBF16 ? 3e-2 : product_tol(d, hidden);
      const cuda::MatmulStats before = cuda::matmul_stats();
      check_grads(fmt::format("fused, hidden {}", hidden), mlp,
                  {{2, 40, 96}, {hidden, 96}, {hidden}, {48, hidden}, {48}}, d, tol, 900);
      const cuda::MatmulStats after = cuda::matmul_stats();
      const bool fused = (d == kF16 || d == kBF16) && hidden % 8 == 0;
      SCOPED_TRACE(fmt::format("{} hidden {}", dname(d), hidden));
      EXPECT_EQ(after.gelu_epilogue - before.gelu_epilogue, fused ? 2u : 0u);
      EXPECT_EQ(after.gelu_fallback - before.gelu_fallback, fused ? 0u : 2u);
      // The same gradients as the three ops' on this device.
      if (d != kF64)
        check_grads("three ops", three, {{2, 40, 96}, {hidden, 96}, {hidden}, {48, hidden}, {48}},
                    d, tol, 900);
    }
  }
  // No cuBLASLt algorithm: the product (classic cuBLAS) and the GELU kernels.
  cuda::set_force_cublas_fallback(true);
  const cuda::MatmulStats before = cuda::matmul_stats();
  check_grads("forced fallback", mlp, {{64, 96}, {128, 96}, {128}, {48, 128}, {48}}, kBF16, 3e-2,
              901);
  cuda::set_force_cublas_fallback(false);
  EXPECT_EQ(cuda::matmul_stats().gelu_fallback - before.gelu_fallback, 2u);
  EXPECT_EQ(cuda::matmul_stats().gelu_epilogue, before.gelu_epilogue);
}

// Every product through the fallbacks (classic cuBLAS, the bias kernel), as happens when
// cuBLASLt's heuristic offers no algorithm for a problem.
TEST_P(LinalgVsCpu, ClassicCublasFallbackMatchesTheCpu) {
  struct Force {
    Force() { cuda::set_force_cublas_fallback(true); }
    ~Force() { cuda::set_force_cublas_fallback(false); }
  } force;
  for (DType d : {kF32, kF16, kBF16, kF64}) {
    uint64_t seed = 700;
    auto P = [&](const Shape& s) { return pair(s, d, seed++); };
    const cuda::MatmulStats before = cuda::matmul_stats();
    check_product("fallback mm", kMm, {P({37, 53}), P({53, 29})}, 53);
    check_product("fallback a^T @ w^T", kMm, {tr(P({53, 37})), tr(P({29, 53}))}, 53);
    check_product("fallback narrowed", kMm, {narrowed(P({37, 64}), 1, 3, 53), P({53, 29})}, 53);
    check_product("fallback broadcast", kMatmul, {P({2, 1, 33, 47}), P({5, 47, 19})}, 47);
    const Pair ex = view(P({1, 9, 11}), [](const Tensor& t) { return ops::expand(t, {5, 9, 11}); });
    check_product("fallback expanded batch", kMatmul, {ex, P({5, 11, 8})}, 11);
    check_product("fallback vector @ batch", kMatmul, {P({53}), P({3, 53, 29})}, 53);
    check_product("fallback linear", kLinear, {P({4, 13, 37}), P({29, 37}), P({29})}, 37);
    const cuda::MatmulStats after = cuda::matmul_stats();
    EXPECT_GE(after.classic_calls - before.classic_calls, 7u) << dname(d);
    EXPECT_EQ(after.lt_calls, before.lt_calls) << dname(d);
    EXPECT_EQ(after.bias_fallback - before.bias_fallback, 1u) << dname(d);
  }
}

// mm_out's float32 product of 16-bit operands (cuBLAS's mixed GEMM: A/B 16-bit, C/D float32)
// against the CPU kernel's, through cuBLASLt and through classic cuBLAS, in the fused
// classifier's shapes: d(weight) += dlogits^T h (a transposed operand, accumulated) and
// d(hidden) from a padded [rows, Vp] gradient read with ld = Vp.
TEST_P(LinalgVsCpu, MixedMmOutMatchesTheCpu) {
  struct Reset {
    ~Reset() { cuda::set_force_cublas_fallback(false); }
  } reset;
  for (const bool fallback : {false, true}) {
    cuda::set_force_cublas_fallback(fallback);
    for (DType d : {kF16, kBF16}) {
      SCOPED_TRACE(std::string(dname(d)) + (fallback ? " classic cuBLAS" : " cuBLASLt"));
      const Pair dl = narrowed(pair({96, 136}, d, 21), 1, 0, 131);  // [96, 131] of [96, 136]
      const Pair h = pair({96, 40}, d, 22), w = pair({131, 40}, d, 23);
      const Pair gw = pair({131, 40}, kF32, 24);  // a float32 sum to accumulate onto
      const cuda::MatmulStats before = cuda::matmul_stats();
      ops::mm_out(gw.gpu, ops::transpose(dl.gpu, 0, 1), h.gpu, /*accumulate=*/true);
      ops::mm_out(gw.cpu, ops::transpose(dl.cpu, 0, 1), h.cpu, /*accumulate=*/true);
      EXPECT_TRUE(close_scaled(gw.gpu, gw.cpu, product_tol(kF32, 96)));
      const Tensor dh_gpu = ops::empty({96, 40}, kF32, dev());
      const Tensor dh_cpu = ops::empty({96, 40}, kF32, Device::cpu());
      ops::mm_out(dh_gpu, dl.gpu, w.gpu);
      ops::mm_out(dh_cpu, dl.cpu, w.cpu);
      EXPECT_TRUE(close_scaled(dh_gpu, dh_cpu, product_tol(kF32, 131)));
      EXPECT_TRUE(
          close_scaled(dh_gpu, ops::mm(cpu64(dl.cpu), cpu64(w.cpu)), product_tol(kF32, 131)));
      const cuda::MatmulStats after = cuda::matmul_stats();
      if (fallback) {
        EXPECT_EQ(after.classic_calls - before.classic_calls, 2u);
        EXPECT_EQ(after.lt_calls, before.lt_calls);
      }
    }
  }
}

// Tuning (set_tunable_enabled, PyTorch's TunableOp): the timed algorithms give the CPU's
// products, an accumulating product adds onto its output once (the timing runs write scratch
// outputs), the GELU epilogue still writes its aux, and a problem met inside a CUDA graph
// capture takes the heuristic's algorithm with no host wait.
TEST_P(LinalgVsCpu, TunableProductsMatchTheCpu) {
  struct Reset {
    ~Reset() { set_tunable_enabled(false); }
  } reset;
  set_tunable_enabled(true);
  EXPECT_TRUE(tunable_enabled());
  const cuda::MatmulStats before = cuda::matmul_stats();
  for (DType d : {kF32, kBF16}) {
    uint64_t seed = 1300;
    auto P = [&](const Shape& s) { return pair(s, d, seed++); };
    // Shapes no other test uses: each is tuned here, then run again from the tuned cache.
    for (int rep = 0; rep < 2; ++rep) {
      check_product("tuned mm", kMm, {P({257, 192}), P({192, 136})}, 192);
      check_product("tuned linear", kLinear, {P({3, 97, 160}), P({144, 160}), P({144})}, 160);
      check_product("tuned bmm", kBmm, {P({5, 65, 72}), P({5, 72, 88})}, 72);
    }
  }
  // Accumulating (mixed) product: gw += dl^T h, added once.
  for (int rep = 0; rep < 2; ++rep) {
    const Pair dl = pair({160, 136}, kBF16, 1330), h = pair({160, 56}, kBF16, 1331);
    const Pair gw = pair({136, 56}, kF32, 1332);
    ops::mm_out(gw.gpu, ops::transpose(dl.gpu, 0, 1), h.gpu, /*accumulate=*/true);
    ops::mm_out(gw.cpu, ops::transpose(dl.cpu, 0, 1), h.cpu, /*accumulate=*/true);
    EXPECT_TRUE(close_scaled(gw.gpu, gw.cpu, product_tol(kF32, 160))) << "accumulate, rep " << rep;
  }
  // The GELU epilogues (gelu_aux writes the aux the backward's dgelu reads).
  const Fn mlp = [](const TensorList& t) {
    return linear_gelu_linear(t[0], t[1], t[2], t[3], t[4]);
  };
  check_grads("tuned fused MLP", mlp, {{2, 48, 104}, {136, 104}, {136}, {56, 136}, {56}}, kBF16,
              3e-2, 1340);
  const cuda::MatmulStats mid = cuda::matmul_stats();
  EXPECT_GT(mid.tuned, before.tuned) << "no problem was timed";
  // Inside a capture: a new problem runs the heuristic's algorithm (a wait would fail the
  // capture), and the replay computes the product.
  const Pair a = pair({211, 120}, kBF16, 1350), b = pair({120, 152}, kBF16, 1351);
  const Tensor out = ops::empty({211, 152}, kBF16, dev());
  ops::mm_out(out, a.gpu, b.gpu);  // warm-up outside: allocations and the tuned plan
  const Pair a2 = pair({219, 120}, kBF16, 1352);
  const Tensor out2 = ops::empty({219, 152}, kBF16, dev());
  cuda::Graph graph;
  graph.capture([&] { ops::mm_out(out2, a2.gpu, b.gpu); });  // a problem first met in it
  graph.replay();
  EXPECT_TRUE(close_scaled(out2, ops::mm(cpu64(a2.cpu), cpu64(b.cpu)), product_tol(kBF16, 120)));
}

// linear_backward's three gradients on the device against the CPU's composite in float64, in
// GPT-2's shapes scaled down and in odd ones.
TEST_P(LinalgVsCpu, LinearBackwardMatchesTheCpu) {
  for (DType d : {kF32, kF16, kBF16, kF64}) {
    for (const auto& [rows, in, out] :
         std::vector<std::array<int64_t, 3>>{{512, 96, 384}, {300, 37, 53}, {1, 8, 16}}) {
      SCOPED_TRACE(fmt::format("{} rows {} in {} out {}", dname(d), rows, in, out));
      const Pair x = pair({rows, in}, d, 41), g = pair({rows, out}, d, 42);
      const Pair w = pair({out, in}, d, 43);
      auto [gx, gw, gb] = ops::linear_backward(x.gpu, g.gpu, w.gpu, {true, true, true});
      const Tensor g64 = cpu64(g.cpu);
      EXPECT_TRUE(close_scaled(gx, ops::mm(g64, cpu64(w.cpu)), product_tol(d, out)));
      EXPECT_TRUE(
          close_scaled(gw, ops::mm(ops::transpose(g64, 0, 1), cpu64(x.cpu)), product_tol(d, rows)));
      EXPECT_TRUE(close_scaled(gb, ops::sum(g64, {0}), product_tol(d, rows)));
      EXPECT_EQ(gb.dtype(), d);
    }
  }
}

TEST_P(LinalgVsCpu, CublasLtWorkspaceIsTaggedWorkspace) {
  memory::CachingAllocator& alloc = memory::get_allocator(dev());
  const size_t ws_bytes = cuda::matmul_workspace_bytes();
  ASSERT_GT(ws_bytes, 0u) << "CUBLASLT_WORKSPACE_SIZE=0 in the environment?";
  const Pair a = pair({64, 96}, kF32, 1), b = pair({96, 48}, kF32, 2), bias = pair({48}, kF32, 3);
  const Pair a3 = pair({2, 64, 96}, kF32, 4);
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
  EXPECT_TRUE(close_scaled(y1, ops::mm(cpu64(a.cpu), cpu64(b.cpu)), 1e-4));
  EXPECT_TRUE(close_scaled(y4, ops::matmul(cpu64(a3.cpu), cpu64(b.cpu)), 1e-4));
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
  EXPECT_TRUE(close_scaled(z, ops::matmul(cpu64(a3.cpu), cpu64(b.cpu)), 1e-4));
  EXPECT_TRUE(close_scaled(
      zl, ops::linear(cpu64(a.cpu), cpu64(ops::transpose(b.cpu, 0, 1)), cpu64(bias.cpu)), 1e-4));
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

// got equals ref element for element (NaN where ref has NaN), as a gather must.
void expect_identical(const Tensor& got, const Tensor& ref, const std::string& what) {
  ASSERT_EQ(got.sizes(), ref.sizes()) << what;
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

TEST_P(LinalgVsCpu, EmbeddingGatherMatchesTheCpu) {
  const int64_t V = 50;
  uint64_t seed = 1;
  // The gather on the device, checked to be there, against the CPU's.
  auto check = [&](const Tensor& w, const Tensor& idx, const Tensor& wc, const Tensor& ic,
                   const std::string& what) {
    const Tensor got = ops::embedding(w, idx);
    EXPECT_EQ(got.device(), dev()) << what;
    expect_identical(got, ops::embedding(wc, ic), what);
  };
  for (DType d : {kF32, kF16, kBF16, kF64, DType::int64}) {
    // D = 64: 16-byte vector path; 37: element path; 8: one vector per bf16/fp16 row.
    for (int64_t D : {64, 37, 8}) {
      const Tensor wc = rnd_weight({V, D}, d, seed++);
      const Tensor wg = put(wc);
      for (DType id : {DType::int64, DType::int32}) {
        const Tensor ic = rnd_indices(V, {7, 13}, id, seed++);  // 91 lookups: repeats
        const Tensor ig = put(ic);
        const std::string what = dname(d) + " D=" + std::to_string(D) + " indices " + dname(id);
        check(wg, ig, wc, ic, what);
        // Transposed (non-contiguous) indices.
        check(wg, ops::transpose(ig, 0, 1), wc, ops::transpose(ic, 0, 1),
              what + " transposed indices");
      }
      // A transposed weight (column stride V), a narrowed one (offset, row stride > D).
      const Tensor wtc = rnd_weight({D, V}, d, seed++);
      const Tensor wtg = put(wtc);
      const Tensor ic = rnd_indices(V, {33}, DType::int64, seed++), ig = put(ic);
      check(ops::transpose(wtg, 0, 1), ig, ops::transpose(wtc, 0, 1), ic,
            dname(d) + " transposed weight");
      const Tensor widec = rnd_weight({V, D + 24}, d, seed++);
      const Tensor wideg = put(widec);
      for (int64_t start : {int64_t{3}, int64_t{16}}) {
        check(ops::narrow(wideg, 1, start, D), ig, ops::narrow(widec, 1, start, D), ic,
              dname(d) + " narrowed weight, start " + std::to_string(start) +
                  " D=" + std::to_string(D));
      }
    }
  }
  // A 0-D index.
  const Tensor wc = rand_tensor({V, 5}, kF32, 99);
  const Tensor i0 = ops::from_vector({7}, {}, DType::int64);
  const Tensor e0 = ops::embedding(put(wc), put(i0));
  EXPECT_EQ(e0.sizes(), (Shape{5}));
  EXPECT_EQ(e0.device(), dev());
  expect_identical(e0, ops::embedding(wc, i0), "0-D index");
}

TEST_P(LinalgVsCpu, EmbeddingOutOfRangeIndicesGiveNanRows) {
  // The CPU throws (Linalg.Errors); the GPU cannot without a host synchronisation, so the
  // row is NaN.
  const Tensor wc = rand_tensor({4, 3}, kF32, 1);
  const Tensor idx = ops::from_vector({1, 4, -1, 3}, {4}, DType::int64, dev());
  const std::vector<double> got = ops::to_vector(ops::embedding(put(wc), idx));
  const std::vector<double> w = ops::to_vector(wc);
  ASSERT_EQ(got.size(), 12u);
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(got[static_cast<size_t>(j)], w[static_cast<size_t>(3 + j)]);
    EXPECT_TRUE(std::isnan(got[static_cast<size_t>(3 + j)]));
    EXPECT_TRUE(std::isnan(got[static_cast<size_t>(6 + j)]));
    EXPECT_EQ(got[static_cast<size_t>(9 + j)], w[static_cast<size_t>(9 + j)]);
  }
  // Backward skips them.
  const Tensor gw = ops::embedding_backward(ops::ones({4, 3}, kF32, dev()), idx, 4, -1);
  EXPECT_EQ(ops::to_vector(gw), (std::vector<double>{0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1}));
}

TEST_P(LinalgVsCpu, EmbeddingBackwardMatchesTheCpu) {
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
          const Tensor gc = rand_tensor({9, 23, D}, d, seed++);
          const Tensor got = ops::embedding_backward(put(gc), put(ic), V, pad);
          const Tensor ref = ops::embedding_backward(cpu64(gc), ic, V, pad);
          EXPECT_EQ(got.dtype(), d);
          EXPECT_EQ(got.device(), dev());
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
      const Tensor gg = ops::transpose(put(ops::transpose(gc, 0, 1)), 0, 1);
      ASSERT_FALSE(gg.is_contiguous());
      EXPECT_TRUE(close_scaled(ops::embedding_backward(gg, put(ic), V, 3),
                               ops::embedding_backward(cpu64(gc), ic, V, 3), tol))
          << dname(d) << " transposed grad, D=" << D;
    }
  }
  // 16-bit weights accumulate in float32: 300 ones into one row is exactly 300.
  const Tensor many = ops::zeros({300}, DType::int64, dev());
  const Tensor g300 = ops::embedding_backward(ops::full({300, 2}, 1.0, kBF16, dev()), many, 2, -1);
  EXPECT_EQ(ops::to_vector(g300), (std::vector<double>{300, 300, 0, 0}));
}

#if defined(TALLY_WITH_CUDA)
TEST_P(LinalgVsCpu, EmbeddingBackwardKernelTakesNarrowGradIntoFloat32) {
  // The kernel contract allows grad narrower than grad_weight (bf16 into float32).
  const Tensor ic = rnd_indices(11, {300}, DType::int64, 3);
  const Tensor gc = rand_tensor({300, 19}, kBF16, 4);
  Tensor gw = ops::zeros({11, 19}, kF32, dev());
  cuda::linalg_kernels.embedding_backward(gw, put(gc), put(ic), 2);
  Tensor ref = ops::zeros({11, 19}, kF32);
  cpu::linalg_kernels.embedding_backward(ref, ops::to(gc, kF32), ic, 2);
  EXPECT_TRUE(close_scaled(gw, ref, 1e-5));
}
#endif

TEST_P(LinalgVsCpu, EmbeddingGradientThroughAutograd) {
  for (DType d : {kF32, kBF16}) {
    const Tensor wv = rand_tensor({23, 40}, d, 1);
    Tensor wc = ops::to(wv, Device::cpu(), kF64, true);
    wc.requires_grad_();
    const Tensor wg = leaf(wv);
    const Tensor ic = rnd_indices(23, {6, 50}, DType::int64, 2);
    const Tensor g = rand_tensor({6, 50, 40}, d, 3);
    embedding(wc, ic, 4).backward(cpu64(g));
    embedding(wg, put(ic), 4).backward(put(g));
    ASSERT_TRUE(wg.grad().defined());
    EXPECT_EQ(wg.grad().dtype(), d);
    EXPECT_TRUE(close_scaled(wg.grad(), wc.grad(), d == kF32 ? 1e-5 : 1e-2)) << dname(d);
  }
}

}  // namespace
}  // namespace tally
