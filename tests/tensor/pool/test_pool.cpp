// Pooling (max_pool2d, avg_pool2d, adaptive_avg_pool2d) and upsample (F.interpolate), one file for
// every device (tests/testing/devices.h). On each device (the CPU in test_pool, CUDA in
// test_pool_cuda): hand-computed values and argmax indices, padding, dilation and ceil_mode
// windows, NaN, what backward saves, float64 gradient checks (overlapping windows, padding,
// ceil_mode, non-contiguous and unbatched inputs), 16-bit dtypes and errors naming the op and the
// shapes. On CUDA only, against the CPU reference: max_pool2d values, indices (ties, NaN, -inf) and
// its scatter-add backward, avg_pool2d with every divisor rule, adaptive_avg_pool2d (shrinking and
// growing), their backward gathers, over float32, float64, float16 and bfloat16, non-contiguous,
// unbatched and ResNet shapes; autograd end to end; the 64-bit index kernel past 2^31
// elements; where the outputs live in the allocator.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>

#include "autograd/node.h"
#include "memory/caching_allocator.h"
#include "memory/memory.h"
#include "tensor/pool/autograd.h"
#include "tensor/pool/math.h"
#include "tensor/pool/ops.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

#if defined(TALLY_WITH_CUDA)
#include <cuda_runtime.h>
#endif

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
Tensor x4_cpu() {
  return from_vector(perm_values(16), {1, 1, 4, 4}, f64);
}
// 5x5: [[0 7 14 21 3] [10 17 24 6 13] [20 2 9 16 23] [5 12 19 1 8] [15 22 4 11 18]]
Tensor x5_cpu() {
  return from_vector(perm_values(25), {1, 1, 5, 5}, f64);
}

// A float64 gradient check of op applied to one input.
struct GradCase {
  std::function<Tensor(const Tensor&)> op;
  Tensor x;  // a float64 leaf on the CPU
};

// The cases that run on every device: the hand-made inputs on dev().
class Pool2d : public OnDevice {
 protected:
  Tensor x4() const { return put(x4_cpu()); }
  Tensor x5() const { return put(x5_cpu()); }
  // gradcheck_on(dev()) of every case.
  void expect_gradients(const std::vector<GradCase>& cases) const {
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto& op = cases[i].op;
      EXPECT_TRUE(gradcheck_on(dev(), [&](const TensorList& t) { return op(t[0]); }, {cases[i].x}))
          << "case " << i;
    }
  }
};
TALLY_ON_DEVICES(Pool2d);

// ---------------------------------------------------------------- max_pool2d

TEST_P(Pool2d, MaxPool2dValuesAndIndices) {
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
  y = max_pool2d(from_vector(perm_values(16), {1, 4, 4}, on(f64)), {1, 2}, {2, 1});
  EXPECT_EQ(y.sizes(), (Shape{1, 2, 3}));
  EXPECT_TRUE(values_near(y, {7, 14, 14, 15, 15, 13}));
}

TEST_P(Pool2d, MaxPool2dNanPropagates) {
  const Tensor x = from_vector({1, NAN, 3, 2}, {1, 1, 2, 2}, on({}));
  auto [y, idx] = max_pool2d_with_indices(x, 2);
  EXPECT_TRUE(std::isnan(y.item()));
  EXPECT_EQ(idx.item(), 1);
}

TEST_P(Pool2d, MaxPool2dBackwardRoutesToArgmaxAndSavesOnlyIndices) {
  const Tensor x = leaf(x4_cpu());
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

TEST_P(Pool2d, MaxPool2dGradients) {
  // Overlapping windows (kernel 3, stride 2), padding, ceil_mode, dilation; non-contiguous (a
  // permuted view) and unbatched inputs.
  const Tensor x = rand_input({2, 3, 5, 5}, -1, 1, 1);
  expect_gradients({
      {[](const Tensor& t) { return max_pool2d(t, 3, 2); }, x},
      {[](const Tensor& t) { return max_pool2d(t, 3, 2, 1); }, x},
      {[](const Tensor& t) { return max_pool2d(t, 2, 2, 1, 1, true); }, x},
      {[](const Tensor& t) { return max_pool2d(t, 2, 1, 1, 2); }, x},
      {[](const Tensor& t) {
         return max_pool2d(t, {3, 2}, {1, 2}, {1, 0}, 1, true);
       },
       x},
      {[](const Tensor& t) { return max_pool2d(t, 3, 2, 1, 1, true); },
       rand_input_noncontig({2, 3, 5, 6}, 2)},
      {[](const Tensor& t) { return max_pool2d(t, 2, 1); }, rand_input({3, 4, 5}, -1, 1, 3)},
  });
}

// ---------------------------------------------------------------- avg_pool2d

TEST_P(Pool2d, AvgPool2dValues) {
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
  y = avg_pool2d(from_vector(perm_values(16), {1, 4, 4}, on(f64)), 2);
  EXPECT_EQ(y.sizes(), (Shape{1, 2, 2}));
  EXPECT_TRUE(values_near(y, {5.5, 7.5, 9.5, 7.5}, 1e-12));
}

TEST_P(Pool2d, AvgPool2dBackwardSavesNothing) {
  const Tensor x = leaf(x4_cpu());
  const Tensor y = avg_pool2d(x, 2, 1);
  EXPECT_TRUE(saved_by(y).empty());
  y.sum().backward();
  // Each pixel gets 1/4 per 2x2 window covering it.
  EXPECT_TRUE(values_near(
      x.grad(), {0.25, 0.5, 0.5, 0.25, 0.5, 1, 1, 0.5, 0.5, 1, 1, 0.5, 0.25, 0.5, 0.5, 0.25}));
}

TEST_P(Pool2d, AvgPool2dGradients) {
  const Tensor x = rand_input({2, 3, 5, 5}, -1, 1, 4);
  expect_gradients({
      {[](const Tensor& t) { return avg_pool2d(t, 3, 2); }, x},
      {[](const Tensor& t) { return avg_pool2d(t, 3, 2, 1); }, x},
      {[](const Tensor& t) { return avg_pool2d(t, 3, 2, 1, true, false); }, x},
      {[](const Tensor& t) { return avg_pool2d(t, 2, 2, 1, true, true); }, x},
      {[](const Tensor& t) {
         return avg_pool2d(t, {3, 2}, {2, 1}, {1, 1}, true, false, 3);
       },
       x},
      {[](const Tensor& t) { return avg_pool2d(t, 2, 1, 1, true, false); },
       rand_input_noncontig({2, 3, 5, 6}, 5)},
      {[](const Tensor& t) { return avg_pool2d(t, 2); }, rand_input({3, 4, 5}, -1, 1, 6)},
  });
}

// ---------------------------------------------------------------- adaptive_avg_pool2d

TEST_P(Pool2d, AdaptiveAvgPool2dValues) {
  // 5x7 (0..34) -> 3x2: rows [0,2) [1,4) [3,5), columns [0,4) [3,7).
  const Tensor x = from_vector(iota_values(35), {1, 1, 5, 7}, on(f64));
  const Tensor y = adaptive_avg_pool2d(x, {3, 2});
  EXPECT_EQ(y.sizes(), (Shape{1, 1, 3, 2}));
  EXPECT_TRUE(values_near(y, {5, 8, 15.5, 18.5, 26, 29}, 1e-12));
  // Output 1x1 is the global mean; output = input size is the identity.
  EXPECT_TRUE(values_near(adaptive_avg_pool2d(x, 1), {17}, 1e-12));
  EXPECT_TRUE(values_near(adaptive_avg_pool2d(x, {5, 7}), x.tolist(), 1e-12));
  // Upsampling (output larger than input) repeats cells.
  EXPECT_TRUE(values_near(adaptive_avg_pool2d(from_vector({1, 2}, {1, 1, 2}, on(f64)), {1, 4}),
                          {1, 1, 2, 2}));
}

TEST_P(Pool2d, AdaptiveAvgPool2dGradients) {
  expect_gradients({
      {[](const Tensor& t) {
         return adaptive_avg_pool2d(t, {3, 2});
       },
       rand_input({2, 3, 5, 7}, -1, 1, 7)},
      {[](const Tensor& t) {
         return adaptive_avg_pool2d(t, {3, 2});
       },
       rand_input_noncontig({2, 3, 5, 7}, 8)},
      {[](const Tensor& t) {
         return adaptive_avg_pool2d(t, {4, 9});
       },
       rand_input({3, 3, 5}, -1, 1, 9)},
  });
  const Tensor x = leaf(rand_input({1, 2, 5, 7}, -1, 1, 10));
  const Tensor y = adaptive_avg_pool2d(x, {3, 2});
  EXPECT_TRUE(saved_by(y).empty());
}

// ---------------------------------------------------------------- dtypes, errors

TEST_P(Pool2d, LowPrecisionDtypes) {
  const Tensor x = rand_input({2, 3, 6, 6}, -1, 1, 11);
  const std::vector<double> rmax = max_pool2d(x, 3, 2, 1).tolist();
  const std::vector<double> ravg = avg_pool2d(x, 3, 2, 1, true, false).tolist();
  const std::vector<double> rada = adaptive_avg_pool2d(x, {4, 3}).tolist();
  for (auto [dt, tol] :
       {std::pair{DType::float32, 1e-6}, {DType::float16, 2e-3}, {DType::bfloat16, 2e-2}}) {
    const Tensor xd = leaf(x.detach().to(dt));
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

// ---------------------------------------------------------------- upsample (F.interpolate)

TEST_P(Pool2d, UpsampleValuesAndGradients) {
  const Tensor line = put(from_vector({1, 2, 4}, {1, 1, 3}, f64));
  // linear 3 -> 5: src = 0.6 (o + 0.5) - 0.5, clamped at 0; align_corners: src = 0.5 o.
  EXPECT_TRUE(values_near(upsample(line, {5}, {}, true), {1, 1.4, 2, 3.2, 4}, 1e-12));
  EXPECT_TRUE(values_near(upsample(line, {5}, {}, true, true), {1, 1.5, 2, 3, 4}, 1e-12));
  // A given scale_factor steps by its inverse (PyTorch's scales): 1 / 1.7, not 3 / 5.
  EXPECT_TRUE(values_near(upsample(line, {5}, {1.7}, true),
                          {1, 1.3823529411764706, 1.9705882352941178, 3.1176470588235294, 4},
                          1e-12));
  EXPECT_TRUE(values_near(upsample(line, {5}), {1, 1, 2, 2, 4}, 0.0));
  EXPECT_TRUE(values_near(upsample(line, {6}, {2.0}), {1, 1, 2, 2, 4, 4}, 0.0));
  // To one output: PyTorch's scale 0 reads input 0, with or without align_corners.
  EXPECT_TRUE(values_near(upsample(line, {1}, {}, true), {1}, 0.0));
  const Tensor vol = put(from_vector({1, 2, 3, 4}, {1, 1, 1, 2, 2}, f64));
  EXPECT_TRUE(values_near(upsample(vol, {1, 3, 2}, {}, true, true), {1, 2, 2, 3, 3, 4}, 1e-12));
  const auto name = [](const Tensor& y) { return y.autograd_meta()->grad_fn->name(); };
  const Tensor lx = leaf(from_vector({1, 2, 3, 4}, {1, 1, 2, 2}, f64));
  EXPECT_EQ(name(upsample(lx, {3, 3}, {}, true)), "UpsampleBilinear2DBackward");
  EXPECT_EQ(name(upsample(lx, {3, 3})), "UpsampleNearest2DBackward");
  using V = std::vector<double>;
  const Tensor x1 = rand_input({2, 2, 3}, -1, 1, 21), x2 = rand_input({1, 2, 3, 4}, -1, 1, 22);
  const Tensor x3 = rand_input({1, 1, 2, 3, 2}, -1, 1, 23);
  const auto up = [](Shape out, V f, bool linear, bool corners) {
    return [=](const Tensor& t) { return upsample(t, out, f, linear, corners); };
  };
  expect_gradients({
      {up({7}, {}, true, false), x1},
      {up({2}, {}, true, false), x1},
      {up({5}, {}, true, true), x1},
      {up({5}, {1.7}, true, false), x1},
      {up({7}, {}, false, false), x1},
      {up({5, 3}, {}, true, false), x2},
      {up({4, 7}, {}, true, true), x2},
      {up({5, 3}, {}, false, false), x2},
      {up({6, 8}, {2, 2}, false, false), x2},
      {up({3, 4, 3}, {}, true, false), x3},
      {up({3, 2, 4}, {1.5, 0.7, 2}, true, false), x3},
      {up({3, 5, 1}, {}, true, true), x3},
      {up({3, 1, 5}, {}, false, false), x3},
      {up({5, 4, 3}, {}, true, false), rand_input_noncontig({1, 2, 2, 3, 2}, 24)},
  });
}

// Every input's readers (InterpAxis::readers, the backward's gather bounds) against a scan of
// every output's taps, over small sizes, each mode and scale rule.
TEST(Upsample, ReadersAreExactlyTheOutputsThatReadEachInput) {
  for (int64_t in = 1; in <= 9; ++in)
    for (int64_t out = 1; out <= 23; ++out)
      for (int rule = 0; rule < 4; ++rule) {
        const bool linear = rule != 0, corners = rule == 2;
        const double f = rule == 3 ? static_cast<double>(out) / static_cast<double>(in) + 0.05 : 0;
        ops::InterpParams p;
        p.in[2] = in;
        p.out[2] = out;
        p.linear = linear;
        p.align_corners = corners;
        p.nearest_scale[2] =
            f > 0 ? static_cast<float>(1.0 / f) : static_cast<float>(in) / static_cast<float>(out);
        p.linear_scale_d[2] = out <= 1  ? 0.0
                              : corners ? static_cast<double>(in - 1) / static_cast<double>(out - 1)
                              : f > 0   ? 1.0 / f
                                        : static_cast<double>(in) / static_cast<double>(out);
        const auto ax = math::interp_axes<int64_t, double>(p).a[2];
        for (int64_t i = 0; i < in; ++i) {
          int64_t lo = 0, hi = 0;
          ax.readers(i, lo, hi);
          for (int64_t o = 0; o < out; ++o) {
            const auto t = ax.tap(o);
            const bool reads = t.i0 == i || t.i1 == i;
            EXPECT_EQ(reads, o >= lo && o <= hi)
                << "in " << in << " out " << out << " rule " << rule << " input " << i << " output "
                << o << " readers [" << lo << ", " << hi << "]";
          }
        }
      }
}

TEST_P(Pool2d, ErrorsNameOpAndShapes) {
  const Tensor x = zeros({2, 3, 4, 4}, on({}));
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
  m = error_of<std::invalid_argument>([&] { max_pool2d(zeros({4, 4}, on({})), 2); });
  EXPECT_TRUE(
      contains(m, "max_pool2d: input must be 3-D [C, H, W] or 4-D [N, C, H, W], got [4, 4]"))
      << m;
  m = error_of<std::invalid_argument>([&] { avg_pool2d(zeros({1, 3, 0, 4}, on({})), 1); });
  EXPECT_TRUE(contains(m, "avg_pool2d: input [1, 3, 0, 4] has an empty spatial dimension")) << m;
  m = error_of<std::invalid_argument>([&] { adaptive_avg_pool2d(x, {0, 2}); });
  EXPECT_TRUE(contains(
      m, "adaptive_avg_pool2d: output_size must be positive, got [0, 2] (input [2, 3, 4, 4])"))
      << m;
  m = error_of<std::invalid_argument>([&] { avg_pool2d(x, 2, 2, 0, false, true, 0); });
  EXPECT_TRUE(contains(m, "avg_pool2d: divisor_override must not be zero")) << m;
  m = error_of<std::invalid_argument>([&] { max_pool2d(zeros({1, 1, 4, 4}, on(i64)), 2); });
  EXPECT_TRUE(contains(m, "max_pool2d: expected a floating tensor, got int64 [1, 1, 4, 4]")) << m;
  // Backward ops check what they are given.
  m = error_of<std::invalid_argument>([&] {
    ops::avg_pool2d_backward(zeros({2, 3, 3, 3}, on({})), {2, 3, 4, 4}, 2);
  });
  EXPECT_TRUE(contains(m,
                       "avg_pool2d_backward: grad_output [2, 3, 3, 3] does not match the output "
                       "[2, 3, 2, 2] for input [2, 3, 4, 4]"))
      << m;
  m = error_of<std::invalid_argument>([&] {
    ops::max_pool2d_backward(zeros({2, 3, 2, 2}, on({})), zeros({2, 3, 2, 2}, on({})), {2, 3, 4, 4},
                             2);
  });
  EXPECT_TRUE(contains(m, "max_pool2d_backward: indices must be int64")) << m;
  m = error_of<std::invalid_argument>([&] {
    ops::max_pool2d_backward(zeros({2, 3, 2, 2}, on({})), zeros({2, 3, 2, 2}, on(i64)),
                             {2, 3, 4, 4}, 3);
  });
  EXPECT_TRUE(contains(m, "grad_output [2, 3, 2, 2] does not match the output [2, 3, 1, 1]")) << m;
  // An index past the input, or outside its window: the CPU kernel throws; the CUDA kernel
  // never matches it (kernels.h).
  if (on_cpu()) {
    EXPECT_THROW(
        ops::max_pool2d_backward(zeros({1, 1, 1, 1}), full({1, 1, 1, 1}, 16, i64), {1, 1, 4, 4}, 4),
        std::out_of_range);
    m = error_of<std::out_of_range>([&] {
      ops::max_pool2d_backward(zeros({1, 1, 2, 2}), full({1, 1, 2, 2}, 0, i64), {1, 1, 4, 4}, 2);
    });
    EXPECT_TRUE(contains(m, "index 0 of output (0, 1) is not a position of its window")) << m;
  }
}

// ================================================================ CUDA against the CPU

// Exact equality of two int64 index tensors, with the first difference.
::testing::AssertionResult same_indices(const Tensor& got, const Tensor& ref) {
  if (got.dtype() != DType::int64 || got.sizes() != ref.sizes())
    return ::testing::AssertionFailure()
           << "indices: dtype or shape differ (" << dtype_name(got.dtype()) << " "
           << got.shape_string() << " vs " << ref.shape_string() << ")";
  const std::vector<double> a = ops::to_vector(got), b = ops::to_vector(ref);
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && bad++ == 0) first = i;
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << a.size() << " indices differ; first at "
                                       << first << ": got " << a[first] << ", want " << b[first];
}

struct PoolCase {
  const char* name;
  Shape x;
  Int2 kernel, stride, padding, dilation;
  bool ceil_mode;
};

const std::vector<PoolCase>& max_cases() {
  static const std::vector<PoolCase> c = {
      {"3x3 stride 2 padding 1 (ResNet)", {2, 3, 17, 13}, 3, 2, 1, 1, false},
      {"2x2", {2, 3, 16, 15}, 2, 2, 0, 1, false},
      {"2x2 ceil_mode", {2, 2, 9, 9}, 2, 2, 0, 1, true},
      {"3x3 stride 1 padding 1 dilation 2", {2, 2, 11, 9}, 3, 1, 1, 2, false},
      {"3x2 stride (2, 1) pad (1, 0) ceil_mode", {1, 3, 10, 7}, {3, 2}, {2, 1}, {1, 0}, 1, true},
      {"3x3 stride 3 padding 1 ceil_mode", {3, 2, 8, 11}, 3, 3, 1, 1, true},
      {"window covers the plane", {2, 2, 5, 4}, {5, 4}, 1, 0, 1, false},
  };
  return c;
}

std::string label(const char* name, DType d, const char* what) {
  return std::string(name) + " " + dtype_name(d) + " " + what;
}

// The cases that compare a device's kernels with the CPU's (accelerators only).
class Pool2dVsCpu : public VsCpu {
 protected:
  // Forward (values, indices) and backward of max_pool2d on the CPU and on dev() for `x`.
  void check_max(const PoolCase& c, const Tensor& x, uint64_t seed) const;
};
TALLY_VS_CPU(Pool2dVsCpu);

void Pool2dVsCpu::check_max(const PoolCase& c, const Tensor& x, uint64_t seed) const {
  const DType d = x.dtype();
  const auto [y, idx] =
      ops::max_pool2d_with_indices(x, c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode);
  const auto [yg, idxg] =
      ops::max_pool2d_with_indices(put(x), c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode);
  EXPECT_EQ(yg.device(), dev());
  EXPECT_EQ(idxg.device(), dev());
  const Diff e = diff_pointwise(yg, y);
  EXPECT_EQ(e.err, 0.0) << label(c.name, d, "max_pool2d values") << ": " << e.str();
  EXPECT_TRUE(same_indices(idxg, idx)) << label(c.name, d, "max_pool2d indices");

  const Tensor gy = rand_tensor(y.sizes(), d, seed);
  const Tensor gx = ops::max_pool2d_backward(gy, idx, x.sizes(), c.kernel, c.stride, c.padding,
                                             c.dilation, c.ceil_mode);
  const Tensor gxg = ops::max_pool2d_backward(put(gy), idxg, x.sizes(), c.kernel, c.stride,
                                              c.padding, c.dilation, c.ceil_mode);
  EXPECT_EQ(gxg.dtype(), d);
  // Both gather each element's windows in output order: the same sums, bit for bit.
  const Diff eb = diff_pointwise(gxg, gx);
  EXPECT_EQ(eb.err, 0.0) << label(c.name, d, "max_pool2d backward") << ": " << eb.str();
}

TEST_P(Pool2dVsCpu, MaxPool2dValuesIndicesAndBackwardMatchTheCpu) {
  uint64_t seed = 10;
  for (const PoolCase& c : max_cases())
    for (DType d : kFloatDtypes) {
      seed += 3;
      check_max(c, rand_tensor(c.x, d, seed), seed + 1);
    }
}

TEST_P(Pool2dVsCpu, MaxPool2dTiesNanAndInfinityLikeTheCpu) {
  for (DType d : kFloatDtypes) {
    for (const PoolCase& c : max_cases()) {
      // Ties: values from {0, 1, 2}; the first maximum in window order wins.
      std::vector<double> t = ops::to_vector(rand_tensor(c.x, DType::float64, 7, 0, 3));
      for (double& v : t) v = std::floor(v);
      check_max(c, ops::from_vector(t, c.x, d), 8);
      // NaN: a sprinkling of NaNs propagates, with the last NaN's index.
      std::vector<double> v = ops::to_vector(rand_tensor(c.x, DType::float64, 9));
      for (size_t i = 0; i < v.size(); i += 7) v[i] = std::numeric_limits<double>::quiet_NaN();
      check_max(c, ops::from_vector(v, c.x, d), 10);
      // All -inf: the value is -inf and the index the window's first in-bounds element.
      const Tensor ninf = ops::full(c.x, -std::numeric_limits<double>::infinity(), d, kCpu);
      check_max(c, ninf, 11);
    }
  }
}

struct AvgCase {
  const char* name;
  Shape x;
  Int2 kernel, stride, padding;
  bool ceil_mode, count_include_pad;
  std::optional<int64_t> divisor;
};

TEST_P(Pool2dVsCpu, AvgPool2dEveryDivisorRuleMatchesTheCpuExactly) {
  const std::vector<AvgCase> cases = {
      {"2x2", {2, 3, 16, 15}, 2, 2, 0, false, true, {}},
      {"3x3 stride 2 padding 1 count_include_pad", {2, 3, 17, 13}, 3, 2, 1, false, true, {}},
      {"3x3 stride 2 padding 1 exclude pad", {2, 3, 17, 13}, 3, 2, 1, false, false, {}},
      {"3x3 stride 2 padding 1 ceil_mode include pad", {2, 2, 10, 9}, 3, 2, 1, true, true, {}},
      {"3x3 stride 2 padding 1 ceil_mode exclude pad", {2, 2, 10, 9}, 3, 2, 1, true, false, {}},
      {"2x2 ceil_mode (partial last window)", {1, 3, 9, 7}, 2, 2, 0, true, true, {}},
      {"3x3 stride 1 padding 1 divisor_override 5", {2, 2, 8, 11}, 3, 1, 1, false, true, 5},
      {"4x3 stride (3, 2) pad (2, 1) ceil div 7", {1, 2, 13, 12}, {4, 3}, {3, 2}, {2, 1}, 1, 0, 7},
      {"overlapping 5x5 stride 1 padding 2", {2, 2, 9, 10}, 5, 1, 2, false, false, {}},
  };
  uint64_t seed = 40;
  for (const AvgCase& c : cases)
    for (DType d : kFloatDtypes) {
      const Tensor x = rand_tensor(c.x, d, seed += 3);
      const Tensor y = ops::avg_pool2d(x, c.kernel, c.stride, c.padding, c.ceil_mode,
                                       c.count_include_pad, c.divisor);
      const Tensor yg = ops::avg_pool2d(put(x), c.kernel, c.stride, c.padding, c.ceil_mode,
                                        c.count_include_pad, c.divisor);
      // Same window, same order, same rounding: bit for bit.
      Diff e = diff_pointwise(yg, y);
      EXPECT_EQ(e.err, 0.0) << label(c.name, d, "avg_pool2d") << ": " << e.str();
      const Tensor gy = rand_tensor(y.sizes(), d, seed + 1);
      const Tensor gx = ops::avg_pool2d_backward(gy, x.sizes(), c.kernel, c.stride, c.padding,
                                                 c.ceil_mode, c.count_include_pad, c.divisor);
      const Tensor gxg = ops::avg_pool2d_backward(put(gy), x.sizes(), c.kernel, c.stride, c.padding,
                                                  c.ceil_mode, c.count_include_pad, c.divisor);
      EXPECT_EQ(gxg.dtype(), d);
      e = diff_pointwise(gxg, gx);
      EXPECT_EQ(e.err, 0.0) << label(c.name, d, "avg_pool2d backward") << ": " << e.str();
    }
}

TEST_P(Pool2dVsCpu, AdaptiveAvgPool2dShrinkingAndGrowingMatchTheCpuExactly) {
  struct Case {
    Shape x;
    Int2 out;
  };
  const std::vector<Case> cases = {
      {{2, 3, 17, 13}, {5, 4}}, {{2, 3, 17, 13}, {1, 1}}, {{2, 3, 17, 13}, {17, 13}},
      {{1, 2, 10, 9}, {7, 3}},  {{1, 2, 5, 3}, {7, 5}},   {{3, 4, 7, 7}, {1, 1}},
      {{2, 2, 1, 6}, {3, 4}},
  };
  uint64_t seed = 70;
  for (const Case& c : cases)
    for (DType d : kFloatDtypes) {
      const std::string name = shape_str(c.x) + " -> " + c.out.str();
      const Tensor x = rand_tensor(c.x, d, seed += 3);
      const Tensor y = ops::adaptive_avg_pool2d(x, c.out);
      Diff e = diff_pointwise(ops::adaptive_avg_pool2d(put(x), c.out), y);
      EXPECT_EQ(e.err, 0.0) << label(name.c_str(), d, "adaptive_avg_pool2d") << ": " << e.str();
      const Tensor gy = rand_tensor(y.sizes(), d, seed + 1);
      e = diff_pointwise(ops::adaptive_avg_pool2d_backward(put(gy), x.sizes()),
                         ops::adaptive_avg_pool2d_backward(gy, x.sizes()));
      EXPECT_EQ(e.err, 0.0) << label(name.c_str(), d, "adaptive_avg_pool2d backward") << ": "
                            << e.str();
    }
}

TEST_P(Pool2dVsCpu, NonContiguousUnbatchedAndResNetShapes) {
  // Channels-last storage viewed as NCHW.
  const Tensor nhwc = rand_tensor({2, 13, 11, 5}, DType::float32, 90);
  const Tensor x = ops::permute(nhwc, {0, 3, 1, 2}), xg = ops::permute(put(nhwc), {0, 3, 1, 2});
  ASSERT_FALSE(xg.is_contiguous());
  const auto [y, idx] = ops::max_pool2d_with_indices(x, 3, 2, 1);
  const auto [yg, idxg] = ops::max_pool2d_with_indices(xg, 3, 2, 1);
  EXPECT_EQ(diff_pointwise(yg, y).err, 0.0);
  EXPECT_TRUE(same_indices(idxg, idx));
  EXPECT_EQ(diff_pointwise(ops::avg_pool2d(xg, 3, 2, 1, true, false),
                           ops::avg_pool2d(x, 3, 2, 1, true, false))
                .err,
            0.0);
  EXPECT_EQ(
      diff_pointwise(ops::adaptive_avg_pool2d(xg, {3, 2}), ops::adaptive_avg_pool2d(x, {3, 2})).err,
      0.0);
  // A non-contiguous grad_output.
  const Tensor wide = rand_tensor({2, 5, 7, 12}, DType::float32, 91);
  const Tensor gy = ops::slice(wide, 3, 0, 12, 2), gyg = ops::slice(put(wide), 3, 0, 12, 2);
  ASSERT_EQ(gy.sizes(), y.sizes());
  EXPECT_EQ(diff_pointwise(ops::max_pool2d_backward(gyg, idxg, x.sizes(), 3, 2, 1),
                           ops::max_pool2d_backward(gy, idx, x.sizes(), 3, 2, 1))
                .err,
            0.0);
  EXPECT_EQ(diff_pointwise(ops::avg_pool2d_backward(gyg, x.sizes(), 3, 2, 1),
                           ops::avg_pool2d_backward(gy, x.sizes(), 3, 2, 1))
                .err,
            0.0);

  // Unbatched [C, H, W].
  const Tensor x3 = rand_tensor({4, 9, 10}, DType::float32, 92);
  const auto [y3, i3] = ops::max_pool2d_with_indices(x3, 2);
  const auto [y3g, i3g] = ops::max_pool2d_with_indices(put(x3), 2);
  EXPECT_EQ(y3g.sizes(), (Shape{4, 4, 5}));
  EXPECT_EQ(diff_pointwise(y3g, y3).err, 0.0);
  EXPECT_TRUE(same_indices(i3g, i3));
  EXPECT_EQ(
      diff_pointwise(ops::adaptive_avg_pool2d(put(x3), 3), ops::adaptive_avg_pool2d(x3, 3)).err,
      0.0);

  // ResNet: the stem's 3x3/2 max pool on [8, 64, 56, 56] and the head's global average.
  const Tensor stem = rand_tensor({8, 64, 56, 56}, DType::float32, 93);
  const PoolCase resnet{"ResNet stem", stem.sizes(), 3, 2, 1, 1, false};
  check_max(resnet, stem, 94);
  const Tensor head = rand_tensor({8, 512, 7, 7}, DType::float32, 95);
  EXPECT_EQ(
      diff_pointwise(ops::adaptive_avg_pool2d(put(head), 1), ops::adaptive_avg_pool2d(head, 1)).err,
      0.0);
  const Tensor ghead = rand_tensor({8, 512, 1, 1}, DType::float32, 96);
  EXPECT_EQ(diff_pointwise(ops::adaptive_avg_pool2d_backward(put(ghead), head.sizes()),
                           ops::adaptive_avg_pool2d_backward(ghead, head.sizes()))
                .err,
            0.0);
}

TEST_P(Pool2dVsCpu, UpsampleEveryModeAndRankMatchesTheCpu) {
  struct Case {
    const char* name;
    Shape x, out;
    std::vector<double> f;
    bool linear, corners;
  };
  const std::vector<Case> cases = {
      {"linear x2", {2, 3, 17}, {34}, {}, true, false},
      {"linear align 7 -> 19", {2, 3, 7}, {19}, {}, true, true},
      {"linear scale 0.6", {2, 3, 20}, {12}, {0.6}, true, false},
      {"nearest 5 -> 13", {2, 3, 5}, {13}, {}, false, false},
      {"bilinear x2", {2, 3, 9, 11}, {18, 22}, {}, true, false},
      {"bilinear align, shrinking", {2, 3, 9, 11}, {5, 7}, {}, true, true},
      {"nearest 2-D scale 1.5", {2, 3, 9, 11}, {13, 16}, {1.5, 1.5}, false, false},
      {"trilinear x2", {2, 2, 5, 6, 7}, {10, 12, 14}, {}, true, false},
      {"trilinear align", {1, 3, 4, 5, 6}, {7, 3, 11}, {}, true, true},
      {"nearest 3-D x3", {2, 2, 3, 4, 5}, {9, 12, 15}, {3, 3, 3}, false, false},
      {"nearest 3-D shrinking", {1, 2, 7, 8, 9}, {3, 5, 4}, {}, false, false},
  };
  uint64_t seed = 70;
  for (const Case& c : cases)
    for (auto [d, tol] :
         {std::pair{DType::float32, 1e-6}, {DType::float64, 1e-13}, {DType::bfloat16, 1e-2}}) {
      const Tensor x = rand_tensor(c.x, d, seed += 3);
      const Tensor y = ops::upsample(x, c.out, c.f, c.linear, c.corners);
      const Tensor yg = ops::upsample(put(x), c.out, c.f, c.linear, c.corners);
      EXPECT_EQ(yg.dtype(), d);
      // The same taps and order; only the device's fused multiply-adds round differently.
      Diff e = diff_scaled(yg, y);
      EXPECT_LE(e.err, tol) << label(c.name, d, "upsample") << ": " << e.str();
      const Tensor gy = rand_tensor(y.sizes(), d, seed + 1);
      const Tensor gx = ops::upsample_backward(gy, x.sizes(), c.f, c.linear, c.corners);
      const Tensor gxg = ops::upsample_backward(put(gy), x.sizes(), c.f, c.linear, c.corners);
      EXPECT_EQ(gxg.dtype(), d);
      e = diff_scaled(gxg, gx);
      EXPECT_LE(e.err, tol) << label(c.name, d, "upsample backward") << ": " << e.str();
    }
}

TEST_P(Pool2dVsCpu, AutogradMatchesTheCpu) {
  const Tensor xc = rand_tensor({2, 3, 11, 10}, DType::float32, 100);
  Tensor x = xc.detach(), xg = put(xc);
  x.requires_grad_(), xg.requires_grad_();
  auto f = [](const Tensor& t) {
    return add(add(sum(mul(max_pool2d(t, 3, 2, 1), 1.5)), sum(avg_pool2d(t, 2, 2, 0, true, false))),
               sum(mul(adaptive_avg_pool2d(t, {3, 4}), 0.5)));
  };
  const Tensor l = f(x), lg = f(xg);
  EXPECT_LE(diff_pointwise(lg, l).err, 1e-5);
  l.backward();
  lg.backward();
  ASSERT_TRUE(xg.grad().defined());
  EXPECT_EQ(xg.grad().device(), dev());
  const Diff e = diff_pointwise(xg.grad(), x.grad());
  EXPECT_LE(e.err, 1e-6) << e.str();
}

#if defined(TALLY_WITH_CUDA)  // cudaMemGetInfo: the device must hold 4.3 GB
// Tensors whose flat indices fit in 31 bits take a kernel with 32-bit index arithmetic; larger
// ones the 64-bit kernel. Past 2^31 input elements (a 4.3 GB bfloat16 tensor, two planes), each
// plane's values and argmax indices from the 64-bit kernel must equal those of the same plane
// pooled alone (1.07e9 elements: the 32-bit kernel), compared on the device.
TEST_P(Pool2dVsCpu, MaxPool2dPastTwoToThe31ElementsTheWideKernelAgreesPlaneByPlane) {
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  if (free_bytes < (size_t{28} << 30))
    GTEST_SKIP() << "needs 28 GiB free on the GPU, has " << (free_bytes >> 20) << " MiB";
  const int64_t H = 32768, W = 32769, rows = 256;  // 2 * H * W = 2,147,549,184 > 2^31 - 1
  const Tensor base = put(rand_tensor({2, 1, 1, rows, W}, DType::bfloat16, 91));
  const Tensor x =
      ops::contiguous(ops::expand(base, {2, 1, H / rows, rows, W})).reshape({2, 1, H, W});
  ASSERT_GT(x.numel(), int64_t{0x7fffffff});
  auto max_abs_diff = [](const Tensor& a, const Tensor& b) {  // values or int64 indices
    const Tensor d = ops::sub(a, b);
    return std::max(ops::item(ops::max(d)), -ops::item(ops::min(d)));
  };
  const auto [y, idx] = ops::max_pool2d_with_indices(x, 3, 2, 1, 1, false);
  ASSERT_EQ(y.sizes(), (Shape{2, 1, H / 2, (W + 1) / 2}));
  for (int64_t plane = 0; plane < 2; ++plane) {
    const Tensor xp = x.narrow(0, plane, 1);
    ASSERT_LE(xp.numel(), int64_t{0x7fffffff});
    const auto [yp, ip] = ops::max_pool2d_with_indices(xp, 3, 2, 1, 1, false);
    EXPECT_EQ(max_abs_diff(y.narrow(0, plane, 1), yp), 0.0) << "plane " << plane << " values";
    EXPECT_EQ(max_abs_diff(idx.narrow(0, plane, 1), ip), 0.0) << "plane " << plane << " indices";
  }
  // the indices are real argmaxes: the last window of the last row holds column W - 1
  const Tensor last = idx.narrow(0, 1, 1).narrow(2, H / 2 - 1, 1).narrow(3, (W + 1) / 2 - 1, 1);
  const double j = ops::item(last);
  EXPECT_GE(j, static_cast<double>((H - 3) * W + W - 2));
  EXPECT_LT(j, static_cast<double>(H * W));
}
#endif  // TALLY_WITH_CUDA

// The outputs and gradients live in the device's allocator under the op's context; pooling
// asks for no workspace.
TEST_P(Pool2dVsCpu, AllocationsLandInTheDeviceAllocator) {
  memory::CachingAllocator& alloc = memory::get_allocator(dev());
  alloc.record_memory_history(true);
  const Tensor x = put(rand_tensor({2, 4, 12, 12}, DType::bfloat16, 110));
  const auto [y, idx] = ops::max_pool2d_with_indices(x, 2);
  const Tensor gx = ops::max_pool2d_backward(ops::ones_like(y), idx, x.sizes(), 2);
  const Tensor a = ops::avg_pool2d(x, 3, 1, 1);
  const Tensor ad = ops::adaptive_avg_pool2d(x, 5);
  const auto history = alloc.history();
  alloc.record_memory_history(false);
  for (const Tensor* t : {&y, &idx, &gx, &a, &ad}) {
    EXPECT_EQ(t->device(), dev());
    EXPECT_NE(t->storage().category(), memory::Category::unknown);
    EXPECT_GE(t->storage().block_bytes(), t->nbytes());
  }
  EXPECT_EQ(idx.dtype(), DType::int64);
  EXPECT_EQ(gx.dtype(), DType::bfloat16);
  size_t allocs = 0;
  for (const auto& e : history) {
    if (e.action != memory::TraceAction::alloc) continue;
    ++allocs;
    EXPECT_NE(e.tag.category, memory::Category::unknown) << memory::interned(e.tag.op);
    EXPECT_NE(e.tag.category, memory::Category::workspace) << memory::interned(e.tag.op);
  }
  EXPECT_GE(allocs, 5u);
  // max_pool2d_backward holds nothing but its result, in the gradient's dtype (no float32
  // buffer of the input's size for a bfloat16 gradient).
  size_t backward_allocs = 0;
  for (const auto& e : history)
    if (e.action == memory::TraceAction::alloc &&
        memory::interned(e.tag.op) == "max_pool2d_backward") {
      ++backward_allocs;
      EXPECT_EQ(e.size, gx.nbytes());
    }
  EXPECT_EQ(backward_allocs, 1u);
  EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::unknown).current, 0);
}

}  // namespace
}  // namespace tally
