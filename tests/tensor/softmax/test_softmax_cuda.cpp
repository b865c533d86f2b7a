// The softmax family on CUDA against the CPU kernels (label gpu: skipped without a device):
// softmax/log_softmax forward and backward over any dim and layout (each of the kernels'
// walks: a thread, a warp or a block per row, contiguous or strided rows), the fused
// cross_entropy and nll_loss with their backwards (ignored targets, label smoothing, every
// reduction, the spatial [N, C, d] form), autograd through them, and where the memory goes.
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <sstream>

#include "testing/cuda_testing.h"

namespace tally {
namespace {

using testing::close_pointwise;
using testing::kFloatDtypes;
using testing::kGpu;
using testing::pointwise_tol;
using testing::rand_tensor;
using testing::to_gpu;

using ops::LossReduction;

// int64 class indices in [0, C) of shape s; about `ignore_frac` of them set to ignore_index.
Tensor targets(const Shape& s, int64_t C, uint64_t seed, double ignore_frac = 0.0,
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

// ------------------------------------------------------------------ softmax

// A softmax case: the input is made as `base` (on the device and on the host alike), then
// viewed through `view` (which may make it non-contiguous), and reduced along `dim`.
struct SoftmaxCase {
  const char* what;
  Shape base;
  int64_t dim;
  std::function<Tensor(const Tensor&)> view;
};

std::vector<SoftmaxCase> softmax_cases() {
  auto id = [](const Tensor& t) { return t; };
  return {
      {"[5, 7] dim 1 (warp a row)", {5, 7}, 1, id},
      {"[5, 7] dim 0 (strided rows, warp)", {5, 7}, 0, id},
      {"[3, 50257] dim -1 (block a row, GPT vocabulary)", {3, 50257}, -1, id},
      {"[37, 1500] dim 0 (strided rows, column tiles, last tile partial)", {37, 1500}, 0, id},
      {"[3000, 40] dim 0 (strided long rows, column tiles)", {3000, 40}, 0, id},
      {"[3, 50257] dim 0 (short strided rows, thread a row)", {3, 50257}, 0, id},
      {"[2000, 3] dim 0 (strided long rows, block)", {2000, 3}, 0, id},
      {"[4, 5, 33] dim 1 (middle dim, column tiles with fewer elements than lanes)",
       {4, 5, 33},
       1,
       id},
      {"transpose of [33, 20], dim 0 (non-contiguous, stride-1 rows)",
       {33, 20},
       0,
       [](const Tensor& t) { return ops::transpose(t, 0, 1); }},
      {"transpose of [33, 20], dim 1 (non-contiguous)",
       {33, 20},
       1,
       [](const Tensor& t) { return ops::transpose(t, 0, 1); }},
      {"transpose of [1100, 9], dim 0 (non-contiguous, stride-1 rows, warp)",
       {1100, 9},
       0,
       [](const Tensor& t) { return ops::transpose(t, 0, 1); }},
      {"transpose of [9, 1100], dim 1 (non-contiguous, thread a row)",
       {9, 1100},
       1,
       [](const Tensor& t) { return ops::transpose(t, 0, 1); }},
      {"every other column of [6, 154], dim 1 (stride 2)",
       {6, 154},
       1,
       [](const Tensor& t) { return ops::slice(t, 1, 0, 154, 2); }},
      {"offset slice of [7, 40], rows 2..6, dim 1",
       {7, 40},
       1,
       [](const Tensor& t) { return ops::slice(t, 0, 2, 6); }},
      {"[1, 1] dim 1 (one element)", {1, 1}, 1, id},
      {"0-D", {}, 0, id},
  };
}

TEST(CudaSoftmax, ForwardMatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 1;
  for (const SoftmaxCase& c : softmax_cases()) {
    for (DType d : kFloatDtypes) {
      const Tensor base = rand_tensor(c.base, d, ++seed, -4, 4);
      const Tensor xc = c.view(base), xg = c.view(to_gpu(base));
      for (bool log : {false, true}) {
        const Tensor yc = log ? ops::log_softmax(xc, c.dim) : ops::softmax(xc, c.dim);
        const Tensor yg = log ? ops::log_softmax(xg, c.dim) : ops::softmax(xg, c.dim);
        EXPECT_TRUE(close_pointwise(yg, yc, pointwise_tol(d)))
            << (log ? "log_softmax " : "softmax ") << c.what << " " << dtype_name(d);
      }
    }
  }
}

TEST(CudaSoftmax, BackwardMatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (const SoftmaxCase& c : softmax_cases()) {
    for (DType d : kFloatDtypes) {
      const Tensor xc = c.view(rand_tensor(c.base, d, ++seed, -4, 4));
      const Tensor gbase = rand_tensor(c.base, d, ++seed);
      const Tensor gc = c.view(gbase), gg = c.view(to_gpu(gbase));  // grad in the view's layout
      for (bool log : {false, true}) {
        const Tensor yc = log ? ops::log_softmax(xc, c.dim) : ops::softmax(xc, c.dim);
        const Tensor yg = to_gpu(yc);  // the same forward output on both sides
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

TEST(CudaSoftmax, ExtremeValuesMatchTheCpu) {
  REQUIRE_GPU();
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
    const Tensor yg = log ? ops::log_softmax(to_gpu(x), 1) : ops::softmax(to_gpu(x), 1);
    EXPECT_TRUE(close_pointwise(yg, yc, 1e-5)) << (log ? "log_softmax" : "softmax");
  }
}

// ------------------------------------------------------------------ losses

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
  auto id = [](const Tensor& t) { return t; };
  return {
      {"[64, 7] (warp a row)", {64, 7}, id, {64}, 7},
      {"[6, 50257] (block a row, GPT vocabulary)", {6, 50257}, id, {6}, 50257},
      {"[3, 1500] (block a row)", {3, 1500}, id, {3}, 1500},
      {"spatial [3, 5, 17] (strided class dim, column tiles)", {3, 5, 17}, id, {3, 17}, 5},
      {"spatial [2, 40, 300] (column tiles)", {2, 40, 300}, id, {2, 300}, 40},
      {"spatial [2, 5, 600] (thread a row)", {2, 5, 600}, id, {2, 600}, 5},
      {"spatial [4, 3, 4000] (two-level loss sum)", {4, 3, 4000}, id, {4, 4000}, 3},
      {"spatial [2, 3, 4, 5]", {2, 3, 4, 5}, id, {2, 4, 5}, 3},
      {"transpose of [33, 40] (non-contiguous [40, 33])",
       {33, 40},
       [](const Tensor& t) { return ops::transpose(t, 0, 1); },
       {40},
       33},
      {"every other class of [10, 26] (stride 2)",
       {10, 26},
       [](const Tensor& t) { return ops::slice(t, 1, 0, 26, 2); },
       {10},
       13},
      {"unbatched [11]", {11}, id, {}, 11},
  };
}

const LossReduction kReductions[] = {LossReduction::none, LossReduction::sum, LossReduction::mean};

// The gradient a loss's backward takes: the target's shape (none) or 0-D.
Tensor loss_grad(const LossCase& c, LossReduction r, DType d, uint64_t seed) {
  if (r == LossReduction::none) return rand_tensor(c.target, d, seed, -1.5, 1.5);
  return ops::full({}, 0.75, d);
}

TEST(CudaCrossEntropy, ForwardAndBackwardMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 200;
  for (const LossCase& c : loss_cases()) {
    for (DType d : kFloatDtypes) {
      const Tensor base = rand_tensor(c.base, d, ++seed, -5, 5);
      const Tensor xc = c.view(base), xg = c.view(to_gpu(base));
      // ignore_index -100 on ~25% of the rows, or a valid class (2) used as ignore_index.
      for (int64_t ignore : {int64_t{-100}, int64_t{2}}) {
        const Tensor tc = targets(c.target, c.classes, ++seed, ignore == -100 ? 0.25 : 0.0, ignore);
        const Tensor tg = to_gpu(tc);
        for (double eps : {0.0, 0.1}) {
          for (LossReduction r : kReductions) {
            std::ostringstream what;
            what << c.what << " " << dtype_name(d) << " ignore_index " << ignore
                 << " label_smoothing " << eps << " reduction " << red_name(r);
            const Tensor lc = ops::cross_entropy(xc, tc, ignore, eps, r);
            const Tensor lg = ops::cross_entropy(xg, tg, ignore, eps, r);
            EXPECT_TRUE(close_pointwise(lg, lc, pointwise_tol(d)))
                << "cross_entropy " << what.str();
            const Tensor g = loss_grad(c, r, d, ++seed);
            const Tensor bc = ops::cross_entropy_backward(g, xc, tc, ignore, eps, r);
            const Tensor bg = ops::cross_entropy_backward(to_gpu(g), xg, tg, ignore, eps, r);
            EXPECT_TRUE(close_pointwise(bg, bc, pointwise_tol(d)))
                << "cross_entropy_backward " << what.str();
          }
        }
      }
    }
  }
}

// The saved log-sum-exp and the float32 loss of 16-bit logits (autocast) against the CPU, on
// class counts whose rows start at every 16-byte misalignment (unaligned head, 16-byte packs,
// tail); the backward from the lse equals the one that recomputes the statistics.
TEST(CudaCrossEntropy, SavedLseAndFloat32LossMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 900;
  for (DType d : kFloatDtypes) {
    const bool low = d == DType::float16 || d == DType::bfloat16;
    const std::optional<DType> loss_dtype =
        low ? std::optional<DType>(DType::float32) : std::nullopt;
    const DType ld = loss_dtype.value_or(d);
    for (int64_t C : {int64_t{7}, int64_t{1003}, int64_t{8195}}) {
      const Tensor x = rand_tensor({37, C}, d, ++seed, -6, 6);
      const Tensor t = targets({37}, C, ++seed, 0.2);
      const Tensor xg = to_gpu(x), tg = to_gpu(t);
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
        const Tensor bg = ops::cross_entropy_backward(to_gpu(g), xg, tg, -100, 0.0, r, rg.lse);
        EXPECT_TRUE(close_pointwise(bg, bc, pointwise_tol(d))) << "backward " << what;
        // A gradient whose rows are not 16-byte aligned like the logits' (scalar write path).
        const Tensor xo = ops::narrow(to_gpu(rand_tensor({37, C + 1}, d, ++seed, -6, 6)), 1, 1, C);
        const ops::CrossEntropyOutput ro =
            ops::cross_entropy_with_lse(xo, tg, -100, 0.0, r, loss_dtype);
        EXPECT_TRUE(close_pointwise(
            ops::cross_entropy_backward(to_gpu(g), xo, tg, -100, 0.0, r, ro.lse),
            ops::cross_entropy_backward(g, ops::to(xo, Device::cpu(), d), t, -100, 0.0, r),
            pointwise_tol(d)))
            << "offset backward " << what;
      }
    }
  }
}

TEST(CudaCrossEntropy, AllTargetsIgnored) {
  REQUIRE_GPU();
  for (DType d : {DType::float32, DType::bfloat16}) {
    const Tensor x = rand_tensor({8, 50}, d, 300);
    const Tensor t = ops::full({8}, -100, DType::int64);
    const Tensor xg = to_gpu(x), tg = to_gpu(t);
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
        const Tensor bg = ops::cross_entropy_backward(to_gpu(g), xg, tg, -100, eps, r);
        EXPECT_TRUE(close_pointwise(bg, ops::zeros({8, 50}, d), 0.0)) << red_name(r);
        EXPECT_TRUE(close_pointwise(bg, ops::cross_entropy_backward(g, x, t, -100, eps, r), 0.0));
      }
      const Tensor nm = ops::nll_loss(xg, tg, -100, LossReduction::mean);
      EXPECT_TRUE(std::isnan(ops::item(nm)));
      const Tensor nb = ops::nll_loss_backward(to_gpu(ops::full({}, 1.0, d)), {8, 50}, tg, -100,
                                               LossReduction::mean);
      EXPECT_TRUE(close_pointwise(nb, ops::zeros({8, 50}, d), 0.0));
    }
  }
}

TEST(CudaCrossEntropy, EmptyBatch) {
  REQUIRE_GPU();
  const Tensor x = ops::zeros({0, 5}, DType::float32, kGpu);
  const Tensor t = ops::zeros({0}, DType::int64, kGpu);
  EXPECT_TRUE(std::isnan(ops::item(ops::cross_entropy(x, t))));
  EXPECT_EQ(ops::item(ops::cross_entropy(x, t, -100, 0.0, LossReduction::sum)), 0.0);
  EXPECT_EQ(ops::cross_entropy(x, t, -100, 0.0, LossReduction::none).numel(), 0);
  EXPECT_EQ(ops::cross_entropy_backward(ops::full({}, 1.0, DType::float32, kGpu), x, t, -100, 0.0,
                                        LossReduction::mean)
                .numel(),
            0);
}

// The device cannot throw for a bad target without a host sync: the row's loss is NaN
// (the mean with it), and its gradient row is NaN.
TEST(CudaCrossEntropy, OutOfRangeTargetGivesNaNOnTheDevice) {
  REQUIRE_GPU();
  const Tensor x = to_gpu(rand_tensor({3, 6}, DType::float32, 310));
  const Tensor t = to_gpu(ops::from_vector({1, 6, 2}, {3}, DType::int64));
  const std::vector<double> none =
      ops::to_vector(ops::cross_entropy(x, t, -100, 0.0, LossReduction::none));
  EXPECT_FALSE(std::isnan(none[0]));
  EXPECT_TRUE(std::isnan(none[1]));
  EXPECT_FALSE(std::isnan(none[2]));
  EXPECT_TRUE(std::isnan(ops::item(ops::cross_entropy(x, t))));
  const std::vector<double> g = ops::to_vector(ops::cross_entropy_backward(
      ops::full({}, 1.0, DType::float32, kGpu), x, t, -100, 0.0, LossReduction::mean));
  for (int c = 0; c < 6; ++c) EXPECT_TRUE(std::isnan(g[static_cast<size_t>(6 + c)])) << c;
  EXPECT_TRUE(std::isnan(ops::item(ops::nll_loss(x, t))));
}

TEST(CudaNllLoss, ForwardAndBackwardMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 400;
  for (const LossCase& c : loss_cases()) {
    for (DType d : kFloatDtypes) {
      const Tensor base = rand_tensor(c.base, d, ++seed, -5, 0);
      const Tensor xc = c.view(base), xg = c.view(to_gpu(base));
      for (int64_t ignore : {int64_t{-100}, int64_t{1}}) {
        const Tensor tc = targets(c.target, c.classes, ++seed, ignore == -100 ? 0.3 : 0.0, ignore);
        const Tensor tg = to_gpu(tc);
        for (LossReduction r : kReductions) {
          std::ostringstream what;
          what << c.what << " " << dtype_name(d) << " ignore_index " << ignore << " reduction "
               << red_name(r);
          EXPECT_TRUE(close_pointwise(ops::nll_loss(xg, tg, ignore, r),
                                      ops::nll_loss(xc, tc, ignore, r), pointwise_tol(d)))
              << "nll_loss " << what.str();
          const Tensor g = loss_grad(c, r, d, ++seed);
          EXPECT_TRUE(close_pointwise(ops::nll_loss_backward(to_gpu(g), xc.sizes(), tg, ignore, r),
                                      ops::nll_loss_backward(g, xc.sizes(), tc, ignore, r),
                                      pointwise_tol(d)))
              << "nll_loss_backward " << what.str();
        }
      }
    }
  }
}

// ------------------------------------------------------------------ autograd

// Leaves on both devices holding the same values.
std::pair<Tensor, Tensor> leaves(const Shape& s, DType d, uint64_t seed, double lo, double hi) {
  Tensor c = rand_tensor(s, d, seed, lo, hi);
  Tensor g = to_gpu(c);
  c.requires_grad_();
  g.requires_grad_();
  return {c, g};
}

TEST(CudaAutograd, CrossEntropyBackwardMatchesTheCpu) {
  REQUIRE_GPU();
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
      const Tensor tc = targets(c.t, c.C, ++seed, 0.2), tg = to_gpu(tc);
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
      EXPECT_EQ(xg.grad().device(), kGpu);
      EXPECT_TRUE(close_pointwise(xg.grad(), xc.grad(), pointwise_tol(d)))
          << c.reduction << " " << dtype_name(d);
    }
  }
}

TEST(CudaAutograd, SoftmaxLogSoftmaxNllBackwardMatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 600;
  for (DType d : {DType::float32, DType::float64}) {
    auto [xc, xg] = leaves({12, 130}, d, ++seed, -3, 3);
    const Tensor wc = rand_tensor({12, 130}, d, ++seed), wg = to_gpu(wc);
    const Tensor tc = targets({12}, 130, ++seed, 0.2), tg = to_gpu(tc);
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

TEST(CudaCrossEntropy, ScratchIsTaggedAndReleased) {
  REQUIRE_GPU();
  memory::CachingAllocator& alloc = memory::get_allocator(kGpu);
  const int64_t rows = 4096, C = 100;
  const Tensor x = to_gpu(rand_tensor({rows, C}, DType::float32, 700));
  const Tensor t = to_gpu(targets({rows}, C, 701, 0.1));
  const Tensor one = ops::full({}, 1.0, DType::float32, kGpu);
  // Many rows: the loss sum takes two levels (a second scratch buffer).
  const Tensor xs = to_gpu(rand_tensor({4, 3, 4000}, DType::float32, 702));
  const Tensor ts = to_gpu(targets({4, 4000}, 3, 703, 0.1));
  const size_t before = memory::memory_allocated(kGpu);
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
  EXPECT_EQ(memory::memory_allocated(kGpu), before);
}

}  // namespace
}  // namespace tally
