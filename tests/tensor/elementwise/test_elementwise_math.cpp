// sin, cos, erf and lerp (the ops docs/architecture.md's walk-through adds): values against
// the C library, float64 gradient checks and errors on every device (test_elementwise_math,
// and on CUDA test_elementwise_math_cuda), the CUDA kernels against the CPU reference over
// dtypes and layouts (ElementwiseMathVsCpu), and the meta kernels' shapes.
#include <cmath>
#include <vector>

#include "testing/cuda_testing.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace testing;

class ElementwiseMath : public OnDevice {};
TALLY_ON_DEVICES(ElementwiseMath);

TEST_P(ElementwiseMath, UnaryValuesMatchTheCLibrary) {
  const std::vector<double> xs{-2.5, -1.0, -0.25, 0.0, 0.5, 1.0, 3.0};
  const Tensor x = put(ops::from_vector(xs, {7}, DType::float64));
  const std::vector<double> s = x.sin().tolist(), c = x.cos().tolist(), e = x.erf().tolist();
  for (size_t i = 0; i < xs.size(); ++i) {
    EXPECT_NEAR(s[i], std::sin(xs[i]), 1e-15) << xs[i];
    EXPECT_NEAR(c[i], std::cos(xs[i]), 1e-15) << xs[i];
    EXPECT_NEAR(e[i], std::erf(xs[i]), 1e-15) << xs[i];
  }
}

TEST_P(ElementwiseMath, LerpValuesBroadcastAndEnds) {
  const Tensor a = put(ops::from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, DType::float64));
  const Tensor b = put(ops::from_vector({10, 20, 30}, {3}, DType::float64));
  const Tensor w = put(ops::from_vector({0.0, 1.0}, {2, 1}, DType::float64));
  // Row 0 takes weight 0 (a), row 1 weight 1 (b, exactly).
  EXPECT_EQ(tally::lerp(a, b, w).tolist(), (std::vector<double>{1, 2, 3, 10, 20, 30}));
  EXPECT_EQ(a.lerp(b, 0.25).tolist(), (std::vector<double>{3.25, 6.5, 9.75, 5.5, 8.75, 12.0}));
  // Weights outside [0, 1] extrapolate, as torch.lerp does.
  EXPECT_EQ(tally::lerp(a, b, 2.0).sizes(), (Shape{2, 3}));
  EXPECT_DOUBLE_EQ(tally::lerp(a, b, 2.0).tolist()[0], 19.0);
  const Tensor f = put(ops::from_vector({0.0, 1.0}, {2}, DType::float32));
  EXPECT_EQ(tally::lerp(f, ops::ones_like(f), 0.5).tolist(), (std::vector<double>{0.5, 1.0}));
}

TEST_P(ElementwiseMath, Gradients) {
  const Tensor x = rand_input({3, 4}, -2.0, 2.0, 3);
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return tally::sin(in[0]); }, {x}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return tally::cos(in[0]); }, {x}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& in) { return tally::erf(in[0]); }, {x}));
  // lerp with every input requiring grad and broadcasting: [3, 4], [4], [3, 1].
  const Tensor a = rand_input({3, 4}, -1.0, 1.0, 4), b = rand_input({4}, -1.0, 1.0, 5);
  const Tensor w = rand_input({3, 1}, -0.5, 1.5, 6);
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& in) { return tally::lerp(in[0], in[1], in[2]); }, {a, b, w}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& in) { return tally::lerp(in[0], in[1], 0.7); }, {a, b}));
  // A weight at or past 0.5 takes the other branch of the formula; its gradient is the same.
  EXPECT_TRUE(
      gradcheck_on(dev(), [](const TensorList& in) { return in[0].lerp(in[1], 0.3); }, {a, b}));
}

TEST_P(ElementwiseMath, LerpInputGradientIsOneMinusWeight) {
  const Tensor a = leaf(rand_tensor({5}, DType::float64, 1)),
               b = put(rand_tensor({5}, DType::float64, 2));
  const Tensor w = put(rand_tensor({5}, DType::float64, 3));
  // Only a needs a gradient: d lerp / d input = 1 - weight.
  const Tensor y = tally::lerp(a, b, w);
  tally::sum(y).backward();
  const std::vector<double> g = a.grad().tolist(), wv = w.tolist();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], 1.0 - wv[i], 1e-15);
}

TEST_P(ElementwiseMath, Errors) {
  const Tensor a = put(ops::zeros({2, 3}));
  expect_error<std::invalid_argument>(
      [&] {
        tally::lerp(a, put(ops::zeros({2, 3}, DType::float64)), 0.5);
      },
      {"lerp", "float32", "float64"});
  expect_error<std::invalid_argument>([&] { tally::lerp(a, put(ops::zeros({4})), 0.5); },
                                      {"lerp", "[2, 3]", "[4]"});
  expect_error<std::invalid_argument>(
      [&] {
        tally::lerp(a, a, put(ops::zeros({2, 3}, DType::float16)));
      },
      {"lerp", "weight", "float16"});
  const Tensor i = put(ops::zeros({2}, DType::int64));
  expect_error<std::invalid_argument>([&] { tally::lerp(i, i, 0.5); }, {"lerp", "int64"});
}

TEST(ElementwiseMathMeta, ShapesAndDtypesWithoutData) {
  const Tensor a = ops::empty({4, 1, 3}, DType::bfloat16, Device::meta(0));
  const Tensor b = ops::empty({5, 3}, DType::bfloat16, Device::meta(0));
  const Tensor y = tally::lerp(a, b, ops::empty({1, 5, 1}, DType::bfloat16, Device::meta(0)));
  EXPECT_TRUE(y.device().is_meta());
  EXPECT_EQ(y.sizes(), (Shape{4, 5, 3}));
  EXPECT_EQ(y.dtype(), DType::bfloat16);
  EXPECT_EQ(tally::erf(a).sizes(), a.sizes());
  EXPECT_EQ(a.sin().dtype(), DType::bfloat16);
}

// ------------------------------------------------------------------ CUDA against the CPU

class ElementwiseMathVsCpu : public VsCpu {};
TALLY_VS_CPU(ElementwiseMathVsCpu);

TEST_P(ElementwiseMathVsCpu, MatchTheCpu) {
  for (DType d : {DType::float32, DType::float16, DType::bfloat16, DType::float64})
    for (bool noncontig : {false, true}) {
      const Pair x = both({33, 65}, d, 11, noncontig, -4, 4);
      const Pair e = both({33, 65}, d, 12, noncontig);
      const Pair w = both({65}, d, 13, false, -0.5, 1.5);
      const double tol = 2 * pointwise_tol(d);
      const std::string what = std::string(dtype_name(d)) + (noncontig ? " strided" : "");
      EXPECT_TRUE(close_to_cpu(x.gpu.sin(), x.cpu.sin(), tol, "sin " + what));
      EXPECT_TRUE(close_to_cpu(x.gpu.cos(), x.cpu.cos(), tol, "cos " + what));
      EXPECT_TRUE(close_to_cpu(x.gpu.erf(), x.cpu.erf(), tol, "erf " + what));
      EXPECT_TRUE(close_to_cpu(tally::lerp(x.gpu, e.gpu, w.gpu), tally::lerp(x.cpu, e.cpu, w.cpu),
                               tol, "lerp " + what));
      EXPECT_TRUE(
          close_to_cpu(x.gpu.lerp(e.gpu, 0.7), x.cpu.lerp(e.cpu, 0.7), tol, "lerp scalar " + what));
    }
}

TEST_P(ElementwiseMathVsCpu, GradientsMatchTheCpu) {
  const Pair a = both({7, 9}, DType::float32, 21), b = both({9}, DType::float32, 22);
  const Pair w = both({7, 1}, DType::float32, 23);
  auto grads = [](Tensor a, Tensor b, Tensor w) {
    a.requires_grad_(true), b.requires_grad_(true), w.requires_grad_(true);
    tally::sum(tally::mul(tally::lerp(a.sin(), b.erf(), w), a.cos())).backward();
    return TensorList{a.grad(), b.grad(), w.grad()};
  };
  const TensorList g = grads(ops::clone(a.gpu), ops::clone(b.gpu), ops::clone(w.gpu));
  const TensorList c = grads(ops::clone(a.cpu), ops::clone(b.cpu), ops::clone(w.cpu));
  for (size_t i = 0; i < g.size(); ++i)
    EXPECT_TRUE(close_to_cpu(g[i], c[i], 1e-5, "gradient " + std::to_string(i)));
}

}  // namespace
}  // namespace tally
