// conv2d, written once against the device under test (tests/testing/devices.h).
//
// On every device (suite Conv2d: the CPU in test_conv, CUDA device 0 through cuDNN in
// test_conv_cuda): hand-computed values, a naive reference over many geometries, float64
// gradient checks (stride, padding, dilation, groups, bias, non-contiguous and unbatched
// inputs), what backward saves, 16-bit dtypes and errors naming the op and the shapes.
// The CPU alone: the im2col workspace accounting, and the ResNet-18 layer4 regression
// (suite Conv2dCpuPath: the backward-data GEMM at tiny spatial sizes, a BasicBlock's
// gradients, resnet18's own).
//
// On CUDA against the CPU reference (suite Conv2dVsCpu, accelerators only): forward,
// backward-data and backward-filter over many geometries (stride, padding, dilation, groups,
// depthwise, 1x1, bias, a ResNet 3x3) in float32, float64, float16 and bfloat16;
// non-contiguous, unbatched and empty inputs; autograd end to end; and cuDNN's internals: the
// workspace tagged `workspace` in the allocator's history, cached execution plans, the
// benchmark switch, TF32, the batch split beyond cuDNN's int-sized tensors.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>

#include "autograd/node.h"
#include "memory/caching_allocator.h"
#include "memory/memory.h"
#include "nn/models/resnet.h"
#include "tensor/conv/autograd.h"
#include "tensor/conv/ops.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

#if defined(TALLY_WITH_CUDA)
#include "tensor/conv/cuda.h"
#include "tensor/cuda/runtime.h"
#endif

namespace tally {
namespace {

using namespace testing;

// The obviously-right definition, for comparing the im2col + GEMM path against.
std::vector<double> naive_conv2d(const Tensor& x_, const Tensor& w_, const Tensor& b_, Int2 s,
                                 Int2 p, Int2 d, int64_t groups, Shape& out_shape) {
  const std::vector<double> x = ops::to_vector(x_), w = ops::to_vector(w_);
  const std::vector<double> b = b_.defined() ? ops::to_vector(b_) : std::vector<double>{};
  const int64_t N = x_.size(0), C = x_.size(1), H = x_.size(2), W = x_.size(3);
  const int64_t O = w_.size(0), Cg = w_.size(1), kH = w_.size(2), kW = w_.size(3);
  const int64_t OH = (H + 2 * p.h - d.h * (kH - 1) - 1) / s.h + 1;
  const int64_t OW = (W + 2 * p.w - d.w * (kW - 1) - 1) / s.w + 1;
  out_shape = {N, O, OH, OW};
  std::vector<double> out;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          double acc = b.empty() ? 0.0 : b[static_cast<size_t>(o)];
          const int64_t g = o / (O / groups);
          for (int64_t c = 0; c < Cg; ++c)
            for (int64_t kh = 0; kh < kH; ++kh)
              for (int64_t kw = 0; kw < kW; ++kw) {
                const int64_t ih = oh * s.h - p.h + kh * d.h, iw = ow * s.w - p.w + kw * d.w;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                acc += x[static_cast<size_t>(((n * C + g * Cg + c) * H + ih) * W + iw)] *
                       w[static_cast<size_t>(((o * Cg + c) * kH + kh) * kW + kw)];
              }
          out.push_back(acc);
        }
  return out;
}

class Conv2d : public OnDevice {
 protected:
  // Absolute error allowed a float32 result of magnitude a few units: the CPU's sgemm sums in
  // a fixed order; cuDNN may pick algorithms (Winograd, FFT, split reductions) that round
  // more, bounded by Conv2dVsCpu's 1e-4 of max |ref|.
  double float32_tol() const { return on_cpu() ? 1e-5 : 1e-4; }
};
TALLY_ON_DEVICES(Conv2d);

// ---------------------------------------------------------------- values

TEST_P(Conv2d, HandValues) {
  // [[1 2 3] [4 5 6] [7 8 9]] * 2x2 ones: sums of each 2x2 window.
  const Tensor x = from_vector(iota_values(9, 1), {1, 1, 3, 3}, on({}));
  const Tensor ones_k = ones({1, 1, 2, 2}, on({}));
  Tensor y = conv2d(x, ones_k);
  EXPECT_EQ(y.sizes(), (Shape{1, 1, 2, 2}));
  EXPECT_EQ(y.device(), dev());
  EXPECT_TRUE(values_near(y, {12, 16, 24, 28}));

  // Kernel [[1 2] [3 4]], bias 0.5, padding 1: a 4x4 output (cross-correlation, no flip).
  const Tensor k = from_vector({1, 2, 3, 4}, {1, 1, 2, 2}, on({}));
  y = conv2d(x, k, from_vector({0.5}, {1}, on({})), 1, 1);
  EXPECT_EQ(y.sizes(), (Shape{1, 1, 4, 4}));
  EXPECT_TRUE(values_near(y, {4.5, 11.5, 18.5, 9.5, 18.5, 37.5, 47.5, 21.5, 36.5, 67.5, 77.5, 33.5,
                              14.5, 23.5, 26.5, 9.5}));

  // Rectangular: x [1, 1, 4, 5] = 0..19, kernel [1, 1, 2, 3] = 1..6, stride (2, 1), padding (0, 1).
  y = conv2d(from_vector(iota_values(20), {1, 1, 4, 5}, on({})),
             from_vector(iota_values(6, 1), {1, 1, 2, 3}, on({})), {}, {2, 1}, {0, 1});
  EXPECT_EQ(y.sizes(), (Shape{1, 1, 2, 5}));
  EXPECT_TRUE(values_near(y, {64, 100, 121, 142, 88, 224, 310, 331, 352, 208}));
}

TEST_P(Conv2d, StridePaddingDilationGroupsValues) {
  // x [1, 4, 5, 5] = (i % 7) - 3, w [2, 2, 2, 2] = (i % 5) - 2, bias [1, -1]; stride 2,
  // padding 1, dilation 2, groups 2 -> [1, 2, 3, 3].
  std::vector<double> xv, wv;
  for (int i = 0; i < 100; ++i) xv.push_back(i % 7 - 3);
  for (int i = 0; i < 16; ++i) wv.push_back(i % 5 - 2);
  const Tensor y =
      conv2d(from_vector(xv, {1, 4, 5, 5}, on({})), from_vector(wv, {2, 2, 2, 2}, on({})),
             from_vector({1, -1}, {2}, on({})), 2, 1, 2, 2);
  EXPECT_EQ(y.sizes(), (Shape{1, 2, 3, 3}));
  EXPECT_TRUE(values_near(y, {4, -1, -1, -3, -9, 11, -4, 12, -5, 0, 2, 7, 0, -9, -8, -4, 2, 1}));
}

TEST_P(Conv2d, MatchesNaiveReference) {
  struct Case {
    Shape x, w;
    Int2 s, p, d;
    int64_t groups;
    bool bias;
  };
  const std::vector<Case> cases = {
      {{2, 3, 7, 6}, {4, 3, 3, 3}, 1, 1, 1, 1, true},
      {{2, 4, 9, 8}, {6, 2, 3, 2}, {2, 3}, {1, 2}, {2, 1}, 2, true},
      {{1, 6, 8, 8}, {6, 1, 3, 3}, 2, 2, 1, 6, false},  // depthwise
      {{3, 4, 5, 5}, {8, 4, 1, 1}, 1, 0, 1, 1, true},   // 1x1: no unrolling
      {{2, 4, 5, 5}, {4, 2, 1, 1}, 1, 0, 1, 2, false},  // 1x1 grouped
      {{2, 2, 6, 7}, {3, 2, 1, 1}, 2, 1, 1, 1, true},   // 1x1 strided and padded
      {{1, 2, 4, 4}, {2, 2, 4, 4}, 1, 0, 1, 1, true},   // kernel = input
      {{2, 3, 10, 3}, {2, 3, 2, 2}, {3, 1}, {0, 2}, {4, 3}, 1, true},
  };
  for (const Case& c : cases) {
    const Tensor x = put(rand_input(c.x, -1, 1, 11)), w = put(rand_input(c.w, -1, 1, 12));
    const Tensor b = c.bias ? put(rand_input({c.w[0]}, -1, 1, 13)) : Tensor();
    Shape expected_shape;
    const std::vector<double> expected =
        naive_conv2d(x, w, b, c.s, c.p, c.d, c.groups, expected_shape);
    const Tensor y = conv2d(x, w, b, c.s, c.p, c.d, c.groups);
    EXPECT_EQ(y.sizes(), expected_shape) << shape_str(c.x) << " " << shape_str(c.w);
    EXPECT_TRUE(values_near(y, expected, 1e-12)) << shape_str(c.x) << " " << shape_str(c.w);
    // float32 (through sgemm on the CPU)
    const Tensor y32 = conv2d(x.to(DType::float32), w.to(DType::float32),
                              c.bias ? b.to(DType::float32) : Tensor(), c.s, c.p, c.d, c.groups);
    EXPECT_TRUE(values_near(y32, expected, float32_tol()));
  }
}

TEST_P(Conv2d, UnbatchedAndEmptyBatch) {
  const Tensor x = put(rand_input({3, 6, 5}, -1, 1, 3)),
               w = put(rand_input({2, 3, 3, 2}, -1, 1, 4));
  const Tensor b = put(rand_input({2}, -1, 1, 5));
  const Tensor y = conv2d(x, w, b, 1, 1);
  EXPECT_EQ(y.sizes(), (Shape{2, 6, 6}));
  EXPECT_TRUE(values_near(y, conv2d(x.unsqueeze(0), w, b, 1, 1).tolist(), 1e-12));
  const Tensor e = conv2d(zeros({0, 3, 6, 5}, on(f64)), w, b);
  EXPECT_EQ(e.sizes(), (Shape{0, 2, 4, 4}));
}

// ---------------------------------------------------------------- gradients

// One gradient check: what it covers, the function, its CPU leaves.
struct GradCase {
  const char* what;
  Fn fn;
  TensorList inputs;
};

TEST_P(Conv2d, Gradients) {
  const Tensor x = rand_input({2, 4, 5, 5}, -1, 1, 1);
  const Tensor w = rand_input({3, 4, 3, 3}, -1, 1, 2);
  const Tensor b = rand_input({3}, -1, 1, 3);
  const Tensor xs = rand_input({2, 4, 5, 5}, -1, 1, 4);
  const std::vector<GradCase> cases = {
      {"bias", [](const TensorList& t) { return conv2d(t[0], t[1], t[2]); }, {x, w, b}},
      {"no bias", [](const TensorList& t) { return conv2d(t[0], t[1]); }, {x, w}},
      {"stride 2, padding 1, dilation 2, groups 2",
       [](const TensorList& t) { return conv2d(t[0], t[1], t[2], 2, 1, 2, 2); },
       {xs, rand_input({4, 2, 3, 3}, -1, 1, 5), rand_input({4}, -1, 1, 6)}},
      // Each on its own.
      {"stride 2",
       [](const TensorList& t) { return conv2d(t[0], t[1], {}, 2); },
       {xs, rand_input({3, 4, 2, 2}, -1, 1, 7)}},
      {"padding 1",
       [](const TensorList& t) { return conv2d(t[0], t[1], {}, 1, 1); },
       {xs, rand_input({3, 4, 2, 2}, -1, 1, 8)}},
      {"dilation 2",
       [](const TensorList& t) { return conv2d(t[0], t[1], {}, 1, 0, 2); },
       {xs, rand_input({3, 4, 2, 2}, -1, 1, 9)}},
      // Rectangular geometry.
      {"rectangular",
       [](const TensorList& t) {
         return conv2d(t[0], t[1], t[2], {2, 1}, {0, 2}, {1, 2});
       },
       {xs, rand_input({2, 4, 2, 3}, -1, 1, 10), rand_input({2}, -1, 1, 11)}},
      // 1x1 (the direct path), grouped.
      {"1x1 grouped",
       [](const TensorList& t) { return conv2d(t[0], t[1], t[2], 1, 0, 1, 2); },
       {xs, rand_input({4, 2, 1, 1}, -1, 1, 12), rand_input({4}, -1, 1, 13)}},
      // Permuted views of the input and of the weight, taken inside the function
      // (gradcheck_on copies the leaves to the device contiguous).
      {"non-contiguous",
       [](const TensorList& t) {
         return conv2d(t[0].permute({3, 2, 1, 0}), t[1].permute({3, 2, 1, 0}), {}, 2, 1, 1, 2);
       },
       {rand_input({5, 5, 4, 2}, -1, 1, 14), rand_input({3, 3, 2, 4}, -1, 1, 15)}},
      // Unbatched [C, H, W].
      {"unbatched",
       [](const TensorList& t) { return conv2d(t[0], t[1], t[2], 1, 1); },
       {rand_input({4, 4, 5}, -1, 1, 16), rand_input({3, 4, 3, 3}, -1, 1, 17),
        rand_input({3}, -1, 1, 18)}},
  };
  for (const GradCase& c : cases) EXPECT_TRUE(gradcheck_on(dev(), c.fn, c.inputs)) << c.what;
}

TEST_P(Conv2d, SavesOnlyWhatBackwardNeeds) {
  const Tensor x = leaf(rand_input({1, 2, 4, 4}, -1, 1, 1)),
               w = leaf(rand_input({2, 2, 3, 3}, -1, 1, 2));
  const Tensor b = leaf(rand_input({2}, -1, 1, 3));
  const Tensor xc = x.detach(), wc = w.detach();
  auto s = saved_by(conv2d(x, w, b));
  ASSERT_EQ(s.size(), 2u);
  // Only the weight needs a gradient: only the input is kept (and vice versa).
  s = saved_by(conv2d(xc, w));
  ASSERT_EQ(s.size(), 1u);
  EXPECT_TRUE(s[0].storage().is_same(x.storage()));
  s = saved_by(conv2d(x, wc));
  ASSERT_EQ(s.size(), 1u);
  EXPECT_TRUE(s[0].storage().is_same(w.storage()));
  // Only the bias: nothing.
  EXPECT_TRUE(saved_by(conv2d(xc, wc, b)).empty());
  Tensor y = conv2d(xc, wc, b);
  y.sum().backward();
  EXPECT_TRUE(values_near(b.grad(), {4, 4}));  // 2x2 outputs per channel
}

TEST_P(Conv2d, BackwardValues) {
  // d(sum(conv(x, ones 2x2)))/dx counts the windows covering each pixel.
  const Tensor x = from_vector(iota_values(9, 1), {1, 1, 3, 3}, on(f64_grad));
  const Tensor w = ones({1, 1, 2, 2}, on(f64_grad));
  conv2d(x, w).sum().backward();
  EXPECT_TRUE(values_near(x.grad(), {1, 2, 1, 2, 4, 2, 1, 2, 1}));
  // d/dw[kh, kw] = sum of the 2x2 block of x it slides over.
  EXPECT_TRUE(values_near(w.grad(), {12, 16, 24, 28}));
}

// ---------------------------------------------------------------- dtypes, memory, errors

TEST_P(Conv2d, LowPrecisionDtypes) {
  const Tensor x = put(rand_input({2, 3, 6, 6}, -1, 1, 21)),
               w = put(rand_input({4, 3, 3, 3}, -1, 1, 22));
  const Tensor b = put(rand_input({4}, -1, 1, 23));
  const std::vector<double> ref = conv2d(x, w, b, 2, 1).tolist();
  for (auto [dt, tol] : {std::pair{DType::float32, float32_tol()},
                         {DType::float16, 3e-2},
                         {DType::bfloat16, 2e-1}}) {
    const Tensor xd = x.detach().to(dt), wd = w.detach().to(dt).requires_grad_(),
                 bd = b.detach().to(dt);
    const Tensor y = conv2d(xd, wd, bd, 2, 1);
    EXPECT_EQ(y.dtype(), dt);
    EXPECT_TRUE(values_near(y, ref, tol)) << dtype_name(dt);
    y.sum().backward();
    EXPECT_EQ(wd.grad().dtype(), dt);
    EXPECT_EQ(wd.grad().sizes(), w.sizes());
  }
}

// The CPU convolves 16-bit tensors in float32 and rounds each result once: the forward and
// both backward kernels, with padding, stride, groups and the 1x1 (no im2col) path, at sizes
// whose GEMMs span several BLAS blocks (K = 16 * 3 * 3 = 144, L = 24 * 24).
TEST_P(Conv2d, SixteenBitConvolutionsAreTheFloat32ResultRoundedOnce) {
  if (!on_cpu()) GTEST_SKIP() << "the CPU's float32 path; cuDNN: Conv2dVsCpu";
  struct Case {
    int64_t C, O, k, stride, pad, groups;
  };
  for (DType dt : {DType::float16, DType::bfloat16})
    for (const Case& c :
         {Case{16, 24, 3, 1, 1, 1}, Case{16, 24, 3, 2, 1, 2}, Case{32, 20, 1, 1, 0, 1}}) {
      const Tensor x = rand_input({2, c.C, 24, 24}, -1, 1, 41).to(dt);
      const Tensor w = rand_input({c.O, c.C / c.groups, c.k, c.k}, -1, 1, 42).to(dt);
      const Tensor b = rand_input({c.O}, -1, 1, 43).to(dt);
      const auto f32 = [](const Tensor& t) { return t.to(DType::float32); };
      const Tensor y = ops::conv2d(x, w, b, c.stride, c.pad, 1, c.groups);
      EXPECT_TRUE(
          rounded_once_from(y, ops::conv2d(f32(x), f32(w), f32(b), c.stride, c.pad, 1, c.groups)));
      const Tensor gy = rand_input(y.sizes(), -1, 1, 44).to(dt);
      EXPECT_TRUE(rounded_once_from(
          ops::conv2d_backward_input(gy, w, x.sizes(), c.stride, c.pad, 1, c.groups),
          ops::conv2d_backward_input(f32(gy), f32(w), x.sizes(), c.stride, c.pad, 1, c.groups)));
      EXPECT_TRUE(rounded_once_from(
          ops::conv2d_backward_weight(gy, x, w.sizes(), c.stride, c.pad, 1, c.groups),
          ops::conv2d_backward_weight(f32(gy), f32(x), w.sizes(), c.stride, c.pad, 1, c.groups)));
    }
}

TEST_P(Conv2d, Im2colWorkspaceIsAccounted) {
  if (!on_cpu())
    GTEST_SKIP() << "the CPU's im2col buffer; cuDNN's workspace: "
                    "Conv2dVsCpu.WorkspaceIsTaggedInTheAllocatorHistory";
  memory::CachingAllocator& alloc = memory::get_allocator(Device::cpu());
  alloc.record_memory_history(true);
  const Tensor x = rand_input({1, 3, 8, 8}, -1, 1, 1), w = rand_input({4, 3, 3, 3}, -1, 1, 2);
  conv2d(x, w, {}, 1, 1).sum().backward();
  const auto history = alloc.history();
  alloc.record_memory_history(false);
  // K x L = (3 * 3 * 3) x (8 * 8) doubles, tagged workspace under each conv op.
  const size_t ws_bytes = 27 * 64 * sizeof(double);
  std::set<std::string> ops_with_workspace;
  for (const auto& e : history)
    if (e.action == memory::TraceAction::alloc && e.tag.category == memory::Category::workspace) {
      EXPECT_GE(e.size, ws_bytes);
      ops_with_workspace.insert(memory::interned(e.tag.op));
    }
  EXPECT_EQ(ops_with_workspace,
            (std::set<std::string>{"conv2d", "conv2d_backward_input", "conv2d_backward_weight"}));
}

TEST_P(Conv2d, ErrorsNameOpAndShapes) {
  const TensorOptions o = on({});
  const Tensor x = zeros({2, 3, 8, 8}, o), x4 = zeros({2, 4, 8, 8}, o);
  const Tensor small = zeros({1, 3, 4, 4}, o), w3 = zeros({4, 3, 3, 3}, o);
  // A conv2d call that must throw std::invalid_argument, and a part of its message.
  struct Case {
    std::function<void()> op;
    const char* part;
  };
  const std::vector<Case> cases = {
      {[&] {
         conv2d(x, zeros({4, 5, 3, 3}, o));
       },
       "conv2d: input [2, 3, 8, 8] has 3 channels but weight [4, 5, 3, 3] expects 5"},
      {[&] {
         conv2d(x4, zeros({4, 1, 3, 3}, o), {}, 1, 0, 1, 3);
       },
       "conv2d: groups 3 does not divide the 4 input channels of input [2, 4, 8, 8]"},
      {[&] {
         conv2d(x4, zeros({3, 2, 3, 3}, o), {}, 1, 0, 1, 2);
       },
       "groups 2 does not divide the 3 output channels of weight [3, 2, 3, 3]"},
      {[&] {
         conv2d(x4, zeros({4, 1, 3, 3}, o), {}, 1, 0, 1, 2);
       },
       "expects 2 (1 per group x 2 groups)"},
      {[&] {
         conv2d(small, zeros({2, 3, 5, 5}, o));
       },
       "conv2d: kernel 5x5 (dilated to 5x5) is larger than the padded input 4x4"},
      {[&] {
         conv2d(small, zeros({2, 3, 5, 5}, o));
       },
       "input [1, 3, 4, 4], weight [2, 3, 5, 5]"},
      {[&] {
         conv2d(small, zeros({2, 3, 2, 2}, o), {}, 1, 0, 4);
       },
       "kernel 2x2 (dilated to 5x5) is larger than the padded input 4x4"},
      {[&] { conv2d(x, w3, zeros({5}, o)); },
       "conv2d: bias [5] does not match the 4 output channels of weight [4, 3, 3, 3]"},
      {[&] {
         conv2d(zeros({3, 8}, o), w3);
       },
       "conv2d: input must be 3-D [C, H, W] or 4-D [N, C, H, W], got [3, 8]"},
      {[&] {
         conv2d(x, zeros({4, 3, 3}, o));
       },
       "conv2d: weight must be 4-D"},
      {[&] { conv2d(x, w3, {}, 0); }, "conv2d: stride must be positive, got [0, 0]"},
      {[&] { conv2d(x, w3, {}, 1, -1); }, "conv2d: padding must be non-negative"},
      {[&] { conv2d(x, w3, {}, 1, 0, 0); }, "conv2d: dilation must be positive"},
      {[&] { conv2d(x, w3, {}, 1, 0, 1, 0); }, "conv2d: groups must be positive"},
      {[&] {
         conv2d(x, zeros({4, 3, 3, 3}, on(f64)));
       },
       "conv2d: input [2, 3, 8, 8] is float32 but weight [4, 3, 3, 3] is float64"},
      {[&] {
         conv2d(zeros({2, 3, 8, 8}, on(i64)), zeros({4, 3, 3, 3}, on(i64)));
       },
       "conv2d: input must be a floating tensor"},
  };
  for (const Case& c : cases) {
    const std::string m = error_of<std::invalid_argument>(c.op);
    EXPECT_TRUE(contains(m, c.part)) << m;
  }
  // The backward ops check grad_output against the geometry.
  const std::string m = error_of<std::invalid_argument>([&] {
    ops::conv2d_backward_input(zeros({2, 4, 5, 5}, o), w3, {2, 3, 8, 8}, 1, 0, 1, 1);
  });
  EXPECT_TRUE(contains(m,
                       "conv2d_backward_input: grad_output [2, 4, 5, 5] does not match the output "
                       "[2, 4, 6, 6]"))
      << m;
}

TEST_P(Conv2d, OutputSizeFormula) {
  if (!on_cpu()) GTEST_SKIP() << "shape arithmetic only: no device involved";
  EXPECT_EQ(ops::conv_output_size(56, 3, 1, 1, 1), 56);
  EXPECT_EQ(ops::conv_output_size(224, 7, 2, 3, 1), 112);
  EXPECT_EQ(ops::conv_output_size(5, 3, 2, 1, 2), 2);
  EXPECT_EQ(ops::conv_output_size(5, 2, 2, 0, 1, /*ceil_mode=*/true), 3);
  EXPECT_EQ(ops::conv_output_size(4, 3, 2, 1, 1, /*ceil_mode=*/true), 3);
  EXPECT_EQ(ops::conv_output_size(5, 2, 2, 1, 1, /*ceil_mode=*/true),
            3);  // a 4th window would start in padding
}

// ---------------------------------------------------------------- ResNet-18 layer4 regression
// On the H200 host the CPU gradients of resnet18 from layer4.0.bn2 backwards differed from
// PyTorch by ~1.5e-2 (fp32), i.e. the gradient flowing out of layer4.1 (3x3 pad-1 convs,
// 512 channels at 2x2, train-mode batch_norm over 16 values, relu, residual add). These pin
// every piece of that path on the CPU; other devices skip them.
class Conv2dCpuPath : public OnDevice {
 protected:
  void SetUp() override {
    OnDevice::SetUp();
    if (!IsSkipped() && !on_cpu()) GTEST_SKIP() << "a regression of the CPU path";
  }
};
TALLY_ON_DEVICES(Conv2dCpuPath);

// d(conv2d)/d(input) by the definition (stride 1, square kernel, padding p).
std::vector<double> naive_conv2d_grad_input(const Tensor& gy_, const Tensor& w_, int64_t H,
                                            int64_t W, int64_t p) {
  const std::vector<double> gy = ops::to_vector(gy_), w = ops::to_vector(w_);
  const int64_t N = gy_.size(0), O = gy_.size(1), OH = gy_.size(2), OW = gy_.size(3);
  const int64_t C = w_.size(1), k = w_.size(2);
  std::vector<double> gx(static_cast<size_t>(N * C * H * W), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow)
          for (int64_t c = 0; c < C; ++c)
            for (int64_t kh = 0; kh < k; ++kh)
              for (int64_t kw = 0; kw < k; ++kw) {
                const int64_t ih = oh - p + kh, iw = ow - p + kw;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                gx[static_cast<size_t>(((n * C + c) * H + ih) * W + iw)] +=
                    gy[static_cast<size_t>(((n * O + o) * OH + oh) * OW + ow)] *
                    w[static_cast<size_t>(((o * C + c) * k + kh) * k + kw)];
              }
  return gx;
}

// The backward-data GEMM (weight^T @ grad_output, then col2im) with many channels and an
// output no larger than the padding, in both BLAS precisions.
TEST_P(Conv2dCpuPath, BackwardInputManyChannelsTinySpatial) {
  for (DType dt : {DType::float64, DType::float32})
    for (int64_t C : {8, 64, 512})
      for (int64_t S : {1, 2, 4}) {
        Generator g(5);
        const Tensor gy = ops::randn({4, C, S, S}, dt, Device::cpu(), &g);
        const Tensor w = ops::randn({C, C, 3, 3}, dt, Device::cpu(), &g);
        const std::vector<double> got =
            ops::to_vector(ops::conv2d_backward_input(gy, w, {4, C, S, S}, 1, 1, 1, 1));
        const std::vector<double> ref = naive_conv2d_grad_input(gy, w, S, S, 1);
        double maxerr = 0, maxref = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
          maxerr = std::max(maxerr, std::abs(got[i] - ref[i]));
          maxref = std::max(maxref, std::abs(ref[i]));
        }
        EXPECT_LT(maxerr, (dt == DType::float64 ? 1e-12 : 1e-5) * maxref)
            << dtype_name(dt) << " C=" << C << " S=" << S;
      }
}

// A whole BasicBlock (conv-bn-relu-conv-bn + identity, relu) against finite differences,
// at spatial sizes 1, 2 and 4 with padding 1.
TEST_P(Conv2dCpuPath, BasicBlockGradientsTinySpatial) {
  for (int64_t C : {8, 16})
    for (int64_t S : {1, 2, 4}) {
      const Tensor x = rand_input({2, C, S, S}, -1, 1, 31);
      const Tensor w1 = rand_input({C, C, 3, 3}, -1, 1, 32);
      const Tensor w2 = rand_input({C, C, 3, 3}, -1, 1, 33);
      const Tensor bw = rand_input({C}, 0.5, 1.5, 34);
      const Tensor bb = rand_input({C}, -1, 1, 35);
      EXPECT_TRUE(gradcheck(
          [](const TensorList& t) {
            const Tensor in = relu(t[0]);
            const Tensor h = relu(batch_norm(conv2d(in, t[1], {}, 1, 1), {}, {}, t[3], t[4], true));
            return relu(add(batch_norm(conv2d(h, t[2], {}, 1, 1), {}, {}, {}, {}, true), in));
          },
          {x, w1, w2, bw, bb}))
          << "C=" << C << " S=" << S;
    }
}

// The reported case itself: resnet18, batch 4, 3x64x64, 10 classes. In float64 the
// gradients of layer4.0.bn2, layer4.0.downsample.1 and layer4.1.bn2 match central
// differences of the loss; in float32 every layer3/layer4/fc gradient matches float64.
TEST_P(Conv2dCpuPath, Resnet18Layer4Gradients) {
  std::vector<nn::NamedTensors> grads;
  std::shared_ptr<nn::ResNet> m64;
  Tensor x64, y;
  for (DType dt : {DType::float64, DType::float32}) {
    Generator g(1234);
    auto model = nn::resnet18({.num_classes = 10, .in_channels = 3, .gen = &g});
    model->to(dt);
    model->train();
    Generator dg(7);
    const Tensor x = ops::randn({4, 3, 64, 64}, DType::float64, Device::cpu(), &dg);
    y = ops::randint(0, 10, {4}, DType::int64, Device::cpu(), &dg);
    cross_entropy((*model)(ops::to(x, dt)), y).backward();
    nn::NamedTensors gs;
    for (auto& [n, p] : model->named_parameters()) gs.push_back({n, p.grad()});
    grads.push_back(gs);
    if (dt == DType::float64) m64 = model, x64 = x;
  }
  for (auto& [n, p] : m64->named_parameters()) {
    if (n != "layer4.1.bn2.weight" && n != "layer4.0.bn2.weight" &&
        n != "layer4.0.downsample.1.weight")
      continue;
    const std::vector<double> analytic = ops::to_vector(p.grad());
    double* d = static_cast<double*>(p.storage().data()) + p.storage_offset();
    for (size_t k = 0; k < 2; ++k) {
      const double saved = d[k], eps = 1e-5;
      NoGradGuard ng;
      d[k] = saved + eps;
      const double lp = ops::item(cross_entropy((*m64)(x64), y));
      d[k] = saved - eps;
      const double lm = ops::item(cross_entropy((*m64)(x64), y));
      d[k] = saved;
      const double numeric = (lp - lm) / (2 * eps);
      EXPECT_NEAR(analytic[k], numeric, 1e-7 + 1e-5 * std::abs(numeric)) << n << "[" << k << "]";
    }
  }
  for (size_t i = 0; i < grads[0].size(); ++i) {
    const std::string& n = grads[0][i].first;
    if (n.rfind("layer3", 0) != 0 && n.rfind("layer4", 0) != 0 && n.rfind("fc", 0) != 0) continue;
    const auto a = ops::to_vector(grads[0][i].second), b = ops::to_vector(grads[1][i].second);
    double num = 0, den = 0;
    for (size_t k = 0; k < a.size(); ++k) {
      num += (a[k] - b[k]) * (a[k] - b[k]);
      den += a[k] * a[k];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-4) << n << " float32 vs float64";
  }
}

// Every element counts: the directional derivative of the loss along a random direction
// over a whole parameter (float64, central differences) equals <grad, direction>, for the
// layer4.0 parameters the PyTorch comparison flagged and a few upstream ones.
TEST_P(Conv2dCpuPath, Resnet18DirectionalDerivatives) {
  Generator g(1234);
  auto model = nn::resnet18({.num_classes = 10, .in_channels = 3, .gen = &g});
  model->to(DType::float64);
  model->train();
  Generator dg(7);
  const Tensor x = ops::randn({4, 3, 64, 64}, DType::float64, Device::cpu(), &dg);
  const Tensor y = ops::randint(0, 10, {4}, DType::int64, Device::cpu(), &dg);
  cross_entropy((*model)(x), y).backward();
  const std::set<std::string> names{"layer4.0.bn2.weight",   "layer4.0.bn2.bias",
                                    "layer4.0.conv2.weight", "layer4.0.downsample.1.bias",
                                    "layer4.0.conv1.weight", "layer3.1.bn2.bias",
                                    "layer4.1.conv1.weight"};
  Generator vg(99);
  for (auto& [n, p] : model->named_parameters()) {
    if (!names.count(n)) continue;
    const Tensor v = ops::randn(p.sizes(), DType::float64, Device::cpu(), &vg);
    const double analytic = ops::item(ops::sum(ops::mul(p.grad(), v)));
    const std::vector<double> dv = ops::to_vector(v);
    double* d = static_cast<double*>(p.storage().data()) + p.storage_offset();
    const std::vector<double> saved(d, d + p.numel());
    const double eps = 1e-6;
    auto loss_at = [&](double t) {
      for (size_t k = 0; k < saved.size(); ++k) d[k] = saved[k] + t * dv[k];
      NoGradGuard ng;
      return ops::item(cross_entropy((*model)(x), y));
    };
    const double numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
    for (size_t k = 0; k < saved.size(); ++k) d[k] = saved[k];
    EXPECT_NEAR(analytic, numeric, 1e-6 + 1e-5 * std::abs(numeric)) << n;
    std::printf("%-28s analytic %.10g numeric %.10g\n", n.c_str(), analytic, numeric);
  }
}

// ================================================================ CUDA against the CPU

// Relative to max |ref|: float32 differs from the CPU only by summation order (FMA math, no
// TF32); 16-bit rounds inputs-times-weights differently and the output once more.
double tol(DType d) {
  switch (d) {
    case DType::float32:
      return 1e-4;
    case DType::float64:
      return 1e-10;
    default:
      return 2e-2;
  }
}

struct ConvCase {
  const char* name;
  Shape x, w;  // input [N, C, H, W], weight [O, C / groups, kH, kW]
  Int2 stride, padding, dilation;
  int64_t groups;
  bool bias;
};

const std::vector<ConvCase>& cases() {
  static const std::vector<ConvCase> c = {
      {"3x3", {2, 3, 9, 11}, {5, 3, 3, 3}, 1, 0, 1, 1, false},
      {"3x3 stride 2 padding 1 bias", {2, 4, 13, 10}, {6, 4, 3, 3}, 2, 1, 1, 1, true},
      {"3x3 dilation 2 padding 2 bias", {2, 3, 15, 14}, {4, 3, 3, 3}, 1, 2, 2, 1, true},
      {"groups 2 bias", {3, 6, 10, 9}, {8, 3, 3, 3}, 1, 1, 1, 2, true},
      {"1x1", {4, 16, 7, 7}, {8, 16, 1, 1}, 1, 0, 1, 1, false},
      {"1x1 stride 2 bias", {2, 8, 9, 9}, {12, 8, 1, 1}, 2, 0, 1, 1, true},
      {"depthwise 3x3 bias", {2, 8, 12, 12}, {8, 1, 3, 3}, 1, 1, 1, 8, true},
      {"depthwise x2 stride 2", {2, 4, 11, 11}, {8, 1, 3, 3}, 2, 1, 1, 4, false},
      {"rectangular kernel, stride, padding, dilation",
       {2, 3, 11, 13},
       {4, 3, 3, 5},
       {2, 1},
       {1, 2},
       {1, 2},
       1,
       true},
      {"7x7 stride 2 padding 3 (stem) bias", {2, 3, 33, 33}, {8, 3, 7, 7}, 2, 3, 1, 1, true},
      {"kernel wider than the input, padded", {1, 2, 2, 2}, {3, 2, 3, 3}, 1, 1, 1, 1, true},
      {"ResNet 3x3 [8, 64, 28, 28]", {8, 64, 28, 28}, {64, 64, 3, 3}, 1, 1, 1, 1, false},
      {"ResNet downsample 3x3 stride 2", {4, 64, 28, 28}, {128, 64, 3, 3}, 2, 1, 1, 1, false},
  };
  return c;
}

std::string label(const ConvCase& c, DType d, const char* what) {
  return std::string(c.name) + " " + dtype_name(d) + " " + what;
}

// The worst error seen per "dtype direction", printed by the main test as a diagnostic.
std::map<std::string, double>& worst_seen() {
  static std::map<std::string, double> m;
  return m;
}

void note(DType d, const char* what, const Diff& e) {
  double& w = worst_seen()[std::string(dtype_name(d)) + " " + what];
  w = std::max(w, e.err);
}

// The three raw ops of a case (forward, backward-data, backward-filter) on x's device, no bias.
std::vector<Tensor> directions(const ConvCase& c, const Tensor& x, const Tensor& w,
                               const Tensor& gy) {
  return {ops::conv2d(x, w, {}, c.stride, c.padding, c.dilation, c.groups),
          ops::conv2d_backward_input(gy, w, c.x, c.stride, c.padding, c.dilation, c.groups),
          ops::conv2d_backward_weight(gy, x, c.w, c.stride, c.padding, c.dilation, c.groups)};
}

class Conv2dVsCpu : public VsCpu {
 protected:
  // Runs the three raw ops on the CPU and the device for one case and dtype, checks each.
  void check_case(const ConvCase& c, DType d, uint64_t seed) const {
    const Tensor x = rand_tensor(c.x, d, seed, -1, 1), w = rand_tensor(c.w, d, seed + 1, -1, 1);
    const Tensor b = c.bias ? rand_tensor({c.w[0]}, d, seed + 2, -1, 1) : Tensor();
    const Tensor y = ops::conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
    const Tensor yg = ops::conv2d(put(x), put(w), c.bias ? put(b) : Tensor(), c.stride, c.padding,
                                  c.dilation, c.groups);
    const Tensor gy = rand_tensor(y.sizes(), d, seed + 3, -1, 1);
    const Tensor gx =
        ops::conv2d_backward_input(gy, w, c.x, c.stride, c.padding, c.dilation, c.groups);
    const Tensor gxg =
        ops::conv2d_backward_input(put(gy), put(w), c.x, c.stride, c.padding, c.dilation, c.groups);
    const Tensor gw =
        ops::conv2d_backward_weight(gy, x, c.w, c.stride, c.padding, c.dilation, c.groups);
    const Tensor gwg = ops::conv2d_backward_weight(put(gy), put(x), c.w, c.stride, c.padding,
                                                   c.dilation, c.groups);
    for (const auto& [what, got, ref] :
         {std::tuple{"forward", yg, y}, std::tuple{"backward input", gxg, gx},
          std::tuple{"backward weight", gwg, gw}}) {
      EXPECT_EQ(got.device(), dev()) << what;
      EXPECT_EQ(got.dtype(), d) << what;
      const Diff e = diff_scaled(got, ref);
      note(d, what, e);
      EXPECT_LE(e.err, tol(d)) << label(c, d, what) << ": " << e.str();
    }
  }

  // directions() of case c on the device, with the inputs of seeds 1, 2, 3.
  std::vector<Tensor> on_device(const ConvCase& c, DType d) const {
    const Tensor x = put(rand_tensor(c.x, d, 1, -1, 1)), w = put(rand_tensor(c.w, d, 2, -1, 1));
    const Tensor y = ops::conv2d(x, w, {}, c.stride, c.padding, c.dilation, c.groups);
    return directions(c, x, w, put(rand_tensor(y.sizes(), d, 3, -1, 1)));
  }
};
TALLY_VS_CPU(Conv2dVsCpu);

#if defined(TALLY_WITH_CUDA)
// Sets the benchmark switch for the scope, restoring it after.
struct BenchmarkScope {
  explicit BenchmarkScope(bool on) : saved(cuda::cudnn_benchmark()) {
    cuda::set_cudnn_benchmark(on);
  }
  ~BenchmarkScope() { cuda::set_cudnn_benchmark(saved); }
  bool saved;
};
#endif

TEST_P(Conv2dVsCpu, ForwardAndBackwardsMatchTheCpu) {
  uint64_t seed = 100;
  for (const ConvCase& c : cases())
    for (DType d : kFloatDtypes) {
      SCOPED_TRACE(label(c, d, ""));
      check_case(c, d, seed += 10);
    }
  for (const auto& [what, err] : worst_seen())
    std::cout << "[ max err ] " << what << ": " << err << " of max |ref|\n";
}

TEST_P(Conv2dVsCpu, NonContiguousUnbatchedAndEmptyInputs) {
  // The three directions on the device against the CPU's, at stride s, padding p.
  auto check = [&](const Tensor& x, const Tensor& w, const Tensor& gy, const Tensor& xg,
                   const Tensor& wg, const Tensor& gyg, Int2 s, Int2 p, double tolerance,
                   const std::string& what) {
    const ConvCase c{"", x.sizes(), w.sizes(), s, p, 1, 1, false};
    const std::vector<Tensor> ref = directions(c, x, w, gy), got = directions(c, xg, wg, gyg);
    const char* names[] = {"forward", "backward input", "backward weight"};
    for (size_t i = 0; i < 3; ++i) {
      const Diff e = diff_scaled(got[i], ref[i]);
      EXPECT_LE(e.err, tolerance) << what << " " << names[i] << ": " << e.str();
    }
  };
  for (DType d : {DType::float32, DType::bfloat16}) {
    SCOPED_TRACE(dtype_name(d));
    // Channels-last input and a transposed weight, both viewed as NCHW / OIHW.
    const Tensor x_nhwc = rand_tensor({2, 9, 11, 5}, d, 1, -1, 1),
                 w_iokk = rand_tensor({5, 6, 3, 3}, d, 2, -1, 1);
    const Tensor x = ops::permute(x_nhwc, {0, 3, 1, 2}), w = ops::transpose(w_iokk, 0, 1);
    const Tensor xg = ops::permute(put(x_nhwc), {0, 3, 1, 2}),
                 wg = ops::transpose(put(w_iokk), 0, 1);
    ASSERT_FALSE(xg.is_contiguous());
    ASSERT_FALSE(wg.is_contiguous());
    // A strided grad_output (every other column of a wider tensor).
    const Shape ys = ops::conv2d(x, w, {}, 2, 1).sizes();
    const Tensor wide = rand_tensor({ys[0], ys[1], ys[2], 2 * ys[3]}, d, 3, -1, 1);
    const Tensor gy = ops::slice(wide, 3, 0, 2 * ys[3], 2),
                 gyg = ops::slice(put(wide), 3, 0, 2 * ys[3], 2);
    ASSERT_FALSE(gyg.is_contiguous());
    check(x, w, gy, xg, wg, gyg, 2, 1, tol(d), "non-contiguous");
  }
  // Unbatched [C, H, W].
  const Tensor x3 = rand_tensor({3, 10, 7}, DType::float32, 4, -1, 1),
               w = rand_tensor({4, 3, 3, 3}, DType::float32, 5, -1, 1);
  const Tensor b = rand_tensor({4}, DType::float32, 6, -1, 1);
  const Tensor y3 = ops::conv2d(put(x3), put(w), put(b), 1, 1);
  EXPECT_EQ(y3.sizes(), (Shape{4, 10, 7}));
  const Diff e = diff_scaled(y3, ops::conv2d(x3, w, b, 1, 1));
  EXPECT_LE(e.err, 1e-4) << "unbatched with bias: " << e.str();
  const Tensor gy3 = rand_tensor({4, 10, 7}, DType::float32, 7, -1, 1);
  check(x3, w, gy3, put(x3), put(w), put(gy3), 1, 1, 1e-4, "unbatched");

  // An empty batch: empty output and input gradient, a zero weight gradient.
  const Tensor x0 = ops::zeros({0, 3, 8, 8}, DType::float32, dev());
  const Tensor y0 = ops::conv2d(x0, put(w), put(b), 1, 1);
  EXPECT_EQ(y0.sizes(), (Shape{0, 4, 8, 8}));
  const Tensor gy0 = ops::zeros({0, 4, 8, 8}, DType::float32, dev());
  EXPECT_EQ(ops::conv2d_backward_input(gy0, put(w), x0.sizes(), 1, 1, 1, 1).sizes(), x0.sizes());
  // Fill the cache with non-zero garbage first so a missing zero-fill would show.
  { const Tensor junk = ops::full({4096}, 7.0, DType::float32, dev()); }
  const Tensor gw0 = ops::conv2d_backward_weight(gy0, x0, w.sizes(), 1, 1, 1, 1);
  EXPECT_EQ(gw0.sizes(), w.sizes());
  for (double v : ops::to_vector(gw0)) ASSERT_EQ(v, 0.0);
}

TEST_P(Conv2dVsCpu, AutogradMatchesTheCpu) {
  const Tensor xc = rand_tensor({3, 4, 12, 11}, DType::float32, 20, -1, 1),
               wc = rand_tensor({6, 2, 3, 3}, DType::float32, 21, -1, 1);
  const Tensor bc = rand_tensor({6}, DType::float32, 22, -1, 1),
               gyc = rand_tensor({3, 6, 6, 6}, DType::float32, 23, -1, 1);
  Tensor x = xc.detach(), w = wc.detach(), b = bc.detach();
  x.requires_grad_(), w.requires_grad_(), b.requires_grad_();
  const Tensor xg = leaf(xc), wg = leaf(wc), bg = leaf(bc);
  const Tensor y = conv2d(x, w, b, 2, 1, 1, 2), yg = conv2d(xg, wg, bg, 2, 1, 1, 2);
  ASSERT_EQ(y.sizes(), gyc.sizes());
  Diff e = diff_scaled(yg, y);
  EXPECT_LE(e.err, 1e-4) << "forward: " << e.str();
  sum(mul(y, gyc)).backward();
  sum(mul(yg, put(gyc))).backward();
  for (auto [name, gc, gg] :
       {std::tuple{"x", x.grad(), xg.grad()}, std::tuple{"w", w.grad(), wg.grad()},
        std::tuple{"b", b.grad(), bg.grad()}}) {
    ASSERT_TRUE(gg.defined()) << name;
    EXPECT_EQ(gg.device(), dev()) << name;
    e = diff_scaled(gg, gc);
    EXPECT_LE(e.err, 1e-4) << "grad " << name << ": " << e.str();
  }
}

#if defined(TALLY_WITH_CUDA)
// Every allocation cuDNN's workspace needs is in the GPU allocator's history, tagged
// `workspace` under the conv op that asked for it; no conv allocation is `unknown`.
TEST_P(Conv2dVsCpu, WorkspaceIsTaggedInTheAllocatorHistory) {
  memory::CachingAllocator& alloc = memory::get_allocator(dev());
  const std::set<std::string> conv_ops{"conv2d", "conv2d_backward_input", "conv2d_backward_weight"};
  for (bool benchmark : {false, true}) {
    SCOPED_TRACE(benchmark ? "benchmark" : "heuristics");
    BenchmarkScope bs(benchmark);
    cuda::clear_conv_algorithm_cache();
    cuda::synchronize(0);
    alloc.reset_peak_memory_stats();
    alloc.record_memory_history(true);
    for (DType d : {DType::float32, DType::float16})
      for (const ConvCase& c : {cases()[9], cases()[11], cases()[12]}) (void)on_device(c, d);
    cuda::synchronize(0);
    const auto history = alloc.history();
    alloc.record_memory_history(false);
    std::map<std::string, size_t> ws_by_op;
    size_t unknown = 0;
    for (const auto& e : history) {
      if (e.action != memory::TraceAction::alloc) continue;
      const std::string op = memory::interned(e.tag.op);
      if (e.tag.category == memory::Category::workspace) {
        EXPECT_TRUE(conv_ops.count(op)) << "workspace allocated under op '" << op << "'";
        ws_by_op[op] += e.size;
      }
      if (e.tag.category == memory::Category::unknown) ++unknown;
    }
    EXPECT_EQ(unknown, 0u);
    std::string seen;
    for (const auto& [op, bytes] : ws_by_op)
      seen += " " + op + ": " + std::to_string(bytes) + " B;";
    // The benchmark's scratch outputs are workspaces; with heuristics (cached execution
    // plans) a workspace exists only where the chosen engine asks for one.
    if (benchmark) {
      EXPECT_FALSE(ws_by_op.empty()) << "no workspace allocation was recorded";
      EXPECT_GT(alloc.stats().cat_bytes(memory::Category::workspace).peak, 0);
    }
    std::cout << "[ workspace ] " << (benchmark ? "benchmark" : "heuristics") << ":" << seen
              << "\n";
    const auto stats = alloc.stats();
    EXPECT_EQ(stats.cat_bytes(memory::Category::workspace).current, 0)
        << "a workspace outlived its op";
  }
}

// With benchmark off the calls run cached cuDNN execution plans (the backend API): one plan
// per direction per geometry and dtype on the first run, none added on the second, results
// matching the CPU; benchmark mode does not touch the plans.
TEST_P(Conv2dVsCpu, HeuristicsRunCachedExecutionPlans) {
  const char* legacy = std::getenv("TALLY_CUDNN_CONV_LEGACY");
  if (legacy && std::string(legacy) == "1")
    GTEST_SKIP() << "TALLY_CUDNN_CONV_LEGACY=1: legacy API only";
  BenchmarkScope bs(false);
  cuda::clear_conv_algorithm_cache();
  const std::vector<ConvCase> picked = {cases()[1], cases()[9], cases()[11], cases()[12]};
  for (int round = 0; round < 2; ++round)
    for (DType d : {DType::float32, DType::float16})
      for (size_t i = 0; i < picked.size(); ++i) {
        SCOPED_TRACE(label(picked[i], d, round == 0 ? "(first run)" : "(cached)"));
        check_case(picked[i], d, 500 + i);
      }
  // Every (direction, dtype, geometry) key has a plan, or fell back to the legacy API once
  // because cuDNN's backend declined it (then the legacy API ran it, checked above).
  const size_t plans = cuda::conv_plan_cache_size(),
               legacy_keys = cuda::conv_algorithm_cache_size();
  std::printf("execution plans %zu, legacy fallbacks %zu\n", plans, legacy_keys);
  EXPECT_EQ(plans + legacy_keys, 3 * 2 * picked.size())
      << "one entry per key, none added on the second run";
  EXPECT_GE(plans, 3 * 2 * (picked.size() - 1)) << "the backend runs (nearly) all of them";
  {
    BenchmarkScope on(true);
    check_case(picked[0], DType::float32, 600);
  }
  EXPECT_EQ(cuda::conv_plan_cache_size(), plans);
  EXPECT_EQ(cuda::conv_algorithm_cache_size(), legacy_keys + 3)
      << "benchmark mode ranks with the legacy API";
}

// The benchmark switch: cudnnFind* once per key (the cache grows by one entry per
// direction, dtype and geometry, and not again on a second run), results that match the
// CPU and the heuristic path.
TEST_P(Conv2dVsCpu, BenchmarkSwitchTimesOncePerKeyAndMatches) {
  const std::vector<ConvCase> picked = {cases()[1], cases()[3], cases()[6], cases()[11]};
  std::vector<std::vector<Tensor>> heuristic;
  {
    BenchmarkScope bs(false);
    EXPECT_FALSE(cuda::cudnn_benchmark());
    for (const ConvCase& c : picked) heuristic.push_back(on_device(c, DType::float32));
  }
  BenchmarkScope bs(true);
  EXPECT_TRUE(cuda::cudnn_benchmark());
  const char* names[] = {"forward", "backward input", "backward weight"};
  for (DType d : {DType::float32, DType::float16}) {
    cuda::clear_conv_algorithm_cache();
    for (int round = 0; round < 2; ++round) {
      for (size_t i = 0; i < picked.size(); ++i) {
        const ConvCase& c = picked[i];
        SCOPED_TRACE(label(c, d, round == 0 ? "(first run)" : "(cached)"));
        check_case(c, d, 300 + i);
        if (d == DType::float32) {
          const std::vector<Tensor> got = on_device(c, d);
          for (size_t k = 0; k < 3; ++k)
            EXPECT_LE(diff_scaled(got[k], heuristic[i][k]).err, 1e-4)
                << names[k] << " vs heuristics";
        }
      }
      // One key per direction per geometry (the cases differ in geometry).
      EXPECT_EQ(cuda::conv_algorithm_cache_size(), 3 * picked.size()) << "round " << round;
    }
  }
}

// Sets cudnn_allow_tf32 for the scope; exact float32 again after it, also when the op throws.
struct CudnnTf32 {
  explicit CudnnTf32(bool on) { cuda::set_cudnn_allow_tf32(on); }
  ~CudnnTf32() { cuda::set_cudnn_allow_tf32(false); }
};

// cudnn_allow_tf32 (PyTorch's torch.backends.cudnn.allow_tf32): on by default in the
// library, off for the test suite (tests/exact_float32.cpp); off, a float32 convolution
// matches the float64 CPU result to float32 rounding; on, cuDNN may round the inputs to TF32's
// 10-bit mantissa (errors near 1e-3 of max|ref|), still far below 16-bit's.
TEST_P(Conv2dVsCpu, Float32IsExactUnlessTf32IsAllowed) {
  EXPECT_FALSE(cuda::cudnn_allow_tf32())
      << "the test suite runs with exact float32 (tests/exact_float32.cpp)";
  const ConvCase& c = cases()[11];  // ResNet 3x3 [8, 64, 28, 28]
  const Tensor x = rand_tensor(c.x, DType::float32, 41, -1, 1),
               w = rand_tensor(c.w, DType::float32, 42, -1, 1);
  const Tensor ref = ops::conv2d(ops::to(x, DType::float64), ops::to(w, DType::float64), {},
                                 c.stride, c.padding, c.dilation, c.groups);
  auto error = [&](bool tf32) {
    CudnnTf32 scope(tf32);
    const Tensor y = ops::conv2d(put(x), put(w), {}, c.stride, c.padding, c.dilation, c.groups);
    return diff_scaled(ops::to(y, DType::float64), ref).err;
  };
  // TF32 off, on, and off again (the switch must not stick).
  const bool allowed[] = {false, true, false};
  double err[3];
  for (int i = 0; i < 3; ++i) err[i] = error(allowed[i]);
  std::printf(
      "conv 3x3 [8, 64, 28, 28] float32, error relative to max|ref|: TF32 off %.3g, on %.3g, off "
      "again %.3g\n",
      err[0], err[1], err[2]);
  for (int i = 0; i < 3; ++i) {
    if (allowed[i]) {
      EXPECT_GT(err[i], 3e-5) << "cudnn_allow_tf32 had no effect";
      EXPECT_LT(err[i], 1e-2);
    } else {
      EXPECT_LT(err[i], 1e-5) << (i ? "off again" : "off");
    }
  }
}

// A batch whose tensors exceed the per-call element limit runs as several cuDNN calls
// (here forced with a tiny limit: slices of 2, 2 and 1 samples); backward filter sums the
// slices.
TEST_P(Conv2dVsCpu, BatchSplitMatchesTheCpu) {
  const ConvCase c{"split", {5, 3, 9, 9}, {4, 3, 3, 3}, 1, 1, 1, 1, true};
  // per sample: input 243, output 324 elements; a limit of 649 fits two samples.
  cuda::set_conv_max_call_elements(649);
  struct Restore {
    ~Restore() { cuda::set_conv_max_call_elements(0); }
  } restore;
  for (DType d : {DType::float32, DType::float64}) {
    SCOPED_TRACE(dtype_name(d));
    check_case(c, d, 500);
    BenchmarkScope bs(true);
    check_case(c, d, 510);
  }
  // One sample beyond the limit is an error naming the shapes.
  cuda::set_conv_max_call_elements(100);
  const std::string m = error_of<std::invalid_argument>([&] {
    ops::conv2d(put(rand_tensor(c.x, DType::float32, 1, -1, 1)),
                put(rand_tensor(c.w, DType::float32, 2, -1, 1)), {}, 1, 1);
  });
  EXPECT_NE(m.find("[5, 3, 9, 9]"), std::string::npos) << m;
}
#endif

}  // namespace
}  // namespace tally
