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
