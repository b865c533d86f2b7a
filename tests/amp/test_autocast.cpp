// Autocast on the CPU with bfloat16: which ops run in bfloat16 and which in float32, the
// dtypes gradients come back in, the weight-cast cache (one autocast_cache block per
// weight per region, freed at exit), nesting, and a small MLP that trains under autocast
// and stays close to its float32 twin.
#include <cmath>

#include "amp_testing.h"
#include "autograd/autocast.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "memory/memory.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using memory::Category;

using amp_testing::data;
using amp_testing::kCpu;
using amp_testing::param;

int64_t cat_bytes(Category c) {
  return memory::get_allocator(kCpu).stats().cat_bytes(c).current;
}
int64_t cat_blocks_allocated(Category c) {
  return memory::get_allocator(kCpu).stats().category_blocks[static_cast<size_t>(c)].allocated;
}

using testing::max_abs_diff;
double max_abs(const Tensor& a) {
  double m = 0;
  for (double v : ops::to_vector(a)) m = std::max(m, std::abs(v));
  return m;
}

TEST(Autocast, GuardStateNestsAndRestores) {
  EXPECT_FALSE(is_autocast_enabled(DeviceType::cpu));
  {
    AutocastGuard outer(DeviceType::cpu, DType::bfloat16);
    EXPECT_TRUE(is_autocast_enabled(DeviceType::cpu));
    EXPECT_FALSE(is_autocast_enabled(DeviceType::cuda));
    EXPECT_EQ(autocast_dtype(DeviceType::cpu), DType::bfloat16);
    {
      AutocastGuard inner(DeviceType::cpu, DType::float16, /*enabled=*/false);
      EXPECT_FALSE(is_autocast_enabled(DeviceType::cpu));
      const Tensor y = linear(data({2, 3}, 1), param({4, 3}, 1.0, 2));
      EXPECT_EQ(y.dtype(), DType::float32);  // disabled inside
      {
        AutocastGuard inner2(DeviceType::cpu, DType::float16);
        EXPECT_EQ(linear(data({2, 3}, 1), param({4, 3}, 1.0, 2)).dtype(), DType::float16);
      }
    }
    EXPECT_TRUE(is_autocast_enabled(DeviceType::cpu));
    EXPECT_EQ(autocast_dtype(DeviceType::cpu), DType::bfloat16);
  }
  EXPECT_FALSE(is_autocast_enabled(DeviceType::cpu));
  // The default dtypes: bfloat16 on the CPU, float16 on CUDA (PyTorch's).
  {
    AutocastGuard g(DeviceType::cpu);
    EXPECT_EQ(autocast_dtype(DeviceType::cpu), DType::bfloat16);
  }
  EXPECT_THROW({ AutocastGuard bad(DeviceType::cpu, DType::float32); }, std::invalid_argument);
  EXPECT_FALSE(is_autocast_enabled(DeviceType::cpu));
}

TEST(Autocast, LowerPrecisionOpsRunInBfloat16) {
  const Tensor x = data({4, 8}, 1), w = param({6, 8}, 0.3, 2), b = param({6}, 0.1, 3);
  const Tensor img = data({2, 3, 6, 6}, 4), kw = param({5, 3, 3, 3}, 0.2, 5);
  const Tensor q = data({2, 5, 8}, 6), k = data({2, 7, 8}, 7), v = data({2, 7, 4}, 8);
  AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
  EXPECT_EQ(linear(x, w, b).dtype(), DType::bfloat16);
  EXPECT_EQ(matmul(x, w.t()).dtype(), DType::bfloat16);
  EXPECT_EQ(mm(x, w.t()).dtype(), DType::bfloat16);
  EXPECT_EQ(bmm(q, k.transpose(1, 2)).dtype(), DType::bfloat16);
  EXPECT_EQ(conv2d(img, kw, Tensor(), {1, 1}, {1, 1}).dtype(), DType::bfloat16);
  EXPECT_EQ(scaled_dot_product_attention(q, k, v).dtype(), DType::bfloat16);
  // float64 is never lowered (PyTorch's eligibility rule).
  const Tensor x64 = ops::to(x, DType::float64);
  EXPECT_EQ(matmul(x64, ops::to(w, DType::float64).t()).dtype(), DType::float64);
}

TEST(Autocast, Float32OpsRunInFloat32) {
  AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
  const Tensor h = linear(data({4, 8}, 1), param({6, 8}, 0.3, 2));  // bfloat16
  ASSERT_EQ(h.dtype(), DType::bfloat16);
  const Tensor target = from_vector({0, 1, 2, 5}, {4}, TensorOptions{}.with_dtype(DType::int64));
  EXPECT_EQ(softmax(h, -1).dtype(), DType::float32);
  EXPECT_EQ(log_softmax(h, -1).dtype(), DType::float32);
  EXPECT_EQ(layer_norm(h, {6}, param({6}, 1.0, 3), param({6}, 0.1, 4)).dtype(), DType::float32);
  EXPECT_EQ(rms_norm(h, {6}, param({6}, 1.0, 3)).dtype(), DType::float32);
  EXPECT_EQ(cross_entropy(h, target).dtype(), DType::float32);
  EXPECT_EQ(nll_loss(log_softmax(h, -1), target).dtype(), DType::float32);
  EXPECT_EQ(exp(h).dtype(), DType::float32);
  EXPECT_EQ(log(abs(h)).dtype(), DType::float32);
  EXPECT_EQ(pow(h, 2.0).dtype(), DType::float32);
  EXPECT_EQ(logsumexp(h, 1).dtype(), DType::float32);
  EXPECT_EQ(sum(h).dtype(), DType::float32);  // fp32_set_opt_dtype
  // Not listed: run in the input dtype.
  EXPECT_EQ(mean(h).dtype(), DType::bfloat16);
  EXPECT_EQ(relu(h).dtype(), DType::bfloat16);
  const Tensor rm = zeros({6}), rv = ones({6});
  EXPECT_EQ(batch_norm(h, rm, rv, param({6}, 1.0, 5), Tensor(), true).dtype(), DType::bfloat16);
  // Promote: mixed inputs run in the widest type.
  const Tensor f = data({4, 6}, 9);
  EXPECT_EQ(add(h, f).dtype(), DType::float32);
  EXPECT_EQ(mul(h, f).dtype(), DType::float32);
  EXPECT_EQ(cat({h, f}, 0).dtype(), DType::float32);
  EXPECT_EQ(stack({h, f}, 0).dtype(), DType::float32);
}

TEST(Autocast, GradientsComeBackInTheParametersDtype) {
  Tensor x = data({5, 8}, 1);
  x.requires_grad_(true);
  const Tensor w1 = param({16, 8}, 0.3, 2), b1 = param({16}, 0.1, 3);
  const Tensor g = param({16}, 1.0, 4), w2 = param({3, 16}, 0.3, 5);
  const Tensor target = from_vector({0, 1, 2, 1, 0}, {5}, TensorOptions{}.with_dtype(DType::int64));
  Tensor loss;
  {
    AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
    loss = cross_entropy(linear(layer_norm(relu(linear(x, w1, b1)), {16}, g), w2), target);
  }
  EXPECT_EQ(loss.dtype(), DType::float32);
  loss.backward();
  for (const Tensor& p : {x, w1, b1, g, w2}) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().dtype(), DType::float32);
    EXPECT_GT(max_abs(p.grad()), 0.0);
  }
}

TEST(Autocast, BackwardRunsInTheForwardDtype) {
  const Tensor x = data({4, 8}, 1), w = param({6, 8}, 0.3, 2);
  Tensor y;
  {
    AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
    y = linear(x, w);
  }
  // LinearBackward saved the bfloat16 input (for dW).
  const std::vector<Tensor> saved = testing::saved_by(y);
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_EQ(saved[0].dtype(), DType::bfloat16);
  // The weight's gradient is the product of the bfloat16 operands, written in float32 (the
  // cached cast declares a float32 gradient: LinearWeightGradientIsNeverRoundedTo16Bits), and
  // matches the float32 product to bfloat16 precision.
  sum(mul(y, 1.0)).backward();
  const Tensor gw = w.grad();
  ASSERT_EQ(gw.dtype(), DType::float32);
  const Tensor expect = ops::mm(ops::ones({6, 4}), x);
  EXPECT_LT(max_abs_diff(gw, expect), 1e-2 * max_abs(expect));
}

TEST(Autocast, WeightCastIsCachedOncePerRegionAndFreedAtExit) {
  const Tensor w = param({64, 64}, 0.1, 2);  // 64*64*2 bytes in bfloat16: one block
  const Tensor x = data({4, 64}, 1);
  ASSERT_EQ(cat_bytes(Category::autocast_cache), 0);
  const int64_t blocks_before = cat_blocks_allocated(Category::autocast_cache);
  {
    AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
    Tensor a = linear(x, w);
    Tensor b = linear(relu(a), w);  // the same weight again
    EXPECT_EQ(autocast_cache_size(), 1u);
    EXPECT_EQ(cat_blocks_allocated(Category::autocast_cache) - blocks_before, 1);
    EXPECT_GE(cat_bytes(Category::autocast_cache), 64 * 64 * 2);
    {
      AutocastGuard nested(DeviceType::cpu, DType::bfloat16);  // still the same region
      Tensor c = linear(x, w);
    }
    EXPECT_EQ(autocast_cache_size(), 1u);
    EXPECT_EQ(cat_blocks_allocated(Category::autocast_cache) - blocks_before, 1);
    // An in-place update bumps the version: the next use casts again.
    {
      NoGradGuard ng;
      ops::mul_(w, 1.0);
    }
    Tensor d = linear(x, w);
    EXPECT_EQ(cat_blocks_allocated(Category::autocast_cache) - blocks_before, 2);
    // Activations (not leaves) are cast each time, never cached.
    EXPECT_EQ(autocast_cache_size(), 1u);
  }
  EXPECT_EQ(autocast_cache_size(), 0u);
  EXPECT_EQ(cat_bytes(Category::autocast_cache), 0);
}

// autocast::cache_casts fills the cache in one multi-tensor copy: the ops then find every
// weight cached, and the outputs and gradients are the lazy casts', to the bit. A tensor
// listed twice (a tied weight) is cast once; what the ops would not cache (an activation, a
// float64 or frozen tensor) is skipped; a cast already cached is kept; outside a region,
// nothing happens.
TEST(Autocast, CacheCastsFillsTheCacheAsTheOpsWould) {
  const Tensor x = data({4, 16}, 1);
  auto run = [&](bool prefill, const TensorList& p) {
    AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
    if (prefill) {
      const int64_t blocks = cat_blocks_allocated(Category::autocast_cache);
      autocast::cache_casts({p[0], p[1], p[2], p[0], data({3}, 9)}, {"a", "a", "b", "a", "c"});
      EXPECT_EQ(autocast_cache_size(), 3u);
      EXPECT_EQ(cat_blocks_allocated(Category::autocast_cache) - blocks, 3);
    }
    const int64_t blocks = cat_blocks_allocated(Category::autocast_cache);
    Tensor y = linear(tanh(linear(x, p[0], p[1])), p[2]);
    // With the prefill the ops cast nothing more.
    EXPECT_EQ(cat_blocks_allocated(Category::autocast_cache) - blocks, prefill ? 0 : 3);
    EXPECT_EQ(autocast_cache_size(), 3u);
    return y;
  };
  const TensorList lazy = {param({16, 16}, 0.2, 3), param({16}, 0.1, 4), param({8, 16}, 0.2, 5)};
  TensorList pre;
  for (const Tensor& t : lazy) pre.push_back(param(t.sizes(), 0.0, 0));
  {
    NoGradGuard ng;
    for (size_t i = 0; i < lazy.size(); ++i) ops::copy_(pre[i], lazy[i]);
  }
  Tensor yl = run(false, lazy), yp = run(true, pre);
  EXPECT_EQ(max_abs_diff(yl, yp), 0.0);
  sum(yl).backward();
  sum(yp).backward();
  for (size_t i = 0; i < lazy.size(); ++i) {
    ASSERT_TRUE(pre[i].grad().defined()) << i;
    EXPECT_EQ(pre[i].grad().dtype(), DType::float32);
    EXPECT_EQ(max_abs_diff(lazy[i].grad(), pre[i].grad()), 0.0) << i;
  }
  // Skipped: float64, frozen; kept: an entry already cached; outside a region: nothing.
  {
    AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
    Tensor c = linear(x, pre[0]);  // caches pre[0]
    const int64_t blocks = cat_blocks_allocated(Category::autocast_cache);
    autocast::cache_casts(
        {pre[0], ops::to(pre[1], DType::float64).requires_grad_(), data({16, 16}, 2)});
    EXPECT_EQ(autocast_cache_size(), 1u);
    EXPECT_EQ(cat_blocks_allocated(Category::autocast_cache), blocks);
    testing::expect_error<std::invalid_argument>(
        [&] {
          autocast::cache_casts({pre[0]}, {"a", "b"});
        },
        {"autocast::cache_casts: 2 module names for 1 tensors"});
  }
  autocast::cache_casts({pre[0]});
  EXPECT_EQ(autocast_cache_size(), 0u);
  EXPECT_EQ(cat_bytes(Category::autocast_cache), 0);
}

// cache_casts records every weight's cast before the first op, yet each weight's gradient
// reaches its .grad as soon as its op's backward made it, as with a lazy cast: here w2's before
// the first linear's backward runs (so before x's), not with every weight at the end.
TEST(Autocast, PrefilledCastHandsTheGradientOnAsSoonAsReady) {
  const Tensor x = param({4, 16}, 0.3, 1);
  const Tensor w1 = param({16, 16}, 0.2, 3), w2 = param({8, 16}, 0.2, 5);
  std::vector<std::string> order;
  const std::vector<std::pair<Tensor, std::string>> leaves = {{x, "x"}, {w1, "w1"}, {w2, "w2"}};
  for (const auto& leaf : leaves) {
    const std::string n = leaf.second;
    autograd::register_post_accumulate_grad_hook(
        leaf.first, [&order, n](const Tensor&) { order.push_back(n); });
  }
  Tensor y;
  {
    AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
    autocast::cache_casts({w1, w2});
    y = linear(tanh(linear(x, w1)), w2);
  }
  sum(y).backward();
  ASSERT_EQ(order.size(), 3u);
  EXPECT_EQ(order[0], "w2");
}

// A cached weight cast declares a float32 gradient (autograd::grad_dtype), so linear's GEMM
// writes the weight's gradient in float32 from the bfloat16 operands: d(w) = g^T x, never
// rounded to 16 bits (a bfloat16 gradient converted after would be off by up to 2^-9).
TEST(Autocast, LinearWeightGradientIsNeverRoundedTo16Bits) {
  const Tensor w = param({3, 64}, 0.1, 7), b = param({3}, 0.1, 9);
  const Tensor x = data({256, 64}, 8);
  {
    AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
    const Tensor y = linear(x, w, b);
    EXPECT_EQ(autograd::grad_dtype(y), DType::bfloat16);
    sum(y).backward();
  }
  ASSERT_EQ(w.grad().dtype(), DType::float32);
  // The output's gradient is 1: d(w)[o, k] = the sum over rows of bfloat16(x)[r, k].
  const std::vector<double> ref =
      ops::to_vector(ops::sum(ops::to(ops::to(x, DType::bfloat16), DType::float64), {0}));
  const std::vector<double> got = ops::to_vector(w.grad());
  double err = 0, scale = 0, off16 = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double r = ref[i % ref.size()];
    err = std::max(err, std::abs(got[i] - r));
    scale = std::max(scale, std::abs(r));
    const double rounded =
        ops::to_vector(ops::to(ops::full({}, got[i], DType::float32, kCpu), DType::bfloat16))[0];
    off16 = std::max(off16, std::abs(rounded - got[i]));
  }
  EXPECT_LE(err, 1e-5 * scale);
  EXPECT_GT(off16, 1e-4 * scale) << "every gradient element is a bfloat16 value";
  EXPECT_EQ(b.grad().dtype(), DType::float32);
  EXPECT_TRUE(std::abs(ops::to_vector(b.grad())[0] - 256.0) < 1e-9);
}

TEST(Autocast, CacheCanBeDisabled) {
  const Tensor w = param({8, 8}, 0.1, 2);
  AutocastGuard guard(DeviceType::cpu, DType::bfloat16, true, /*cache_enabled=*/false);
  Tensor a = linear(data({2, 8}, 1), w);
  EXPECT_EQ(autocast_cache_size(), 0u);
}

// A three-layer MLP on a fixed classification problem, trained with plain SGD.
struct Mlp {
  TensorList params;
  explicit Mlp(uint64_t seed) {
    params = {param({32, 8}, 0.35, seed),      param({32}, 0.0, seed + 1),
              param({32, 32}, 0.18, seed + 2), param({32}, 0.0, seed + 3),
              param({4, 32}, 0.18, seed + 4),  param({4}, 0.0, seed + 5)};
  }
  Tensor forward(const Tensor& x) const {
    // tanh, not relu: a smooth network, so bfloat16 rounding cannot flip a unit on or off
    // and the gradients stay comparable element by element.
    Tensor h = tanh(linear(x, params[0], params[1]));
    h = tanh(linear(h, params[2], params[3]));
    return linear(h, params[4], params[5]);
  }
};

TEST(Autocast, MlpTrainsUnderBfloat16AndStaysCloseToFloat32) {
  const Tensor x = data({64, 8}, 11);
  // Labels from a fixed random linear map, so the problem is learnable.
  const Tensor teacher = data({4, 8}, 12);
  const Tensor y = ops::argmax(ops::matmul(x, ops::transpose(teacher, 0, 1)), 1);

  Mlp amp(100), ref(100);
  // One forward: autocast vs float32, same parameters.
  {
    NoGradGuard ng;
    const Tensor out32 = ref.forward(x);
    Tensor out16;
    {
      AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
      out16 = amp.forward(x);
    }
    EXPECT_EQ(out16.dtype(), DType::bfloat16);
    EXPECT_LT(max_abs_diff(out16, out32), 1e-2 * std::max(1.0, max_abs(out32)));
  }
  auto step = [&](Mlp& m, bool autocast) {
    for (Tensor& p : m.params) p.set_grad(Tensor());
    Tensor loss;
    {
      AutocastGuard guard(DeviceType::cpu, DType::bfloat16, autocast);
      loss = cross_entropy(m.forward(x), y);
    }
    loss.backward();
    NoGradGuard ng;
    for (Tensor& p : m.params) {
      EXPECT_EQ(p.grad().dtype(), DType::float32);
      ops::add_(p, p.grad(), -0.5);
    }
    return loss.item();
  };
  // The first step's gradients (same parameters): float32, and close to float32's.
  const double first = step(amp, true);
  step(ref, false);
  // (step already applied the update; the gradients are still there)
  for (size_t i = 0; i < amp.params.size(); ++i) {
    EXPECT_EQ(amp.params[i].grad().dtype(), DType::float32);
    EXPECT_LT(max_abs_diff(amp.params[i].grad(), ref.params[i].grad()),
              2e-2 * max_abs(ref.params[i].grad()))
        << "parameter " << i;
  }
  double last_amp = first, last_ref = 0;
  for (int i = 0; i < 30; ++i) {
    last_amp = step(amp, true);
    last_ref = step(ref, false);
  }
  EXPECT_LT(last_amp, 0.8 * first);
  EXPECT_NEAR(last_amp, last_ref, 0.05 * last_ref + 1e-2);
  for (const Tensor& p : amp.params) EXPECT_EQ(p.dtype(), DType::float32);
}

TEST(Autocast, ExcludeScopeTurnsItOff) {
  AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
  EXPECT_TRUE(autocast::is_active(kCpu));
  autocast::ExcludeScope exclude;
  EXPECT_FALSE(autocast::is_active(kCpu));
  EXPECT_EQ(linear(data({2, 3}, 1), param({4, 3}, 1.0, 2)).dtype(), DType::float32);
}

}  // namespace
}  // namespace tally
