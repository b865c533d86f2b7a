// conv2d on CUDA (cuDNN) against the CPU reference (label gpu: skipped without a device):
// forward, backward-data and backward-filter over many geometries (stride, padding,
// dilation, groups, depthwise, 1x1, bias, a ResNet 3x3) in float32, float64, float16 and
// bfloat16; non-contiguous, unbatched and empty inputs; autograd end to end; the cuDNN
// workspace tagged `workspace` in the allocator's history; the benchmark switch; the batch
// split beyond cuDNN's int-sized tensors.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "memory/caching_allocator.h"
#include "memory/memory.h"
#include "tensor/conv/autograd.h"
#include "tensor/conv/ops.h"
#include "testing/cuda_testing.h"

#if defined(TALLY_WITH_CUDA)
#include "tensor/conv/cuda.h"
#include "tensor/cuda/runtime.h"
#endif

namespace tally {
namespace {

using testing::Diff;
using testing::diff_scaled;
using testing::kCpu;
using testing::kFloatDtypes;
using testing::kGpu;
using testing::rand_tensor;
using testing::to_gpu;

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

// Runs the three raw ops on CPU and GPU for one case and dtype and checks each.
void check_case(const ConvCase& c, DType d, uint64_t seed) {
  const Tensor x = rand_tensor(c.x, d, seed, -1, 1), w = rand_tensor(c.w, d, seed + 1, -1, 1);
  const Tensor b = c.bias ? rand_tensor({c.w[0]}, d, seed + 2, -1, 1) : Tensor();
  const Tensor y = ops::conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
  const Tensor yg = ops::conv2d(to_gpu(x), to_gpu(w), c.bias ? to_gpu(b) : Tensor(), c.stride,
                                c.padding, c.dilation, c.groups);
  EXPECT_EQ(yg.device(), kGpu);
  EXPECT_EQ(yg.dtype(), d);
  Diff e = diff_scaled(yg, y);
  note(d, "forward", e);
  EXPECT_LE(e.err, tol(d)) << label(c, d, "forward") << ": " << e.str();

  const Tensor gy = rand_tensor(y.sizes(), d, seed + 3, -1, 1);
  const Tensor gx =
      ops::conv2d_backward_input(gy, w, c.x, c.stride, c.padding, c.dilation, c.groups);
  const Tensor gxg = ops::conv2d_backward_input(to_gpu(gy), to_gpu(w), c.x, c.stride, c.padding,
                                                c.dilation, c.groups);
  EXPECT_EQ(gxg.dtype(), d);
  e = diff_scaled(gxg, gx);
  note(d, "backward input", e);
  EXPECT_LE(e.err, tol(d)) << label(c, d, "backward input") << ": " << e.str();

  const Tensor gw =
      ops::conv2d_backward_weight(gy, x, c.w, c.stride, c.padding, c.dilation, c.groups);
  const Tensor gwg = ops::conv2d_backward_weight(to_gpu(gy), to_gpu(x), c.w, c.stride, c.padding,
                                                 c.dilation, c.groups);
  EXPECT_EQ(gwg.dtype(), d);
  e = diff_scaled(gwg, gw);
  note(d, "backward weight", e);
  EXPECT_LE(e.err, tol(d)) << label(c, d, "backward weight") << ": " << e.str();
}

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

TEST(CudaConv2d, ForwardAndBackwardsMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (const ConvCase& c : cases())
    for (DType d : kFloatDtypes) {
      SCOPED_TRACE(label(c, d, ""));
      check_case(c, d, seed += 10);
    }
  for (const auto& [what, err] : worst_seen())
    std::cout << "[ max err ] " << what << ": " << err << " of max |ref|\n";
}

TEST(CudaConv2d, NonContiguousUnbatchedAndEmptyInputs) {
  REQUIRE_GPU();
  for (DType d : {DType::float32, DType::bfloat16}) {
    SCOPED_TRACE(dtype_name(d));
    // Channels-last input and a transposed weight, both viewed as NCHW / OIHW.
    const Tensor x_nhwc = rand_tensor({2, 9, 11, 5}, d, 1, -1, 1),
                 w_iokk = rand_tensor({5, 6, 3, 3}, d, 2, -1, 1);
    const Tensor x = ops::permute(x_nhwc, {0, 3, 1, 2}), w = ops::transpose(w_iokk, 0, 1);
    const Tensor xg = ops::permute(to_gpu(x_nhwc), {0, 3, 1, 2}),
                 wg = ops::transpose(to_gpu(w_iokk), 0, 1);
    ASSERT_FALSE(xg.is_contiguous());
    ASSERT_FALSE(wg.is_contiguous());
    const Tensor y = ops::conv2d(x, w, {}, 2, 1);
    Diff e = diff_scaled(ops::conv2d(xg, wg, {}, 2, 1), y);
    EXPECT_LE(e.err, tol(d)) << "non-contiguous forward: " << e.str();
    // A strided grad_output (every other column of a wider tensor).
    const Shape ys = y.sizes();
    const Tensor wide = rand_tensor({ys[0], ys[1], ys[2], 2 * ys[3]}, d, 3, -1, 1);
    const Tensor gy = ops::slice(wide, 3, 0, 2 * ys[3], 2),
                 gyg = ops::slice(to_gpu(wide), 3, 0, 2 * ys[3], 2);
    ASSERT_FALSE(gyg.is_contiguous());
    e = diff_scaled(ops::conv2d_backward_input(gyg, wg, x.sizes(), 2, 1, 1, 1),
                    ops::conv2d_backward_input(gy, w, x.sizes(), 2, 1, 1, 1));
    EXPECT_LE(e.err, tol(d)) << "non-contiguous backward input: " << e.str();
    e = diff_scaled(ops::conv2d_backward_weight(gyg, xg, w.sizes(), 2, 1, 1, 1),
                    ops::conv2d_backward_weight(gy, x, w.sizes(), 2, 1, 1, 1));
    EXPECT_LE(e.err, tol(d)) << "non-contiguous backward weight: " << e.str();
  }
  // Unbatched [C, H, W].
  const Tensor x3 = rand_tensor({3, 10, 7}, DType::float32, 4, -1, 1),
               w = rand_tensor({4, 3, 3, 3}, DType::float32, 5, -1, 1);
  const Tensor b = rand_tensor({4}, DType::float32, 6, -1, 1);
  const Tensor y3 = ops::conv2d(to_gpu(x3), to_gpu(w), to_gpu(b), 1, 1);
  EXPECT_EQ(y3.sizes(), (Shape{4, 10, 7}));
  Diff e = diff_scaled(y3, ops::conv2d(x3, w, b, 1, 1));
  EXPECT_LE(e.err, 1e-4) << "unbatched: " << e.str();
  const Tensor gy3 = rand_tensor({4, 10, 7}, DType::float32, 7, -1, 1);
  e = diff_scaled(ops::conv2d_backward_input(to_gpu(gy3), to_gpu(w), x3.sizes(), 1, 1, 1, 1),
                  ops::conv2d_backward_input(gy3, w, x3.sizes(), 1, 1, 1, 1));
  EXPECT_LE(e.err, 1e-4) << "unbatched backward input: " << e.str();
  e = diff_scaled(ops::conv2d_backward_weight(to_gpu(gy3), to_gpu(x3), w.sizes(), 1, 1, 1, 1),
                  ops::conv2d_backward_weight(gy3, x3, w.sizes(), 1, 1, 1, 1));
  EXPECT_LE(e.err, 1e-4) << "unbatched backward weight: " << e.str();

  // An empty batch: empty output and input gradient, a zero weight gradient.
  const Tensor x0 = ops::zeros({0, 3, 8, 8}, DType::float32, kGpu);
  const Tensor y0 = ops::conv2d(x0, to_gpu(w), to_gpu(b), 1, 1);
  EXPECT_EQ(y0.sizes(), (Shape{0, 4, 8, 8}));
  const Tensor gy0 = ops::zeros({0, 4, 8, 8}, DType::float32, kGpu);
  EXPECT_EQ(ops::conv2d_backward_input(gy0, to_gpu(w), x0.sizes(), 1, 1, 1, 1).sizes(), x0.sizes());
  // Fill the cache with non-zero garbage first so a missing zero-fill would show.
  { const Tensor junk = ops::full({4096}, 7.0, DType::float32, kGpu); }
  const Tensor gw0 = ops::conv2d_backward_weight(gy0, x0, w.sizes(), 1, 1, 1, 1);
  EXPECT_EQ(gw0.sizes(), w.sizes());
  for (double v : ops::to_vector(gw0)) ASSERT_EQ(v, 0.0);
}

TEST(CudaConv2d, AutogradMatchesTheCpu) {
  REQUIRE_GPU();
  const Tensor xc = rand_tensor({3, 4, 12, 11}, DType::float32, 20, -1, 1),
               wc = rand_tensor({6, 2, 3, 3}, DType::float32, 21, -1, 1);
  const Tensor bc = rand_tensor({6}, DType::float32, 22, -1, 1),
               gyc = rand_tensor({3, 6, 6, 6}, DType::float32, 23, -1, 1);
  Tensor x = xc.detach(), w = wc.detach(), b = bc.detach();
  x.requires_grad_(), w.requires_grad_(), b.requires_grad_();
  Tensor xg = to_gpu(xc), wg = to_gpu(wc), bg = to_gpu(bc);
  xg.requires_grad_(), wg.requires_grad_(), bg.requires_grad_();
  const Tensor y = conv2d(x, w, b, 2, 1, 1, 2), yg = conv2d(xg, wg, bg, 2, 1, 1, 2);
  ASSERT_EQ(y.sizes(), gyc.sizes());
  Diff e = diff_scaled(yg, y);
  EXPECT_LE(e.err, 1e-4) << "forward: " << e.str();
  sum(mul(y, gyc)).backward();
  sum(mul(yg, to_gpu(gyc))).backward();
  for (auto [name, gc, gg] :
       {std::tuple{"x", x.grad(), xg.grad()}, std::tuple{"w", w.grad(), wg.grad()},
        std::tuple{"b", b.grad(), bg.grad()}}) {
    ASSERT_TRUE(gg.defined()) << name;
    EXPECT_EQ(gg.device(), kGpu) << name;
    e = diff_scaled(gg, gc);
    EXPECT_LE(e.err, 1e-4) << "grad " << name << ": " << e.str();
  }
}

// Every allocation cuDNN's workspace needs is in the GPU allocator's history, tagged
// `workspace` under the conv op that asked for it; no conv allocation is `unknown`.
TEST(CudaConv2d, WorkspaceIsTaggedInTheAllocatorHistory) {
  REQUIRE_GPU();
#if defined(TALLY_WITH_CUDA)
  memory::CachingAllocator& alloc = memory::get_allocator(kGpu);
  const std::set<std::string> conv_ops{"conv2d", "conv2d_backward_input", "conv2d_backward_weight"};
  for (bool benchmark : {false, true}) {
    SCOPED_TRACE(benchmark ? "benchmark" : "heuristics");
    BenchmarkScope bs(benchmark);
    cuda::clear_conv_algorithm_cache();
    cuda::synchronize(0);
    alloc.reset_peak_memory_stats();
    alloc.record_memory_history(true);
    for (DType d : {DType::float32, DType::float16})
      for (const ConvCase& c : {cases()[9], cases()[11], cases()[12]}) {
        const Tensor x = to_gpu(rand_tensor(c.x, d, 1, -1, 1)),
                     w = to_gpu(rand_tensor(c.w, d, 2, -1, 1));
        const Tensor y = ops::conv2d(x, w, {}, c.stride, c.padding, c.dilation, c.groups);
        const Tensor gy = to_gpu(rand_tensor(y.sizes(), d, 3, -1, 1));
        ops::conv2d_backward_input(gy, w, c.x, c.stride, c.padding, c.dilation, c.groups);
        ops::conv2d_backward_weight(gy, x, c.w, c.stride, c.padding, c.dilation, c.groups);
      }
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
#endif
}

// With benchmark off the calls run cached cuDNN execution plans (the backend API): one plan
// per direction per geometry and dtype on the first run, none added on the second, results
// matching the CPU; benchmark mode does not touch the plans.
TEST(CudaConv2d, HeuristicsRunCachedExecutionPlans) {
  REQUIRE_GPU();
#if defined(TALLY_WITH_CUDA)
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
#endif
}

// The benchmark switch: cudnnFind* once per key (the cache grows by one entry per
// direction, dtype and geometry, and not again on a second run), results that match the
// CPU and the heuristic path.
TEST(CudaConv2d, BenchmarkSwitchTimesOncePerKeyAndMatches) {
  REQUIRE_GPU();
#if defined(TALLY_WITH_CUDA)
  const std::vector<ConvCase> picked = {cases()[1], cases()[3], cases()[6], cases()[11]};
  std::vector<std::vector<Tensor>> heuristic;
  {
    BenchmarkScope bs(false);
    EXPECT_FALSE(cuda::cudnn_benchmark());
    for (const ConvCase& c : picked) {
      const Tensor x = to_gpu(rand_tensor(c.x, DType::float32, 1, -1, 1)),
                   w = to_gpu(rand_tensor(c.w, DType::float32, 2, -1, 1));
      const Tensor y = ops::conv2d(x, w, {}, c.stride, c.padding, c.dilation, c.groups);
      const Tensor gy = to_gpu(rand_tensor(y.sizes(), DType::float32, 3, -1, 1));
      heuristic.push_back(
          {y, ops::conv2d_backward_input(gy, w, c.x, c.stride, c.padding, c.dilation, c.groups),
           ops::conv2d_backward_weight(gy, x, c.w, c.stride, c.padding, c.dilation, c.groups)});
    }
  }
  BenchmarkScope bs(true);
  EXPECT_TRUE(cuda::cudnn_benchmark());
  for (DType d : {DType::float32, DType::float16}) {
    cuda::clear_conv_algorithm_cache();
    for (int round = 0; round < 2; ++round) {
      for (size_t i = 0; i < picked.size(); ++i) {
        const ConvCase& c = picked[i];
        SCOPED_TRACE(label(c, d, round == 0 ? "(first run)" : "(cached)"));
        check_case(c, d, 300 + i);
        if (d == DType::float32) {
          const Tensor x = to_gpu(rand_tensor(c.x, d, 1, -1, 1)),
                       w = to_gpu(rand_tensor(c.w, d, 2, -1, 1));
          const Tensor y = ops::conv2d(x, w, {}, c.stride, c.padding, c.dilation, c.groups);
          const Tensor gy = to_gpu(rand_tensor(y.sizes(), d, 3, -1, 1));
          const Tensor gx =
              ops::conv2d_backward_input(gy, w, c.x, c.stride, c.padding, c.dilation, c.groups);
          const Tensor gw =
              ops::conv2d_backward_weight(gy, x, c.w, c.stride, c.padding, c.dilation, c.groups);
          EXPECT_LE(diff_scaled(y, heuristic[i][0]).err, 1e-4) << "forward vs heuristics";
          EXPECT_LE(diff_scaled(gx, heuristic[i][1]).err, 1e-4) << "backward input vs heuristics";
          EXPECT_LE(diff_scaled(gw, heuristic[i][2]).err, 1e-4) << "backward weight vs heuristics";
        }
      }
      // One key per direction per geometry (the cases differ in geometry).
      EXPECT_EQ(cuda::conv_algorithm_cache_size(), 3 * picked.size()) << "round " << round;
    }
  }
#endif
}

// cudnn_allow_tf32 (PyTorch's torch.backends.cudnn.allow_tf32): on by default in the
// library, off for the test suite (tests/exact_float32.cpp); off, a float32 convolution
// matches the float64 CPU result to float32 rounding; on, cuDNN may round the inputs to TF32's
// 10-bit mantissa (errors near 1e-3 of max|ref|), still far below 16-bit's.
TEST(CudaConv2d, Float32IsExactUnlessTf32IsAllowed) {
  REQUIRE_GPU();
#if defined(TALLY_WITH_CUDA)
  EXPECT_FALSE(cuda::cudnn_allow_tf32())
      << "the test suite runs with exact float32 (tests/exact_float32.cpp)";
  const ConvCase& c = cases()[11];  // ResNet 3x3 [8, 64, 28, 28]
  const Tensor x = rand_tensor(c.x, DType::float32, 41, -1, 1),
               w = rand_tensor(c.w, DType::float32, 42, -1, 1);
  const Tensor ref = ops::conv2d(ops::to(x, DType::float64), ops::to(w, DType::float64), {},
                                 c.stride, c.padding, c.dilation, c.groups);
  auto error = [&](bool tf32) {
    cuda::set_cudnn_allow_tf32(tf32);
    Tensor y;
    try {
      y = ops::conv2d(to_gpu(x), to_gpu(w), {}, c.stride, c.padding, c.dilation, c.groups);
    } catch (...) {
      cuda::set_cudnn_allow_tf32(false);
      throw;
    }
    cuda::set_cudnn_allow_tf32(false);
    return diff_scaled(ops::to(y, DType::float64), ref).err;
  };
  const double exact = error(false), tf32 = error(true), again = error(false);
  std::printf(
      "conv 3x3 [8, 64, 28, 28] float32, error relative to max|ref|: TF32 off %.3g, on %.3g, off "
      "again %.3g\n",
      exact, tf32, again);
  EXPECT_LT(exact, 1e-5);
  EXPECT_LT(again, 1e-5);
  EXPECT_GT(tf32, 3e-5) << "cudnn_allow_tf32 had no effect";
  EXPECT_LT(tf32, 1e-2);
#endif
}

// A batch whose tensors exceed the per-call element limit runs as several cuDNN calls
// (here forced with a tiny limit: slices of 2, 2 and 1 samples); backward filter sums the
// slices.
TEST(CudaConv2d, BatchSplitMatchesTheCpu) {
  REQUIRE_GPU();
#if defined(TALLY_WITH_CUDA)
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
  std::string m = "<no exception>";
  try {
    ops::conv2d(to_gpu(rand_tensor(c.x, DType::float32, 1, -1, 1)),
                to_gpu(rand_tensor(c.w, DType::float32, 2, -1, 1)), {}, 1, 1);
  } catch (const std::invalid_argument& e) {
    m = e.what();
  }
  EXPECT_NE(m.find("[5, 3, 9, 9]"), std::string::npos) << m;
#endif
}

}  // namespace
}  // namespace tally
