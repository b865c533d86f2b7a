// group_norm (ops::group_norm_forward / group_norm_backward, tally::group_norm and its node
// NativeGroupNormBackward0), one file for every device (tests/testing/devices.h). On each
// device: values against the composite (layer_norm over the groups, then the affine) in
// float64, float64 gradient checks (affine or not, 3-D and 4-D), what backward saves, the
// output dtype beside float32 parameters and under autocast (the cast fused, bit for bit the
// two ops), the composite kept for other parameter dtypes, and errors naming op and shapes.
//
// On CUDA only, against the CPU kernels: forward (out, mean, rstd) and backward for every
// output mask on float32, float64 and float16/bfloat16 inputs with float32 parameters, and
// 16-bit inputs with a float32 output and gradient (autocast's cast fused); odd planes (7,
// 5x5: one element at a time), packed planes, one channel a group and many, misaligned and
// non-contiguous inputs, and the U-Net's [128, 128, 32, 32] in bfloat16.
#include <array>
#include <optional>
#include <string>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "nn/functional.h"
#include "tensor/norm/autograd.h"
#include "tensor/norm/ops.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace testing;

class GroupNormOp : public OnDevice {};
TALLY_ON_DEVICES(GroupNormOp);

// The composite the fused op replaces, in x's dtype: layer_norm over each (sample, group),
// then weight and bias per channel.
Tensor composite(const Tensor& x, int64_t groups, const Tensor& w, const Tensor& b, double eps) {
  const int64_t n = x.sizes()[0], c = x.sizes()[1];
  const int64_t per = x.numel() / (n * groups);
  auto [y, m, r] = ops::layer_norm(ops::reshape(x, {n, groups, per}), {per}, {}, {}, eps);
  y = ops::reshape(y, x.sizes());
  Shape pc(static_cast<size_t>(x.dim()), 1);
  pc[1] = c;
  if (w.defined()) y = ops::mul(y, ops::reshape(w, pc));
  if (b.defined()) y = ops::add(y, ops::reshape(b, pc));
  return y;
}

TEST_P(GroupNormOp, ValuesAreTheComposites) {
  for (const Shape& xs : {Shape{2, 6, 7}, Shape{3, 4, 2, 3}, Shape{2, 6}}) {
    SCOPED_TRACE(shape_str(xs));
    const Tensor x = put(rand_tensor(xs, DType::float64, 1));
    const Tensor w = put(rand_tensor({xs[1]}, DType::float64, 2, 0.5, 1.5));
    const Tensor b = put(rand_tensor({xs[1]}, DType::float64, 3));
    const int64_t g = xs[1] / 2;
    auto [out, mean, rstd] = ops::group_norm_forward(x, w, b, g, 1e-5);
    EXPECT_EQ(out.sizes(), xs);
    EXPECT_EQ(mean.sizes(), (Shape{xs[0], g}));
    EXPECT_EQ(rstd.dtype(), DType::float64);
    const std::vector<double> got = ops::to_vector(out),
                              ref = ops::to_vector(composite(x, g, w, b, 1e-5));
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-12) << i;
    // No affine.
    const std::vector<double> plain =
        ops::to_vector(std::get<0>(ops::group_norm_forward(x, {}, {}, g)));
    const std::vector<double> plain_ref = ops::to_vector(composite(x, g, {}, {}, 1e-5));
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(plain[i], plain_ref[i], 1e-12) << i;
  }
}

TEST_P(GroupNormOp, Gradients) {
  Tensor x3 = rand_tensor({2, 6, 5}, DType::float64, 1);
  Tensor x4 = rand_tensor({2, 4, 3, 3}, DType::float64, 2);
  Tensor w6 = rand_tensor({6}, DType::float64, 3, 0.5, 1.5),
         b6 = rand_tensor({6}, DType::float64, 4);
  Tensor w4 = rand_tensor({4}, DType::float64, 5, 0.5, 1.5),
         b4 = rand_tensor({4}, DType::float64, 6);
  for (Tensor* t : {&x3, &x4, &w6, &b6, &w4, &b4}) t->requires_grad_(true);
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return group_norm(t[0], 3, t[1], t[2]); }, {x3, w6, b6}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& t) { return group_norm(t[0], 2); }, {x3}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& t) { return group_norm(t[0], 2, t[1], t[2]); }, {x4, w4, b4}));
  EXPECT_TRUE(gradcheck_on(dev(), [](const TensorList& t) { return group_norm(t[0], 4); }, {x4}));
  EXPECT_TRUE(
      gradcheck_on(dev(), [](const TensorList& t) { return group_norm(t[0], 1, t[1]); }, {x4, w4}));
  // Parameters only (the input a constant), and bias only.
  const Tensor xc = put(x4.detach());
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& t) { return group_norm(xc, 2, t[0], t[1]); }, {w4, b4}));
  EXPECT_TRUE(
      gradcheck_on(dev(), [&](const TensorList& t) { return group_norm(xc, 2, {}, t[0]); }, {b4}));
}

TEST_P(GroupNormOp, SavesInputAndStatisticsNotOutput) {
  const Tensor x = leaf(rand_tensor({2, 4, 3}, DType::float32, 1));
  const Tensor w = leaf(rand_tensor({4}, DType::float32, 2, 0.5, 1.5));
  const Tensor b = leaf(rand_tensor({4}, DType::float32, 3));
  const Tensor out = nn::functional::group_norm(x, 2, w, b);
  EXPECT_EQ(out.autograd_meta()->grad_fn->name(), "NativeGroupNormBackward0");
  const std::vector<Tensor> saved = saved_by(out);
  ASSERT_EQ(saved.size(), 4u);  // x, mean, rstd, weight
  EXPECT_TRUE(saved[0].storage().is_same(x.storage()));
  EXPECT_EQ(saved[1].sizes(), (Shape{2, 2}));
  EXPECT_EQ(saved[2].sizes(), (Shape{2, 2}));
  EXPECT_TRUE(saved[3].storage().is_same(w.storage()));
  // Only bias requires grad: nothing saved.
  EXPECT_TRUE(saved_by(group_norm(x.detach(), 2, w.detach(), b)).empty());
}

// Float32 parameters beside a 16-bit input give the input's dtype (PyTorch's mixed type), the
// values of the float32 computation rounded; under autocast the op runs in float32.
TEST_P(GroupNormOp, DtypesAndAutocast) {
  const Tensor x32 = put(rand_tensor({2, 8, 5}, DType::float32, 1));
  const Tensor w = put(rand_tensor({8}, DType::float32, 2, 0.5, 1.5));
  const Tensor b = put(rand_tensor({8}, DType::float32, 3));
  for (DType d : {DType::bfloat16, DType::float16}) {
    SCOPED_TRACE(dtype_name(d));
    const Tensor x = ops::to(x32, d);
    const Tensor out = nn::functional::group_norm(x, 4, w, b);
    EXPECT_EQ(out.dtype(), d);
    const std::vector<double> got = ops::to_vector(out),
                              ref = ops::to_vector(
                                  composite(ops::to(x, DType::float32), 4, w, b, 1e-5));
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 2e-2 * 4) << i;
    AutocastGuard autocast(dev().type, DType::bfloat16);
    EXPECT_EQ(nn::functional::group_norm(x, 4, w, b).dtype(), DType::float32);
  }
  // A float64 weight beside a float32 input: not the fused op's; the composite promotes.
  const Tensor w64 = ops::to(w, DType::float64);
  EXPECT_FALSE(ops::group_norm_fast_path_applies(x32, w64, b));
  EXPECT_TRUE(ops::group_norm_fast_path_applies(ops::to(x32, DType::bfloat16), w, b));
  EXPECT_EQ(nn::functional::group_norm(x32, 4, w64, b).dtype(), DType::float64);
}

// Under autocast a 16-bit input is read as it is (the float32 cast fused): the output is
// group_norm of its float32 copy bit for bit, the input's gradient that copy's gradient rounded
// once, and what backward saves is the 16-bit input itself.
TEST_P(GroupNormOp, AutocastCastIsFused) {
  for (DType d : {DType::bfloat16, DType::float16}) {
    SCOPED_TRACE(dtype_name(d));
    const Tensor x = leaf(ops::to(rand_tensor({2, 8, 3, 5}, DType::float32, 1), d));
    const Tensor w = leaf(rand_tensor({8}, DType::float32, 2, 0.5, 1.5));
    const Tensor b = leaf(rand_tensor({8}, DType::float32, 3));
    const Tensor dy = put(rand_tensor({2, 8, 3, 5}, DType::float32, 4));
    Tensor out;
    {
      AutocastGuard autocast(dev().type, d);
      out = nn::functional::group_norm(x, 4, w, b);
    }
    ASSERT_EQ(out.dtype(), DType::float32);
    EXPECT_EQ(out.autograd_meta()->grad_fn->name(), "NativeGroupNormBackward0");
    EXPECT_TRUE(saved_by(out)[0].storage().is_same(x.storage()));
    out.backward(dy);
    const Tensor x32 = leaf(ops::to(x.detach(), DType::float32));
    const Tensor w2 = leaf(w.detach()), b2 = leaf(b.detach());
    const Tensor ref = nn::functional::group_norm(x32, 4, w2, b2);
    ref.backward(dy);
    EXPECT_EQ(ops::to_vector(out), ops::to_vector(ref));
    ASSERT_EQ(x.grad().dtype(), d);
    EXPECT_EQ(ops::to_vector(x.grad()), ops::to_vector(ops::to(x32.grad(), d)));
    EXPECT_EQ(ops::to_vector(w.grad()), ops::to_vector(w2.grad()));
    EXPECT_EQ(ops::to_vector(b.grad()), ops::to_vector(b2.grad()));
  }
}

TEST_P(GroupNormOp, Errors) {
  const Tensor x = put(rand_tensor({2, 6, 4}, DType::float32, 1));
  const Tensor w = put(rand_tensor({6}, DType::float32, 2));
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { ops::group_norm_forward(x, w, {}, 4); })
                .find("group_norm: num_channels 6 of input of shape [2, 6, 4] must be divisible "
                      "by num_groups 4"),
            std::string::npos);
  EXPECT_NE(message([&] {
              ops::group_norm_forward(x, ops::narrow(w, 0, 0, 5), {}, 3);
            }).find("group_norm: weight of shape [5]"),
            std::string::npos);
  EXPECT_NE(message([&] {
              ops::group_norm_forward(ops::reshape(x, {48}), {}, {}, 1);
            }).find("at least 2 dims"),
            std::string::npos);
  // Named tensors, not a structured binding: clang 14 cannot capture one in the lambda.
  const auto fwd = ops::group_norm_forward(x, w, {}, 3);
  const Tensor mean = std::get<1>(fwd), rstd = std::get<2>(fwd);
  EXPECT_NE(message([&] {
              ops::group_norm_backward(x, x, mean, rstd, w, 2, {true, true, true});
            }).find("group_norm_backward: mean of shape [2, 3]"),
            std::string::npos);
}

// ================================================================ CUDA against the CPU

class GroupNormVsCpu : public VsCpu {};
TALLY_VS_CPU(GroupNormVsCpu);

const std::array<bool, 3> kGroupNormMasks[] = {
    {true, true, true}, {true, false, false}, {false, true, false}, {false, false, true}};

// Forward and backward of x (both devices' copies) in groups, affine unless plain. out_dtype:
// float32 beside a 16-bit x (the autocast cast fused; dy float32 then).
void check_group_norm(const Pair& x, const Pair& dy, int64_t groups, bool plain, uint64_t seed,
                      std::optional<DType> out_dtype = std::nullopt) {
  const DType d = x.cpu.dtype(), pd = ops::norm_stat_dtype(d);
  SCOPED_TRACE(case_label("group_norm", x.cpu.sizes(), d,
                          (" groups " + std::to_string(groups) + (plain ? " plain" : "") +
                           (out_dtype ? " out float32" : ""))
                              .c_str()));
  const NormTol tol = norm_tol(d);
  const int64_t c = x.cpu.sizes()[1];
  const Pair w = plain ? Pair{} : both({c}, pd, seed, false, 0.5, 1.5);
  const Pair b = plain ? Pair{} : both({c}, pd, seed + 1);
  auto [oc, mc, rc] = ops::group_norm_forward(x.cpu, w.cpu, b.cpu, groups, 1e-5, out_dtype);
  auto [og, mg, rg] = ops::group_norm_forward(x.gpu, w.gpu, b.gpu, groups, 1e-5, out_dtype);
  EXPECT_TRUE(close_to_cpu(og, oc, tol.elem, "out"));
  EXPECT_TRUE(close_to_cpu(mg, mc, tol.elem, "mean"));
  EXPECT_TRUE(close_to_cpu(rg, rc, tol.elem, "rstd"));
  for (std::array<bool, 3> mask : kGroupNormMasks) {
    SCOPED_TRACE(::testing::Message() << "mask " << mask[0] << mask[1] << mask[2]);
    auto [dxc, dwc, dbc] = ops::group_norm_backward(dy.cpu, x.cpu, mc, rc, w.cpu, groups, mask);
    auto [dxg, dwg, dbg] = ops::group_norm_backward(dy.gpu, x.gpu, mg, rg, w.gpu, groups, mask);
    EXPECT_TRUE(close_to_cpu(dxg, dxc, tol.elem, "dx", norm_dx_floor(dy.cpu, w.cpu, rc)));
    EXPECT_TRUE(close_to_cpu(dwg, dwc, tol.red, "dweight"));
    EXPECT_TRUE(close_to_cpu(dbg, dbc, tol.red, "dbias"));
  }
}

struct GroupCase {
  Shape xs;
  int64_t groups;
  bool plain = false, noncontig = false;
};

TEST_P(GroupNormVsCpu, MatchesTheCpu) {
  const GroupCase cases[] = {
      {{2, 6, 7}, 3},                   // odd plane: one element at a time
      {{3, 6, 7}, 3, true},             // no affine
      {{2, 8, 5, 5}, 4},                // 5x5 plane
      {{4, 32, 8, 8}, 8},               // packed planes, 4 channels a group
      {{2, 16, 4, 4}, 16},              // one channel a group: several warps a channel
      {{2, 64, 16}, 1},                 // one group of 64 channels: a warp loops over channels
      {{3, 40, 9, 9}, 5},               // 8 channels of 81
      {{2, 12, 4, 6}, 4, false, true},  // non-contiguous input and grad_output
      {{1, 6}, 2},                      // no spatial dims
  };
  uint64_t seed = 10;
  for (DType d : kFloatDtypes)
    for (const GroupCase& c : cases) {
      const Pair x = both(c.xs, d, seed += 10, c.noncontig);
      const Pair dy = both(c.xs, d, seed + 1, c.noncontig);
      check_group_norm(x, dy, c.groups, c.plain, seed + 2);
    }
}

// Inputs one element off their allocation's start take the one-element kernels.
TEST_P(GroupNormVsCpu, MisalignedInputs) {
  uint64_t seed = 500;
  const Shape xs{4, 16, 8, 8};
  const int64_t numel = shape_numel(xs);
  const auto shifted = [&](const Tensor& flat) {
    return ops::view(ops::narrow(flat, 0, 1, numel), xs);
  };
  for (DType d : {DType::float32, DType::bfloat16}) {
    const Pair xf = both({numel + 1}, d, ++seed), gf = both({numel + 1}, d, ++seed);
    const Pair x{shifted(xf.cpu), shifted(xf.gpu)}, dy{shifted(gf.cpu), shifted(gf.gpu)};
    ASSERT_TRUE(x.gpu.is_contiguous());
    check_group_norm(x, dy, 4, false, ++seed);
  }
}

// The U-Net's largest group_norm (bench_train --model unet) and the bench row's shape.
TEST_P(GroupNormVsCpu, UNetShapes) {
  uint64_t seed = 900;
  for (auto [xs, d] : {std::pair<Shape, DType>{{128, 128, 32, 32}, DType::bfloat16},
                       std::pair<Shape, DType>{{16, 256, 32, 32}, DType::float16},
                       std::pair<Shape, DType>{{16, 256, 16, 16}, DType::float32}}) {
    const Pair x = both(xs, d, ++seed), dy = both(xs, d, ++seed);
    check_group_norm(x, dy, 32, false, ++seed);
  }
}

// A 16-bit input with a float32 output and gradient (autocast's cast, fused): odd and packed
// planes, misaligned, and the U-Net's [128, 128, 32, 32] in bfloat16 as bench_train runs it.
TEST_P(GroupNormVsCpu, FloatOutputBesideA16BitInput) {
  uint64_t seed = 700;
  for (DType d : {DType::bfloat16, DType::float16})
    for (const GroupCase& c : {GroupCase{{2, 6, 7}, 3}, GroupCase{{4, 32, 8, 8}, 8},
                               GroupCase{{2, 16, 4, 4}, 16, true}}) {
      const Pair x = both(c.xs, d, seed += 10);
      const Pair dy = both(c.xs, DType::float32, seed + 1);
      check_group_norm(x, dy, c.groups, c.plain, seed + 2, DType::float32);
    }
  const Shape xs{4, 16, 8, 8};
  const int64_t numel = shape_numel(xs);
  const Pair xf = both({numel + 1}, DType::bfloat16, 801);
  const Pair x{ops::view(ops::narrow(xf.cpu, 0, 1, numel), xs),
               ops::view(ops::narrow(xf.gpu, 0, 1, numel), xs)};
  check_group_norm(x, both(xs, DType::float32, 802), 4, false, 803, DType::float32);
  const Shape unet{128, 128, 32, 32};
  check_group_norm(both(unet, DType::bfloat16, 804), both(unet, DType::float32, 805), 32, false,
                   806, DType::float32);
}

// Through nn::functional::group_norm and autograd, under autocast, against the CPU.
TEST_P(GroupNormVsCpu, AutogradMatchesTheCpu) {
  const Tensor x0 = rand_tensor({4, 8, 6, 6}, DType::float32, 1);
  const Tensor w0 = rand_tensor({8}, DType::float32, 2, 0.5, 1.5),
               b0 = rand_tensor({8}, DType::float32, 3);
  auto run = [&](Device device, bool amp) {
    auto leaf_on = [&](const Tensor& t) {
      Tensor l = ops::to(t, device, t.dtype(), /*copy=*/true);
      l.requires_grad_(true);
      return l;
    };
    const Tensor x = leaf_on(x0), w = leaf_on(w0), b = leaf_on(b0);
    Tensor y;
    {
      AutocastGuard autocast(device.type, DType::bfloat16, amp);
      y = nn::functional::group_norm(amp ? x.to(DType::bfloat16) : x, 4, w, b);
    }
    tally::sum(tally::mul(y, tally::tanh(y))).backward();
    return std::vector<Tensor>{y.detach(), x.grad(), w.grad(), b.grad()};
  };
  for (bool amp : {false, true}) {
    SCOPED_TRACE(amp ? "autocast" : "float32");
    const std::vector<Tensor> c = run(Device::cpu(), amp), g = run(dev(), amp);
    const char* names[] = {"out", "dx", "dweight", "dbias"};
    for (size_t i = 0; i < c.size(); ++i)
      EXPECT_TRUE(close_to_cpu(g[i], c[i], amp ? 2e-2 : 1e-4, names[i]));
  }
}

}  // namespace
}  // namespace tally
