// Softmax family: softmax/log_softmax along any dim, the fused cross_entropy and nll_loss.
// Values against hand-computed cases, float64 gradient checks (non-last and negative dims,
// non-contiguous inputs, ignore_index, label smoothing, every reduction, the spatial
// form), what backward saves, lower-precision dtypes and the error messages.
#include <cmath>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "tensor/softmax/autograd.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using namespace testing;

Tensor targets(std::initializer_list<double> v, const Shape& shape) {
  return from_vector(std::vector<double>(v), shape, i64);
}

// The tensors a result's grad_fn holds for backward.
std::vector<const SavedTensor*> saved_of(const Tensor& out) {
  return out.autograd_meta()->grad_fn->saved_tensors();
}

// ---------------------------------------------------------------- softmax values

TEST(Softmax, HandValues) {
  const Tensor x = from_vector({1, 2, 3}, {3}, f64);
  EXPECT_TRUE(values_near(softmax(x, 0), {0.0900305732, 0.2447284711, 0.6652409558}, 1e-9));
  EXPECT_TRUE(values_near(softmax(x, -1), {0.0900305732, 0.2447284711, 0.6652409558}, 1e-9));
  EXPECT_TRUE(values_near(log_softmax(x, 0), {-2.4076059644, -1.4076059644, -0.4076059644}, 1e-9));
  // Rows of a matrix, and columns (dim 0): softmax([1, 3]) = [0.1192029220, 0.8807970780].
  const Tensor m = from_vector({1, 2, 3, 4}, {2, 2});
  EXPECT_TRUE(
      values_near(softmax(m, 0), {0.1192029220, 0.1192029220, 0.8807970780, 0.8807970780}, 1e-6));
  EXPECT_TRUE(
      values_near(softmax(m, -1), {0.2689414214, 0.7310585786, 0.2689414214, 0.7310585786}, 1e-6));
  // Stable for large logits (exp(1000) overflows without the max shift).
  const Tensor big = from_vector({1000, 1001, -1000, -1001}, {2, 2});
  EXPECT_TRUE(
      values_near(softmax(big, 1), {0.2689414214, 0.7310585786, 0.7310585786, 0.2689414214}, 1e-6));
  EXPECT_TRUE(values_near(log_softmax(big, 1),
                          {-1.3132616875, -0.3132616875, -0.3132616875, -1.3132616875}, 1e-5));
  // 0-D: softmax is 1, log_softmax 0.
  const Tensor s = full({}, 5.0);
  EXPECT_EQ(softmax(s, 0).dim(), 0);
  EXPECT_TRUE(values_near(softmax(s, -1), {1.0}));
  EXPECT_TRUE(values_near(log_softmax(s, 0), {0.0}));
  // Empty along another dim.
  EXPECT_EQ(softmax(zeros({0, 3}), 1).sizes(), (Shape{0, 3}));
}

TEST(Softmax, NonContiguousAndMiddleDim) {
  // A transposed view: softmax along dim 0 of x^T equals softmax along dim 1 of x.
  const Tensor x = rand_input({3, 5}, -2, 2, 11).detach();
  const Tensor xt = x.transpose(0, 1);  // [5, 3], non-contiguous
  ASSERT_FALSE(xt.is_contiguous());
  EXPECT_TRUE(
      values_near(softmax(xt, 0), softmax(x, 1).transpose(0, 1).contiguous().tolist(), 1e-12));
  EXPECT_TRUE(values_near(log_softmax(xt, 0),
                          log_softmax(x, 1).transpose(0, 1).contiguous().tolist(), 1e-12));
  // The middle dim of a 3-D tensor: every [i, :, k] column sums to 1.
  const Tensor y = softmax(rand_input({2, 4, 3}, -3, 3, 12).detach(), 1);
  EXPECT_TRUE(values_near(ops::sum(y, {1}), std::vector<double>(6, 1.0), 1e-12));
}

TEST(Softmax, LowPrecisionDtypes) {
  const Tensor x = rand_input({4, 7}, -4, 4, 13).detach();
  const std::vector<double> ref = softmax(x, 1).tolist();
  const std::vector<double> lref = log_softmax(x, 0).tolist();
  for (DType d : {DType::float32, DType::float16, DType::bfloat16}) {
    const double tol = d == DType::float32 ? 1e-6 : d == DType::float16 ? 2e-3 : 1e-2;
    const Tensor xd = x.to(d);
    EXPECT_EQ(softmax(xd, 1).dtype(), d);
    EXPECT_TRUE(values_near(softmax(xd, 1), ref, tol)) << dtype_name(d);
    EXPECT_TRUE(values_near(log_softmax(xd, 0), lref, tol * 8)) << dtype_name(d);
  }
}

// ---------------------------------------------------------------- softmax gradients

TEST(Softmax, Gradients) {
  const Tensor a = rand_input({3, 4}, -2, 2, 1);
  const Tensor c = rand_input_noncontig({4, 3}, 2);  // non-contiguous
  const Tensor b = rand_input({2, 3, 4}, -2, 2, 3);
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return softmax(x[0], -1); }, {a}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return softmax(x[0], 0); }, {a}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return softmax(x[0], 0); }, {c}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return softmax(x[0], 1); }, {b}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return log_softmax(x[0], 1); }, {a}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return log_softmax(x[0], 0); }, {c}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return log_softmax(x[0], -2); }, {b}));
  // Through a transposed view of a leaf, and composed twice.
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return softmax(x[0].transpose(0, 1), 0); }, {a}));
  EXPECT_TRUE(
      gradcheck([](const TensorList& x) { return log_softmax(softmax(x[0], 1) * 3.0, 0); }, {a}));
}

TEST(Softmax, BackwardSavesOnlyTheOutput) {
  const Tensor x = rand_input({2, 5}, -1, 1, 4);
  for (bool log : {false, true}) {
    const Tensor y = log ? log_softmax(x, 1) : softmax(x, 1);
    const auto saved = saved_of(y);
    ASSERT_EQ(saved.size(), 1u);
    EXPECT_TRUE(saved[0]->held().storage().is_same(y.storage()));
  }
  // Hand gradient: d(sum(softmax(x) * w))/dx = y * (w - sum(w * y)).
  const Tensor v = from_vector({1, 2, 3}, {3}, f64_grad);
  const Tensor w = from_vector({1, 0, 0}, {3}, f64);
  sum(softmax(v, 0) * w).backward();
  // y0 * (1 - y0), -y0 * y1, -y0 * y2
  EXPECT_TRUE(values_near(v.grad(), {0.0819250691, -0.0220330445, -0.0598920245}, 1e-9));
}

// ---------------------------------------------------------------- cross_entropy values

TEST(CrossEntropy, HandValues) {
  const Tensor logits = from_vector({1, 2, 3, 1, 2, 3}, {2, 3}, f64);
  const Tensor t = targets({2, 0}, {2});
  // Per row: lse(1, 2, 3) - x[t] = 3.4076059644 - 3 and - 1.
  EXPECT_TRUE(values_near(cross_entropy(logits, t), {1.4076059644}, 1e-9));
  EXPECT_EQ(cross_entropy(logits, t).dim(), 0);
  EXPECT_TRUE(values_near(cross_entropy(logits, t, -100, 0.0, "sum"), {2.8152119289}, 1e-9));
  const Tensor none = cross_entropy(logits, t, -100, 0.0, "none");
  EXPECT_EQ(none.sizes(), (Shape{2}));
  EXPECT_TRUE(values_near(none, {0.4076059644, 2.4076059644}, 1e-9));
  // PyTorch's positional order (ignore_index, reduction, label_smoothing) works too.
  EXPECT_TRUE(values_near(cross_entropy(logits, t, -100, "sum"), {2.8152119289}, 1e-9));
  // ignore_index: the ignored row contributes nothing and is not counted by mean.
  const Tensor ti = targets({2, -100}, {2});
  EXPECT_TRUE(values_near(cross_entropy(logits, ti), {0.4076059644}, 1e-9));
  EXPECT_TRUE(values_near(cross_entropy(logits, ti, -100, 0.0, "none"), {0.4076059644, 0.0}, 1e-9));
  EXPECT_TRUE(values_near(cross_entropy(logits, targets({2, 0}, {2}), /*ignore_index=*/0),
                          {0.4076059644}, 1e-9));
  // Every target ignored: mean is 0/0 = NaN (as PyTorch), sum is 0.
  const Tensor all_ignored = targets({-100, -100}, {2});
  EXPECT_TRUE(std::isnan(cross_entropy(logits, all_ignored).item()));
  EXPECT_TRUE(values_near(cross_entropy(logits, all_ignored, -100, 0.0, "sum"), {0.0}));
  // Label smoothing 0.1: 0.9 * nll + 0.1 / 3 * sum_c (lse - x_c).
  EXPECT_TRUE(
      values_near(cross_entropy(logits, t, -100, 0.1, "none"), {0.5076059644, 2.3076059644}, 1e-9));
  EXPECT_TRUE(values_near(cross_entropy(logits, t, -100, 0.1), {1.4076059644}, 1e-9));
  EXPECT_TRUE(values_near(cross_entropy(logits, ti, -100, 0.1, "none"), {0.5076059644, 0.0}, 1e-9));
  EXPECT_TRUE(values_near(cross_entropy(logits, ti, -100, 0.1), {0.5076059644}, 1e-9));
  // Unbatched: input [C], target 0-D.
  const Tensor row = from_vector({1, 2, 3}, {3}, f64);
  EXPECT_TRUE(values_near(cross_entropy(row, targets({0}, {})), {2.4076059644}, 1e-9));
  EXPECT_EQ(cross_entropy(row, full({}, 1.0, i64), -100, 0.0, "none").dim(), 0);
  // Spatial [N, C, d]: x[0, :, 0] = (0.5, -1, 2) with target 2, x[0, :, 1] = (1, 1, 0) with 0.
  const Tensor sp = from_vector({0.5, 1, -1, 1, 2, 0}, {1, 3, 2}, f64);
  const Tensor st = targets({2, 0}, {1, 2});
  EXPECT_TRUE(
      values_near(cross_entropy(sp, st, -100, 0.0, "none"), {0.2413112967, 0.8619948041}, 1e-9));
  EXPECT_EQ(cross_entropy(sp, st, -100, 0.0, "none").sizes(), (Shape{1, 2}));
  EXPECT_TRUE(values_near(cross_entropy(sp, st), {0.5516530504}, 1e-9));
  // Large logits stay finite.
  EXPECT_TRUE(values_near(cross_entropy(from_vector({1000, 1001, 1002}, {1, 3}), targets({2}, {1})),
                          {0.4076059644}, 1e-5));
}

TEST(CrossEntropy, HandGradient) {
  const Tensor logits = from_vector({1, 2, 3, 1, 2, 3}, {2, 3}, f64_grad);
  cross_entropy(logits, targets({2, 0}, {2})).backward();
  // (softmax - one_hot) / 2 per row.
  EXPECT_TRUE(values_near(
      logits.grad(),
      {0.0450152866, 0.1223642355, -0.1673795221, -0.4549847134, 0.1223642355, 0.3326204779},
      1e-9));
  // Label smoothing 0.1, mean over both rows (values from PyTorch 2.11).
  const Tensor l1 = from_vector({1, 2, 3, 1, 2, 3}, {2, 3}, f64_grad);
  cross_entropy(l1, targets({2, 0}, {2}), -100, 0.1).backward();
  EXPECT_TRUE(values_near(
      l1.grad(),
      {0.0283486199, 0.1056975689, -0.1340461888, -0.4216513801, 0.1056975689, 0.3159538112},
      1e-9));
  // Label smoothing 0.1 and an ignored row: (softmax - (0.9 one_hot + 0.1 / 3)) / 1, and 0.
  const Tensor l2 = from_vector({1, 2, 3, 1, 2, 3}, {2, 3}, f64_grad);
  cross_entropy(l2, targets({2, -100}, {2}), -100, 0.1).backward();
  EXPECT_TRUE(values_near(l2.grad(), {0.0566972398, 0.2113951377, -0.2680923776, 0, 0, 0}, 1e-9));
}

TEST(CrossEntropy, MatchesLogSoftmaxThenNllLoss) {
  Generator g(5);
  const Tensor x = rand_input({4, 5, 3}, -3, 3, 21).detach();
  const Tensor t = ops::randint(0, 5, {4, 3}, DType::int64, Device::cpu(), &g);
  for (const char* red : {"mean", "sum", "none"}) {
    const Tensor fused = cross_entropy(x, t, -100, 0.0, red);
    const Tensor composed = nll_loss(log_softmax(x, 1), t, -100, red);
    EXPECT_TRUE(values_near(fused, composed.tolist(), 1e-12)) << red;
  }
}

TEST(CrossEntropy, BackwardSavesLogitsTargetsAndRowLse) {
  const Tensor logits = rand_input({4, 6}, -1, 1, 7);
  const Tensor t = targets({0, 5, 2, -100}, {4});
  const Tensor loss = cross_entropy(logits, t, -100, 0.1);
  const auto saved = saved_of(loss);
  ASSERT_EQ(saved.size(), 3u);
  EXPECT_TRUE(saved[0]->held().storage().is_same(logits.storage()));
  EXPECT_TRUE(saved[1]->held().storage().is_same(t.storage()));
  // One float64 per row besides: never the [N, C] softmax.
  EXPECT_EQ(saved[2]->held().nbytes(), 4 * sizeof(double));
  // nll_loss keeps only the targets.
  const Tensor nl = nll_loss(logits, t);
  ASSERT_EQ(saved_of(nl).size(), 1u);
  EXPECT_TRUE(saved_of(nl)[0]->held().storage().is_same(t.storage()));
}

// cross_entropy_with_lse: lse is each row's log(sum(exp(x))) in the target's shape (0 for an
// ignored row); the backward from it equals the backward that recomputes the statistics.
TEST(CrossEntropy, SavedLseIsTheRowLogSumExp) {
  const Tensor x = rand_input({5, 7}, -4, 4, 11).detach();
  const Tensor t = targets({0, 6, -100, 3, 3}, {5});
  for (double eps : {0.0, 0.1}) {
    const ops::CrossEntropyOutput r =
        ops::cross_entropy_with_lse(x, t, -100, eps, ops::LossReduction::mean);
    ASSERT_EQ(r.lse.sizes(), Shape({5}));
    ASSERT_EQ(r.lse.dtype(), DType::float64);
    const std::vector<double> xs = x.tolist(), lse = r.lse.tolist();
    for (int64_t i = 0; i < 5; ++i) {
      double sum = 0;
      for (int64_t c = 0; c < 7; ++c) sum += std::exp(xs[static_cast<size_t>(i * 7 + c)]);
      EXPECT_NEAR(lse[static_cast<size_t>(i)], i == 2 ? 0.0 : std::log(sum), 1e-12) << i;
    }
    EXPECT_NEAR(r.loss.item(), ops::cross_entropy(x, t, -100, eps).item(), 1e-14);
    for (auto red : {ops::LossReduction::mean, ops::LossReduction::sum, ops::LossReduction::none}) {
      const ops::CrossEntropyOutput rr = ops::cross_entropy_with_lse(x, t, -100, eps, red);
      const Tensor g = red == ops::LossReduction::none ? ops::randn({5}, DType::float64)
                                                       : ops::full({}, 0.75, DType::float64);
      const Tensor with = ops::cross_entropy_backward(g, x, t, -100, eps, red, rr.lse);
      const Tensor without = ops::cross_entropy_backward(g, x, t, -100, eps, red);
      EXPECT_TRUE(values_near(with, without.tolist(), 1e-12));
    }
  }
  // Spatial input [N, C, S]: lse is [N, S].
  const Tensor xs = rand_input({2, 3, 4}, -2, 2, 12).detach();
  const Tensor ts = targets({0, 1, 2, 0, 2, 2, 1, 0}, {2, 4});
  const ops::CrossEntropyOutput rs = ops::cross_entropy_with_lse(xs, ts);
  EXPECT_EQ(rs.lse.sizes(), Shape({2, 4}));
  EXPECT_TRUE(values_near(ops::cross_entropy_backward(ops::full({}, 1.0, DType::float64), xs, ts,
                                                      -100, 0.0, ops::LossReduction::mean, rs.lse),
                          ops::cross_entropy_backward(ops::full({}, 1.0, DType::float64), xs, ts,
                                                      -100, 0.0, ops::LossReduction::mean)
                              .tolist(),
                          1e-12));
  // A wrong lse is refused by name.
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::cross_entropy_backward(ops::full({}, 1.0, DType::float64), xs, ts, -100, 0.0,
                                          ops::LossReduction::mean,
                                          ops::zeros({8}, DType::float64));
      },
      {"cross_entropy_backward", "lse"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::cross_entropy_with_lse(xs, ts, -100, 0.0, ops::LossReduction::mean,
                                          DType::float16);
      },
      {"cross_entropy", "float16"});
}

// Under autocast, float16/bfloat16 logits stay as they are (no float32 copy is made or
// saved), the loss is float32 and the gradient comes back in the logits' dtype.
TEST(CrossEntropy, AutocastReadsLowPrecisionLogitsInPlace) {
  const Tensor x = rand_input({6, 10}, -3, 3, 8).detach();
  const Tensor t = targets({0, 9, 3, -100, 4, 4}, {6});
  const double ref = cross_entropy(x, t).item();
  for (DType d : {DType::bfloat16, DType::float16}) {
    const Tensor xd = x.to(d).requires_grad_();
    Tensor loss;
    {
      AutocastGuard autocast(DeviceType::cpu, d);
      loss = cross_entropy(xd, t);
    }
    EXPECT_EQ(loss.dtype(), DType::float32) << dtype_name(d);
    // Only the rounding of the logits themselves: the arithmetic is float32.
    EXPECT_NEAR(loss.item(), cross_entropy(xd.detach().to(DType::float64), t).item(), 1e-5);
    EXPECT_NEAR(loss.item(), ref, 3e-2);
    const auto saved = saved_of(loss);
    ASSERT_EQ(saved.size(), 3u);
    EXPECT_TRUE(saved[0]->held().storage().is_same(xd.storage())) << dtype_name(d);
    loss.backward();
    EXPECT_EQ(xd.grad().dtype(), d);
  }
}

TEST(CrossEntropy, LowPrecisionDtypes) {
  const Tensor x = rand_input({6, 10}, -3, 3, 8).detach();
  const Tensor t = targets({0, 9, 3, -100, 4, 4}, {6});
  const double ref = cross_entropy(x, t, -100, 0.1).item();
  Tensor gref;
  {
    const Tensor xr = x.clone().requires_grad_();
    cross_entropy(xr, t, -100, 0.1).backward();
    gref = xr.grad();
  }
  for (DType d : {DType::float32, DType::float16, DType::bfloat16}) {
    const double tol = d == DType::float32 ? 1e-6 : d == DType::float16 ? 5e-3 : 3e-2;
    const Tensor xd = x.to(d).requires_grad_();
    const Tensor loss = cross_entropy(xd, t, -100, 0.1);
    EXPECT_EQ(loss.dtype(), d);
    EXPECT_NEAR(loss.item(), ref, tol) << dtype_name(d);
    loss.backward();
    EXPECT_EQ(xd.grad().dtype(), d);
    EXPECT_TRUE(values_near(xd.grad(), gref.tolist(), tol)) << dtype_name(d);
  }
}

// ---------------------------------------------------------------- cross_entropy gradients

TEST(CrossEntropy, Gradients) {
  const Tensor x = rand_input({4, 5}, -2, 2, 31);
  const Tensor t = targets({1, 4, 0, 2}, {4});
  const Tensor ti = targets({1, -100, 0, 3}, {4});  // one ignored
  for (const char* red : {"mean", "sum", "none"}) {
    for (double ls : {0.0, 0.1}) {
      EXPECT_TRUE(gradcheck(
          [&](const TensorList& in) { return cross_entropy(in[0], t, -100, ls, red); }, {x}))
          << red << " " << ls;
      EXPECT_TRUE(gradcheck(
          [&](const TensorList& in) { return cross_entropy(in[0], ti, -100, ls, red); }, {x}))
          << red << " " << ls << " ignore_index";
    }
  }
  // A custom ignore_index that is a valid class.
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& in) { return cross_entropy(in[0], t, /*ignore_index=*/4, 0.1); }, {x}));
  // Non-contiguous logits (a transposed layout).
  const Tensor xn = rand_input_noncontig({4, 5}, 32);
  EXPECT_TRUE(
      gradcheck([&](const TensorList& in) { return cross_entropy(in[0], ti, -100, 0.1); }, {xn}));
  // Spatial [N, C, d1, d2] with target [N, d1, d2], one ignored.
  const Tensor xs = rand_input({2, 3, 2, 2}, -2, 2, 33);
  const Tensor ts = targets({0, 2, 1, -100, 2, 2, 0, 1}, {2, 2, 2});
  for (const char* red : {"mean", "sum", "none"})
    EXPECT_TRUE(gradcheck(
        [&](const TensorList& in) { return cross_entropy(in[0], ts, -100, 0.1, red); }, {xs}))
        << red;
  // [N, C, d] through a permuted view of [N, d, C] (the usual "classes last" layout).
  const Tensor xp = rand_input({2, 4, 3}, -2, 2, 34);
  const Tensor tp = targets({0, 2, 1, -100, 2, 2, 0, 1}, {2, 4});
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& in) {
        return cross_entropy(in[0].permute({0, 2, 1}), tp);
      },
      {xp}));
  // Unbatched.
  const Tensor xu = rand_input({5}, -2, 2, 35);
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& in) { return cross_entropy(in[0], full({}, 3.0, i64), -100, 0.1); },
      {xu}));
  // The loss feeding more graph (the gradient is not 1).
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& in) { return cross_entropy(in[0], t) * cross_entropy(in[0], ti); },
      {x}));
}

TEST(NllLoss, ValuesAndGradients) {
  const Tensor lp = from_vector({-1, -2, -3, -0.5, -4, -6}, {2, 3}, f64);
  EXPECT_TRUE(values_near(nll_loss(lp, targets({2, 0}, {2})), {1.75}));
  EXPECT_TRUE(values_near(nll_loss(lp, targets({2, 0}, {2}), -100, "sum"), {3.5}));
  EXPECT_TRUE(values_near(nll_loss(lp, targets({2, -100}, {2}), -100, "none"), {3.0, 0.0}));
  EXPECT_TRUE(values_near(nll_loss(lp, targets({2, -100}, {2})), {3.0}));
  const Tensor x = rand_input({3, 4}, -2, 2, 41);
  const Tensor t = targets({3, -100, 1}, {3});
  for (const char* red : {"mean", "sum", "none"})
    EXPECT_TRUE(gradcheck([&](const TensorList& in) { return nll_loss(in[0], t, -100, red); }, {x}))
        << red;
  const Tensor xs = rand_input({2, 3, 2}, -2, 2, 42);
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& in) {
        return nll_loss(log_softmax(in[0], 1), targets({0, 2, -100, 1}, {2, 2}));
      },
      {xs}));
  const Tensor xu = rand_input_noncontig({4, 3}, 43);
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& in) {
        return nll_loss(in[0], targets({0, 2, 1, 1}, {4}), -100, "sum");
      },
      {xu}));
}

// ---------------------------------------------------------------- errors

TEST(CrossEntropy, Errors) {
  const Tensor logits = zeros({2, 3});
  expect_error<std::out_of_range>(
      [&] {
        (void)cross_entropy(logits, targets({1, 3}, {2}));
      },
      {"cross_entropy", "target 3", "3 classes", "[2, 3]"});
  expect_error<std::out_of_range>(
      [&] {
        (void)cross_entropy(logits, targets({-1, 0}, {2}));
      },
      {"cross_entropy", "target -1", "3 classes"});
  expect_error<std::out_of_range>(
      [&] {
        (void)nll_loss(logits, targets({0, 7}, {2}));
      },
      {"nll_loss", "target 7", "3 classes"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)cross_entropy(logits, targets({1, 0, 2}, {3}));
      },
      {"cross_entropy", "[2, 3]", "[2]", "[3]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)cross_entropy(zeros({2, 3, 4}), targets({0, 1}, {2}));
      },
      {"cross_entropy", "[2, 3, 4]", "[2, 4]"});
  expect_error<std::invalid_argument>([&] { (void)cross_entropy(logits, zeros({2})); },
                                      {"cross_entropy", "int64", "float32"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)cross_entropy(logits, targets({0, 1}, {2}), -100, 0.0, "avg");
      },
      {"cross_entropy", "reduction", "'avg'"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)cross_entropy(logits, targets({0, 1}, {2}), -100, 1.5);
      },
      {"cross_entropy", "label_smoothing", "1.5"});
  expect_error<std::invalid_argument>(
      [&] { (void)cross_entropy(full({}, 1.0), full({}, 0.0, i64)); }, {"cross_entropy"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)softmax(targets({1, 2}, {2}), 0);
      },
      {"softmax", "int64"});
  expect_error<std::out_of_range>([&] { (void)softmax(logits, 2); }, {"softmax", "dimension 2"});
  expect_error<std::out_of_range>([&] { (void)log_softmax(logits, -3); },
                                  {"log_softmax", "dimension -3"});
  // The graph is usable after an error, and a good call still works.
  EXPECT_TRUE(values_near(cross_entropy(logits, targets({1, 2}, {2})), {std::log(3.0)}, 1e-6));
}

}  // namespace
}  // namespace tally
