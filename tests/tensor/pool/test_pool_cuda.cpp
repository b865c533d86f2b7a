// Pooling on CUDA against the CPU reference (label gpu: skipped without a device):
// max_pool2d values and argmax indices (ties, NaN, -inf, padding, dilation, ceil_mode),
// its scatter-add backward, avg_pool2d with every divisor rule, adaptive_avg_pool2d
// (shrinking and growing), their backward gathers; float32, float64, float16, bfloat16;
// non-contiguous and unbatched inputs; autograd end to end; where the outputs live.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>

#include "memory/caching_allocator.h"
#include "memory/memory.h"
#include "tensor/pool/autograd.h"
#include "tensor/pool/ops.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using testing::Diff;
using testing::diff_pointwise;
using testing::kCpu;
using testing::kFloatDtypes;
using testing::kGpu;
using testing::rand_tensor;
using testing::to_gpu;

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
      {"3x2 stride (2, 1) padding (1, 0) ceil_mode",
       {1, 3, 10, 7},
       {3, 2},
       {2, 1},
       {1, 0},
       1,
       true},
      {"3x3 stride 3 padding 1 ceil_mode", {3, 2, 8, 11}, 3, 3, 1, 1, true},
      {"window covers the plane", {2, 2, 5, 4}, {5, 4}, 1, 0, 1, false},
  };
  return c;
}

std::string label(const char* name, DType d, const char* what) {
  return std::string(name) + " " + dtype_name(d) + " " + what;
}

// Forward (values, indices) and backward of max_pool2d on CPU and GPU for `x`.
void check_max(const PoolCase& c, const Tensor& x, uint64_t seed) {
  const DType d = x.dtype();
  const auto [y, idx] =
      ops::max_pool2d_with_indices(x, c.kernel, c.stride, c.padding, c.dilation, c.ceil_mode);
  const auto [yg, idxg] = ops::max_pool2d_with_indices(to_gpu(x), c.kernel, c.stride, c.padding,
                                                       c.dilation, c.ceil_mode);
  EXPECT_EQ(yg.device(), kGpu);
  EXPECT_EQ(idxg.device(), kGpu);
  const Diff e = diff_pointwise(yg, y);
  EXPECT_EQ(e.err, 0.0) << label(c.name, d, "max_pool2d values") << ": " << e.str();
  EXPECT_TRUE(same_indices(idxg, idx)) << label(c.name, d, "max_pool2d indices");

  const Tensor gy = rand_tensor(y.sizes(), d, seed);
  const Tensor gx = ops::max_pool2d_backward(gy, idx, x.sizes());
  const Tensor gxg = ops::max_pool2d_backward(to_gpu(gy), idxg, x.sizes());
  EXPECT_EQ(gxg.dtype(), d);
  // Overlapping windows add in atomicAdd order: float32 rounding apart; 16-bit may round
  // the (float) sum to a neighbouring value.
  const double t = d == DType::float64 ? 1e-12 : d == DType::float32 ? 1e-6 : 1e-2;
  const Diff eb = diff_pointwise(gxg, gx);
  EXPECT_LE(eb.err, t) << label(c.name, d, "max_pool2d backward") << ": " << eb.str();
}

TEST(CudaMaxPool2d, ValuesIndicesAndBackwardMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 10;
  for (const PoolCase& c : max_cases())
    for (DType d : kFloatDtypes) {
      seed += 3;
      check_max(c, rand_tensor(c.x, d, seed), seed + 1);
    }
}

TEST(CudaMaxPool2d, TiesNanAndInfinityLikeTheCpu) {
  REQUIRE_GPU();
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

TEST(CudaAvgPool2d, EveryDivisorRuleMatchesTheCpuExactly) {
  REQUIRE_GPU();
  const std::vector<AvgCase> cases = {
      {"2x2", {2, 3, 16, 15}, 2, 2, 0, false, true, std::nullopt},
      {"3x3 stride 2 padding 1 count_include_pad",
       {2, 3, 17, 13},
       3,
       2,
       1,
       false,
       true,
       std::nullopt},
      {"3x3 stride 2 padding 1 exclude pad", {2, 3, 17, 13}, 3, 2, 1, false, false, std::nullopt},
      {"3x3 stride 2 padding 1 ceil_mode include pad",
       {2, 2, 10, 9},
       3,
       2,
       1,
       true,
       true,
       std::nullopt},
      {"3x3 stride 2 padding 1 ceil_mode exclude pad",
       {2, 2, 10, 9},
       3,
       2,
       1,
       true,
       false,
       std::nullopt},
      {"2x2 ceil_mode (partial last window)", {1, 3, 9, 7}, 2, 2, 0, true, true, std::nullopt},
      {"3x3 stride 1 padding 1 divisor_override 5", {2, 2, 8, 11}, 3, 1, 1, false, true, 5},
      {"4x3 stride (3, 2) padding (2, 1) ceil divisor_override 7",
       {1, 2, 13, 12},
       {4, 3},
       {3, 2},
       {2, 1},
       true,
       false,
       7},
      {"overlapping 5x5 stride 1 padding 2", {2, 2, 9, 10}, 5, 1, 2, false, false, std::nullopt},
  };
  uint64_t seed = 40;
  for (const AvgCase& c : cases)
    for (DType d : kFloatDtypes) {
      const Tensor x = rand_tensor(c.x, d, seed += 3);
      const Tensor y = ops::avg_pool2d(x, c.kernel, c.stride, c.padding, c.ceil_mode,
                                       c.count_include_pad, c.divisor);
      const Tensor yg = ops::avg_pool2d(to_gpu(x), c.kernel, c.stride, c.padding, c.ceil_mode,
                                        c.count_include_pad, c.divisor);
      // Same window, same order, same rounding: bit for bit.
      Diff e = diff_pointwise(yg, y);
      EXPECT_EQ(e.err, 0.0) << label(c.name, d, "avg_pool2d") << ": " << e.str();
      const Tensor gy = rand_tensor(y.sizes(), d, seed + 1);
      const Tensor gx = ops::avg_pool2d_backward(gy, x.sizes(), c.kernel, c.stride, c.padding,
                                                 c.ceil_mode, c.count_include_pad, c.divisor);
      const Tensor gxg =
          ops::avg_pool2d_backward(to_gpu(gy), x.sizes(), c.kernel, c.stride, c.padding,
                                   c.ceil_mode, c.count_include_pad, c.divisor);
      EXPECT_EQ(gxg.dtype(), d);
      e = diff_pointwise(gxg, gx);
      EXPECT_EQ(e.err, 0.0) << label(c.name, d, "avg_pool2d backward") << ": " << e.str();
    }
}

TEST(CudaAdaptiveAvgPool2d, ShrinkingAndGrowingMatchTheCpuExactly) {
  REQUIRE_GPU();
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
      Diff e = diff_pointwise(ops::adaptive_avg_pool2d(to_gpu(x), c.out), y);
      EXPECT_EQ(e.err, 0.0) << label(name.c_str(), d, "adaptive_avg_pool2d") << ": " << e.str();
      const Tensor gy = rand_tensor(y.sizes(), d, seed + 1);
      e = diff_pointwise(ops::adaptive_avg_pool2d_backward(to_gpu(gy), x.sizes()),
                         ops::adaptive_avg_pool2d_backward(gy, x.sizes()));
      EXPECT_EQ(e.err, 0.0) << label(name.c_str(), d, "adaptive_avg_pool2d backward") << ": "
                            << e.str();
    }
}

TEST(CudaPool2d, NonContiguousUnbatchedAndResNetShapes) {
  REQUIRE_GPU();
  // Channels-last storage viewed as NCHW.
  const Tensor nhwc = rand_tensor({2, 13, 11, 5}, DType::float32, 90);
  const Tensor x = ops::permute(nhwc, {0, 3, 1, 2}), xg = ops::permute(to_gpu(nhwc), {0, 3, 1, 2});
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
  const Tensor gy = ops::slice(wide, 3, 0, 12, 2), gyg = ops::slice(to_gpu(wide), 3, 0, 12, 2);
  ASSERT_EQ(gy.sizes(), y.sizes());
  EXPECT_LE(diff_pointwise(ops::max_pool2d_backward(gyg, idxg, x.sizes()),
                           ops::max_pool2d_backward(gy, idx, x.sizes()))
                .err,
            1e-6);
  EXPECT_EQ(diff_pointwise(ops::avg_pool2d_backward(gyg, x.sizes(), 3, 2, 1),
                           ops::avg_pool2d_backward(gy, x.sizes(), 3, 2, 1))
                .err,
            0.0);

  // Unbatched [C, H, W].
  const Tensor x3 = rand_tensor({4, 9, 10}, DType::float32, 92);
  const auto [y3, i3] = ops::max_pool2d_with_indices(x3, 2);
  const auto [y3g, i3g] = ops::max_pool2d_with_indices(to_gpu(x3), 2);
  EXPECT_EQ(y3g.sizes(), (Shape{4, 4, 5}));
  EXPECT_EQ(diff_pointwise(y3g, y3).err, 0.0);
  EXPECT_TRUE(same_indices(i3g, i3));
  EXPECT_EQ(
      diff_pointwise(ops::adaptive_avg_pool2d(to_gpu(x3), 3), ops::adaptive_avg_pool2d(x3, 3)).err,
      0.0);

  // ResNet: the stem's 3x3/2 max pool on [8, 64, 56, 56] and the head's global average.
  const Tensor stem = rand_tensor({8, 64, 56, 56}, DType::float32, 93);
  const PoolCase resnet{"ResNet stem", stem.sizes(), 3, 2, 1, 1, false};
  check_max(resnet, stem, 94);
  const Tensor head = rand_tensor({8, 512, 7, 7}, DType::float32, 95);
  EXPECT_EQ(
      diff_pointwise(ops::adaptive_avg_pool2d(to_gpu(head), 1), ops::adaptive_avg_pool2d(head, 1))
          .err,
      0.0);
  const Tensor ghead = rand_tensor({8, 512, 1, 1}, DType::float32, 96);
  EXPECT_EQ(diff_pointwise(ops::adaptive_avg_pool2d_backward(to_gpu(ghead), head.sizes()),
                           ops::adaptive_avg_pool2d_backward(ghead, head.sizes()))
                .err,
            0.0);
}

TEST(CudaPool2d, AutogradMatchesTheCpu) {
  REQUIRE_GPU();
  const Tensor xc = rand_tensor({2, 3, 11, 10}, DType::float32, 100);
  Tensor x = xc.detach(), xg = to_gpu(xc);
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
  EXPECT_EQ(xg.grad().device(), kGpu);
  const Diff e = diff_pointwise(xg.grad(), x.grad());
  EXPECT_LE(e.err, 1e-6) << e.str();
}

// The outputs and gradients live in the GPU allocator under the op's context; pooling
// asks for no workspace.
// Tensors whose flat indices fit in 31 bits take a kernel with 32-bit index arithmetic; larger
// ones the 64-bit kernel. Past 2^31 input elements (a 4.3 GB bfloat16 tensor, two planes), each
// plane's values and argmax indices from the 64-bit kernel must equal those of the same plane
// pooled alone (1.07e9 elements: the 32-bit kernel), compared on the device.
TEST(CudaMaxPool2d, PastTwoToThe31ElementsTheWideKernelAgreesPlaneByPlane) {
  REQUIRE_GPU();
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  if (free_bytes < (size_t{28} << 30))
    GTEST_SKIP() << "needs 28 GiB free on the GPU, has " << (free_bytes >> 20) << " MiB";
  const int64_t H = 32768, W = 32769, rows = 256;  // 2 * H * W = 2,147,549,184 > 2^31 - 1
  const Tensor base = to_gpu(rand_tensor({2, 1, 1, rows, W}, DType::bfloat16, 91));
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

TEST(CudaPool2d, AllocationsLandInTheGpuAllocator) {
  REQUIRE_GPU();
  memory::CachingAllocator& alloc = memory::get_allocator(kGpu);
  alloc.record_memory_history(true);
  const Tensor x = to_gpu(rand_tensor({2, 4, 12, 12}, DType::bfloat16, 110));
  const auto [y, idx] = ops::max_pool2d_with_indices(x, 2);
  const Tensor gx = ops::max_pool2d_backward(ops::ones_like(y), idx, x.sizes());
  const Tensor a = ops::avg_pool2d(x, 3, 1, 1);
  const Tensor ad = ops::adaptive_avg_pool2d(x, 5);
  const auto history = alloc.history();
  alloc.record_memory_history(false);
  for (const Tensor* t : {&y, &idx, &gx, &a, &ad}) {
    EXPECT_EQ(t->device(), kGpu);
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
  EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::unknown).current, 0);
}

}  // namespace
}  // namespace tally
