// The channels_last memory format on CUDA device 0 (label gpu; every case skips without a
// device), against the CPU's row-major results: conversions and elementwise ops keeping the
// layout; batch_norm's NHWC kernels (bn_stats_partial_nhwc_kernel, bn_bwd_partial_nhwc_kernel,
// the channels-last elemt / dx kernels) forward (training with running statistics, eval) and
// backward for every output mask, in float32, float16 and bfloat16, over channel counts that
// pack 4 wide, 1 wide (C not a multiple of 4) and span two column tiles (C > 1024), with many
// row splits and with one; cuDNN's NHWC convolutions (forward, backward-data, backward-filter)
// in float32 (TF32 off: tests/exact_float32.cpp), float16 and bfloat16; autograd's conv2d; and
// a conv-bn-relu-conv-bn-add_relu block trained one step in channels_last against the same
// step row-major. Errors relative to max |reference| (test_norm_cuda's and test_conv_cuda's
// tolerances); the CPU-side rules of the layout: test_channels_last.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "tensor/conv/autograd.h"
#include "tensor/conv/ops.h"
#include "tensor/norm/autograd.h"
#include "tensor/norm/ops.h"
#include "tensor/pool/autograd.h"
#include "testing/cuda_testing.h"

#if defined(TALLY_WITH_CUDA)
#include "tensor/cuda/cudnn.h"
#endif

namespace tally {
namespace {

using namespace testing;

// A channels_last copy on the GPU of a CPU tensor (to() to another device is row-major).
Tensor gpu_cl(const Tensor& cpu) {
  return cl(to_gpu(cpu));
}

// ================================================================ conversions, elementwise

TEST(ChannelsLastCuda, ConversionsAndElementwiseKeepTheLayout) {
  REQUIRE_GPU();
  const Tensor a = rand_tensor({3, 12, 5, 7}, DType::float32, 1);
  const Tensor b = rand_tensor({3, 12, 5, 7}, DType::float32, 2);
  const Tensor ag = gpu_cl(a), bg = gpu_cl(b);
  ASSERT_TRUE(ag.is_cuda());
  EXPECT_EQ(ag.strides(), (Shape{420, 1, 84, 12}));
  EXPECT_TRUE(is_channels_last(ag));
  EXPECT_EQ(ops::to_vector(ag), ops::to_vector(a));
  // Back to the CPU: row-major there, the same values.
  const Tensor back = ops::to(ag, kCpu, DType::float32);
  EXPECT_TRUE(is_row_major(back));
  EXPECT_EQ(ops::to_vector(back), ops::to_vector(a));
  // clone, to(dtype), contiguous(row-major) on the device.
  EXPECT_TRUE(is_channels_last(ops::clone(ag)));
  EXPECT_EQ(ops::to_vector(ops::clone(ag)), ops::to_vector(a));
  for (DType d : {DType::float16, DType::bfloat16, DType::float64}) {
    SCOPED_TRACE(dtype_name(d));
    const Tensor t = ops::to(ag, d);
    EXPECT_TRUE(is_channels_last(t));
    EXPECT_EQ(ops::to_vector(t), ops::to_vector(ops::to(a, d)));
  }
  const Tensor rm = ops::contiguous(ag, kRM);
  EXPECT_TRUE(is_row_major(rm));
  EXPECT_EQ(ops::to_vector(rm), ops::to_vector(a));
  // Elementwise ops: channels_last results, the CPU's values (exact ops only).
  for (auto [name, got, want] :
       {std::tuple{"relu", ops::unary(ops::UnaryOp::relu, ag), ops::unary(ops::UnaryOp::relu, a)},
        std::tuple{"add", ops::add(ag, bg), ops::add(a, b)},
        std::tuple{"mul", ops::mul(ag, bg), ops::mul(a, b)},
        std::tuple{"add_relu", ops::add_relu(ag, bg), ops::add_relu(a, b)},
        std::tuple{"relu_backward", ops::binary(ops::BinaryOp::relu_backward, ag, bg),
                   ops::binary(ops::BinaryOp::relu_backward, a, b)},
        std::tuple{"mul scalar", ops::mul(ag, 0.5), ops::mul(a, 0.5)},
        std::tuple{"add scalar", ops::add(ag, -1.0), ops::add(a, -1.0)}}) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(is_channels_last(got));
    EXPECT_TRUE(close_to_cpu(got, want, 0, name));
  }
  // Mixed layouts: the CPU's values.
  EXPECT_TRUE(close_to_cpu(ops::add(ag, to_gpu(b)), ops::add(a, b), 0, "cl + row-major"));
  EXPECT_TRUE(close_to_cpu(ops::add_relu(to_gpu(a), bg), ops::add_relu(a, b), 0, "row-major + cl"));
  // In place.
  const Tensor t = ops::clone(ag);
  ops::add_(t, bg, 2.0);
  EXPECT_TRUE(is_channels_last(t));
  EXPECT_TRUE(close_to_cpu(t, ops::add(a, ops::mul(b, 2.0)), 1e-6, "add_"));
  // 16-bit beside float32, channels_last both.
  const Tensor bh = ops::to(bg, DType::bfloat16);
  EXPECT_TRUE(close_to_cpu(ops::add(ag, bh),
                           ops::add(a, ops::to(ops::to(b, DType::bfloat16), DType::float32)), 0,
                           "float32 + bfloat16"));
  // A batch slice (offset) of a channels_last tensor on the device.
  const Tensor part = ops::narrow(ag, 0, 1, 2);
  ASSERT_TRUE(is_channels_last(part));
  EXPECT_TRUE(close_to_cpu(ops::unary(ops::UnaryOp::relu, part),
                           ops::unary(ops::UnaryOp::relu, ops::narrow(a, 0, 1, 2)), 0,
                           "offset relu"));
}

// ================================================================ batch_norm

// The masks (dx, dweight, dbias) a backward is checked for.
const std::array<bool, 3> kMasks[] = {
    {true, true, true}, {true, false, false}, {false, true, true}, {false, true, false}};

// batch_norm on a channels_last GPU tensor of shape xs and dtype d against the CPU's row-major
// run: training forward (two steps of running statistics, and none), training backward for
// every mask (dy channels_last, then row-major), eval forward and backward.
void check_batch_norm_cl(const Shape& xs, DType d, uint64_t seed) {
  SCOPED_TRACE(case_label("batch_norm channels_last", xs, d));
  const NormTol tol = norm_tol(d);
  const DType pd = ops::norm_stat_dtype(d);
  const int64_t c = xs[1];
  const Tensor x = rand_tensor(xs, d, seed);
  const Tensor w = rand_tensor({c}, pd, seed + 1, 0.5, 1.5);
  const Tensor b = rand_tensor({c}, pd, seed + 2, -1, 1);
  const Tensor dy = rand_tensor(xs, d, seed + 3);
  const Tensor rm = rand_tensor({c}, pd, seed + 4, -0.5, 0.5);
  const Tensor rv = rand_tensor({c}, pd, seed + 5, 0.5, 1.5);
  const Tensor xg = gpu_cl(x), dyg = gpu_cl(dy), wg = to_gpu(w), bg = to_gpu(b);
  // [N, C, 1, 1] (or C = 1) is row-major and channels_last at once: contiguous, and the
  // layout checks are moot.
  const bool distinct = xs[1] > 1 && xs[2] * xs[3] > 1;
  if (distinct) {
    ASSERT_TRUE(is_channels_last(xg));
  }
  const Tensor rmg = to_gpu(rm), rvg = to_gpu(rv);

  auto forward = [&](bool training, double momentum, const std::string& phase) {
    auto [oc, mc, ic] = ops::batch_norm(x, rm, rv, w, b, training, momentum, 1e-5);
    auto [og, mg, ig] = ops::batch_norm(xg, rmg, rvg, wg, bg, training, momentum, 1e-5);
    if (distinct) {
      EXPECT_TRUE(is_channels_last(og)) << phase << " out";
    }
    EXPECT_EQ(og.dtype(), d);
    EXPECT_TRUE(close_to_cpu(og, oc, tol.elem, phase + " out"));
    EXPECT_TRUE(close_to_cpu(mg, mc, tol.elem, phase + " mean"));
    EXPECT_TRUE(close_to_cpu(ig, ic, tol.elem, phase + " invstd"));
    return std::array<Tensor, 4>{mc, ic, mg, ig};
  };

  const auto [mc, ic, mg, ig] = forward(true, 0.1, "train");
  EXPECT_TRUE(close_to_cpu(rmg, rm, tol.elem, "running_mean after step 1"));
  EXPECT_TRUE(close_to_cpu(rvg, rv, tol.elem, "running_var after step 1"));
  forward(true, 0.5, "train step 2");
  EXPECT_TRUE(close_to_cpu(rmg, rm, tol.elem, "running_mean after step 2"));
  EXPECT_TRUE(close_to_cpu(rvg, rv, tol.elem, "running_var after step 2"));
  {
    const Tensor og = std::get<0>(ops::batch_norm(xg, {}, {}, wg, bg, true));
    if (distinct) {
      EXPECT_TRUE(is_channels_last(og));
    }
    EXPECT_TRUE(close_to_cpu(og, std::get<0>(ops::batch_norm(x, {}, {}, w, b, true)), tol.elem,
                             "train out (no running stats, affine)"));
    const Tensor on = std::get<0>(ops::batch_norm(xg, {}, {}, {}, {}, true));
    EXPECT_TRUE(close_to_cpu(on, std::get<0>(ops::batch_norm(x, {}, {}, {}, {}, true)), tol.elem,
                             "train out (no affine)"));
  }

  for (std::array<bool, 3> mask : kMasks) {
    SCOPED_TRACE(::testing::Message() << "train mask " << mask[0] << mask[1] << mask[2]);
    auto [dxc, dwc, dbc] = ops::batch_norm_backward(dy, x, mc, ic, w, true, mask);
    for (bool dy_cl : {true, false}) {
      SCOPED_TRACE(dy_cl ? "dy channels_last" : "dy row-major");
      auto [dxg, dwg, dbg] =
          ops::batch_norm_backward(dy_cl ? dyg : to_gpu(dy), xg, mg, ig, wg, true, mask);
      if (mask[0] && distinct) {
        EXPECT_TRUE(is_channels_last(dxg)) << "dx";
      }
      EXPECT_TRUE(close_to_cpu(dxg, dxc, tol.elem, "dx", norm_dx_floor(dy, w, ic)));
      EXPECT_TRUE(close_to_cpu(dwg, dwc, tol.elem, "dweight"));
      EXPECT_TRUE(close_to_cpu(dbg, dbc, tol.elem, "dbias"));
    }
  }

  const auto [emc, eic, emg, eig] = forward(false, 0.1, "eval");
  {
    SCOPED_TRACE("eval backward");
    auto [dxc, dwc, dbc] = ops::batch_norm_backward(dy, x, emc, eic, w, false, {true, true, true});
    auto [dxg, dwg, dbg] =
        ops::batch_norm_backward(dyg, xg, emg, eig, wg, false, {true, true, true});
    if (distinct) {
      EXPECT_TRUE(is_channels_last(dxg));
    }
    EXPECT_TRUE(close_to_cpu(dxg, dxc, tol.elem, "eval dx"));
    EXPECT_TRUE(close_to_cpu(dwg, dwc, tol.elem, "eval dweight"));
    EXPECT_TRUE(close_to_cpu(dbg, dbc, tol.elem, "eval dbias"));
  }
}

TEST(ChannelsLastCuda, BatchNormMatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 1000;
  for (DType d : {DType::float32, DType::float16, DType::bfloat16}) {
    check_batch_norm_cl({4, 64, 7, 9}, d, seed += 10);     // C a multiple of 4: 4-wide packs
    check_batch_norm_cl({2, 3, 5, 5}, d, seed += 10);      // C = 3: 1-wide packs
    check_batch_norm_cl({3, 6, 5, 7}, d, seed += 10);      // C = 6: even, not a multiple of 4
    check_batch_norm_cl({8, 256, 14, 14}, d, seed += 10);  // many rows: several row splits
    check_batch_norm_cl({3, 2048, 2, 3}, d, seed += 10);   // C > 1024: two column tiles
    check_batch_norm_cl({2, 1100, 3, 3}, d, seed += 10);   // a ragged second tile
    check_batch_norm_cl({2, 5, 1, 1}, d, seed += 10);      // 2 values a channel (both layouts)
  }
}

TEST(ChannelsLastCuda, BatchNormManyRowsFewChannels) {
  REQUIRE_GPU();
  // [N * H * W = 32768 rows, 8 channels]: the row splits at their largest.
  check_batch_norm_cl({32, 8, 32, 32}, DType::float32, 1);
  check_batch_norm_cl({32, 8, 32, 32}, DType::bfloat16, 2);
  // Values far from zero (the variance of shifted data).
  const Tensor xc = ops::add(rand_tensor({6, 12, 17, 19}, DType::float32, 3), 1000.0);
  auto [oc, mc, ic] = ops::batch_norm(xc, {}, {}, {}, {}, true);
  auto [og, mg, ig] = ops::batch_norm(gpu_cl(xc), {}, {}, {}, {}, true);
  EXPECT_TRUE(is_channels_last(og));
  EXPECT_TRUE(close_to_cpu(mg, mc, 1e-6, "mean of offset data"));
  EXPECT_TRUE(close_to_cpu(ig, ic, 1e-4, "invstd of offset data"));
  EXPECT_TRUE(close_to_cpu(og, oc, 1e-3, "out of offset data"));
}

TEST(ChannelsLastCuda, BatchNormEmptyBatch) {
  REQUIRE_GPU();
  const Shape s{0, 6, 4, 4};
  const Tensor x = ops::contiguous(ops::zeros(s, DType::float32, kGpu), kCL);
  const Tensor rm = to_gpu(rand_tensor({6}, DType::float32, 1));
  const Tensor rv = to_gpu(rand_tensor({6}, DType::float32, 2, 0.5, 1.5));
  const std::vector<double> rm0 = ops::to_vector(rm), rv0 = ops::to_vector(rv);
  const Tensor w = ops::ones({6}, DType::float32, kGpu);
  auto [out, mean, invstd] = ops::batch_norm(x, rm, rv, w, {}, true);
  EXPECT_EQ(out.sizes(), s);
  EXPECT_EQ(ops::to_vector(rm), rm0);
  EXPECT_EQ(ops::to_vector(rv), rv0);
  auto [dx, dw, db] = ops::batch_norm_backward(x, x, mean, invstd, w, true, {true, true, true});
  EXPECT_EQ(dx.sizes(), s);
  EXPECT_TRUE(close_to_cpu(dw, ops::zeros({6}), 0, "dweight of an empty batch"));
  EXPECT_TRUE(close_to_cpu(db, ops::zeros({6}), 0, "dbias of an empty batch"));
}

// Autograd's batch_norm (what nn::BatchNorm2d calls) on a channels_last GPU input.
TEST(ChannelsLastCuda, BatchNormAutogradMatchesTheCpu) {
  REQUIRE_GPU();
  const Shape s{4, 24, 6, 5};
  const Tensor x0 = rand_tensor(s, DType::float32, 50);
  const Tensor w0 = rand_tensor({24}, DType::float32, 51, 0.5, 1.5);
  const Tensor b0 = rand_tensor({24}, DType::float32, 52, -1, 1);
  const Tensor gy = rand_tensor(s, DType::float32, 53);
  Tensor xc = ops::clone(x0), wc = ops::clone(w0), bc = ops::clone(b0);
  xc.requires_grad_(), wc.requires_grad_(), bc.requires_grad_();
  Tensor xg = gpu_cl(x0), wg = to_gpu(w0), bg = to_gpu(b0);
  xg.requires_grad_(), wg.requires_grad_(), bg.requires_grad_();
  const Tensor rmc = ops::zeros({24}), rvc = ops::ones({24});
  const Tensor rmg = ops::zeros({24}, DType::float32, kGpu),
               rvg = ops::ones({24}, DType::float32, kGpu);
  const Tensor ic = std::get<2>(ops::batch_norm(x0, {}, {}, w0, b0, true));
  const Tensor yc = batch_norm(xc, rmc, rvc, wc, bc, true);
  const Tensor yg = batch_norm(xg, rmg, rvg, wg, bg, true);
  EXPECT_TRUE(is_channels_last(yg));
  EXPECT_TRUE(close_to_cpu(yg, yc, 1e-5, "out"));
  yc.backward(gy);
  yg.backward(gpu_cl(gy));
  EXPECT_TRUE(is_channels_last(xg.grad()));
  EXPECT_TRUE(close_to_cpu(xg.grad(), xc.grad(), 1e-5, "dx", norm_dx_floor(gy, w0, ic)));
  EXPECT_TRUE(close_to_cpu(wg.grad(), wc.grad(), 1e-5, "dweight"));
  EXPECT_TRUE(close_to_cpu(bg.grad(), bc.grad(), 1e-5, "dbias"));
  EXPECT_TRUE(close_to_cpu(rmg, rmc, 1e-5, "running_mean"));
  EXPECT_TRUE(close_to_cpu(rvg, rvc, 1e-5, "running_var"));
}

// ================================================================ conv2d

// Relative to max |ref|: float32 differs from the CPU only by summation order (no TF32);
// 16-bit rounds the products and the output differently (test_conv_cuda's tolerances).
double conv_tol(DType d) {
  return d == DType::float32 ? 1e-4 : 2e-2;
}

struct ConvCase {
  const char* name;
  Shape x, w;  // input [N, C, H, W], weight [O, C / groups, kH, kW]
  Int2 stride, padding, dilation;
  int64_t groups;
};

const std::vector<ConvCase>& conv_cases() {
  static const std::vector<ConvCase> c = {
      {"3x3 padding 1", {4, 16, 14, 14}, {32, 16, 3, 3}, 1, 1, 1, 1},
      {"3x3 stride 2 padding 1", {2, 32, 15, 13}, {64, 32, 3, 3}, 2, 1, 1, 1},
      {"1x1", {4, 64, 7, 7}, {128, 64, 1, 1}, 1, 0, 1, 1},
      {"1x1 stride 2", {2, 32, 9, 9}, {64, 32, 1, 1}, 2, 0, 1, 1},
      {"7x7 stride 2 padding 3, 3 channels (stem)", {2, 3, 33, 33}, {16, 3, 7, 7}, 2, 3, 1, 1},
      {"odd channels 5 -> 7", {3, 5, 8, 9}, {7, 5, 3, 3}, 1, 1, 1, 1},
      {"dilation 2", {2, 8, 12, 11}, {8, 8, 3, 3}, 1, 2, 2, 1},
      {"groups 2", {2, 16, 9, 9}, {16, 8, 3, 3}, 1, 1, 1, 2},
      {"depthwise", {2, 32, 12, 12}, {32, 1, 3, 3}, 1, 1, 1, 32},
  };
  return c;
}

// Whether a weight of these sizes has a channels_last form distinct from row-major (else it
// is both, and suggest_memory_format says contiguous).
bool has_distinct_cl(const Shape& w) {
  return w[1] > 1 && w[2] * w[3] > 1;
}

TEST(ChannelsLastCuda, Conv2dMatchesTheCpu) {
  REQUIRE_GPU();
#if defined(TALLY_WITH_CUDA)
  ASSERT_FALSE(cuda::cudnn_allow_tf32()) << "tests/exact_float32.cpp turns TF32 off";
#endif
  uint64_t seed = 200;
  for (const ConvCase& c : conv_cases())
    for (DType d : {DType::float32, DType::float16, DType::bfloat16}) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(d));
      const double tol = conv_tol(d);
      const Tensor x = rand_tensor(c.x, d, seed += 10, -1, 1);
      const Tensor w = rand_tensor(c.w, d, seed + 1, -1, 1);
      const Tensor b = rand_tensor({c.w[0]}, d, seed + 2, -1, 1);
      const Tensor y = ops::conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
      const Tensor gy = rand_tensor(y.sizes(), d, seed + 3, -1, 1);
      const Tensor gx =
          ops::conv2d_backward_input(gy, w, c.x, c.stride, c.padding, c.dilation, c.groups);
      const Tensor gw =
          ops::conv2d_backward_weight(gy, x, c.w, c.stride, c.padding, c.dilation, c.groups);
      // (input, weight) layouts on the device; grad_output follows the input's.
      for (auto [xf, wf] : {std::pair{kCL, kRM}, std::pair{kCL, kCL}, std::pair{kRM, kCL}}) {
        const std::string lay =
            std::string("input ") + memory_format_name(xf) + ", weight " + memory_format_name(wf);
        SCOPED_TRACE(lay);
        const Tensor xg = ops::contiguous(to_gpu(x), xf), wg = ops::contiguous(to_gpu(w), wf);
        const Tensor gyg = ops::contiguous(to_gpu(gy), xf);
        const bool expect_cl = xf == kCL || has_distinct_cl(c.w);
        const Tensor yg = ops::conv2d(xg, wg, to_gpu(b), c.stride, c.padding, c.dilation, c.groups);
        if (expect_cl) {
          EXPECT_TRUE(is_channels_last(yg)) << "forward";
        }
        EXPECT_TRUE(close_to_cpu(yg, y, tol, "forward"));
        const Tensor gxg =
            ops::conv2d_backward_input(gyg, wg, c.x, c.stride, c.padding, c.dilation, c.groups);
        if (expect_cl) {
          EXPECT_TRUE(is_channels_last(gxg)) << "backward input";
        }
        EXPECT_TRUE(close_to_cpu(gxg, gx, tol, "backward input"));
        const Tensor gwg =
            ops::conv2d_backward_weight(gyg, xg, c.w, c.stride, c.padding, c.dilation, c.groups);
        if (xf == kCL && has_distinct_cl(c.w)) {
          EXPECT_TRUE(is_channels_last(gwg)) << "backward weight";
        }
        EXPECT_TRUE(close_to_cpu(gwg, gw, tol, "backward weight"));
      }
    }
}

// Autograd's conv2d on the device with a channels_last input and a row-major weight (a model
// whose input alone was converted) and with both channels_last (model.to(channels_last)).
TEST(ChannelsLastCuda, Conv2dAutogradMatchesTheCpu) {
  REQUIRE_GPU();
  const Tensor x0 = rand_tensor({3, 8, 12, 11}, DType::float32, 300, -1, 1);
  const Tensor w0 = rand_tensor({12, 4, 3, 3}, DType::float32, 301, -1, 1);
  const Tensor b0 = rand_tensor({12}, DType::float32, 302, -1, 1);
  Tensor xc = ops::clone(x0), wc = ops::clone(w0), bc = ops::clone(b0);
  xc.requires_grad_(), wc.requires_grad_(), bc.requires_grad_();
  const Tensor yc = conv2d(xc, wc, bc, 2, 1, 1, 2);
  const Tensor gy = rand_tensor(yc.sizes(), DType::float32, 303, -1, 1);
  yc.backward(gy);
  for (MemoryFormat wf : {kRM, kCL}) {
    SCOPED_TRACE(std::string("weight ") + memory_format_name(wf));
    Tensor xg = gpu_cl(x0), wg = ops::contiguous(to_gpu(w0), wf), bg = to_gpu(b0);
    xg.requires_grad_(), wg.requires_grad_(), bg.requires_grad_();
    const Tensor yg = conv2d(xg, wg, bg, 2, 1, 1, 2);
    EXPECT_TRUE(is_channels_last(yg));
    EXPECT_TRUE(close_to_cpu(yg, yc, 1e-4, "forward"));
    yg.backward(gpu_cl(gy));
    EXPECT_TRUE(is_channels_last(xg.grad())) << "input gradient";
    if (wf == kRM) {
      EXPECT_TRUE(is_row_major(wg.grad())) << "a row-major weight's gradient";
    } else {
      EXPECT_TRUE(is_channels_last(wg.grad())) << "a channels_last weight's gradient";
    }
    EXPECT_TRUE(close_to_cpu(xg.grad(), xc.grad(), 1e-4, "grad x"));
    EXPECT_TRUE(close_to_cpu(wg.grad(), wc.grad(), 1e-4, "grad w"));
    EXPECT_TRUE(close_to_cpu(bg.grad(), bc.grad(), 1e-4, "grad b"));
  }
}

// ================================================================ a block, one training step

// A residual block (conv-bn-relu, conv-bn, add_relu with the input, then global average
// pooling) on the GPU, its 4-D tensors (input and conv weights) laid out as `f`: forward,
// backward, one SGD step, forward again.
struct BlockRun {
  Tensor out, loss, gx, gw1, gw2, gg1, gb1, gg2, gb2, rm1, rv1, rm2, rv2, w1_after, out_after;
};

BlockRun run_block(MemoryFormat f) {
  constexpr int64_t N = 4, C = 16, H = 10, W = 9;
  auto param = [&](const Shape& s, uint64_t seed, double lo, double hi) {
    Tensor p = to_gpu(rand_tensor(s, DType::float32, seed, lo, hi));
    if (s.size() == 4) p = ops::contiguous(p, f);
    p.requires_grad_(true);
    return p;
  };
  const Tensor x = param({N, C, H, W}, 400, -1, 1);
  const Tensor w1 = param({C, C, 3, 3}, 401, -0.2, 0.2), w2 = param({C, C, 3, 3}, 402, -0.2, 0.2);
  const Tensor g1 = param({C}, 403, 0.5, 1.5), b1 = param({C}, 404, -0.5, 0.5);
  const Tensor g2 = param({C}, 405, 0.5, 1.5), b2 = param({C}, 406, -0.5, 0.5);
  const Tensor rm1 = ops::zeros({C}, DType::float32, kGpu),
               rv1 = ops::ones({C}, DType::float32, kGpu);
  const Tensor rm2 = ops::zeros({C}, DType::float32, kGpu),
               rv2 = ops::ones({C}, DType::float32, kGpu);
  const Tensor target = to_gpu(rand_tensor({N, C, 1, 1}, DType::float32, 407, -1, 1));
  auto forward = [&]() {
    Tensor h = relu(batch_norm(conv2d(x, w1, {}, 1, 1), rm1, rv1, g1, b1, true));
    h = batch_norm(conv2d(h, w2, {}, 1, 1), rm2, rv2, g2, b2, true);
    return add_relu(h, x);
  };
  const Tensor out = forward();
  const Tensor pooled = adaptive_avg_pool2d(out, {1, 1});
  const Tensor diff = sub(pooled, target);
  const Tensor loss = mean(mul(diff, diff));
  loss.backward();
  BlockRun r;
  r.out = out.detach();
  r.loss = loss.detach();
  r.gx = x.grad(), r.gw1 = w1.grad(), r.gw2 = w2.grad();
  r.gg1 = g1.grad(), r.gb1 = b1.grad(), r.gg2 = g2.grad(), r.gb2 = b2.grad();
  {
    NoGradGuard ng;
    for (const Tensor& p : {w1, w2, g1, b1, g2, b2}) ops::add_(p, p.grad(), -0.1);
    r.out_after = forward();
  }
  r.rm1 = rm1, r.rv1 = rv1, r.rm2 = rm2, r.rv2 = rv2;
  r.w1_after = w1.detach();
  return r;
}

TEST(ChannelsLastCuda, ConvBnReluAddReluBlockTrainStepMatchesRowMajor) {
  REQUIRE_GPU();
  const BlockRun ref = run_block(kRM), got = run_block(kCL);
  EXPECT_TRUE(is_row_major(ref.out));
  EXPECT_TRUE(is_channels_last(got.out)) << "block output";
  EXPECT_TRUE(is_channels_last(got.out_after)) << "block output after the step";
  EXPECT_TRUE(is_channels_last(got.gx)) << "input gradient";
  EXPECT_TRUE(is_channels_last(got.gw1)) << "conv1 weight gradient";
  EXPECT_TRUE(is_channels_last(got.gw2)) << "conv2 weight gradient";
  EXPECT_TRUE(is_channels_last(got.w1_after)) << "conv1 weight after the step";
  // Both runs are on the device (close_to_cpu() wants the reference on the CPU).
  auto cpu = [](const Tensor& t) { return ops::to(t, kCpu, t.dtype()); };
  const std::vector<std::tuple<const char*, Tensor, Tensor, double>> checks = {
      {"out", got.out, ref.out, 1e-4},
      {"loss", got.loss, ref.loss, 1e-4},
      {"grad x", got.gx, ref.gx, 2e-4},
      {"grad conv1 weight", got.gw1, ref.gw1, 2e-4},
      {"grad conv2 weight", got.gw2, ref.gw2, 2e-4},
      {"grad bn1 weight", got.gg1, ref.gg1, 2e-4},
      {"grad bn1 bias", got.gb1, ref.gb1, 2e-4},
      {"grad bn2 weight", got.gg2, ref.gg2, 2e-4},
      {"grad bn2 bias", got.gb2, ref.gb2, 2e-4},
      {"bn1 running_mean", got.rm1, ref.rm1, 1e-4},
      {"bn1 running_var", got.rv1, ref.rv1, 1e-4},
      {"bn2 running_mean", got.rm2, ref.rm2, 1e-4},
      {"bn2 running_var", got.rv2, ref.rv2, 1e-4},
      {"conv1 weight after the step", got.w1_after, ref.w1_after, 1e-5},
      {"out after the step", got.out_after, ref.out_after, 2e-4},
  };
  for (const auto& [name, g, r, tol] : checks) {
    ASSERT_TRUE(g.defined() && r.defined()) << name;
    EXPECT_TRUE(close_to_cpu(g, cpu(r), tol, name));
  }
}

// ================================================================ pools

// max_pool2d and adaptive_avg_pool2d's NHWC kernels (forward and backward, through autograd)
// against the CPU's row-major run: the same values, indices and gradients (the same windows
// in the same order: to the bit in float32), the results and the input gradient channels_last.
TEST(ChannelsLastCuda, PoolsMatchTheCpu) {
  REQUIRE_GPU();
  struct MaxCase {
    Shape in;
    Int2 k, stride, pad, dil;
    bool ceil;
  };
  const MaxCase max_cases[] = {{{2, 16, 13, 11}, 3, 2, 1, 1, false},  // ResNet's stem pool
                               {{3, 6, 8, 8}, 2, 2, 0, 1, false},
                               {{1, 5, 9, 10}, {3, 2}, {1, 2}, {1, 0}, 2, true},
                               {{2, 3, 7, 7}, 3, 1, 1, 1, false}};
  for (const DType dt : {DType::float32, DType::float16, DType::bfloat16}) {
    const double tol = dt == DType::float32 ? 0.0 : norm_tol(dt).elem;
    uint64_t seed = 40;
    for (const MaxCase& mc : max_cases) {
      const std::string what = case_label("max_pool2d", mc.in, dt);
      const Tensor x_cpu = ops::to(rand_tensor(mc.in, DType::float32, ++seed), dt);
      Tensor xc = ops::clone(x_cpu), xg = gpu_cl(x_cpu);
      xc.requires_grad_(true);
      xg.requires_grad_(true);
      auto [yc, ic] = max_pool2d_with_indices(xc, mc.k, mc.stride, mc.pad, mc.dil, mc.ceil);
      auto [yg, ig] = max_pool2d_with_indices(xg, mc.k, mc.stride, mc.pad, mc.dil, mc.ceil);
      EXPECT_TRUE(is_channels_last(yg) || yg.is_contiguous(kCL)) << what;
      EXPECT_TRUE(close_to_cpu(yg, yc, tol, what + " out"));
      EXPECT_EQ(ops::to_vector(ig), ops::to_vector(ic)) << what << ": indices";
      const Tensor gy = ops::to(rand_tensor(yc.sizes(), DType::float32, ++seed), dt);
      yc.backward(gy);
      yg.backward(gpu_cl(gy));
      EXPECT_TRUE(xg.grad().is_contiguous(kCL)) << what;
      EXPECT_TRUE(close_to_cpu(xg.grad(), xc.grad(), tol, what + " grad"));
    }
    const std::pair<Shape, Int2> adaptive_cases[] = {
        {{4, 32, 7, 7}, 1}, {{2, 8, 9, 7}, {3, 2}}, {{1, 3, 5, 6}, {5, 6}}};
    for (const auto& [in, size] : adaptive_cases) {
      const std::string what = case_label("adaptive_avg_pool2d", in, dt);
      const Tensor x_cpu = ops::to(rand_tensor(in, DType::float32, ++seed), dt);
      Tensor xc = ops::clone(x_cpu), xg = gpu_cl(x_cpu);
      xc.requires_grad_(true);
      xg.requires_grad_(true);
      const Tensor yc = adaptive_avg_pool2d(xc, size), yg = adaptive_avg_pool2d(xg, size);
      EXPECT_TRUE(yg.is_contiguous(kCL)) << what;
      EXPECT_TRUE(close_to_cpu(yg, yc, norm_tol(dt).elem, what + " out"));
      const Tensor gy = ops::to(rand_tensor(yc.sizes(), DType::float32, ++seed), dt);
      yc.backward(gy);
      yg.backward(gpu_cl(gy));
      EXPECT_TRUE(xg.grad().is_contiguous(kCL)) << what;
      EXPECT_TRUE(close_to_cpu(xg.grad(), xc.grad(), norm_tol(dt).elem, what + " grad"));
    }
  }
}

}  // namespace
}  // namespace tally
