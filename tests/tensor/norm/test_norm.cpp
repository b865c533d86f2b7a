// Normalization ops (layer_norm, rms_norm, batch_norm): hand-computed values, running-stat
// updates, eval mode, what backward saves, float64 gradient checks (affine or not, several
// normalized dims, non-contiguous inputs), 16-bit dtypes and errors naming op and shapes.
#include "autograd/node.h"
#include "tensor/norm/autograd.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using namespace testing;

// ---------------------------------------------------------------- layer_norm

TEST(LayerNorm, Values) {
  const Tensor x = from_vector({1, 2, 3, 4}, {4});
  EXPECT_TRUE(values_near(
      layer_norm(x, {4}, {}, {}, 1e-12),
      {-1.3416407864993372, -0.447213595499779, 0.447213595499779, 1.3416407864993372}, 1e-6));
  const Tensor w = from_vector({1, 2, 0.5, -1}, {4});
  const Tensor b = from_vector({0, 1, -1, 0.5}, {4});
  EXPECT_TRUE(values_near(
      layer_norm(x, {4}, w, b, 1e-12),
      {-1.3416407864993372, 0.10557280900044197, -0.7763932022501105, -0.8416407864993372}, 1e-6));
  // bias without weight
  EXPECT_TRUE(values_near(
      layer_norm(x, {4}, {}, b, 1e-12),
      {-1.3416407864993372, 0.552786404500221, -0.552786404500221, 1.8416407864993372}, 1e-6));

  // Rows of a [2, 3] input, default eps = 1e-5; the raw op's mean and rstd are [2, 1].
  const Tensor x2 = from_vector({1, 2, 3, 2, 4, 8}, {2, 3}, f64);
  auto [out, mean, rstd] = ops::layer_norm(x2, {3});
  EXPECT_TRUE(values_near(out,
                          {-1.2247356859083902, 0.0, 1.2247356859083902, -1.0690441085967415,
                           -0.2672610271491854, 1.3363051357459264},
                          1e-12));
  EXPECT_EQ(mean.sizes(), (Shape{2, 1}));
  EXPECT_EQ(rstd.sizes(), (Shape{2, 1}));
  EXPECT_TRUE(values_near(mean, {2.0, 4.666666666666667}, 1e-12));
  EXPECT_TRUE(values_near(rstd, {1.2247356859083902, 0.400891540723778}, 1e-12));

  // Over the last two dims: [2, 2, 3] normalized over [2, 3] = rows of 6.
  const Tensor x3 = from_vector({1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0, 6}, {2, 2, 3}, f64);
  auto [out3, mean3, rstd3] = ops::layer_norm(x3, {2, 3}, {}, {}, 0.0);
  EXPECT_EQ(mean3.sizes(), (Shape{2, 1, 1}));
  EXPECT_TRUE(values_near(mean3, {3.5, 1.0}, 1e-12));
  // row 0: var 35/12; row 1: var 5
  EXPECT_TRUE(values_near(rstd3, {1.0 / std::sqrt(35.0 / 12.0), 1.0 / std::sqrt(5.0)}, 1e-12));
  EXPECT_TRUE(values_near(out3.select(0, 1),
                          {-0.4472135954999579, -0.4472135954999579, -0.4472135954999579,
                           -0.4472135954999579, -0.4472135954999579, 2.23606797749979},
                          1e-12));
}

TEST(LayerNorm, SimpleGradients) {
  // sum(layer_norm(x)) does not depend on x; dbias counts the rows; dweight sums xhat.
  const Tensor x = from_vector({1, 2, 3, 2, 4, 8}, {2, 3}, f64_grad);
  const Tensor w = from_vector({1, 1, 1}, {3}, f64_grad);
  const Tensor b = from_vector({0, 0, 0}, {3}, f64_grad);
  sum(layer_norm(x, {3}, w, b, 0.0)).backward();
  EXPECT_TRUE(values_near(x.grad(), {0, 0, 0, 0, 0, 0}, 1e-12));
  EXPECT_TRUE(values_near(b.grad(), {2, 2, 2}, 1e-12));
  EXPECT_TRUE(values_near(w.grad(),
                          {-1.2247448713915890 - 1.0690449676496976, 0.0 - 0.2672612419124244,
                           1.2247448713915890 + 1.3363062095621219},
                          1e-12));
}

TEST(LayerNorm, Gradients) {
  const Tensor x = rand_input({3, 4}, -1, 1, 1);
  const Tensor x3 = rand_input({2, 2, 3}, -1, 1, 2);
  const Tensor w = rand_input({4}, 0.5, 1.5, 3);
  const Tensor b = rand_input({4}, -1, 1, 4);
  const Tensor w2 = rand_input({2, 3}, 0.5, 1.5, 5);
  const Tensor b2 = rand_input({2, 3}, -1, 1, 6);
  // no affine, last dim / last two dims
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return layer_norm(t[0], {4}); }, {x}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return layer_norm(t[0], {2, 3}); }, {x3}));
  // affine
  EXPECT_TRUE(
      gradcheck([](const TensorList& t) { return layer_norm(t[0], {4}, t[1], t[2]); }, {x, w, b}));
  EXPECT_TRUE(gradcheck(
      [](const TensorList& t) {
        return layer_norm(t[0], {2, 3}, t[1], t[2]);
      },
      {x3, w2, b2}));
  // weight only, bias only
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return layer_norm(t[0], {4}, t[1]); }, {x, w}));
  EXPECT_TRUE(
      gradcheck([](const TensorList& t) { return layer_norm(t[0], {4}, {}, t[1]); }, {x, b}));
  // non-contiguous input, normalized over 1 and 2 dims
  const Tensor xn = rand_input_noncontig({2, 3, 4}, 7);
  ASSERT_FALSE(xn.is_contiguous());
  EXPECT_TRUE(
      gradcheck([](const TensorList& t) { return layer_norm(t[0], {4}, t[1], t[2]); }, {xn, w, b}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return layer_norm(t[0], {3, 4}); }, {xn}));
  // a transposed view as input
  const Tensor xt = rand_input({4, 3}, -1, 1, 8);
  EXPECT_TRUE(
      gradcheck([](const TensorList& t) { return layer_norm(t[0].t(), {4}, t[1]); }, {xt, w}));
  // only the parameters require grad (x a constant): dweight alone, dbias alone
  const Tensor xc = ops::rand({3, 4}, DType::float64);
  EXPECT_TRUE(
      gradcheck([&](const TensorList& t) { return layer_norm(xc, {4}, t[0], t[1]); }, {w, b}));
  EXPECT_TRUE(gradcheck([&](const TensorList& t) { return layer_norm(xc, {4}, {}, t[0]); }, {b}));
}

TEST(LayerNorm, SavesInputAndStatisticsNotOutput) {
  const Tensor x = rand_input({3, 4}, -1, 1, 1);
  const Tensor w = rand_input({4}, 0.5, 1.5, 2);
  const Tensor b = rand_input({4}, -1, 1, 3);
  const Tensor out = layer_norm(x, {4}, w, b);
  const std::vector<Tensor> saved = saved_by(out);
  ASSERT_EQ(saved.size(), 4u);  // x, mean, rstd, weight
  EXPECT_TRUE(saved[0].storage().is_same(x.storage()));
  EXPECT_EQ(saved[1].sizes(), (Shape{3, 1}));
  EXPECT_EQ(saved[2].sizes(), (Shape{3, 1}));
  EXPECT_TRUE(saved[3].storage().is_same(w.storage()));
  for (const Tensor& s : saved) EXPECT_FALSE(s.storage().is_same(out.storage()));
  EXPECT_EQ(out.autograd_meta()->grad_fn->name(), "LayerNormBackward");

  // Only bias requires grad: nothing saved at all.
  const Tensor xc = ops::rand({3, 4}, DType::float64);
  EXPECT_TRUE(saved_by(layer_norm(xc, {4}, w.detach(), b)).empty());
  // Only weight: x, mean, rstd, but not the weight.
  EXPECT_EQ(saved_by(layer_norm(xc, {4}, w, b.detach())).size(), 3u);
}

TEST(LayerNorm, Dtypes) {
  const std::vector<double> v = {1, 2, 3, 4, -1, 0, 5, 2};
  const Tensor ref = layer_norm(from_vector(v, {2, 4}), {4});
  for (DType d : {DType::float16, DType::bfloat16, DType::float32, DType::float64}) {
    const Tensor x = from_vector(v, {2, 4}, TensorOptions{}.with_dtype(d));
    auto [out, mean, rstd] = ops::layer_norm(x, {4});
    EXPECT_EQ(out.dtype(), d);
    EXPECT_EQ(mean.dtype(), d == DType::float64 ? DType::float64 : DType::float32);
    EXPECT_EQ(rstd.dtype(), mean.dtype());
    EXPECT_TRUE(values_near(out, ops::to_vector(ref), d == DType::bfloat16 ? 2e-2 : 2e-3))
        << dtype_name(d);
  }
  // bfloat16 input with float32 parameters (mixed precision): gradients keep each dtype.
  Tensor x = from_vector(v, {2, 4}, TensorOptions{}.with_dtype(DType::bfloat16));
  x.requires_grad_(true);
  const Tensor w = ones({4}, TensorOptions{}.with_requires_grad());
  const Tensor b = zeros({4}, TensorOptions{}.with_requires_grad());
  const Tensor out = layer_norm(x, {4}, w, b);
  EXPECT_EQ(out.dtype(), DType::bfloat16);
  sum(out).backward();
  EXPECT_EQ(x.grad().dtype(), DType::bfloat16);
  EXPECT_EQ(w.grad().dtype(), DType::float32);
  EXPECT_EQ(b.grad().dtype(), DType::float32);
  EXPECT_TRUE(values_near(b.grad(), {2, 2, 2, 2}, 1e-6));
  EXPECT_TRUE(values_near(x.grad(), std::vector<double>(8, 0.0), 2e-2));
}

TEST(LayerNorm, Errors) {
  const Tensor x = zeros({2, 3});
  std::string m = error_of<std::invalid_argument>([&] { layer_norm(x, {4}); });
  EXPECT_TRUE(contains(m, "layer_norm") && contains(m, "[4]") && contains(m, "[2, 3]")) << m;
  m = error_of<std::invalid_argument>([&] { layer_norm(x, {2, 3, 1}); });
  EXPECT_TRUE(contains(m, "layer_norm") && contains(m, "[2, 3, 1]")) << m;
  m = error_of<std::invalid_argument>([&] { layer_norm(x, {}); });
  EXPECT_TRUE(contains(m, "layer_norm") && contains(m, "at least one dimension")) << m;
  m = error_of<std::invalid_argument>([&] { layer_norm(x, {3}, zeros({4})); });
  EXPECT_TRUE(contains(m, "layer_norm: weight of shape [4]") && contains(m, "[3]")) << m;
  m = error_of<std::invalid_argument>([&] { layer_norm(x, {3}, {}, zeros({2, 3})); });
  EXPECT_TRUE(contains(m, "layer_norm: bias of shape [2, 3]")) << m;
  m = error_of<std::invalid_argument>([&] {
    layer_norm(zeros({2, 3}, TensorOptions{}.with_dtype(DType::int64)), {3});
  });
  EXPECT_TRUE(contains(m, "layer_norm") && contains(m, "int64")) << m;
  m = error_of<std::invalid_argument>([&] { rms_norm(x, {2}); });
  EXPECT_TRUE(contains(m, "rms_norm") && contains(m, "[2]") && contains(m, "[2, 3]")) << m;
}

TEST(LayerNorm, EmptyInput) {
  const Tensor x = zeros({0, 4}, f64_grad);
  const Tensor w = ones({4}, f64_grad);
  const Tensor out = layer_norm(x, {4}, w);
  EXPECT_EQ(out.sizes(), (Shape{0, 4}));
  sum(out).backward();
  EXPECT_EQ(x.grad().sizes(), (Shape{0, 4}));
  EXPECT_TRUE(values_near(w.grad(), {0, 0, 0, 0}));
}

// ---------------------------------------------------------------- rms_norm

TEST(RmsNorm, ValuesAndGradients) {
  const Tensor x = from_vector({1, 2, 3, 4}, {4}, f64);
  EXPECT_TRUE(values_near(
      rms_norm(x, {4}, {}, 1e-6),
      {0.3651483473268884, 0.7302966946537768, 1.0954450419806652, 1.4605933893075536}, 1e-12));
  const Tensor x2 = from_vector({1, -2, 3, 4}, {4}, f64);
  const Tensor w = from_vector({1, 0.5, 2, -1}, {4}, f64);
  EXPECT_TRUE(values_near(
      rms_norm(x2, {4}, w, 1e-6),
      {0.3651483473268884, -0.3651483473268884, 2.1908900839613303, -1.4605933893075536}, 1e-12));
  // Default eps: float32 machine epsilon.
  EXPECT_TRUE(values_near(rms_norm(from_vector({3, 4}, {2}), {2}),
                          {3.0 / std::sqrt(12.5), 4.0 / std::sqrt(12.5)}, 1e-6));

  const Tensor xi = rand_input({3, 4}, -1, 1, 1);
  const Tensor xn = rand_input_noncontig({2, 3, 4}, 2);
  const Tensor wi = rand_input({4}, 0.5, 1.5, 3);
  const Tensor w2 = rand_input({3, 4}, 0.5, 1.5, 4);
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return rms_norm(t[0], {4}); }, {xi}));
  EXPECT_TRUE(
      gradcheck([](const TensorList& t) { return rms_norm(t[0], {4}, t[1], 1e-5); }, {xi, wi}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return rms_norm(t[0], {4}, t[1]); }, {xn, wi}));
  EXPECT_TRUE(gradcheck(
      [](const TensorList& t) {
        return rms_norm(t[0], {3, 4}, t[1]);
      },
      {xn, w2}));
  const Tensor out = rms_norm(xi, {4}, wi);
  EXPECT_EQ(out.autograd_meta()->grad_fn->name(), "RmsNormBackward");
  EXPECT_EQ(saved_by(out).size(), 3u);  // x, rstd, weight
}

// ---------------------------------------------------------------- batch_norm

TEST(BatchNorm, TrainingValuesAndRunningStats) {
  const Tensor x = from_vector({1, 10, 2, 20, 3, 60}, {3, 2}, f64);
  const Tensor rm = zeros({2}, f64);
  const Tensor rv = ones({2}, f64);
  const Tensor out = batch_norm(x, rm, rv, {}, {}, /*training=*/true);
  EXPECT_TRUE(values_near(out,
                          {-1.2247356859083902, -0.9258200898530505, 0.0, -0.46291004492652527,
                           1.2247356859083902, 1.3887301347795757},
                          1e-12));
  // momentum 0.1: running_mean = 0.1 * [2, 30]; running_var = 0.9 + 0.1 * unbiased [1, 700]
  EXPECT_TRUE(values_near(rm, {0.2, 3.0}, 1e-12));
  EXPECT_TRUE(values_near(rv, {1.0, 70.9}, 1e-12));

  // Affine, momentum 0.5, from the updated stats.
  const Tensor w = from_vector({2, -1}, {2}, f64);
  const Tensor b = from_vector({0.5, 1}, {2}, f64);
  const Tensor out2 = batch_norm(x, rm, rv, w, b, true, 0.5);
  EXPECT_TRUE(values_near(out2,
                          {-1.9494713718167804, 1.9258200898530506, 0.5, 1.4629100449265253,
                           2.9494713718167804, -0.38873013477957574},
                          1e-12));
  EXPECT_TRUE(values_near(rm, {1.1, 16.5}, 1e-12));
  EXPECT_TRUE(values_near(rv, {1.0, 385.45}, 1e-12));

  // Undefined running stats: batch statistics, nothing updated.
  EXPECT_TRUE(values_near(batch_norm(x, {}, {}, {}, {}, true), ops::to_vector(out), 1e-12));

  // 4-D [2, 2, 1, 2]: channel 0 holds {1, 3, 5, 7}, channel 1 {0, 4, 2, 2}.
  const Tensor x4 = from_vector({1, 3, 0, 4, 5, 7, 2, 2}, {2, 2, 1, 2}, f64);
  const Tensor rm4 = zeros({2}, f64), rv4 = ones({2}, f64);
  EXPECT_TRUE(values_near(batch_norm(x4, rm4, rv4, {}, {}, true),
                          {-1.3416394448610998, -0.4472131482870333, -1.4142100268524473,
                           1.4142100268524473, 0.4472131482870333, 1.3416394448610998, 0.0, 0.0},
                          1e-12));
  EXPECT_TRUE(values_near(rm4, {0.4, 0.2}, 1e-12));
  EXPECT_TRUE(values_near(rv4, {1.5666666666666669, 1.1666666666666667}, 1e-12));

  // The raw op's statistics: the batch mean and 1 / sqrt(biased var + eps).
  auto [o, mean, invstd] = ops::batch_norm(x4, {}, {}, {}, {}, true, 0.1, 0.0);
  EXPECT_TRUE(values_near(mean, {4.0, 2.0}, 1e-12));
  EXPECT_TRUE(values_near(invstd, {1.0 / std::sqrt(5.0), 1.0 / std::sqrt(2.0)}, 1e-12));
}

TEST(BatchNorm, RunningStatsAreNotInTheGraph) {
  const Tensor x = rand_input({4, 3}, -1, 1, 1);
  const Tensor w = rand_input({3}, 0.5, 1.5, 2);
  const Tensor rm = zeros({3}, f64), rv = ones({3}, f64);
  const uint64_t v0 = rm.storage().version();
  const Tensor out = batch_norm(x, rm, rv, w, {}, true);
  EXPECT_GT(rm.storage().version(), v0);  // updated in place
  EXPECT_FALSE(rm.requires_grad());
  EXPECT_FALSE(rv.requires_grad());
  EXPECT_EQ(rm.autograd_meta(), nullptr);
  EXPECT_TRUE(out.requires_grad());
  EXPECT_EQ(out.autograd_meta()->grad_fn->name(), "BatchNormBackward");
  // The graph's only inputs are x, weight, bias.
  EXPECT_EQ(out.autograd_meta()->grad_fn->next_edges.size(), 3u);
  // Updating the running stats again does not break this graph's backward.
  batch_norm(x.detach(), rm, rv, {}, {}, true);
  sum(out).backward();
  EXPECT_TRUE(x.grad().defined());
  EXPECT_TRUE(w.grad().defined());
}

TEST(BatchNorm, EvalUsesRunningStats) {
  const Tensor x = from_vector({1, 2, 3, 5}, {2, 2}, f64);
  const Tensor rm = from_vector({1, 2}, {2}, f64);
  const Tensor rv = from_vector({4, 9}, {2}, f64);
  const Tensor w = from_vector({2, 3}, {2}, f64);
  const Tensor b = from_vector({1, -1}, {2}, f64);
  EXPECT_TRUE(values_near(batch_norm(x, rm, rv, w, b, false, 0.1, 0.0), {1, -1, 3, 2}, 1e-12));
  EXPECT_TRUE(values_near(batch_norm(x, rm, rv, {}, {}, false, 0.1, 0.0), {0, 0, 1, 1}, 1e-12));
  // Eval mode never touches the running stats, even with a single value per channel.
  EXPECT_TRUE(
      values_near(batch_norm(from_vector({1, 2}, {1, 2}, f64), rm, rv, {}, {}, false, 0.1, 0.0),
                  {0, 0}, 1e-12));
  EXPECT_TRUE(values_near(rm, {1, 2}));
  EXPECT_TRUE(values_near(rv, {4, 9}));

  // Eval backward: dx = dy * weight * invstd; only invstd and weight saved for it.
  const Tensor xg = from_vector({1, 2, 3, 5}, {2, 2}, f64_grad);
  const Tensor out = batch_norm(xg, rm, rv, w, b, false, 0.1, 0.0);
  EXPECT_EQ(saved_by(out).size(), 2u);
  sum(out).backward();
  EXPECT_TRUE(values_near(xg.grad(), {1, 1, 1, 1}, 1e-12));  // 2 / 2, 3 / 3
}

TEST(BatchNorm, Gradients) {
  const Tensor x2 = rand_input({4, 3}, -1, 1, 1);
  const Tensor x4 = rand_input({2, 3, 2, 2}, -1, 1, 2);
  const Tensor x3n = rand_input_noncontig({3, 2, 4}, 3);
  const Tensor w = rand_input({3}, 0.5, 1.5, 4);
  const Tensor b = rand_input({3}, -1, 1, 5);
  const Tensor w2 = rand_input({2}, 0.5, 1.5, 6);
  const Tensor b2 = rand_input({2}, -1, 1, 7);
  const Tensor rm = ops::mul(ops::rand({3}, DType::float64), 0.5);
  const Tensor rv = ops::add(ops::rand({3}, DType::float64), 0.5);
  // training, 2-D and 4-D, with and without affine, with and without running stats
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& t) { return batch_norm(t[0], {}, {}, t[1], t[2], true); }, {x2, w, b}));
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& t) {
        return batch_norm(t[0], ops::zeros({3}, DType::float64), ops::ones({3}, DType::float64),
                          t[1], t[2], true);
      },
      {x4, w, b}));
  EXPECT_TRUE(
      gradcheck([&](const TensorList& t) { return batch_norm(t[0], {}, {}, {}, {}, true); }, {x4}));
  EXPECT_TRUE(
      gradcheck([&](const TensorList& t) { return batch_norm(t[0], {}, {}, t[1], t[2], true); },
                {x3n, w2, b2}));
  // eval, 2-D and 4-D
  EXPECT_TRUE(
      gradcheck([&](const TensorList& t) { return batch_norm(t[0], rm, rv, t[1], t[2], false); },
                {x2, w, b}));
  EXPECT_TRUE(
      gradcheck([&](const TensorList& t) { return batch_norm(t[0], rm, rv, t[1], t[2], false); },
                {x4, w, b}));
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& t) { return batch_norm(t[0], rm, rv, {}, {}, false); }, {x4}));
  // only the parameters require grad
  const Tensor xc = ops::rand({2, 3, 2}, DType::float64);
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& t) { return batch_norm(xc, {}, {}, t[0], t[1], true); }, {w, b}));
  EXPECT_TRUE(
      gradcheck([&](const TensorList& t) { return batch_norm(xc, {}, {}, {}, t[0], true); }, {b}));
  EXPECT_TRUE(
      gradcheck([&](const TensorList& t) { return batch_norm(xc, rm, rv, t[0], {}, false); }, {w}));
}

TEST(BatchNorm, Dtypes) {
  const std::vector<double> v = {1, 10, 2, 20, 3, 60, 4, -5};
  const Tensor ref = batch_norm(from_vector(v, {4, 2}), {}, {}, {}, {}, true);
  for (DType d : {DType::float16, DType::bfloat16, DType::float32}) {
    Tensor x = from_vector(v, {4, 2}, TensorOptions{}.with_dtype(d));
    const Tensor rm = zeros({2}), rv = ones({2});  // float32 running stats
    auto [out, mean, invstd] = ops::batch_norm(x, rm, rv, {}, {}, true);
    EXPECT_EQ(out.dtype(), d);
    EXPECT_EQ(mean.dtype(), DType::float32);
    EXPECT_EQ(invstd.dtype(), DType::float32);
    EXPECT_TRUE(values_near(out, ops::to_vector(ref), d == DType::bfloat16 ? 2e-2 : 2e-3))
        << dtype_name(d);
    EXPECT_TRUE(values_near(rm, {0.25, 2.125}, 2e-3)) << dtype_name(d);
    x.requires_grad_(true);
    const Tensor w = ones({2}, TensorOptions{}.with_dtype(d).with_requires_grad());
    sum(batch_norm(x, {}, {}, w, {}, true)).backward();
    EXPECT_EQ(x.grad().dtype(), d);
    EXPECT_EQ(w.grad().dtype(), d);
    EXPECT_TRUE(values_near(x.grad(), std::vector<double>(8, 0.0), 2e-2)) << dtype_name(d);
  }
}

TEST(BatchNorm, Errors) {
  const Tensor x = zeros({2, 3, 5});
  std::string m =
      error_of<std::invalid_argument>([&] { batch_norm(x, zeros({4}), ones({4}), {}, {}, true); });
  EXPECT_TRUE(contains(m, "batch_norm: running_mean of shape [4]") && contains(m, "3 channels") &&
              contains(m, "[2, 3, 5]"))
      << m;
  m = error_of<std::invalid_argument>(
      [&] { batch_norm(x, zeros({3}), ones({3}), ones({2}), {}, true); });
  EXPECT_TRUE(contains(m, "batch_norm: weight of shape [2]") && contains(m, "[2, 3, 5]")) << m;
  m = error_of<std::invalid_argument>([&] { batch_norm(x, {}, {}, {}, zeros({3, 1}), true); });
  EXPECT_TRUE(contains(m, "batch_norm: bias of shape [3, 1]")) << m;
  m = error_of<std::invalid_argument>([&] {
    batch_norm(zeros({1, 3}), zeros({3}), ones({3}), {}, {}, true);
  });
  EXPECT_TRUE(contains(m, "batch_norm: Expected more than 1 value per channel when training") &&
              contains(m, "[1, 3]"))
      << m;
  m = error_of<std::invalid_argument>([&] {
    batch_norm(zeros({1, 3, 1, 1}), {}, {}, {}, {}, true);
  });
  EXPECT_TRUE(contains(m, "Expected more than 1 value per channel when training") &&
              contains(m, "[1, 3, 1, 1]"))
      << m;
  EXPECT_NO_THROW(batch_norm(zeros({1, 3, 2}), {}, {}, {}, {}, true));  // 2 values per channel
  m = error_of<std::invalid_argument>([&] { batch_norm(x, {}, {}, {}, {}, false); });
  EXPECT_TRUE(contains(m, "batch_norm") && contains(m, "evaluation mode")) << m;
  m = error_of<std::invalid_argument>([&] { batch_norm(x, zeros({3}), {}, {}, {}, true); });
  EXPECT_TRUE(contains(m, "batch_norm") && contains(m, "running_var")) << m;
  m = error_of<std::invalid_argument>([&] { batch_norm(zeros({3}), {}, {}, {}, {}, true); });
  EXPECT_TRUE(contains(m, "batch_norm") && contains(m, "[N, C]") && contains(m, "[3]")) << m;
}

TEST(BatchNorm, EmptyBatch) {
  const Tensor x = zeros({0, 3}, f64_grad);
  const Tensor w = ones({3}, f64_grad);
  const Tensor rm = zeros({3}, f64), rv = ones({3}, f64);
  const Tensor out = batch_norm(x, rm, rv, w, {}, true);
  EXPECT_EQ(out.sizes(), (Shape{0, 3}));
  EXPECT_TRUE(values_near(rm, {0, 0, 0}));  // nothing to learn from
  EXPECT_TRUE(values_near(rv, {1, 1, 1}));
  sum(out).backward();
  EXPECT_EQ(x.grad().sizes(), (Shape{0, 3}));
  EXPECT_TRUE(values_near(w.grad(), {0, 0, 0}));
}

}  // namespace
}  // namespace tally
