// Shape ops: cat, stack, split, chunk. Values, views that allocate nothing, dtype
// promotion, float64 gradient checks (non-contiguous inputs, unused pieces) and errors; every
// case runs on each device (tests/testing/devices.h): the CPU in test_shape, CUDA in
// test_shape_cuda.
#include <limits>
#include <string>

#include "memory/caching_allocator.h"
#include "tensor/shape/autograd.h"
#include "testing/devices.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using namespace testing;

// The cases run on every device; tensors are made on dev().
class ShapeOps : public OnDevice {
 protected:
  // start, start + 1, ... in `shape`, on dev().
  Tensor seq(double start, const Shape& shape, TensorOptions opts = {}) const {
    return ops::reshape(arange(start, start + static_cast<double>(shape_numel(shape)), 1, on(opts)),
                        shape);
  }
};
TALLY_ON_DEVICES(ShapeOps);

std::vector<int64_t> sizes_along(const TensorList& ts, int64_t d) {
  std::vector<int64_t> out;
  for (const Tensor& t : ts) out.push_back(t.size(d));
  return out;
}

TEST_P(ShapeOps, CatValues) {
  const Tensor a = seq(1, {2, 1, 2}), b = seq(11, {2, 2, 2}), c = seq(21, {2, 3, 2});
  const Tensor out = cat({a, b, c}, 1);
  EXPECT_EQ(out.sizes(), (Shape{2, 6, 2}));
  EXPECT_TRUE(values_near(out, {1, 2, 11, 12, 13, 14, 21, 22, 23, 24, 25, 26,
                                3, 4, 15, 16, 17, 18, 27, 28, 29, 30, 31, 32}));
  EXPECT_TRUE(values_near(cat({a, b, c}, -2), ops::to_vector(out)));
  EXPECT_TRUE(values_near(cat({seq(0, {1, 2}), seq(5, {2, 2})}), {0, 1, 5, 6, 7, 8}));
  EXPECT_TRUE(values_near(cat({seq(0, {2, 1}), seq(5, {2, 2})}, 1), {0, 5, 6, 1, 7, 8}));
  // Non-contiguous inputs are read through their layout.
  const Tensor t = ops::transpose(seq(0, {2, 3}), 0, 1);  // [[0,3],[1,4],[2,5]]
  EXPECT_TRUE(values_near(cat({t, t}, 1), {0, 3, 0, 3, 1, 4, 1, 4, 2, 5, 2, 5}));
  // A single tensor: a copy.
  const Tensor one = cat({a}, 0);
  EXPECT_FALSE(one.storage().is_same(a.storage()));
  EXPECT_TRUE(values_near(one, ops::to_vector(a)));
}

TEST_P(ShapeOps, CatPromotesDtypesAndSkipsLegacyEmpty) {
  const Tensor f = tensor({1.5, 2.5}, on({}));
  const Tensor d = tensor({3.25}, on(f64));
  const Tensor i = from_vector({4, 5}, {2}, on(i64));
  EXPECT_EQ(cat({f, d}).dtype(), DType::float64);
  EXPECT_TRUE(values_near(cat({f, d}), {1.5, 2.5, 3.25}));
  EXPECT_EQ(cat({i, f}).dtype(), DType::float32);
  EXPECT_TRUE(values_near(cat({i, f}), {4, 5, 1.5, 2.5}));
  EXPECT_EQ(cat({i, i}).dtype(), DType::int64);
  EXPECT_EQ(cat({f.to(DType::float16), f.to(DType::bfloat16)}).dtype(), DType::float32);
  // Shape [0] tensors are skipped among higher-rank ones, as in PyTorch.
  const Tensor m = seq(0, {2, 2});
  const Tensor e = zeros({0}, on({}));
  EXPECT_EQ(cat({e, m, e, m}, 1).sizes(), (Shape{2, 4}));
  EXPECT_EQ(cat({e, e}).sizes(), (Shape{0}));
  EXPECT_EQ(cat({zeros({2, 0}, on({})), m}, 1).sizes(), (Shape{2, 2}));
}

TEST_P(ShapeOps, StackValues) {
  const Tensor a = seq(0, {2, 2}), b = seq(10, {2, 2});
  const Tensor s0 = stack({a, b});
  EXPECT_EQ(s0.sizes(), (Shape{2, 2, 2}));
  EXPECT_TRUE(values_near(s0, {0, 1, 2, 3, 10, 11, 12, 13}));
  const Tensor s1 = stack({a, b}, 1);
  EXPECT_EQ(s1.sizes(), (Shape{2, 2, 2}));
  EXPECT_TRUE(values_near(s1, {0, 1, 10, 11, 2, 3, 12, 13}));
  const Tensor s2 = stack({a, b}, -1);
  EXPECT_EQ(s2.sizes(), (Shape{2, 2, 2}));
  EXPECT_TRUE(values_near(s2, {0, 10, 1, 11, 2, 12, 3, 13}));
  const Tensor scalars =
      stack({full({}, 1.0, on({})), full({}, 2.0, on({})), full({}, 3.0, on({}))});
  EXPECT_EQ(scalars.sizes(), (Shape{3}));
  EXPECT_TRUE(values_near(scalars, {1, 2, 3}));
}

TEST_P(ShapeOps, SplitAndChunkAreViews) {
  const Tensor x = seq(0, {3, 5}, f64).requires_grad_();
  const size_t before = memory::memory_allocated(dev());
  TensorList parts = split(x, 2, 1);
  TensorList sized = split(x, std::vector<int64_t>{1, 3, 1}, 1);
  TensorList chunks = chunk(x, 3, 1);
  TensorList rows = chunk(x, 2, 0);
  EXPECT_EQ(memory::memory_allocated(dev()), before);  // views: nothing allocated
  for (const TensorList* l : {&parts, &sized, &chunks, &rows})
    for (const Tensor& p : *l) {
      EXPECT_TRUE(p.storage().is_same(x.storage()));
      EXPECT_TRUE(p.requires_grad());
    }
  EXPECT_EQ(sizes_along(parts, 1), (std::vector<int64_t>{2, 2, 1}));
  EXPECT_EQ(sizes_along(sized, 1), (std::vector<int64_t>{1, 3, 1}));
  EXPECT_EQ(sizes_along(chunks, 1), (std::vector<int64_t>{2, 2, 1}));  // uneven last piece
  EXPECT_EQ(sizes_along(rows, 0), (std::vector<int64_t>{2, 1}));
  EXPECT_TRUE(values_near(parts[1], {2, 3, 7, 8, 12, 13}));
  EXPECT_TRUE(values_near(sized[1], {1, 2, 3, 6, 7, 8, 11, 12, 13}));
  EXPECT_TRUE(values_near(rows[1], {10, 11, 12, 13, 14}));
  // torch.chunk semantics: ceil(6 / 4) = 2 -> 3 pieces; split_size beyond the size -> one.
  EXPECT_EQ(chunk(seq(0, {6}), 4).size(), 3u);
  EXPECT_EQ(split(seq(0, {6}), 10).size(), 1u);
  EXPECT_EQ(chunk(seq(0, {5}), 5, -1).size(), 5u);
  // A dimension of size 0: chunk gives `chunks` empty views, split(0) one.
  const TensorList empty_chunks = chunk(zeros({0, 2}, on({})), 3);
  EXPECT_EQ(empty_chunks.size(), 3u);
  EXPECT_EQ(empty_chunks[2].sizes(), (Shape{0, 2}));
  EXPECT_EQ(split(zeros({0}, on({})), 0).size(), 1u);
  // Without grad the pieces are plain views.
  const TensorList plain = split(seq(0, {4}), 2);
  EXPECT_FALSE(plain[0].requires_grad());
}

TEST_P(ShapeOps, UnusedPiecesGetZeroGradient) {
  const Tensor x = ones({5}, on(f64_grad));
  const TensorList p = chunk(x, 3);
  mul(p[2], 3.0).sum().backward();
  EXPECT_TRUE(values_near(x.grad(), {0, 0, 0, 0, 3}));
  x.set_grad(Tensor());
  const TensorList q = split(x, std::vector<int64_t>{2, 3});
  (q[0].sum() + mul(q[1], 2.0).sum()).backward();
  EXPECT_TRUE(values_near(x.grad(), {1, 1, 2, 2, 2}));
}

TEST_P(ShapeOps, CatAndStackGradientsComeBackInEachDtype) {
  const Tensor a = ones({2}, on(TensorOptions{}.with_requires_grad()));  // float32
  const Tensor b = ones({3}, on(f64_grad));                              // float64
  const Tensor c = from_vector({7}, {1}, on(i64));                       // no grad
  const Tensor out = cat({a, c, b});
  EXPECT_EQ(out.dtype(), DType::float64);
  out.backward(from_vector({1, 2, 3, 4, 5, 6}, {6}, on(f64)));
  EXPECT_EQ(a.grad().dtype(), DType::float32);
  EXPECT_TRUE(values_near(a.grad(), {1, 2}));
  EXPECT_TRUE(values_near(b.grad(), {4, 5, 6}));
  const Tensor e = zeros({0}, on(f64_grad));
  const Tensor m = ones({2, 2}, on(f64_grad));
  cat({e, m}, 1).sum().backward();
  EXPECT_EQ(e.grad().sizes(), (Shape{0}));
  EXPECT_TRUE(values_near(m.grad(), {1, 1, 1, 1}));
  const Tensor s = ones({2}, on(TensorOptions{}.with_requires_grad()));
  stack({s, s.to(DType::float64)}, 1).backward(from_vector({1, 2, 3, 4}, {2, 2}, on(f64)));
  EXPECT_EQ(s.grad().dtype(), DType::float32);
  EXPECT_TRUE(values_near(s.grad(), {3, 7}));
}

TEST_P(ShapeOps, Gradients) {
  // cat of 3 tensors along a middle dim, one non-contiguous.
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& x) {
                             return cat({x[0], x[1], x[2]}, 1);
                           },
                           {rand_input({2, 1, 3}, -1, 1, 1), rand_input_noncontig({2, 2, 3}, 2),
                            rand_input({2, 3, 3}, -1, 1, 3)}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& x) {
                             return cat({x[0], x[1]}, -1);
                           },
                           {rand_input_noncontig({3, 2}, 4), rand_input({3, 4}, -1, 1, 5)}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& x) {
                             return stack({x[0], x[1], x[2]}, 1);
                           },
                           {rand_input({2, 3}, -1, 1, 6), rand_input_noncontig({2, 3}, 7),
                            rand_input({2, 3}, -1, 1, 8)}));
  // split / chunk: pieces combined unevenly, one piece unused (its gradient is zero).
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& x) {
                             const TensorList p = split(x[0], 2, 1);  // [3,2], [3,2], [3,1]
                             return add(mul(p[0], p[2]), p[1]);
                           },
                           {rand_input({3, 5}, -1, 1, 9)}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& x) {
                             const TensorList p = split(x[0], 2, 1);
                             return mul(p[0], p[2]);  // p[1] unused
                           },
                           {rand_input_noncontig({3, 5}, 10)}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& x) {
                             const TensorList p =
                                 chunk(x[0], 3, 0);  // uneven: 3, 3, 1 rows of [7, 2]
                             return add(mul(p[1], 2.0), p[2]);
                           },
                           {rand_input({7, 2}, -1, 1, 11)}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& x) {
                             const TensorList p = split(x[0], std::vector<int64_t>{1, 3, 1}, -1);
                             return add(exp(p[1]), mul(p[0], p[2]));
                           },
                           {rand_input({2, 5}, -1, 1, 12)}));
}

TEST_P(ShapeOps, Errors) {
  const Tensor a = zeros({2, 3}, on({})), b = zeros({2, 4}, on({}));
  expect_error<std::invalid_argument>([&] { (void)cat({}, 0); },
                                      {"cat: expected a non-empty list of tensors"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)cat({a, b}, 0);
      },
      {"cat: sizes of tensors must match except in dimension 0: tensor 1 has shape [2, 4] but "
       "tensor 0 has shape [2, 3]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)cat({a, zeros({2, 3, 1}, on({}))}, 1);
      },
      {"tensor 1 has shape [2, 3, 1]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)cat({zeros({}, on({})), zeros({}, on({}))});
      },
      {"cat: zero-dimensional tensor (at position 0) cannot be concatenated"});
  expect_error<std::out_of_range>(
      [&] {
        (void)cat({a, a}, 2);
      },
      {"cat: dimension 2 out of range for a 2-D tensor"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)stack({a, b});
      },
      {"stack: expects each tensor to be equal size, but got [2, 3] at entry 0 and [2, 4] at entry "
       "1"});
  expect_error<std::out_of_range>(
      [&] {
        (void)stack({a, a}, 3);
      },
      {"stack: dimension 3 out of range"});
  expect_error<std::invalid_argument>([&] { (void)stack({}); },
                                      {"stack: expected a non-empty list"});
  expect_error<std::invalid_argument>([&] { (void)split(a, 0, 1); },
                                      {"split: split_size must be positive"});
  expect_error<std::invalid_argument>([&] { (void)split(a, -1, 1); },
                                      {"got -1 for dimension 1 of shape [2, 3]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)split(a, std::vector<int64_t>{1, 1}, 1);
      },
      {"split: split sizes [1, 1] sum to 2 but dimension 1 of shape [2, 3] has size 3"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)split(a, std::vector<int64_t>{4, -1}, 1);
      },
      {"split: split sizes must be non-negative"});
  expect_error<std::invalid_argument>([&] { (void)split(zeros({}, on({})), 1); },
                                      {"split: cannot split a 0-D tensor"});
  expect_error<std::out_of_range>([&] { (void)split(a, 1, 2); },
                                  {"split: dimension 2 out of range"});
  expect_error<std::invalid_argument>([&] { (void)chunk(a, 0); },
                                      {"chunk: number of chunks must be greater than 0, got 0"});
  expect_error<std::out_of_range>([&] { (void)chunk(a, 2, -3); },
                                  {"chunk: dimension -3 out of range"});
  // Sizes that sum past 2^63 are an error, not a wrapped sum.
  const int64_t half = int64_t{1} << 62;
  expect_error<std::invalid_argument>(
      [&] {
        (void)split(a, std::vector<int64_t>{half, half, 3}, 1);
      },
      {"split: split sizes [4611686018427387904, 4611686018427387904, 3] sum past 2^63 but "
       "dimension 1 of shape [2, 3] has size 3"});
}

// More pieces than the host can hold are refused before any is made: an empty dimension in
// 2^40 chunks, an expanded one of 2^50 elements split by 1. Counts near 2^63 do not overflow.
TEST_P(ShapeOps, PiecesBeyondTheHostsMemoryAreRefused) {
  const int64_t many = int64_t{1} << 40;
  expect_error<memory::OutOfMemoryError>(
      [&] {
        (void)chunk(zeros({2, 0}, on({})), many, 1);
      },
      {"chunk: dimension 1 of shape [2, 0] would give 1099511627776 tensors, 393216.00 GiB of "
       "views, "
       "and the system can give"});
  const Tensor huge = ones({1}, on({})).expand({int64_t{1} << 50});
  expect_error<memory::OutOfMemoryError>(
      [&] { (void)split(huge, 1); },
      {"split: dimension 0 of shape [1125899906842624] would give 1125899906842624 tensors"});
  const int64_t top = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(chunk(seq(0, {5}), top).size(), 5u);  // ceil(5 / 2^63-1) = 1 per piece
  EXPECT_EQ(split(huge, top).size(), 1u);
  EXPECT_EQ(split(huge, (int64_t{1} << 50) - 1).size(), 2u);
  EXPECT_EQ(chunk(zeros({0}, on({})), 1 << 16).size(), size_t{1} << 16);  // below the check
}

}  // namespace
}  // namespace tally
