// Softmax family: softmax/log_softmax along any dim, the fused cross_entropy and nll_loss, one
// file for every device (tests/testing/devices.h). The OnDevice suites (Softmax, CrossEntropy,
// NllLoss) run on the CPU (test_softmax) and on CUDA device 0 (test_softmax_cuda): values
// against hand-computed cases, float64 gradient checks (non-last and negative dims,
// non-contiguous inputs, ignore_index, label smoothing, every reduction, the spatial form),
// what backward saves, autocast, lower-precision dtypes, an empty batch and the error
// messages. The VsCpu suite SoftmaxVsCpu runs on CUDA only: the kernels against the CPU's,
// forward and backward, over any dim and layout (each of the kernels' walks: a thread, a warp
// or a block per row, contiguous or strided rows), the losses with ignored targets, label
// smoothing, every reduction and the spatial [N, C, d] form, the saved log-sum-exp, what a
// device does with a bad target, autograd through them, and where the memory goes.
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "tensor/softmax/autograd.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace testing;

// The tensors a result's grad_fn holds for backward.
std::vector<const SavedTensor*> saved_of(const Tensor& out) {
  return out.autograd_meta()->grad_fn->saved_tensors();
}

// The OnDevice suites' fixture: targets() makes int64 class indices on the device under test.
class LossOnDevice : public OnDevice {
 protected:
  Tensor targets(std::initializer_list<double> v, const Shape& shape) const {
    return put(from_vector(std::vector<double>(v), shape, i64));
  }
};
class Softmax : public LossOnDevice {};
class CrossEntropy : public LossOnDevice {};
class NllLoss : public LossOnDevice {};
TALLY_ON_DEVICES(Softmax);
TALLY_ON_DEVICES(CrossEntropy);
TALLY_ON_DEVICES(NllLoss);

// ---------------------------------------------------------------- softmax values

TEST_P(Softmax, HandValues) {
  const Tensor x = put(from_vector({1, 2, 3}, {3}, f64));
  EXPECT_TRUE(values_near(softmax(x, 0), {0.0900305732, 0.2447284711, 0.6652409558}, 1e-9));
  EXPECT_TRUE(values_near(softmax(x, -1), {0.0900305732, 0.2447284711, 0.6652409558}, 1e-9));
  EXPECT_TRUE(values_near(log_softmax(x, 0), {-2.4076059644, -1.4076059644, -0.4076059644}, 1e-9));
  // Rows of a matrix, and columns (dim 0): softmax([1, 3]) = [0.1192029220, 0.8807970780].
  const Tensor m = put(from_vector({1, 2, 3, 4}, {2, 2}));
  EXPECT_TRUE(
      values_near(softmax(m, 0), {0.1192029220, 0.1192029220, 0.8807970780, 0.8807970780}, 1e-6));
  EXPECT_TRUE(
      values_near(softmax(m, -1), {0.2689414214, 0.7310585786, 0.2689414214, 0.7310585786}, 1e-6));
  // Stable for large logits (exp(1000) overflows without the max shift).
  const Tensor big = put(from_vector({1000, 1001, -1000, -1001}, {2, 2}));
  EXPECT_TRUE(
      values_near(softmax(big, 1), {0.2689414214, 0.7310585786, 0.7310585786, 0.2689414214}, 1e-6));
  EXPECT_TRUE(values_near(log_softmax(big, 1),
                          {-1.3132616875, -0.3132616875, -0.3132616875, -1.3132616875}, 1e-5));
  // 0-D: softmax is 1, log_softmax 0.
  const Tensor s = full({}, 5.0, on({}));
  EXPECT_EQ(softmax(s, 0).dim(), 0);
  EXPECT_TRUE(values_near(softmax(s, -1), {1.0}));
  EXPECT_TRUE(values_near(log_softmax(s, 0), {0.0}));
  // Empty along another dim.
  EXPECT_EQ(softmax(zeros({0, 3}, on({})), 1).sizes(), (Shape{0, 3}));
}

TEST_P(Softmax, NonContiguousAndMiddleDim) {
  // A transposed view: softmax along dim 0 of x^T equals softmax along dim 1 of x.
  const Tensor x = put(rand_input({3, 5}, -2, 2, 11).detach());
  const Tensor xt = x.transpose(0, 1);  // [5, 3], non-contiguous
  ASSERT_FALSE(xt.is_contiguous());
  EXPECT_TRUE(
      values_near(softmax(xt, 0), softmax(x, 1).transpose(0, 1).contiguous().tolist(), 1e-12));
  EXPECT_TRUE(values_near(log_softmax(xt, 0),
                          log_softmax(x, 1).transpose(0, 1).contiguous().tolist(), 1e-12));
  // The middle dim of a 3-D tensor: every [i, :, k] column sums to 1.
  const Tensor y = softmax(put(rand_input({2, 4, 3}, -3, 3, 12).detach()), 1);
  EXPECT_TRUE(values_near(ops::sum(y, {1}), std::vector<double>(6, 1.0), 1e-12));
}

TEST_P(Softmax, LowPrecisionDtypes) {
  const Tensor x = put(rand_input({4, 7}, -4, 4, 13).detach());
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

TEST_P(Softmax, Gradients) {
  const Tensor a = rand_input({3, 4}, -2, 2, 1);
  const Tensor c = rand_input_noncontig({4, 3}, 2);  // non-contiguous
  const Tensor b = rand_input({2, 3, 4}, -2, 2, 3);
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& x) { return softmax(x[0], -1); }, {a}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& x) { return softmax(x[0], 0); }, {a}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& x) { return softmax(x[0], 0); }, {c}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& x) { return softmax(x[0], 1); }, {b}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& x) { return log_softmax(x[0], 1); }, {a}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& x) { return log_softmax(x[0], 0); }, {c}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& x) { return log_softmax(x[0], -2); }, {b}));
  // Through a transposed view of a leaf, and composed twice.
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& x) { return softmax(x[0].transpose(0, 1), 0); }, {a}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& x) { return log_softmax(softmax(x[0], 1) * 3.0, 0); }, {a}));
}

TEST_P(Softmax, BackwardSavesOnlyTheOutput) {
  const Tensor x = leaf(rand_input({2, 5}, -1, 1, 4));
  for (bool log : {false, true}) {
    const Tensor y = log ? log_softmax(x, 1) : softmax(x, 1);
    const auto saved = saved_of(y);
    ASSERT_EQ(saved.size(), 1u);
    EXPECT_TRUE(saved[0]->held().storage().is_same(y.storage()));
  }
  // Hand gradient: d(sum(softmax(x) * w))/dx = y * (w - sum(w * y)).
  const Tensor v = leaf(from_vector({1, 2, 3}, {3}, f64));
  const Tensor w = put(from_vector({1, 0, 0}, {3}, f64));
  sum(softmax(v, 0) * w).backward();
  // y0 * (1 - y0), -y0 * y1, -y0 * y2
  EXPECT_TRUE(values_near(v.grad(), {0.0819250691, -0.0220330445, -0.0598920245}, 1e-9));
}

// ---------------------------------------------------------------- cross_entropy values

TEST_P(CrossEntropy, HandValues) {
  const Tensor logits = put(from_vector({1, 2, 3, 1, 2, 3}, {2, 3}, f64));
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
  const Tensor row = put(from_vector({1, 2, 3}, {3}, f64));
  EXPECT_TRUE(values_near(cross_entropy(row, targets({0}, {})), {2.4076059644}, 1e-9));
  EXPECT_EQ(cross_entropy(row, full({}, 1.0, on(i64)), -100, 0.0, "none").dim(), 0);
  // Spatial [N, C, d]: x[0, :, 0] = (0.5, -1, 2) with target 2, x[0, :, 1] = (1, 1, 0) with 0.
  const Tensor sp = put(from_vector({0.5, 1, -1, 1, 2, 0}, {1, 3, 2}, f64));
  const Tensor st = targets({2, 0}, {1, 2});
  EXPECT_TRUE(
      values_near(cross_entropy(sp, st, -100, 0.0, "none"), {0.2413112967, 0.8619948041}, 1e-9));
  EXPECT_EQ(cross_entropy(sp, st, -100, 0.0, "none").sizes(), (Shape{1, 2}));
  EXPECT_TRUE(values_near(cross_entropy(sp, st), {0.5516530504}, 1e-9));
  // Large logits stay finite.
  EXPECT_TRUE(
      values_near(cross_entropy(put(from_vector({1000, 1001, 1002}, {1, 3})), targets({2}, {1})),
                  {0.4076059644}, 1e-5));
}

TEST_P(CrossEntropy, HandGradient) {
  const Tensor logits = leaf(from_vector({1, 2, 3, 1, 2, 3}, {2, 3}, f64));
  cross_entropy(logits, targets({2, 0}, {2})).backward();
  // (softmax - one_hot) / 2 per row.
  EXPECT_TRUE(values_near(
      logits.grad(),
      {0.0450152866, 0.1223642355, -0.1673795221, -0.4549847134, 0.1223642355, 0.3326204779},
      1e-9));
  // Label smoothing 0.1, mean over both rows (values from PyTorch 2.11).
  const Tensor l1 = leaf(from_vector({1, 2, 3, 1, 2, 3}, {2, 3}, f64));
  cross_entropy(l1, targets({2, 0}, {2}), -100, 0.1).backward();
  EXPECT_TRUE(values_near(
      l1.grad(),
      {0.0283486199, 0.1056975689, -0.1340461888, -0.4216513801, 0.1056975689, 0.3159538112},
      1e-9));
  // Label smoothing 0.1 and an ignored row: (softmax - (0.9 one_hot + 0.1 / 3)) / 1, and 0.
  const Tensor l2 = leaf(from_vector({1, 2, 3, 1, 2, 3}, {2, 3}, f64));
  cross_entropy(l2, targets({2, -100}, {2}), -100, 0.1).backward();
  EXPECT_TRUE(values_near(l2.grad(), {0.0566972398, 0.2113951377, -0.2680923776, 0, 0, 0}, 1e-9));
}

TEST_P(CrossEntropy, MatchesLogSoftmaxThenNllLoss) {
  Generator g(5);
  const Tensor x = put(rand_input({4, 5, 3}, -3, 3, 21).detach());
  const Tensor t = ops::randint(0, 5, {4, 3}, DType::int64, dev(), &g);
  for (const char* red : {"mean", "sum", "none"}) {
    const Tensor fused = cross_entropy(x, t, -100, 0.0, red);
    const Tensor composed = nll_loss(log_softmax(x, 1), t, -100, red);
    EXPECT_TRUE(values_near(fused, composed.tolist(), 1e-12)) << red;
  }
}

TEST_P(CrossEntropy, BackwardSavesLogitsTargetsAndRowLse) {
  const Tensor logits = leaf(rand_input({4, 6}, -1, 1, 7));
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
TEST_P(CrossEntropy, SavedLseIsTheRowLogSumExp) {
  const Tensor x = put(rand_input({5, 7}, -4, 4, 11).detach());
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
      const Tensor g = red == ops::LossReduction::none ? put(ops::randn({5}, DType::float64))
                                                       : ops::full({}, 0.75, DType::float64, dev());
      const Tensor with = ops::cross_entropy_backward(g, x, t, -100, eps, red, rr.lse);
      const Tensor without = ops::cross_entropy_backward(g, x, t, -100, eps, red);
      EXPECT_TRUE(values_near(with, without.tolist(), 1e-12));
    }
  }
  // Spatial input [N, C, S]: lse is [N, S].
  const Tensor xs = put(rand_input({2, 3, 4}, -2, 2, 12).detach());
  const Tensor ts = targets({0, 1, 2, 0, 2, 2, 1, 0}, {2, 4});
  const ops::CrossEntropyOutput rs = ops::cross_entropy_with_lse(xs, ts);
  EXPECT_EQ(rs.lse.sizes(), Shape({2, 4}));
  EXPECT_TRUE(
      values_near(ops::cross_entropy_backward(ops::full({}, 1.0, DType::float64, dev()), xs, ts,
                                              -100, 0.0, ops::LossReduction::mean, rs.lse),
                  ops::cross_entropy_backward(ops::full({}, 1.0, DType::float64, dev()), xs, ts,
                                              -100, 0.0, ops::LossReduction::mean)
                      .tolist(),
                  1e-12));
  // A wrong lse is refused by name.
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::cross_entropy_backward(ops::full({}, 1.0, DType::float64, dev()), xs, ts, -100,
                                          0.0, ops::LossReduction::mean,
                                          ops::zeros({8}, DType::float64, dev()));
      },
      {"cross_entropy_backward", "lse"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::cross_entropy_with_lse(xs, ts, -100, 0.0, ops::LossReduction::mean,
                                          DType::float16);
      },
      {"cross_entropy", "float16"});
}

// cross_entropy_backward's `out`: the gradient written into the first C columns of a padded
// buffer (the padding untouched), or over the logits themselves (in place, given the lse), equal
// to the op's own output; out's shape, dtype and overlap are checked.
TEST_P(CrossEntropy, BackwardIntoPaddedOutAndInPlace) {
  constexpr double kSentinel = 1024.0;  // exact in every dtype
  const int64_t N = 5, C = 13, Cp = 16;
  const Tensor t = targets({0, 12, -100, 3, 7}, {5});
  for (DType dt : {DType::float64, DType::float32, DType::bfloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol = dt == DType::bfloat16 ? 1e-2 : dt == DType::float32 ? 1e-6 : 1e-12;
    const std::vector<double> sentinels(static_cast<size_t>(N * (Cp - C)), kSentinel);
    for (auto red : {ops::LossReduction::mean, ops::LossReduction::sum}) {
      const Tensor buf = ops::full({N, Cp}, kSentinel, dt, dev());
      const Tensor x = ops::narrow(buf, 1, 0, C);  // [N, C], rows Cp apart
      ops::copy_(x, ops::to(put(rand_input({N, C}, -4, 4, 21).detach()), dt));
      const ops::CrossEntropyOutput r = ops::cross_entropy_with_lse(x, t, -100, 0.1, red);
      const Tensor g = ops::full({}, 0.75, dt, dev());
      const std::vector<double> ref =
          ops::cross_entropy_backward(g, x, t, -100, 0.1, red, r.lse).tolist();
      // Into another padded buffer.
      const Tensor obuf = ops::full({N, Cp}, kSentinel, dt, dev());
      const Tensor out = ops::narrow(obuf, 1, 0, C);
      const Tensor got = ops::cross_entropy_backward(g, x, t, -100, 0.1, red, r.lse, out);
      EXPECT_EQ(got.data_ptr(), out.data_ptr());
      EXPECT_EQ(got.strides(), out.strides());
      EXPECT_TRUE(values_near(out, ref, tol));
      EXPECT_TRUE(values_near(ops::narrow(obuf, 1, C, Cp - C), sentinels, 0.0));
      // Over the logits, in place.
      ops::cross_entropy_backward(g, x, t, -100, 0.1, red, r.lse, x);
      EXPECT_TRUE(values_near(x, ref, tol));
      EXPECT_TRUE(values_near(ops::narrow(buf, 1, C, Cp - C), sentinels, 0.0));
    }
  }
  const Tensor buf = ops::zeros({N, Cp}, DType::float32, dev());
  const Tensor x = ops::narrow(buf, 1, 0, C);
  const ops::CrossEntropyOutput r = ops::cross_entropy_with_lse(x, t);
  const Tensor g = ops::full({}, 1.0, DType::float32, dev());
  auto backward_into = [&](const Tensor& out, const Tensor& lse) {
    (void)ops::cross_entropy_backward(g, x, t, -100, 0.0, ops::LossReduction::mean, lse, out);
  };
  expect_error<std::invalid_argument>(
      [&] {
        backward_into(ops::zeros({N, C + 1}, DType::float32, dev()), r.lse);
      },
      {"cross_entropy_backward: out must have input's shape and dtype", "out float32 [5, 14]",
       "input float32 [5, 13] strides [16, 1]"});
  expect_error<std::invalid_argument>(
      [&] {
        backward_into(ops::zeros({N, C}, DType::float64, dev()), r.lse);
      },
      {"cross_entropy_backward: out must have input's shape and dtype", "out float64"});
  // In place needs the forward's lse (without it the row statistics read the whole row first).
  expect_error<std::invalid_argument>(
      [&] { backward_into(x, Tensor()); },
      {"cross_entropy_backward: out shares storage with input", "lse not given"});
  // A view that overlaps the logits without being them.
  expect_error<std::invalid_argument>([&] { backward_into(ops::narrow(buf, 1, 1, C), r.lse); },
                                      {"cross_entropy_backward: out shares storage with input"});
}

// cross_entropy_and_backward is cross_entropy_with_lse then cross_entropy_backward: the same
// loss, lse and gradient, into a new tensor, into the first C columns of a padded buffer and
// over the logits in place; its argument errors name it.
TEST_P(CrossEntropy, AndBackwardIsTheTwoOps) {
  const int64_t N = 5, C = 13, Cp = 16;
  const Tensor t = targets({0, 12, -100, 3, 7}, {5});
  for (DType dt : {DType::float64, DType::float32, DType::bfloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol = dt == DType::bfloat16 ? 1e-2 : dt == DType::float32 ? 1e-5 : 1e-12;
    for (auto red : {ops::LossReduction::mean, ops::LossReduction::sum}) {
      SCOPED_TRACE(ops::loss_reduction_name(red));
      const Tensor buf = ops::zeros({N, Cp}, dt, dev());
      const Tensor x = ops::narrow(buf, 1, 0, C);  // [N, C], rows Cp apart
      ops::copy_(x, ops::to(put(rand_input({N, C}, -4, 4, 31).detach()), dt));
      const Tensor g = ops::full({}, 0.75, dt, dev());
      const ops::CrossEntropyOutput r = ops::cross_entropy_with_lse(x, t, -100, 0.0, red);
      const Tensor ref = ops::cross_entropy_backward(g, x, t, -100, 0.0, red, r.lse);
      const ops::CrossEntropyAndGrad a = ops::cross_entropy_and_backward(x, t, g, -100, 0.0, red);
      EXPECT_TRUE(values_near(a.loss, r.loss.tolist(), tol));
      EXPECT_TRUE(values_near(a.lse, r.lse.tolist(), tol));
      EXPECT_TRUE(values_near(a.grad_input, ref.tolist(), tol));
      // In place over the logits: the padding stays as it was.
      const ops::CrossEntropyAndGrad b =
          ops::cross_entropy_and_backward(x, t, g, -100, 0.0, red, std::nullopt, x);
      EXPECT_EQ(b.grad_input.data_ptr(), x.data_ptr());
      EXPECT_TRUE(values_near(b.loss, r.loss.tolist(), tol));
      EXPECT_TRUE(values_near(x, ref.tolist(), tol));
      EXPECT_TRUE(values_near(ops::narrow(buf, 1, C, Cp - C),
                              std::vector<double>(static_cast<size_t>(N * (Cp - C)), 0.0), 0.0));
    }
  }
  // Reduction none takes a per-row gradient; float32 loss for bfloat16 logits.
  const Tensor x = ops::to(put(rand_input({N, C}, -4, 4, 32).detach()), DType::bfloat16);
  const Tensor gr = ops::to(put(rand_input({N}, -1, 1, 33).detach()), DType::bfloat16);
  const ops::CrossEntropyAndGrad a = ops::cross_entropy_and_backward(
      x, t, gr, -100, 0.1, ops::LossReduction::none, DType::float32);
  EXPECT_EQ(a.loss.dtype(), DType::float32);
  EXPECT_EQ(a.loss.sizes(), (Shape{N}));
  EXPECT_TRUE(values_near(
      a.loss,
      ops::cross_entropy_with_lse(x, t, -100, 0.1, ops::LossReduction::none, DType::float32)
          .loss.tolist(),
      1e-6));
  EXPECT_TRUE(values_near(
      a.grad_input,
      ops::cross_entropy_backward(gr, x, t, -100, 0.1, ops::LossReduction::none).tolist(), 1e-2));
  const Tensor g = ops::full({}, 1.0, DType::float32, dev());
  const Tensor xf = put(rand_input({N, C}, -4, 4, 34).detach());
  expect_error<std::invalid_argument>(
      [&] { (void)ops::cross_entropy_and_backward(xf, t, ops::ones({N}, DType::float32, dev())); },
      {"cross_entropy_and_backward: grad [5] does not match the loss", "reduction mean"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::cross_entropy_and_backward(xf, t, g, -100, 0.0, ops::LossReduction::mean,
                                              DType::float16);
      },
      {"cross_entropy_and_backward: the loss dtype must be the input's", "got float16"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::cross_entropy_and_backward(xf, t, g, -100, 0.0, ops::LossReduction::mean,
                                              std::nullopt,
                                              ops::zeros({N, C + 1}, DType::float32, dev()));
      },
      {"cross_entropy_and_backward: out must have input's shape and dtype"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::cross_entropy_and_backward(xf, targets({0, 1, 2}, {3}), g);
      },
      {"cross_entropy_and_backward: input [5, 13] expects target [5], got target [3]"});
}

// Under autocast, float16/bfloat16 logits stay as they are (no float32 copy is made or
// saved), the loss is float32 and the gradient comes back in the logits' dtype.
TEST_P(CrossEntropy, AutocastReadsLowPrecisionLogitsInPlace) {
  const Tensor x = put(rand_input({6, 10}, -3, 3, 8).detach());
  const Tensor t = targets({0, 9, 3, -100, 4, 4}, {6});
  const double ref = cross_entropy(x, t).item();
  for (DType d : {DType::bfloat16, DType::float16}) {
    const Tensor xd = x.to(d).requires_grad_();
    Tensor loss;
    {
      AutocastGuard autocast(dev().type, d);
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

TEST_P(CrossEntropy, LowPrecisionDtypes) {
  const Tensor x = put(rand_input({6, 10}, -3, 3, 8).detach());
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

TEST_P(CrossEntropy, Gradients) {
  const Tensor x = rand_input({4, 5}, -2, 2, 31);
  const Tensor t = targets({1, 4, 0, 2}, {4});
  const Tensor ti = targets({1, -100, 0, 3}, {4});  // one ignored
  for (const char* red : {"mean", "sum", "none"}) {
    for (double ls : {0.0, 0.1}) {
      EXPECT_TRUE(gradcheck_on(
          dev(), [&](const TensorList& in) { return cross_entropy(in[0], t, -100, ls, red); }, {x}))
          << red << " " << ls;
      EXPECT_TRUE(gradcheck_on(
          dev(), [&](const TensorList& in) { return cross_entropy(in[0], ti, -100, ls, red); },
          {x}))
          << red << " " << ls << " ignore_index";
    }
  }
  // A custom ignore_index that is a valid class.
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& in) { return cross_entropy(in[0], t, /*ignore_index=*/4, 0.1); },
      {x}));
  // Non-contiguous logits (a transposed layout).
  const Tensor xn = rand_input_noncontig({4, 5}, 32);
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& in) { return cross_entropy(in[0], ti, -100, 0.1); }, {xn}));
  // Spatial [N, C, d1, d2] with target [N, d1, d2], one ignored.
  const Tensor xs = rand_input({2, 3, 2, 2}, -2, 2, 33);
  const Tensor ts = targets({0, 2, 1, -100, 2, 2, 0, 1}, {2, 2, 2});
  for (const char* red : {"mean", "sum", "none"})
    EXPECT_TRUE(gradcheck_on(
        dev(), [&](const TensorList& in) { return cross_entropy(in[0], ts, -100, 0.1, red); },
        {xs}))
        << red;
  // [N, C, d] through a permuted view of [N, d, C] (the usual "classes last" layout).
  const Tensor xp = rand_input({2, 4, 3}, -2, 2, 34);
  const Tensor tp = targets({0, 2, 1, -100, 2, 2, 0, 1}, {2, 4});
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& in) {
                             return cross_entropy(in[0].permute({0, 2, 1}), tp);
                           },
                           {xp}));
  // Unbatched.
  const Tensor xu = rand_input({5}, -2, 2, 35);
  EXPECT_TRUE(gradcheck_on(
      dev(),
      [&](const TensorList& in) { return cross_entropy(in[0], full({}, 3.0, on(i64)), -100, 0.1); },
      {xu}));
  // The loss feeding more graph (the gradient is not 1).
  EXPECT_TRUE(gradcheck_on(
      dev(),
      [&](const TensorList& in) { return cross_entropy(in[0], t) * cross_entropy(in[0], ti); },
      {x}));
}

TEST_P(NllLoss, ValuesAndGradients) {
  const Tensor lp = put(from_vector({-1, -2, -3, -0.5, -4, -6}, {2, 3}, f64));
  EXPECT_TRUE(values_near(nll_loss(lp, targets({2, 0}, {2})), {1.75}));
  EXPECT_TRUE(values_near(nll_loss(lp, targets({2, 0}, {2}), -100, "sum"), {3.5}));
  EXPECT_TRUE(values_near(nll_loss(lp, targets({2, -100}, {2}), -100, "none"), {3.0, 0.0}));
  EXPECT_TRUE(values_near(nll_loss(lp, targets({2, -100}, {2})), {3.0}));
  const Tensor x = rand_input({3, 4}, -2, 2, 41);
  const Tensor t = targets({3, -100, 1}, {3});
  for (const char* red : {"mean", "sum", "none"})
    EXPECT_TRUE(gradcheck_on(
        dev(), [&](const TensorList& in) { return nll_loss(in[0], t, -100, red); }, {x}))
        << red;
  const Tensor xs = rand_input({2, 3, 2}, -2, 2, 42);
  EXPECT_TRUE(
      gradcheck_on(dev(),
                   [&](const TensorList& in) {
                     return nll_loss(log_softmax(in[0], 1), targets({0, 2, -100, 1}, {2, 2}));
                   },
                   {xs}));
  const Tensor xu = rand_input_noncontig({4, 3}, 43);
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& in) {
                             return nll_loss(in[0], targets({0, 2, 1, 1}, {4}), -100, "sum");
                           },
                           {xu}));
}

// ---------------------------------------------------------------- errors

TEST_P(CrossEntropy, Errors) {
  const Tensor logits = zeros({2, 3}, on({}));
  // A target outside [0, C) is an error on the CPU; a device cannot throw for it without a
  // host sync and gives NaN instead (SoftmaxVsCpu.OutOfRangeTargetGivesNaNOnTheDevice).
  if (on_cpu()) {
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
  }
  expect_error<std::invalid_argument>(
      [&] {
        (void)cross_entropy(logits, targets({1, 0, 2}, {3}));
      },
      {"cross_entropy", "[2, 3]", "[2]", "[3]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)cross_entropy(zeros({2, 3, 4}, on({})), targets({0, 1}, {2}));
      },
      {"cross_entropy", "[2, 3, 4]", "[2, 4]"});
  expect_error<std::invalid_argument>([&] { (void)cross_entropy(logits, zeros({2}, on({}))); },
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
      [&] { (void)cross_entropy(full({}, 1.0, on({})), full({}, 0.0, on(i64))); },
      {"cross_entropy"});
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

// An empty batch: mean is 0 / 0 = NaN (as PyTorch), sum 0, none empty, and an empty gradient.
TEST_P(CrossEntropy, EmptyBatch) {
  const Tensor x = ops::zeros({0, 5}, DType::float32, dev());
  const Tensor t = ops::zeros({0}, DType::int64, dev());
  EXPECT_TRUE(std::isnan(ops::item(ops::cross_entropy(x, t))));
  EXPECT_EQ(ops::item(ops::cross_entropy(x, t, -100, 0.0, ops::LossReduction::sum)), 0.0);
  EXPECT_EQ(ops::cross_entropy(x, t, -100, 0.0, ops::LossReduction::none).numel(), 0);
  EXPECT_EQ(ops::cross_entropy_backward(ops::full({}, 1.0, DType::float32, dev()), x, t, -100, 0.0,
                                        ops::LossReduction::mean)
                .numel(),
            0);
}

// ---------------------------------------------------------------- against the CPU

using ops::LossReduction;

// int64 class indices in [0, C) of shape s; about `ignore_frac` of them set to ignore_index.
Tensor random_targets(const Shape& s, int64_t C, uint64_t seed, double ignore_frac = 0.0,
                      int64_t ignore_index = -100) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> v(static_cast<size_t>(shape_numel(s)));
  for (double& x : v)
    x = u(rng) < ignore_frac ? static_cast<double>(ignore_index)
                             : static_cast<double>(rng() % static_cast<uint64_t>(C));
  return ops::from_vector(v, s, DType::int64);
}

std::string red_name(LossReduction r) {
  return ops::loss_reduction_name(r);
}

const LossReduction kReductions[] = {LossReduction::none, LossReduction::sum, LossReduction::mean};

// The views the cases take of their base tensor.
Tensor same(const Tensor& t) {
  return t;
}
Tensor transposed(const Tensor& t) {
  return ops::transpose(t, 0, 1);
}

// A softmax case: the input is made as `base` (on the device and on the host alike), then
// viewed through `view` (which may make it non-contiguous), and reduced along `dim`.
struct SoftmaxCase {
  const char* what;
  Shape base;
  int64_t dim;
  std::function<Tensor(const Tensor&)> view;
};

std::vector<SoftmaxCase> softmax_cases() {
  const auto every_other_column = [](const Tensor& t) { return ops::slice(t, 1, 0, 154, 2); };
  const auto rows_2_to_6 = [](const Tensor& t) { return ops::slice(t, 0, 2, 6); };
  return {
      {"[5, 7] dim 1 (warp a row)", {5, 7}, 1, same},
      {"[5, 7] dim 0 (strided rows, warp)", {5, 7}, 0, same},
      {"[3, 50257] dim -1 (block a row, GPT vocabulary)", {3, 50257}, -1, same},
      {"[37, 1500] dim 0 (strided rows, column tiles, last tile partial)", {37, 1500}, 0, same},
      {"[3000, 40] dim 0 (strided long rows, column tiles)", {3000, 40}, 0, same},
      {"[3, 50257] dim 0 (short strided rows, thread a row)", {3, 50257}, 0, same},
      {"[2000, 3] dim 0 (strided long rows, block)", {2000, 3}, 0, same},
      {"[4, 5, 33] dim 1 (middle dim, column tiles with fewer elements than lanes)",
       {4, 5, 33},
       1,
       same},
      {"transpose of [33, 20], dim 0 (non-contiguous, stride-1 rows)", {33, 20}, 0, transposed},
      {"transpose of [33, 20], dim 1 (non-contiguous)", {33, 20}, 1, transposed},
      {"transpose of [1100, 9], dim 0 (non-contiguous, stride-1 rows, warp)",
       {1100, 9},
       0,
       transposed},
      {"transpose of [9, 1100], dim 1 (non-contiguous, thread a row)", {9, 1100}, 1, transposed},
      {"every other column of [6, 154], dim 1 (stride 2)", {6, 154}, 1, every_other_column},
      {"offset slice of [7, 40], rows 2..6, dim 1", {7, 40}, 1, rows_2_to_6},
      {"[1, 1] dim 1 (one element)", {1, 1}, 1, same},
      {"0-D", {}, 0, same},
  };
}

// A loss case: logits made as `base` then viewed through `view` into [N, C, ...] (or [C]),
// and the target's shape.
struct LossCase {
  const char* what;
  Shape base;
  std::function<Tensor(const Tensor&)> view;
  Shape target;
  int64_t classes;
};

std::vector<LossCase> loss_cases() {
  return {
      {"[64, 7] (warp a row)", {64, 7}, same, {64}, 7},
      {"[6, 50257] (block a row, GPT vocabulary)", {6, 50257}, same, {6}, 50257},
      {"[3, 1500] (block a row)", {3, 1500}, same, {3}, 1500},
      {"spatial [3, 5, 17] (strided class dim, column tiles)", {3, 5, 17}, same, {3, 17}, 5},
      {"spatial [2, 40, 300] (column tiles)", {2, 40, 300}, same, {2, 300}, 40},
      {"spatial [2, 5, 600] (thread a row)", {2, 5, 600}, same, {2, 600}, 5},
      {"spatial [4, 3, 4000] (two-level loss sum)", {4, 3, 4000}, same, {4, 4000}, 3},
      {"spatial [2, 3, 4, 5]", {2, 3, 4, 5}, same, {2, 4, 5}, 3},
      {"transpose of [33, 40] (non-contiguous [40, 33])", {33, 40}, transposed, {40}, 33},
      {"every other class of [10, 26] (stride 2)",
       {10, 26},
       [](const Tensor& t) { return ops::slice(t, 1, 0, 26, 2); },
       {10},
       13},
      {"unbatched [11]", {11}, same, {}, 11},
  };
}

// The gradient a loss's backward takes: the target's shape (none) or 0-D.
Tensor loss_grad(const LossCase& c, LossReduction r, DType d, uint64_t seed) {
  if (r == LossReduction::none) return rand_tensor(c.target, d, seed, -1.5, 1.5);
  return ops::full({}, 0.75, d);
}

// The same loss inputs on the CPU (xc, tc) and on the device under test (xg, tg).
struct LossInputs {
  const LossCase& c;
  DType d;
  Tensor xc, xg, tc, tg;
  int64_t ignore;
  std::string what;
};

class SoftmaxVsCpu : public VsCpu {
 protected:
  // Calls check(in) for every loss case and float dtype, with logits uniform in [lo, hi), and
  // for two ignore_index values: -100 on about `ignore_frac` of the targets, and `valid`, a
  // class index, used as ignore_index. `seed` counts up.
  void for_each_loss_input(uint64_t& seed, double lo, double hi, int64_t valid, double ignore_frac,
                           const std::function<void(const LossInputs&)>& check) const {
    for (const LossCase& c : loss_cases()) {
      for (DType d : kFloatDtypes) {
        const Tensor base = rand_tensor(c.base, d, ++seed, lo, hi);
        for (int64_t ignore : {int64_t{-100}, valid}) {
          const Tensor tc = random_targets(c.target, c.classes, ++seed,
                                           ignore == -100 ? ignore_frac : 0.0, ignore);
          check({c, d, c.view(base), c.view(put(base)), tc, put(tc), ignore,
                 std::string(c.what) + " " + dtype_name(d) + " ignore_index " +
                     std::to_string(ignore)});
        }
      }
    }
  }
  // Leaves on the CPU and on the device under test holding the same values.
  std::pair<Tensor, Tensor> leaves(const Shape& s, DType d, uint64_t seed, double lo,
                                   double hi) const {
    Tensor c = rand_tensor(s, d, seed, lo, hi);
    const Tensor g = leaf(c);
    c.requires_grad_();
    return {c, g};
  }
};
TALLY_VS_CPU(SoftmaxVsCpu);

// A logits dtype of kFloatDtypes, the loss dtype asked of it (float32 for 16-bit logits, as
// under autocast; none for the others) and the dtype the loss then comes out in.
struct LossDtypes {
  DType d;
  std::optional<DType> asked;
  DType loss;
};

std::vector<LossDtypes> loss_dtypes() {
  std::vector<LossDtypes> out;
  for (DType d : kFloatDtypes) {
    const bool half = d == DType::float16 || d == DType::bfloat16;
    out.push_back(
        {d, half ? std::optional<DType>(DType::float32) : std::nullopt, half ? DType::float32 : d});
  }
  return out;
}

// ------------------------------------------------------------------ softmax

TEST_P(SoftmaxVsCpu, ForwardMatchesTheCpu) {
  uint64_t seed = 1;
  for (const SoftmaxCase& c : softmax_cases()) {
    for (DType d : kFloatDtypes) {
      const Tensor base = rand_tensor(c.base, d, ++seed, -4, 4);
      const Tensor xc = c.view(base), xg = c.view(put(base));
      for (bool log : {false, true}) {
        const Tensor yc = log ? ops::log_softmax(xc, c.dim) : ops::softmax(xc, c.dim);
        const Tensor yg = log ? ops::log_softmax(xg, c.dim) : ops::softmax(xg, c.dim);
        EXPECT_TRUE(close_pointwise(yg, yc, pointwise_tol(d)))
            << (log ? "log_softmax " : "softmax ") << c.what << " " << dtype_name(d);
      }
    }
  }
}

TEST_P(SoftmaxVsCpu, BackwardMatchesTheCpu) {
  uint64_t seed = 100;
  for (const SoftmaxCase& c : softmax_cases()) {
    for (DType d : kFloatDtypes) {
      const Tensor xc = c.view(rand_tensor(c.base, d, ++seed, -4, 4));
      const Tensor gbase = rand_tensor(c.base, d, ++seed);
      const Tensor gc = c.view(gbase), gg = c.view(put(gbase));  // grad in the view's layout
      for (bool log : {false, true}) {
        const Tensor yc = log ? ops::log_softmax(xc, c.dim) : ops::softmax(xc, c.dim);
        const Tensor yg = put(yc);  // the same forward output on both sides
        const Tensor rc =
            log ? ops::log_softmax_backward(gc, yc, c.dim) : ops::softmax_backward(gc, yc, c.dim);
        const Tensor rg =
            log ? ops::log_softmax_backward(gg, yg, c.dim) : ops::softmax_backward(gg, yg, c.dim);
        EXPECT_TRUE(close_pointwise(rg, rc, pointwise_tol(d)))
            << (log ? "log_softmax_backward " : "softmax_backward ") << c.what << " "
            << dtype_name(d);
      }
    }
  }
}

TEST_P(SoftmaxVsCpu, ExtremeValuesMatchTheCpu) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Rows: large logits (no overflow), a -inf entry, all -inf (NaN), a NaN (NaN row), +inf.
  const Tensor x = ops::from_vector({1000, 1001, 999,  0,                   //
                                     -inf, 1,    2,    3,                   //
                                     -inf, -inf, -inf, -inf, 1, nan, 2, 3,  //
                                     inf,  1,    2,    3},
                                    {5, 4}, DType::float32);
  for (bool log : {false, true}) {
    const Tensor yc = log ? ops::log_softmax(x, 1) : ops::softmax(x, 1);
    const Tensor yg = log ? ops::log_softmax(put(x), 1) : ops::softmax(put(x), 1);
    EXPECT_TRUE(close_pointwise(yg, yc, 1e-5)) << (log ? "log_softmax" : "softmax");
  }
}

// ------------------------------------------------------------------ losses

TEST_P(SoftmaxVsCpu, CrossEntropyForwardAndBackwardMatchTheCpu) {
  uint64_t seed = 200;
  // ignore_index -100 on ~25% of the rows, or a valid class (2) used as ignore_index.
  for_each_loss_input(seed, -5, 5, 2, 0.25, [&](const LossInputs& in) {
    for (double eps : {0.0, 0.1}) {
      for (LossReduction r : kReductions) {
        const std::string what =
            in.what + " label_smoothing " + std::to_string(eps) + " reduction " + red_name(r);
        const Tensor lc = ops::cross_entropy(in.xc, in.tc, in.ignore, eps, r);
        const Tensor lg = ops::cross_entropy(in.xg, in.tg, in.ignore, eps, r);
        EXPECT_TRUE(close_pointwise(lg, lc, pointwise_tol(in.d))) << "cross_entropy " << what;
        const Tensor g = loss_grad(in.c, r, in.d, ++seed);
        const Tensor bc = ops::cross_entropy_backward(g, in.xc, in.tc, in.ignore, eps, r);
        const Tensor bg = ops::cross_entropy_backward(put(g), in.xg, in.tg, in.ignore, eps, r);
        EXPECT_TRUE(close_pointwise(bg, bc, pointwise_tol(in.d)))
            << "cross_entropy_backward " << what;
      }
    }
  });
}

// The saved log-sum-exp and the float32 loss of 16-bit logits (autocast) against the CPU, on
// class counts whose rows start at every 16-byte misalignment (unaligned head, 16-byte packs,
// tail); the backward from the lse equals the one that recomputes the statistics.
TEST_P(SoftmaxVsCpu, SavedLseAndFloat32LossMatchTheCpu) {
  uint64_t seed = 900;
  for (const auto& [d, loss_dtype, ld] : loss_dtypes()) {
    for (int64_t C : {int64_t{7}, int64_t{1003}, int64_t{8195}}) {
      const Tensor x = rand_tensor({37, C}, d, ++seed, -6, 6);
      const Tensor t = random_targets({37}, C, ++seed, 0.2);
      const Tensor xg = put(x), tg = put(t);
      for (LossReduction r : kReductions) {
        const std::string what =
            std::string(dtype_name(d)) + " C " + std::to_string(C) + " " + red_name(r);
        const ops::CrossEntropyOutput rc =
            ops::cross_entropy_with_lse(x, t, -100, 0.0, r, loss_dtype);
        const ops::CrossEntropyOutput rg =
            ops::cross_entropy_with_lse(xg, tg, -100, 0.0, r, loss_dtype);
        EXPECT_EQ(rg.loss.dtype(), ld) << what;
        EXPECT_TRUE(close_pointwise(rg.loss, rc.loss, pointwise_tol(ld))) << "loss " << what;
        EXPECT_TRUE(close_pointwise(rg.lse, rc.lse,
                                    pointwise_tol(d == DType::float64 ? d : DType::float32)))
            << "lse " << what;
        const Tensor g = r == LossReduction::none ? rand_tensor({37}, ld, ++seed, -1.5, 1.5)
                                                  : ops::full({}, 0.75, ld);
        const Tensor bc = ops::cross_entropy_backward(g, x, t, -100, 0.0, r);
        const Tensor bg = ops::cross_entropy_backward(put(g), xg, tg, -100, 0.0, r, rg.lse);
        EXPECT_TRUE(close_pointwise(bg, bc, pointwise_tol(d))) << "backward " << what;
        // A gradient whose rows are not 16-byte aligned like the logits' (scalar write path).
        const Tensor xo = ops::narrow(put(rand_tensor({37, C + 1}, d, ++seed, -6, 6)), 1, 1, C);
        const ops::CrossEntropyOutput ro =
            ops::cross_entropy_with_lse(xo, tg, -100, 0.0, r, loss_dtype);
        EXPECT_TRUE(close_pointwise(
            ops::cross_entropy_backward(put(g), xo, tg, -100, 0.0, r, ro.lse),
            ops::cross_entropy_backward(g, ops::to(xo, Device::cpu(), d), t, -100, 0.0, r),
            pointwise_tol(d)))
            << "offset backward " << what;
      }
    }
  }
}

// The fused classifier's one-pass kernel (aligned contiguous rows, 0-D grad) and its
// two-kernel fallback (unaligned rows, reduction none, label smoothing, float64) against the
// CPU's two ops: loss, lse and gradient, into a new tensor and in place, with ignored rows,
// GPT's vocabularies and a class count that leaves a tail past the last 16-byte pack.
TEST_P(SoftmaxVsCpu, CrossEntropyAndBackwardMatchTheCpu) {
  uint64_t seed = 950;
  for (const auto& [d, loss_dtype, ld] : loss_dtypes()) {
    for (int64_t C : {int64_t{7}, int64_t{8}, int64_t{1003}, int64_t{50257}, int64_t{50304}}) {
      for (LossReduction r : kReductions) {
        for (double eps : {0.0, 0.1}) {
          for (int64_t offset : {int64_t{0}, int64_t{1}}) {  // 1: rows not 16-byte aligned
            const std::string what = std::string(dtype_name(d)) + " C " + std::to_string(C) + " " +
                                     red_name(r) + " eps " + std::to_string(eps) + " offset " +
                                     std::to_string(offset);
            const int64_t N = C > 2000 ? 9 : 37, Cp = C + (8 - C % 8);
            const Tensor x = rand_tensor({N, C}, d, ++seed, -6, 6);
            const Tensor t = random_targets({N}, C, ++seed, 0.2);
            const Tensor g = r == LossReduction::none ? rand_tensor({N}, d, ++seed, -1.5, 1.5)
                                                      : ops::full({}, 0.75, d);
            const ops::CrossEntropyOutput fc =
                ops::cross_entropy_with_lse(x, t, -100, eps, r, loss_dtype);
            const Tensor bc = ops::cross_entropy_backward(g, x, t, -100, eps, r);
            // On the device: the logits as columns [offset, offset + C) of a [N, Cp + 8]
            // buffer, whose rows start 16-byte aligned (Cp is a multiple of 8).
            const Tensor buf = put(ops::zeros({N, Cp + 8}, d));
            const Tensor xg = ops::narrow(buf, 1, offset, C);
            ops::copy_(xg, put(x));
            const Tensor tg = put(t), gg = put(g);
            const ops::CrossEntropyAndGrad a =
                ops::cross_entropy_and_backward(xg, tg, gg, -100, eps, r, loss_dtype);
            // Label smoothing's loss adds C terms (max - x_c) in float on the device: over GPT's
            // vocabulary that is 2e-5 off the CPU's double sum (the cross_entropy kernel's own
            // precision; the fused kernel takes no smoothing).
            const double loss_tol =
                eps > 0 && C > 2000 && ld == DType::float32 ? 1e-4 : pointwise_tol(ld);
            EXPECT_EQ(a.loss.dtype(), ld) << what;
            EXPECT_TRUE(close_pointwise(a.loss, fc.loss, loss_tol)) << "loss " << what;
            EXPECT_TRUE(close_pointwise(a.lse, fc.lse,
                                        pointwise_tol(d == DType::float64 ? d : DType::float32)))
                << "lse " << what;
            EXPECT_TRUE(close_pointwise(a.grad_input, bc, pointwise_tol(d))) << "grad " << what;
            const ops::CrossEntropyAndGrad b =
                ops::cross_entropy_and_backward(xg, tg, gg, -100, eps, r, loss_dtype, xg);
            EXPECT_TRUE(close_pointwise(b.loss, fc.loss, loss_tol)) << "loss " << what;
            EXPECT_TRUE(close_pointwise(xg, bc, pointwise_tol(d))) << "in place " << what;
            // The columns outside the view are untouched.
            EXPECT_EQ(
                ops::item(ops::sum(ops::unary(
                    ops::UnaryOp::abs, ops::to(ops::narrow(buf, 1, offset + C, Cp + 8 - offset - C),
                                               DType::float64)))),
                0.0)
                << what;
          }
        }
      }
    }
  }
  // Every row ignored: mean NaN, sum 0, gradient 0; an out-of-range target: NaN loss and row.
  const Tensor x = put(rand_tensor({4, 16}, DType::bfloat16, 990));
  const Tensor one = put(ops::full({}, 1.0, DType::bfloat16));
  const ops::CrossEntropyAndGrad ig =
      ops::cross_entropy_and_backward(x, put(ops::full({4}, -100, DType::int64)), one, -100, 0.0,
                                      LossReduction::mean, DType::float32);
  EXPECT_TRUE(std::isnan(ops::item(ig.loss)));
  EXPECT_TRUE(close_pointwise(ig.grad_input, ops::zeros({4, 16}, DType::bfloat16), 0.0));
  const ops::CrossEntropyAndGrad bad =
      ops::cross_entropy_and_backward(x, put(ops::from_vector({1, 16, 2, -100}, {4}, DType::int64)),
                                      one, -100, 0.0, LossReduction::sum, DType::float32);
  EXPECT_TRUE(std::isnan(ops::item(bad.loss)));
  const std::vector<double> gb = ops::to_vector(bad.grad_input);
  for (int c = 0; c < 16; ++c) {
    EXPECT_TRUE(std::isnan(gb[static_cast<size_t>(16 + c)])) << c;
    EXPECT_FALSE(std::isnan(gb[static_cast<size_t>(c)])) << c;
    EXPECT_EQ(gb[static_cast<size_t>(48 + c)], 0.0) << c;
  }
}

TEST_P(SoftmaxVsCpu, AllTargetsIgnored) {
  for (DType d : {DType::float32, DType::bfloat16}) {
    const Tensor x = rand_tensor({8, 50}, d, 300);
    const Tensor t = ops::full({8}, -100, DType::int64);
    const Tensor xg = put(x), tg = put(t);
    for (double eps : {0.0, 0.2}) {
      // mean: 0 / 0 = NaN, as the CPU (and PyTorch).
      const Tensor mg = ops::cross_entropy(xg, tg, -100, eps, LossReduction::mean);
      EXPECT_TRUE(std::isnan(ops::item(mg))) << ops::item(mg) << " " << dtype_name(d);
      EXPECT_TRUE(std::isnan(ops::item(ops::cross_entropy(x, t, -100, eps, LossReduction::mean))));
      EXPECT_EQ(ops::item(ops::cross_entropy(xg, tg, -100, eps, LossReduction::sum)), 0.0);
      EXPECT_TRUE(close_pointwise(ops::cross_entropy(xg, tg, -100, eps, LossReduction::none),
                                  ops::cross_entropy(x, t, -100, eps, LossReduction::none), 0.0));
      // The gradients are all zero (no NaN from the 0 count).
      for (LossReduction r : kReductions) {
        const Tensor g = r == LossReduction::none ? ops::ones({8}, d) : ops::full({}, 1.0, d);
        const Tensor bg = ops::cross_entropy_backward(put(g), xg, tg, -100, eps, r);
        EXPECT_TRUE(close_pointwise(bg, ops::zeros({8, 50}, d), 0.0)) << red_name(r);
        EXPECT_TRUE(close_pointwise(bg, ops::cross_entropy_backward(g, x, t, -100, eps, r), 0.0));
      }
      const Tensor nm = ops::nll_loss(xg, tg, -100, LossReduction::mean);
      EXPECT_TRUE(std::isnan(ops::item(nm)));
      const Tensor nb = ops::nll_loss_backward(put(ops::full({}, 1.0, d)), {8, 50}, tg, -100,
                                               LossReduction::mean);
      EXPECT_TRUE(close_pointwise(nb, ops::zeros({8, 50}, d), 0.0));
    }
  }
}

// The device cannot throw for a bad target without a host sync: the row's loss is NaN
// (the mean with it), and its gradient row is NaN.
TEST_P(SoftmaxVsCpu, OutOfRangeTargetGivesNaNOnTheDevice) {
  const Tensor x = put(rand_tensor({3, 6}, DType::float32, 310));
  const Tensor t = put(ops::from_vector({1, 6, 2}, {3}, DType::int64));
  const std::vector<double> none =
      ops::to_vector(ops::cross_entropy(x, t, -100, 0.0, LossReduction::none));
  EXPECT_FALSE(std::isnan(none[0]));
  EXPECT_TRUE(std::isnan(none[1]));
  EXPECT_FALSE(std::isnan(none[2]));
  EXPECT_TRUE(std::isnan(ops::item(ops::cross_entropy(x, t))));
  const std::vector<double> g = ops::to_vector(ops::cross_entropy_backward(
      ops::full({}, 1.0, DType::float32, dev()), x, t, -100, 0.0, LossReduction::mean));
  for (int c = 0; c < 6; ++c) EXPECT_TRUE(std::isnan(g[static_cast<size_t>(6 + c)])) << c;
  EXPECT_TRUE(std::isnan(ops::item(ops::nll_loss(x, t))));
}

TEST_P(SoftmaxVsCpu, NllLossForwardAndBackwardMatchTheCpu) {
  uint64_t seed = 400;
  for_each_loss_input(seed, -5, 0, 1, 0.3, [&](const LossInputs& in) {
    for (LossReduction r : kReductions) {
      const std::string what = in.what + " reduction " + red_name(r);
      EXPECT_TRUE(close_pointwise(ops::nll_loss(in.xg, in.tg, in.ignore, r),
                                  ops::nll_loss(in.xc, in.tc, in.ignore, r), pointwise_tol(in.d)))
          << "nll_loss " << what;
      const Tensor g = loss_grad(in.c, r, in.d, ++seed);
      EXPECT_TRUE(close_pointwise(
          ops::nll_loss_backward(put(g), in.xc.sizes(), in.tg, in.ignore, r),
          ops::nll_loss_backward(g, in.xc.sizes(), in.tc, in.ignore, r), pointwise_tol(in.d)))
          << "nll_loss_backward " << what;
    }
  });
}

// ------------------------------------------------------------------ autograd

TEST_P(SoftmaxVsCpu, CrossEntropyAutogradMatchesTheCpu) {
  struct Case {
    Shape x;
    Shape t;
    int64_t C;
    const char* reduction;
    double eps;
  };
  const Case cases[] = {
      {{16, 50257}, {16}, 50257, "mean", 0.1},  // a GPT-2 head
      {{16, 50257}, {16}, 50257, "sum", 0.0},
      {{2, 5, 600}, {2, 600}, 5, "mean", 0.0},  // spatial
      {{9, 31}, {9}, 31, "none", 0.05},
  };
  uint64_t seed = 500;
  for (const Case& c : cases) {
    for (DType d : {DType::float32, DType::bfloat16}) {
      auto [xc, xg] = leaves(c.x, d, ++seed, -3, 3);
      const Tensor tc = random_targets(c.t, c.C, ++seed, 0.2), tg = put(tc);
      Tensor lc = tally::cross_entropy(xc, tc, -100, c.eps, c.reduction);
      Tensor lg = tally::cross_entropy(xg, tg, -100, c.eps, c.reduction);
      EXPECT_TRUE(close_pointwise(lg, lc, pointwise_tol(d))) << c.reduction << " " << dtype_name(d);
      if (std::string(c.reduction) == "none") {
        lc = tally::sum(lc);
        lg = tally::sum(lg);
      }
      lc.backward();
      lg.backward();
      ASSERT_TRUE(xg.grad().defined());
      EXPECT_EQ(xg.grad().device(), dev());
      EXPECT_TRUE(close_pointwise(xg.grad(), xc.grad(), pointwise_tol(d)))
          << c.reduction << " " << dtype_name(d);
    }
  }
}

TEST_P(SoftmaxVsCpu, SoftmaxLogSoftmaxNllAutogradMatchesTheCpu) {
  uint64_t seed = 600;
  for (DType d : {DType::float32, DType::float64}) {
    auto [xc, xg] = leaves({12, 130}, d, ++seed, -3, 3);
    const Tensor wc = rand_tensor({12, 130}, d, ++seed), wg = put(wc);
    const Tensor tc = random_targets({12}, 130, ++seed, 0.2), tg = put(tc);
    auto f = [](const Tensor& x, const Tensor& w, const Tensor& t) {
      const Tensor a = tally::sum(tally::mul(tally::softmax(x, 0), w));
      const Tensor b = tally::nll_loss(tally::log_softmax(x, 1), t);
      return tally::add(a, b);
    };
    const Tensor lc = f(xc, wc, tc), lg = f(xg, wg, tg);
    EXPECT_TRUE(close_pointwise(lg, lc, pointwise_tol(d))) << dtype_name(d);
    lc.backward();
    lg.backward();
    EXPECT_TRUE(close_pointwise(xg.grad(), xc.grad(), pointwise_tol(d))) << dtype_name(d);
  }
}

// ------------------------------------------------------------------ memory

TEST_P(SoftmaxVsCpu, CrossEntropyScratchIsTaggedAndReleased) {
  memory::CachingAllocator& alloc = memory::get_allocator(dev());
  const int64_t rows = 4096, C = 100;
  const Tensor x = put(rand_tensor({rows, C}, DType::float32, 700));
  const Tensor t = put(random_targets({rows}, C, 701, 0.1));
  const Tensor one = ops::full({}, 1.0, DType::float32, dev());
  // Many rows: the loss sum takes two levels (a second scratch buffer).
  const Tensor xs = put(rand_tensor({4, 3, 4000}, DType::float32, 702));
  const Tensor ts = put(random_targets({4, 4000}, 3, 703, 0.1));
  const size_t before = memory::memory_allocated(dev());
  alloc.record_memory_history(true);
  {
    const Tensor loss = ops::cross_entropy(x, t);
    const Tensor grad = ops::cross_entropy_backward(one, x, t, -100, 0.0, LossReduction::mean);
    const Tensor nll = ops::nll_loss(x, t);
    const Tensor spatial = ops::cross_entropy(xs, ts, -100, 0.0, LossReduction::sum);
    const Tensor spatial_grad =
        ops::cross_entropy_backward(one, xs, ts, -100, 0.0, LossReduction::mean);
    EXPECT_FALSE(std::isnan(ops::item(loss)));
    EXPECT_FALSE(std::isnan(ops::item(spatial)));
    EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::unknown).current, 0);
  }
  const auto history = alloc.history();
  alloc.record_memory_history(false);
  // The per-row partial losses (2 doubles a row) under cross_entropy and nll_loss and the
  // target count under cross_entropy_backward are scratch (`workspace`); grad_input is the
  // backward's output (`temporary`); nothing is unknown.
  const size_t partial_bytes = 2 * rows * sizeof(double);
  std::set<std::string> ops_with_partials;
  int backward_allocs = 0, backward_scratch = 0;
  for (const auto& e : history) {
    if (e.action != memory::TraceAction::alloc) continue;
    EXPECT_NE(e.tag.category, memory::Category::unknown) << memory::interned(e.tag.op);
    const std::string op = memory::interned(e.tag.op);
    if (e.tag.category == memory::Category::workspace && e.size >= partial_bytes &&
        e.size < 2 * partial_bytes)
      ops_with_partials.insert(op);
    if (op == "cross_entropy_backward" && e.tag.category == memory::Category::temporary)
      ++backward_allocs;
    if (op == "cross_entropy_backward" && e.tag.category == memory::Category::workspace)
      ++backward_scratch;
  }
  EXPECT_TRUE(ops_with_partials.count("cross_entropy")) << "no partial-loss scratch seen";
  EXPECT_TRUE(ops_with_partials.count("nll_loss")) << "no partial-loss scratch seen";
  EXPECT_GE(backward_allocs, 1) << "expected grad_input";
  EXPECT_GE(backward_scratch, 1) << "expected the target count";
  // Everything the ops allocated is back (scratch included).
  EXPECT_EQ(memory::memory_allocated(dev()), before);
}

}  // namespace
}  // namespace tally
