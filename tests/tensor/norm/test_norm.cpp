// Normalization ops (layer_norm, rms_norm, batch_norm), one file for every device
// (tests/testing/devices.h). On each device (the CPU in test_norm, CUDA in test_norm_cuda):
// hand-computed values, running-stat updates, eval mode, what backward saves, float64 gradient
// checks (affine or not, several normalized dims, non-contiguous inputs), 16-bit dtypes, empty
// inputs and errors naming op and shapes.
//
// On CUDA only, against the CPU kernels: every raw op forward and backward (dx, dweight, dbias)
// on fresh random data: float32, float64, and float16/bfloat16 inputs with float32 parameters;
// odd row lengths, 2-D/3-D/4-D batch_norm, running statistics after training steps,
// non-contiguous inputs, empty batches, autograd end to end, and where the kernels' scratch
// lands in the allocator. Those errors are max |gpu - cpu| / max |cpu| over a tensor (both read
// back as float64); for dx, whose terms can cancel (batch_norm over 2 values gives dx ~ 0), the
// denominator is at least the size of its terms, max |dy| * max |weight| * max |rstd|.
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <set>
#include <sstream>

#include "autograd/node.h"
#include "tensor/norm/autograd.h"
#include "tensor/norm/ops.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace testing;

// The cases that run on every device.
class Norm : public OnDevice {};
TALLY_ON_DEVICES(Norm);

// ---------------------------------------------------------------- layer_norm

TEST_P(Norm, LayerNormValues) {
  const Tensor x = from_vector({1, 2, 3, 4}, {4}, on({}));
  EXPECT_TRUE(values_near(
      layer_norm(x, {4}, {}, {}, 1e-12),
      {-1.3416407864993372, -0.447213595499779, 0.447213595499779, 1.3416407864993372}, 1e-6));
  const Tensor w = from_vector({1, 2, 0.5, -1}, {4}, on({}));
  const Tensor b = from_vector({0, 1, -1, 0.5}, {4}, on({}));
  EXPECT_TRUE(values_near(
      layer_norm(x, {4}, w, b, 1e-12),
      {-1.3416407864993372, 0.10557280900044197, -0.7763932022501105, -0.8416407864993372}, 1e-6));
  // bias without weight
  EXPECT_TRUE(values_near(
      layer_norm(x, {4}, {}, b, 1e-12),
      {-1.3416407864993372, 0.552786404500221, -0.552786404500221, 1.8416407864993372}, 1e-6));

  // Rows of a [2, 3] input, default eps = 1e-5; the raw op's mean and rstd are [2, 1].
  const Tensor x2 = from_vector({1, 2, 3, 2, 4, 8}, {2, 3}, on(f64));
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
  const Tensor x3 = from_vector({1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0, 6}, {2, 2, 3}, on(f64));
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

TEST_P(Norm, LayerNormSimpleGradients) {
  // sum(layer_norm(x)) does not depend on x; dbias counts the rows; dweight sums xhat.
  const Tensor x = leaf(from_vector({1, 2, 3, 2, 4, 8}, {2, 3}, f64));
  const Tensor w = leaf(from_vector({1, 1, 1}, {3}, f64));
  const Tensor b = leaf(from_vector({0, 0, 0}, {3}, f64));
  sum(layer_norm(x, {3}, w, b, 0.0)).backward();
  EXPECT_TRUE(values_near(x.grad(), {0, 0, 0, 0, 0, 0}, 1e-12));
  EXPECT_TRUE(values_near(b.grad(), {2, 2, 2}, 1e-12));
  EXPECT_TRUE(values_near(w.grad(),
                          {-1.2247448713915890 - 1.0690449676496976, 0.0 - 0.2672612419124244,
                           1.2247448713915890 + 1.3363062095621219},
                          1e-12));
}

TEST_P(Norm, LayerNormGradients) {
  const Tensor x = rand_input({3, 4}, -1, 1, 1);
  const Tensor x3 = rand_input({2, 2, 3}, -1, 1, 2);
  const Tensor w = rand_input({4}, 0.5, 1.5, 3);
  const Tensor b = rand_input({4}, -1, 1, 4);
  const Tensor w2 = rand_input({2, 3}, 0.5, 1.5, 5);
  const Tensor b2 = rand_input({2, 3}, -1, 1, 6);
  // no affine, last dim / last two dims
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& t) { return layer_norm(t[0], {4}); }, {x}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& t) {
                             return layer_norm(t[0], {2, 3});
                           },
                           {x3}));
  // affine
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return layer_norm(t[0], {4}, t[1], t[2]); }, {x, w, b}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& t) {
                             return layer_norm(t[0], {2, 3}, t[1], t[2]);
                           },
                           {x3, w2, b2}));
  // weight only, bias only
  EXPECT_TRUE(
      gradcheck_on(dev(), [](const TensorList& t) { return layer_norm(t[0], {4}, t[1]); }, {x, w}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return layer_norm(t[0], {4}, {}, t[1]); }, {x, b}));
  // non-contiguous input, normalized over 1 and 2 dims
  const Tensor xn = rand_input_noncontig({2, 3, 4}, 7);
  ASSERT_FALSE(xn.is_contiguous());
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return layer_norm(t[0], {4}, t[1], t[2]); }, {xn, w, b}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& t) {
                             return layer_norm(t[0], {3, 4});
                           },
                           {xn}));
  // a transposed view as input
  const Tensor xt = rand_input({4, 3}, -1, 1, 8);
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return layer_norm(t[0].t(), {4}, t[1]); }, {xt, w}));
  // only the parameters require grad (x a constant): dweight alone, dbias alone
  const Tensor xc = put(ops::rand({3, 4}, DType::float64));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return layer_norm(xc, {4}, t[0], t[1]); }, {w, b}));
  EXPECT_TRUE(
      gradcheck_on(dev(), [&](const TensorList& t) { return layer_norm(xc, {4}, {}, t[0]); }, {b}));
}

TEST_P(Norm, LayerNormSavesInputAndStatisticsNotOutput) {
  const Tensor x = leaf(rand_input({3, 4}, -1, 1, 1));
  const Tensor w = leaf(rand_input({4}, 0.5, 1.5, 2));
  const Tensor b = leaf(rand_input({4}, -1, 1, 3));
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
  const Tensor xc = put(ops::rand({3, 4}, DType::float64));
  EXPECT_TRUE(saved_by(layer_norm(xc, {4}, w.detach(), b)).empty());
  // Only weight: x, mean, rstd, but not the weight.
  EXPECT_EQ(saved_by(layer_norm(xc, {4}, w, b.detach())).size(), 3u);
}

TEST_P(Norm, LayerNormDtypes) {
  const std::vector<double> v = {1, 2, 3, 4, -1, 0, 5, 2};
  const Tensor ref = layer_norm(from_vector(v, {2, 4}), {4});
  for (DType d : {DType::float16, DType::bfloat16, DType::float32, DType::float64}) {
    const Tensor x = from_vector(v, {2, 4}, on(TensorOptions{}.with_dtype(d)));
    auto [out, mean, rstd] = ops::layer_norm(x, {4});
    EXPECT_EQ(out.dtype(), d);
    EXPECT_EQ(mean.dtype(), d == DType::float64 ? DType::float64 : DType::float32);
    EXPECT_EQ(rstd.dtype(), mean.dtype());
    EXPECT_TRUE(values_near(out, ops::to_vector(ref), d == DType::bfloat16 ? 2e-2 : 2e-3))
        << dtype_name(d);
  }
  // bfloat16 input with float32 parameters (mixed precision): gradients keep each dtype.
  Tensor x = from_vector(v, {2, 4}, on(TensorOptions{}.with_dtype(DType::bfloat16)));
  x.requires_grad_(true);
  const Tensor w = ones({4}, on(TensorOptions{}.with_requires_grad()));
  const Tensor b = zeros({4}, on(TensorOptions{}.with_requires_grad()));
  const Tensor out = layer_norm(x, {4}, w, b);
  EXPECT_EQ(out.dtype(), DType::bfloat16);
  sum(out).backward();
  EXPECT_EQ(x.grad().dtype(), DType::bfloat16);
  EXPECT_EQ(w.grad().dtype(), DType::float32);
  EXPECT_EQ(b.grad().dtype(), DType::float32);
  EXPECT_TRUE(values_near(b.grad(), {2, 2, 2, 2}, 1e-6));
  EXPECT_TRUE(values_near(x.grad(), std::vector<double>(8, 0.0), 2e-2));
}

// The same values, element for element, and the same dtype (to_vector reads 16-bit values
// exactly, so equal vectors are equal bits up to the sign of zero).
::testing::AssertionResult same_values(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.sizes() != b.sizes())
    return ::testing::AssertionFailure() << dtype_name(a.dtype()) << a.shape_string() << " vs "
                                         << dtype_name(b.dtype()) << b.shape_string();
  const std::vector<double> va = ops::to_vector(a), vb = ops::to_vector(b);
  for (size_t i = 0; i < va.size(); ++i)
    if (va[i] != vb[i])
      return ::testing::AssertionFailure() << "element " << i << ": " << va[i] << " vs " << vb[i];
  return ::testing::AssertionSuccess();
}

// out_dtype: a float32 input's output written in a 16-bit dtype is to(layer_norm(x), dtype)
// to the bit, on the warp kernel's rows (768, 64) and the block kernel's (50); the 16-bit
// gradient of such an output gives the gradients of its float32 copy to the bit. Pairs the
// kernels do not fuse (a 16-bit input to float32, float64 to bfloat16) convert afterwards.
TEST_P(Norm, LayerNormOutDtypeIsTheCastFused) {
  uint64_t seed = 40;
  for (const Shape& xs : {Shape{6, 768}, Shape{2, 3, 64}, Shape{7, 50}}) {
    const Shape ns{xs.back()};
    const auto f32 = [&](const Shape& s, double lo, double hi) {
      return ops::to(rand_tensor(s, DType::float32, ++seed, lo, hi), dev(), DType::float32);
    };
    const Tensor x = f32(xs, -3, 3), w = f32(ns, 0.5, 1.5), b = f32(ns, -1, 1);
    for (DType d : {DType::bfloat16, DType::float16}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(d) << ", rows of " << xs.back());
      auto [ref, mr, rr] = ops::layer_norm(x, ns, w, b, 1e-5);
      auto [out, m, r] = ops::layer_norm(x, ns, w, b, 1e-5, d);
      EXPECT_TRUE(same_values(out, ops::to(ref, d)));
      EXPECT_TRUE(same_values(m, mr));
      EXPECT_TRUE(same_values(r, rr));
      const Tensor dy = ops::to(f32(xs, -2, 2), d);
      for (std::array<bool, 3> mask :
           {std::array<bool, 3>{true, true, true}, {true, false, false}, {false, true, true}}) {
        auto [dx, dw, db] = ops::layer_norm_backward(dy, x, ns, m, r, w, mask);
        auto [dx32, dw32, db32] =
            ops::layer_norm_backward(ops::to(dy, DType::float32), x, ns, m, r, w, mask);
        EXPECT_EQ(dx.defined(), mask[0]);
        if (mask[0]) {
          EXPECT_TRUE(same_values(dx, dx32));
        }
        if (mask[1]) {
          EXPECT_TRUE(same_values(dw, dw32));
        }
        if (mask[2]) {
          EXPECT_TRUE(same_values(db, db32));
        }
      }
      // Through autograd: the gradients of the float32 output followed by the cast.
      const Tensor xl = x.detach().requires_grad_(true), wl = w.detach().requires_grad_(true),
                   bl = b.detach().requires_grad_(true);
      const Tensor x2 = x.detach().requires_grad_(true), w2 = w.detach().requires_grad_(true),
                   b2 = b.detach().requires_grad_(true);
      const Tensor fused = layer_norm(xl, ns, wl, bl, 1e-5, d);
      const Tensor composite = layer_norm(x2, ns, w2, b2, 1e-5).to(d);
      EXPECT_TRUE(same_values(fused, composite));
      sum(mul(fused, dy)).backward();
      sum(mul(composite, dy)).backward();
      EXPECT_TRUE(same_values(xl.grad(), x2.grad()));
      EXPECT_TRUE(same_values(wl.grad(), w2.grad()));
      EXPECT_TRUE(same_values(bl.grad(), b2.grad()));
    }
  }
  // Not fused: computed in the input's dtype, then converted.
  const Tensor xb = ops::to(rand_tensor({3, 40}, DType::float32, 7), dev(), DType::bfloat16);
  EXPECT_TRUE(same_values(std::get<0>(ops::layer_norm(xb, {40}, {}, {}, 1e-5, DType::float32)),
                          ops::to(std::get<0>(ops::layer_norm(xb, {40})), DType::float32)));
  const Tensor xd = ops::to(rand_tensor({3, 40}, DType::float32, 8), dev(), DType::float64);
  EXPECT_TRUE(same_values(std::get<0>(ops::layer_norm(xd, {40}, {}, {}, 1e-5, DType::bfloat16)),
                          ops::to(std::get<0>(ops::layer_norm(xd, {40})), DType::bfloat16)));
  const Tensor gb = ops::to(ops::ones({3, 40}, DType::float32, dev()), DType::float16);
  auto [sd, md, rd] = ops::layer_norm(xd, {40});
  EXPECT_TRUE(same_values(
      std::get<0>(ops::layer_norm_backward(gb, xd, {40}, md, rd, {}, {true, false, false})),
      std::get<0>(ops::layer_norm_backward(ops::to(gb, DType::float64), xd, {40}, md, rd, {},
                                           {true, false, false}))));
  const std::string m = error_of<std::invalid_argument>([&] {
    ops::layer_norm(ops::zeros({2, 3}, DType::float32, dev()), {3}, {}, {}, 1e-5, DType::int64);
  });
  EXPECT_TRUE(contains(m, "layer_norm: out_dtype") && contains(m, "int64") && contains(m, "[2, 3]"))
      << m;
}

TEST_P(Norm, LayerNormErrors) {
  const Tensor x = zeros({2, 3}, on({}));
  std::string m = error_of<std::invalid_argument>([&] { layer_norm(x, {4}); });
  EXPECT_TRUE(contains(m, "layer_norm") && contains(m, "[4]") && contains(m, "[2, 3]")) << m;
  m = error_of<std::invalid_argument>([&] { layer_norm(x, {2, 3, 1}); });
  EXPECT_TRUE(contains(m, "layer_norm") && contains(m, "[2, 3, 1]")) << m;
  m = error_of<std::invalid_argument>([&] { layer_norm(x, {}); });
  EXPECT_TRUE(contains(m, "layer_norm") && contains(m, "at least one dimension")) << m;
  m = error_of<std::invalid_argument>([&] { layer_norm(x, {3}, zeros({4}, on({}))); });
  EXPECT_TRUE(contains(m, "layer_norm: weight of shape [4]") && contains(m, "[3]")) << m;
  m = error_of<std::invalid_argument>([&] { layer_norm(x, {3}, {}, zeros({2, 3}, on({}))); });
  EXPECT_TRUE(contains(m, "layer_norm: bias of shape [2, 3]")) << m;
  m = error_of<std::invalid_argument>([&] { layer_norm(zeros({2, 3}, on(i64)), {3}); });
  EXPECT_TRUE(contains(m, "layer_norm") && contains(m, "int64")) << m;
  m = error_of<std::invalid_argument>([&] { rms_norm(x, {2}); });
  EXPECT_TRUE(contains(m, "rms_norm") && contains(m, "[2]") && contains(m, "[2, 3]")) << m;
}

TEST_P(Norm, LayerNormEmptyInput) {
  const Tensor x = zeros({0, 4}, on(f64_grad));
  const Tensor w = ones({4}, on(f64_grad));
  const Tensor out = layer_norm(x, {4}, w);
  EXPECT_EQ(out.sizes(), (Shape{0, 4}));
  sum(out).backward();
  EXPECT_EQ(x.grad().sizes(), (Shape{0, 4}));
  EXPECT_TRUE(values_near(w.grad(), {0, 0, 0, 0}));
}

// ---------------------------------------------------------------- rms_norm

TEST_P(Norm, RmsNormValuesAndGradients) {
  const Tensor x = from_vector({1, 2, 3, 4}, {4}, on(f64));
  EXPECT_TRUE(values_near(
      rms_norm(x, {4}, {}, 1e-6),
      {0.3651483473268884, 0.7302966946537768, 1.0954450419806652, 1.4605933893075536}, 1e-12));
  const Tensor x2 = from_vector({1, -2, 3, 4}, {4}, on(f64));
  const Tensor w = from_vector({1, 0.5, 2, -1}, {4}, on(f64));
  EXPECT_TRUE(values_near(
      rms_norm(x2, {4}, w, 1e-6),
      {0.3651483473268884, -0.3651483473268884, 2.1908900839613303, -1.4605933893075536}, 1e-12));
  // Default eps: float32 machine epsilon.
  EXPECT_TRUE(values_near(rms_norm(from_vector({3, 4}, {2}, on({})), {2}),
                          {3.0 / std::sqrt(12.5), 4.0 / std::sqrt(12.5)}, 1e-6));

  const Tensor xi = rand_input({3, 4}, -1, 1, 1);
  const Tensor xn = rand_input_noncontig({2, 3, 4}, 2);
  const Tensor wi = rand_input({4}, 0.5, 1.5, 3);
  const Tensor w2 = rand_input({3, 4}, 0.5, 1.5, 4);
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& t) { return rms_norm(t[0], {4}); }, {xi}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return rms_norm(t[0], {4}, t[1], 1e-5); }, {xi, wi}));
  EXPECT_TRUE(
      gradcheck_on(dev(), [](const TensorList& t) { return rms_norm(t[0], {4}, t[1]); }, {xn, wi}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& t) {
                             return rms_norm(t[0], {3, 4}, t[1]);
                           },
                           {xn, w2}));
  const Tensor out = rms_norm(leaf(xi), {4}, leaf(wi));
  EXPECT_EQ(out.autograd_meta()->grad_fn->name(), "RmsNormBackward");
  EXPECT_EQ(saved_by(out).size(), 3u);  // x, rstd, weight
}

// ---------------------------------------------------------------- batch_norm

TEST_P(Norm, BatchNormTrainingValuesAndRunningStats) {
  const Tensor x = from_vector({1, 10, 2, 20, 3, 60}, {3, 2}, on(f64));
  const Tensor rm = zeros({2}, on(f64));
  const Tensor rv = ones({2}, on(f64));
  const Tensor out = batch_norm(x, rm, rv, {}, {}, /*training=*/true);
  EXPECT_TRUE(values_near(out,
                          {-1.2247356859083902, -0.9258200898530505, 0.0, -0.46291004492652527,
                           1.2247356859083902, 1.3887301347795757},
                          1e-12));
  // momentum 0.1: running_mean = 0.1 * [2, 30]; running_var = 0.9 + 0.1 * unbiased [1, 700]
  EXPECT_TRUE(values_near(rm, {0.2, 3.0}, 1e-12));
  EXPECT_TRUE(values_near(rv, {1.0, 70.9}, 1e-12));

  // Affine, momentum 0.5, from the updated stats.
  const Tensor w = from_vector({2, -1}, {2}, on(f64));
  const Tensor b = from_vector({0.5, 1}, {2}, on(f64));
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
  const Tensor x4 = from_vector({1, 3, 0, 4, 5, 7, 2, 2}, {2, 2, 1, 2}, on(f64));
  const Tensor rm4 = zeros({2}, on(f64)), rv4 = ones({2}, on(f64));
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

TEST_P(Norm, BatchNormRunningStatsAreNotInTheGraph) {
  const Tensor x = leaf(rand_input({4, 3}, -1, 1, 1));
  const Tensor w = leaf(rand_input({3}, 0.5, 1.5, 2));
  const Tensor rm = zeros({3}, on(f64)), rv = ones({3}, on(f64));
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

// The running statistics move inside the statistics kernel when they are contiguous buffers
// of the stat dtype (float32 here); a float64 pair or a strided pair takes the four in-place
// ops. Both rules give the same numbers, and each bumps the buffers' versions.
TEST_P(Norm, BatchNormRunningStatsFusedOrNotAgree) {
  const Tensor x = put(ops::to(rand_input({8, 3, 4, 5}, -2, 3, 40), DType::float32));
  const Tensor rm = zeros({3}, on({})), rv = ones({3}, on({}));  // fused
  const Tensor rm64 = zeros({3}, on(f64)), rv64 = ones({3}, on(f64));
  const Tensor buf_m = zeros({3, 2}, on({})), buf_v = ones({3, 2}, on({}));
  const Tensor rms = ops::select(buf_m, 1, 0), rvs = ops::select(buf_v, 1, 0);  // stride 2
  ASSERT_FALSE(rms.is_contiguous());
  for (const double momentum : {0.1, 0.35}) {
    const uint64_t v0 = rm.storage().version(), v1 = rv.storage().version();
    batch_norm(x, rm, rv, {}, {}, true, momentum);
    EXPECT_GT(rm.storage().version(), v0);
    EXPECT_GT(rv.storage().version(), v1);
    batch_norm(x, rm64, rv64, {}, {}, true, momentum);
    batch_norm(x, rms, rvs, {}, {}, true, momentum);
  }
  const std::vector<double> m = ops::to_vector(rm), v = ops::to_vector(rv);
  EXPECT_TRUE(values_near(rm64, m, 1e-6));
  EXPECT_TRUE(values_near(rv64, v, 1e-5));
  EXPECT_TRUE(values_near(rms, m, 1e-6));
  EXPECT_TRUE(values_near(rvs, v, 1e-5));
  // The other column of the strided buffers is untouched.
  EXPECT_TRUE(values_near(ops::select(buf_m, 1, 1), {0, 0, 0}));
  EXPECT_TRUE(values_near(ops::select(buf_v, 1, 1), {1, 1, 1}));
  // Against the float64 formula from the batch itself: momentum 0.1, then 0.35.
  const std::vector<double> xs = ops::to_vector(x);
  for (int64_t ch = 0; ch < 3; ++ch) {
    double s = 0, ss = 0;
    int64_t k = 0;
    for (int64_t b = 0; b < 8; ++b)
      for (int64_t i = 0; i < 20; ++i, ++k) s += xs[static_cast<size_t>((b * 3 + ch) * 20 + i)];
    const double mu = s / static_cast<double>(k);
    for (int64_t b = 0; b < 8; ++b)
      for (int64_t i = 0; i < 20; ++i) {
        const double d = xs[static_cast<size_t>((b * 3 + ch) * 20 + i)] - mu;
        ss += d * d;
      }
    const double var = ss / static_cast<double>(k - 1);
    double em = 0, ev = 1;
    for (const double mo : {0.1, 0.35}) {
      em = (1 - mo) * em + mo * mu;
      ev = (1 - mo) * ev + mo * var;
    }
    EXPECT_NEAR(m[static_cast<size_t>(ch)], em, 1e-5) << "channel " << ch;
    EXPECT_NEAR(v[static_cast<size_t>(ch)], ev, 1e-4) << "channel " << ch;
  }
}

TEST_P(Norm, BatchNormEvalUsesRunningStats) {
  const Tensor x = from_vector({1, 2, 3, 5}, {2, 2}, on(f64));
  const Tensor rm = from_vector({1, 2}, {2}, on(f64));
  const Tensor rv = from_vector({4, 9}, {2}, on(f64));
  const Tensor w = from_vector({2, 3}, {2}, on(f64));
  const Tensor b = from_vector({1, -1}, {2}, on(f64));
  EXPECT_TRUE(values_near(batch_norm(x, rm, rv, w, b, false, 0.1, 0.0), {1, -1, 3, 2}, 1e-12));
  EXPECT_TRUE(values_near(batch_norm(x, rm, rv, {}, {}, false, 0.1, 0.0), {0, 0, 1, 1}, 1e-12));
  // Eval mode never touches the running stats, even with a single value per channel.
  EXPECT_TRUE(
      values_near(batch_norm(from_vector({1, 2}, {1, 2}, on(f64)), rm, rv, {}, {}, false, 0.1, 0.0),
                  {0, 0}, 1e-12));
  EXPECT_TRUE(values_near(rm, {1, 2}));
  EXPECT_TRUE(values_near(rv, {4, 9}));

  // Eval backward: dx = dy * weight * invstd; only invstd and weight saved for it.
  const Tensor xg = leaf(from_vector({1, 2, 3, 5}, {2, 2}, f64));
  const Tensor out = batch_norm(xg, rm, rv, w, b, false, 0.1, 0.0);
  EXPECT_EQ(saved_by(out).size(), 2u);
  sum(out).backward();
  EXPECT_TRUE(values_near(xg.grad(), {1, 1, 1, 1}, 1e-12));  // 2 / 2, 3 / 3
}

TEST_P(Norm, BatchNormGradients) {
  const Tensor x2 = rand_input({4, 3}, -1, 1, 1);
  const Tensor x4 = rand_input({2, 3, 2, 2}, -1, 1, 2);
  const Tensor x3n = rand_input_noncontig({3, 2, 4}, 3);
  const Tensor w = rand_input({3}, 0.5, 1.5, 4);
  const Tensor b = rand_input({3}, -1, 1, 5);
  const Tensor w2 = rand_input({2}, 0.5, 1.5, 6);
  const Tensor b2 = rand_input({2}, -1, 1, 7);
  // Running statistics and constant inputs live on the device under test.
  const Tensor rm = put(ops::mul(ops::rand({3}, DType::float64), 0.5));
  const Tensor rv = put(ops::add(ops::rand({3}, DType::float64), 0.5));
  // training, 2-D and 4-D, with and without affine, with and without running stats
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return batch_norm(t[0], {}, {}, t[1], t[2], true); },
      {x2, w, b}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& t) {
                             return batch_norm(t[0], ops::zeros({3}, DType::float64, dev()),
                                               ops::ones({3}, DType::float64, dev()), t[1], t[2],
                                               true);
                           },
                           {x4, w, b}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return batch_norm(t[0], {}, {}, {}, {}, true); }, {x4}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return batch_norm(t[0], {}, {}, t[1], t[2], true); },
      {x3n, w2, b2}));
  // eval, 2-D and 4-D
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return batch_norm(t[0], rm, rv, t[1], t[2], false); },
      {x2, w, b}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return batch_norm(t[0], rm, rv, t[1], t[2], false); },
      {x4, w, b}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return batch_norm(t[0], rm, rv, {}, {}, false); }, {x4}));
  // only the parameters require grad
  const Tensor xc = put(ops::rand({2, 3, 2}, DType::float64));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return batch_norm(xc, {}, {}, t[0], t[1], true); },
      {w, b}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return batch_norm(xc, {}, {}, {}, t[0], true); }, {b}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return batch_norm(xc, rm, rv, t[0], {}, false); }, {w}));
}

TEST_P(Norm, BatchNormDtypes) {
  const std::vector<double> v = {1, 10, 2, 20, 3, 60, 4, -5};
  const Tensor ref = batch_norm(from_vector(v, {4, 2}), {}, {}, {}, {}, true);
  for (DType d : {DType::float16, DType::bfloat16, DType::float32}) {
    Tensor x = from_vector(v, {4, 2}, on(TensorOptions{}.with_dtype(d)));
    const Tensor rm = zeros({2}, on({})), rv = ones({2}, on({}));  // float32 running stats
    auto [out, mean, invstd] = ops::batch_norm(x, rm, rv, {}, {}, true);
    EXPECT_EQ(out.dtype(), d);
    EXPECT_EQ(mean.dtype(), DType::float32);
    EXPECT_EQ(invstd.dtype(), DType::float32);
    EXPECT_TRUE(values_near(out, ops::to_vector(ref), d == DType::bfloat16 ? 2e-2 : 2e-3))
        << dtype_name(d);
    EXPECT_TRUE(values_near(rm, {0.25, 2.125}, 2e-3)) << dtype_name(d);
    x.requires_grad_(true);
    const Tensor w = ones({2}, on(TensorOptions{}.with_dtype(d).with_requires_grad()));
    sum(batch_norm(x, {}, {}, w, {}, true)).backward();
    EXPECT_EQ(x.grad().dtype(), d);
    EXPECT_EQ(w.grad().dtype(), d);
    EXPECT_TRUE(values_near(x.grad(), std::vector<double>(8, 0.0), 2e-2)) << dtype_name(d);
  }
}

TEST_P(Norm, BatchNormErrors) {
  const Tensor x = zeros({2, 3, 5}, on({}));
  std::string m = error_of<std::invalid_argument>(
      [&] { batch_norm(x, zeros({4}, on({})), ones({4}, on({})), {}, {}, true); });
  EXPECT_TRUE(contains(m, "batch_norm: running_mean of shape [4]") && contains(m, "3 channels") &&
              contains(m, "[2, 3, 5]"))
      << m;
  m = error_of<std::invalid_argument>(
      [&] { batch_norm(x, zeros({3}, on({})), ones({3}, on({})), ones({2}, on({})), {}, true); });
  EXPECT_TRUE(contains(m, "batch_norm: weight of shape [2]") && contains(m, "[2, 3, 5]")) << m;
  m = error_of<std::invalid_argument>([&] {
    batch_norm(x, {}, {}, {}, zeros({3, 1}, on({})), true);
  });
  EXPECT_TRUE(contains(m, "batch_norm: bias of shape [3, 1]")) << m;
  m = error_of<std::invalid_argument>([&] {
    batch_norm(zeros({1, 3}, on({})), zeros({3}, on({})), ones({3}, on({})), {}, {}, true);
  });
  EXPECT_TRUE(contains(m, "batch_norm: Expected more than 1 value per channel when training") &&
              contains(m, "[1, 3]"))
      << m;
  m = error_of<std::invalid_argument>([&] {
    batch_norm(zeros({1, 3, 1, 1}, on({})), {}, {}, {}, {}, true);
  });
  EXPECT_TRUE(contains(m, "Expected more than 1 value per channel when training") &&
              contains(m, "[1, 3, 1, 1]"))
      << m;
  EXPECT_NO_THROW(
      batch_norm(zeros({1, 3, 2}, on({})), {}, {}, {}, {}, true));  // 2 values per channel
  m = error_of<std::invalid_argument>([&] { batch_norm(x, {}, {}, {}, {}, false); });
  EXPECT_TRUE(contains(m, "batch_norm") && contains(m, "evaluation mode")) << m;
  m = error_of<std::invalid_argument>([&] { batch_norm(x, zeros({3}, on({})), {}, {}, {}, true); });
  EXPECT_TRUE(contains(m, "batch_norm") && contains(m, "running_var")) << m;
  m = error_of<std::invalid_argument>(
      [&] { batch_norm(zeros({3}, on({})), {}, {}, {}, {}, true); });
  EXPECT_TRUE(contains(m, "batch_norm") && contains(m, "[N, C]") && contains(m, "[3]")) << m;
}

TEST_P(Norm, BatchNormEmptyBatch) {
  const Tensor x = zeros({0, 3}, on(f64_grad));
  const Tensor w = ones({3}, on(f64_grad));
  const Tensor rm = zeros({3}, on(f64)), rv = ones({3}, on(f64));
  const Tensor out = batch_norm(x, rm, rv, w, {}, true);
  EXPECT_EQ(out.sizes(), (Shape{0, 3}));
  EXPECT_TRUE(values_near(rm, {0, 0, 0}));  // nothing to learn from
  EXPECT_TRUE(values_near(rv, {1, 1, 1}));
  sum(out).backward();
  EXPECT_EQ(x.grad().sizes(), (Shape{0, 3}));
  EXPECT_TRUE(values_near(w.grad(), {0, 0, 0}));
}

// ================================================================ CUDA against the CPU

// The output masks (dx, dweight, dbias) a three-gradient backward is checked for.
const std::array<bool, 3> kMasks3[] = {{true, true, true},
                                       {true, false, false},
                                       {false, true, false},
                                       {false, false, true},
                                       {false, true, true}};

Pair undefined_both() {
  return {Tensor(), Tensor()};
}

// add_rms_norm and rms_norm's out_dtype: add_layer_norm's contract without centering (LLaMA's
// post-attention norm), the gradients float64 finite differences'.
TEST_P(Norm, AddRmsNormIsTheTwoOps) {
  const Tensor x = rand_input({3, 5, 8}, -1, 1, 31), r = rand_input({3, 5, 8}, -1, 1, 32);
  const Tensor w = rand_input({8}, 0.5, 1.5, 33);
  {
    NoGradGuard ng;
    auto [s, h] = add_rms_norm(x, r, {8}, w, 1e-6);
    EXPECT_EQ(max_abs_diff(s, ops::add(x, r)), 0.0);
    EXPECT_LT(max_abs_diff(h, rms_norm(ops::add(x, r), {8}, w, 1e-6)), 1e-12);
  }
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& t) {
                             auto [s, h] = add_rms_norm(t[0], t[1], {8}, t[2]);
                             return add(mul(s, 0.5), h);  // both outputs' gradients meet in d(sum)
                           },
                           {x, r, w}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return add_rms_norm(t[0], t[1], {8}).second; }, {x, r}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return add_rms_norm(t[0], t[1], {8}).first; }, {x, r}));
  // float32 x, bfloat16 residual and out (LLaMA's layers under autocast): the sum float32, the
  // out the bits of rms_norm(sum) converted; rms_norm's own out_dtype likewise.
  const Tensor x32 = ops::to(x, DType::float32), r16 = ops::to(r, DType::bfloat16);
  const Tensor w32 = ops::to(w, DType::float32);
  auto [s32, o16, rs32] = ops::add_rms_norm(x32, r16, {8}, w32, 1e-5, DType::bfloat16);
  EXPECT_EQ(s32.dtype(), DType::float32);
  EXPECT_EQ(o16.dtype(), DType::bfloat16);
  EXPECT_EQ(max_abs_diff(s32, ops::add(x32, r16)), 0.0);
  const Tensor full = std::get<0>(ops::rms_norm(ops::add(x32, r16), {8}, w32, 1e-5));
  EXPECT_EQ(max_abs_diff(o16, ops::to(full, DType::bfloat16)), 0.0);
  EXPECT_EQ(max_abs_diff(std::get<0>(ops::rms_norm(s32, {8}, w32, 1e-5, DType::bfloat16)), o16),
            0.0);
  // Its backward: d(sum) equals rms_norm_backward's plus the sum's own gradient; the bfloat16
  // residual's copy is to(d_x)'s bits.
  const Tensor g16 = ops::to(rand_input({3, 5, 8}, -1, 1, 34), DType::bfloat16);
  const Tensor gs = ops::to(rand_input({3, 5, 8}, -1, 1, 35), DType::float32);
  auto [d_x, d_r, d_w] =
      ops::add_rms_norm_backward(gs, g16, s32, {8}, rs32, w32, DType::bfloat16, {true, true, true});
  auto [ref_dx, ref_dw] =
      ops::rms_norm_backward(ops::to(g16, DType::float32), s32, {8}, rs32, w32, {true, true});
  EXPECT_LT(max_abs_diff(d_x, ops::add(ref_dx, gs)), 1e-5);
  EXPECT_EQ(max_abs_diff(d_r, ops::to(d_x, DType::bfloat16)), 0.0);
  EXPECT_LT(max_abs_diff(d_w, ref_dw), 1e-5);
  testing::expect_error<std::invalid_argument>(
      [&] { ops::add_rms_norm(x, ops::narrow(r, 2, 0, 4), {8}); },
      {"add_rms_norm", "residual of shape [3, 5, 4]", "[3, 5, 8]"});
}

// add_layer_norm: the same values as add, then layer_norm (the sum bit for bit), and its
// gradients float64 finite differences'; a float32 input with a 16-bit residual and output
// (GPT's blocks under autocast) and a wider residual (the composite) keep add's dtypes.
TEST_P(Norm, AddLayerNormIsTheTwoOps) {
  const Tensor x = rand_input({3, 5, 8}, -1, 1, 21), r = rand_input({3, 5, 8}, -1, 1, 22);
  const Tensor w = rand_input({8}, 0.5, 1.5, 23), b = rand_input({8}, -1, 1, 24);
  {
    NoGradGuard ng;
    auto [s, h] = add_layer_norm(x, r, {8}, w, b);
    EXPECT_EQ(max_abs_diff(s, ops::add(x, r)), 0.0);
    EXPECT_LT(max_abs_diff(h, layer_norm(ops::add(x, r), {8}, w, b)), 1e-12);
  }
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& t) {
                             auto [s, h] = add_layer_norm(t[0], t[1], {8}, t[2], t[3]);
                             return add(mul(s, 0.5), h);  // both outputs' gradients meet in d(sum)
                           },
                           {x, r, w, b}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return add_layer_norm(t[0], t[1], {8}).second; }, {x, r}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return add_layer_norm(t[0], t[1], {8}).first; }, {x, r}));
  // float32 x, bfloat16 residual, bfloat16 out: the sum float32, as add's.
  const Tensor x32 = ops::to(x, DType::float32), r16 = ops::to(r, DType::bfloat16);
  auto [s32, o32, m32, rs32] =
      ops::add_layer_norm(x32, r16, {8}, ops::to(w, DType::float32), {}, 1e-5, DType::bfloat16);
  EXPECT_EQ(s32.dtype(), DType::float32);
  EXPECT_EQ(o32.dtype(), DType::bfloat16);
  EXPECT_EQ(max_abs_diff(s32, ops::add(x32, r16)), 0.0);
  const Tensor ref = std::get<0>(ops::layer_norm(
      ops::add(x32, r16), {8}, ops::to(w, DType::float32), {}, 1e-5, DType::bfloat16));
  EXPECT_EQ(max_abs_diff(o32, ref), 0.0);
  // Its backward: d(sum) in float32 and, for the bfloat16 residual, the same values in
  // bfloat16 from the same pass; another 16-bit dtype is converted. Both are to(d_x)'s bits.
  const Tensor g16 = ops::to(rand_input({3, 5, 8}, -1, 1, 25), DType::bfloat16);
  const Tensor gs = ops::to(rand_input({3, 5, 8}, -1, 1, 26), DType::float32);
  for (const DType rd : {DType::bfloat16, DType::float16, DType::float32}) {
    SCOPED_TRACE(dtype_name(rd));
    auto [d_x, d_r, d_w, d_b] = ops::add_layer_norm_backward(
        gs, g16, s32, {8}, m32, rs32, ops::to(w, DType::float32), rd, {true, true, false, false});
    const Tensor ref_dx = std::get<0>(ops::layer_norm_backward(
        g16, s32, {8}, m32, rs32, ops::to(w, DType::float32), {true, false, false}, gs));
    EXPECT_EQ(max_abs_diff(d_x, ref_dx), 0.0);
    EXPECT_EQ(d_r.dtype(), rd);
    EXPECT_EQ(max_abs_diff(d_r, ops::to(ref_dx, rd)), 0.0);
    EXPECT_FALSE(d_w.defined() || d_b.defined());
  }
  // Named copies: clang 14 (CI's ASan build) refuses to capture a structured binding.
  const Tensor s = s32, m = m32, rs = rs32;
  testing::expect_error<std::invalid_argument>(
      [&] {
        ops::add_layer_norm_backward(gs, g16, s, {8}, m, rs, {}, DType::int64,
                                     {true, true, false, false});
      },
      {"add_layer_norm_backward", "int64"});
  // A wider residual: add's promotion, then layer_norm.
  auto [sw, ow, mw, rw] = ops::add_layer_norm(r16, x32, {8});
  EXPECT_EQ(sw.dtype(), DType::float32);
  EXPECT_EQ(max_abs_diff(sw, ops::add(r16, x32)), 0.0);
  // Errors name the op and the shapes.
  testing::expect_error<std::invalid_argument>(
      [&] { ops::add_layer_norm(x, ops::narrow(r, 2, 0, 4), {8}); },
      {"add_layer_norm", "residual of shape [3, 5, 4]", "[3, 5, 8]"});
  testing::expect_error<std::invalid_argument>([&] { ops::add_layer_norm(x, r, {5}); },
                                               {"add_layer_norm", "normalized_shape"});
}

// The cases that compare a device's kernels with the CPU's (accelerators only).
class NormVsCpu : public VsCpu {};
TALLY_VS_CPU(NormVsCpu);

// add_layer_norm on the device against the CPU: the sum, the output and statistics, and the
// backward with the sum's gradient added (the warp kernel's rows, GPT's 768 float32 with a
// bfloat16 residual; and rows that take the block kernels).
TEST_P(NormVsCpu, AddLayerNormMatchesTheCpu) {
  uint64_t seed = 1500;
  struct Case {
    Shape xs;
    DType d, rd, od;
  };
  const Case cases[] = {{{4, 16, 768}, DType::float32, DType::bfloat16, DType::bfloat16},
                        {{4, 16, 768}, DType::float32, DType::float32, DType::float32},
                        {{64, 768}, DType::bfloat16, DType::bfloat16, DType::bfloat16},
                        {{37, 50}, DType::float32, DType::float32, DType::float32},
                        {{9, 5000}, DType::float32, DType::bfloat16, DType::bfloat16},
                        {{300, 1026}, DType::float64, DType::float64, DType::float64}};
  for (const Case& c : cases) {
    const std::string extra =
        std::string(" residual ") + dtype_name(c.rd) + " out " + dtype_name(c.od);
    SCOPED_TRACE(case_label("add_layer_norm", c.xs, c.d, extra.c_str()));
    const int64_t cols = c.xs.back();
    const Pair x = both(c.xs, c.d, seed += 10, false), r = both(c.xs, c.rd, seed + 1, false);
    const Pair w = both({cols}, ops::norm_stat_dtype(c.d), seed + 2, false, 0.5, 1.5);
    const Pair b = both({cols}, ops::norm_stat_dtype(c.d), seed + 3, false, -1, 1);
    auto [sc, oc, mc, rc] = ops::add_layer_norm(x.cpu, r.cpu, {cols}, w.cpu, b.cpu, 1e-5, c.od);
    auto [sg, og, mg, rg] = ops::add_layer_norm(x.gpu, r.gpu, {cols}, w.gpu, b.gpu, 1e-5, c.od);
    const NormTol tol = norm_tol(c.od == DType::float64 ? c.d : c.od);
    EXPECT_TRUE(close_to_cpu(sg, sc, 0.0, "sum"));
    EXPECT_TRUE(close_to_cpu(og, oc, tol.elem, "out"));
    EXPECT_TRUE(close_to_cpu(mg, mc, norm_tol(c.d).elem, "mean"));
    EXPECT_TRUE(close_to_cpu(rg, rc, norm_tol(c.d).elem, "rstd"));
    const Pair dy = both(c.xs, c.od, seed + 4, false), ds = both(c.xs, c.d, seed + 5, false);
    auto [dxc, dwc, dbc] =
        ops::layer_norm_backward(dy.cpu, sc, {cols}, mc, rc, w.cpu, kMasks3[0], ds.cpu);
    auto [dxg, dwg, dbg] =
        ops::layer_norm_backward(dy.gpu, sg, {cols}, mg, rg, w.gpu, kMasks3[0], ds.gpu);
    const NormTol dt = norm_tol(c.d);
    EXPECT_TRUE(close_to_cpu(dxg, dxc, dt.elem, "dx + d(sum)", norm_dx_floor(dy.cpu, w.cpu, rc)));
    EXPECT_TRUE(close_to_cpu(dwg, dwc, dt.red, "dweight"));
    EXPECT_TRUE(close_to_cpu(dbg, dbc, dt.red, "dbias"));
    // add_layer_norm_backward: d(sum) once more in the residual's dtype, to(d_x)'s bits on
    // each device (GPT's bfloat16 branch: written by the same kernel).
    const auto fused = [&](const char* where, const Tensor& g_sum, const Tensor& g_out,
                           const Tensor& sum, const Tensor& m, const Tensor& rs, const Tensor& wt,
                           const Tensor& dx, const Tensor& dw, const Tensor& db) {
      SCOPED_TRACE(where);
      auto [d_x, d_r, d_w, d_b] = ops::add_layer_norm_backward(g_sum, g_out, sum, {cols}, m, rs, wt,
                                                               c.rd, {true, true, true, true});
      EXPECT_EQ(max_abs_diff(d_x, dx), 0.0);
      EXPECT_EQ(d_r.dtype(), c.rd);
      EXPECT_EQ(max_abs_diff(d_r, ops::to(d_x, c.rd)), 0.0);
      EXPECT_EQ(max_abs_diff(d_w, dw), 0.0);
      EXPECT_EQ(max_abs_diff(d_b, db), 0.0);
    };
    fused("cpu", ds.cpu, dy.cpu, sc, mc, rc, w.cpu, dxc, dwc, dbc);
    fused("device", ds.gpu, dy.gpu, sg, mg, rg, w.gpu, dxg, dwg, dbg);
  }
}

// ---------------------------------------------------------------- layer_norm / rms_norm

// x's shape, how many of its last dims are normalized, weight, bias, a non-contiguous input.
struct RowNormCase {
  Shape xs;
  size_t k;
  bool affine, with_bias, noncontig;
};

// Forward and backward of layer_norm (rms = false) or rms_norm (rms = true) on x of shape
// c.xs normalized over its last c.k dims, for every output mask of the backward.
void check_row_norm(bool rms, const RowNormCase& c, DType d, uint64_t seed) {
  const auto& [xs, k, affine, with_bias, noncontig] = c;
  const char* op = rms ? "rms_norm" : "layer_norm";
  const std::string where = case_label(op, xs, d, noncontig ? " noncontig" : "") +
                            (affine ? " affine" : "") + (with_bias ? " bias" : "");
  SCOPED_TRACE(where);
  const NormTol tol = norm_tol(d);
  const DType pd = ops::norm_stat_dtype(d);
  const Shape ns(xs.end() - static_cast<std::ptrdiff_t>(k), xs.end());
  const Pair x = both(xs, d, seed, noncontig);
  const Pair w = affine ? both(ns, pd, seed + 1, false, 0.5, 1.5) : undefined_both();
  const Pair b = with_bias ? both(ns, pd, seed + 2, false, -1, 1) : undefined_both();
  const Pair dy = both(xs, d, seed + 3, noncontig);

  Tensor mean_c, mean_g, rstd_c, rstd_g;
  if (rms) {
    const double eps = 1e-6;
    auto [oc, rc] = ops::rms_norm(x.cpu, ns, w.cpu, eps);
    auto [og, rg] = ops::rms_norm(x.gpu, ns, w.gpu, eps);
    EXPECT_TRUE(close_to_cpu(og, oc, tol.elem, "out"));
    EXPECT_TRUE(close_to_cpu(rg, rc, tol.elem, "rstd"));
    rstd_c = rc;
    rstd_g = rg;
    // default eps (the dtype's machine epsilon)
    EXPECT_TRUE(close_to_cpu(std::get<0>(ops::rms_norm(x.gpu, ns, w.gpu)),
                             std::get<0>(ops::rms_norm(x.cpu, ns, w.cpu)), tol.elem,
                             "out (default eps)"));
    for (std::array<bool, 2> mask :
         {std::array<bool, 2>{true, true}, {true, false}, {false, true}}) {
      SCOPED_TRACE(::testing::Message() << "mask " << mask[0] << mask[1]);
      auto [dxc, dwc] = ops::rms_norm_backward(dy.cpu, x.cpu, ns, rstd_c, w.cpu, mask);
      auto [dxg, dwg] = ops::rms_norm_backward(dy.gpu, x.gpu, ns, rstd_g, w.gpu, mask);
      EXPECT_TRUE(close_to_cpu(dxg, dxc, tol.elem, "dx", norm_dx_floor(dy.cpu, w.cpu, rstd_c)));
      EXPECT_TRUE(close_to_cpu(dwg, dwc, tol.red, "dweight"));
    }
    return;
  }
  auto [oc, mc, rc] = ops::layer_norm(x.cpu, ns, w.cpu, b.cpu, 1e-5);
  auto [og, mg, rg] = ops::layer_norm(x.gpu, ns, w.gpu, b.gpu, 1e-5);
  EXPECT_TRUE(close_to_cpu(og, oc, tol.elem, "out"));
  EXPECT_TRUE(close_to_cpu(mg, mc, tol.elem, "mean"));
  EXPECT_TRUE(close_to_cpu(rg, rc, tol.elem, "rstd"));
  for (std::array<bool, 3> mask : kMasks3) {
    SCOPED_TRACE(::testing::Message() << "mask " << mask[0] << mask[1] << mask[2]);
    auto [dxc, dwc, dbc] = ops::layer_norm_backward(dy.cpu, x.cpu, ns, mc, rc, w.cpu, mask);
    auto [dxg, dwg, dbg] = ops::layer_norm_backward(dy.gpu, x.gpu, ns, mg, rg, w.gpu, mask);
    EXPECT_TRUE(close_to_cpu(dxg, dxc, tol.elem, "dx", norm_dx_floor(dy.cpu, w.cpu, rc)));
    EXPECT_TRUE(close_to_cpu(dwg, dwc, tol.red, "dweight"));
    EXPECT_TRUE(close_to_cpu(dbg, dbc, tol.red, "dbias"));
  }
}

// A [rows, cols] input in dtype d, normalized over its rows, contiguous: affine (layer_norm
// with a bias) unless plain.
struct RowsCase {
  int64_t rows, cols;
  DType d;
  bool plain = false;
};

// check_row_norm on each case, seeded ++seed.
void check_row_norms(bool rms, std::initializer_list<RowsCase> cases, uint64_t& seed) {
  for (const RowsCase& c : cases)
    check_row_norm(rms, {{c.rows, c.cols}, 1, !c.plain, !rms && !c.plain, false}, c.d, ++seed);
}

TEST_P(NormVsCpu, LayerNormMatchesTheCpu) {
  const RowNormCase cases[] = {
      // GPT-2 rows, odd row lengths, one row, several normalized dims
      {{4, 16, 768}, 1, true, true, false},
      {{37, 50}, 1, true, true, false},
      {{29, 3}, 1, true, true, false},
      {{1, 333}, 1, true, false, false},
      {{6, 5, 7, 9}, 2, true, true, false},
      // no affine; bias only
      {{13, 100}, 1, false, false, false},
      {{13, 100}, 1, false, true, false},
      // non-contiguous input and grad_output
      {{24, 65}, 1, true, true, true},
  };
  uint64_t seed = 100;
  for (DType d : kFloatDtypes)
    for (const RowNormCase& c : cases) check_row_norm(false, c, d, seed += 10);
}

TEST_P(NormVsCpu, LayerNormManyRowsAndLongRows) {
  uint64_t seed = 0;
  check_row_norms(false,
                  {// Many more rows than blocks (each block accumulates dweight/dbias over
                   // several rows).
                   {4100, 50, DType::float32},
                   {9001, 3, DType::float32},
                   {2048, 768, DType::float32},
                   {2048, 768, DType::bfloat16},
                   {3000, 129, DType::float64},
                   // Rows too long for the shared-memory accumulators (float32 > 4096,
                   // float64 > 2048).
                   {70, 5000, DType::float32},
                   {70, 3001, DType::float64},
                   {33, 4500, DType::float16}},
                  seed);
}

// The backward's register kernel takes rows of at most 512 aligned 16-byte packs (2048 float32,
// 4096 bfloat16 columns); a longer row, a row not of whole packs or a misaligned tensor takes the
// general kernel. Both sides of each edge, and inputs one element off their allocation's start.
TEST_P(NormVsCpu, LayerNormBackwardPackedRowsAndTheirEdges) {
  uint64_t seed = 900;
  check_row_norms(false,
                  {{300, 2048, DType::float32},
                   {300, 2052, DType::float32},
                   {100, 4096, DType::bfloat16},
                   {100, 4104, DType::bfloat16},
                   {300, 36, DType::float16, /*plain=*/true},
                   {300, 1024, DType::float64},
                   {300, 1026, DType::float64}},
                  seed);
  const auto shifted = [](const Tensor& flat, int64_t rows, int64_t cols) {
    return ops::view(ops::narrow(flat, 0, 1, rows * cols), {rows, cols});
  };
  for (DType d : {DType::float32, DType::bfloat16}) {
    SCOPED_TRACE(dtype_name(d));
    const int64_t rows = 64, cols = 768;
    const Pair xf = both({rows * cols + 1}, d, ++seed), gf = both({rows * cols + 1}, d, ++seed);
    const Pair w = both({cols}, ops::norm_stat_dtype(d), ++seed, false, 0.5, 1.5);
    const Tensor xc = shifted(xf.cpu, rows, cols), xg = shifted(xf.gpu, rows, cols);
    const Tensor gc = shifted(gf.cpu, rows, cols), gg = shifted(gf.gpu, rows, cols);
    ASSERT_TRUE(xg.is_contiguous());
    auto [oc, mc, rc] = ops::layer_norm(xc, {cols}, w.cpu, {}, 1e-5);
    auto [og, mg, rg] = ops::layer_norm(xg, {cols}, w.gpu, {}, 1e-5);
    auto [dxc, dwc, dbc] = ops::layer_norm_backward(gc, xc, {cols}, mc, rc, w.cpu, kMasks3[0]);
    auto [dxg, dwg, dbg] = ops::layer_norm_backward(gg, xg, {cols}, mg, rg, w.gpu, kMasks3[0]);
    const NormTol tol = norm_tol(d);
    EXPECT_TRUE(close_to_cpu(dxg, dxc, tol.elem, "dx", norm_dx_floor(gc, w.cpu, rc)));
    EXPECT_TRUE(close_to_cpu(dwg, dwc, tol.red, "dweight"));
    EXPECT_TRUE(close_to_cpu(dbg, dbc, tol.red, "dbias"));
  }
}

TEST_P(NormVsCpu, RmsNormMatchesTheCpu) {
  const RowNormCase cases[] = {
      {{4, 16, 768}, 1, true, false, false}, {{37, 50}, 1, true, false, false},
      {{29, 3}, 1, true, false, false},      {{6, 5, 7, 9}, 2, true, false, false},
      {{13, 100}, 1, false, false, false},   {{24, 65}, 1, true, false, true},
  };
  uint64_t seed = 500;
  for (DType d : kFloatDtypes)
    for (const RowNormCase& c : cases) check_row_norm(true, c, d, seed += 10);
  seed = 0;
  check_row_norms(
      true, {{4100, 50, DType::float32}, {70, 5000, DType::float32}, {70, 3001, DType::float64}},
      seed);
}

TEST_P(NormVsCpu, LayerNormEmptyInputs) {
  // No rows: empty out and statistics, zero dweight/dbias.
  const Tensor x = ops::zeros({0, 8}, DType::float32, dev());
  const Tensor w = ops::to(rand_tensor({8}, DType::float32, 1, 0.5, 1.5), dev(), DType::float32);
  auto [out, mean, rstd] = ops::layer_norm(x, {8}, w, w);
  EXPECT_EQ(out.sizes(), (Shape{0, 8}));
  EXPECT_EQ(mean.sizes(), (Shape{0, 1}));
  auto [dx, dw, db] = ops::layer_norm_backward(x, x, {8}, mean, rstd, w, {true, true, true});
  EXPECT_EQ(dx.sizes(), (Shape{0, 8}));
  EXPECT_TRUE(close_to_cpu(dw, ops::zeros({8}), 0, "dweight of no rows"));
  EXPECT_TRUE(close_to_cpu(db, ops::zeros({8}), 0, "dbias of no rows"));
  auto [rdx, rdw] = ops::rms_norm_backward(x, x, {8}, rstd, w, {true, true});
  EXPECT_TRUE(close_to_cpu(rdw, ops::zeros({8}), 0, "rms dweight of no rows"));
  // Empty rows: mean 0, rstd 1 / sqrt(eps), as the CPU.
  const Tensor xe = ops::zeros({3, 0}, DType::float32, dev());
  auto [oe, me, re] = ops::layer_norm(xe, {0}, {}, {}, 1e-4);
  auto [oc, mc, rc] = ops::layer_norm(ops::zeros({3, 0}), {0}, {}, {}, 1e-4);
  EXPECT_TRUE(close_to_cpu(me, mc, 1e-6, "mean of empty rows"));
  EXPECT_TRUE(close_to_cpu(re, rc, 1e-6, "rstd of empty rows"));
}

// ---------------------------------------------------------------- batch_norm

// Training forward (with running statistics, two steps), training backward for every
// output mask, eval forward and eval backward, on x of shape xs.
void check_batch_norm(const Shape& xs, DType d, bool affine, bool noncontig, uint64_t seed) {
  SCOPED_TRACE(case_label("batch_norm", xs, d, noncontig ? " noncontig" : "") +
               (affine ? " affine" : ""));
  const NormTol tol = norm_tol(d);
  const DType pd = ops::norm_stat_dtype(d);
  const int64_t c = xs[1];
  const Pair x = both(xs, d, seed, noncontig);
  const Pair w = affine ? both({c}, pd, seed + 1, false, 0.5, 1.5) : undefined_both();
  const Pair b = affine ? both({c}, pd, seed + 2, false, -1, 1) : undefined_both();
  const Pair dy = both(xs, d, seed + 3, noncontig);
  // Running statistics: separate copies on each side, updated in place.
  const Pair rm = both({c}, pd, seed + 4, false, -0.5, 0.5);
  const Pair rv = both({c}, pd, seed + 5, false, 0.5, 1.5);

  // Forward on both sides (each updating its own running statistics when training), out and
  // statistics compared; returns the CPU's mean and invstd, then the device's.
  auto forward = [&](bool training, double momentum, const std::string& phase) {
    auto [oc, mc, ic] =
        ops::batch_norm(x.cpu, rm.cpu, rv.cpu, w.cpu, b.cpu, training, momentum, 1e-5);
    auto [og, mg, ig] =
        ops::batch_norm(x.gpu, rm.gpu, rv.gpu, w.gpu, b.gpu, training, momentum, 1e-5);
    EXPECT_TRUE(close_to_cpu(og, oc, tol.elem, phase + " out"));
    EXPECT_TRUE(close_to_cpu(mg, mc, tol.elem, phase + " mean"));
    EXPECT_TRUE(close_to_cpu(ig, ic, tol.elem, phase + " invstd"));
    return std::array<Tensor, 4>{mc, ic, mg, ig};
  };

  // ---- training forward, two steps (momentum 0.1, then 0.5)
  const auto [mc, ic, mg, ig] = forward(true, 0.1, "train");
  EXPECT_TRUE(close_to_cpu(rm.gpu, rm.cpu, tol.elem, "running_mean after step 1"));
  EXPECT_TRUE(close_to_cpu(rv.gpu, rv.cpu, tol.elem, "running_var after step 1"));
  forward(true, 0.5, "train step 2");
  EXPECT_TRUE(close_to_cpu(rm.gpu, rm.cpu, tol.elem, "running_mean after step 2"));
  EXPECT_TRUE(close_to_cpu(rv.gpu, rv.cpu, tol.elem, "running_var after step 2"));
  // without running statistics
  EXPECT_TRUE(close_to_cpu(std::get<0>(ops::batch_norm(x.gpu, {}, {}, w.gpu, b.gpu, true)),
                           std::get<0>(ops::batch_norm(x.cpu, {}, {}, w.cpu, b.cpu, true)),
                           tol.elem, "train out (no running stats)"));

  // ---- training backward
  for (std::array<bool, 3> mask : kMasks3) {
    SCOPED_TRACE(::testing::Message() << "train mask " << mask[0] << mask[1] << mask[2]);
    auto [dxc, dwc, dbc] = ops::batch_norm_backward(dy.cpu, x.cpu, mc, ic, w.cpu, true, mask);
    auto [dxg, dwg, dbg] = ops::batch_norm_backward(dy.gpu, x.gpu, mg, ig, w.gpu, true, mask);
    EXPECT_TRUE(close_to_cpu(dxg, dxc, tol.elem, "dx", norm_dx_floor(dy.cpu, w.cpu, ic)));
    EXPECT_TRUE(close_to_cpu(dwg, dwc, tol.elem, "dweight"));
    EXPECT_TRUE(close_to_cpu(dbg, dbc, tol.elem, "dbias"));
  }

  // ---- eval forward and backward (running statistics as constants)
  const auto [emc, eic, emg, eig] = forward(false, 0.1, "eval");
  EXPECT_TRUE(close_to_cpu(rm.gpu, rm.cpu, tol.elem, "running_mean after eval"));
  for (std::array<bool, 3> mask : {std::array<bool, 3>{true, true, true}, {false, true, false}}) {
    SCOPED_TRACE(::testing::Message() << "eval mask " << mask[0] << mask[1] << mask[2]);
    auto [dxc, dwc, dbc] = ops::batch_norm_backward(dy.cpu, x.cpu, emc, eic, w.cpu, false, mask);
    auto [dxg, dwg, dbg] = ops::batch_norm_backward(dy.gpu, x.gpu, emg, eig, w.gpu, false, mask);
    EXPECT_TRUE(close_to_cpu(dxg, dxc, tol.elem, "eval dx"));
    EXPECT_TRUE(close_to_cpu(dwg, dwc, tol.elem, "eval dweight"));
    EXPECT_TRUE(close_to_cpu(dbg, dbc, tol.elem, "eval dbias"));
  }
  // eval dx and dbias need neither the input nor the mean
  {
    SCOPED_TRACE("eval mask 101, no input");
    auto [dxc, dwc, dbc] = ops::batch_norm_backward(dy.cpu, Tensor(), Tensor(), eic, w.cpu, false,
                                                    {true, false, true});
    auto [dxg, dwg, dbg] = ops::batch_norm_backward(dy.gpu, Tensor(), Tensor(), eig, w.gpu, false,
                                                    {true, false, true});
    EXPECT_TRUE(close_to_cpu(dxg, dxc, tol.elem, "eval dx"));
    EXPECT_FALSE(dwg.defined());
    EXPECT_TRUE(close_to_cpu(dbg, dbc, tol.elem, "eval dbias"));
  }
}

TEST_P(NormVsCpu, BatchNormMatchesTheCpu) {
  uint64_t seed = 1000;
  for (DType d : kFloatDtypes) {
    check_batch_norm({37, 5}, d, true, false, seed += 10);         // 2-D
    check_batch_norm({64, 130}, d, true, false, seed += 10);       // 2-D, many channels
    check_batch_norm({5, 6, 33}, d, true, false, seed += 10);      // 3-D
    check_batch_norm({4, 7, 9, 11}, d, true, false, seed += 10);   // 4-D, odd sizes
    check_batch_norm({4, 7, 9, 11}, d, false, false, seed += 10);  // no affine
    check_batch_norm({3, 6, 5, 7}, d, true, true, seed += 10);     // non-contiguous
    check_batch_norm({2, 3, 1, 1}, d, true, false, seed += 10);    // 2 values a channel
    check_batch_norm({4, 6, 4, 8}, d, true, false, seed += 10);    // planes of 32: 4-element packs
    check_batch_norm({3, 5, 2, 2}, d, false, false, seed += 10);   // planes of 4: one pack a plane
  }
}

TEST_P(NormVsCpu, BatchNormLargeChannels) {
  // Channels of tens of thousands of elements (split over several blocks each).
  check_batch_norm({8, 3, 64, 65}, DType::float32, true, false, 1);
  check_batch_norm({8, 3, 64, 65}, DType::float64, true, false, 2);
  check_batch_norm({8, 3, 64, 65}, DType::bfloat16, true, false, 3);
  check_batch_norm({16, 64, 28, 28}, DType::float32, true, false, 4);
  check_batch_norm({4096, 3}, DType::float32, true, false, 5);
  // A channel whose values sit far from zero (the one-pass variance is shifted).
  const Tensor xc = ops::add(rand_tensor({6, 4, 17, 19}, DType::float32, 6), 1000.0);
  const Tensor xg = ops::to(xc, dev(), DType::float32);
  auto [oc, mc, ic] = ops::batch_norm(xc, {}, {}, {}, {}, true);
  auto [og, mg, ig] = ops::batch_norm(xg, {}, {}, {}, {}, true);
  EXPECT_TRUE(close_to_cpu(mg, mc, 1e-6, "mean of offset data"));
  EXPECT_TRUE(close_to_cpu(ig, ic, 1e-4, "invstd of offset data"));
  EXPECT_TRUE(close_to_cpu(og, oc, 1e-3, "out of offset data"));
}

TEST_P(NormVsCpu, BatchNormEmptyBatch) {
  for (const Shape& s : {Shape{0, 3}, Shape{0, 3, 4, 4}}) {
    SCOPED_TRACE(shape_str(s));
    const Tensor x = ops::zeros(s, DType::float32, dev());
    const Tensor rm = ops::to(rand_tensor({3}, DType::float32, 1), dev(), DType::float32);
    const Tensor rv = ops::to(rand_tensor({3}, DType::float32, 2, 0.5, 1.5), dev(), DType::float32);
    const std::vector<double> rm0 = ops::to_vector(rm), rv0 = ops::to_vector(rv);
    const Tensor w = ops::ones({3}, DType::float32, dev());
    auto [out, mean, invstd] = ops::batch_norm(x, rm, rv, w, {}, true);
    EXPECT_EQ(out.sizes(), s);
    EXPECT_EQ(ops::to_vector(rm), rm0);  // nothing to learn from
    EXPECT_EQ(ops::to_vector(rv), rv0);
    auto [oc, mc, ic] = ops::batch_norm(ops::zeros(s), {}, {}, {}, {}, true);
    EXPECT_TRUE(close_to_cpu(mean, mc, 1e-6, "mean of an empty batch"));
    EXPECT_TRUE(close_to_cpu(invstd, ic, 1e-6, "invstd of an empty batch"));
    auto [dx, dw, db] = ops::batch_norm_backward(x, x, mean, invstd, w, true, {true, true, true});
    EXPECT_EQ(dx.sizes(), s);
    EXPECT_TRUE(close_to_cpu(dw, ops::zeros({3}), 0, "dweight of an empty batch"));
    EXPECT_TRUE(close_to_cpu(db, ops::zeros({3}), 0, "dbias of an empty batch"));
  }
}

// ---------------------------------------------------------------- autograd and memory

TEST_P(NormVsCpu, AutogradMatchesTheCpu) {
  // layer_norm -> batch_norm over a [N, C, L] view, through the differentiable ops.
  const Tensor xc0 = rand_tensor({6, 5, 40}, DType::float32, 1);
  const Tensor wc0 = rand_tensor({40}, DType::float32, 2, 0.5, 1.5),
               bc0 = rand_tensor({40}, DType::float32, 3);
  const Tensor gc0 = rand_tensor({5}, DType::float32, 4, 0.5, 1.5),
               hc0 = rand_tensor({5}, DType::float32, 5);
  auto run = [&](Device device) {
    auto leaf_on = [&](const Tensor& t) {
      Tensor l = ops::to(t, device, t.dtype(), /*copy=*/true);
      l.requires_grad_(true);
      return l;
    };
    const Tensor x = leaf_on(xc0), w = leaf_on(wc0), b = leaf_on(bc0), g = leaf_on(gc0),
                 h = leaf_on(hc0);
    const Tensor rm = ops::zeros({5}, DType::float32, device),
                 rv = ops::ones({5}, DType::float32, device);
    const Tensor y = batch_norm(layer_norm(x, {40}, w, b), rm, rv, g, h, true);
    tally::sum(tally::mul(y, tally::tanh(y))).backward();
    return std::vector<Tensor>{y.detach(), x.grad(), w.grad(), b.grad(),
                               g.grad(),   h.grad(), rm,       rv};
  };
  const std::vector<Tensor> c = run(Device::cpu()), gpu = run(dev());
  const char* names[] = {"out",        "dx",       "dweight",      "dbias",
                         "bn dweight", "bn dbias", "running_mean", "running_var"};
  for (size_t i = 0; i < c.size(); ++i) EXPECT_TRUE(close_to_cpu(gpu[i], c[i], 1e-4, names[i]));
}

TEST_P(NormVsCpu, ScratchIsTemporaryUnderTheOpAndFreed) {
  memory::CachingAllocator& alloc = memory::get_allocator(dev());
  const Tensor x = ops::to(rand_tensor({64, 768}, DType::float32, 1), dev(), DType::float32);
  const Tensor w = ops::to(rand_tensor({768}, DType::float32, 2, 0.5, 1.5), dev(), DType::float32);
  const Tensor xb = ops::to(rand_tensor({8, 16, 9, 9}, DType::float32, 3), dev(), DType::float32);
  const Tensor wb = ops::to(rand_tensor({16}, DType::float32, 4, 0.5, 1.5), dev(), DType::float32);
  const Tensor rm = ops::zeros({16}, DType::float32, dev()),
               rv = ops::ones({16}, DType::float32, dev());
  const int64_t temp0 = alloc.stats().cat_bytes(memory::Category::temporary).current;
  alloc.record_memory_history(true);
  {
    auto [out, mean, rstd] = ops::layer_norm(x, {768}, w, w);
    auto grads = ops::layer_norm_backward(x, x, {768}, mean, rstd, w, {true, true, true});
    auto [bo, bm, bi] = ops::batch_norm(xb, rm, rv, wb, wb, true);
    auto bgrads = ops::batch_norm_backward(xb, xb, bm, bi, wb, true, {true, true, true});
    (void)grads;
    (void)bgrads;
  }
  const auto history = alloc.history();
  alloc.record_memory_history(false);
  // Every allocation is tagged; blocks allocated and freed inside an op are its scratch.
  std::set<uint64_t> freed;
  for (const auto& e : history)
    if (e.action == memory::TraceAction::free_requested) freed.insert(e.addr);
  std::set<std::string> ops_with_scratch;
  size_t layer_norm_scratch = 0;
  for (const auto& e : history) {
    if (e.action != memory::TraceAction::alloc) continue;
    EXPECT_NE(e.tag.category, memory::Category::unknown) << memory::interned(e.tag.op);
    if (e.tag.category == memory::Category::temporary && freed.count(e.addr)) {
      const std::string op = memory::interned(e.tag.op);
      ops_with_scratch.insert(op);
      if (op == "layer_norm_backward") layer_norm_scratch = std::max(layer_norm_scratch, e.size);
    }
  }
  EXPECT_TRUE(ops_with_scratch.count("layer_norm_backward"));
  EXPECT_TRUE(ops_with_scratch.count("batch_norm"));
  EXPECT_TRUE(ops_with_scratch.count("batch_norm_backward"));
  // At least one partial [2][768] float row per block.
  EXPECT_GE(layer_norm_scratch, 2 * 768 * sizeof(float));
  // Outputs and scratch all released: the temporary bytes are back where they were.
  EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::temporary).current, temp0);
  EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::unknown).current, 0);
}

// Throughput of the kernels (not a check; run with --gtest_also_run_disabled_tests).
// Times `iters` calls, each ended by a read-back of one element (a sync), and prints the
// bytes the op must move (read x/dy once, write out/dx once) per second.
TEST_P(NormVsCpu, DISABLED_Throughput) {
  auto time_ms = [this](auto&& fn) {
    fn();
    const auto sync = [this] { (void)ops::item(ops::zeros({1}, DType::float32, dev())); };
    sync();
    const int iters = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) fn();
    sync();
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::milli>(t1 - t0).count() / iters;
  };
  for (DType d : {DType::float32, DType::bfloat16}) {
    const Shape xs{16 * 1024, 768};
    const Tensor x = ops::to(rand_tensor(xs, d, 1), dev(), d),
                 dy = ops::to(rand_tensor(xs, d, 2), dev(), d);
    const Tensor w = ops::to(rand_tensor({768}, DType::float32, 3), dev(), DType::float32);
    const double bytes = static_cast<double>(x.nbytes());
    const auto [o, m_, r_] = ops::layer_norm(x, {768}, w, w);
    (void)o;
    const Tensor m = m_, r = r_;  // named copies: clang 14 cannot capture a structured binding
    const double f = time_ms([&] { ops::layer_norm(x, {768}, w, w); });
    const double b = time_ms([&] {
      ops::layer_norm_backward(dy, x, {768}, m, r, w, {true, true, true});
    });
    std::printf("layer_norm %s [16384, 768]: fwd %.3f ms (%.0f GB/s), bwd %.3f ms (%.0f GB/s)\n",
                dtype_name(d), f, 2 * bytes / f / 1e6, b, 3 * bytes / b / 1e6);
    const Shape bs{64, 256, 56, 56};
    const Tensor bx = ops::to(rand_tensor(bs, d, 4), dev(), d),
                 bdy = ops::to(rand_tensor(bs, d, 5), dev(), d);
    const Tensor bw = ops::to(rand_tensor({256}, DType::float32, 6), dev(), DType::float32);
    const Tensor rm = ops::zeros({256}, DType::float32, dev()),
                 rv = ops::ones({256}, DType::float32, dev());
    const double bbytes = static_cast<double>(bx.nbytes());
    const auto [bo, bm_, bi_] = ops::batch_norm(bx, rm, rv, bw, bw, true);
    (void)bo;
    const Tensor bm = bm_, bi = bi_;  // named copies, as above
    const double bf = time_ms([&] { ops::batch_norm(bx, rm, rv, bw, bw, true); });
    const double bb = time_ms([&] {
      ops::batch_norm_backward(bdy, bx, bm, bi, bw, true, {true, true, true});
    });
    std::printf(
        "batch_norm %s [64, 256, 56, 56]: train fwd %.3f ms (%.0f GB/s), bwd %.3f ms (%.0f GB/s)\n",
        dtype_name(d), bf, 3 * bbytes / bf / 1e6, bb, 5 * bbytes / bb / 1e6);
  }
}

}  // namespace
}  // namespace tally
