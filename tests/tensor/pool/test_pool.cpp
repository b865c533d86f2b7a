// Pooling (max_pool2d, avg_pool2d, adaptive_avg_pool2d): hand-computed values and argmax
// indices, padding, dilation and ceil_mode windows, what backward saves, float64 gradient
// checks (overlapping windows, padding, ceil_mode, non-contiguous and unbatched inputs),
// 16-bit dtypes and errors naming the op and the shapes.
#include "autograd/node.h"
#include "tensor/pool/autograd.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using namespace testing;

// (i * 7) % n for i < n: a permutation of 0..n-1 (n coprime to 7), so no ties.
std::vector<double> perm_values(int n) {
  std::vector<double> v;
  for (int i = 0; i < n; ++i) v.push_back((i * 7) % n);
  return v;
}

// 4x4: [[0 7 14 5] [12 3 10 1] [8 15 6 13] [4 11 2 9]]
Tensor x4(TensorOptions opts = f64) {
  return from_vector(perm_values(16), {1, 1, 4, 4}, opts);
}
// 5x5: [[0 7 14 21 3] [10 17 24 6 13] [20 2 9 16 23] [5 12 19 1 8] [15 22 4 11 18]]
Tensor x5(TensorOptions opts = f64) {
  return from_vector(perm_values(25), {1, 1, 5, 5}, opts);
}

// ---------------------------------------------------------------- max_pool2d

TEST(MaxPool2d, ValuesAndIndices) {
  auto [y, idx] = max_pool2d_with_indices(x4(), 2);  // stride defaults to the kernel
  EXPECT_EQ(y.sizes(), (Shape{1, 1, 2, 2}));
  EXPECT_EQ(idx.dtype(), DType::int64);
  EXPECT_TRUE(values_near(y, {12, 14, 15, 13}));
  EXPECT_TRUE(values_near(idx, {4, 2, 9, 11}));

  // Overlapping 3x3 windows, stride 2, padding 1, ceil_mode: 3x3 output.
  std::tie(y, idx) = max_pool2d_with_indices(x4(), 3, 2, 1, 1, /*ceil_mode=*/true);
  EXPECT_EQ(y.sizes(), (Shape{1, 1, 3, 3}));
  EXPECT_TRUE(values_near(y, {12, 14, 5, 15, 15, 13, 11, 11, 9}));
  EXPECT_TRUE(values_near(idx, {4, 2, 3, 9, 9, 11, 13, 13, 15}));

  // ceil_mode keeps the partial last window: 5x5 -> 3x3 (2x2 without it).
  std::tie(y, idx) = max_pool2d_with_indices(x5(), 2, 2, 0, 1, true);
  EXPECT_TRUE(values_near(y, {17, 24, 13, 20, 19, 23, 22, 11, 18}));
  EXPECT_TRUE(values_near(idx, {6, 7, 9, 10, 17, 14, 21, 23, 24}));
  EXPECT_EQ(max_pool2d(x5(), 2).sizes(), (Shape{1, 1, 2, 2}));

  // Dilation 2, stride 1, padding 1: 5x5 -> 5x5.
  std::tie(y, idx) = max_pool2d_with_indices(x5(), 2, 1, 1, 2);
  EXPECT_TRUE(values_near(y, {17, 24, 17, 24, 6,  7,  20, 21, 23, 21, 17, 24, 17,
                              24, 6,  22, 20, 22, 23, 16, 12, 19, 12, 19, 1}));
  EXPECT_TRUE(values_near(idx, {6, 7, 6,  7,  8,  1,  10, 3,  14, 3,  6,  7, 6,
                                7, 8, 21, 10, 21, 14, 13, 16, 17, 16, 17, 18}));

  // Rectangular kernel and stride on an unbatched [C, H, W] input.
  y = max_pool2d(from_vector(perm_values(16), {1, 4, 4}, f64), {1, 2}, {2, 1});
  EXPECT_EQ(y.sizes(), (Shape{1, 2, 3}));
  EXPECT_TRUE(values_near(y, {7, 14, 14, 15, 15, 13}));
}

TEST(MaxPool2d, NanPropagates) {
  const Tensor x = from_vector({1, NAN, 3, 2}, {1, 1, 2, 2});
  auto [y, idx] = max_pool2d_with_indices(x, 2);
  EXPECT_TRUE(std::isnan(y.item()));
  EXPECT_EQ(idx.item(), 1);
}

TEST(MaxPool2d, BackwardRoutesToArgmaxAndSavesOnlyIndices) {
  const Tensor x = x4(f64_grad);
  const Tensor y = max_pool2d(x, 3, 2, 1, 1, true);
  const auto s = saved_by(y);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].dtype(), DType::int64);  // the argmax, not the input
  EXPECT_EQ(s[0].sizes(), y.sizes());
  EXPECT_FALSE(s[0].storage().is_same(x.storage()));
  y.sum().backward();
  // Argmax positions 4, 2, 3, 9 (twice), 11, 13 (twice), 15.
  EXPECT_TRUE(values_near(x.grad(), {0, 0, 1, 1, 1, 0, 0, 0, 0, 2, 0, 1, 0, 2, 0, 1}));
}

TEST(MaxPool2d, Gradients) {
  // Overlapping windows (kernel 3, stride 2), padding, ceil_mode, dilation.
  const Tensor x = rand_input({2, 3, 5, 5}, -1, 1, 1);
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return max_pool2d(t[0], 3, 2); }, {x}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return max_pool2d(t[0], 3, 2, 1); }, {x}));
  EXPECT_TRUE(
      gradcheck([](const TensorList& t) { return max_pool2d(t[0], 2, 2, 1, 1, true); }, {x}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return max_pool2d(t[0], 2, 1, 1, 2); }, {x}));
  EXPECT_TRUE(gradcheck(
      [](const TensorList& t) {
        return max_pool2d(t[0], {3, 2}, {1, 2}, {1, 0}, 1, true);
      },
      {x}));
  // Non-contiguous (a permuted view) and unbatched inputs.
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return max_pool2d(t[0], 3, 2, 1, 1, true); },
                        {rand_input_noncontig({2, 3, 5, 6}, 2)}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return max_pool2d(t[0], 2, 1); },
                        {rand_input({3, 4, 5}, -1, 1, 3)}));
}

// ---------------------------------------------------------------- avg_pool2d

TEST(AvgPool2d, Values) {
  // 3x3 windows, stride 2, padding 1, ceil_mode; padding counted in the divisor.
  Tensor y = avg_pool2d(x5(), 3, 2, 1, true, /*count_include_pad=*/true);
  EXPECT_EQ(y.sizes(), (Shape{1, 1, 3, 3}));
  EXPECT_TRUE(values_near(
      y, {34.0 / 9, 89.0 / 9, 43.0 / 9, 66.0 / 9, 106.0 / 9, 67.0 / 9, 6, 69.0 / 9, 38.0 / 9},
      1e-12));
  // Padding not counted: corners average 4 cells, edges 6, the centre 9.
  y = avg_pool2d(x5(), 3, 2, 1, true, /*count_include_pad=*/false);
  EXPECT_TRUE(
      values_near(y, {8.5, 89.0 / 6, 10.75, 11, 106.0 / 9, 67.0 / 6, 13.5, 11.5, 9.5}, 1e-12));
  // ceil_mode: the partial last window's divisor is clipped to the input (+ padding).
  y = avg_pool2d(x5(), 2, 2, 0, true);
  EXPECT_TRUE(values_near(y, {8.5, 16.25, 8, 9.75, 11.25, 15.5, 18.5, 7.5, 18}, 1e-12));
  // divisor_override
  y = avg_pool2d(x5(), 3, 2, 1, false, true, 2);
  EXPECT_TRUE(values_near(y, {17, 44.5, 21.5, 33, 53, 33.5, 27, 34.5, 19}, 1e-12));
  // Default stride = kernel, unbatched.
  y = avg_pool2d(from_vector(perm_values(16), {1, 4, 4}, f64), 2);
  EXPECT_EQ(y.sizes(), (Shape{1, 2, 2}));
  EXPECT_TRUE(values_near(y, {5.5, 7.5, 9.5, 7.5}, 1e-12));
}

TEST(AvgPool2d, BackwardSavesNothing) {
  const Tensor x = x4(f64_grad);
  const Tensor y = avg_pool2d(x, 2, 1);
  EXPECT_TRUE(saved_by(y).empty());
  y.sum().backward();
  // Each pixel gets 1/4 per 2x2 window covering it.
  EXPECT_TRUE(values_near(
      x.grad(), {0.25, 0.5, 0.5, 0.25, 0.5, 1, 1, 0.5, 0.5, 1, 1, 0.5, 0.25, 0.5, 0.5, 0.25}));
}

TEST(AvgPool2d, Gradients) {
  const Tensor x = rand_input({2, 3, 5, 5}, -1, 1, 4);
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return avg_pool2d(t[0], 3, 2); }, {x}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return avg_pool2d(t[0], 3, 2, 1); }, {x}));
  EXPECT_TRUE(
      gradcheck([](const TensorList& t) { return avg_pool2d(t[0], 3, 2, 1, true, false); }, {x}));
  EXPECT_TRUE(
      gradcheck([](const TensorList& t) { return avg_pool2d(t[0], 2, 2, 1, true, true); }, {x}));
  EXPECT_TRUE(gradcheck(
      [](const TensorList& t) {
        return avg_pool2d(t[0], {3, 2}, {2, 1}, {1, 1}, true, false, 3);
      },
      {x}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return avg_pool2d(t[0], 2, 1, 1, true, false); },
                        {rand_input_noncontig({2, 3, 5, 6}, 5)}));
  EXPECT_TRUE(gradcheck([](const TensorList& t) { return avg_pool2d(t[0], 2); },
                        {rand_input({3, 4, 5}, -1, 1, 6)}));
}

// ---------------------------------------------------------------- adaptive_avg_pool2d

TEST(AdaptiveAvgPool2d, Values) {
  // 5x7 (0..34) -> 3x2: rows [0,2) [1,4) [3,5), columns [0,4) [3,7).
  const Tensor x = from_vector(iota_values(35), {1, 1, 5, 7}, f64);
  const Tensor y = adaptive_avg_pool2d(x, {3, 2});
  EXPECT_EQ(y.sizes(), (Shape{1, 1, 3, 2}));
  EXPECT_TRUE(values_near(y, {5, 8, 15.5, 18.5, 26, 29}, 1e-12));
  // Output 1x1 is the global mean; output = input size is the identity.
  EXPECT_TRUE(values_near(adaptive_avg_pool2d(x, 1), {17}, 1e-12));
  EXPECT_TRUE(values_near(adaptive_avg_pool2d(x, {5, 7}), x.tolist(), 1e-12));
  // Upsampling (output larger than input) repeats cells.
  EXPECT_TRUE(
      values_near(adaptive_avg_pool2d(from_vector({1, 2}, {1, 1, 2}, f64), {1, 4}), {1, 1, 2, 2}));
}

TEST(AdaptiveAvgPool2d, Gradients) {
  EXPECT_TRUE(gradcheck(
      [](const TensorList& t) {
        return adaptive_avg_pool2d(t[0], {3, 2});
      },
      {rand_input({2, 3, 5, 7}, -1, 1, 7)}));
  EXPECT_TRUE(gradcheck(
      [](const TensorList& t) {
        return adaptive_avg_pool2d(t[0], {3, 2});
      },
      {rand_input_noncontig({2, 3, 5, 7}, 8)}));
  EXPECT_TRUE(gradcheck(
      [](const TensorList& t) {
        return adaptive_avg_pool2d(t[0], {4, 9});
      },
      {rand_input({3, 3, 5}, -1, 1, 9)}));
  const Tensor x = rand_input({1, 2, 5, 7}, -1, 1, 10);
  const Tensor y = adaptive_avg_pool2d(x, {3, 2});
  EXPECT_TRUE(saved_by(y).empty());
}

// ---------------------------------------------------------------- dtypes, errors

TEST(Pool2d, LowPrecisionDtypes) {
  const Tensor x = rand_input({2, 3, 6, 6}, -1, 1, 11);
  const std::vector<double> rmax = max_pool2d(x, 3, 2, 1).tolist();
  const std::vector<double> ravg = avg_pool2d(x, 3, 2, 1, true, false).tolist();
  const std::vector<double> rada = adaptive_avg_pool2d(x, {4, 3}).tolist();
  for (auto [dt, tol] :
       {std::pair{DType::float32, 1e-6}, {DType::float16, 2e-3}, {DType::bfloat16, 2e-2}}) {
    const Tensor xd = x.detach().to(dt).requires_grad_();
    const Tensor ym = max_pool2d(xd, 3, 2, 1), ya = avg_pool2d(xd, 3, 2, 1, true, false),
                 yd = adaptive_avg_pool2d(xd, {4, 3});
    EXPECT_EQ(ym.dtype(), dt);
    EXPECT_TRUE(values_near(ym, rmax, tol)) << dtype_name(dt);
    EXPECT_TRUE(values_near(ya, ravg, tol)) << dtype_name(dt);
    EXPECT_TRUE(values_near(yd, rada, tol)) << dtype_name(dt);
    (ym.sum() + ya.sum() + yd.sum()).backward();
    EXPECT_EQ(xd.grad().dtype(), dt);
    EXPECT_EQ(xd.grad().sizes(), x.sizes());
  }
}

TEST(Pool2d, ErrorsNameOpAndShapes) {
  const Tensor x = zeros({2, 3, 4, 4});
  std::string m = error_of<std::invalid_argument>([&] { max_pool2d(x, 5); });
  EXPECT_TRUE(
      contains(m,
               "max_pool2d: kernel [5, 5] (dilated [5, 5]) is larger than the padded input 4x4 "
               "(input [2, 3, 4, 4]"))
      << m;
  m = error_of<std::invalid_argument>([&] { max_pool2d(x, 2, 2, 2); });
  EXPECT_TRUE(contains(m,
                       "max_pool2d: padding [2, 2] should be at most half of the kernel size [2, "
                       "2] (input [2, 3, 4, 4])"))
      << m;
  // The undilated kernel bounds the padding, as in PyTorch.
  m = error_of<std::invalid_argument>([&] { max_pool2d(x, 2, 1, {0, 2}, 3); });
  EXPECT_TRUE(
      contains(m, "max_pool2d: padding [0, 2] should be at most half of the kernel size [2, 2]"))
      << m;
  m = error_of<std::invalid_argument>([&] { avg_pool2d(x, 3, 1, 2); });
  EXPECT_TRUE(contains(m, "avg_pool2d: padding [2, 2] should be at most half of the kernel size"))
      << m;
  m = error_of<std::invalid_argument>([&] { max_pool2d(x, 0); });
  EXPECT_TRUE(contains(m, "max_pool2d: kernel_size must be positive, got [0, 0]")) << m;
  m = error_of<std::invalid_argument>([&] { avg_pool2d(x, 2, {0, 1}); });
  EXPECT_TRUE(contains(m, "avg_pool2d: stride must be positive, got [0, 1]")) << m;
  m = error_of<std::invalid_argument>([&] { max_pool2d(x, 2, 1, 0, 0); });
  EXPECT_TRUE(contains(m, "max_pool2d: dilation must be positive")) << m;
  m = error_of<std::invalid_argument>([&] { max_pool2d(zeros({4, 4}), 2); });
  EXPECT_TRUE(
      contains(m, "max_pool2d: input must be 3-D [C, H, W] or 4-D [N, C, H, W], got [4, 4]"))
      << m;
  m = error_of<std::invalid_argument>([&] { avg_pool2d(zeros({1, 3, 0, 4}), 1); });
  EXPECT_TRUE(contains(m, "avg_pool2d: input [1, 3, 0, 4] has an empty spatial dimension")) << m;
  m = error_of<std::invalid_argument>([&] { adaptive_avg_pool2d(x, {0, 2}); });
  EXPECT_TRUE(contains(
      m, "adaptive_avg_pool2d: output_size must be positive, got [0, 2] (input [2, 3, 4, 4])"))
      << m;
  m = error_of<std::invalid_argument>([&] { avg_pool2d(x, 2, 2, 0, false, true, 0); });
  EXPECT_TRUE(contains(m, "avg_pool2d: divisor_override must not be zero")) << m;
  m = error_of<std::invalid_argument>([&] {
    max_pool2d(zeros({1, 1, 4, 4}, TensorOptions{}.with_dtype(DType::int64)), 2);
  });
  EXPECT_TRUE(contains(m, "max_pool2d: expected a floating tensor, got int64 [1, 1, 4, 4]")) << m;
  // Backward ops check what they are given.
  m = error_of<std::invalid_argument>([&] {
    ops::avg_pool2d_backward(zeros({2, 3, 3, 3}), {2, 3, 4, 4}, 2);
  });
  EXPECT_TRUE(contains(m,
                       "avg_pool2d_backward: grad_output [2, 3, 3, 3] does not match the output "
                       "[2, 3, 2, 2] for input [2, 3, 4, 4]"))
      << m;
  m = error_of<std::invalid_argument>([&] {
    ops::max_pool2d_backward(zeros({2, 3, 2, 2}), zeros({2, 3, 2, 2}), {2, 3, 4, 4});
  });
  EXPECT_TRUE(contains(m, "max_pool2d_backward: indices must be int64")) << m;
  EXPECT_THROW(ops::max_pool2d_backward(
                   zeros({1, 1, 1, 1}),
                   full({1, 1, 1, 1}, 16, TensorOptions{}.with_dtype(DType::int64)), {1, 1, 4, 4}),
               std::out_of_range);
}

}  // namespace
}  // namespace tally
