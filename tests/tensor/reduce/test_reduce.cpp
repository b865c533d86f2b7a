// Reduce family: max/min along a dim (values + indices), max/min/amax/amin over dims,
// argmax/argmin, var/std, logsumexp, one file for every device (tests/testing/devices.h).
// The OnDevice suite Reduce runs on the CPU (test_reduce) and on CUDA device 0
// (test_reduce_cuda): values against hand-computed cases (ties, NaN, -inf, keepdim, negative
// dims, 0-D), float64 gradient checks (non-contiguous inputs, several dims), what backward
// saves, lower-precision dtypes and the error messages. The VsCpu suite ReduceVsCpu runs on
// CUDA only: the kernels against the CPU's over every dtype they take, every layout
// (contiguous and strided rows, several reduced dims, non-contiguous views) and each of the
// kernels' walks (a thread, a warp or a block per row), the max/min backward scatter,
// autograd through them and how their outputs are tagged.
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "autograd/node.h"
#include "tensor/reduce/autograd.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace testing;

class Reduce : public OnDevice {};
TALLY_ON_DEVICES(Reduce);

// ---------------------------------------------------------------- selections

TEST_P(Reduce, MaxMinAlongDim) {
  const Tensor x = put(from_vector({1, 3, 3, 2, 0, 5}, {2, 3}));
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
  const Tensor n = put(from_vector({1, NAN, 7, NAN}, {4}));
  EXPECT_TRUE(std::isnan(max(n, 0).values.item()));
  EXPECT_TRUE(values_near(max(n, 0).indices, {1}));
  EXPECT_TRUE(values_near(argmin(n), {1}));
  EXPECT_TRUE(std::isnan(amax(n).item()));
  // Integer and bool inputs keep their dtype.
  const Tensor xi = put(from_vector({4, -2, 9, 9}, {2, 2}, i64));
  EXPECT_EQ(max(xi, 1).values.dtype(), DType::int64);
  EXPECT_TRUE(values_near(max(xi, 1).values, {4, 9}));
  EXPECT_TRUE(values_near(max(xi, 1).indices, {0, 0}));
  EXPECT_TRUE(values_near(amin(xi, {0, 1}), {-2}));
  const Tensor xb = put(from_vector({0, 1, 0}, {3}, TensorOptions{}.with_dtype(DType::bool_)));
  EXPECT_TRUE(values_near(argmax(xb), {1}));
  // 0-D input with dim 0.
  const Tensor s = full({}, 4.0, on({}));
  EXPECT_EQ(max(s, 0).values.dim(), 0);
  EXPECT_TRUE(values_near(max(s, -1).values, {4}));
  EXPECT_TRUE(values_near(max(s, 0).indices, {0}));
  EXPECT_TRUE(values_near(argmax(s), {0}));
}

TEST_P(Reduce, AmaxAmin) {
  const Tensor x = put(from_vector({1, 8, 3, 4, 5, 6, 7, 2}, {2, 2, 2}));
  EXPECT_TRUE(values_near(amax(x), {8}));
  EXPECT_TRUE(values_near(amax(x, {0, 2}), {8, 7}));
  EXPECT_TRUE(values_near(amin(x, {-1}), {1, 3, 5, 2}));
  EXPECT_EQ(amax(x, {1}, true).sizes(), (Shape{2, 1, 2}));
  EXPECT_TRUE(values_near(amax(x, {1}, true), {3, 8, 7, 6}));
  EXPECT_TRUE(values_near(amin(x.permute({2, 0, 1}), {1, 2}), {1, 2}));
  // Empty along a kept dim: an empty result.
  EXPECT_EQ(amax(zeros({0, 3}, on({})), {1}).sizes(), (Shape{0}));
}

// An expanded (stride 0) reduced dim repeats one value: the selections read it once. The API
// walk's seed 153 spent minutes in ones(1).expand(2**62).amin().
TEST_P(Reduce, SelectionsReadAnExpandedDimOnce) {
  const Tensor huge = put(from_vector({3}, {1})).expand({int64_t{1} << 62});
  EXPECT_TRUE(values_near(amin(huge), {3}));
  EXPECT_TRUE(values_near(amax(huge, {0}, true), {3}));
  EXPECT_EQ(amax(huge, {0}, true).sizes(), (Shape{1}));
  EXPECT_TRUE(values_near(max(huge), {3}));
  EXPECT_TRUE(values_near(min(huge, 0).values, {3}));
  EXPECT_TRUE(values_near(min(huge, 0).indices, {0}));  // the first of the ties
  EXPECT_TRUE(values_near(argmax(huge), {0}));
  // Rows expanded over 2^40 columns, reduced along them.
  const Tensor column = put(from_vector({2, -1, NAN}, {3, 1}));
  const Tensor rows = column.expand({3, int64_t{1} << 40});
  const Tensor lo = amin(rows, {1});
  EXPECT_EQ(lo.sizes(), (Shape{3}));
  EXPECT_EQ(lo.to(Device::cpu()).data<float>()[0], 2.0f);
  EXPECT_EQ(lo.to(Device::cpu()).data<float>()[1], -1.0f);
  EXPECT_TRUE(std::isnan(lo.to(Device::cpu()).data<float>()[2]));
  const ValuesIndices hi = max(rows, 1, /*keepdim=*/true);
  EXPECT_EQ(hi.indices.sizes(), (Shape{3, 1}));
  EXPECT_TRUE(values_near(hi.indices, {0, 0, 0}));
  EXPECT_TRUE(values_near(argmin(rows, -1), {0, 0, 0}));
  // A kept expanded dim keeps every position; a reduced dim that is not expanded is read whole.
  const Tensor wide = column.expand({3, 4});
  EXPECT_EQ(amax(wide, {0}).sizes(), (Shape{4}));
  EXPECT_TRUE(std::isnan(amax(wide, {0}).to(Device::cpu()).data<float>()[3]));
  const Tensor grid = put(from_vector({5, 1, 4}, {1, 3})).expand({1 << 20, 3});
  EXPECT_TRUE(values_near(amin(grid), {1}));
  EXPECT_TRUE(values_near(max(grid, 1).indices.narrow(0, 0, 2), {0, 0}));
}

// ---------------------------------------------------------------- statistics

TEST_P(Reduce, VarStd) {
  const Tensor x = put(from_vector({1, 2, 3, 4}, {1, 4}, f64));
  EXPECT_TRUE(values_near(var(x, {1}), {1.6666666667}, 1e-9));
  EXPECT_TRUE(values_near(var(x, {1}, 0.0), {1.25}, 1e-12));
  EXPECT_TRUE(values_near(std(x, {1}), {1.2909944487}, 1e-9));
  EXPECT_TRUE(values_near(std(x, {}, 0.0), {std::sqrt(1.25)}, 1e-12));
  EXPECT_EQ(var(x, {1}, 1.0, true).sizes(), (Shape{1, 1}));
  const Tensor m = put(from_vector({1, 2, 4, 8}, {2, 2}, f64));
  EXPECT_TRUE(values_near(var(m), {9.5833333333}, 1e-9));
  EXPECT_TRUE(values_near(var(m, {0}), {4.5, 18}, 1e-12));
  EXPECT_TRUE(values_near(var(m, {0, 1}), {9.5833333333}, 1e-9));
  EXPECT_TRUE(values_near(var(m.t(), {1}), {4.5, 18}, 1e-12));        // non-contiguous
  EXPECT_TRUE(values_near(var(m, {-1}, 2.0), {INFINITY, INFINITY}));  // divisor max(0, 2 - 2) = 0
  EXPECT_TRUE(std::isnan(var(put(from_vector({3}, {1}, f64))).item()));  // one element: 0 / 0
  EXPECT_TRUE(std::isnan(var(zeros({0}, on({}))).item()));
  // Large offset: the two-pass algorithm keeps the variance exact.
  EXPECT_TRUE(
      values_near(var(put(from_vector({1e9 + 1, 1e9 + 2, 1e9 + 3}, {3}, f64))), {1.0}, 1e-6));
  for (DType d : {DType::float32, DType::float16, DType::bfloat16}) {
    const Tensor xd = x.to(d);
    EXPECT_EQ(var(xd).dtype(), d);
    EXPECT_TRUE(values_near(var(xd, {1}), {1.6666666667}, d == DType::float32 ? 1e-6 : 1e-2))
        << dtype_name(d);
  }
}

TEST_P(Reduce, Logsumexp) {
  const Tensor x = put(from_vector({1, 2, 3}, {3}, f64));
  EXPECT_TRUE(values_near(logsumexp(x, 0), {3.4076059644}, 1e-9));
  EXPECT_TRUE(values_near(logsumexp(put(from_vector({1000, 1001, 1002}, {3})), 0),
                          {1002.4076059644}, 1e-3));
  const Tensor m = put(from_vector({1, 2, 3, -INFINITY}, {2, 2}, f64));
  EXPECT_TRUE(values_near(logsumexp(m, 1), {2.3132616875, 3.0}, 1e-9));
  EXPECT_EQ(logsumexp(m, -1, true).sizes(), (Shape{2, 1}));
  EXPECT_TRUE(values_near(logsumexp(put(from_vector({1, 2, 3, 4}, {2, 2}, f64)), {0, 1}),
                          {4.4401896986}, 1e-9));
  EXPECT_TRUE(values_near(logsumexp(put(from_vector({1, 2, 3, 4}, {2, 2}, f64)), Shape{}),
                          {4.4401896986}, 1e-9));
  // All -inf gives -inf, a +inf gives +inf, an empty reduction -inf.
  const Tensor inf = put(from_vector({-INFINITY, -INFINITY, 1, INFINITY}, {2, 2}, f64));
  EXPECT_TRUE(values_near(logsumexp(inf, 1), {-INFINITY, INFINITY}));
  EXPECT_TRUE(values_near(logsumexp(zeros({2, 0}, on({})), 1), {-INFINITY, -INFINITY}));
  // Integers compute in float32.
  EXPECT_EQ(logsumexp(put(from_vector({1, 2, 3}, {3}, i64)), 0).dtype(), DType::float32);
  for (DType d : {DType::float16, DType::bfloat16})
    EXPECT_TRUE(values_near(logsumexp(x.to(d), 0), {3.4076059644}, 2e-2)) << dtype_name(d);
}

// ---------------------------------------------------------------- gradients

TEST_P(Reduce, Gradients) {
  const Tensor a = rand_input({3, 4}, -2, 2, 1);
  const Tensor c = rand_input_noncontig({4, 3}, 2);
  const Tensor b = rand_input({2, 3, 4}, -2, 2, 3);
  const Device d = dev();
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return max(x[0], 1).values; }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return max(x[0], 0, true).values; }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return min(x[0], -2).values; }, {b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return min(x[0], 1, true).values; }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return max(x[0]) * 2.0; }, {b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return min(x[0]); }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return amax(x[0], {0, 2}); }, {b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return amin(x[0], {-1}, true); }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return var(x[0], {1}); }, {a}));
  EXPECT_TRUE(gradcheck_on(d,
                           [](const TensorList& x) {
                             return var(x[0], {0, 2}, 0.0, true);
                           },
                           {b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return var(x[0]); }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return std(x[0], {0}); }, {c}));
  EXPECT_TRUE(gradcheck_on(d,
                           [](const TensorList& x) {
                             return std(x[0], {-1, 0}, 2.0, true);
                           },
                           {b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return std(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return logsumexp(x[0], 1); }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return logsumexp(x[0], 0, true); }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return logsumexp(x[0], {0, 2}); }, {b}));
  EXPECT_TRUE(gradcheck_on(
      d, [](const TensorList& x) { return logsumexp(x[0].transpose(0, 1) * 3.0, Shape{}); }, {a}));
}

TEST_P(Reduce, TieGradients) {
  // max along a dim: all of the gradient to the first index among ties.
  const Tensor x = leaf(from_vector({1, 3, 3}, {3}, f64));
  max(x, 0).values.backward();
  EXPECT_TRUE(values_near(x.grad(), {0, 1, 0}));
  // max over everything and amax: split evenly among ties (PyTorch's rule).
  const Tensor y = leaf(from_vector({1, 3, 3}, {3}, f64));
  max(y).backward();
  EXPECT_TRUE(values_near(y.grad(), {0, 0.5, 0.5}));
  const Tensor z = leaf(from_vector({1, 3, 3, 2, 2, 0}, {2, 3}, f64));
  sum(amax(z, {1}) * put(from_vector({1, 10}, {2}, f64))).backward();
  EXPECT_TRUE(values_near(z.grad(), {0, 0.5, 0.5, 5, 5, 0}));
  const Tensor w = leaf(from_vector({2, 1, 1}, {3}, f64));
  min(w).backward();
  EXPECT_TRUE(values_near(w.grad(), {0, 0.5, 0.5}));
  // std of constant values: gradient 0, not NaN.
  const Tensor k = leaf(from_vector({2, 2, 2}, {3}, f64));
  std(k).backward();
  EXPECT_TRUE(values_near(k.grad(), {0, 0, 0}));
  // var: 2 (x - mean) / (N - 1) = (x - 2.5) * 2 / 3.
  const Tensor v = leaf(from_vector({1, 2, 3, 4}, {4}, f64));
  var(v).backward();
  EXPECT_TRUE(values_near(v.grad(), {-1.0, -1.0 / 3, 1.0 / 3, 1.0}, 1e-12));
}

TEST_P(Reduce, SavedForBackward) {
  const Tensor x = leaf(rand_input({4, 6}, -1, 1, 9));
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
TEST_P(Reduce, CoreSumMeanOfZeroDimOverDimZero) {
  const Tensor s = full({}, 2.0, on(f64_grad));
  EXPECT_TRUE(values_near(sum(s, {0}), {2.0}));
  EXPECT_EQ(sum(s, {-1}).dim(), 0);
  EXPECT_TRUE(values_near(mean(s, {0}, true), {2.0}));
  (sum(s, {0}) + mean(s, {-1})).backward();
  EXPECT_TRUE(values_near(s.grad(), {2.0}));
}

// ---------------------------------------------------------------- errors

TEST_P(Reduce, Errors) {
  const Tensor x = zeros({2, 0}, on({}));
  expect_error<std::out_of_range>([&] { (void)max(x, 1); }, {"max", "dim 1", "size 0", "[2, 0]"});
  expect_error<std::out_of_range>([&] { (void)argmin(x, -1); }, {"argmin", "size 0"});
  expect_error<std::out_of_range>([&] { (void)amax(x, {0, 1}); }, {"amax", "size 0"});
  expect_error<std::invalid_argument>([&] { (void)max(x); }, {"max", "[2, 0]"});
  expect_error<std::invalid_argument>([&] { (void)argmax(x); }, {"argmax", "[2, 0]"});
  const Tensor y = zeros({2, 3}, on({}));
  expect_error<std::out_of_range>([&] { (void)max(y, 2); }, {"max", "dimension 2"});
  expect_error<std::out_of_range>([&] { (void)var(y, {-3}); }, {"var", "dimension -3"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)var(y, {1, -1});
      },
      {"var", "dim 1", "multiple times"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)std(put(from_vector({1, 2}, {2}, i64)));
      },
      {"std", "int64"});
  expect_error<std::out_of_range>([&] { (void)logsumexp(y, 5); }, {"logsumexp", "dimension 5"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::value_selecting_reduction_backward(zeros({3}, on({})), zeros({3}, on(i64)),
                                                      {2, 3}, 1, false);
      },
      {"value_selecting_reduction_backward", "[3]", "[2, 3]"});
}

// ---------------------------------------------------------------- against the CPU

// Values with many ties: 9 levels in [-2, 2] (floats), [-4, 4] (int32/int64), or 0/1 (bool),
// exactly representable in every dtype; with NaNs at about `nan_frac` of the elements.
Tensor tied(const Shape& s, DType d, uint64_t seed, double nan_frac = 0.0) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> level(-4, 4);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> v(static_cast<size_t>(shape_numel(s)));
  for (double& x : v) {
    const int l = level(rng);
    if (d == DType::bool_)
      x = l > 0 ? 1.0 : 0.0;
    else if (d == DType::int32 || d == DType::int64)
      x = l;
    else
      x = u(rng) < nan_frac ? std::numeric_limits<double>::quiet_NaN() : l * 0.5;
  }
  return ops::from_vector(v, s, d);
}

const std::vector<DType> kAll = {DType::float32, DType::float64, DType::float16, DType::bfloat16,
                                 DType::int32,   DType::int64,   DType::bool_};
const std::vector<DType> kFloats(std::begin(kFloatDtypes), std::end(kFloatDtypes));

// A layout: the input is made as `base` (host and device alike) and viewed through `view`.
struct Layout {
  const char* what;
  Shape base;
  std::function<Tensor(const Tensor&)> view;
};

std::vector<Layout> layouts() {
  const auto id = [](const Tensor& t) { return t; };
  const auto transpose = [](const Tensor& t) { return ops::transpose(t, 0, 1); };
  return {
      {"[5, 7]", {5, 7}, id},
      {"[3, 50257]", {3, 50257}, id},
      {"[37, 1500]", {37, 1500}, id},
      {"[2000, 3]", {2000, 3}, id},
      {"[3000, 40]", {3000, 40}, id},
      {"[4, 5, 33]", {4, 5, 33}, id},
      {"transpose of [33, 20]", {33, 20}, transpose},
      {"transpose of [1100, 9]", {1100, 9}, transpose},
      {"permuted [6, 7, 8] -> [8, 6, 7]",
       {6, 7, 8},
       [](const Tensor& t) {
         return ops::permute(t, {2, 0, 1});
       }},
      {"every other column of [6, 154]",
       {6, 154},
       [](const Tensor& t) { return ops::slice(t, 1, 0, 154, 2); }},
      {"offset rows 2..6 of [7, 40]",
       {7, 40},
       [](const Tensor& t) { return ops::slice(t, 0, 2, 6); }},
      {"[1, 1]", {1, 1}, id},
      {"0-D", {}, id},
  };
}

// Several dim lists for a tensor of `rank` (every single dim, pairs, all, none = all).
std::vector<Shape> dim_lists(int64_t rank) {
  std::vector<Shape> out = {{}};
  for (int64_t d = 0; d < rank; ++d) out.push_back({d});
  if (rank >= 2) out.push_back({0, rank - 1});
  if (rank >= 3) out.push_back({-1, 1});
  if (rank >= 2) {
    Shape all;
    for (int64_t d = 0; d < rank; ++d) all.push_back(d);
    out.push_back(all);
  }
  return out;
}

class ReduceVsCpu : public VsCpu {
 protected:
  // Calls check(xc, xg, what) for every layout and each of `dtypes`: xc is made on the CPU by
  // make(base shape, dtype, seed) (seeds counting up from `seed`) and viewed through the
  // layout, xg is the same values on the device under test viewed the same way.
  void for_each_input(
      const std::vector<DType>& dtypes, uint64_t seed,
      const std::function<Tensor(const Shape&, DType, uint64_t)>& make,
      const std::function<void(const Tensor&, const Tensor&, const std::string&)>& check) const {
    for (const Layout& l : layouts())
      for (DType d : dtypes) {
        const Tensor base = make(l.base, d, ++seed);
        check(l.view(base), l.view(put(base)), std::string(l.what) + " " + dtype_name(d));
      }
  }
  // Calls check(dims, keepdim, what) for every dim list of a tensor of `rank` (dim_lists),
  // with and without keepdim.
  static void for_each_dims(
      int64_t rank, const std::function<void(const Shape&, bool, const std::string&)>& check) {
    for (const Shape& dims : dim_lists(rank))
      for (bool keepdim : {false, true})
        check(dims, keepdim, " dims " + shape_str(dims) + " keepdim " + std::to_string(keepdim));
  }
  // The input, as `tied` makes it, for the value-selecting reductions.
  static Tensor tied_input(const Shape& s, DType d, uint64_t seed) { return tied(s, d, seed); }
};
TALLY_VS_CPU(ReduceVsCpu);

// ------------------------------------------------------------------ selections

TEST_P(ReduceVsCpu, MaxMinAlongADimMatchTheCpu) {
  for_each_input(kAll, 1, tied_input, [](const Tensor& xc, const Tensor& xg, const std::string& l) {
    const int64_t rank = xc.dim();
    for (int64_t dim = rank == 0 ? 0 : -rank; dim < std::max<int64_t>(rank, 1); ++dim) {
      for (bool keepdim : {false, true}) {
        const std::string what =
            l + " dim " + std::to_string(dim) + " keepdim " + std::to_string(keepdim);
        for (bool is_max : {true, false}) {
          const ValuesIndices c = is_max ? ops::max(xc, dim, keepdim) : ops::min(xc, dim, keepdim);
          const ValuesIndices g = is_max ? ops::max(xg, dim, keepdim) : ops::min(xg, dim, keepdim);
          const char* name = is_max ? "max " : "min ";
          EXPECT_TRUE(close_pointwise(g.values, c.values, 0.0)) << name << what;
          EXPECT_TRUE(close_pointwise(g.indices, c.indices, 0.0)) << name << "indices " << what;
          const Tensor ac = is_max ? ops::argmax(xc, dim, keepdim) : ops::argmin(xc, dim, keepdim);
          const Tensor ag = is_max ? ops::argmax(xg, dim, keepdim) : ops::argmin(xg, dim, keepdim);
          EXPECT_TRUE(close_pointwise(ag, ac, 0.0)) << (is_max ? "argmax " : "argmin ") << what;
        }
      }
    }
  });
}

TEST_P(ReduceVsCpu, NaNsWinWithTheirFirstIndex) {
  const auto with_nans = [](const Shape& s, DType d, uint64_t seed) {
    return tied(s, d, seed, 0.02);
  };
  for_each_input(
      kFloats, 50, with_nans, [](const Tensor& xc, const Tensor& xg, const std::string& l) {
        for (int64_t dim = 0; dim < std::max<int64_t>(xc.dim(), 1); ++dim) {
          const std::string what = l + " dim " + std::to_string(dim);
          const ValuesIndices c = ops::max(xc, dim), g = ops::max(xg, dim);
          EXPECT_TRUE(close_pointwise(g.values, c.values, 0.0)) << "max " << what;
          EXPECT_TRUE(close_pointwise(g.indices, c.indices, 0.0)) << "max indices " << what;
          const ValuesIndices cm = ops::min(xc, dim), gm = ops::min(xg, dim);
          EXPECT_TRUE(close_pointwise(gm.indices, cm.indices, 0.0)) << "min indices " << what;
          EXPECT_TRUE(close_pointwise(ops::amax(xg, {dim}), ops::amax(xc, {dim}), 0.0))
              << "amax " << what;
        }
        EXPECT_TRUE(close_pointwise(ops::argmax(xg), ops::argmax(xc), 0.0)) << l;
        EXPECT_TRUE(close_pointwise(ops::max(xg), ops::max(xc), 0.0)) << l;
      });
  // A row of NaNs only, and signed zeros (equal: the first is kept, bit for bit).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor x = ops::from_vector({nan, nan, nan, 0.0, -0.0, 0.0, -0.0, 0.0, -1.0}, {3, 3});
  for (int64_t dim : {0, 1}) {
    const ValuesIndices c = ops::max(x, dim), g = ops::max(put(x), dim);
    EXPECT_TRUE(close_pointwise(g.indices, c.indices, 0.0)) << dim;
    const ValuesIndices cm = ops::min(x, dim), gm = ops::min(put(x), dim);
    EXPECT_TRUE(close_pointwise(gm.indices, cm.indices, 0.0)) << dim;
    const std::vector<double> v = ops::to_vector(gm.values), w = ops::to_vector(cm.values);
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isnan(w[i])) {
        EXPECT_EQ(std::signbit(v[i]), std::signbit(w[i])) << dim << " " << i;
      }
  }
}

TEST_P(ReduceVsCpu, FlatArgmaxAndFullMaxMatchTheCpu) {
  for_each_input(
      kAll, 100, tied_input, [](const Tensor& xc, const Tensor& xg, const std::string& what) {
        EXPECT_TRUE(close_pointwise(ops::argmax(xg), ops::argmax(xc), 0.0)) << "argmax " << what;
        EXPECT_TRUE(close_pointwise(ops::argmin(xg), ops::argmin(xc), 0.0)) << "argmin " << what;
        EXPECT_TRUE(close_pointwise(ops::max(xg), ops::max(xc), 0.0)) << "max " << what;
        EXPECT_TRUE(close_pointwise(ops::min(xg), ops::min(xc), 0.0)) << "min " << what;
      });
}

TEST_P(ReduceVsCpu, AmaxAminMatchTheCpu) {
  for_each_input(
      kAll, 200, tied_input, [](const Tensor& xc, const Tensor& xg, const std::string& l) {
        for_each_dims(xc.dim(), [&](const Shape& dims, bool keepdim, const std::string& how) {
          EXPECT_TRUE(
              close_pointwise(ops::amax(xg, dims, keepdim), ops::amax(xc, dims, keepdim), 0.0))
              << "amax " << l << how;
          EXPECT_TRUE(
              close_pointwise(ops::amin(xg, dims, keepdim), ops::amin(xc, dims, keepdim), 0.0))
              << "amin " << l << how;
        });
      });
}

// ------------------------------------------------------------------ statistics

TEST_P(ReduceVsCpu, VarStdMatchTheCpu) {
  const auto make = [](const Shape& s, DType d, uint64_t seed) {
    return rand_tensor(s, d, seed, -3, 5);
  };
  for_each_input(kFloats, 300, make, [](const Tensor& xc, const Tensor& xg, const std::string& l) {
    const double tol = pointwise_tol(xc.dtype());
    for_each_dims(xc.dim(), [&](const Shape& dims, bool keepdim, const std::string& how) {
      for (double correction : {1.0, 0.0, 2.5}) {
        const std::string what = l + how + " correction " + std::to_string(correction);
        EXPECT_TRUE(close_pointwise(ops::var(xg, dims, correction, keepdim),
                                    ops::var(xc, dims, correction, keepdim), tol))
            << "var " << what;
        EXPECT_TRUE(close_pointwise(ops::std(xg, dims, correction, keepdim),
                                    ops::std(xc, dims, correction, keepdim), tol))
            << "std " << what;
      }
    });
  });
  // Divisor 0 (inf or NaN, as the CPU), and an offset mean (two passes stay accurate).
  const Tensor one = ops::from_vector({3.0, 4.0}, {2, 1});
  EXPECT_TRUE(close_pointwise(ops::var(put(one), {1}), ops::var(one, {1}), 0.0));
  EXPECT_TRUE(close_pointwise(ops::var(put(one), {0}, 2.0), ops::var(one, {0}, 2.0), 0.0));
  const Tensor offset =
      ops::to(ops::affine(rand_tensor({4, 999}, DType::float64, 333), 1.0, 1e4), DType::float32);
  EXPECT_TRUE(close_pointwise(ops::var(put(offset), {1}), ops::var(offset, {1}), 1e-5));
}

TEST_P(ReduceVsCpu, LogsumexpMatchesTheCpu) {
  const auto make = [](const Shape& s, DType d, uint64_t seed) {
    return rand_tensor(s, d, seed, -10, 10);
  };
  for_each_input(kFloats, 400, make, [](const Tensor& xc, const Tensor& xg, const std::string& l) {
    for_each_dims(xc.dim(), [&](const Shape& dims, bool keepdim, const std::string& how) {
      EXPECT_TRUE(close_pointwise(ops::logsumexp(xg, dims, keepdim),
                                  ops::logsumexp(xc, dims, keepdim), pointwise_tol(xc.dtype())))
          << "logsumexp " << l << how;
    });
  });
  // Infinities, NaN, an empty reduction (-inf), an integer input (computed in float32).
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor x = ops::from_vector({-inf, -inf, -inf, 1000, 1001, -inf, inf, 1, 2, nan, 1, 2},
                                    {4, 3}, DType::float32);
  EXPECT_TRUE(close_pointwise(ops::logsumexp(put(x), {1}), ops::logsumexp(x, {1}), 1e-5));
  const Tensor empty = ops::zeros({3, 0}, DType::float32);
  EXPECT_TRUE(close_pointwise(ops::logsumexp(put(empty), {1}), ops::logsumexp(empty, {1}), 0.0));
  const Tensor ints = tied({5, 9}, DType::int64, 444);
  EXPECT_TRUE(close_pointwise(ops::logsumexp(put(ints), {1}), ops::logsumexp(ints, {1}), 1e-5));
}

// ------------------------------------------------------------------ backward

TEST_P(ReduceVsCpu, ValueSelectingBackwardMatchesTheCpu) {
  uint64_t grad_seed = 1500;
  for_each_input(
      kFloats, 500, tied_input, [&](const Tensor& xc, const Tensor&, const std::string& l) {
        for (int64_t dim = 0; dim < std::max<int64_t>(xc.dim(), 1); ++dim) {
          for (bool keepdim : {false, true}) {
            const Tensor idx = ops::max(xc, dim, keepdim).indices;
            const Tensor g = rand_tensor(idx.sizes(), xc.dtype(), ++grad_seed);
            const Tensor rc =
                ops::value_selecting_reduction_backward(g, idx, xc.sizes(), dim, keepdim);
            const Tensor rg =
                ops::value_selecting_reduction_backward(put(g), put(idx), xc.sizes(), dim, keepdim);
            EXPECT_TRUE(close_pointwise(rg, rc, 0.0))
                << l << " dim " << dim << " keepdim " << keepdim;
          }
        }
      });
  // A non-contiguous grad and indices (transposed views).
  const Tensor x = tied({9, 6, 5}, DType::float32, 555);
  const Tensor idx = ops::contiguous(ops::transpose(ops::argmax(x, 1, true), 0, 2));  // [5, 1, 9]
  const Tensor g = rand_tensor({5, 1, 9}, DType::float32, 556);
  const Tensor it = ops::transpose(idx, 0, 2), gt = ops::transpose(g, 0, 2);  // [9, 1, 5]
  EXPECT_TRUE(close_pointwise(
      ops::value_selecting_reduction_backward(ops::transpose(put(g), 0, 2),
                                              ops::transpose(put(idx), 0, 2), {9, 6, 5}, 1, true),
      ops::value_selecting_reduction_backward(gt, it, {9, 6, 5}, 1, true), 0.0));
}

// The device cannot throw for an index outside the dim without a host sync: that entry is
// skipped (its gradient stays 0).
TEST_P(ReduceVsCpu, OutOfRangeIndexIsSkippedOnTheDevice) {
  const Tensor idx = put(ops::from_vector({0, 7, 2}, {3}, DType::int64));
  const Tensor g = put(ops::from_vector({1, 2, 3}, {3}, DType::float32));
  const std::vector<double> r =
      ops::to_vector(ops::value_selecting_reduction_backward(g, idx, {3, 4}, 1, false));
  const std::vector<double> want = {1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0};
  EXPECT_EQ(r, want);
}

// ------------------------------------------------------------------ autograd

TEST_P(ReduceVsCpu, ReductionGradientsMatchTheCpu) {
  uint64_t seed = 600;
  for (DType d : {DType::float32, DType::float64}) {
    for (int which = 0; which < 7; ++which) {
      Tensor xc = which < 3 ? tied({7, 130}, d, ++seed) : rand_tensor({7, 130}, d, ++seed);
      const Tensor xg = leaf(xc);
      xc.requires_grad_();
      const Tensor wc = rand_tensor({130}, d, ++seed), wg = put(wc);
      auto f = [which](const Tensor& x, const Tensor& w) -> Tensor {
        switch (which) {
          case 0:
            return tally::sum(tally::max(x, 1).values);
          case 1:
            return tally::sum(tally::mul(tally::min(x.transpose(0, 1), 1, true).values, 3.0));
          case 2:
            return tally::sum(tally::amax(x, {0}));
          case 3:
            return tally::sum(tally::var(tally::mul(x, w), {1}));
          case 4:
            return tally::sum(tally::std(x, {0}, 0.0));
          case 5:
            return tally::sum(tally::logsumexp(tally::mul(x, w), {1}));
          default:
            return tally::max(tally::mul(x, w));
        }
      };
      const Tensor lc = f(xc, wc), lg = f(xg, wg);
      EXPECT_TRUE(close_pointwise(lg, lc, pointwise_tol(d))) << which << " " << dtype_name(d);
      lc.backward();
      lg.backward();
      ASSERT_TRUE(xg.grad().defined()) << which;
      EXPECT_TRUE(close_pointwise(xg.grad(), xc.grad(), pointwise_tol(d)))
          << which << " " << dtype_name(d);
    }
  }
}

// Every output the reductions allocate on the device is a `temporary` under its op's name,
// and all of it is given back.
TEST_P(ReduceVsCpu, OutputsAreTaggedNeverUnknown) {
  memory::CachingAllocator& alloc = memory::get_allocator(dev());
  const Tensor x = put(rand_tensor({64, 300}, DType::float32, 700));
  const size_t before = memory::memory_allocated(dev());
  alloc.record_memory_history(true);
  {
    const ValuesIndices m = ops::max(x, 1);
    const Tensor v = ops::var(x, {0});
    const Tensor s = ops::logsumexp(x, {1});
    EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::unknown).current, 0);
  }
  std::set<std::string> ops_seen;
  for (const memory::TraceEntry& e : alloc.history())
    if (e.action == memory::TraceAction::alloc) {
      EXPECT_EQ(e.tag.category, memory::Category::temporary) << memory::interned(e.tag.op);
      ops_seen.insert(memory::interned(e.tag.op));
    }
  alloc.record_memory_history(false);
  EXPECT_EQ(ops_seen, (std::set<std::string>{"max", "var", "logsumexp"}));
  EXPECT_EQ(memory::memory_allocated(dev()), before);
}

}  // namespace
}  // namespace tally
