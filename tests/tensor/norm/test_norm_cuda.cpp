// layer_norm, rms_norm and batch_norm on CUDA against the CPU kernels (label gpu: skipped
// without a device). Every raw op forward and backward (dx, dweight, dbias) on fresh random
// data: float32, float64, and float16/bfloat16 inputs with float32 parameters; odd row
// lengths, 2-D/3-D/4-D batch_norm, running statistics after training steps, non-contiguous
// inputs, empty batches, and where the kernels' scratch lands in the allocator.
//
// Errors are max |gpu - cpu| / max |cpu| over a tensor (both read back as float64); for dx,
// whose terms can cancel (batch_norm over 2 values gives dx ~ 0), the denominator is at
// least the size of its terms, max |dy| * max |weight| * max |rstd|.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>

#include "tensor/norm/autograd.h"
#include "tensor/norm/ops.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using testing::both;
using testing::kFloatDtypes;
using testing::kGpu;
using testing::Pair;
using testing::rand_tensor;

// Tolerances relative to max |reference|: elementwise-ish results (out, dx, per-row or
// per-channel statistics) and reductions over many rows (layer_norm's dweight, dbias).
struct Tol {
  double elem, red;
};
Tol tol_for(DType d) {
  switch (d) {
    case DType::float32:
      return {1e-5, 1e-4};
    case DType::float64:
      return {1e-12, 1e-11};
    default:
      return {2e-2, 2e-2};
  }
}

// Parameters (weight, bias, running stats) are float32 for 16-bit inputs.
DType param_dtype(DType d) {
  return d == DType::float64 ? DType::float64 : DType::float32;
}

std::string shape_dtype(const Tensor& t) {
  return t.shape_string() + " " + dtype_name(t.dtype());
}

// max |t| (0 for an undefined or empty tensor).
double max_abs(const Tensor& t) {
  double m = 0;
  if (t.defined())
    for (double v : ops::to_vector(t)) m = std::max(m, std::abs(v));
  return m;
}

// gpu (on the device) against cpu: same definedness, shape and dtype, and
// max |gpu - cpu| <= tol * max(max |cpu|, floor); the failure names the worst element.
::testing::AssertionResult close(const Tensor& gpu, const Tensor& cpu, double tol,
                                 const std::string& what, double floor = 0) {
  if (gpu.defined() != cpu.defined())
    return ::testing::AssertionFailure()
           << what << ": defined on gpu " << gpu.defined() << ", on cpu " << cpu.defined();
  if (!gpu.defined()) return ::testing::AssertionSuccess();
  if (!gpu.is_cuda())
    return ::testing::AssertionFailure() << what << ": result is on " << gpu.device().str();
  if (gpu.sizes() != cpu.sizes() || gpu.dtype() != cpu.dtype())
    return ::testing::AssertionFailure()
           << what << ": gpu " << shape_dtype(gpu) << " vs cpu " << shape_dtype(cpu);
  const std::vector<double> a = ops::to_vector(gpu), b = ops::to_vector(cpu);
  double max_ref = 0, max_diff = 0;
  size_t worst = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i]) || std::isinf(a[i]) != std::isinf(b[i]))
      return ::testing::AssertionFailure() << what << ": element " << i << " gpu " << a[i]
                                           << " cpu " << b[i] << " (" << shape_dtype(cpu) << ")";
    if (std::isnan(b[i]) || std::isinf(b[i])) continue;
    max_ref = std::max(max_ref, std::abs(b[i]));
    const double diff = std::abs(a[i] - b[i]);
    if (diff > max_diff) {
      max_diff = diff;
      worst = i;
    }
  }
  const double denom = std::max(max_ref, floor);
  const double rel = denom > 0 ? max_diff / denom : max_diff;
  if (rel <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": relative error " << rel << " > " << tol << " (" << shape_dtype(cpu)
         << ", max|ref| " << max_ref << ", floor " << floor << ", worst at flat index " << worst
         << ": gpu " << a[worst] << " vs cpu " << b[worst] << ")";
}

Pair undefined_both() {
  return {Tensor(), Tensor()};
}

// The size of dx's terms: max |dy| * max |weight| (1 without) * max |rstd or invstd|.
double dx_floor(const Tensor& dy, const Tensor& w, const Tensor& rstd) {
  return max_abs(dy) * (w.defined() ? max_abs(w) : 1.0) * max_abs(rstd);
}

std::string label(const char* op, const Shape& s, DType d, const char* extra = "") {
  std::ostringstream o;
  o << op << " " << shape_str(s) << " " << dtype_name(d) << extra;
  return o.str();
}

// ---------------------------------------------------------------- layer_norm / rms_norm

// Forward and backward of layer_norm (rms = false) or rms_norm (rms = true) on x of shape
// xs normalized over its last `k` dims, for every output mask of the backward.
void check_row_norm(bool rms, const Shape& xs, size_t k, DType d, bool affine, bool with_bias,
                    bool noncontig, uint64_t seed) {
  const char* op = rms ? "rms_norm" : "layer_norm";
  const std::string where = label(op, xs, d, noncontig ? " noncontig" : "") +
                            (affine ? " affine" : "") + (with_bias ? " bias" : "");
  SCOPED_TRACE(where);
  const Tol tol = tol_for(d);
  const DType pd = param_dtype(d);
  const Shape ns(xs.end() - static_cast<std::ptrdiff_t>(k), xs.end());
  const Pair x = both(xs, d, seed, noncontig);
  const Pair w = affine ? both(ns, pd, seed + 1, false, 0.5, 1.5) : undefined_both();
  const Pair b = with_bias ? both(ns, pd, seed + 2, false, -1, 1) : undefined_both();
  const Pair dy = both(xs, d, seed + 3, noncontig);

  Tensor mean_c, mean_g, rstd_c, rstd_g;
  if (rms) {
    const double eps = 1e-6;
    auto [oc, rc] = ops::rms_norm(x.cpu, ns, w.cpu, eps);
    auto [og, rg] = ops::rms_norm(x.gpu, ns, w.gpu, eps);
    EXPECT_TRUE(close(og, oc, tol.elem, "out"));
    EXPECT_TRUE(close(rg, rc, tol.elem, "rstd"));
    rstd_c = rc;
    rstd_g = rg;
    // default eps (the dtype's machine epsilon)
    EXPECT_TRUE(close(std::get<0>(ops::rms_norm(x.gpu, ns, w.gpu)),
                      std::get<0>(ops::rms_norm(x.cpu, ns, w.cpu)), tol.elem, "out (default eps)"));
    for (std::array<bool, 2> mask :
         {std::array<bool, 2>{true, true}, {true, false}, {false, true}}) {
      SCOPED_TRACE(::testing::Message() << "mask " << mask[0] << mask[1]);
      auto [dxc, dwc] = ops::rms_norm_backward(dy.cpu, x.cpu, ns, rstd_c, w.cpu, mask);
      auto [dxg, dwg] = ops::rms_norm_backward(dy.gpu, x.gpu, ns, rstd_g, w.gpu, mask);
      EXPECT_TRUE(close(dxg, dxc, tol.elem, "dx", dx_floor(dy.cpu, w.cpu, rstd_c)));
      EXPECT_TRUE(close(dwg, dwc, tol.red, "dweight"));
    }
    return;
  }
  auto [oc, mc, rc] = ops::layer_norm(x.cpu, ns, w.cpu, b.cpu, 1e-5);
  auto [og, mg, rg] = ops::layer_norm(x.gpu, ns, w.gpu, b.gpu, 1e-5);
  EXPECT_TRUE(close(og, oc, tol.elem, "out"));
  EXPECT_TRUE(close(mg, mc, tol.elem, "mean"));
  EXPECT_TRUE(close(rg, rc, tol.elem, "rstd"));
  for (std::array<bool, 3> mask : {std::array<bool, 3>{true, true, true},
                                   {true, false, false},
                                   {false, true, false},
                                   {false, false, true},
                                   {false, true, true}}) {
    SCOPED_TRACE(::testing::Message() << "mask " << mask[0] << mask[1] << mask[2]);
    auto [dxc, dwc, dbc] = ops::layer_norm_backward(dy.cpu, x.cpu, ns, mc, rc, w.cpu, mask);
    auto [dxg, dwg, dbg] = ops::layer_norm_backward(dy.gpu, x.gpu, ns, mg, rg, w.gpu, mask);
    EXPECT_TRUE(close(dxg, dxc, tol.elem, "dx", dx_floor(dy.cpu, w.cpu, rc)));
    EXPECT_TRUE(close(dwg, dwc, tol.red, "dweight"));
    EXPECT_TRUE(close(dbg, dbc, tol.red, "dbias"));
  }
}

TEST(CudaLayerNorm, MatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (DType d : kFloatDtypes) {
    // GPT-2 rows, odd row lengths, one row, several normalized dims
    check_row_norm(false, {4, 16, 768}, 1, d, true, true, false, seed += 10);
    check_row_norm(false, {37, 50}, 1, d, true, true, false, seed += 10);
    check_row_norm(false, {29, 3}, 1, d, true, true, false, seed += 10);
    check_row_norm(false, {1, 333}, 1, d, true, false, false, seed += 10);
    check_row_norm(false, {6, 5, 7, 9}, 2, d, true, true, false, seed += 10);
    // no affine; bias only
    check_row_norm(false, {13, 100}, 1, d, false, false, false, seed += 10);
    check_row_norm(false, {13, 100}, 1, d, false, true, false, seed += 10);
    // non-contiguous input and grad_output
    check_row_norm(false, {24, 65}, 1, d, true, true, true, seed += 10);
  }
}

TEST(CudaLayerNorm, ManyRowsAndLongRows) {
  REQUIRE_GPU();
  // Many more rows than blocks (each block accumulates dweight/dbias over several rows).
  check_row_norm(false, {4100, 50}, 1, DType::float32, true, true, false, 1);
  check_row_norm(false, {9001, 3}, 1, DType::float32, true, true, false, 2);
  check_row_norm(false, {2048, 768}, 1, DType::float32, true, true, false, 3);
  check_row_norm(false, {2048, 768}, 1, DType::bfloat16, true, true, false, 4);
  check_row_norm(false, {3000, 129}, 1, DType::float64, true, true, false, 5);
  // Rows too long for the shared-memory accumulators (float32 > 4096, float64 > 2048).
  check_row_norm(false, {70, 5000}, 1, DType::float32, true, true, false, 6);
  check_row_norm(false, {70, 3001}, 1, DType::float64, true, true, false, 7);
  check_row_norm(false, {33, 4500}, 1, DType::float16, true, true, false, 8);
}

TEST(CudaRmsNorm, MatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 500;
  for (DType d : kFloatDtypes) {
    check_row_norm(true, {4, 16, 768}, 1, d, true, false, false, seed += 10);
    check_row_norm(true, {37, 50}, 1, d, true, false, false, seed += 10);
    check_row_norm(true, {29, 3}, 1, d, true, false, false, seed += 10);
    check_row_norm(true, {6, 5, 7, 9}, 2, d, true, false, false, seed += 10);
    check_row_norm(true, {13, 100}, 1, d, false, false, false, seed += 10);
    check_row_norm(true, {24, 65}, 1, d, true, false, true, seed += 10);
  }
  check_row_norm(true, {4100, 50}, 1, DType::float32, true, false, false, 1);
  check_row_norm(true, {70, 5000}, 1, DType::float32, true, false, false, 2);
  check_row_norm(true, {70, 3001}, 1, DType::float64, true, false, false, 3);
}

TEST(CudaLayerNorm, EmptyInputs) {
  REQUIRE_GPU();
  // No rows: empty out and statistics, zero dweight/dbias.
  const Tensor x = ops::zeros({0, 8}, DType::float32, kGpu);
  const Tensor w = ops::to(rand_tensor({8}, DType::float32, 1, 0.5, 1.5), kGpu, DType::float32);
  auto [out, mean, rstd] = ops::layer_norm(x, {8}, w, w);
  EXPECT_EQ(out.sizes(), (Shape{0, 8}));
  EXPECT_EQ(mean.sizes(), (Shape{0, 1}));
  auto [dx, dw, db] = ops::layer_norm_backward(x, x, {8}, mean, rstd, w, {true, true, true});
  EXPECT_EQ(dx.sizes(), (Shape{0, 8}));
  EXPECT_TRUE(close(dw, ops::zeros({8}), 0, "dweight of no rows"));
  EXPECT_TRUE(close(db, ops::zeros({8}), 0, "dbias of no rows"));
  auto [rdx, rdw] = ops::rms_norm_backward(x, x, {8}, rstd, w, {true, true});
  EXPECT_TRUE(close(rdw, ops::zeros({8}), 0, "rms dweight of no rows"));
  // Empty rows: mean 0, rstd 1 / sqrt(eps), as the CPU.
  const Tensor xe = ops::zeros({3, 0}, DType::float32, kGpu);
  auto [oe, me, re] = ops::layer_norm(xe, {0}, {}, {}, 1e-4);
  auto [oc, mc, rc] = ops::layer_norm(ops::zeros({3, 0}), {0}, {}, {}, 1e-4);
  EXPECT_TRUE(close(me, mc, 1e-6, "mean of empty rows"));
  EXPECT_TRUE(close(re, rc, 1e-6, "rstd of empty rows"));
}

// ---------------------------------------------------------------- batch_norm

// Training forward (with running statistics, two steps), training backward for every
// output mask, eval forward and eval backward, on x of shape xs.
void check_batch_norm(const Shape& xs, DType d, bool affine, bool noncontig, uint64_t seed) {
  SCOPED_TRACE(label("batch_norm", xs, d, noncontig ? " noncontig" : "") +
               (affine ? " affine" : ""));
  const Tol tol = tol_for(d);
  const DType pd = param_dtype(d);
  const int64_t c = xs[1];
  const Pair x = both(xs, d, seed, noncontig);
  const Pair w = affine ? both({c}, pd, seed + 1, false, 0.5, 1.5) : undefined_both();
  const Pair b = affine ? both({c}, pd, seed + 2, false, -1, 1) : undefined_both();
  const Pair dy = both(xs, d, seed + 3, noncontig);
  // Running statistics: separate copies on each side, updated in place.
  const Pair rm = both({c}, pd, seed + 4, false, -0.5, 0.5);
  const Pair rv = both({c}, pd, seed + 5, false, 0.5, 1.5);

  // ---- training forward, two steps (momentum 0.1, then 0.5)
  auto [oc, mc, ic] = ops::batch_norm(x.cpu, rm.cpu, rv.cpu, w.cpu, b.cpu, true, 0.1, 1e-5);
  auto [og, mg, ig] = ops::batch_norm(x.gpu, rm.gpu, rv.gpu, w.gpu, b.gpu, true, 0.1, 1e-5);
  EXPECT_TRUE(close(og, oc, tol.elem, "train out"));
  EXPECT_TRUE(close(mg, mc, tol.elem, "batch mean"));
  EXPECT_TRUE(close(ig, ic, tol.elem, "batch invstd"));
  EXPECT_TRUE(close(rm.gpu, rm.cpu, tol.elem, "running_mean after step 1"));
  EXPECT_TRUE(close(rv.gpu, rv.cpu, tol.elem, "running_var after step 1"));
  ops::batch_norm(x.cpu, rm.cpu, rv.cpu, w.cpu, b.cpu, true, 0.5, 1e-5);
  ops::batch_norm(x.gpu, rm.gpu, rv.gpu, w.gpu, b.gpu, true, 0.5, 1e-5);
  EXPECT_TRUE(close(rm.gpu, rm.cpu, tol.elem, "running_mean after step 2"));
  EXPECT_TRUE(close(rv.gpu, rv.cpu, tol.elem, "running_var after step 2"));
  // without running statistics
  EXPECT_TRUE(close(std::get<0>(ops::batch_norm(x.gpu, {}, {}, w.gpu, b.gpu, true)),
                    std::get<0>(ops::batch_norm(x.cpu, {}, {}, w.cpu, b.cpu, true)), tol.elem,
                    "train out (no running stats)"));

  // ---- training backward
  for (std::array<bool, 3> mask : {std::array<bool, 3>{true, true, true},
                                   {true, false, false},
                                   {false, true, false},
                                   {false, false, true},
                                   {false, true, true}}) {
    SCOPED_TRACE(::testing::Message() << "train mask " << mask[0] << mask[1] << mask[2]);
    auto [dxc, dwc, dbc] = ops::batch_norm_backward(dy.cpu, x.cpu, mc, ic, w.cpu, true, mask);
    auto [dxg, dwg, dbg] = ops::batch_norm_backward(dy.gpu, x.gpu, mg, ig, w.gpu, true, mask);
    EXPECT_TRUE(close(dxg, dxc, tol.elem, "dx", dx_floor(dy.cpu, w.cpu, ic)));
    EXPECT_TRUE(close(dwg, dwc, tol.elem, "dweight"));
    EXPECT_TRUE(close(dbg, dbc, tol.elem, "dbias"));
  }

  // ---- eval forward and backward (running statistics as constants)
  auto [eoc, emc, eic] = ops::batch_norm(x.cpu, rm.cpu, rv.cpu, w.cpu, b.cpu, false, 0.1, 1e-5);
  auto [eog, emg, eig] = ops::batch_norm(x.gpu, rm.gpu, rv.gpu, w.gpu, b.gpu, false, 0.1, 1e-5);
  EXPECT_TRUE(close(eog, eoc, tol.elem, "eval out"));
  EXPECT_TRUE(close(emg, emc, tol.elem, "eval mean"));
  EXPECT_TRUE(close(eig, eic, tol.elem, "eval invstd"));
  EXPECT_TRUE(close(rm.gpu, rm.cpu, tol.elem, "running_mean after eval"));
  for (std::array<bool, 3> mask : {std::array<bool, 3>{true, true, true}, {false, true, false}}) {
    SCOPED_TRACE(::testing::Message() << "eval mask " << mask[0] << mask[1] << mask[2]);
    auto [dxc, dwc, dbc] = ops::batch_norm_backward(dy.cpu, x.cpu, emc, eic, w.cpu, false, mask);
    auto [dxg, dwg, dbg] = ops::batch_norm_backward(dy.gpu, x.gpu, emg, eig, w.gpu, false, mask);
    EXPECT_TRUE(close(dxg, dxc, tol.elem, "eval dx"));
    EXPECT_TRUE(close(dwg, dwc, tol.elem, "eval dweight"));
    EXPECT_TRUE(close(dbg, dbc, tol.elem, "eval dbias"));
  }
  // eval dx and dbias need neither the input nor the mean
  {
    SCOPED_TRACE("eval mask 101, no input");
    auto [dxc, dwc, dbc] = ops::batch_norm_backward(dy.cpu, Tensor(), Tensor(), eic, w.cpu, false,
                                                    {true, false, true});
    auto [dxg, dwg, dbg] = ops::batch_norm_backward(dy.gpu, Tensor(), Tensor(), eig, w.gpu, false,
                                                    {true, false, true});
    EXPECT_TRUE(close(dxg, dxc, tol.elem, "eval dx"));
    EXPECT_FALSE(dwg.defined());
    EXPECT_TRUE(close(dbg, dbc, tol.elem, "eval dbias"));
  }
}

TEST(CudaBatchNorm, MatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 1000;
  for (DType d : kFloatDtypes) {
    check_batch_norm({37, 5}, d, true, false, seed += 10);         // 2-D
    check_batch_norm({64, 130}, d, true, false, seed += 10);       // 2-D, many channels
    check_batch_norm({5, 6, 33}, d, true, false, seed += 10);      // 3-D
    check_batch_norm({4, 7, 9, 11}, d, true, false, seed += 10);   // 4-D, odd sizes
    check_batch_norm({4, 7, 9, 11}, d, false, false, seed += 10);  // no affine
    check_batch_norm({3, 6, 5, 7}, d, true, true, seed += 10);     // non-contiguous
    check_batch_norm({2, 3, 1, 1}, d, true, false, seed += 10);    // 2 values a channel
    check_batch_norm({4, 6, 4, 8}, d, true, false, seed += 10);    // planes of 32: 4-element packs
    check_batch_norm({3, 5, 2, 2}, d, false, false, seed += 10);   // planes of 4: one pack a plane
  }
}

TEST(CudaBatchNorm, LargeChannels) {
  REQUIRE_GPU();
  // Channels of tens of thousands of elements (split over several blocks each).
  check_batch_norm({8, 3, 64, 65}, DType::float32, true, false, 1);
  check_batch_norm({8, 3, 64, 65}, DType::float64, true, false, 2);
  check_batch_norm({8, 3, 64, 65}, DType::bfloat16, true, false, 3);
  check_batch_norm({16, 64, 28, 28}, DType::float32, true, false, 4);
  check_batch_norm({4096, 3}, DType::float32, true, false, 5);
  // A channel whose values sit far from zero (the one-pass variance is shifted).
  const Tensor xc = ops::add(rand_tensor({6, 4, 17, 19}, DType::float32, 6), 1000.0);
  const Tensor xg = ops::to(xc, kGpu, DType::float32);
  auto [oc, mc, ic] = ops::batch_norm(xc, {}, {}, {}, {}, true);
  auto [og, mg, ig] = ops::batch_norm(xg, {}, {}, {}, {}, true);
  EXPECT_TRUE(close(mg, mc, 1e-6, "mean of offset data"));
  EXPECT_TRUE(close(ig, ic, 1e-4, "invstd of offset data"));
  EXPECT_TRUE(close(og, oc, 1e-3, "out of offset data"));
}

TEST(CudaBatchNorm, EmptyBatch) {
  REQUIRE_GPU();
  for (const Shape& s : {Shape{0, 3}, Shape{0, 3, 4, 4}}) {
    SCOPED_TRACE(shape_str(s));
    const Tensor x = ops::zeros(s, DType::float32, kGpu);
    const Tensor rm = ops::to(rand_tensor({3}, DType::float32, 1), kGpu, DType::float32);
    const Tensor rv = ops::to(rand_tensor({3}, DType::float32, 2, 0.5, 1.5), kGpu, DType::float32);
    const std::vector<double> rm0 = ops::to_vector(rm), rv0 = ops::to_vector(rv);
    const Tensor w = ops::ones({3}, DType::float32, kGpu);
    auto [out, mean, invstd] = ops::batch_norm(x, rm, rv, w, {}, true);
    EXPECT_EQ(out.sizes(), s);
    EXPECT_EQ(ops::to_vector(rm), rm0);  // nothing to learn from
    EXPECT_EQ(ops::to_vector(rv), rv0);
    auto [oc, mc, ic] = ops::batch_norm(ops::zeros(s), {}, {}, {}, {}, true);
    EXPECT_TRUE(close(mean, mc, 1e-6, "mean of an empty batch"));
    EXPECT_TRUE(close(invstd, ic, 1e-6, "invstd of an empty batch"));
    auto [dx, dw, db] = ops::batch_norm_backward(x, x, mean, invstd, w, true, {true, true, true});
    EXPECT_EQ(dx.sizes(), s);
    EXPECT_TRUE(close(dw, ops::zeros({3}), 0, "dweight of an empty batch"));
    EXPECT_TRUE(close(db, ops::zeros({3}), 0, "dbias of an empty batch"));
  }
}

// ---------------------------------------------------------------- autograd and memory

TEST(CudaNorm, AutogradMatchesTheCpu) {
  REQUIRE_GPU();
  // layer_norm -> batch_norm over a [N, C, L] view, through the differentiable ops.
  const Tensor xc0 = rand_tensor({6, 5, 40}, DType::float32, 1);
  const Tensor wc0 = rand_tensor({40}, DType::float32, 2, 0.5, 1.5),
               bc0 = rand_tensor({40}, DType::float32, 3);
  const Tensor gc0 = rand_tensor({5}, DType::float32, 4, 0.5, 1.5),
               hc0 = rand_tensor({5}, DType::float32, 5);
  auto run = [&](Device dev) {
    auto leaf = [&](const Tensor& t) {
      Tensor l = ops::to(t, dev, t.dtype(), /*copy=*/true);
      l.requires_grad_(true);
      return l;
    };
    const Tensor x = leaf(xc0), w = leaf(wc0), b = leaf(bc0), g = leaf(gc0), h = leaf(hc0);
    const Tensor rm = ops::zeros({5}, DType::float32, dev),
                 rv = ops::ones({5}, DType::float32, dev);
    const Tensor y = batch_norm(layer_norm(x, {40}, w, b), rm, rv, g, h, true);
    tally::sum(tally::mul(y, tally::tanh(y))).backward();
    return std::vector<Tensor>{y.detach(), x.grad(), w.grad(), b.grad(),
                               g.grad(),   h.grad(), rm,       rv};
  };
  const std::vector<Tensor> c = run(Device::cpu()), gpu = run(kGpu);
  const char* names[] = {"out",        "dx",       "dweight",      "dbias",
                         "bn dweight", "bn dbias", "running_mean", "running_var"};
  for (size_t i = 0; i < c.size(); ++i) EXPECT_TRUE(close(gpu[i], c[i], 1e-4, names[i]));
}

TEST(CudaNorm, ScratchIsTemporaryUnderTheOpAndFreed) {
  REQUIRE_GPU();
  memory::CachingAllocator& alloc = memory::get_allocator(kGpu);
  const Tensor x = ops::to(rand_tensor({64, 768}, DType::float32, 1), kGpu, DType::float32);
  const Tensor w = ops::to(rand_tensor({768}, DType::float32, 2, 0.5, 1.5), kGpu, DType::float32);
  const Tensor xb = ops::to(rand_tensor({8, 16, 9, 9}, DType::float32, 3), kGpu, DType::float32);
  const Tensor wb = ops::to(rand_tensor({16}, DType::float32, 4, 0.5, 1.5), kGpu, DType::float32);
  const Tensor rm = ops::zeros({16}, DType::float32, kGpu),
               rv = ops::ones({16}, DType::float32, kGpu);
  const int64_t temp0 = alloc.stats().cat_bytes(memory::Category::temporary).current;
  alloc.record_memory_history(true);
  {
    auto [out, mean, rstd] = ops::layer_norm(x, {768}, w, w);
    auto grads = ops::layer_norm_backward(x, x, {768}, mean, rstd, w, {true, true, true});
    auto [bo, bm, bi] = ops::batch_norm(xb, rm, rv, wb, wb, true);
    auto bgrads = ops::batch_norm_backward(xb, xb, bm, bi, wb, true, {true, true, true});
    (void)grads;
    (void)bgrads;
  }
  const auto history = alloc.history();
  alloc.record_memory_history(false);
  // Every allocation is tagged; blocks allocated and freed inside an op are its scratch.
  std::set<uint64_t> freed;
  for (const auto& e : history)
    if (e.action == memory::TraceAction::free_requested) freed.insert(e.addr);
  std::set<std::string> ops_with_scratch;
  size_t layer_norm_scratch = 0;
  for (const auto& e : history) {
    if (e.action != memory::TraceAction::alloc) continue;
    EXPECT_NE(e.tag.category, memory::Category::unknown) << memory::interned(e.tag.op);
    if (e.tag.category == memory::Category::temporary && freed.count(e.addr)) {
      const std::string op = memory::interned(e.tag.op);
      ops_with_scratch.insert(op);
      if (op == "layer_norm_backward") layer_norm_scratch = std::max(layer_norm_scratch, e.size);
    }
  }
  EXPECT_TRUE(ops_with_scratch.count("layer_norm_backward"));
  EXPECT_TRUE(ops_with_scratch.count("batch_norm"));
  EXPECT_TRUE(ops_with_scratch.count("batch_norm_backward"));
  // At least one partial [2][768] float row per block.
  EXPECT_GE(layer_norm_scratch, 2 * 768 * sizeof(float));
  // Outputs and scratch all released: the temporary bytes are back where they were.
  EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::temporary).current, temp0);
  EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::unknown).current, 0);
}

// Throughput of the kernels (not a check; run with --gtest_also_run_disabled_tests).
// Times `iters` calls, each ended by a read-back of one element (a sync), and prints the
// bytes the op must move (read x/dy once, write out/dx once) per second.
TEST(CudaNorm, DISABLED_Throughput) {
  REQUIRE_GPU();
  auto time_ms = [](auto&& fn) {
    fn();
    const auto sync = [] { (void)ops::item(ops::zeros({1}, DType::float32, kGpu)); };
    sync();
    const int iters = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) fn();
    sync();
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::milli>(t1 - t0).count() / iters;
  };
  for (DType d : {DType::float32, DType::bfloat16}) {
    const Shape xs{16 * 1024, 768};
    const Tensor x = ops::to(rand_tensor(xs, d, 1), kGpu, d),
                 dy = ops::to(rand_tensor(xs, d, 2), kGpu, d);
    const Tensor w = ops::to(rand_tensor({768}, DType::float32, 3), kGpu, DType::float32);
    const double bytes = static_cast<double>(x.nbytes());
    auto [o, m, r] = ops::layer_norm(x, {768}, w, w);
    (void)o;
    const double f = time_ms([&] { ops::layer_norm(x, {768}, w, w); });
    const double b = time_ms([&] {
      ops::layer_norm_backward(dy, x, {768}, m, r, w, {true, true, true});
    });
    std::printf("layer_norm %s [16384, 768]: fwd %.3f ms (%.0f GB/s), bwd %.3f ms (%.0f GB/s)\n",
                dtype_name(d), f, 2 * bytes / f / 1e6, b, 3 * bytes / b / 1e6);
    const Shape bs{64, 256, 56, 56};
    const Tensor bx = ops::to(rand_tensor(bs, d, 4), kGpu, d),
                 bdy = ops::to(rand_tensor(bs, d, 5), kGpu, d);
    const Tensor bw = ops::to(rand_tensor({256}, DType::float32, 6), kGpu, DType::float32);
    const Tensor rm = ops::zeros({256}, DType::float32, kGpu),
                 rv = ops::ones({256}, DType::float32, kGpu);
    const double bbytes = static_cast<double>(bx.nbytes());
    auto [bo, bm, bi] = ops::batch_norm(bx, rm, rv, bw, bw, true);
    (void)bo;
    const double bf = time_ms([&] { ops::batch_norm(bx, rm, rv, bw, bw, true); });
    const double bb = time_ms([&] {
      ops::batch_norm_backward(bdy, bx, bm, bi, bw, true, {true, true, true});
    });
    std::printf(
        "batch_norm %s [64, 256, 56, 56]: train fwd %.3f ms (%.0f GB/s), bwd %.3f ms (%.0f GB/s)\n",
        dtype_name(d), bf, 3 * bbytes / bf / 1e6, bb, 5 * bbytes / bb / 1e6);
  }
}

}  // namespace
}  // namespace tally
