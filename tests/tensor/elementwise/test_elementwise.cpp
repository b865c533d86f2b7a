// Elementwise ops, activations, dropout, reductions, views, printing and random numbers,
// one file for every device (tests/testing/devices.h): test_elementwise runs the OnDevice
// suites on the CPU, test_elementwise_cuda runs them on CUDA device 0 (hand-computed values,
// float64 gradient checks with broadcasting and non-contiguous inputs, dtype promotion and
// rounding, size-overflow errors, views that never allocate) and adds the VsCpu suite
// ElementwiseVsCpu: the CUDA kernels against the CPU reference over random inputs, dtypes and
// layouts (copies and casts, the vectorised cast path, binary/unary maps, 16-bit GELU on every
// input, sums and their column/full fast paths, gradients through a small graph on the device's
// allocator).
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "autograd/autocast.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace testing;

// ------------------------------------------------------------------ on every device

// The OnDevice suites (Printing, below, has a helper of its own).
class Elementwise : public OnDevice {};
TALLY_ON_DEVICES(Elementwise);
class Activations : public OnDevice {};
TALLY_ON_DEVICES(Activations);
class Reductions : public OnDevice {};
TALLY_ON_DEVICES(Reductions);
class Views : public OnDevice {};
TALLY_ON_DEVICES(Views);
class Random : public OnDevice {};
TALLY_ON_DEVICES(Random);

TEST_P(Elementwise, BroadcastValues) {
  const Tensor a = put(from_vector({1, 2, 3, 4, 5, 6}, {2, 3}));
  const Tensor b = put(from_vector({10, 20, 30}, {3}));
  EXPECT_TRUE(values_near(a + b, {11, 22, 33, 14, 25, 36}));
  EXPECT_TRUE(values_near(a * b, {10, 40, 90, 40, 100, 180}));
  EXPECT_TRUE(values_near(b - a, {9, 18, 27, 6, 15, 24}));
  EXPECT_TRUE(values_near(a / 2.0, {0.5, 1, 1.5, 2, 2.5, 3}));
  EXPECT_TRUE(values_near(2.0 - a, {1, 0, -1, -2, -3, -4}));
  EXPECT_TRUE(values_near(pow(a, 2.0), {1, 4, 9, 16, 25, 36}));
  EXPECT_TRUE(values_near(clamp(a, 2.0, 4.5), {2, 2, 3, 4, 4.5, 4.5}));
  EXPECT_TRUE(values_near(relu(put(from_vector({-1, 0, 2}, {3}))), {0, 0, 2}));
  EXPECT_TRUE(values_near(add_relu(a, put(from_vector({-2, -5, 0}, {3}))), {0, 0, 3, 2, 0, 6}));
  const Tensor one = put(from_vector({1.0}, {1}));
  EXPECT_TRUE(values_near(gelu(one), {0.8413447460685429}, 1e-6));
  EXPECT_TRUE(values_near(gelu(one, "tanh"), {0.8411919906082768}, 1e-6));
  EXPECT_TRUE(values_near(sigmoid(put(from_vector({0.0}, {1}))), {0.5}));
  const Tensor m = put(from_vector({1, 0, 1}, {3}, TensorOptions{}.with_dtype(DType::bool_)));
  EXPECT_TRUE(values_near(masked_fill(a, m, -1), {-1, 2, -1, -1, 5, -1}));
  EXPECT_TRUE(values_near(where(m, a, b), {1, 20, 3, 4, 20, 6}));
  EXPECT_TRUE(values_near(sum(a, {0}), {5, 7, 9}));
  EXPECT_TRUE(values_near(sum(a, {1}, true), {6, 15}));
  EXPECT_EQ(sum(a, {1}, true).sizes(), (Shape{2, 1}));
  EXPECT_TRUE(values_near(mean(a), {3.5}));
  EXPECT_TRUE(values_near(eq(a, put(from_vector({1, 0, 3}, {3}))), {1, 0, 1, 0, 0, 0}));
}

TEST_P(Elementwise, ShapeErrorsNameTheOp) {
  const Tensor a = zeros({2, 3}, on({})), b = zeros({4}, on({}));
  expect_error<std::invalid_argument>([&] { (void)(a + b); }, {"add: shapes [2, 3] and [4]"});
}

// Sizes that overflow are errors naming the shape, never a tensor with a wrapped element
// count (issue 22: zeros({2^32, 2^32}) used to "succeed" with 0 elements). Each case: what
// throws std::length_error, and the parts its message must contain.
TEST_P(Elementwise, FactorySizesThatOverflowAreErrors) {
  const int64_t g = int64_t{1} << 32;
  float buf[4] = {};
  const Tensor one = zeros({1, 1}, on({})), empty = zeros({0}, on({}));
  const std::pair<std::function<void()>, std::vector<std::string>> length_errors[] = {
      {[&] {
         (void)zeros({g, g}, on({}));
       },
       {"shape [4294967296, 4294967296] has more than 2^63 - 1"}},
      {[&] {
         (void)ops::zeros({g, g}, DType::bool_, dev());
       },
       {"[4294967296, 4294967296]"}},
      {[&] {
         (void)shape_numel({g, g});
       },
       {"numel: shape [4294967296, 4294967296]"}},
      {[&] {
         (void)shape_numel({g, g, 0});
       },
       {"[4294967296, 4294967296, 0]"}},
      // 2^64 - 2^20 bytes: fits in 64 bits, not in 63; never reaches the allocator's rounding.
      {[&] { (void)ops::empty({(int64_t{1} << 62) - (int64_t{1} << 18)}, DType::float32, dev()); },
       {"empty: a tensor of shape [4611686018427125760] with 4-byte elements is larger than "
        "2^63 - 1 bytes"}},
      // Host memory Tally does not own, whatever the device under test.
      {[&] {
         (void)ops::from_blob(buf, {g, g});
       },
       {"from_blob", "[4294967296, 4294967296]"}},
      // A view whose element count does not fit (a scalar expanded to 2^64 elements).
      {[&] {
         (void)ops::expand(one, {g, g});
       },
       {"[4294967296, 4294967296]"}},
      // view/reshape of an empty tensor to a shape whose other dimensions wrap to 0.
      {[&] {
         (void)ops::view(empty, {g, g, 0});
       },
       {"view: shape [4294967296, 4294967296, 0] has more than"}},
      {[&] {
         (void)ops::reshape(empty, {-1, g, g});
       },
       {"reshape: shape [-1, 4294967296, 4294967296]"}},
  };
  for (const auto& [make, parts] : length_errors) {
    const std::string msg = error_of<std::length_error>(make);
    for (const std::string& part : parts) EXPECT_TRUE(contains(msg, part)) << msg;
  }
  EXPECT_EQ(shape_numel({g, 0}), 0);
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::empty({3, -2}, DType::float32, dev());
      },
      {"empty: negative dimension in shape [3, -2]"});
  // A layout whose extent wraps used to pass the bounds check: 2^62 + 2^62 elements.
  expect_error<std::overflow_error>(
      [&] {
        (void)Tensor::make(Storage::borrow(buf, sizeof(buf), Device::cpu()), {2, 2},
                           {int64_t{1} << 62, int64_t{1} << 62}, 0, DType::float32);
      },
      {"Tensor::make: the extent of the layout"});
}

// add_ and mul_ with a scalar: in place, one kernel, the version bumped; an integer tensor
// takes integral scalars only, a bool tensor none.
TEST_P(Elementwise, InPlaceScalarAddAndMul) {
  const Tensor i = put(from_vector({1, 2, 3}, {3}, TensorOptions{}.with_dtype(DType::int64)));
  const Tensor f = put(from_vector({0.5, -1.5}, {2}));
  const uint64_t vi = i.storage().version(), vf = f.storage().version();
  ops::add_(i, 1.0);
  ops::add_(i, -3.0);
  ops::mul_(i, 2.0);
  ops::add_(f, 0.25);
  ops::mul_(f, -2.0);
  EXPECT_EQ(i.dtype(), DType::int64);
  EXPECT_TRUE(values_near(i, {-2, 0, 2}, 0));
  EXPECT_TRUE(values_near(f, {-1.5, 2.5}, 0));
  EXPECT_EQ(i.storage().version(), vi + 3);
  EXPECT_EQ(f.storage().version(), vf + 2);
  std::string m = error_of<std::invalid_argument>([&] { ops::add_(i, 0.5); });
  EXPECT_TRUE(contains(m,
                       "add_: the scalar 0.5 cannot be applied in place to a int64 tensor of "
                       "shape [3]"))
      << m;
  m = error_of<std::invalid_argument>([&] { ops::mul_(i, 1.5); });
  EXPECT_TRUE(contains(m, "mul_: the scalar 1.5")) << m;
  const Tensor b = put(from_vector({1, 0}, {2}, TensorOptions{}.with_dtype(DType::bool_)));
  m = error_of<std::invalid_argument>([&] { ops::add_(b, 1.0); });
  EXPECT_TRUE(contains(m, "add_: the scalar 1 cannot be applied in place to a bool")) << m;
  EXPECT_TRUE(values_near(i, {-2, 0, 2}, 0));  // the refused calls changed nothing
  EXPECT_EQ(i.storage().version(), vi + 3);
}

// PyTorch's assert_no_internal_overlap: an expanded destination (stride 0 over a size > 1) is
// refused by every in-place write, before any work (a [2^62] expansion of one element would
// otherwise loop for hours); size-1 and empty expansions are still writable.
TEST_P(Elementwise, InPlaceWritesRefuseExpandedDestinations) {
  const Tensor one = put(from_vector({5}, {1}));
  const Tensor wide = ops::expand(one, {int64_t{1} << 62});
  const Tensor grid = ops::expand(put(from_vector({1, 2}, {2, 1})), {2, 3});
  const Tensor src = put(from_vector({1, 2, 3, 4, 5, 6}, {2, 3}));
  const uint64_t v = one.storage().version();
  const std::vector<std::pair<std::string, std::function<void()>>> writes = {
      {"fill_", [&] { ops::fill_(wide, 1.0); }},
      {"copy_", [&] { ops::copy_(grid, src); }},
      {"add_", [&] { ops::add_(grid, src); }},
      {"add_", [&] { ops::add_(wide, 1.0); }},
      {"mul_", [&] { ops::mul_(grid, 2.0); }},
      {"_foreach_copy_", [&] { ops::foreach_copy_({grid}, {src}); }},
  };
  for (const auto& [op, write] : writes) {
    const std::string m = error_of<std::invalid_argument>(write);
    EXPECT_TRUE(contains(m, op + ": the written-to tensor of shape")) << m;
    EXPECT_TRUE(contains(m, "more than one element at a single memory location")) << m;
  }
  const std::string m = error_of<std::invalid_argument>([&] { ops::copy_(grid, src); });
  EXPECT_TRUE(contains(m, "shape [2, 3]") && contains(m, "dimension 1 has stride 0")) << m;
  EXPECT_EQ(one.storage().version(), v);  // nothing was written
  EXPECT_TRUE(values_near(one, {5}, 0));
  // A size-1 expansion and an empty one hold no two elements at one place.
  const Tensor same = ops::expand(put(from_vector({7}, {1, 1})), {1, 1});
  ops::fill_(same, 3.0);
  EXPECT_TRUE(values_near(same, {3}, 0));
  ops::fill_(ops::expand(put(from_vector({7}, {1})), {0}), 3.0);
}

TEST_P(Elementwise, DtypesPromoteAndConvert) {
  const Tensor i = put(from_vector({1, 2, 3}, {3}, TensorOptions{}.with_dtype(DType::int64)));
  const Tensor f = put(from_vector({0.5, 0.5, 0.5}, {3}));
  EXPECT_EQ((i + f).dtype(), DType::float32);
  EXPECT_EQ((i + i).dtype(), DType::int64);
  EXPECT_EQ(div(i, i).dtype(), DType::float32);
  for (DType d : {DType::float16, DType::bfloat16, DType::float64, DType::int32}) {
    const Tensor t = f.to(d);
    EXPECT_EQ(t.dtype(), d);
    EXPECT_EQ(t.device(), dev());
    EXPECT_TRUE(values_near(t.to(DType::float32), d == DType::int32
                                                      ? std::vector<double>{0, 0, 0}
                                                      : std::vector<double>{0.5, 0.5, 0.5}));
  }
  // float16 rounding: 1/3 -> 0.333251953125, 65520 -> inf, 1e-7 -> 1.1920928955078125e-07
  const Tensor h = put(from_vector({1.0 / 3.0, 65520.0, 1e-7, -2.5}, {4})).to(DType::float16);
  EXPECT_TRUE(values_near(h, {0.333251953125, INFINITY, 1.1920928955078125e-07, -2.5}, 1e-12));
  const Tensor bf = put(from_vector({1.0 / 3.0, 3e38}, {2})).to(DType::bfloat16);
  EXPECT_TRUE(values_near(bf, {0.333984375, 1.765625 * std::ldexp(1.0, 127)}, 1e30));
}

// ops::foreach_copy_ (torch._foreach_copy_) is one copy_ per pair, to the bit: float32 ->
// bfloat16 and float16 -> float32 over more pairs than one CUDA launch takes (80), sizes with
// and without a tail of 8 and past one block's chunk, a misaligned view and a transposed
// source (copied alone); and its errors, raised before anything is written.
TEST_P(Elementwise, ForeachCopyIsOneCopyEach) {
  const std::vector<int64_t> sizes = {1, 7, 8, 9, 1000, 8192, 8199, 40000};
  for (auto [from, to] :
       {std::pair{DType::float32, DType::bfloat16}, std::pair{DType::float16, DType::float32}}) {
    SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + dtype_name(to));
    TensorList srcs, dsts;
    for (int i = 0; i < 90; ++i) {
      const int64_t n = sizes[static_cast<size_t>(i) % sizes.size()];
      srcs.push_back(
          put(ops::to(rand_input({n}, -300, 300, 100 + static_cast<uint64_t>(i)), from)));
    }
    const Tensor base = put(ops::to(rand_input({2, 1001}, -3, 3, 7), from));
    srcs.push_back(ops::narrow(ops::reshape(base, {2002}), 0, 1, 2000));  // misaligned
    srcs.push_back(
        ops::transpose(ops::reshape(ops::narrow(ops::reshape(base, {2002}), 0, 0, 2000), {40, 50}),
                       0, 1));  // not contiguous
    for (const Tensor& t : srcs) dsts.push_back(ops::empty(t.sizes(), to, dev()));
    ops::foreach_copy_(dsts, srcs);
    for (size_t i = 0; i < srcs.size(); ++i) {
      EXPECT_EQ(ops::to_vector(dsts[i]), ops::to_vector(ops::to(srcs[i], to))) << "pair " << i;
      EXPECT_EQ(dsts[i].storage().version(), 1u) << "pair " << i;
    }
  }
  const Tensor a = put(ops::to(rand_input({4}), DType::float32));
  const Tensor b = ops::empty({4}, DType::bfloat16, dev()),
               c = ops::empty({5}, DType::bfloat16, dev());
  expect_error<std::invalid_argument>(
      [&] {
        ops::foreach_copy_({b}, {a, a});
      },
      {"_foreach_copy_: 1 destinations for 2 sources"});
  expect_error<std::invalid_argument>(
      [&] {
        ops::foreach_copy_({b, c}, {a, a});
      },
      {"_foreach_copy_: pair 1: destination [5] and source [4]"});
  expect_error<std::invalid_argument>(
      [&] {
        ops::foreach_copy_({b, ops::empty({4}, DType::float16, dev())}, {a, a});
      },
      {"_foreach_copy_: pair 1: destination float16 and source float32, expected bfloat16"});
  expect_error<std::invalid_argument>(
      [&] {
        ops::foreach_copy_({b, a}, {a, a});
      },
      {"_foreach_copy_"});
  expect_error<std::invalid_argument>([&] { ops::foreach_copy_({b}, {Tensor()}); },
                                      {"_foreach_copy_: pair 0 has an undefined tensor"});
  EXPECT_EQ(b.storage().version(), 0u);
}

// A float32 operand and a 16-bit one (an autocast branch added to a float32 residual): add,
// sub and mul read the 16-bit operand widened in the kernel, to the bit what converting it
// first gives: either order, the vectorised path with a tail (1003 elements), a misaligned
// view and a broadcast operand (the strided paths), an output donated by a temporary, and
// gradients in each operand's dtype.
TEST_P(Elementwise, SixteenBitOperandBesideFloat32IsWidenedExactly) {
  using ops::BinaryOp;
  const auto same = [](const Tensor& got, const Tensor& want) {
    return got.dtype() == want.dtype() && got.sizes() == want.sizes() &&
           ops::to_vector(got) == ops::to_vector(want);
  };
  const Tensor a = put(rand_tensor({3, 1003}, DType::float32, 11));
  for (DType d : {DType::bfloat16, DType::float16}) {
    const Tensor h = put(rand_tensor({3, 1003}, d, 12)), row = put(rand_tensor({1003}, d, 13));
    const Tensor h32 = ops::to(h, DType::float32), row32 = ops::to(row, DType::float32);
    for (auto op : {BinaryOp::add, BinaryOp::sub, BinaryOp::mul}) {
      const std::string name = std::string(dtype_name(d)) + " " + ops::binary_op_name(op);
      EXPECT_TRUE(same(ops::binary(op, a, h), ops::binary(op, a, h32))) << name;
      EXPECT_TRUE(same(ops::binary(op, h, a), ops::binary(op, h32, a))) << name << " (reversed)";
      EXPECT_TRUE(same(ops::binary(op, a, row), ops::binary(op, a, row32))) << name << " (row)";
      const Tensor an = ops::narrow(a, 1, 1, 1002), hn = ops::narrow(h, 1, 1, 1002);
      EXPECT_TRUE(same(ops::binary(op, an, hn), ops::binary(op, an, ops::to(hn, DType::float32))))
          << name << " (misaligned)";
      Tensor temp = ops::mul(a, 2.0);
      const Tensor want = ops::binary(op, temp, h32);
      EXPECT_TRUE(same(ops::binary_over(op, std::move(temp), h), want)) << name << " (donated)";
    }
  }
  const Tensor x = put(rand_tensor({4, 5}, DType::float32, 14)).requires_grad_(true);
  const Tensor y = put(rand_tensor({4, 5}, DType::bfloat16, 15)).requires_grad_(true);
  sum(mul(add(x, y), x)).backward();
  EXPECT_EQ(x.grad().dtype(), DType::float32);
  EXPECT_EQ(y.grad().dtype(), DType::bfloat16);
  EXPECT_TRUE(values_near(y.grad(), ops::to_vector(x), 1e-2));
}

TEST_P(Elementwise, Gradients) {
  const Tensor a = rand_input({2, 3}, -1, 1, 1);
  const Tensor b = rand_input({3}, 0.5, 2, 2);  // broadcast
  const Tensor c = rand_input_noncontig({2, 3}, 3);
  const Tensor pos = rand_input({2, 3}, 0.5, 2, 4);
  const Device d = dev();
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return add(x[0], x[1], 2.0); }, {a, b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return sub(x[0], x[1]); }, {c, b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return mul(x[0], x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return div(x[0], x[1]); }, {c, b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return pow(x[0], 3.0); }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return pow(x[0], x[1]); }, {pos, b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return neg(exp(x[0])); }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return log(x[0]); }, {pos}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return sqrt(x[0]); }, {pos}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return rsqrt(x[0]); }, {pos}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return abs(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return square(x[0]) / 3.0; }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return maximum(x[0], x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return minimum(x[0], x[1]); }, {c, b}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return clamp(x[0], -0.3, 0.4); }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return where(gt(x[0], x[1]), x[0], x[1]); },
                           {a, b}));
  EXPECT_TRUE(gradcheck_on(
      d, [](const TensorList& x) { return masked_fill(x[0], gt(x[0], zeros_like(x[0])), 1.0); },
      {a}));
  EXPECT_TRUE(
      gradcheck_on(d, [](const TensorList& x) { return 1.0 / x[0] + 2.0 * x[0] - 1.0; }, {pos}));
}

TEST_P(Activations, Gradients) {
  const Tensor a = rand_input({3, 4}, -2, 2, 5);
  const Tensor c = rand_input_noncontig({3, 4}, 6);
  const Device d = dev();
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return relu(x[0]); }, {a}));
  // add_relu, broadcasting its second operand, against add then relu.
  const Tensor r = rand_input({4}, -2, 2, 7);
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return add_relu(x[0], x[1]); }, {a, r}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return add_relu(x[0], x[1]); }, {c, a}));
  // Written over a dying intermediate (donated), the gradients still reach what made it.
  EXPECT_TRUE(
      gradcheck_on(d, [](const TensorList& x) { return add_relu(x[0] * x[1], x[1]); }, {a, c}));
  EXPECT_TRUE(
      gradcheck_on(d, [](const TensorList& x) { return add_relu(exp(x[0]) - 1.5, x[1]); }, {a, r}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return gelu(x[0]); }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return gelu(x[0], "tanh"); }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return silu(x[0]); }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return sigmoid(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return tanh(x[0]); }, {c}));
  // silu_mul (SwiGLU's gate times up) in one pass: its value is silu then mul's, and its
  // gradients reach both operands, broadcast or strided.
  EXPECT_TRUE(values_near(silu_mul(a, c), ops::to_vector(mul(silu(a), c)), 1e-12));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return silu_mul(x[0], x[1]); }, {a, c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return silu_mul(x[0], x[1]); }, {c, r}));
}

TEST_P(Activations, DropoutMasksAndScales) {
  manual_seed(7);
  const Tensor x = ones({1000}, on(f64_grad));
  const Tensor y = dropout(x, 0.3);
  EXPECT_EQ(y.device(), dev());
  const std::vector<double> v = y.tolist();
  int zeros_n = 0;
  for (double e : v) {
    EXPECT_TRUE(e == 0.0 || std::abs(e - 1.0 / 0.7) < 1e-12);
    zeros_n += e == 0.0;
  }
  EXPECT_GT(zeros_n, 230);
  EXPECT_LT(zeros_n, 370);
  y.sum().backward();
  EXPECT_TRUE(values_near(x.grad(), v, 1e-12));  // same mask in backward
  EXPECT_TRUE(values_near(dropout(x, 0.3, /*train=*/false), std::vector<double>(1000, 1.0)));
  // The same seed gives the same mask.
  manual_seed(7);
  EXPECT_TRUE(values_near(dropout(x, 0.3), v, 0));
}

TEST_P(Reductions, Gradients) {
  const Tensor a = rand_input({2, 3, 4}, -1, 1, 7);
  const Tensor c = rand_input_noncontig({2, 3, 4}, 8);
  const Device d = dev();
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return sum(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return sum(x[0], {1}); }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return sum(x[0], {0, 2}, true); }, {a}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return mean(x[0], {-1}); }, {c}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& x) { return mean(x[0]); }, {a}));
}

// sum's dtype (torch.sum(x, dims, dtype=)): a 16-bit input summed straight into float32
// equals the sum of its float32 copy; integral sides cast the input first, as PyTorch; the
// gradient comes back in the input's dtype; autocast sums a 16-bit input into float32 the
// same way (fp32_set_opt_dtype) with no float32 copy of the input.
// Many outputs of a few elements each (an expand's backward, as grouped-query attention's key
// heads): CUDA's thread-per-output path, against the CPU in float64.
TEST_P(Reductions, SumManyOutputsFewElements) {
  const Device d = dev();
  const Tensor x64 = rand_tensor({2, 8, 4, 64, 64}, DType::float64, 33);
  for (DType dt : {DType::float32, DType::bfloat16}) {
    const Tensor x = ops::to(x64, d, dt);
    const Tensor ref = ops::sum(ops::to(x, Device::cpu(), DType::float64), {2}, true);
    const Tensor got = ops::sum(x, {2}, true);
    EXPECT_EQ(got.sizes(), (Shape{2, 8, 1, 64, 64}));
    EXPECT_LT(max_pointwise_error_lenient(ops::to(got, DType::float64), ref),
              dt == DType::float32 ? 1e-6 : 1e-2)
        << dtype_name(dt);
    // A transposed view: the kept dims strided.
    const Tensor xt = x.transpose(3, 4);
    const Tensor ref2 = ops::sum(ops::to(xt, Device::cpu(), DType::float64), {2}, false);
    EXPECT_LT(max_pointwise_error_lenient(ops::to(ops::sum(xt, {2}), DType::float64), ref2),
              dt == DType::float32 ? 1e-6 : 1e-2)
        << dtype_name(dt) << " transposed";
  }
}

TEST_P(Reductions, SumDtype) {
  const Device d = dev();
  for (DType in : {DType::bfloat16, DType::float16}) {
    const Tensor x = ops::to(rand_tensor({6, 40, 24}, DType::float32, 31), d, in);
    const Tensor wide = ops::to(x, DType::float32);
    for (const Shape& dims : std::vector<Shape>{{0, 1}, {2}, {}}) {
      const Tensor got = ops::sum(x, dims, false, DType::float32);
      EXPECT_EQ(got.dtype(), DType::float32);
      EXPECT_LT(max_pointwise_error_lenient(got, ops::sum(wide, dims)), 1e-6)
          << dtype_name(in) << " dims " << shape_str(dims);
    }
    const Tensor keep = ops::sum(x, {1}, true, DType::float64);
    EXPECT_EQ(keep.dtype(), DType::float64);
    EXPECT_EQ(keep.sizes(), (Shape{6, 1, 24}));
  }
  const Tensor i = ops::to(ops::randint(-50, 50, {5, 7}), d, DType::int64);
  const Tensor fi = ops::sum(i, {1}, false, DType::float32);
  EXPECT_EQ(fi.dtype(), DType::float32);
  EXPECT_EQ(max_pointwise_error_lenient(fi, ops::sum(i, {1})), 0.0);
  const Tensor f = ops::to(ops::full({4}, 2.75, DType::float32, Device::cpu()), d, DType::float32);
  const Tensor i32 = ops::sum(f, {}, false, DType::int32);  // the input cast first: 4 x 2
  EXPECT_EQ(i32.dtype(), DType::int32);
  EXPECT_EQ(ops::item(i32), 8.0);
  // Autograd: the result in dtype, the gradient in the input's.
  Tensor xb = ops::to(rand_tensor({3, 5}, DType::float32, 32), d, DType::bfloat16);
  xb.requires_grad_();
  const Tensor s = sum(xb, {0}, false, DType::float32);
  EXPECT_EQ(s.dtype(), DType::float32);
  sum(mul(s, 2.0)).backward();
  ASSERT_TRUE(xb.grad().defined());
  EXPECT_EQ(xb.grad().dtype(), DType::bfloat16);
  EXPECT_TRUE(values_near(xb.grad(), std::vector<double>(15, 2.0), 0));
  // Autocast: float32 out, no float32 copy of the input made (only the [5] result).
  {
    AutocastGuard guard(d.type, DType::bfloat16);
    const size_t before = memory::memory_allocated(d);
    const Tensor big = ops::to(rand_tensor({64, 512}, DType::float32, 33), d, DType::bfloat16);
    const size_t with_input = memory::memory_allocated(d);
    const Tensor r = sum(big, {0});
    EXPECT_EQ(r.dtype(), DType::float32);
    EXPECT_LT(memory::memory_allocated(d) - with_input, with_input - before)
        << "a float32 copy of the input was made";
  }
}

TEST_P(Views, NeverAllocate) {
  const Tensor a = zeros({4, 6}, on({}));
  const size_t before = memory::memory_allocated(dev());
  const Tensor v = a.view({2, 12}).transpose(0, 1).narrow(0, 2, 5).unsqueeze(0).expand({3, 5, 2});
  (void)a.permute({1, 0}).select(0, 2).flatten();
  (void)a.slice(1, 0, 6, 2).squeeze();
  EXPECT_EQ(memory::memory_allocated(dev()), before);
  EXPECT_TRUE(v.storage().is_same(a.storage()));
  EXPECT_FALSE(v.is_contiguous());
  const Tensor c = v.contiguous();  // allocates
  EXPECT_GT(memory::memory_allocated(dev()), before);
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_THROW(a.transpose(0, 1).view({24}), std::invalid_argument);
  EXPECT_EQ(a.transpose(0, 1).reshape({24}).sizes(), (Shape{24}));
}

TEST_P(Views, ValuesAndGradients) {
  const Tensor a = put(from_vector({0, 1, 2, 3, 4, 5}, {2, 3}));
  EXPECT_TRUE(values_near(a.t().contiguous(), {0, 3, 1, 4, 2, 5}));
  EXPECT_TRUE(values_near(a.select(1, 2), {2, 5}));
  EXPECT_TRUE(values_near(a.slice(1, 0, 3, 2), {0, 2, 3, 5}));
  EXPECT_TRUE(values_near(a.narrow(0, 1, 1), {3, 4, 5}));
  EXPECT_TRUE(values_near(a.unsqueeze(1).expand({2, 2, 3}), {0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5}));
  const Tensor x = rand_input({2, 3, 4}, -1, 1, 9);
  const Device d = dev();
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& t) { return t[0].view({6, 4}) * 2.0; }, {x}));
  EXPECT_TRUE(gradcheck_on(d,
                           [](const TensorList& t) {
                             return t[0].permute({2, 0, 1}).reshape({4, 6});
                           },
                           {x}));
  EXPECT_TRUE(gradcheck_on(
      d, [](const TensorList& t) { return t[0].transpose(0, 2).narrow(1, 1, 2); }, {x}));
  EXPECT_TRUE(gradcheck_on(
      d, [](const TensorList& t) { return t[0].slice(2, 1, 4, 2).select(0, 1); }, {x}));
  EXPECT_TRUE(gradcheck_on(d,
                           [](const TensorList& t) {
                             return t[0].select(1, 0).unsqueeze(1).expand({2, 5, 4});
                           },
                           {x}));
  EXPECT_TRUE(gradcheck_on(d, [](const TensorList& t) { return t[0].flatten(1).squeeze(); }, {x}));
}

// Out-of-range indices and the 0-D tensor (no dimension to index) are errors naming the op;
// sums near int64's ends do not wrap past the checks.
TEST_P(Views, IndicesOutOfRangeAreErrors) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  const Tensor s = zeros({}, on({}));
  for (const int64_t dim : {0, -1}) {
    EXPECT_THROW(
        {
          try {
            (void)s.select(dim, 0);
          } catch (const std::out_of_range& e) {
            EXPECT_NE(std::string(e.what()).find("select: cannot be applied to a 0-D tensor"),
                      std::string::npos)
                << e.what();
            throw;
          }
        },
        std::out_of_range);
    EXPECT_THROW((void)s.narrow(dim, 0, 0), std::out_of_range);
    EXPECT_THROW((void)s.slice(dim, 0, 1), std::out_of_range);
  }
  const Tensor a = zeros({2, 3}, on({}));
  EXPECT_THROW((void)a.select(1, kMin), std::out_of_range);
  EXPECT_THROW((void)a.select(1, 3), std::out_of_range);
  EXPECT_THROW((void)a.narrow(1, 1, kMax), std::out_of_range);  // 1 + kMax wrapped before
  EXPECT_THROW((void)a.narrow(1, kMin, 1), std::out_of_range);
  EXPECT_THROW((void)a.narrow(1, 4, 0), std::out_of_range);
  EXPECT_EQ(a.narrow(1, 3, 0).sizes(), (Shape{2, 0}));
  EXPECT_EQ(a.narrow(1, -3, 3).sizes(), (Shape{2, 3}));
  EXPECT_EQ(a.slice(1, 0, 3, kMax).sizes(), (Shape{2, 1}));  // end - start + step wrapped before
  EXPECT_EQ(a.slice(1, kMin, kMax, 2).sizes(), (Shape{2, 2}));
  // Fewer dims than dimensions: the backward's inverse was filled before the check (a write
  // past its end, which the ASan job sees).
  const Tensor b = zeros({1, 2, 3, 4}, on({}));
  EXPECT_THROW((void)b.permute({3, 2}), std::invalid_argument);
  EXPECT_THROW((void)b.permute({3, 2, 1, 1}), std::invalid_argument);
  EXPECT_EQ(b.permute({3, 2, 1, 0}).sizes(), (Shape{4, 3, 2, 1}));
}

// str() of a tensor on the device under test: on the CPU its values, like PyTorch; on a
// device its shape and device (the values stay where they are), then PyTorch's suffixes.
class Printing : public OnDevice {
 protected:
  std::string want(const std::string& values, const std::string& shape,
                   const std::string& dtype_suffix = "", bool requires_grad = false) const {
    const std::string d = dev().str();
    // PyTorch's order of suffixes: device, then dtype, then requires_grad.
    return "tensor(" + (on_cpu() ? values : "<" + shape + " on " + d + ">") +
           (on_cpu() ? "" : ", device='" + d + "'") + dtype_suffix +
           (requires_grad ? ", requires_grad=True" : "") + ")";
  }
};
TALLY_ON_DEVICES(Printing);

TEST_P(Printing, PrintsLikePyTorch) {
  EXPECT_EQ(put(from_vector({1, 2.5}, {2})).str(), want("[1.0000, 2.5000]", "[2]"));
  EXPECT_EQ(put(from_vector({1, 2, 3, 4}, {2, 2}, TensorOptions{}.with_dtype(DType::int64))).str(),
            want("[[1, 2],\n        [3, 4]]", "[2, 2]"));
  EXPECT_EQ(ones({1}, on(TensorOptions{}.with_dtype(DType::float16))).str(),
            want("[1.]", "[1]", ", dtype=float16"));
  EXPECT_EQ(ones({1}, on(TensorOptions{}.with_requires_grad())).str(),
            want("[1.]", "[1]", "", /*requires_grad=*/true));
}

// The rest of torch/_tensor_str.py's rules, on the CPU (where the values print); each
// expected string is what PyTorch 2.11 prints for the same tensor, but for the dtype's name
// (torch.int64 there).
TEST(PrintingCpu, PrintsLikePyTorchsFormatter) {
  auto vec = [](std::vector<double> v, DType d = DType::float32) {
    const int64_t n = static_cast<int64_t>(v.size());
    return ops::to(from_vector(std::move(v), {n}), d);
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  // Whole numbers: int mode ("1."), right-aligned to the widest.
  EXPECT_EQ(vec({1, 10}).str(), "tensor([ 1., 10.])");
  EXPECT_EQ(zeros({2}).str(), "tensor([0., 0.])");
  EXPECT_EQ(vec({nan, 1, -inf}).str(), "tensor([nan, 1., -inf])");
  // Scientific past a ratio of 1000, above 1e8, or (not whole) below 1e-4.
  EXPECT_EQ(vec({1e-5, 1}).str(), "tensor([1.0000e-05, 1.0000e+00])");
  EXPECT_EQ(vec({1, 1e9}).str(), "tensor([1.0000e+00, 1.0000e+09])");
  EXPECT_EQ(vec({0.1, 0.25}).str(), "tensor([0.1000, 0.2500])");
  // Integers and bools padded; 0-D; empty tensors with their size and dtype.
  EXPECT_EQ(vec({1, 10, -100}, DType::int64).str(), "tensor([   1,   10, -100])");
  EXPECT_EQ(vec({1, 0}, DType::bool_).str(), "tensor([ True, False])");
  EXPECT_EQ(full({}, -0.0).str(), "tensor(-0.)");
  EXPECT_EQ(full({}, 2.5).str(), "tensor(2.5000)");
  EXPECT_EQ(zeros({2, 0}).str(), "tensor([], size=(2, 0))");
  EXPECT_EQ(zeros({0}, TensorOptions{}.with_dtype(DType::int64)).str(), "tensor([], dtype=int64)");
  // Every element up to 1,000 of them; blank lines between the 2-D blocks of a 3-D tensor.
  EXPECT_EQ(arange(0, 10, 1).str(), "tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])");
  EXPECT_EQ(arange(0, 12, 1, TensorOptions{}).reshape({3, 2, 2}).str(),
            "tensor([[[ 0.,  1.],\n"
            "         [ 2.,  3.]],\n"
            "\n"
            "        [[ 4.,  5.],\n"
            "         [ 6.,  7.]],\n"
            "\n"
            "        [[ 8.,  9.],\n"
            "         [10., 11.]]])");
  // Past 1,000 elements: 3 at each end of every dimension, the width from those shown.
  EXPECT_EQ(arange(1000, 3000, 1, TensorOptions{}).str(),
            "tensor([1000., 1001., 1002.,  ..., 2997., 2998., 2999.])");
  EXPECT_EQ(arange(0, 2000, 1, TensorOptions{}).str(),  // 1999 / 1 > 1000: scientific
            "tensor([0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03, 1.9980e+03,\n"
            "        1.9990e+03])");
  EXPECT_EQ(arange(0, 1600, 1).reshape({40, 40}).str(),
            "tensor([[   0,    1,    2,  ...,   37,   38,   39],\n"
            "        [  40,   41,   42,  ...,   77,   78,   79],\n"
            "        [  80,   81,   82,  ...,  117,  118,  119],\n"
            "        ...,\n"
            "        [1480, 1481, 1482,  ..., 1517, 1518, 1519],\n"
            "        [1520, 1521, 1522,  ..., 1557, 1558, 1559],\n"
            "        [1560, 1561, 1562,  ..., 1597, 1598, 1599]])");
  // 80 columns: 9 items of width 6 (+2) a line after the 7-column indent.
  EXPECT_EQ(div(arange(0, 12, 1, TensorOptions{}), 7.0).str(),
            "tensor([0.0000, 0.1429, 0.2857, 0.4286, 0.5714, 0.7143, 0.8571, 1.0000, 1.1429,\n"
            "        1.2857, 1.4286, 1.5714])");
}

TEST_P(Random, SameSeedSameNumbers) {
  Generator g1(42), g2(42);
  EXPECT_TRUE(values_near(ops::rand({10}, DType::float64, dev(), &g1),
                          ops::to_vector(ops::rand({10}, DType::float64, dev(), &g2)), 0));
  Generator g3(1);
  const Tensor n = ops::randn({20000}, DType::float64, dev(), &g3);
  EXPECT_NEAR(ops::item(ops::mean(n)), 0.0, 0.03);
  EXPECT_NEAR(ops::item(ops::mean(ops::mul(n, n))), 1.0, 0.05);
  const Tensor r = ops::randint(3, 7, {1000}, DType::int64, dev());
  for (double v : r.tolist()) EXPECT_TRUE(v >= 3 && v < 7);
}

// ------------------------------------------------------------------ against the CPU

class ElementwiseVsCpu : public VsCpu {};
TALLY_VS_CPU(ElementwiseVsCpu);

TEST_P(ElementwiseVsCpu, RandomNumbersMatchTheCpu) {
  for (auto kind : {0, 1, 2}) {
    // The same generator state gives the same numbers on either device.
    const auto draw = [kind](Device device) {
      Generator g(5);
      return kind == 0   ? ops::rand({1003}, DType::float32, device, &g)
             : kind == 1 ? ops::randn({1003}, DType::float32, device, &g)
                         : ops::randint(-5, 100, {1003}, DType::int64, device, &g);
    };
    EXPECT_LT(max_pointwise_error_lenient(draw(dev()), draw(Device::cpu())), 1e-6) << kind;
  }
}

TEST_P(ElementwiseVsCpu, CopiesRoundTripAllDtypesAndLayouts) {
  const Tensor src = rand_tensor({3, 4, 5}, DType::float64, 1);
  for (DType d : {DType::float32, DType::float16, DType::bfloat16, DType::float64, DType::int32,
                  DType::int64, DType::bool_}) {
    const Tensor c = ops::to(src, d);
    const Tensor g = put(c);
    EXPECT_EQ(max_pointwise_error_lenient(g, c), 0.0) << dtype_name(d);
    // strided device-side copy with a dtype change
    const Tensor gt = ops::contiguous(ops::permute(g, {2, 0, 1}));
    EXPECT_EQ(max_pointwise_error_lenient(gt, ops::contiguous(ops::permute(c, {2, 0, 1}))), 0.0)
        << dtype_name(d);
  }
  // host -> device into a non-contiguous destination
  Tensor dst = ops::zeros({5, 4}, DType::float32, dev());
  const Tensor host = ops::to(rand_tensor({4, 5}, DType::float64, 2), DType::float32);
  ops::copy_(ops::transpose(dst, 0, 1), host);
  EXPECT_EQ(max_pointwise_error_lenient(ops::transpose(dst, 0, 1), host), 0.0);
}

// Contiguous casts among float32 / float16 / bfloat16 take the vectorised path (8 elements a
// step, 16-byte accesses); a length that is not a multiple of 8 exercises its tail, a view
// starting 2 elements in (not 16-byte aligned) the general path. Both round like the CPU.
TEST_P(ElementwiseVsCpu, VectorisedCastsMatchTheCpu) {
  const DType family[] = {DType::float32, DType::float16, DType::bfloat16};
  for (const int64_t n : {int64_t{8}, int64_t{1003}, int64_t{1 << 20} + 5}) {
    const Tensor src64 = ops::mul(rand_tensor({n}, DType::float64, 7), 300.0);
    for (DType from : family) {
      const Tensor c_from = ops::to(src64, from);
      const Tensor g_from = put(c_from);
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

TEST_P(ElementwiseVsCpu, BinaryUnaryMatchTheCpu) {
  using ops::BinaryOp;
  using ops::UnaryOp;
  for (DType d : {DType::float32, DType::float16, DType::bfloat16, DType::float64}) {
    const Tensor a = rand_tensor({4, 1, 33}, d, 3), b = rand_tensor({5, 33}, d, 4, 0.5, 2);
    const Tensor ga = put(a), gb = put(b);
    // got (on the device) against want (the CPU), within `scale` times the dtype's tolerance.
    const auto check = [&](const Tensor& got, const Tensor& want, const std::string& what,
                           double scale = 1) {
      EXPECT_LT(max_pointwise_error_lenient(got, want), pointwise_tol(d) * scale)
          << dtype_name(d) << " " << what;
    };
    for (auto op : {BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div, BinaryOp::maximum,
                    BinaryOp::minimum, BinaryOp::relu_backward, BinaryOp::gelu_backward,
                    BinaryOp::gelu_tanh_backward, BinaryOp::add_relu, BinaryOp::silu_backward,
                    BinaryOp::sigmoid_backward, BinaryOp::tanh_backward, BinaryOp::silu_mul,
                    BinaryOp::lt, BinaryOp::eq})
      check(ops::binary(op, ga, gb), ops::binary(op, a, b), ops::binary_op_name(op));
    check(ops::binary(BinaryOp::pow, gb, ga), ops::binary(BinaryOp::pow, b, a), "pow", 10);
    for (auto op :
         {UnaryOp::neg, UnaryOp::exp, UnaryOp::abs, UnaryOp::relu, UnaryOp::sigmoid, UnaryOp::tanh,
          UnaryOp::silu, UnaryOp::gelu, UnaryOp::gelu_tanh, UnaryOp::square, UnaryOp::erf})
      check(ops::unary(op, ga), ops::unary(op, a), ops::unary_op_name(op));
    for (auto op : {UnaryOp::log, UnaryOp::sqrt, UnaryOp::rsqrt})
      check(ops::unary(op, gb), ops::unary(op, b), ops::unary_op_name(op));
    check(ops::binary_scalar(BinaryOp::mul, ga, 3.5), ops::binary_scalar(BinaryOp::mul, a, 3.5),
          "x * 3.5");
    check(ops::scalar_binary(BinaryOp::sub, 1.0, ga), ops::scalar_binary(BinaryOp::sub, 1.0, a),
          "1 - x");
    check(ops::affine(ga, 2.0, -1.0), ops::affine(a, 2.0, -1.0), "affine");
    check(ops::clamp(ga, -0.5, 0.7), ops::clamp(a, -0.5, 0.7), "clamp");
    const Tensor cond = ops::binary_scalar(BinaryOp::gt, a, 0.0);
    check(ops::where(ops::to(cond, dev(), DType::bool_), ga, gb), ops::where(cond, a, b), "where");
    check(ops::mul(ops::transpose(gb, 0, 1), 2.0), ops::mul(ops::transpose(b, 0, 1), 2.0),
          "non-contiguous operand");
  }
}

// A full operand and a one-element device tensor (a loss scale, a mean's 1 / count): the
// vectorised path reads the element on the device, either operand order, with a tail (1003
// elements) and a misaligned view (the strided path), like the CPU.
TEST_P(ElementwiseVsCpu, OneElementOperandMatchesTheCpu) {
  using ops::BinaryOp;
  for (DType d : {DType::float32, DType::float16, DType::bfloat16, DType::float64}) {
    const Tensor a = rand_tensor({1003}, d, 5), s0 = rand_tensor({}, d, 6, 0.5, 2);
    const Tensor s1 = ops::reshape(s0, {1});
    const Tensor ga = put(a), gs0 = put(s0), gs1 = put(s1);
    for (auto op : {BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div}) {
      const std::string name = std::string(dtype_name(d)) + " " + ops::binary_op_name(op);
      EXPECT_EQ(max_pointwise_error_lenient(ops::binary(op, ga, gs0), ops::binary(op, a, s0)), 0.0)
          << name;
      EXPECT_EQ(max_pointwise_error_lenient(ops::binary(op, gs1, ga), ops::binary(op, s1, a)), 0.0)
          << name << " (reversed)";
      const Tensor off = ops::narrow(ga, 0, 1, 1002);
      EXPECT_EQ(max_pointwise_error_lenient(ops::binary(op, off, gs0),
                                            ops::binary(op, ops::narrow(a, 0, 1, 1002), s0)),
                0.0)
          << name << " (misaligned)";
    }
  }
}

// float16 / bfloat16 GELU (exact and tanh) take their own float32 formulas on CUDA (one exp2, no
// erff / tanhf; elementwise.cu). Every one of the 65,536 bit patterns, through the contiguous fast
// path and the strided path: each finite result within one ulp of the 16-bit type of a long-double
// reference (or 1e-9 absolute, where float32's 1 + erf saturates to 0), non-finite inputs as the
// CPU kernel gives them. The textbook float32 formula fails this in the tail (x near -5, where
// 1 + erf(x / sqrt 2) cancels).
TEST_P(ElementwiseVsCpu, SixteenBitGeluIsWithinOneUlpOnEveryInput) {
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
        const Tensor xg = strided ? ops::select(put(wide), 1, 0) : put(x);
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

TEST_P(ElementwiseVsCpu, SumMatchesTheCpu) {
  for (DType d : {DType::float32, DType::bfloat16, DType::float64, DType::int64}) {
    const Tensor a =
        d == DType::int64 ? ops::randint(-50, 50, {6, 7, 300}) : rand_tensor({6, 7, 300}, d, 9);
    const Tensor g = put(a);
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
  EXPECT_LT(max_pointwise_error_lenient(ops::sum(put(big)), ops::sum(big)), 1e-5);
}

// The fast paths of a contiguous input: column sums (the outer dims reduced: a Linear's
// bias gradient, [B, T, N] -> [N]) and full sums, at widths around the 32-column tile, with
// many rows (several splits; {2, 4099, 64} and the full sums take the block-per-column reduction
// of the partials) and a storage offset; and they repeat bit for bit (no atomics).
TEST_P(ElementwiseVsCpu, ColumnAndFullSumsMatchTheCpu) {
  uint64_t seed = 60;
  for (DType d : {DType::float32, DType::bfloat16, DType::float16, DType::float64}) {
    const double tol = d == DType::float32 ? 1e-5 : d == DType::float64 ? 1e-12 : 2e-2;
    for (const Shape& shape : std::vector<Shape>{{4, 1000, 33},
                                                 {3, 517, 768},
                                                 {2, 4099, 64},
                                                 {2, 4099, 1},
                                                 {64, 3, 5},
                                                 {100003},
                                                 {8, 1031, 256}}) {
      const Tensor a = rand_tensor(shape, d, ++seed);
      const Tensor g = put(a);
      const std::string what = std::string(dtype_name(d)) + " " + a.shape_string();
      if (shape.size() == 3) {
        EXPECT_LT(max_pointwise_error_lenient(ops::sum(g, {0, 1}), ops::sum(a, {0, 1})), tol)
            << what;
        EXPECT_LT(max_pointwise_error_lenient(ops::sum(g, {0}, true), ops::sum(a, {0}, true)), tol)
            << what;
        const Tensor once = ops::sum(g, {0, 1}), twice = ops::sum(g, {0, 1});
        EXPECT_EQ(max_pointwise_error_lenient(once, twice), 0.0) << what << " is deterministic";
        // Into float32 (a bias gradient of 16-bit activations): the CPU's float32 sum.
        const Tensor f32 = ops::sum(g, {0, 1}, false, DType::float32);
        EXPECT_EQ(f32.dtype(), DType::float32);
        EXPECT_LT(max_pointwise_error_lenient(f32, ops::sum(a, {0, 1}, false, DType::float32)),
                  1e-5)
            << what << " into float32";
      }
      EXPECT_LT(max_pointwise_error_lenient(ops::sum(g), ops::sum(a)), tol) << what;
      EXPECT_EQ(max_pointwise_error_lenient(ops::sum(g), ops::sum(g)), 0.0)
          << what << " full sum is deterministic";
      // A view starting 7 elements into its storage.
      const Tensor flat = ops::reshape(a, {-1});
      const int64_t n = flat.numel() - 7;
      EXPECT_LT(max_pointwise_error_lenient(ops::sum(ops::narrow(put(flat), 0, 7, n)),
                                            ops::sum(ops::narrow(flat, 0, 7, n))),
                tol)
          << what << " offset 7";
    }
  }
}

// Gradients through a small graph on the device equal the CPU's, and every byte of them
// stayed on the device's allocator, tagged.
TEST_P(ElementwiseVsCpu, AutogradGradientsMatchTheCpu) {
  auto f = [](const Tensor& x, const Tensor& w) {
    return sum(mul(gelu(mul(x, w)), tanh(x)) / 3.0);
  };
  Tensor xc = rand_tensor({8, 16}, DType::float32, 12), wc = rand_tensor({16}, DType::float32, 13);
  const Tensor xg = leaf(xc), wg = leaf(wc);
  xc.requires_grad_();
  wc.requires_grad_();
  f(xc, wc).backward();
  f(xg, wg).backward();
  EXPECT_LT(max_pointwise_error_lenient(xg.grad(), xc.grad()), 1e-5);
  EXPECT_LT(max_pointwise_error_lenient(wg.grad(), wc.grad()), 1e-5);
  EXPECT_EQ(xg.grad().device(), dev());
  const auto& stats = memory::get_allocator(dev()).stats();
  EXPECT_EQ(stats.cat_bytes(memory::Category::unknown).current, 0);
  EXPECT_GT(stats.cat_bytes(memory::Category::gradient).current, 0);
}

}  // namespace
}  // namespace tally
