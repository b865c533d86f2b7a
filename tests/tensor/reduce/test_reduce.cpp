// Reduce family: max/min along a dim (values + indices), max/min/amax/amin over dims,
// argmax/argmin, var/std, logsumexp. Values against hand-computed cases (ties, NaN, -inf,
// keepdim, negative dims, 0-D), float64 gradient checks (non-contiguous inputs, several
// dims), what backward saves, lower-precision dtypes and the error messages.
#include <cmath>

#include "autograd/node.h"
#include "tensor/reduce/autograd.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using namespace testing;

// ---------------------------------------------------------------- selections

TEST(Reduce, MaxMinAlongDim) {
  const Tensor x = from_vector({1, 3, 3, 2, 0, 5}, {2, 3});
  auto [v, i] = max(x, 1);
  EXPECT_EQ(v.sizes(), (Shape{2}));
  EXPECT_EQ(i.dtype(), DType::int64);
  EXPECT_TRUE(values_near(v, {3, 5}));
  EXPECT_TRUE(values_near(i, {1, 2}));  // the tie at 1 and 2 takes the first
  const ValuesIndices mn = min(x, 0, /*keepdim=*/true);
  EXPECT_EQ(mn.values.sizes(), (Shape{1, 3}));
  EXPECT_TRUE(values_near(mn.values, {1, 0, 3}));
  EXPECT_TRUE(values_near(mn.indices, {0, 1, 0}));
  EXPECT_TRUE(values_near(max(x, -2).indices, {1, 0, 1}));
  EXPECT_TRUE(values_near(max(x), {5}));
  EXPECT_EQ(max(x).dim(), 0);
  EXPECT_TRUE(values_near(min(x), {0}));
  EXPECT_TRUE(values_near(argmax(x), {5}));
  EXPECT_TRUE(values_near(argmin(x), {4}));
  EXPECT_TRUE(values_near(argmax(x, 0), {1, 0, 1}));
  EXPECT_TRUE(values_near(argmin(x, 1, true), {0, 1}));
  EXPECT_EQ(argmin(x, 1, true).sizes(), (Shape{2, 1}));
  // A transposed (non-contiguous) input reads through its strides.
  const Tensor xt = x.t();
  EXPECT_TRUE(values_near(max(xt, 0).values, {3, 5}));
  EXPECT_TRUE(values_near(max(xt, 0).indices, {1, 2}));
  EXPECT_TRUE(values_near(argmin(xt), {3}));  // x^T flattened: [1, 2, 3, 0, 3, 5]
  // A NaN wins (and its first index).
  const Tensor n = from_vector({1, NAN, 7, NAN}, {4});
  EXPECT_TRUE(std::isnan(max(n, 0).values.item()));
  EXPECT_TRUE(values_near(max(n, 0).indices, {1}));
  EXPECT_TRUE(values_near(argmin(n), {1}));
  EXPECT_TRUE(std::isnan(amax(n).item()));
  // Integer and bool inputs keep their dtype.
  const Tensor xi = from_vector({4, -2, 9, 9}, {2, 2}, i64);
  EXPECT_EQ(max(xi, 1).values.dtype(), DType::int64);
  EXPECT_TRUE(values_near(max(xi, 1).values, {4, 9}));
  EXPECT_TRUE(values_near(max(xi, 1).indices, {0, 0}));
  EXPECT_TRUE(values_near(amin(xi, {0, 1}), {-2}));
  const Tensor xb = from_vector({0, 1, 0}, {3}, TensorOptions{}.with_dtype(DType::bool_));
  EXPECT_TRUE(values_near(argmax(xb), {1}));
  // 0-D input with dim 0.
  const Tensor s = full({}, 4.0);
  EXPECT_EQ(max(s, 0).values.dim(), 0);
  EXPECT_TRUE(values_near(max(s, -1).values, {4}));
  EXPECT_TRUE(values_near(max(s, 0).indices, {0}));
  EXPECT_TRUE(values_near(argmax(s), {0}));
}

TEST(Reduce, AmaxAmin) {
  const Tensor x = from_vector({1, 8, 3, 4, 5, 6, 7, 2}, {2, 2, 2});
  EXPECT_TRUE(values_near(amax(x), {8}));
  EXPECT_TRUE(values_near(amax(x, {0, 2}), {8, 7}));
  EXPECT_TRUE(values_near(amin(x, {-1}), {1, 3, 5, 2}));
  EXPECT_EQ(amax(x, {1}, true).sizes(), (Shape{2, 1, 2}));
  EXPECT_TRUE(values_near(amax(x, {1}, true), {3, 8, 7, 6}));
  EXPECT_TRUE(values_near(amin(x.permute({2, 0, 1}), {1, 2}), {1, 2}));
  // Empty along a kept dim: an empty result.
  EXPECT_EQ(amax(zeros({0, 3}), {1}).sizes(), (Shape{0}));
}

// ---------------------------------------------------------------- statistics

TEST(Reduce, VarStd) {
  const Tensor x = from_vector({1, 2, 3, 4}, {1, 4}, f64);
  EXPECT_TRUE(values_near(var(x, {1}), {1.6666666667}, 1e-9));
  EXPECT_TRUE(values_near(var(x, {1}, 0.0), {1.25}, 1e-12));
  EXPECT_TRUE(values_near(std(x, {1}), {1.2909944487}, 1e-9));
  EXPECT_TRUE(values_near(std(x, {}, 0.0), {std::sqrt(1.25)}, 1e-12));
  EXPECT_EQ(var(x, {1}, 1.0, true).sizes(), (Shape{1, 1}));
  const Tensor m = from_vector({1, 2, 4, 8}, {2, 2}, f64);
  EXPECT_TRUE(values_near(var(m), {9.5833333333}, 1e-9));
  EXPECT_TRUE(values_near(var(m, {0}), {4.5, 18}, 1e-12));
  EXPECT_TRUE(values_near(var(m, {0, 1}), {9.5833333333}, 1e-9));
  EXPECT_TRUE(values_near(var(m.t(), {1}), {4.5, 18}, 1e-12));        // non-contiguous
  EXPECT_TRUE(values_near(var(m, {-1}, 2.0), {INFINITY, INFINITY}));  // divisor max(0, 2 - 2) = 0
  EXPECT_TRUE(std::isnan(var(from_vector({3}, {1}, f64)).item()));    // one element: 0 / 0
  EXPECT_TRUE(std::isnan(var(zeros({0})).item()));
  // Large offset: the two-pass algorithm keeps the variance exact.
  EXPECT_TRUE(values_near(var(from_vector({1e9 + 1, 1e9 + 2, 1e9 + 3}, {3}, f64)), {1.0}, 1e-6));
  for (DType d : {DType::float32, DType::float16, DType::bfloat16}) {
    const Tensor xd = x.to(d);
    EXPECT_EQ(var(xd).dtype(), d);
    EXPECT_TRUE(values_near(var(xd, {1}), {1.6666666667}, d == DType::float32 ? 1e-6 : 1e-2))
        << dtype_name(d);
  }
}

TEST(Reduce, Logsumexp) {
  const Tensor x = from_vector({1, 2, 3}, {3}, f64);
  EXPECT_TRUE(values_near(logsumexp(x, 0), {3.4076059644}, 1e-9));
  EXPECT_TRUE(
      values_near(logsumexp(from_vector({1000, 1001, 1002}, {3}), 0), {1002.4076059644}, 1e-3));
  const Tensor m = from_vector({1, 2, 3, -INFINITY}, {2, 2}, f64);
  EXPECT_TRUE(values_near(logsumexp(m, 1), {2.3132616875, 3.0}, 1e-9));
  EXPECT_EQ(logsumexp(m, -1, true).sizes(), (Shape{2, 1}));
  EXPECT_TRUE(
      values_near(logsumexp(from_vector({1, 2, 3, 4}, {2, 2}, f64), {0, 1}), {4.4401896986}, 1e-9));
  EXPECT_TRUE(values_near(logsumexp(from_vector({1, 2, 3, 4}, {2, 2}, f64), Shape{}),
                          {4.4401896986}, 1e-9));
  // All -inf gives -inf, a +inf gives +inf, an empty reduction -inf.
  const Tensor inf = from_vector({-INFINITY, -INFINITY, 1, INFINITY}, {2, 2}, f64);
  EXPECT_TRUE(values_near(logsumexp(inf, 1), {-INFINITY, INFINITY}));
  EXPECT_TRUE(values_near(logsumexp(zeros({2, 0}), 1), {-INFINITY, -INFINITY}));
  // Integers compute in float32.
  EXPECT_EQ(logsumexp(from_vector({1, 2, 3}, {3}, i64), 0).dtype(), DType::float32);
  for (DType d : {DType::float16, DType::bfloat16})
    EXPECT_TRUE(values_near(logsumexp(x.to(d), 0), {3.4076059644}, 2e-2)) << dtype_name(d);
}

// ---------------------------------------------------------------- gradients

TEST(Reduce, Gradients) {
  const Tensor a = rand_input({3, 4}, -2, 2, 1);
  const Tensor c = rand_input_noncontig({4, 3}, 2);
  const Tensor b = rand_input({2, 3, 4}, -2, 2, 3);
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return max(x[0], 1).values; }, {a}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return max(x[0], 0, true).values; }, {c}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return min(x[0], -2).values; }, {b}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return min(x[0], 1, true).values; }, {c}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return max(x[0]) * 2.0; }, {b}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return min(x[0]); }, {c}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return amax(x[0], {0, 2}); }, {b}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return amin(x[0], {-1}, true); }, {c}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return var(x[0], {1}); }, {a}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return var(x[0], {0, 2}, 0.0, true); }, {b}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return var(x[0]); }, {c}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return std(x[0], {0}); }, {c}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return std(x[0], {-1, 0}, 2.0, true); }, {b}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return std(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return logsumexp(x[0], 1); }, {a}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return logsumexp(x[0], 0, true); }, {c}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return logsumexp(x[0], {0, 2}); }, {b}));
  EXPECT_TRUE(gradcheck(
      [](const TensorList& x) { return logsumexp(x[0].transpose(0, 1) * 3.0, Shape{}); }, {a}));
}

TEST(Reduce, TieGradients) {
  // max along a dim: all of the gradient to the first index among ties.
  const Tensor x = from_vector({1, 3, 3}, {3}, f64_grad);
  max(x, 0).values.backward();
  EXPECT_TRUE(values_near(x.grad(), {0, 1, 0}));
  // max over everything and amax: split evenly among ties (PyTorch's rule).
  const Tensor y = from_vector({1, 3, 3}, {3}, f64_grad);
  max(y).backward();
  EXPECT_TRUE(values_near(y.grad(), {0, 0.5, 0.5}));
  const Tensor z = from_vector({1, 3, 3, 2, 2, 0}, {2, 3}, f64_grad);
  sum(amax(z, {1}) * from_vector({1, 10}, {2}, f64)).backward();
  EXPECT_TRUE(values_near(z.grad(), {0, 0.5, 0.5, 5, 5, 0}));
  const Tensor w = from_vector({2, 1, 1}, {3}, f64_grad);
  min(w).backward();
  EXPECT_TRUE(values_near(w.grad(), {0, 0.5, 0.5}));
  // std of constant values: gradient 0, not NaN.
  const Tensor k = from_vector({2, 2, 2}, {3}, f64_grad);
  std(k).backward();
  EXPECT_TRUE(values_near(k.grad(), {0, 0, 0}));
  // var: 2 (x - mean) / (N - 1) = (x - 2.5) * 2 / 3.
  const Tensor v = from_vector({1, 2, 3, 4}, {4}, f64_grad);
  var(v).backward();
  EXPECT_TRUE(values_near(v.grad(), {-1.0, -1.0 / 3, 1.0 / 3, 1.0}, 1e-12));
}

TEST(Reduce, SavedForBackward) {
  const Tensor x = rand_input({4, 6}, -1, 1, 9);
  // max along a dim keeps only the int64 indices.
  const ValuesIndices r = max(x, 1);
  const auto saved = r.values.autograd_meta()->grad_fn->saved_tensors();
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_TRUE(saved[0]->held().storage().is_same(r.indices.storage()));
  EXPECT_FALSE(r.indices.requires_grad());
  EXPECT_FALSE(argmax(x, 1).requires_grad());
  // var keeps the input only.
  const Tensor vr = var(x, {1});
  ASSERT_EQ(vr.autograd_meta()->grad_fn->saved_tensors().size(), 1u);
  // Under no_grad nothing is recorded.
  NoGradGuard ng;
  EXPECT_FALSE(logsumexp(x, 1).requires_grad());
}

// Regression (core tensor/elementwise/ops.cpp, tensor/elementwise/autograd.cpp): sum/mean of a 0-D
// tensor over dim 0 or -1 wrote out of bounds, and its backward failed to expand.
TEST(Reduce, CoreSumMeanOfZeroDimOverDimZero) {
  const Tensor s = full({}, 2.0, f64_grad);
  EXPECT_TRUE(values_near(sum(s, {0}), {2.0}));
  EXPECT_EQ(sum(s, {-1}).dim(), 0);
  EXPECT_TRUE(values_near(mean(s, {0}, true), {2.0}));
  (sum(s, {0}) + mean(s, {-1})).backward();
  EXPECT_TRUE(values_near(s.grad(), {2.0}));
}

// ---------------------------------------------------------------- errors

TEST(Reduce, Errors) {
  const Tensor x = zeros({2, 0});
  expect_error<std::out_of_range>([&] { (void)max(x, 1); }, {"max", "dim 1", "size 0", "[2, 0]"});
  expect_error<std::out_of_range>([&] { (void)argmin(x, -1); }, {"argmin", "size 0"});
  expect_error<std::out_of_range>([&] { (void)amax(x, {0, 1}); }, {"amax", "size 0"});
  expect_error<std::invalid_argument>([&] { (void)max(x); }, {"max", "[2, 0]"});
  expect_error<std::invalid_argument>([&] { (void)argmax(x); }, {"argmax", "[2, 0]"});
  const Tensor y = zeros({2, 3});
  expect_error<std::out_of_range>([&] { (void)max(y, 2); }, {"max", "dimension 2"});
  expect_error<std::out_of_range>([&] { (void)var(y, {-3}); }, {"var", "dimension -3"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)var(y, {1, -1});
      },
      {"var", "dim 1", "multiple times"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)std(from_vector({1, 2}, {2}, i64));
      },
      {"std", "int64"});
  expect_error<std::out_of_range>([&] { (void)logsumexp(y, 5); }, {"logsumexp", "dimension 5"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::value_selecting_reduction_backward(zeros({3}), zeros({3}, i64), {2, 3}, 1,
                                                      false);
      },
      {"value_selecting_reduction_backward", "[3]", "[2, 3]"});
}

}  // namespace
}  // namespace tally
