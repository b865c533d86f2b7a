// The reduce family on CUDA against the CPU kernels (label gpu: skipped without a device):
// max/min with indices (first index on ties, NaN wins), amax/amin, argmax/argmin, var/std,
// logsumexp and the max/min backward scatter, over every dtype they take, every layout
// (contiguous and strided rows, several reduced dims, non-contiguous views) and each of the
// kernels' walks (a thread, a warp or a block per row); autograd through them.
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

// Values with many ties: 9 levels in [-2, 2] (floats), [-4, 4] (int32/int64), or 0/1 (bool),
// exactly representable in every dtype; with NaNs at about `nan_frac` of the elements.
Tensor tied(const Shape& s, DType d, uint64_t seed, double nan_frac = 0.0) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> level(-4, 4);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> v(static_cast<size_t>(shape_numel(s)));
  for (double& x : v) {
    const int l = level(rng);
    if (d == DType::bool_)
      x = l > 0 ? 1.0 : 0.0;
    else if (d == DType::int32 || d == DType::int64)
      x = l;
    else
      x = u(rng) < nan_frac ? std::numeric_limits<double>::quiet_NaN() : l * 0.5;
  }
  return ops::from_vector(v, s, d);
}

const DType kAll[] = {DType::float32, DType::float64, DType::float16, DType::bfloat16,
                      DType::int32,   DType::int64,   DType::bool_};

// A layout: the input is made as `base` (host and device alike) and viewed through `view`.
struct Layout {
  const char* what;
  Shape base;
  std::function<Tensor(const Tensor&)> view;
};

Tensor id(const Tensor& t) {
  return t;
}

std::vector<Layout> layouts() {
  return {
      {"[5, 7]", {5, 7}, id},
      {"[3, 50257]", {3, 50257}, id},
      {"[37, 1500]", {37, 1500}, id},
      {"[2000, 3]", {2000, 3}, id},
      {"[3000, 40]", {3000, 40}, id},
      {"[4, 5, 33]", {4, 5, 33}, id},
      {"transpose of [33, 20]", {33, 20}, [](const Tensor& t) { return ops::transpose(t, 0, 1); }},
      {"transpose of [1100, 9]",
       {1100, 9},
       [](const Tensor& t) { return ops::transpose(t, 0, 1); }},
      {"permuted [6, 7, 8] -> [8, 6, 7]",
       {6, 7, 8},
       [](const Tensor& t) {
         return ops::permute(t, {2, 0, 1});
       }},
      {"every other column of [6, 154]",
       {6, 154},
       [](const Tensor& t) { return ops::slice(t, 1, 0, 154, 2); }},
      {"offset rows 2..6 of [7, 40]",
       {7, 40},
       [](const Tensor& t) { return ops::slice(t, 0, 2, 6); }},
      {"[1, 1]", {1, 1}, id},
      {"0-D", {}, id},
  };
}

// ------------------------------------------------------------------ selections

TEST(CudaReduce, MaxMinAlongADimMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 1;
  for (const Layout& l : layouts()) {
    for (DType d : kAll) {
      const Tensor base = tied(l.base, d, ++seed);
      const Tensor xc = l.view(base), xg = l.view(to_gpu(base));
      const int64_t rank = xc.dim();
      for (int64_t dim = rank == 0 ? 0 : -rank; dim < std::max<int64_t>(rank, 1); ++dim) {
        for (bool keepdim : {false, true}) {
          std::ostringstream what;
          what << l.what << " " << dtype_name(d) << " dim " << dim << " keepdim " << keepdim;
          for (bool is_max : {true, false}) {
            const ValuesIndices c =
                is_max ? ops::max(xc, dim, keepdim) : ops::min(xc, dim, keepdim);
            const ValuesIndices g =
                is_max ? ops::max(xg, dim, keepdim) : ops::min(xg, dim, keepdim);
            const char* name = is_max ? "max " : "min ";
            EXPECT_TRUE(close_pointwise(g.values, c.values, 0.0)) << name << what.str();
            EXPECT_TRUE(close_pointwise(g.indices, c.indices, 0.0))
                << name << "indices " << what.str();
            const Tensor ac =
                is_max ? ops::argmax(xc, dim, keepdim) : ops::argmin(xc, dim, keepdim);
            const Tensor ag =
                is_max ? ops::argmax(xg, dim, keepdim) : ops::argmin(xg, dim, keepdim);
            EXPECT_TRUE(close_pointwise(ag, ac, 0.0))
                << (is_max ? "argmax " : "argmin ") << what.str();
          }
        }
      }
    }
  }
}

TEST(CudaReduce, NaNsWinWithTheirFirstIndex) {
  REQUIRE_GPU();
  uint64_t seed = 50;
  for (const Layout& l : layouts()) {
    for (DType d : kFloatDtypes) {
      const Tensor base = tied(l.base, d, ++seed, 0.02);
      const Tensor xc = l.view(base), xg = l.view(to_gpu(base));
      for (int64_t dim = 0; dim < std::max<int64_t>(xc.dim(), 1); ++dim) {
        std::ostringstream what;
        what << l.what << " " << dtype_name(d) << " dim " << dim;
        const ValuesIndices c = ops::max(xc, dim), g = ops::max(xg, dim);
        EXPECT_TRUE(close_pointwise(g.values, c.values, 0.0)) << "max " << what.str();
        EXPECT_TRUE(close_pointwise(g.indices, c.indices, 0.0)) << "max indices " << what.str();
        const ValuesIndices cm = ops::min(xc, dim), gm = ops::min(xg, dim);
        EXPECT_TRUE(close_pointwise(gm.indices, cm.indices, 0.0)) << "min indices " << what.str();
        EXPECT_TRUE(close_pointwise(ops::amax(xg, {dim}), ops::amax(xc, {dim}), 0.0))
            << "amax " << what.str();
      }
      EXPECT_TRUE(close_pointwise(ops::argmax(xg), ops::argmax(xc), 0.0))
          << l.what << " " << dtype_name(d);
      EXPECT_TRUE(close_pointwise(ops::max(xg), ops::max(xc), 0.0))
          << l.what << " " << dtype_name(d);
    }
  }
  // A row of NaNs only, and signed zeros (equal: the first is kept, bit for bit).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor x = ops::from_vector({nan, nan, nan, 0.0, -0.0, 0.0, -0.0, 0.0, -1.0}, {3, 3});
  for (int64_t dim : {0, 1}) {
    const ValuesIndices c = ops::max(x, dim), g = ops::max(to_gpu(x), dim);
    EXPECT_TRUE(close_pointwise(g.indices, c.indices, 0.0)) << dim;
    const ValuesIndices cm = ops::min(x, dim), gm = ops::min(to_gpu(x), dim);
    EXPECT_TRUE(close_pointwise(gm.indices, cm.indices, 0.0)) << dim;
    const std::vector<double> v = ops::to_vector(gm.values), w = ops::to_vector(cm.values);
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isnan(w[i])) {
        EXPECT_EQ(std::signbit(v[i]), std::signbit(w[i])) << dim << " " << i;
      }
  }
}

TEST(CudaReduce, FlatArgmaxAndFullMaxMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (const Layout& l : layouts()) {
    for (DType d : kAll) {
      const Tensor base = tied(l.base, d, ++seed);
      const Tensor xc = l.view(base), xg = l.view(to_gpu(base));
      std::ostringstream what;
      what << l.what << " " << dtype_name(d);
      EXPECT_TRUE(close_pointwise(ops::argmax(xg), ops::argmax(xc), 0.0))
          << "argmax " << what.str();
      EXPECT_TRUE(close_pointwise(ops::argmin(xg), ops::argmin(xc), 0.0))
          << "argmin " << what.str();
      EXPECT_TRUE(close_pointwise(ops::max(xg), ops::max(xc), 0.0)) << "max " << what.str();
      EXPECT_TRUE(close_pointwise(ops::min(xg), ops::min(xc), 0.0)) << "min " << what.str();
    }
  }
}

// Several dim lists for a tensor of `rank` (every single dim, pairs, all, none = all).
std::vector<Shape> dim_lists(int64_t rank) {
  std::vector<Shape> out = {{}};
  for (int64_t d = 0; d < rank; ++d) out.push_back({d});
  if (rank >= 2) out.push_back({0, rank - 1});
  if (rank >= 3) out.push_back({-1, 1});
  if (rank >= 2) {
    Shape all;
    for (int64_t d = 0; d < rank; ++d) all.push_back(d);
    out.push_back(all);
  }
  return out;
}

std::string dims_str(const Shape& dims) {
  return shape_str(dims);
}

TEST(CudaReduce, AmaxAminMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 200;
  for (const Layout& l : layouts()) {
    for (DType d : kAll) {
      const Tensor base = tied(l.base, d, ++seed);
      const Tensor xc = l.view(base), xg = l.view(to_gpu(base));
      for (const Shape& dims : dim_lists(xc.dim())) {
        for (bool keepdim : {false, true}) {
          std::ostringstream what;
          what << l.what << " " << dtype_name(d) << " dims " << dims_str(dims) << " keepdim "
               << keepdim;
          EXPECT_TRUE(
              close_pointwise(ops::amax(xg, dims, keepdim), ops::amax(xc, dims, keepdim), 0.0))
              << "amax " << what.str();
          EXPECT_TRUE(
              close_pointwise(ops::amin(xg, dims, keepdim), ops::amin(xc, dims, keepdim), 0.0))
              << "amin " << what.str();
        }
      }
    }
  }
}

// ------------------------------------------------------------------ statistics

TEST(CudaReduce, VarStdMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 300;
  for (const Layout& l : layouts()) {
    for (DType d : kFloatDtypes) {
      const Tensor base = rand_tensor(l.base, d, ++seed, -3, 5);
      const Tensor xc = l.view(base), xg = l.view(to_gpu(base));
      for (const Shape& dims : dim_lists(xc.dim())) {
        for (double correction : {1.0, 0.0, 2.5}) {
          for (bool keepdim : {false, true}) {
            std::ostringstream what;
            what << l.what << " " << dtype_name(d) << " dims " << dims_str(dims) << " correction "
                 << correction << " keepdim " << keepdim;
            EXPECT_TRUE(close_pointwise(ops::var(xg, dims, correction, keepdim),
                                        ops::var(xc, dims, correction, keepdim), pointwise_tol(d)))
                << "var " << what.str();
            EXPECT_TRUE(close_pointwise(ops::std(xg, dims, correction, keepdim),
                                        ops::std(xc, dims, correction, keepdim), pointwise_tol(d)))
                << "std " << what.str();
          }
        }
      }
    }
  }
  // Divisor 0 (inf or NaN, as the CPU), and an offset mean (two passes stay accurate).
  const Tensor one = ops::from_vector({3.0, 4.0}, {2, 1});
  EXPECT_TRUE(close_pointwise(ops::var(to_gpu(one), {1}), ops::var(one, {1}), 0.0));
  EXPECT_TRUE(close_pointwise(ops::var(to_gpu(one), {0}, 2.0), ops::var(one, {0}, 2.0), 0.0));
  const Tensor offset =
      ops::to(ops::affine(rand_tensor({4, 999}, DType::float64, 333), 1.0, 1e4), DType::float32);
  EXPECT_TRUE(close_pointwise(ops::var(to_gpu(offset), {1}), ops::var(offset, {1}), 1e-5));
}

TEST(CudaReduce, LogsumexpMatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 400;
  for (const Layout& l : layouts()) {
    for (DType d : kFloatDtypes) {
      const Tensor base = rand_tensor(l.base, d, ++seed, -10, 10);
      const Tensor xc = l.view(base), xg = l.view(to_gpu(base));
      for (const Shape& dims : dim_lists(xc.dim())) {
        for (bool keepdim : {false, true}) {
          std::ostringstream what;
          what << l.what << " " << dtype_name(d) << " dims " << dims_str(dims) << " keepdim "
               << keepdim;
          EXPECT_TRUE(close_pointwise(ops::logsumexp(xg, dims, keepdim),
                                      ops::logsumexp(xc, dims, keepdim), pointwise_tol(d)))
              << "logsumexp " << what.str();
        }
      }
    }
  }
  // Infinities, NaN, an empty reduction (-inf), an integer input (computed in float32).
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor x = ops::from_vector({-inf, -inf, -inf, 1000, 1001, -inf, inf, 1, 2, nan, 1, 2},
                                    {4, 3}, DType::float32);
  EXPECT_TRUE(close_pointwise(ops::logsumexp(to_gpu(x), {1}), ops::logsumexp(x, {1}), 1e-5));
  const Tensor empty = ops::zeros({3, 0}, DType::float32);
  EXPECT_TRUE(close_pointwise(ops::logsumexp(to_gpu(empty), {1}), ops::logsumexp(empty, {1}), 0.0));
  const Tensor ints = tied({5, 9}, DType::int64, 444);
  EXPECT_TRUE(close_pointwise(ops::logsumexp(to_gpu(ints), {1}), ops::logsumexp(ints, {1}), 1e-5));
}

// ------------------------------------------------------------------ backward

TEST(CudaReduce, ValueSelectingBackwardMatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 500;
  for (const Layout& l : layouts()) {
    for (DType d : kFloatDtypes) {
      const Tensor xc = l.view(tied(l.base, d, ++seed));
      for (int64_t dim = 0; dim < std::max<int64_t>(xc.dim(), 1); ++dim) {
        for (bool keepdim : {false, true}) {
          std::ostringstream what;
          what << l.what << " " << dtype_name(d) << " dim " << dim << " keepdim " << keepdim;
          const Tensor idx = ops::max(xc, dim, keepdim).indices;
          const Tensor g = rand_tensor(idx.sizes(), d, ++seed);
          const Tensor rc =
              ops::value_selecting_reduction_backward(g, idx, xc.sizes(), dim, keepdim);
          const Tensor rg = ops::value_selecting_reduction_backward(to_gpu(g), to_gpu(idx),
                                                                    xc.sizes(), dim, keepdim);
          EXPECT_TRUE(close_pointwise(rg, rc, 0.0)) << what.str();
        }
      }
    }
  }
  // A non-contiguous grad and indices (transposed views).
  const Tensor x = tied({9, 6, 5}, DType::float32, 555);
  const Tensor idx = ops::contiguous(ops::transpose(ops::argmax(x, 1, true), 0, 2));  // [5, 1, 9]
  const Tensor g = rand_tensor({5, 1, 9}, DType::float32, 556);
  const Tensor it = ops::transpose(idx, 0, 2), gt = ops::transpose(g, 0, 2);  // [9, 1, 5]
  EXPECT_TRUE(close_pointwise(
      ops::value_selecting_reduction_backward(
          ops::transpose(to_gpu(g), 0, 2), ops::transpose(to_gpu(idx), 0, 2), {9, 6, 5}, 1, true),
      ops::value_selecting_reduction_backward(gt, it, {9, 6, 5}, 1, true), 0.0));
}

// The device cannot throw for an index outside the dim without a host sync: that entry is
// skipped (its gradient stays 0).
TEST(CudaReduce, OutOfRangeIndexIsSkippedOnTheDevice) {
  REQUIRE_GPU();
  const Tensor idx = to_gpu(ops::from_vector({0, 7, 2}, {3}, DType::int64));
  const Tensor g = to_gpu(ops::from_vector({1, 2, 3}, {3}, DType::float32));
  const std::vector<double> r =
      ops::to_vector(ops::value_selecting_reduction_backward(g, idx, {3, 4}, 1, false));
  const std::vector<double> want = {1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0};
  EXPECT_EQ(r, want);
}

// ------------------------------------------------------------------ autograd

TEST(CudaAutograd, ReductionGradientsMatchTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 600;
  for (DType d : {DType::float32, DType::float64}) {
    for (int which = 0; which < 7; ++which) {
      Tensor xc = which < 3 ? tied({7, 130}, d, ++seed) : rand_tensor({7, 130}, d, ++seed);
      Tensor xg = to_gpu(xc);
      xc.requires_grad_();
      xg.requires_grad_();
      const Tensor wc = rand_tensor({130}, d, ++seed), wg = to_gpu(wc);
      auto f = [which](const Tensor& x, const Tensor& w) -> Tensor {
        switch (which) {
          case 0:
            return tally::sum(tally::max(x, 1).values);
          case 1:
            return tally::sum(tally::mul(tally::min(x.transpose(0, 1), 1, true).values, 3.0));
          case 2:
            return tally::sum(tally::amax(x, {0}));
          case 3:
            return tally::sum(tally::var(tally::mul(x, w), {1}));
          case 4:
            return tally::sum(tally::std(x, {0}, 0.0));
          case 5:
            return tally::sum(tally::logsumexp(tally::mul(x, w), {1}));
          default:
            return tally::max(tally::mul(x, w));
        }
      };
      const Tensor lc = f(xc, wc), lg = f(xg, wg);
      EXPECT_TRUE(close_pointwise(lg, lc, pointwise_tol(d))) << which << " " << dtype_name(d);
      lc.backward();
      lg.backward();
      ASSERT_TRUE(xg.grad().defined()) << which;
      EXPECT_TRUE(close_pointwise(xg.grad(), xc.grad(), pointwise_tol(d)))
          << which << " " << dtype_name(d);
    }
  }
}

TEST(CudaReduce, OutputsAreTaggedNeverUnknown) {
  REQUIRE_GPU();
  memory::CachingAllocator& alloc = memory::get_allocator(kGpu);
  const Tensor x = to_gpu(rand_tensor({64, 300}, DType::float32, 700));
  const size_t before = memory::memory_allocated(kGpu);
  alloc.record_memory_history(true);
  {
    const ValuesIndices m = ops::max(x, 1);
    const Tensor v = ops::var(x, {0});
    const Tensor s = ops::logsumexp(x, {1});
    EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::unknown).current, 0);
  }
  const auto history = alloc.history();
  alloc.record_memory_history(false);
  std::set<std::string> ops_seen;
  for (const auto& e : history) {
    if (e.action != memory::TraceAction::alloc) continue;
    EXPECT_EQ(e.tag.category, memory::Category::temporary) << memory::interned(e.tag.op);
    ops_seen.insert(memory::interned(e.tag.op));
  }
  EXPECT_EQ(ops_seen, (std::set<std::string>{"max", "var", "logsumexp"}));
  EXPECT_EQ(memory::memory_allocated(kGpu), before);
}

}  // namespace
}  // namespace tally
