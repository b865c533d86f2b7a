// clip_grad_norm_ and clip_grad_value_ on the CPU: the norm's value for several norm types,
// the scaling, and the errors.
#include <gtest/gtest.h>

#include <cmath>

#include "optim/clip_grad.h"
#include "optim_testing.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using optim::clip_grad_norm_;
using testing::near_rel;
using testing::param;
using testing::set_grad;

struct Two {
  Tensor a = param({0, 0}), b = param({0});
  Two() {
    set_grad(a, {3, 4});
    set_grad(b, {-12});
  }
};

TEST(ClipGradNorm, ScalesDownToMaxNorm) {
  Two t;
  const Tensor n = clip_grad_norm_({t.a, t.b}, 6.5);
  EXPECT_EQ(n.dim(), 0);
  EXPECT_EQ(n.dtype(), DType::float32);
  EXPECT_NEAR(n.item(), 13.0, 1e-6);
  // coefficient 6.5 / (13 + 1e-6)
  const double c = 6.5 / (13.0 + 1e-6);
  EXPECT_TRUE(near_rel(t.a.grad(), {3 * c, 4 * c}, 1e-6));
  EXPECT_TRUE(near_rel(t.b.grad(), {-12 * c}, 1e-6));
  // now the norm is 6.5: a second clip to 6.5 changes (almost) nothing
  EXPECT_NEAR(clip_grad_norm_({t.a, t.b}, 6.5).item(), 6.5, 1e-5);
  EXPECT_TRUE(near_rel(t.b.grad(), {-12 * c}, 1e-5));
}

TEST(ClipGradNorm, LeavesSmallGradientsUnchanged) {
  Two t;
  EXPECT_NEAR(clip_grad_norm_({t.a, t.b}, 100.0).item(), 13.0, 1e-6);
  EXPECT_TRUE(near_rel(t.a.grad(), {3, 4}, 0));
  EXPECT_TRUE(near_rel(t.b.grad(), {-12}, 0));
}

TEST(ClipGradNorm, OtherNormTypes) {
  {
    Two t;
    EXPECT_NEAR(clip_grad_norm_({t.a, t.b}, 100.0, optim::kInfNorm).item(), 12.0, 0);
  }
  {
    Two t;
    EXPECT_NEAR(clip_grad_norm_({t.a, t.b}, 100.0, 1.0).item(), 19.0, 1e-6);
  }
  {
    Two t;  // (27 + 64 + 1728)^(1/3)
    EXPECT_NEAR(clip_grad_norm_({t.a, t.b}, 100.0, 3.0).item(), std::cbrt(1819.0), 1e-5);
  }
  {
    Two t;
    const Tensor n = clip_grad_norm_({t.a, t.b}, 1.0, optim::kInfNorm);
    const double c = 1.0 / (12.0 + 1e-6);
    EXPECT_TRUE(near_rel(t.a.grad(), {3 * c, 4 * c}, 1e-6));
  }
}

TEST(ClipGradNorm, ParamsWithoutGradsAndNonFiniteGrads) {
  Tensor a = param({1, 2}), b = param({1});
  set_grad(b, {2});
  EXPECT_NEAR(clip_grad_norm_({a, b}, 1.0).item(), 2.0, 1e-6);
  EXPECT_FALSE(a.grad().defined());
  EXPECT_NEAR(b.grad().item(), 1.0 / (2.0 + 1e-6) * 2.0, 1e-6);
  EXPECT_EQ(clip_grad_norm_({a}, 1.0).item(), 0.0);  // no gradients at all
  set_grad(b, {NAN});
  EXPECT_TRUE(std::isnan(clip_grad_norm_({b}, 1.0).item()));
}

// 16-bit gradients (a bfloat16 model whose masters live in CpuOffload) are reduced and scaled
// in float32: the float32 clip's norm and result, to 16-bit rounding, for each norm type.
TEST(ClipGradNorm, SixteenBitGradients) {
  for (const DType dt : {DType::bfloat16, DType::float16})
    for (const double type : {2.0, 1.0, 3.0, 0.0, optim::kInfNorm}) {
      Two f;
      Tensor a = ops::to(f.a, dt).requires_grad_(), b = ops::to(f.b, dt).requires_grad_();
      a.set_grad(ops::to(f.a.grad(), dt));
      b.set_grad(ops::to(f.b.grad(), dt));
      const Tensor want = clip_grad_norm_({f.a, f.b}, 2.5, type);
      const Tensor got = clip_grad_norm_({a, b}, 2.5, type);
      EXPECT_EQ(got.dtype(), dt);
      EXPECT_NEAR(got.item(), want.item(), 1e-2 * want.item()) << type;
      const std::vector<std::pair<Tensor, Tensor>> pairs = {{a, f.a}, {b, f.b}};
      for (const auto& [low, full] : pairs)  // within the 16-bit rounding of the float32 clip
        EXPECT_LT(testing::max_abs_diff(ops::to(low.grad(), DType::float32), full.grad()),
                  1e-2 * 12)
            << dtype_name(dt) << " " << type;
    }
}

TEST(ClipGradNorm, Float64AndErrors) {
  Tensor a = param({0, 0}, DType::float64);
  set_grad(a, {3, 4});
  const Tensor n = clip_grad_norm_({a}, 1.0);
  EXPECT_EQ(n.dtype(), DType::float64);
  EXPECT_DOUBLE_EQ(n.item(), 5.0);
  EXPECT_TRUE(near_rel(a.grad(), {3 / (5 + 1e-6), 4 / (5 + 1e-6)}, 1e-15));
  Tensor b = param({0});
  set_grad(b, {1});
  testing::expect_error<std::invalid_argument>(
      [&] {
        clip_grad_norm_({a, b}, 1.0);
      },
      {"parameter 1", "float32", "float64"});
  testing::expect_error<std::invalid_argument>([&] { clip_grad_norm_({a}, 1.0, -1.0); },
                                               {"norm_type"});
}

TEST(ClipGradValue, Clamps) {
  Two t;
  optim::clip_grad_value_({t.a, t.b}, 3.5);
  EXPECT_TRUE(near_rel(t.a.grad(), {3, 3.5}, 0));
  EXPECT_TRUE(near_rel(t.b.grad(), {-3.5}, 0));
}

}  // namespace
}  // namespace tally
