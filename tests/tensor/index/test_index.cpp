// Index family and the composed ops: gather/scatter/scatter_add, index_select/index_add,
// cumsum, sort/topk, flip/roll, masked_select and the in-place mask writes, tril/triu,
// repeat, pad, one_hot, norm and einsum. One file for every device (tests/testing/devices.h):
// the OnDevice suite Index runs on the CPU (test_index) and on CUDA device 0
// (test_index_cuda): hand-computed values, float64 gradient checks and errors. The VsCpu
// suite IndexVsCpu runs on CUDA only: each kernel against the CPU reference over dtypes and
// non-contiguous layouts.
#include <cmath>
#include <string>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/estimate.h"
#include "memory/meta.h"
#include "tensor/index/kernels.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace testing;

class Index : public OnDevice {
 protected:
  Tensor i64(const std::vector<double>& v, const Shape& s) const {
    return put(from_vector(v, s, TensorOptions{}.with_dtype(DType::int64)));
  }
  Tensor f(const std::vector<double>& v, const Shape& s) const { return put(from_vector(v, s)); }
};
TALLY_ON_DEVICES(Index);

TEST_P(Index, GatherScatter) {
  const Tensor x = f({1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor idx = i64({2, 0, 1, 1}, {2, 2});
  EXPECT_TRUE(values_near(gather(x, 1, idx), {3, 1, 5, 5}));
  EXPECT_TRUE(values_near(gather(x, 0, i64({1, 0, 1}, {1, 3})), {4, 2, 6}));
  EXPECT_TRUE(values_near(gather(x, 1, i64({-1}, {1, 1})), {3}));  // negative counts from the end
  const Tensor src = f({10, 20, 30, 40}, {2, 2});
  EXPECT_TRUE(values_near(scatter(x, 1, i64({2, 0, 1, 0}, {2, 2}), src), {20, 2, 10, 40, 30, 6}));
  EXPECT_TRUE(values_near(scatter(x, 1, i64({2, 0}, {2, 1}), 0.0), {1, 2, 0, 0, 5, 6}));
  EXPECT_TRUE(values_near(scatter_add(x, 1, i64({0, 0, 2, 2}, {2, 2}), src), {31, 2, 3, 4, 5, 76}));
  EXPECT_TRUE(values_near(index_select(x, 1, i64({2, 0, 2}, {3})), {3, 1, 3, 6, 4, 6}));
  EXPECT_TRUE(values_near(index_select(x, 0, i64({1}, {1})), {4, 5, 6}));
  EXPECT_TRUE(values_near(index_add(x, 0, i64({1, 1}, {2}), f({1, 1, 1, 2, 2, 2}, {2, 3}), 2.0),
                          {1, 2, 3, 10, 11, 12}));
}

TEST_P(Index, GatherScatterGradients) {
  const Tensor idx = i64({2, 0, 1, 1, 0, 0}, {2, 3});
  EXPECT_TRUE(gradcheck_on(dev(), [&](const TensorList& in) { return gather(in[0], 1, idx); },
                           {rand_input({2, 4})}));
  const Tensor uniq = i64({2, 0, 1, 1, 0, 2}, {2, 3});  // no duplicates along dim 1
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& in) { return scatter(in[0], 1, uniq, in[1]); },
                           {rand_input({2, 4}), rand_input({2, 3}, -1, 1, 2)}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& in) { return scatter_add(in[0], 1, idx, in[1]); },
                           {rand_input({2, 4}), rand_input({2, 4}, -1, 1, 3)}));
  const Tensor rows = i64({2, 0, 2}, {3});
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& in) { return index_select(in[0], 0, rows); },
                           {rand_input_noncontig({3, 2})}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& in) { return index_add(in[0], 1, rows, in[1], -0.5); },
      {rand_input({2, 3}), rand_input({2, 3}, -1, 1, 4)}));
}

// A float64 leaf with exact values (zeros where a gradient must handle them), requiring grad.
Tensor exact_leaf(const std::vector<double>& v, const Shape& s) {
  Tensor t = from_vector(v, s, TensorOptions{}.with_dtype(DType::float64));
  t.requires_grad_(true);
  return t;
}

TEST_P(Index, ScatterReduceIndexFill) {
  const Tensor x = f({1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor dup = i64({0, 0, 2, 2}, {2, 2});
  const Tensor src = f({10, 20, 30, 40}, {2, 2});
  EXPECT_TRUE(values_near(scatter(x, 1, dup, src, "multiply"), {200, 2, 3, 4, 5, 7200}));
  EXPECT_TRUE(values_near(scatter(x, 1, dup, src, "add"), {31, 2, 3, 4, 5, 76}));
  EXPECT_TRUE(
      values_near(scatter(x, 1, i64({1, 1}, {2, 1}), 2.0, "multiply"), {1, 4, 3, 4, 10, 6}));
  EXPECT_TRUE(values_near(index_fill(x, 1, i64({0, 2}, {2}), -1), {-1, 2, -1, -1, 5, -1}));
  Tensor y = ops::clone(x);
  index_add_(y, 0, i64({1}, {1}), f({1, 1, 1}, {1, 3}), 2.0);
  EXPECT_TRUE(values_near(y, {1, 2, 3, 6, 7, 8}));
  scatter_(y, 0, i64({1, 0, 0}, {1, 3}), 9.0);
  EXPECT_TRUE(values_near(y, {1, 9, 9, 9, 7, 8}));
  scatter_(y, 1, dup, src, "sum");
  EXPECT_TRUE(values_near(y, {31, 9, 9, 9, 7, 78}));
  index_fill_(y, 0, i64({-1}, {1}), 0.0);
  EXPECT_TRUE(values_near(y, {31, 9, 9, 0, 0, 0}));
  EXPECT_THROW(scatter(x, 1, dup, src, "max"), std::invalid_argument);
  EXPECT_THROW(index_fill(x, 1, i64({0}, {1, 1}), 0.0), std::invalid_argument);
  // multiply's src gradient with zero sources: one zero at a place, two, and none.
  const Tensor idx = i64({0, 0, 1, 2, 2, 2, 1, 3, 1}, {3, 3});
  const Tensor s = exact_leaf({0.5, 0, 2, 0, 0, 1.5, 0.7, -1.3, 0.9}, {3, 3});
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& in) { return scatter(in[0], 1, idx, in[1], "multiply"); },
      {rand_input({3, 4}), s}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& in) { return scatter(in[0], 1, idx, in[1], "add"); },
      {rand_input({3, 4}), rand_input({3, 3}, -1, 1, 2)}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& in) { return scatter(in[0], 1, idx, -1.5, "multiply"); },
      {rand_input({3, 4})}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& in) {
                             return index_fill(in[0], 0, i64({2, 0}, {2}), 3.0);
                           },
                           {rand_input_noncontig({3, 2})}));
}

// The methods under PyTorch's names, index_fill's tensor value and x[..., mask, ...] = v.
TEST_P(Index, MethodsFillValueMaskPut) {
  const Tensor x = f({1, 2, 3, 4, 5, 6}, {2, 3});
  const Tensor dup = i64({0, 0, 2, 2}, {2, 2});
  const Tensor src = f({10, 20, 30, 40}, {2, 2});
  EXPECT_TRUE(values_near(x.scatter(1, dup, src, "multiply"), {200, 2, 3, 4, 5, 7200}));
  EXPECT_TRUE(values_near(x.index_fill(1, i64({1}, {1}), 0.0), {1, 0, 3, 4, 0, 6}));
  EXPECT_TRUE(values_near(x.cumprod(1), {1, 2, 6, 4, 20, 120}));
  Tensor y = ops::clone(x);
  y.index_add_(0, i64({1}, {1}), f({1, 1, 1}, {1, 3}), 2.0)
      .index_fill_(1, i64({0}, {1}), f({-1}, {}))
      .scatter_(1, i64({2}, {1, 1}), 9.0);
  EXPECT_TRUE(values_near(y, {-1, 2, 9, -1, 7, 8}));
  y.scatter_(0, i64({1, 1}, {1, 2}), src, "add");
  EXPECT_TRUE(values_near(y, {-1, 2, 9, 9, 27, 8}));
  EXPECT_THROW(x.index_fill(1, i64({0}, {1}), f({1, 2}, {2})), std::invalid_argument);
  // The value's gradient: the output's gradient summed where filled (index 0 twice: once).
  const Tensor idx = i64({2, 0, 0}, {3});
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& in) { return index_fill(in[0], 1, idx, in[1]); },
                           {rand_input({2, 4}), rand_input({}, -1, 1, 2)}));
  // x[:, mask] = v: v broadcast over the selected [2, count = 2, 2] entries.
  const Tensor z = f({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {2, 3, 2});
  const Tensor mask = put(from_vector({1, 0, 1}, {3}, TensorOptions{}.with_dtype(DType::bool_)));
  EXPECT_TRUE(values_near(index_mask_put(z, 1, mask, f({-1, -2}, {2})),
                          {-1, -2, 2, 3, -1, -2, -1, -2, 8, 9, -1, -2}));
  EXPECT_THROW(index_mask_put(z, 1, mask, f({1, 2, 3}, {3})), std::invalid_argument);
  const Tensor m2 =
      put(from_vector({0, 1, 1, 0, 0, 1}, {3, 2}, TensorOptions{}.with_dtype(DType::bool_)));
  EXPECT_TRUE(
      gradcheck_on(dev(), [&](const TensorList& in) { return index_mask_put(in[0], 1, m2, in[1]); },
                   {rand_input_noncontig({2, 3, 2}), rand_input({2, 1}, -1, 1, 2)}));
  // One node, PyTorch's name for the gradient of x[mask] = v.
  const Tensor put_out = index_mask_put(leaf(rand_input({2, 3, 2})), 1, m2, f({1}, {1}));
  EXPECT_EQ(put_out.autograd_meta()->grad_fn->name(), "IndexPutBackward0");
}

TEST_P(Index, Cumprod) {
  EXPECT_TRUE(values_near(cumprod(f({1, 2, 3, 0, 5, 2}, {2, 3}), 1), {1, 2, 6, 0, 0, 0}));
  EXPECT_TRUE(values_near(cumprod(f({1, 2, 3, 0, 5, 2}, {2, 3}), 0), {1, 2, 3, 0, 10, 6}));
  const Tensor ints = cumprod(i64({1, 2, 3}, {3}), 0);
  EXPECT_EQ(ints.dtype(), DType::int64);
  EXPECT_TRUE(values_near(ints, {1, 2, 6}));
  // Rows with no zero, one zero and two zeros: the gradient at and after a zero.
  const Tensor x = exact_leaf({2, 0, 3, 0.5, 1.5, -1, 0, 2, 0.7, 1.2, -0.4, 0.9}, {3, 4});
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return cumprod(in[0], 1); }, {x}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return cumprod(in[0], 0); }, {x}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return cumprod(in[0], 0); },
                           {rand_input_noncontig({3, 2})}));
}

TEST_P(Index, CumsumSortTopk) {
  const Tensor x = f({3, 1, 2, 1, 5, 4}, {2, 3});
  EXPECT_TRUE(values_near(cumsum(x, 1), {3, 4, 6, 1, 6, 10}));
  EXPECT_TRUE(values_near(cumsum(x, 0), {3, 1, 2, 4, 6, 6}));
  const Tensor ints = i64({1, 2, 3}, {3});
  EXPECT_EQ(cumsum(ints, 0).dtype(), DType::int64);
  EXPECT_TRUE(values_near(cumsum(ints, 0), {1, 3, 6}));
  auto [v, i] = sort(x, 1);
  EXPECT_TRUE(values_near(v, {1, 2, 3, 1, 4, 5}));
  EXPECT_TRUE(values_near(i, {1, 2, 0, 0, 2, 1}));
  auto [vd, id] = sort(f({1, NAN, 2, 1}, {4}), 0, true);
  EXPECT_TRUE(std::isnan(ops::to_vector(vd)[0]));
  EXPECT_TRUE(values_near(id, {1, 2, 0, 3}));  // NaN largest; ties keep their order
  auto [tv, ti] = topk(x, 2, 1);
  EXPECT_TRUE(values_near(tv, {3, 2, 5, 4}));
  EXPECT_TRUE(values_near(ti, {0, 2, 1, 2}));
  auto [bv, bi] = topk(x, 1, 0, /*largest=*/false);
  EXPECT_TRUE(values_near(bv, {1, 1, 2}));
  EXPECT_TRUE(values_near(bi, {1, 0, 0}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return cumsum(in[0], 1); },
                           {rand_input_noncontig({3, 4})}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return sort(in[0], 0, true).values; },
                           {rand_input({5, 2})}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return topk(in[0], 2, -1).values; },
                           {rand_input({3, 4})}));
  EXPECT_THROW(topk(x, 4, 1), std::out_of_range);
}

TEST_P(Index, FlipRollMasks) {
  const Tensor x = f({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_TRUE(values_near(flip(x, {1}), {3, 2, 1, 6, 5, 4}));
  EXPECT_TRUE(values_near(flip(x, {0, 1}), {6, 5, 4, 3, 2, 1}));
  EXPECT_TRUE(values_near(flip(x.t(), {0}), {3, 6, 2, 5, 1, 4}));
  EXPECT_TRUE(values_near(roll(x, {1}, {1}), {3, 1, 2, 6, 4, 5}));
  EXPECT_TRUE(values_near(roll(x, {-1, 1}, {0, 1}), {6, 4, 5, 3, 1, 2}));
  EXPECT_TRUE(values_near(roll(x, {2}), {5, 6, 1, 2, 3, 4}));
  // A 0-D tensor takes dim 0 / -1 as itself (PyTorch's wrap); others are out of range.
  const Tensor s = f({7}, {});
  EXPECT_TRUE(values_near(flip(s, {0}), {7}));
  EXPECT_TRUE(values_near(flip(s, {-1}), {7}));
  EXPECT_TRUE(values_near(roll(s, {3}, {0}), {7}));
  EXPECT_EQ(flip(s, {0}).dim(), 0);
  EXPECT_THROW(flip(s, {0, -1}), std::invalid_argument);
  EXPECT_THROW(flip(s, {1}), std::out_of_range);
  EXPECT_THROW(roll(s, {1}, {-2}), std::out_of_range);
  const Tensor mask = ops::binary_scalar(ops::BinaryOp::gt, x, 2.5);
  EXPECT_TRUE(values_near(masked_select(x, mask), {3, 4, 5, 6}));
  const Tensor row = put(from_vector({1, 0, 1}, {3}, TensorOptions{}.with_dtype(DType::bool_)));
  EXPECT_TRUE(values_near(masked_select(x, row), {1, 3, 4, 6}));  // mask broadcast
  Tensor y = ops::clone(x);
  masked_fill_(y, row, -1);
  EXPECT_TRUE(values_near(y, {-1, 2, -1, -1, 5, -1}));
  masked_scatter_(y, mask, f({7, 8, 9, 10, 11}, {5}));
  EXPECT_TRUE(values_near(y, {-1, 2, 7, 8, 9, 10}));
  EXPECT_THROW(masked_scatter_(y, mask, f({1}, {1})), std::invalid_argument);
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& in) {
                             return flip(in[0], {0, 1});
                           },
                           {rand_input_noncontig({3, 2})}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& in) {
                             return roll(in[0], {1, -3}, {0, 1});
                           },
                           {rand_input({3, 4})}));
  EXPECT_TRUE(gradcheck_on(dev(), [&](const TensorList& in) { return masked_select(in[0], row); },
                           {rand_input({2, 3})}));
}

TEST_P(Index, ComposedShapeOps) {
  const Tensor x = f({1, 2, 3, 4, 5, 6, 7, 8, 9}, {3, 3});
  EXPECT_TRUE(values_near(tril(x), {1, 0, 0, 4, 5, 0, 7, 8, 9}));
  EXPECT_TRUE(values_near(triu(x, 1), {0, 2, 3, 0, 0, 6, 0, 0, 0}));
  EXPECT_TRUE(values_near(tril(x, -1), {0, 0, 0, 4, 0, 0, 7, 8, 0}));
  const Tensor r = repeat(f({1, 2}, {2}), {2, 2});
  EXPECT_EQ(r.sizes(), (Shape{2, 4}));
  EXPECT_TRUE(values_near(r, {1, 2, 1, 2, 1, 2, 1, 2}));
  const Tensor p = pad(f({1, 2, 3, 4}, {2, 2}), {1, 0, 0, 1}, "constant", 9);
  EXPECT_EQ(p.sizes(), (Shape{3, 3}));
  EXPECT_TRUE(values_near(p, {9, 1, 2, 9, 3, 4, 9, 9, 9}));
  EXPECT_TRUE(values_near(pad(f({1, 2, 3}, {1, 3}), {2, 1}, "reflect"), {3, 2, 1, 2, 3, 2}));
  EXPECT_TRUE(values_near(pad(f({1, 2, 3}, {1, 3}), {-1, 1}), {2, 3, 0}));
  const Tensor oh = one_hot(i64({0, 2, 1}, {3}), 4);
  EXPECT_EQ(oh.dtype(), DType::int64);
  EXPECT_TRUE(values_near(oh, {1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0}));
  EXPECT_EQ(one_hot(i64({0, 2}, {2})).sizes(), (Shape{2, 3}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return tril(in[0], 1); },
                           {rand_input({2, 3, 4})}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& in) {
                             return repeat(in[0], {2, 1, 3});
                           },
                           {rand_input({2, 2})}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& in) {
                             return pad(in[0], {1, 2, -1, 1});
                           },
                           {rand_input({3, 4})}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& in) {
                             return pad(in[0], {2, 1}, "reflect");
                           },
                           {rand_input({2, 4})}));
  EXPECT_THROW(pad(x, {3, 0}, "reflect"), std::invalid_argument);
  EXPECT_THROW(repeat(x, {int64_t{1} << 62, 4}), std::overflow_error);  // sizes checked
}

TEST_P(Index, NormEinsum) {
  const Tensor x = f({3, -4, 0, 0}, {2, 2});
  EXPECT_TRUE(values_near(norm(x), {5}));
  EXPECT_TRUE(values_near(norm(x, 1, {1}), {7, 0}));
  EXPECT_TRUE(values_near(norm(x, INFINITY), {4}));
  EXPECT_TRUE(values_near(norm(x, 3, {1}, true), {std::cbrt(91.0), 0}, 1e-5));
  // The gradient at a zero norm is 0, not NaN.
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return norm(in[0], 2, {1}); },
                           {rand_input({3, 4})}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return norm(in[0], 3); },
                           {rand_input({3, 4})}));
  Tensor z = put(ops::zeros({2}, DType::float64));
  z.requires_grad_(true);
  norm(z).backward();
  EXPECT_TRUE(values_near(z.grad(), {0, 0}));

  const Tensor a = f({1, 2, 3, 4, 5, 6}, {2, 3}), b = f({1, 0, 0, 1, 1, 1}, {3, 2});
  EXPECT_TRUE(values_near(einsum("ij,jk->ik", {a, b}), {4, 5, 10, 11}));
  EXPECT_TRUE(values_near(einsum("ij->ji", {a}), {1, 4, 2, 5, 3, 6}));
  EXPECT_TRUE(values_near(einsum("ij->", {a}), {21}));
  EXPECT_TRUE(values_near(einsum("ij,ij->i", {a, a}), {14, 77}));
  EXPECT_TRUE(values_near(einsum("i,j", {f({1, 2}, {2}), f({3, 4}, {2})}), {3, 4, 6, 8}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& in) {
                             return einsum("bij,bkj->bki", {in[0], in[1]});
                           },
                           {rand_input({2, 3, 4}), rand_input({2, 2, 4}, -1, 1, 5)}));
  try {
    einsum("ii->i", {x});
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("einsum('ii->i')"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- the CUDA kernels vs the CPU

// The Tensor methods (tensor/tensor.h) give the free functions' results; the in-place ones
// return the tensor itself.
TEST_P(Index, TensorMethods) {
  const Tensor x = f({3, 1, 2, 6, 5, 4}, {2, 3});
  const Tensor idx = i64({2, 0, 1, 1}, {2, 2});
  EXPECT_TRUE(values_near(x.gather(1, idx), {2, 3, 5, 5}));
  EXPECT_TRUE(values_near(x.index_select(0, i64({1}, {1})), {6, 5, 4}));
  EXPECT_TRUE(values_near(x.scatter(1, i64({0, 0}, {2, 1}), 0.0), {0, 1, 2, 0, 5, 4}));
  EXPECT_TRUE(values_near(x.scatter_add(1, i64({0, 0}, {2, 1}), f({10, 20}, {2, 1})),
                          {13, 1, 2, 26, 5, 4}));
  EXPECT_TRUE(
      values_near(x.index_add(1, i64({2}, {1}), f({1, 1}, {2, 1}), 2.0), {3, 1, 4, 6, 5, 6}));
  EXPECT_TRUE(values_near(x.cumsum(1), {3, 4, 6, 6, 11, 15}));
  const auto [v, i] = x.sort(1, true);
  EXPECT_TRUE(values_near(v, {3, 2, 1, 6, 5, 4}));
  EXPECT_TRUE(values_near(i, {0, 2, 1, 0, 1, 2}));
  EXPECT_TRUE(values_near(x.argsort(1), {1, 2, 0, 2, 1, 0}));
  EXPECT_TRUE(values_near(x.topk(1, 1).values, {3, 6}));
  EXPECT_TRUE(values_near(x.flip({0}), {6, 5, 4, 3, 1, 2}));
  EXPECT_TRUE(values_near(x.roll({1}, {1}), {2, 3, 1, 4, 6, 5}));
  const Tensor mask =
      put(from_vector({0, 0, 0, 1, 1, 1}, {2, 3}, TensorOptions{}.with_dtype(DType::bool_)));
  EXPECT_TRUE(values_near(x.masked_select(mask), {6, 5, 4}));
  EXPECT_TRUE(values_near(x.masked_fill(mask, -1.0), {3, 1, 2, -1, -1, -1}));
  EXPECT_TRUE(values_near(x.tril(), {3, 0, 0, 6, 5, 0}));
  EXPECT_TRUE(values_near(x.triu(1), {0, 1, 2, 0, 0, 4}));
  EXPECT_EQ(x.repeat({2, 1}).sizes(), (Shape{4, 3}));
  Tensor y = x.clone();
  EXPECT_TRUE(y.masked_fill_(mask, 0.0).is_same(y));
  EXPECT_TRUE(values_near(y, {3, 1, 2, 0, 0, 0}));
  EXPECT_TRUE(
      values_near(y.scatter_add_(1, i64({1, 1}, {2, 1}), f({1, 1}, {2, 1})), {3, 2, 2, 0, 1, 0}));
}

class IndexVsCpu : public VsCpu {};
TALLY_VS_CPU(IndexVsCpu);

TEST_P(IndexVsCpu, KernelsMatchTheCpu) {
  // Integer cumsum and sort too (exact).
  const Tensor ints = ops::randint(-5, 5, {6, 300}, DType::int64, kCpu);
  EXPECT_TRUE(close_pointwise(ops::cumsum(to_gpu(ints), 1), ops::cumsum(ints, 1), 0.0));
  EXPECT_TRUE(close_pointwise(ops::sort(to_gpu(ints), 1).indices, ops::sort(ints, 1).indices, 0.0));
  for (DType d : {DType::float32, DType::float64, DType::float16, DType::bfloat16}) {
    for (bool nc : {false, true}) {
      const std::string what = std::string(dtype_name(d)) + (nc ? " noncontig" : "");
      const Pair x = both({37, 29}, d, 7, nc);
      const Tensor ic = ops::randint(0, 29, {37, 40}, DType::int64, kCpu);
      const Tensor ig = to_gpu(ic);
      EXPECT_TRUE(close_pointwise(ops::gather(x.gpu, 1, ig), ops::gather(x.cpu, 1, ic), 0.0))
          << what;
      const Tensor rc = ops::randint(0, 37, {50}, DType::int64, kCpu);
      EXPECT_TRUE(close_pointwise(ops::index_select(x.gpu, 0, to_gpu(rc)),
                                  ops::index_select(x.cpu, 0, rc), 0.0))
          << what;
      const Pair s = both({37, 40}, d, 8);
      const Tensor perm = ops::sort(ops::rand({37, 29}, DType::float32, kCpu), 1).indices;
      const Tensor pc = ops::contiguous(ops::narrow(perm, 1, 0, 20));
      const Tensor sc = ops::contiguous(ops::narrow(s.cpu, 1, 0, 20));
      EXPECT_TRUE(close_pointwise(ops::scatter(x.gpu, 1, to_gpu(pc), to_gpu(sc)),
                                  ops::scatter(x.cpu, 1, pc, sc), 0.0))
          << what;
      const double tol = pointwise_tol(d) * 10;
      EXPECT_TRUE(close_pointwise(ops::scatter_add(x.gpu, 1, ig, s.gpu),
                                  ops::scatter_add(x.cpu, 1, ic, s.cpu), tol))
          << what;
      const Pair src = both({50, 29}, d, 9);
      EXPECT_TRUE(close_pointwise(ops::index_add(x.gpu, 0, to_gpu(rc), src.gpu, 0.5),
                                  ops::index_add(x.cpu, 0, rc, src.cpu, 0.5), tol))
          << what;
      EXPECT_TRUE(close_pointwise(ops::cumsum(x.gpu, 0), ops::cumsum(x.cpu, 0), 0.0)) << what;
      EXPECT_TRUE(close_pointwise(ops::cumsum(x.gpu, 1, true), ops::cumsum(x.cpu, 1, true), 0.0))
          << what;
      for (bool desc : {false, true}) {
        const ValuesIndices g = ops::sort(x.gpu, 1, desc), c = ops::sort(x.cpu, 1, desc);
        EXPECT_TRUE(close_pointwise(g.values, c.values, 0.0)) << what;
        EXPECT_TRUE(close_pointwise(g.indices, c.indices, 0.0)) << what;
      }
      EXPECT_TRUE(
          close_pointwise(ops::topk(x.gpu, 5, 0).values, ops::topk(x.cpu, 5, 0).values, 0.0))
          << what;
      EXPECT_TRUE(close_pointwise(ops::flip(x.gpu, {0, 1}), ops::flip(x.cpu, {0, 1}), 0.0)) << what;
      EXPECT_TRUE(close_pointwise(ops::roll(x.gpu, {3, -30}, {0, 1}),
                                  ops::roll(x.cpu, {3, -30}, {0, 1}), 0.0))
          << what;
      const Tensor mc = ops::binary_scalar(ops::BinaryOp::gt, x.cpu, 0.0);
      const Tensor mg = to_gpu(mc);
      EXPECT_TRUE(
          close_pointwise(ops::masked_select(x.gpu, mg), ops::masked_select(x.cpu, mc), 0.0))
          << what;
      Tensor yc = ops::clone(x.cpu), yg = ops::clone(x.gpu);
      ops::masked_fill_(yc, mc, 3.0);
      ops::masked_fill_(yg, mg, 3.0);
      EXPECT_TRUE(close_pointwise(yg, yc, 0.0)) << what;
      const Pair many = both({37 * 29}, d, 10);
      ops::masked_scatter_(yc, ops::binary_scalar(ops::BinaryOp::lt, x.cpu, 0.0), many.cpu);
      ops::masked_scatter_(yg, ops::binary_scalar(ops::BinaryOp::lt, x.gpu, 0.0), many.gpu);
      EXPECT_TRUE(close_pointwise(yg, yc, 0.0)) << what;
    }
  }
}

// The row kernels: cumsum / cumprod along contiguous rows of 64 or more, and index_select /
// index_add / index_fill of rows of 64 or more elements (16-byte copies where rows allow).
TEST_P(IndexVsCpu, RowKernelsMatchTheCpu) {
  for (DType d : {DType::float32, DType::float64, DType::float16, DType::bfloat16}) {
    const std::string what = dtype_name(d);
    const double tol = pointwise_tol(d) * 10;
    const Pair x = both({6, 300}, d, 11);
    EXPECT_TRUE(close_pointwise(ops::cumsum(x.gpu, 1), ops::cumsum(x.cpu, 1), 1e-12)) << what;
    EXPECT_TRUE(close_pointwise(ops::cumsum(x.gpu, 1, true), ops::cumsum(x.cpu, 1, true), 1e-12))
        << what;
    const Pair p = both({6, 300}, d, 12, false, 0.9, 1.1);
    EXPECT_TRUE(close_pointwise(ops::cumprod(p.gpu, 1), ops::cumprod(p.cpu, 1), tol)) << what;
    for (int64_t inner : {96, 65}) {  // 16-byte copies, then element copies
      const Pair t = both({3, 20, inner}, d, 13);
      const Tensor rc = ops::randint(0, 20, {30}, DType::int64, kCpu);  // duplicates
      const Tensor rg = to_gpu(rc);
      EXPECT_TRUE(
          close_pointwise(ops::index_select(t.gpu, 1, rg), ops::index_select(t.cpu, 1, rc), 0.0))
          << what << " " << inner;
      const Pair src = both({3, 30, inner}, d, 14);
      EXPECT_TRUE(close_pointwise(ops::index_add(t.gpu, 1, rg, src.gpu, 0.5),
                                  ops::index_add(t.cpu, 1, rc, src.cpu, 0.5), tol))
          << what << " " << inner;
      EXPECT_TRUE(close_pointwise(ops::index_fill(t.gpu, 1, rg, -1.5),
                                  ops::index_fill(t.cpu, 1, rc, -1.5), 0.0))
          << what << " " << inner;
    }
  }
}

TEST_P(IndexVsCpu, ScatterReduceCumprodMatchTheCpu) {
  for (DType d : {DType::float32, DType::float64, DType::float16, DType::bfloat16}) {
    const std::string what = dtype_name(d);
    const Pair x = both({37, 29}, d, 7, true);
    const Pair s = both({37, 40}, d, 8, false, 0.5, 1.5);
    const Tensor ic = ops::randint(0, 29, {37, 40}, DType::int64, kCpu);  // duplicates
    const double tol = pointwise_tol(d) * 10;
    EXPECT_TRUE(close_pointwise(ops::scatter(x.gpu, 1, to_gpu(ic), s.gpu, "multiply"),
                                ops::scatter(x.cpu, 1, ic, s.cpu, "multiply"), tol))
        << what;
    const Tensor rc = ops::randint(0, 29, {7}, DType::int64, kCpu);
    EXPECT_TRUE(close_pointwise(ops::index_fill(x.gpu, 1, to_gpu(rc), 2.5),
                                ops::index_fill(x.cpu, 1, rc, 2.5), 0.0))
        << what;
    const Pair p = both({37, 29}, d, 9, true, 0.5, 1.5);
    EXPECT_TRUE(close_pointwise(ops::cumprod(p.gpu, 0), ops::cumprod(p.cpu, 0), tol)) << what;
    EXPECT_TRUE(close_pointwise(ops::cumprod(p.gpu, 1), ops::cumprod(p.cpu, 1), tol)) << what;
  }
  // Long rows take cub's radix sort: ties, NaN and -0/+0 must order as the CPU's stable sort.
  for (DType d : {DType::float32, DType::float16, DType::int64}) {
    Tensor big = ops::to(ops::randint(-20, 20, {3, 5000}, DType::int64, kCpu), d);
    if (d != DType::int64) {
      const Tensor special =
          from_vector({NAN, -0.0, 0.0, -NAN}, {4}, TensorOptions{}.with_dtype(d));
      ops::copy_(ops::narrow(ops::select(big, 0, 1), 0, 100, 4), special);
    }
    for (int64_t dim : {1, 0})
      for (bool desc : {false, true}) {
        const ValuesIndices g = ops::sort(to_gpu(big), dim, desc), c = ops::sort(big, dim, desc);
        EXPECT_TRUE(close_pointwise(g.values, c.values, 0.0)) << dtype_name(d) << " " << dim;
        EXPECT_TRUE(close_pointwise(g.indices, c.indices, 0.0)) << dtype_name(d) << " " << dim;
      }
  }
  const Tensor u8 = ops::randint(1, 4, {6, 50}, DType::uint8, kCpu);
  const Tensor ic = ops::randint(0, 6, {6, 50}, DType::int64, kCpu);
  EXPECT_TRUE(close_pointwise(ops::scatter(to_gpu(u8), 1, to_gpu(ic), to_gpu(u8), "multiply"),
                              ops::scatter(u8, 1, ic, u8, "multiply"), 0.0));
}

// A dry run replaying a GPU charges CUDA's radix sort of long rows its scratch (keys and
// positions twice over, the row offsets: tensor/index/meta.cpp) and notes cub's temporary
// storage, which it cannot size; rows of one block, and the CPU, take none.
TEST(IndexMeta, CudaSortOfLongRowsIsChargedItsScratch) {
  struct Seen {
    int64_t scratch_peak;
    size_t notes;
  };
  auto dry_sort = [](const std::string& target, int64_t n) {
    memory::DryRun dry({.target = target, .max_history = 0});
    const Device d = dry.device();
    const Tensor x = ops::empty({3, n}, DType::bfloat16, d);
    memory::reset_peak_memory_stats(d);
    (void)ops::sort(x, 1, false);
    return Seen{memory::get_allocator(d).stats().cat_bytes(memory::Category::workspace).peak,
                memory::unreplayed(d).size()};
  };
  const int64_t n = kCudaBlockSortMax + 1, total = 3 * n;
  const Seen long_rows = dry_sort("h200", n);
  const int64_t raw = 2 * total * 2 + 2 * total * 8 + 4 * 8;  // bf16 keys, int64 positions
  EXPECT_GE(long_rows.scratch_peak, raw);
  EXPECT_LT(long_rows.scratch_peak, raw + 3 * 512);  // each rounded up to the allocator's 512 B
  EXPECT_EQ(long_rows.notes, 1u);
  const Seen short_rows = dry_sort("h200", kCudaBlockSortMax);
  EXPECT_EQ(short_rows.scratch_peak, 0);
  EXPECT_EQ(short_rows.notes, 0u);
  const Seen cpu = dry_sort("cpu", n);
  EXPECT_EQ(cpu.scratch_peak, 0);
  EXPECT_EQ(cpu.notes, 0u);
}

}  // namespace
}  // namespace tally
