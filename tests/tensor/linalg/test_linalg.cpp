// Linear algebra: matmul (all of PyTorch's cases), mm, bmm, linear, embedding. Values
// against hand-computed cases and a naive loop, float64 gradient checks (broadcast
// batches, 1-D operands, transposed and non-contiguous operands), what backward saves,
// layouts that must not copy, dtypes and errors.
#include <string>

#include "autograd/node.h"
#include "tensor/linalg/autograd.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using namespace testing;

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

TEST(Linalg, MatmulValues) {
  const Tensor a = from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor b = from_vector({7, 8, 9, 10, 11, 12}, {3, 2});
  EXPECT_TRUE(values_near(mm(a, b), {58, 64, 139, 154}));
  EXPECT_TRUE(values_near(matmul(a, b), {58, 64, 139, 154}));
  EXPECT_EQ(matmul(a, b).sizes(), (Shape{2, 2}));
  // 1-D x 1-D: a dot product, 0-D.
  const Tensor d = matmul(tensor({1, 2, 3}), tensor({4, 5, 6}));
  EXPECT_EQ(d.dim(), 0);
  EXPECT_DOUBLE_EQ(d.item(), 32.0);
  // matrix-vector and vector-matrix.
  const Tensor mv = matmul(a, tensor({1, 0, -1}));
  EXPECT_EQ(mv.sizes(), (Shape{2}));
  EXPECT_TRUE(values_near(mv, {-2, -2}));
  const Tensor vm = matmul(tensor({1, -1}), a);
  EXPECT_EQ(vm.sizes(), (Shape{3}));
  EXPECT_TRUE(values_near(vm, {-3, -3, -3}));
  // Broadcast batches: [2, 1, 2, 2] x [3, 2, 1] -> [2, 3, 2, 1].
  const Tensor ba = ops::reshape(arange(0, 8, 1, f64), {2, 1, 2, 2});
  const Tensor bb = ops::reshape(arange(0, 6, 1, f64), {3, 2, 1});
  const Tensor bc = matmul(ba, bb);
  EXPECT_EQ(bc.sizes(), (Shape{2, 3, 2, 1}));
  EXPECT_TRUE(values_near(bc, {1, 3, 3, 13, 5, 23, 5, 7, 23, 33, 41, 59}));
  // bmm.
  const Tensor x = ops::reshape(arange(0, 8, 1, f64), {2, 2, 2});
  EXPECT_TRUE(values_near(bmm(x, x), {2, 3, 6, 11, 46, 55, 66, 79}));
  // 1-D with a batch: [2] x [3, 2, 2] -> [3, 2]; [2, 2, 3] x [3] -> [2, 2].
  const Tensor v = tensor({1, 2}, f64);
  const Tensor b3 = ops::reshape(arange(0, 12, 1, f64), {3, 2, 2});
  EXPECT_EQ(matmul(v, b3).sizes(), (Shape{3, 2}));
  EXPECT_TRUE(values_near(matmul(v, b3), {4, 7, 16, 19, 28, 31}));
  const Tensor a3 = ops::reshape(arange(0, 12, 1, f64), {2, 2, 3});
  EXPECT_EQ(matmul(a3, tensor({1, 0, 2}, f64)).sizes(), (Shape{2, 2}));
  EXPECT_TRUE(values_near(matmul(a3, tensor({1, 0, 2}, f64)), {4, 13, 22, 31}));
}

TEST(Linalg, MatmulAgreesWithNaiveLoops) {
  Generator g(7);
  for (DType dt : {DType::float32, DType::float64}) {
    const Tensor a = ops::randn({3, 1, 5, 7}, dt, Device::cpu(), &g);
    const Tensor b = ops::randn({4, 7, 6}, dt, Device::cpu(), &g);
    const Tensor c = matmul(a, b);
    EXPECT_EQ(c.sizes(), (Shape{3, 4, 5, 6}));
    const std::vector<double> ref = naive_matmul(ops::contiguous(ops::expand(a, {3, 4, 5, 7})),
                                                 ops::contiguous(ops::expand(b, {3, 4, 7, 6})));
    EXPECT_TRUE(values_near(c, ref, dt == DType::float32 ? 1e-4 : 1e-12));
    // Transposed and strided operands give the same numbers.
    const Tensor at = ops::transpose(ops::contiguous(ops::transpose(a, -1, -2)), -1, -2);
    const Tensor bt = ops::transpose(ops::contiguous(ops::transpose(b, -1, -2)), -1, -2);
    EXPECT_FALSE(at.is_contiguous());
    EXPECT_TRUE(values_near(matmul(at, bt), ref, dt == DType::float32 ? 1e-4 : 1e-12));
    // Every other column of a wider matrix: not BLAS-readable, copied.
    const Tensor wide = ops::randn({5, 14}, dt, Device::cpu(), &g);
    const Tensor strided = ops::slice(wide, 1, 0, 14, 2);  // [5, 7], strides [14, 2]
    EXPECT_FALSE(ops::blas_layout(strided).has_value());
    EXPECT_TRUE(values_near(
        matmul(strided, b),
        naive_matmul(ops::contiguous(ops::expand(strided, {4, 5, 7})), ops::contiguous(b)),
        dt == DType::float32 ? 1e-4 : 1e-12));
  }
}

TEST(Linalg, EmptyDimensions) {
  const Tensor a = zeros({2, 0}), b = zeros({0, 3});
  const Tensor c = matmul(a, b);
  EXPECT_EQ(c.sizes(), (Shape{2, 3}));
  EXPECT_TRUE(values_near(c, {0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(matmul(zeros({0, 4}), zeros({4, 3})).sizes(), (Shape{0, 3}));
  EXPECT_EQ(matmul(zeros({2, 0, 4}), zeros({4, 3})).sizes(), (Shape{2, 0, 3}));
  EXPECT_EQ(bmm(zeros({0, 2, 4}), zeros({0, 4, 3})).sizes(), (Shape{0, 2, 3}));
  const Tensor x = zeros({5, 0});
  const Tensor lin = linear(x, zeros({3, 0}), ones({3}));
  EXPECT_TRUE(values_near(lin, std::vector<double>(15, 1.0)));
}

TEST(Linalg, BlasLayout) {
  const Tensor m = zeros({3, 4});
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
  EXPECT_FALSE(ops::blas_layout(ops::expand(zeros({1, 4}), {3, 4})).has_value());  // row stride 0
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

TEST(Linalg, TransposedAndBroadcastOperandsAreNotCopied) {
  const Tensor a = ops::randn({64, 32}, DType::float32);
  const Tensor w = ops::randn({48, 32}, DType::float32);
  Tensor out;
  // a @ w^T: the transposed view goes to BLAS as CblasTrans; only the output is allocated.
  size_t peak = peak_bytes_of([&] { out = ops::mm(a, ops::transpose(w, 0, 1)); });
  EXPECT_EQ(peak, out.storage().block_bytes());
  peak = peak_bytes_of([&] { out = ops::linear(a, w); });
  EXPECT_EQ(peak, out.storage().block_bytes());
  // A batch times one matrix: folded into one GEMM over a's rows, no copy.
  const Tensor x = ops::randn({4, 16, 32}, DType::float32);
  peak = peak_bytes_of([&] { out = ops::matmul(x, ops::transpose(w, 0, 1)); });
  EXPECT_EQ(peak, out.storage().block_bytes());
  EXPECT_EQ(out.sizes(), (Shape{4, 16, 48}));
  // Broadcast batch dims are walked with stride 0, never materialised.
  const Tensor p = ops::randn({2, 1, 8, 32}, DType::float32),
               q = ops::randn({5, 32, 8}, DType::float32);
  peak = peak_bytes_of([&] { out = ops::matmul(p, q); });
  EXPECT_EQ(peak, out.storage().block_bytes());
}

TEST(Linalg, LinearValues) {
  const Tensor x = from_vector({1, 2, 3, 4}, {2, 2});
  const Tensor w = from_vector({1, 0, 0, 1, 1, 1}, {3, 2});
  const Tensor b = tensor({0.5, -0.5, 1});
  EXPECT_TRUE(values_near(linear(x, w, b), {1.5, 1.5, 4, 3.5, 3.5, 8}));
  EXPECT_TRUE(values_near(linear(x, w), {1, 2, 3, 3, 4, 7}));
  const Tensor y = linear(tensor({1, 2}), w, b);  // 1-D input
  EXPECT_EQ(y.sizes(), (Shape{3}));
  EXPECT_TRUE(values_near(y, {1.5, 1.5, 4}));
  const Tensor x3 = ops::reshape(from_vector({1, 2, 3, 4, 1, 2, 3, 4}, {8}), {2, 2, 2});
  EXPECT_EQ(linear(x3, w, b).sizes(), (Shape{2, 2, 3}));
  EXPECT_TRUE(values_near(linear(x3, w, b), {1.5, 1.5, 4, 3.5, 3.5, 8, 1.5, 1.5, 4, 3.5, 3.5, 8}));
}

TEST(Linalg, SixteenBitDtypesMultiplyInFloat32) {
  Generator g(3);
  const Tensor a = ops::randn({3, 4, 5}, DType::float32, Device::cpu(), &g);
  const Tensor b = ops::randn({5, 6}, DType::float32, Device::cpu(), &g);
  const Tensor bias = ops::randn({6}, DType::float32, Device::cpu(), &g);
  for (DType dt : {DType::float16, DType::bfloat16}) {
    const double tol = dt == DType::float16 ? 2e-2 : 1e-1;
    const Tensor ah = a.to(dt), bh = b.to(dt);
    // Reference: the rounded inputs multiplied in float32.
    const Tensor ref = matmul(ah.to(DType::float32), bh.to(DType::float32));
    const Tensor c = matmul(ah, bh);
    EXPECT_EQ(c.dtype(), dt);
    EXPECT_TRUE(values_near(c, ops::to_vector(ref), tol));
    const Tensor l = linear(ah, ops::transpose(bh, 0, 1), bias.to(dt));
    EXPECT_EQ(l.dtype(), dt);
    EXPECT_TRUE(values_near(l, ops::to_vector(ops::add(ref, bias.to(dt).to(DType::float32))), tol));
    // Backward runs in the same dtype.
    const Tensor ag = ah.detach().requires_grad_(), bg = bh.detach().requires_grad_();
    matmul(ag, bg).sum().backward();
    EXPECT_EQ(ag.grad().dtype(), dt);
    EXPECT_EQ(bg.grad().sizes(), (Shape{5, 6}));
  }
}

TEST(Linalg, MatmulGradients) {
  // Batched with broadcasting of batch dims: [2, 1, 3, 4] x [5, 4, 2].
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); },
                        {rand_input({2, 1, 3, 4}, -1, 1, 1), rand_input({5, 4, 2}, -1, 1, 2)}));
  // 2-D x batched (a broadcast along the batch), and batched x 2-D (folded).
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); },
                        {rand_input({3, 4}, -1, 1, 3), rand_input({2, 4, 2}, -1, 1, 4)}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); },
                        {rand_input({2, 3, 4}, -1, 1, 5), rand_input({4, 2}, -1, 1, 6)}));
  // 1-D cases: dot, matrix-vector, vector-matrix, vector with batches on either side.
  const Tensor v4 = rand_input({4}, -1, 1, 7), w4 = rand_input({4}, -1, 1, 8);
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); }, {v4, w4}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); },
                        {rand_input({3, 4}, -1, 1, 9), v4}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); },
                        {v4, rand_input({4, 2}, -1, 1, 10)}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); },
                        {v4, rand_input({2, 4, 3}, -1, 1, 11)}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); },
                        {rand_input({2, 1, 3, 4}, -1, 1, 12), w4}));
  // Non-contiguous leaves and transposed views taken inside the graph.
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); },
                        {rand_input_noncontig({3, 4}, 13), rand_input_noncontig({4, 2}, 14)}));
  EXPECT_TRUE(
      gradcheck([](const TensorList& x) { return matmul(x[0].t(), x[1].transpose(-1, -2)); },
                {rand_input({4, 3}, -1, 1, 15), rand_input({2, 5, 4}, -1, 1, 16)}));
  EXPECT_TRUE(
      gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); },
                {rand_input_noncontig({2, 3, 4}, 17), rand_input_noncontig({2, 4, 3}, 18)}));
  // Only one operand requires grad.
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return matmul(x[0], x[1]); },
                        {rand_input({3, 4}, -1, 1, 19), ops::randn({2, 4, 2}, DType::float64)}));
}

TEST(Linalg, MmBmmGradients) {
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return mm(x[0], x[1]); },
                        {rand_input({3, 4}, -1, 1, 1), rand_input_noncontig({4, 2}, 2)}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return mm(x[0].t(), x[1]); },
                        {rand_input({4, 3}, -1, 1, 3), rand_input({4, 2}, -1, 1, 4)}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return bmm(x[0], x[1]); },
                        {rand_input({2, 3, 4}, -1, 1, 5), rand_input({2, 4, 2}, -1, 1, 6)}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return bmm(x[0], x[1].transpose(1, 2)); },
                        {rand_input_noncontig({2, 3, 4}, 7), rand_input({2, 2, 4}, -1, 1, 8)}));
}

TEST(Linalg, LinearGradients) {
  const Tensor x = rand_input({2, 3, 4}, -1, 1, 1);
  const Tensor w = rand_input({5, 4}, -1, 1, 2);
  const Tensor b = rand_input({5}, -1, 1, 3);
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return linear(t[0], t[1], t[2]); }, {x, w, b}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return linear(t[0], t[1]); }, {x, w}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return linear(t[0], t[1], t[2]); },
                        {rand_input_noncontig({3, 4}, 4), rand_input_noncontig({5, 4}, 5), b}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return linear(t[0], t[1], t[2]); },
                        {rand_input({4}, -1, 1, 6), w, b}));
  // A permuted (non-viewable) 3-D input.
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return linear(t[0], t[1], t[2]); },
                        {rand_input_noncontig({2, 3, 4}, 7), w, b}));
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

TEST(Linalg, SavesOnlyWhatThePartnerNeeds) {
  const Tensor a = rand_input({3, 4}), b = ops::randn({4, 2}, DType::float64);
  // Only a needs grad: dA = dC B^T needs b; a itself is not kept.
  EXPECT_EQ(saved_defined(matmul(a, b)), (std::vector<bool>{false, true}));
  EXPECT_EQ(saved_defined(matmul(b.t(), a.t())), (std::vector<bool>{true, false}));
  const Tensor bb = rand_input({4, 2});
  EXPECT_EQ(saved_defined(mm(a, bb)), (std::vector<bool>{true, true}));
  EXPECT_EQ(node_of(mm(a, bb))->name(), "MmBackward");
  // linear saves x only for dW and W only for dx; the bias needs nothing.
  const Tensor x = ops::randn({2, 4}, DType::float64);
  const Tensor w = rand_input({3, 4}), bias = rand_input({3});
  EXPECT_EQ(saved_defined(linear(x, w, bias)), (std::vector<bool>{true, false}));
  const Tensor xg = rand_input({2, 4});
  const Tensor wn = ops::randn({3, 4}, DType::float64);
  EXPECT_EQ(saved_defined(linear(xg, wn)), (std::vector<bool>{false, true}));
  // embedding saves the indices only.
  const Tensor idx = from_vector({0, 2}, {2}, i64);
  EXPECT_EQ(saved_defined(embedding(rand_input({3, 2}), idx)), (std::vector<bool>{true}));
}

TEST(Linalg, EmbeddingValues) {
  const Tensor w = from_vector({0, 1, 2, 3, 4, 5, 6, 7}, {4, 2});
  const Tensor idx = from_vector({1, 3, 0, 1}, {2, 2}, i64);
  const Tensor e = embedding(w, idx);
  EXPECT_EQ(e.sizes(), (Shape{2, 2, 2}));
  EXPECT_TRUE(values_near(e, {2, 3, 6, 7, 0, 1, 2, 3}));
  // int32 indices, a 0-D index, a transposed weight.
  EXPECT_TRUE(values_near(
      embedding(w, from_vector({2}, {1}, TensorOptions{}.with_dtype(DType::int32))), {4, 5}));
  const Tensor e0 = embedding(w, from_vector({3}, {}, i64));
  EXPECT_EQ(e0.sizes(), (Shape{2}));
  EXPECT_TRUE(values_near(e0, {6, 7}));
  const Tensor wt = ops::transpose(from_vector({0, 2, 4, 6, 1, 3, 5, 7}, {2, 4}), 0, 1);
  EXPECT_TRUE(values_near(embedding(wt, idx), {2, 3, 6, 7, 0, 1, 2, 3}));
}

TEST(Linalg, EmbeddingBackwardScatterAddsAndSkipsPadding) {
  const Tensor w = from_vector({0, 1, 2, 3, 4, 5, 6, 7}, {4, 2}, f64).requires_grad_();
  const Tensor idx = from_vector({1, 3, 1, 0}, {4}, i64);
  const Tensor g = from_vector({1, 2, 3, 4, 5, 6, 7, 8}, {4, 2}, f64);
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
  const Tensor wh = from_vector({0, 0, 0, 0}, {2, 2}).to(DType::bfloat16).requires_grad_();
  const Tensor many = zeros({300}, i64);
  embedding(wh, many).backward(ops::full({300, 2}, 1.0, DType::bfloat16));
  EXPECT_EQ(wh.grad().dtype(), DType::bfloat16);
  EXPECT_TRUE(values_near(wh.grad(), {300, 300, 0, 0}));  // bfloat16 adds would stall at 256
}

TEST(Linalg, EmbeddingGradients) {
  const Tensor w = rand_input({5, 3}, -1, 1, 1);
  const Tensor idx = from_vector({4, 1, 1, 0, 4, 4}, {2, 3}, i64);  // repeated indices
  EXPECT_TRUE(gradcheck([&](const TensorList& x) { return embedding(x[0], idx); }, {w}));
  EXPECT_TRUE(gradcheck([&](const TensorList& x) { return embedding(x[0], idx); },
                        {rand_input_noncontig({5, 3}, 2)}));
  // padding_idx: the padding row's lookups are masked out of the function, so the
  // numeric gradient agrees with "no gradient into the padding row".
  const Tensor keep = from_vector({1, 0, 0, 1, 1, 1}, {2, 3, 1}, f64);  // idx != 1
  EXPECT_TRUE(
      gradcheck([&](const TensorList& x) { return mul(embedding(x[0], idx, 1), keep); }, {w}));
}

TEST(Linalg, Errors) {
  const Tensor a = zeros({2, 3}), b = zeros({4, 5});
  expect_error<std::invalid_argument>(
      [&] { (void)matmul(a, b); },
      {"matmul: shapes [2, 3] and [4, 5] cannot be multiplied (2x3 and 4x5)"});
  expect_error<std::invalid_argument>([&] { (void)matmul(zeros({3}), zeros({4})); },
                                      {"matmul: shapes [3] and [4]"});
  expect_error<std::invalid_argument>([&] { (void)matmul(zeros({}), a); }, {"at least 1-D"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)matmul(zeros({2, 2, 3}), zeros({3, 3, 1}));
      },
      {"matmul: batch dimensions of [2, 2, 3] and [3, 3, 1] cannot be broadcast"});
  expect_error<std::invalid_argument>([&] { (void)matmul(a, zeros({3, 2}, f64)); }, {"same dtype"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)matmul(zeros({2, 3}, i64), zeros({3, 2}, i64));
      },
      {"floating"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)mm(zeros({2, 2, 3}), zeros({3, 2}));
      },
      {"mm: expected two 2-D tensors, got shapes [2, 2, 3] and [3, 2]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)mm(a, zeros({2, 3}));
      },
      {"mm: shapes [2, 3] and [2, 3] cannot be multiplied"});
  expect_error<std::invalid_argument>(
      [&] { (void)bmm(a, a); }, {"bmm: expected two 3-D tensors, got shapes [2, 3] and [2, 3]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)bmm(zeros({2, 2, 3}), zeros({3, 3, 2}));
      },
      {"bmm: batch sizes differ: shapes [2, 2, 3] and [3, 3, 2]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)bmm(zeros({2, 2, 3}), zeros({2, 2, 2}));
      },
      {"bmm: shapes [2, 2, 3] and [2, 2, 2] cannot be multiplied"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)linear(zeros({2, 3}), zeros({4, 5}));
      },
      {"linear: input [2, 3] has 3 features but weight [4, 5] expects 5"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)linear(zeros({2, 5}), zeros({4, 5}), zeros({3}));
      },
      {"linear: bias must have shape [4]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)linear(zeros({2, 5}), zeros({5}));
      },
      {"linear: weight must be 2-D"});
  const Tensor w = zeros({4, 2});
  expect_error<std::out_of_range>(
      [&] {
        (void)embedding(w, from_vector({1, 7}, {2}, i64));
      },
      {"embedding: index 7 is out of range for 4 rows"});
  expect_error<std::out_of_range>([&] { (void)embedding(w, from_vector({-1}, {1}, i64)); },
                                  {"index -1 is out of range for 4 rows"});
  expect_error<std::invalid_argument>([&] { (void)embedding(w, from_vector({1}, {1})); },
                                      {"embedding: indices must be int64 or int32, got float32"});
  expect_error<std::invalid_argument>(
      [&] { (void)embedding(zeros({4}), from_vector({1}, {1}, i64)); },
      {"embedding: weight must be 2-D"});
  expect_error<std::invalid_argument>([&] { (void)embedding(w, from_vector({1}, {1}, i64), 4); },
                                      {"embedding: padding_idx 4 must be -1 (none) or in [0, 4)"});
  // The allocator is consistent after the failures: ops still run.
  EXPECT_TRUE(values_near(mm(ones({1, 2}), ones({2, 1})), {2}));
}

}  // namespace
}  // namespace tally
