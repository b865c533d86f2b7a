// The everyday layers of issue 50 (nn/activation.h, nn/loss.h, nn/norm.h, nn/conv.h,
// nn/pooling.h, nn/functional.h, conv_transpose2d), nn::init's xavier and truncated normal,
// Module::apply, Embedding's padding_idx and frozen parameters. On each device of the binary
// (CPU here, CUDA in the _cuda twin): forward values against float64 references computed
// here element by element, float64 gradient checks, and on the meta device the shapes of a dry
// run.
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "memory/caching_allocator.h"
#include "nn/activation.h"
#include "nn/container.h"
#include "nn/conv.h"
#include "nn/functional.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/loss.h"
#include "nn/norm.h"
#include "nn/pooling.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "tensor/conv/transpose.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace testing;
namespace F = nn::functional;

std::vector<double> host(const Tensor& t) {
  return ops::to_vector(ops::to(t.detach(), Device::cpu(), DType::float64));
}

void expect_near(const std::vector<double>& got, const std::vector<double>& want, double tol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i])))
        << what << " [" << i << "]";
}

Tensor f64(const std::vector<double>& v, const Shape& s, bool grad = false) {
  Tensor t = ops::from_vector(v, s, DType::float64);
  if (grad) t.requires_grad_(true);
  return t;
}

class LayersHabits : public OnDevice {};

// ---- activations ----
TEST_P(LayersHabits, ActivationModulesMatchTheirFormulas) {
  const std::vector<double> xs = {-3.0, -0.5, 0.0, 0.25, 2.0, 7.0};
  const Tensor x = put(f64(xs, {2, 3}));
  std::vector<double> silu_ref, sig_ref, tanh_ref, leaky_ref;
  for (double v : xs) {
    sig_ref.push_back(1.0 / (1.0 + std::exp(-v)));
    silu_ref.push_back(v / (1.0 + std::exp(-v)));
    tanh_ref.push_back(std::tanh(v));
    leaky_ref.push_back(v > 0 ? v : 0.2 * v);
  }
  nn::SiLU silu_m;
  nn::Sigmoid sig_m;
  nn::Tanh tanh_m;
  nn::LeakyReLU leaky_m(0.2);
  expect_near(host(silu_m(x)), silu_ref, 1e-12, "SiLU");
  expect_near(host(sig_m(x)), sig_ref, 1e-12, "Sigmoid");
  expect_near(host(tanh_m(x)), tanh_ref, 1e-12, "Tanh");
  expect_near(host(leaky_m(x)), leaky_ref, 0.0, "LeakyReLU");
  // Softmax over dim 1, and the legacy default (dim 1 for a 2-D input).
  nn::Softmax sm(1), sm_default;
  nn::LogSoftmax lsm(-1);
  std::vector<double> sm_ref;
  for (int r = 0; r < 2; ++r) {
    double z = 0;
    for (int c = 0; c < 3; ++c) z += std::exp(xs[r * 3 + c]);
    for (int c = 0; c < 3; ++c) sm_ref.push_back(std::exp(xs[r * 3 + c]) / z);
  }
  expect_near(host(sm(x)), sm_ref, 1e-12, "Softmax");
  expect_near(host(sm_default(x)), sm_ref, 1e-12, "Softmax(dim=None)");
  std::vector<double> lsm_ref;
  for (double p : sm_ref) lsm_ref.push_back(std::log(p));
  expect_near(host(lsm(x)), lsm_ref, 1e-12, "LogSoftmax");
  EXPECT_EQ(leaky_m.repr(), "LeakyReLU(negative_slope=0.2)");
}

TEST_P(LayersHabits, LeakyReLUGradient) {
  // Off the kink: the slope below 0, 1 above.
  const Tensor x = f64({-2.0, -0.3, 0.4, 1.5}, {4}, true);
  EXPECT_TRUE(
      gradcheck_on(dev(), [](const TensorList& t) { return F::leaky_relu(t[0], 0.1); }, {x}));
  // At 0 the gradient is negative_slope, as PyTorch's.
  const Tensor z = leaf(f64({0.0}, {1}));
  sum(F::leaky_relu(z, 0.1)).backward();
  EXPECT_DOUBLE_EQ(host(z.grad())[0], 0.1);
}

// ---- losses ----
TEST_P(LayersHabits, RegressionLossesMatchReferences) {
  const std::vector<double> a = {0.1, -1.7, 2.5, 0.4, -0.05, 3.0};
  const std::vector<double> b = {0.3, -0.2, 0.5, 0.45, 0.0, -1.0};
  const Tensor x = put(f64(a, {2, 3})), y = put(f64(b, {2, 3}));
  double mse = 0, l1 = 0, sl1 = 0, hub = 0;
  std::vector<double> sl1_none;
  const double beta = 0.5, delta = 1.5;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(a[i] - b[i]);
    mse += d * d;
    l1 += d;
    const double s = d < beta ? 0.5 * d * d / beta : d - 0.5 * beta;
    sl1 += s;
    sl1_none.push_back(s);
    hub += d < delta ? 0.5 * d * d : delta * (d - 0.5 * delta);
  }
  const double n = static_cast<double>(a.size());
  nn::MSELoss mse_m;
  nn::L1Loss l1_sum("sum");
  nn::SmoothL1Loss sl1_m("none", beta);
  nn::HuberLoss hub_m("mean", delta);
  expect_near(host(mse_m(x, y)), {mse / n}, 1e-12, "MSELoss");
  expect_near(host(l1_sum(x, y)), {l1}, 1e-12, "L1Loss(sum)");
  expect_near(host(sl1_m(x, y)), sl1_none, 1e-12, "SmoothL1Loss(none)");
  expect_near(host(hub_m(x, y)), {hub / n}, 1e-12, "HuberLoss");
  expect_near(host(F::smooth_l1_loss(x, y, "sum", 0.0)), {l1}, 1e-12, "smooth_l1 beta 0");
  EXPECT_THROW(nn::MSELoss("avg"), std::invalid_argument);
  for (auto fn : {+[](const TensorList& t) { return F::mse_loss(t[0], t[1]); },
                  +[](const TensorList& t) { return F::l1_loss(t[0], t[1], "sum"); },
                  +[](const TensorList& t) { return F::smooth_l1_loss(t[0], t[1], "none", 0.5); },
                  +[](const TensorList& t) { return F::huber_loss(t[0], t[1], "mean", 1.5); }})
    EXPECT_TRUE(gradcheck_on(dev(), fn, {f64(a, {2, 3}, true), f64(b, {2, 3}, true)}));
}

TEST_P(LayersHabits, BCEWithLogitsMatchesReference) {
  const std::vector<double> a = {-30.0, -1.2, 0.0, 0.7, 4.0, 40.0};
  const std::vector<double> t = {0.0, 1.0, 0.5, 1.0, 0.0, 1.0};
  const std::vector<double> pw = {2.0, 0.5, 3.0};
  const std::vector<double> w = {1.0, 0.25, 2.0, 1.0, 0.5, 1.5};
  std::vector<double> ref_none;
  double ref_pw = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    // log(1 + exp(-x)) in float64 by its stable form.
    const double sp = std::max(-a[i], 0.0) + std::log1p(std::exp(-std::abs(a[i])));
    ref_none.push_back(w[i] * ((1 - t[i]) * a[i] + sp));
    ref_pw += (1 - t[i]) * a[i] + (1 + (pw[i % 3] - 1) * t[i]) * sp;
  }
  const Tensor x = put(f64(a, {2, 3})), y = put(f64(t, {2, 3}));
  nn::BCEWithLogitsLoss weighted(put(f64(w, {2, 3})), "none");
  nn::BCEWithLogitsLoss with_pw({}, "sum", put(f64(pw, {3})));
  expect_near(host(weighted(x, y)), ref_none, 1e-12, "BCEWithLogitsLoss(weight)");
  expect_near(host(with_pw(x, y)), {ref_pw}, 1e-12, "BCEWithLogitsLoss(pos_weight)");
  // Far in the tail the loss stays exact (log1p): x = 40, t = 1 gives exp(-40).
  expect_near(host(F::binary_cross_entropy_with_logits(put(f64({40.0}, {1})), put(f64({1.0}, {1})),
                                                       {}, "sum")),
              {std::exp(-40.0)}, 1e-12, "tail");
  EXPECT_THROW(F::binary_cross_entropy_with_logits(x, put(f64({1, 2}, {2}))),
               std::invalid_argument);
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& in) {
                             return F::binary_cross_entropy_with_logits(in[0], in[1], {}, "mean",
                                                                        in[2]);
                           },
                           {f64({-1.2, 0.3, 2.0, -0.4, 0.9, 1.1}, {2, 3}, true),
                            f64(t, {2, 3}, true), f64(pw, {3}, true)}));
}

TEST_P(LayersHabits, NLLAndKLDiv) {
  const std::vector<double> logp = {std::log(0.2), std::log(0.5), std::log(0.3),
                                    std::log(0.6), std::log(0.1), std::log(0.3)};
  const Tensor lp = put(f64(logp, {2, 3}));
  const Tensor target = put(ops::from_vector({1, 2}, {2}, DType::int64));
  nn::NLLLoss nll;
  expect_near(host(nll(lp, target)), {-(logp[1] + logp[5]) / 2}, 1e-12, "NLLLoss");
  nn::NLLLoss nll_ignore(2, "sum");
  expect_near(host(nll_ignore(lp, target)), {-logp[1]}, 1e-12, "NLLLoss(ignore_index)");

  const std::vector<double> q = {0.0, 0.25, 0.75, 0.5, 0.5, 0.0};
  double kl = 0;
  for (size_t i = 0; i < q.size(); ++i)
    if (q[i] > 0) kl += q[i] * (std::log(q[i]) - logp[i]);
  const Tensor tq = put(f64(q, {2, 3}));
  nn::KLDivLoss batchmean("batchmean"), mean_m("mean");
  expect_near(host(batchmean(lp, tq)), {kl / 2}, 1e-12, "KLDivLoss(batchmean)");
  expect_near(host(mean_m(lp, tq)), {kl / 6}, 1e-12, "KLDivLoss(mean)");
  std::vector<double> logq;
  for (double v : q) logq.push_back(v > 0 ? std::log(v) : -1e300);
  double kl_log = 0;
  for (size_t i = 0; i < q.size(); ++i) kl_log += std::exp(logq[i]) * (logq[i] - logp[i]);
  expect_near(host(F::kl_div(lp,
                             put(f64({std::log(0.1), std::log(0.25), std::log(0.65), std::log(0.5),
                                      std::log(0.4), std::log(0.1)},
                                     {2, 3})),
                             "sum", true)),
              {0.1 * (std::log(0.1) - logp[0]) + 0.25 * (std::log(0.25) - logp[1]) +
               0.65 * (std::log(0.65) - logp[2]) + 0.5 * (std::log(0.5) - logp[3]) +
               0.4 * (std::log(0.4) - logp[4]) + 0.1 * (std::log(0.1) - logp[5])},
              1e-12, "kl_div(log_target)");
  EXPECT_THROW(nn::KLDivLoss("batch"), std::invalid_argument);
  EXPECT_TRUE(
      gradcheck_on(dev(), [](const TensorList& in) { return F::kl_div(in[0], in[1], "batchmean"); },
                   {f64(logp, {2, 3}, true), f64({0.1, 0.25, 0.65, 0.5, 0.4, 0.1}, {2, 3}, true)}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& in) { return F::kl_div(in[0], in[1], "mean", true); },
      {f64(logp, {2, 3}, true), f64({-1.0, -2.0, -0.5, -0.7, -3.0, -1.1}, {2, 3}, true)}));
}

// ---- norms ----
TEST_P(LayersHabits, GroupNormMatchesReference) {
  const int64_t n = 2, c = 4, hw = 3, g = 2;
  const Tensor x64 = rand_input({n, c, hw}, -2.0, 2.0, 7);
  const std::vector<double> xs = host(x64);
  nn::GroupNorm gn(g, c, 1e-5);
  gn.to(dev());
  {
    NoGradGuard ng;
    ops::copy_(gn.weight, put(f64({1.0, 2.0, 0.5, -1.0}, {4})));
    ops::copy_(gn.bias, put(f64({0.0, 0.1, 0.2, 0.3}, {4})));
  }
  const std::vector<double> w = {1.0, 2.0, 0.5, -1.0}, b = {0.0, 0.1, 0.2, 0.3};
  std::vector<double> ref(xs.size());
  const int64_t per = c / g * hw;
  for (int64_t s = 0; s < n * g; ++s) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < per; ++i) mean += xs[s * per + i];
    mean /= per;
    for (int64_t i = 0; i < per; ++i) var += std::pow(xs[s * per + i] - mean, 2);
    var /= per;
    for (int64_t i = 0; i < per; ++i) {
      const int64_t ch = (s % g) * (c / g) + i / hw;
      ref[s * per + i] = (xs[s * per + i] - mean) / std::sqrt(var + 1e-5) * w[ch] + b[ch];
    }
  }
  expect_near(host(gn(put(x64.detach()).to(DType::float32))), ref, 2e-5, "GroupNorm float32");
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& t) { return F::group_norm(t[0], 2, t[1], t[2]); },
                           {x64, rand_input({4}, 0.5, 1.5, 2), rand_input({4}, -1, 1, 3)}));
  EXPECT_THROW(nn::GroupNorm(3, 4), std::invalid_argument);
}

TEST_P(LayersHabits, RMSNormModule) {
  nn::RMSNorm norm(3);
  norm.to(dev());
  EXPECT_EQ(host(norm.weight), (std::vector<double>{1, 1, 1}));
  const Tensor x = put(f64({1.0, 2.0, 2.0}, {1, 3}).to(DType::float32));
  const double r = std::sqrt(3.0 + static_cast<double>(std::numeric_limits<float>::epsilon()));
  expect_near(host(norm(x)), {1 / r, 2 / r, 2 / r}, 1e-6, "RMSNorm");
}

TEST_P(LayersHabits, BatchNorm1dTrainAndEvalMatchBatchNorm2d) {
  for (int dims : {2, 3}) {
    const Shape s = dims == 2 ? Shape{5, 3} : Shape{4, 3, 6};
    const Tensor x = put(rand_input(s, -1, 3, 11).detach());
    nn::BatchNorm1d bn1(3, 1e-5, 0.3);
    nn::BatchNorm2d bn2(3, 1e-5, 0.3);
    bn1.to(dev(), DType::float64);
    bn2.to(dev(), DType::float64);
    const Tensor x4 = dims == 2 ? x.unsqueeze(2).unsqueeze(3) : x.unsqueeze(3);
    expect_near(host(bn1(x)), host(bn2(x4)), 1e-12, "BatchNorm1d train");
    expect_near(host(bn1.running_mean), host(bn2.running_mean), 1e-12, "running_mean");
    expect_near(host(bn1.running_var), host(bn2.running_var), 1e-12, "running_var");
    EXPECT_EQ(host(bn1.num_batches_tracked)[0], 1.0);
    // The running mean moved from zero towards the batch mean by the momentum.
    const std::vector<double> xs = host(x);
    double mean0 = 0;
    int64_t count = 0;
    for (size_t i = 0; i < xs.size(); ++i)
      if ((dims == 2 ? i % 3 : (i / 6) % 3) == 0) mean0 += xs[i], ++count;
    EXPECT_NEAR(host(bn1.running_mean)[0], 0.3 * mean0 / count, 1e-12);
    bn1.eval();
    bn2.eval();
    expect_near(host(bn1(x)), host(bn2(x4)), 1e-12, "BatchNorm1d eval");
    EXPECT_THROW(bn1(put(f64({1, 2, 3, 4}, {1, 4}))), std::invalid_argument);
  }
  const Tensor x = rand_input({4, 3, 5}, -1, 1, 5);
  EXPECT_TRUE(gradcheck_on(
      dev(),
      [](const TensorList& t) {
        return batch_norm(t[0].unsqueeze(3), {}, {}, t[1], t[2], true, 0.1, 1e-5).squeeze(3);
      },
      {x, rand_input({3}, 0.5, 1.5, 2), rand_input({3}, -1, 1, 3)}));
}

// ---- convolution, pooling, resampling ----
TEST_P(LayersHabits, Conv1dMatchesDirectSum) {
  nn::Conv1d conv(2, 3, 3, /*stride=*/2, /*padding=*/1);
  conv.to(dev(), DType::float64);
  const Tensor x = put(rand_input({2, 2, 7}, -1, 1, 4).detach());
  const std::vector<double> xs = host(x), ws = host(conv.weight), bs = host(conv.bias);
  const int64_t L = 7, OL = (7 + 2 - 3) / 2 + 1;
  std::vector<double> ref;
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t o = 0; o < 3; ++o)
      for (int64_t l = 0; l < OL; ++l) {
        double acc = bs[o];
        for (int64_t ci = 0; ci < 2; ++ci)
          for (int64_t k = 0; k < 3; ++k) {
            const int64_t p = l * 2 - 1 + k;
            if (p >= 0 && p < L) acc += ws[(o * 2 + ci) * 3 + k] * xs[(n * 2 + ci) * L + p];
          }
        ref.push_back(acc);
      }
  const Tensor y = conv(x);
  EXPECT_EQ(y.sizes(), (Shape{2, 3, OL}));
  expect_near(host(y), ref, 1e-12, "Conv1d");
  // Unbatched [C, L].
  EXPECT_EQ(conv(x.select(0, 1)).sizes(), (Shape{3, OL}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return F::conv1d(t[0], t[1], t[2], 1, 2, 2, 1); },
      {rand_input({1, 2, 6}), rand_input({4, 2, 2}, -1, 1, 2), rand_input({4}, -1, 1, 3)}));
  // PyTorch's init bound: 1/sqrt(fan_in) for the bias, fan_in = 2 * 3.
  for (double v : bs) EXPECT_LE(std::abs(v), 1.0 / std::sqrt(6.0));
}

TEST_P(LayersHabits, ConvTranspose2dIsTheAdjointOfConv2d) {
  // <conv2d(a, w), x> == <a, conv_transpose2d(x, w)> for every a, x.
  const Tensor w = put(rand_input({3, 2, 3, 3}, -1, 1, 8).detach());  // conv 2 -> 3 channels
  const Tensor a = put(rand_input({2, 2, 8, 7}, -1, 1, 9).detach());
  const Int2 stride{2, 2}, padding{1, 1};
  const Tensor ca = conv2d(a, w, {}, stride, padding);
  const Tensor x = put(rand_input(ca.sizes(), -1, 1, 10).detach());
  // output_padding {1, 0}: H 8 = (4 - 1) * 2 - 2 + 3 + 1, W 7 = (4 - 1) * 2 - 2 + 3.
  const Tensor tx = conv_transpose2d(x, w, {}, stride, padding, {1, 0});
  ASSERT_EQ(tx.sizes(), a.sizes());
  EXPECT_NEAR(ops::item(sum(mul(ca, x))), ops::item(sum(mul(a, tx))), 1e-10);
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return conv_transpose2d(t[0], t[1], t[2], 2, 1, 1); },
      {rand_input({1, 3, 3, 2}), rand_input({3, 2, 3, 3}, -1, 1, 2), rand_input({2}, -1, 1, 3)}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return conv_transpose2d(t[0], t[1], {}, 1, 0, 0, 2); },
      {rand_input({2, 4, 3, 3}), rand_input({4, 1, 2, 2}, -1, 1, 2)}));
  nn::ConvTranspose2d up(4, 2, 4, 2, 1);
  up.to(dev());
  EXPECT_EQ(up.weight.sizes(), (Shape{4, 2, 4, 4}));
  EXPECT_EQ(up(put(ops::zeros({1, 4, 5, 5}))).sizes(), (Shape{1, 2, 10, 10}));
  EXPECT_THROW(nn::ConvTranspose2d(4, 2, 3, 1, 0, 1), std::invalid_argument);
}

TEST_P(LayersHabits, AvgPool2dModule) {
  nn::AvgPool2d pool(2, {}, 1, false, false);
  const Tensor x = put(f64({1, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 1, 3, 3}));
  // Windows at stride 2 with padding 1, padded cells not counted.
  expect_near(host(pool(x)), {1, 2.5, 5.5, 7}, 1e-12, "AvgPool2d");
  nn::AvgPool2d pool_pad(2, {}, 1);
  expect_near(host(pool_pad(x)), {0.25, 1.25, 2.75, 7}, 1e-12, "AvgPool2d count_include_pad");
}

// Bilinear by PyTorch's source-index rule, one output at a time.
std::vector<double> bilinear_ref(const std::vector<double>& x, int64_t h, int64_t w, int64_t oh,
                                 int64_t ow, bool corners) {
  auto src = [&](int64_t o, int64_t in, int64_t out) {
    if (corners) return out > 1 ? o * double(in - 1) / double(out - 1) : 0.0;
    return std::max((o + 0.5) * double(in) / double(out) - 0.5, 0.0);
  };
  std::vector<double> y;
  for (int64_t i = 0; i < oh; ++i)
    for (int64_t j = 0; j < ow; ++j) {
      const double sy = src(i, h, oh), sx = src(j, w, ow);
      const int64_t y0 = std::min<int64_t>(int64_t(sy), h - 1),
                    x0 = std::min<int64_t>(int64_t(sx), w - 1);
      const int64_t y1 = std::min(y0 + 1, h - 1), x1 = std::min(x0 + 1, w - 1);
      const double ly = sy - y0, lx = sx - x0;
      y.push_back((1 - ly) * ((1 - lx) * x[y0 * w + x0] + lx * x[y0 * w + x1]) +
                  ly * ((1 - lx) * x[y1 * w + x0] + lx * x[y1 * w + x1]));
    }
  return y;
}

TEST_P(LayersHabits, UpsampleNearestAndBilinear) {
  const std::vector<double> xs = {1, 2, 3, 4, 5, 6};
  const Tensor x = put(f64(xs, {1, 1, 2, 3}));
  nn::Upsample twice(std::nullopt, std::array<double, 2>{2.0, 2.0});
  expect_near(host(twice(x)),
              {1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 4, 4, 5, 5, 6, 6}, 0.0,
              "nearest x2");
  // Nearest to an odd size: src = floor(dst * in / out).
  expect_near(host(F::interpolate(x, std::array<int64_t, 2>{3, 2})), {1, 2, 1, 2, 4, 5}, 0.0,
              "nearest (3, 2)");
  for (bool corners : {false, true}) {
    nn::Upsample bil(std::array<int64_t, 2>{5, 4}, std::nullopt, "bilinear", corners);
    expect_near(host(bil(x)), bilinear_ref(xs, 2, 3, 5, 4, corners), 1e-12,
                corners ? "bilinear align_corners" : "bilinear");
  }
  EXPECT_TRUE(gradcheck_on(
      dev(),
      [](const TensorList& t) {
        return F::interpolate(t[0], std::array<int64_t, 2>{5, 3}, std::nullopt, "bilinear");
      },
      {rand_input({1, 2, 3, 4})}));
  EXPECT_TRUE(
      gradcheck_on(dev(),
                   [](const TensorList& t) {
                     return F::interpolate(t[0], std::nullopt, std::array<double, 2>{2.0, 3.0});
                   },
                   {rand_input({2, 1, 2, 2})}));
  EXPECT_THROW(nn::Upsample(std::nullopt, std::array<double, 2>{2, 2}, "nearest", true),
               std::invalid_argument);
}

// 3-D (linear) and 5-D (trilinear) inputs, nearest at both ranks, and the rank errors.
TEST_P(LayersHabits, Interpolate3dAnd5d) {
  using V = std::vector<int64_t>;
  using S = std::vector<double>;
  const Tensor line = put(f64({1, 2, 4}, {1, 1, 3}));
  expect_near(host(F::interpolate(line, V{5}, std::nullopt, "linear")), {1, 1.4, 2, 3.2, 4}, 1e-12,
              "linear");
  expect_near(host(F::interpolate(line, V{5}, std::nullopt, "linear", true)), {1, 1.5, 2, 3, 4},
              1e-12, "linear align_corners");
  expect_near(host(F::interpolate(line, std::nullopt, S{2.0})), {1, 1, 2, 2, 4, 4}, 0.0,
              "nearest x2");
  expect_near(host(F::interpolate(line, V{5})), {1, 1, 2, 2, 4}, 0.0, "nearest 5");
  nn::Upsample up(V{5}, std::nullopt, "linear", true);
  expect_near(host(up(line)), {1, 1.5, 2, 3, 4}, 1e-12, "Upsample linear");
  const Tensor vol = put(f64({1, 2, 3, 4}, {1, 1, 1, 2, 2}));
  expect_near(host(F::interpolate(vol, std::nullopt, S{1, 1, 2})), {1, 1, 2, 2, 3, 3, 4, 4}, 0.0,
              "nearest (1, 1, 2)");
  expect_near(host(F::interpolate(vol, V{2, 2, 3})), {1, 1, 2, 3, 3, 4, 1, 1, 2, 3, 3, 4}, 0.0,
              "nearest (2, 2, 3)");
  expect_near(host(F::interpolate(put(f64({1, 3}, {1, 1, 2, 1, 1})), V{3, 1, 1}, std::nullopt,
                                  "trilinear", true)),
              {1, 2, 3}, 1e-12, "trilinear along D");
  // At depth 1 trilinear is bilinear over H, W.
  const std::vector<double> xs = {1, 2, 3, 4, 5, 6};
  expect_near(
      host(F::interpolate(put(f64(xs, {1, 1, 1, 2, 3})), V{1, 5, 4}, std::nullopt, "trilinear")),
      bilinear_ref(xs, 2, 3, 5, 4, false), 1e-12, "trilinear at depth 1");
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& t) {
                             return F::interpolate(t[0], std::nullopt, S{1.5}, "linear", true);
                           },
                           {rand_input({2, 2, 3})}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& t) {
                             return F::interpolate(t[0], V{3, 3, 2}, std::nullopt, "trilinear");
                           },
                           {rand_input({1, 1, 2, 2, 3})}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& t) {
                             return F::interpolate(t[0], V{3, 1, 3});
                           },
                           {rand_input({1, 2, 2, 2, 2})}));
  EXPECT_THROW(F::interpolate(line, V{5}, std::nullopt, "bilinear"), std::invalid_argument);
  EXPECT_THROW(F::interpolate(vol, V{2, 2}), std::invalid_argument);
  EXPECT_THROW(F::interpolate(put(f64({1, 2}, {1, 2})), V{4}), std::invalid_argument);
}

// ---- embedding, init, apply, frozen parameters ----
TEST_P(LayersHabits, EmbeddingPaddingIdxRowIsZeroAndGetsNoGradient) {
  nn::Embedding emb(5, 3, 1);
  emb.to(dev());
  EXPECT_EQ(host(emb.weight.select(0, 1)), (std::vector<double>{0, 0, 0}));
  const Tensor idx = put(ops::from_vector({1, 2, 1, 4}, {4}, DType::int64));
  sum(emb(idx)).backward();
  const std::vector<double> g = host(emb.weight.grad());
  for (int64_t c = 0; c < 3; ++c) {
    EXPECT_EQ(g[1 * 3 + c], 0.0);
    EXPECT_EQ(g[2 * 3 + c], 1.0);
    EXPECT_EQ(g[0 * 3 + c], 0.0);
  }
  nn::Embedding last(5, 3, -1);
  EXPECT_EQ(last.padding_idx, 4);
}

TEST_P(LayersHabits, InitIsInPlaceAndRecordsNothing) {
  nn::Linear lin(400, 300);
  lin.to(dev());
  const void* before = lin.weight.data_ptr();
  Generator g(3);
  nn::init::xavier_uniform_(lin.weight, 2.0, &g);
  EXPECT_EQ(lin.weight.data_ptr(), before);
  EXPECT_TRUE(lin.weight.is_leaf());
  EXPECT_TRUE(lin.weight.requires_grad());
  const double bound = 2.0 * std::sqrt(6.0 / 700.0);
  const std::vector<double> w = host(lin.weight);
  double lo = 1e9, hi = -1e9, sq = 0;
  for (double v : w) lo = std::min(lo, v), hi = std::max(hi, v), sq += v * v;
  EXPECT_GE(lo, -bound);
  EXPECT_LE(hi, bound);
  EXPECT_GT(hi, 0.99 * bound);
  nn::init::xavier_normal_(lin.weight, 1.0, &g);
  sq = 0;
  for (double v : host(lin.weight)) sq += v * v;
  EXPECT_NEAR(std::sqrt(sq / w.size()), std::sqrt(2.0 / 700.0), 0.02 * std::sqrt(2.0 / 700.0));
  nn::init::kaiming_normal_(lin.weight, 0.0, "fan_out", "relu", &g);
  sq = 0;
  for (double v : host(lin.weight)) sq += v * v;
  EXPECT_NEAR(std::sqrt(sq / w.size()), std::sqrt(2.0 / 300.0), 0.02 * std::sqrt(2.0 / 300.0));
  nn::init::trunc_normal_(lin.weight, 0.5, 1.0, -0.5, 1.0, &g);
  double mean = 0;
  for (double v : host(lin.weight)) {
    ASSERT_GE(v, -0.5);
    ASSERT_LE(v, 1.0);
    mean += v;
  }
  // The mean of N(0.5, 1) truncated to [-0.5, 1.0]: 0.5 + (phi(-1) - phi(0.5)) / (Phi(0.5) -
  // Phi(-1)).
  auto phi = [](double z) { return std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI); };
  auto Phi = [](double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); };
  const double want = 0.5 + (phi(-1.0) - phi(0.5)) / (Phi(0.5) - Phi(-1.0));
  EXPECT_NEAR(mean / w.size(), want, 0.01);
  EXPECT_THROW(nn::init::trunc_normal_(lin.weight, 0, 1, 30, 31), std::invalid_argument);
  EXPECT_FALSE(lin.weight.grad().defined());
}

TEST(LayersHabitsCpu, ApplyVisitsChildrenFirst) {
  nn::Sequential seq;
  seq.push_back(std::make_shared<nn::Linear>(2, 3));
  auto inner = std::make_shared<nn::Sequential>();
  inner->push_back(std::make_shared<nn::SiLU>());
  inner->push_back(std::make_shared<nn::Linear>(3, 1));
  seq.push_back(inner);
  std::vector<std::string> order;
  seq.apply([&](nn::Module& m) {
    order.push_back(m.type_name());
    if (auto* l = dynamic_cast<nn::Linear*>(&m)) nn::init::zeros_(l->weight);
  });
  EXPECT_EQ(order,
            (std::vector<std::string>{"Linear", "SiLU", "Linear", "Sequential", "Sequential"}));
  for (const Tensor& p : seq.parameters()) {
    if (p.dim() != 2) continue;
    for (double v : host(p)) EXPECT_EQ(v, 0.0);
  }
}

TEST_P(LayersHabits, FrozenParametersGetNoGradientAndNoOptimizerState) {
  nn::Sequential model;
  auto first = std::make_shared<nn::Linear>(4, 8);
  auto second = std::make_shared<nn::Linear>(8, 2);
  model.push_back(first);
  model.push_back(second);
  model.to(dev());
  first->weight.requires_grad_(false);
  first->bias.requires_grad_(false);
  const std::vector<double> frozen_before = host(first->weight);
  const std::vector<double> trained_before = host(second->weight);
  optim::Adam opt(model.parameters());
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    const Tensor x = put(rand_input({3, 4}, -1, 1, 20 + step).detach().to(DType::float32));
    sum(square(model(x))).backward();
    EXPECT_FALSE(first->weight.grad().defined());
    EXPECT_FALSE(first->bias.grad().defined());
    EXPECT_TRUE(second->weight.grad().defined());
    opt.step();
  }
  EXPECT_EQ(host(first->weight), frozen_before);
  EXPECT_NE(host(second->weight), trained_before);
  // State only for the two trained tensors (parameters 2 and 3).
  const auto sd = opt.state_dict();
  for (const auto& [key, t] : sd.tensors) {
    EXPECT_EQ(key.find("state.0."), std::string::npos) << key;
    EXPECT_EQ(key.find("state.1."), std::string::npos) << key;
  }
  bool has_trained = false;
  for (const auto& [key, t] : sd.tensors) has_trained |= key.rfind("state.2.", 0) == 0;
  EXPECT_TRUE(has_trained);
}

TEST(LayersHabitsCpu, ForwardAllocationsCarryModulePathAndCategory) {
  nn::Sequential model;
  model.push_back(std::make_shared<nn::Conv1d>(2, 4, 3));
  model.push_back(std::make_shared<nn::GroupNorm>(2, 4));
  model.push_back(std::make_shared<nn::SiLU>());
  auto& alloc = memory::get_allocator(Device::cpu());
  alloc.record_memory_history(true);
  const Tensor x = ops::randn({2, 2, 6});
  const Tensor y = model(x);
  std::set<std::string> paths;
  for (const auto& e : alloc.history())
    if (e.action == memory::TraceAction::alloc) paths.insert(memory::interned(e.tag.module));
  alloc.record_memory_history(false);
  for (const char* p : {"0", "1", "2"}) EXPECT_TRUE(paths.count(p)) << p;
  EXPECT_EQ(y.sizes(), (Shape{2, 4, 4}));
}

// ---- a dry run on the meta device: every new module forward and backward ----
TEST(LayersHabitsMeta, EveryModuleRunsOnMeta) {
  const Device meta = Device::meta();
  nn::BuildOnDevice on(meta);
  auto seq = std::make_shared<nn::Sequential>();
  seq->push_back(std::make_shared<nn::Conv1d>(3, 8, 3, 1, 1));
  seq->push_back(std::make_shared<nn::BatchNorm1d>(8));
  seq->push_back(std::make_shared<nn::LeakyReLU>());
  seq->push_back(std::make_shared<nn::SiLU>());
  const Tensor x = ops::empty({2, 3, 16}, DType::float32, meta);
  const Tensor y = (*seq)(x);
  EXPECT_EQ(y.sizes(), (Shape{2, 8, 16}));
  nn::MSELoss mse;
  mse(y, ops::empty({2, 8, 16}, DType::float32, meta)).backward();
  EXPECT_TRUE(seq->parameters()[0].grad().defined());

  nn::ConvTranspose2d up(4, 2, 4, 2, 1);
  nn::GroupNorm gn(2, 2);
  nn::Upsample bil(std::nullopt, std::array<double, 2>{2, 2}, "bilinear", false);
  nn::AvgPool2d pool(2);
  const Tensor img = ops::empty({1, 4, 5, 5}, DType::float32, meta);
  const Tensor z = pool(bil(gn(up(img))));
  EXPECT_EQ(z.sizes(), (Shape{1, 2, 10, 10}));
  sum(z).backward();
  EXPECT_TRUE(up.weight.grad().defined());
  EXPECT_EQ(up.weight.grad().device(), meta);
  nn::Upsample tri(std::vector<int64_t>{3, 4, 5}, std::nullopt, "trilinear", true);
  Tensor vol = ops::empty({1, 2, 2, 3, 2}, DType::float32, meta);
  vol.requires_grad_(true);
  sum(tri(vol)).backward();
  EXPECT_EQ(tri(vol).sizes(), (Shape{1, 2, 3, 4, 5}));
  EXPECT_EQ(vol.grad().sizes(), vol.sizes());
}

TALLY_ON_DEVICES(LayersHabits);

}  // namespace
}  // namespace tally
