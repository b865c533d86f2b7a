// The channels_last memory format (MemoryFormat, tensor/tensor.h) on the CPU: the layout
// predicates (is_contiguous(channels_last), suggest_memory_format) on hand-made strides, size-1
// dims and non-4-D tensors; memory_format_strides and its error; ops::contiguous / clone / to /
// copy_ keeping the values and the layout; elementwise ops (unary, binary, add_relu, binary
// with a scalar, add_, the donated add_relu, mixed layouts, offsets) giving channels_last
// results equal to the row-major run; and conv2d, batch_norm and the pools, forward and
// backward through autograd, a channels_last run against the row-major one: the same values
// (the CPU kernels compute row-major and convert, so to float32 rounding at most), the results
// and input gradients channels_last, a row-major parameter's gradient row-major (and a
// channels_last one's channels_last: AccumulateGrad). The CUDA kernels: test_channels_last_cuda.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "nn/container.h"
#include "nn/layers.h"
#include "nn/norm.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "tensor/conv/autograd.h"
#include "tensor/conv/ops.h"
#include "tensor/norm/autograd.h"
#include "tensor/norm/ops.h"
#include "tensor/op_alloc.h"
#include "tensor/pool/autograd.h"
#include "tensor/pool/ops.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using namespace testing;

// The same sizes, dtype and values, bit for bit (read back as float64 in row-major order).
::testing::AssertionResult same_values(const Tensor& got, const Tensor& want) {
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure()
           << "shape " << got.shape_string() << " vs " << want.shape_string();
  if (got.dtype() != want.dtype())
    return ::testing::AssertionFailure()
           << "dtype " << dtype_name(got.dtype()) << " vs " << dtype_name(want.dtype());
  const std::vector<double> a = ops::to_vector(got), b = ops::to_vector(want);
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && !(std::isnan(a[i]) && std::isnan(b[i])))
      return ::testing::AssertionFailure()
             << "element " << i << " of " << a.size() << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

// max |got - ref| / max |ref| <= tol (float32 rounding: the CPU kernels run both layouts as
// NCHW, so the results should agree far better than this).
::testing::AssertionResult close(const Tensor& got, const Tensor& ref, double tol = 1e-6) {
  if (!got.defined() || !ref.defined())
    return ::testing::AssertionFailure()
           << "undefined: got " << got.defined() << ", ref " << ref.defined();
  const Diff d = diff_scaled(got, ref);
  if (d.err <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << d.str() << " > " << tol;
}

// close(got[i], ref[i], tol) for each tensor of two runs, named by names[i] on failure.
void expect_all_close(const std::vector<Tensor>& got, const std::vector<Tensor>& ref,
                      const std::vector<const char*>& names, double tol) {
  ASSERT_EQ(got.size(), names.size());
  ASSERT_EQ(ref.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) EXPECT_TRUE(close(got[i], ref[i], tol)) << names[i];
}

// A channels_last result against the row-major run's: is_channels_last(got), then
// close(got, ref) or same_values(got, ref).
::testing::AssertionResult cl_close(const Tensor& got, const Tensor& ref) {
  ::testing::AssertionResult layout = is_channels_last(got);
  return layout ? close(got, ref) : layout;
}
::testing::AssertionResult cl_same(const Tensor& got, const Tensor& want) {
  ::testing::AssertionResult layout = is_channels_last(got);
  return layout ? same_values(got, want) : layout;
}

// A float32 leaf with t's values, laid out as f, requiring grad.
Tensor leaf_as(const Tensor& t, MemoryFormat f) {
  Tensor l = ops::contiguous(ops::clone(ops::contiguous(t, MemoryFormat::contiguous)), f);
  l.requires_grad_(true);
  return l;
}

// ================================================================ layout predicates

TEST(ChannelsLast, MemoryFormatStridesAndNames) {
  EXPECT_STREQ(memory_format_name(kCL), "channels_last");
  EXPECT_STREQ(memory_format_name(kRM), "contiguous_format");
  // [N, C, H, W] -> [H * W * C, 1, W * C, C]
  EXPECT_EQ(memory_format_strides({2, 3, 4, 5}, kCL, "t"), (Shape{60, 1, 15, 3}));
  EXPECT_EQ(memory_format_strides({7, 64, 1, 1}, kCL, "t"), (Shape{64, 1, 64, 64}));
  EXPECT_EQ(memory_format_strides({1, 1, 1, 1}, kCL, "t"), (Shape{1, 1, 1, 1}));
  EXPECT_EQ(memory_format_strides({2, 3, 4, 5}, kRM, "t"), (Shape{60, 20, 5, 1}));
  EXPECT_EQ(memory_format_strides({2, 3, 4}, kRM, "t"), (Shape{12, 4, 1}));
  // channels_last needs 4-D sizes: std::invalid_argument naming the caller and the shape.
  expect_error<std::invalid_argument>(
      [] {
        memory_format_strides({2, 3, 4}, kCL, "my_op");
      },
      {"my_op", "channels_last", "[2, 3, 4]"});
  expect_error<std::invalid_argument>(
      [] {
        memory_format_strides({1, 2, 3, 4, 5}, kCL, "other_op");
      },
      {"other_op", "[1, 2, 3, 4, 5]"});
  expect_error<std::invalid_argument>([] { memory_format_strides({}, kCL, "scalar_op"); },
                                      {"scalar_op"});
}

// t's layout predicates in one line: is_contiguous(channels_last), is_contiguous() and
// suggest_memory_format() (cl or rm).
std::string layout(const Tensor& t) {
  return std::string("cl=") + (t.is_contiguous(kCL) ? "1" : "0") +
         " rm=" + (t.is_contiguous() ? "1" : "0") +
         " suggest=" + (t.suggest_memory_format() == kCL ? "cl" : "rm");
}

// A view of hand-made sizes and strides over a zero buffer of 4096 floats.
Tensor strided(const Shape& sizes, const Shape& strides, int64_t offset = 0) {
  return ops::as_strided(ops::zeros({4096}, DType::float32), sizes, strides, offset);
}

// The layout() of each named strided(sizes, strides) view.
struct LayoutCase {
  const char* what;
  Shape sizes, strides;
  const char* layout;
};
void expect_layouts(std::initializer_list<LayoutCase> cases) {
  for (const LayoutCase& c : cases) {
    SCOPED_TRACE(c.what);
    EXPECT_EQ(layout(strided(c.sizes, c.strides)), c.layout);
  }
}

TEST(ChannelsLast, IsContiguousAndSuggestOnHandMadeStrides) {
  // Canonical channels_last [2, 3, 4, 5]: strides [60, 1, 15, 3].
  const Tensor a = strided({2, 3, 4, 5}, {60, 1, 15, 3});
  EXPECT_EQ(layout(a), "cl=1 rm=0 suggest=cl");
  EXPECT_FALSE(a.is_contiguous(kRM));
  // With a storage offset it still is.
  EXPECT_EQ(strided({2, 3, 4, 5}, {60, 1, 15, 3}, 17).suggest_memory_format(), kCL);
  // Row-major [2, 3, 4, 5].
  const Tensor r = strided({2, 3, 4, 5}, {60, 20, 5, 1});
  EXPECT_EQ(layout(r), "cl=0 rm=1 suggest=rm");
  EXPECT_TRUE(r.is_contiguous(kRM));
  // A permuted NHWC buffer is channels_last.
  const Tensor nhwc = ops::permute(strided({2, 4, 5, 3}, {60, 15, 3, 1}), {0, 3, 1, 2});
  EXPECT_EQ(nhwc.strides(), (Shape{60, 1, 15, 3}));
  EXPECT_EQ(nhwc.suggest_memory_format(), kCL);
  expect_layouts({
      // NCWH (H and W swapped) and NWHC are neither.
      {"NCWH", {2, 3, 4, 5}, {60, 20, 1, 4}, "cl=0 rm=0 suggest=rm"},
      {"NWHC", {2, 3, 4, 5}, {60, 1, 3, 12}, "cl=0 rm=0 suggest=rm"},
      // Not dense: every other W column of a channels_last [2, 3, 4, 10].
      {"gaps", {2, 3, 4, 5}, {120, 1, 30, 6}, "cl=0 rm=0 suggest=rm"},
  });
  // A channel slice of a channels_last tensor is not dense either.
  const Tensor cslice = ops::narrow(cl(ops::zeros({2, 6, 4, 5})), 1, 1, 3);
  EXPECT_EQ(layout(cslice), "cl=0 rm=0 suggest=rm");
  // A batch slice is (N is the outermost dim).
  const Tensor nslice = ops::narrow(cl(ops::zeros({4, 3, 4, 5})), 0, 1, 2);
  EXPECT_EQ(layout(nslice), "cl=1 rm=0 suggest=cl");
}

TEST(ChannelsLast, SizeOneDimsTakeAnyStride) {
  // H = 1: its stride is free ([2, 3, 1, 5] channels_last is [15, 1, 15, 3]).
  for (int64_t hs : {15, 999, 0, 1}) {
    SCOPED_TRACE(hs);
    const Tensor t = strided({2, 3, 1, 5}, {15, 1, hs, 3});
    EXPECT_EQ(layout(t), "cl=1 rm=0 suggest=cl");
  }
  // N = 1: likewise.
  EXPECT_EQ(strided({1, 3, 4, 5}, {7, 1, 15, 3}).suggest_memory_format(), kCL);
  expect_layouts({
      // C = 1: channels_last strides [H*W, 1, W, 1] are also row-major: contiguous wins.
      {"C = 1", {2, 1, 4, 5}, {20, 1, 5, 1}, "cl=1 rm=1 suggest=rm"},
      // H = W = 1 ([N, C, 1, 1], a pooled feature map): both layouts again; contiguous.
      {"H = W = 1", {2, 3, 1, 1}, {3, 1, 3, 3}, "cl=1 rm=1 suggest=rm"},
      {"all ones", {1, 1, 1, 1}, {5, 7, 9, 11}, "cl=1 rm=1 suggest=rm"},
      // W = 1 with C > 1 and H > 1: channels_last strides [H*C, 1, C, C] are not row-major.
      {"W = 1", {2, 3, 4, 1}, {12, 1, 3, 42}, "cl=1 rm=0 suggest=cl"},
  });
  // A size-1 dim does not excuse a wrong stride elsewhere.
  EXPECT_FALSE(strided({2, 3, 1, 5}, {16, 1, 15, 3}).is_contiguous(kCL));
}

TEST(ChannelsLast, NotFourDimensionalIsNeverChannelsLast) {
  // 3-D [C, H, W] with NHWC-like strides (HWC order): not channels_last.
  const Tensor t3 = strided({3, 4, 5}, {1, 15, 3});
  EXPECT_FALSE(t3.is_contiguous(kCL));
  EXPECT_EQ(t3.suggest_memory_format(), kRM);
  EXPECT_FALSE(ops::zeros({3, 4, 5}).is_contiguous(kCL));
  EXPECT_EQ(ops::zeros({3, 4, 5}).suggest_memory_format(), kRM);
  EXPECT_FALSE(ops::zeros({2, 3}).is_contiguous(kCL));
  EXPECT_FALSE(ops::zeros({6}).is_contiguous(kCL));
  EXPECT_FALSE(ops::zeros({2, 3, 4, 5, 6}).is_contiguous(kCL));
  EXPECT_EQ(ops::zeros({2, 3, 4, 5, 6}).suggest_memory_format(), kRM);
  // A plain row-major 4-D tensor.
  EXPECT_EQ(ops::zeros({2, 3, 4, 5}).suggest_memory_format(), kRM);
}

// ================================================================ conversions

TEST(ChannelsLast, ContiguousConvertsKeepsValuesAndReturnsItselfWhenAlready) {
  const Tensor x = rand_tensor({2, 3, 4, 5}, DType::float32, 1);
  const Tensor y = ops::contiguous(x, kCL);
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_EQ(y.strides(), (Shape{60, 1, 15, 3}));
  EXPECT_TRUE(y.is_contiguous(kCL));
  EXPECT_EQ(y.suggest_memory_format(), kCL);
  EXPECT_NE(y.storage().data(), x.storage().data());
  EXPECT_EQ(ops::to_vector(y), ops::to_vector(x));
  // Memory order is NHWC: element (n, c, h, w) at n*60 + h*15 + w*3 + c.
  const float* p = y.data<float>();
  const std::vector<double> v = ops::to_vector(x);
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t w = 0; w < 5; ++w)
          ASSERT_EQ(p[n * 60 + h * 15 + w * 3 + c],
                    static_cast<float>(v[static_cast<size_t>(((n * 3 + c) * 4 + h) * 5 + w)]))
              << n << c << h << w;
  // Already channels_last: the same tensor.
  const Tensor again = ops::contiguous(y, kCL);
  EXPECT_EQ(again.storage().data(), y.storage().data());
  EXPECT_EQ(again.strides(), y.strides());
  // Back to row-major, same values.
  const Tensor back = ops::contiguous(y, kRM);
  EXPECT_TRUE(is_row_major(back));
  EXPECT_EQ(ops::to_vector(back), ops::to_vector(x));
  EXPECT_EQ(ops::contiguous(y).strides(), contiguous_strides(x.sizes()));
  // Row-major asked of a row-major tensor: itself.
  EXPECT_EQ(ops::contiguous(x, kRM).storage().data(), x.storage().data());
  // From a non-dense view (a strided slice) straight to channels_last.
  const Tensor wide = rand_tensor({2, 3, 4, 10}, DType::float64, 2);
  const Tensor sl = ops::slice(wide, 3, 0, 10, 2);
  const Tensor slc = ops::contiguous(sl, kCL);
  EXPECT_TRUE(is_channels_last(slc));
  EXPECT_EQ(ops::to_vector(slc), ops::to_vector(sl));
  // Empty batch and size-1 dims convert too.
  const Tensor e = ops::contiguous(ops::zeros({0, 3, 4, 5}), kCL);
  EXPECT_EQ(e.sizes(), (Shape{0, 3, 4, 5}));
  const Tensor one = rand_tensor({1, 3, 1, 5}, DType::float32, 3);
  const Tensor onec = ops::contiguous(one, kCL);
  EXPECT_TRUE(onec.is_contiguous(kCL));
  EXPECT_EQ(ops::to_vector(onec), ops::to_vector(one));
  // Integer and bool tensors keep their values.
  const Tensor ints = ops::arange(0, 120, 1, DType::int64);
  const Tensor i4 = ops::reshape(ints, {2, 3, 4, 5});
  const Tensor i4c = ops::contiguous(i4, kCL);
  EXPECT_TRUE(is_channels_last(i4c));
  EXPECT_EQ(i4c.dtype(), DType::int64);
  EXPECT_EQ(ops::to_vector(i4c), ops::to_vector(i4));
}

TEST(ChannelsLast, TensorContiguousIsDifferentiable) {
  const Tensor x = leaf_as(rand_tensor({2, 3, 4, 5}, DType::float64, 4), kRM);
  const Tensor y = x.contiguous(kCL);
  EXPECT_TRUE(is_channels_last(y));
  EXPECT_TRUE(y.requires_grad());
  EXPECT_EQ(ops::to_vector(y), ops::to_vector(x));
  const Tensor g = rand_tensor({2, 3, 4, 5}, DType::float64, 5);
  sum(mul(y, g)).backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(same_values(x.grad(), g));
  EXPECT_TRUE(is_row_major(x.grad())) << "the .grad of a row-major leaf";
  // Already channels_last: itself (the same autograd identity).
  const Tensor z = leaf_as(rand_tensor({2, 3, 4, 5}, DType::float64, 6), kCL);
  const Tensor z2 = z.contiguous(kCL);
  EXPECT_EQ(z2.storage().data(), z.storage().data());
  EXPECT_TRUE(z2.is_leaf());
  // Differentiable through a gradcheck (float64).
  const Tensor in = rand_input({2, 3, 2, 2}, -1, 1, 7);
  EXPECT_TRUE(gradcheck(
      [](const TensorList& t) { return mul(t[0].contiguous(MemoryFormat::channels_last), 3.0); },
      {in}));
}

TEST(ChannelsLast, CloneAndToKeepTheLayout) {
  const Tensor x = cl(rand_tensor({2, 3, 4, 5}, DType::float32, 8));
  // clone: a new channels_last tensor.
  const Tensor c = ops::clone(x);
  EXPECT_NE(c.storage().data(), x.storage().data());
  EXPECT_TRUE(is_channels_last(c));
  EXPECT_EQ(c.strides(), x.strides());
  EXPECT_TRUE(same_values(c, x));
  // clone of row-major and of a non-dense view stay/come out row-major.
  EXPECT_TRUE(is_row_major(ops::clone(rand_tensor({2, 3, 4, 5}, DType::float32, 9))));
  const Tensor t2 = ops::transpose(rand_tensor({3, 4}, DType::float32, 10), 0, 1);
  EXPECT_TRUE(is_row_major(ops::clone(t2)));
  EXPECT_TRUE(same_values(ops::clone(t2), t2));
  // to(dtype): channels_last on the same device, values converted.
  for (DType d : {DType::float64, DType::float16, DType::bfloat16}) {
    SCOPED_TRACE(dtype_name(d));
    const Tensor y = ops::to(x, d);
    EXPECT_EQ(y.dtype(), d);
    EXPECT_TRUE(is_channels_last(y));
    EXPECT_TRUE(same_values(y, ops::to(ops::contiguous(x, kRM), d)));
    // and back
    const Tensor z = ops::to(y, DType::float32);
    EXPECT_TRUE(is_channels_last(z));
  }
  // to(device, dtype) on the same device, copy=true: a channels_last copy.
  const Tensor cp = ops::to(x, Device::cpu(), DType::float32, /*copy=*/true);
  EXPECT_NE(cp.storage().data(), x.storage().data());
  EXPECT_TRUE(cl_same(cp, x));
  // Nothing to change: x itself.
  EXPECT_EQ(ops::to(x, DType::float32).storage().data(), x.storage().data());
  // Tensor::to (autograd) keeps it too.
  const Tensor ag = x.to(DType::float64);
  EXPECT_TRUE(is_channels_last(ag));
  EXPECT_TRUE(same_values(ag, ops::to(x, DType::float64)));
}

TEST(ChannelsLast, CopyBetweenLayouts) {
  const Tensor src_rm = rand_tensor({2, 5, 3, 4}, DType::float32, 11);
  const Tensor src_cl = cl(src_rm);
  // channels_last -> channels_last (the flat copy)
  const Tensor dst_cl = cl(ops::zeros({2, 5, 3, 4}));
  ops::copy_(dst_cl, src_cl);
  EXPECT_TRUE(cl_same(dst_cl, src_rm));
  // channels_last -> row-major and row-major -> channels_last
  const Tensor dst_rm = ops::zeros({2, 5, 3, 4});
  ops::copy_(dst_rm, src_cl);
  EXPECT_TRUE(same_values(dst_rm, src_rm));
  const Tensor dst_cl2 = cl(ops::zeros({2, 5, 3, 4}));
  ops::copy_(dst_cl2, src_rm);
  EXPECT_TRUE(cl_same(dst_cl2, src_rm));
  // With a dtype change (float64 channels_last into float32 channels_last).
  const Tensor dst_cl3 = cl(ops::zeros({2, 5, 3, 4}));
  ops::copy_(dst_cl3, ops::to(src_cl, DType::float64));
  EXPECT_TRUE(same_values(dst_cl3, src_rm));
  // Into a batch slice of a channels_last tensor (an offset view, the flat path): the rest
  // of the destination untouched.
  const Tensor big = cl(ops::zeros({4, 5, 3, 4}));
  const Tensor part = ops::narrow(big, 0, 1, 2);
  ASSERT_EQ(part.suggest_memory_format(), kCL);
  ops::copy_(part, src_cl);
  EXPECT_TRUE(same_values(ops::narrow(big, 0, 1, 2), src_rm));
  EXPECT_TRUE(same_values(ops::narrow(big, 0, 0, 1), ops::zeros({1, 5, 3, 4})));
  EXPECT_TRUE(same_values(ops::narrow(big, 0, 3, 1), ops::zeros({1, 5, 3, 4})));
  // Channels-last tensors whose strides differ only in a size-1 dim.
  const Tensor h1 = rand_tensor({2, 3, 1, 4}, DType::float32, 12);
  const Tensor h1c = cl(h1);
  const Tensor base = ops::zeros({64});
  const Tensor odd = ops::as_strided(base, {2, 3, 1, 4}, {12, 1, 77, 3}, 0);
  ASSERT_EQ(odd.suggest_memory_format(), kCL);
  ops::copy_(odd, h1c);
  EXPECT_TRUE(same_values(odd, h1));
}

// ================================================================ elementwise

TEST(ChannelsLast, UnaryOpsGiveChannelsLastResults) {
  const Tensor x = rand_tensor({3, 5, 4, 6}, DType::float32, 20);
  const Tensor xc = cl(x);
  for (ops::UnaryOp op : {ops::UnaryOp::relu, ops::UnaryOp::exp, ops::UnaryOp::neg,
                          ops::UnaryOp::tanh, ops::UnaryOp::square, ops::UnaryOp::sigmoid}) {
    SCOPED_TRACE(ops::unary_op_name(op));
    const Tensor y = ops::unary(op, xc);
    EXPECT_TRUE(is_channels_last(y));
    EXPECT_TRUE(same_values(y, ops::unary(op, x)));
  }
  // Autograd's relu and its gradient.
  const Tensor a = leaf_as(x, kCL), b = leaf_as(x, kRM);
  const Tensor ya = relu(a), yb = relu(b);
  EXPECT_TRUE(cl_same(ya, yb));
  const Tensor g = rand_tensor({3, 5, 4, 6}, DType::float32, 21);
  sum(mul(ya, cl(g))).backward();
  sum(mul(yb, g)).backward();
  EXPECT_TRUE(is_channels_last(a.grad()));
  EXPECT_TRUE(same_values(a.grad(), b.grad()));
  // An integer channels_last tensor: relu keeps the dtype and the layout.
  const Tensor ints = cl(ops::reshape(ops::arange(-60, 60, 1, DType::int64), {2, 3, 4, 5}));
  const Tensor ri = ops::unary(ops::UnaryOp::relu, ints);
  EXPECT_EQ(ri.dtype(), DType::int64);
  EXPECT_TRUE(is_channels_last(ri));
  EXPECT_TRUE(same_values(ri, ops::unary(ops::UnaryOp::relu, ops::contiguous(ints, kRM))));
  // A batch slice (storage offset) of a channels_last tensor.
  const Tensor big = cl(rand_tensor({5, 5, 4, 6}, DType::float32, 22));
  const Tensor part = ops::narrow(big, 0, 2, 3);
  ASSERT_EQ(part.suggest_memory_format(), kCL);
  const Tensor rp = ops::unary(ops::UnaryOp::exp, part);
  EXPECT_TRUE(is_channels_last(rp));
  EXPECT_TRUE(same_values(rp, ops::unary(ops::UnaryOp::exp, ops::contiguous(part, kRM))));
}

TEST(ChannelsLast, BinaryOpsOnChannelsLastOperands) {
  const Tensor a = rand_tensor({3, 6, 5, 4}, DType::float32, 30);
  const Tensor b = rand_tensor({3, 6, 5, 4}, DType::float32, 31);
  const Tensor ac = cl(a), bc = cl(b);
  for (ops::BinaryOp op :
       {ops::BinaryOp::add, ops::BinaryOp::sub, ops::BinaryOp::mul, ops::BinaryOp::add_relu,
        ops::BinaryOp::relu_backward, ops::BinaryOp::maximum}) {
    SCOPED_TRACE(ops::binary_op_name(op));
    const Tensor y = ops::binary(op, ac, bc);
    EXPECT_TRUE(is_channels_last(y));
    EXPECT_TRUE(same_values(y, ops::binary(op, a, b)));
  }
  // A comparison: bool, channels_last.
  const Tensor gt = ops::binary(ops::BinaryOp::gt, ac, bc);
  EXPECT_EQ(gt.dtype(), DType::bool_);
  EXPECT_TRUE(is_channels_last(gt));
  EXPECT_TRUE(same_values(gt, ops::binary(ops::BinaryOp::gt, a, b)));
  // Autograd's add and add_relu, with gradients.
  const Tensor la = leaf_as(a, kCL), lb = leaf_as(b, kCL);
  const Tensor ra = leaf_as(a, kRM), rb = leaf_as(b, kRM);
  const Tensor s = add(la, lb), sr = add(ra, rb);
  EXPECT_TRUE(cl_same(s, sr));
  const Tensor ar = add_relu(la, lb), arr = add_relu(ra, rb);
  EXPECT_TRUE(cl_same(ar, arr));
  const Tensor g = rand_tensor(a.sizes(), DType::float32, 32);
  sum(mul(add(s, ar), cl(g))).backward();
  sum(mul(add(sr, arr), g)).backward();
  for (auto [name, got, want] :
       {std::tuple{"a", la.grad(), ra.grad()}, std::tuple{"b", lb.grad(), rb.grad()}}) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(cl_same(got, want));
  }
  // Type promotion: float32 channels_last + float64 channels_last.
  const Tensor b64 = ops::to(bc, DType::float64);
  const Tensor p = ops::add(ac, b64);
  EXPECT_EQ(p.dtype(), DType::float64);
  EXPECT_TRUE(is_channels_last(p));
  EXPECT_TRUE(same_values(p, ops::add(a, ops::to(b, DType::float64))));
  // A float32 channels_last with a 16-bit channels_last (read widened).
  const Tensor bh = ops::to(bc, DType::bfloat16);
  const Tensor w = ops::add(ac, bh);
  EXPECT_TRUE(is_channels_last(w));
  EXPECT_TRUE(same_values(w, ops::add(a, ops::to(ops::to(b, DType::bfloat16), DType::float32))));
  // Batch slices (offsets) of channels_last tensors.
  const Tensor big = cl(rand_tensor({6, 6, 5, 4}, DType::float32, 33));
  const Tensor p1 = ops::narrow(big, 0, 1, 3), p2 = ops::narrow(big, 0, 3, 3);
  const Tensor ps = ops::add(p1, p2);
  EXPECT_TRUE(is_channels_last(ps));
  EXPECT_TRUE(same_values(ps, ops::add(ops::contiguous(p1, kRM), ops::contiguous(p2, kRM))));
}

TEST(ChannelsLast, BinaryWithScalarGivesChannelsLast) {
  const Tensor a = rand_tensor({2, 7, 3, 5}, DType::float32, 40);
  const Tensor ac = cl(a);
  for (auto [name, got, want] :
       {std::tuple{"add", ops::add(ac, 1.5), ops::add(a, 1.5)},
        std::tuple{"mul", ops::mul(ac, -3.0), ops::mul(a, -3.0)},
        std::tuple{"pow", ops::binary_scalar(ops::BinaryOp::pow, ac, 2.0),
                   ops::binary_scalar(ops::BinaryOp::pow, a, 2.0)},
        std::tuple{"gt", ops::binary_scalar(ops::BinaryOp::gt, ac, 0.25),
                   ops::binary_scalar(ops::BinaryOp::gt, a, 0.25)},
        std::tuple{"scalar - t", ops::scalar_binary(ops::BinaryOp::sub, 2.0, ac),
                   ops::scalar_binary(ops::BinaryOp::sub, 2.0, a)},
        std::tuple{"scalar / t", ops::scalar_binary(ops::BinaryOp::div, 2.0, ac),
                   ops::scalar_binary(ops::BinaryOp::div, 2.0, a)}}) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(cl_same(got, want));
  }
  // An integer channels_last tensor times a fraction: float32, channels_last.
  const Tensor ints = cl(ops::reshape(ops::arange(0, 24, 1, DType::int64), {1, 2, 3, 4}));
  const Tensor f = ops::mul(ints, 0.5);
  EXPECT_EQ(f.dtype(), DType::float32);
  EXPECT_TRUE(is_channels_last(f));
  EXPECT_TRUE(same_values(f, ops::mul(ops::contiguous(ints, kRM), 0.5)));
  // Autograd's scalar ops.
  const Tensor l = leaf_as(a, kCL);
  const Tensor y = l * 2.0 + 1.0;
  EXPECT_TRUE(is_channels_last(y));
  EXPECT_TRUE(same_values(y, a * 2.0 + 1.0));
}

TEST(ChannelsLast, MixedLayoutsAndBroadcastsGiveCorrectValues) {
  const Tensor a = rand_tensor({2, 6, 5, 3}, DType::float32, 50);
  const Tensor b = rand_tensor({2, 6, 5, 3}, DType::float32, 51);
  const Tensor ac = cl(a), bc = cl(b);
  for (ops::BinaryOp op :
       {ops::BinaryOp::add, ops::BinaryOp::sub, ops::BinaryOp::mul, ops::BinaryOp::add_relu}) {
    SCOPED_TRACE(ops::binary_op_name(op));
    const Tensor want = ops::binary(op, a, b);
    EXPECT_TRUE(same_values(ops::binary(op, ac, b), want)) << "channels_last op row-major";
    EXPECT_TRUE(same_values(ops::binary(op, a, bc), want)) << "row-major op channels_last";
    // A non-dense operand.
    const Tensor bt = ops::permute(ops::contiguous(ops::permute(b, {3, 2, 1, 0})), {3, 2, 1, 0});
    ASSERT_EQ(bt.suggest_memory_format(), kRM);
    EXPECT_TRUE(same_values(ops::binary(op, ac, bt), want)) << "channels_last op transposed";
  }
  // A per-channel bias [1, C, 1, 1] and a per-channel [C, 1, 1] on channels_last.
  const Tensor bias = rand_tensor({1, 6, 1, 1}, DType::float32, 52);
  EXPECT_TRUE(same_values(ops::add(ac, bias), ops::add(a, bias)));
  EXPECT_TRUE(same_values(ops::mul(bias, ac), ops::mul(bias, a)));
  const Tensor bias3 = rand_tensor({6, 1, 1}, DType::float32, 53);
  EXPECT_TRUE(same_values(ops::add(ac, bias3), ops::add(a, bias3)));
  // Two channels_last tensors broadcast over N ([1, C, H, W] + [N, C, H, W]).
  const Tensor one = rand_tensor({1, 6, 5, 3}, DType::float32, 54);
  EXPECT_TRUE(same_values(ops::add(cl(one), ac), ops::add(one, a)));
  EXPECT_TRUE(same_values(ops::add(ac, cl(one)), ops::add(a, one)));
  // Channels-last operands of different strides (a size-1 dim's stride differs).
  const Tensor h = rand_tensor({2, 3, 1, 4}, DType::float32, 55);
  const Tensor hc = cl(h);
  const Tensor base = ops::clone(ops::contiguous(hc, kCL));
  const Tensor odd = ops::as_strided(base, {2, 3, 1, 4}, {12, 1, 99, 3}, 0);
  ASSERT_EQ(odd.suggest_memory_format(), kCL);
  const Tensor h2 = rand_tensor({2, 3, 1, 4}, DType::float32, 56);
  EXPECT_TRUE(same_values(ops::add(odd, cl(h2)), ops::add(h, h2)));
  // Channels-last tensors of one layout but different batch offsets.
  const Tensor big = cl(rand_tensor({4, 6, 5, 3}, DType::float32, 57));
  const Tensor q = ops::narrow(big, 0, 2, 2);
  EXPECT_TRUE(same_values(ops::mul(q, ac), ops::mul(ops::contiguous(q, kRM), a)));
  // Autograd through a mixed op: each .grad in its leaf's layout.
  const Tensor la = leaf_as(a, kCL), lb = leaf_as(b, kRM);
  sum(mul(la, lb)).backward();
  EXPECT_TRUE(is_channels_last(la.grad()));
  EXPECT_TRUE(is_row_major(lb.grad()));
  EXPECT_TRUE(same_values(la.grad(), b));
  EXPECT_TRUE(same_values(lb.grad(), a));
}

TEST(ChannelsLast, InPlaceAddAndDonatedAddRelu) {
  const Tensor a = rand_tensor({2, 5, 3, 4}, DType::float32, 60);
  const Tensor b = rand_tensor({2, 5, 3, 4}, DType::float32, 61);
  // add_ on a channels_last tensor: layout unchanged, values a + 2b.
  {
    const Tensor t = cl(a);
    const void* p = t.storage().data();
    ops::add_(t, cl(b), 2.0);
    EXPECT_EQ(t.storage().data(), p);
    EXPECT_TRUE(is_channels_last(t));
    const Tensor want = ops::add(a, ops::mul(b, 2.0));
    EXPECT_TRUE(close(t, want, 1e-6));
  }
  {
    const Tensor t = cl(a);
    ops::add_(t, b);  // row-major operand
    EXPECT_TRUE(is_channels_last(t));
    EXPECT_TRUE(same_values(t, ops::add(a, b)));
    const Tensor u = ops::clone(a);
    ops::add_(u, cl(b));  // row-major destination, channels_last operand
    EXPECT_TRUE(is_row_major(u));
    EXPECT_TRUE(same_values(u, ops::add(a, b)));
  }
  // add_relu over a dying channels_last intermediate: the result written over it, still
  // channels_last, values relu(a + b).
  const Tensor want = ops::add_relu(a, b);
  {  // row-major first: the donation itself
    Tensor t = ops::mul(a, 1.0);
    const void* p = t.storage().data();
    const Tensor out = ops::add_relu(std::move(t), b);
    EXPECT_TRUE(same_values(out, want));
    EXPECT_EQ(out.storage().data(), p) << "the donor's buffer (row-major)";
  }
  {
    Tensor t = ops::mul(cl(a), 1.0);
    ASSERT_EQ(t.suggest_memory_format(), kCL);
    const void* p = t.storage().data();
    const Tensor out = ops::add_relu(std::move(t), cl(b));
    EXPECT_TRUE(cl_same(out, want));
    EXPECT_EQ(out.storage().data(), p) << "the donor's buffer";
  }
  {  // donated channels_last, the other operand row-major
    Tensor t = ops::mul(cl(a), 1.0);
    const Tensor out = ops::add_relu(std::move(t), b);
    EXPECT_TRUE(same_values(out, want));
  }
  {  // donated row-major, the other operand channels_last
    Tensor t = ops::mul(a, 1.0);
    const Tensor out = ops::add_relu(std::move(t), cl(b));
    EXPECT_TRUE(same_values(out, want));
  }
  {  // donated channels_last plus a broadcast per-channel bias (the strided kernel writes it)
    const Tensor bias = rand_tensor({1, 5, 1, 1}, DType::float32, 62);
    Tensor t = ops::mul(cl(a), 1.0);
    const Tensor out = ops::binary_over(ops::BinaryOp::add, std::move(t), bias);
    EXPECT_TRUE(same_values(out, ops::add(a, bias)));
  }
}

// ================================================================ conv2d

struct ConvRun {
  Tensor out, gx, gw, gb;
};

// conv2d (autograd) of x laid out as xf with weight laid out as wf, then backward from the
// output with the gradient gy laid out as gf.
ConvRun run_conv(const Tensor& x0, const Tensor& w0, const Tensor& b0, const Tensor& gy0,
                 MemoryFormat xf, MemoryFormat wf, MemoryFormat gf, Int2 stride, Int2 padding,
                 Int2 dilation = 1, int64_t groups = 1) {
  const Tensor x = leaf_as(x0, xf), w = leaf_as(w0, wf), b = leaf_as(b0, kRM);
  const Tensor out = conv2d(x, w, b, stride, padding, dilation, groups);
  out.backward(ops::contiguous(gy0, gf));
  return {out, x.grad(), w.grad(), b.grad()};
}

TEST(ChannelsLast, Conv2dForwardBackwardMatchesRowMajor) {
  struct Case {
    const char* name;
    Shape x, w;
    Int2 stride, padding, dilation;
    int64_t groups;
  };
  const Case cases[] = {
      {"3x3 padding 1", {2, 4, 7, 6}, {5, 4, 3, 3}, 1, 1, 1, 1},
      {"3x3 stride 2", {3, 3, 9, 8}, {6, 3, 3, 3}, 2, 1, 1, 1},
      {"1x1", {2, 8, 5, 5}, {4, 8, 1, 1}, 1, 0, 1, 1},
      {"groups 2 dilation 2", {2, 4, 9, 9}, {6, 2, 3, 3}, 1, 2, 2, 2},
      {"depthwise", {2, 6, 6, 7}, {6, 1, 3, 3}, 1, 1, 1, 6},
  };
  uint64_t seed = 100;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Tensor x = rand_tensor(c.x, DType::float32, ++seed, -1, 1);
    const Tensor w = rand_tensor(c.w, DType::float32, ++seed, -1, 1);
    const Tensor b = rand_tensor({c.w[0]}, DType::float32, ++seed, -1, 1);
    const Shape ys = ops::conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups).sizes();
    const Tensor gy = rand_tensor(ys, DType::float32, ++seed, -1, 1);
    const ConvRun ref =
        run_conv(x, w, b, gy, kRM, kRM, kRM, c.stride, c.padding, c.dilation, c.groups);
    EXPECT_TRUE(is_row_major(ref.out));
    EXPECT_TRUE(is_row_major(ref.gx));
    EXPECT_TRUE(is_row_major(ref.gw));
    // A channels_last input (the upstream gradient channels_last too, as a following
    // batch_norm or relu gives it).
    const ConvRun got =
        run_conv(x, w, b, gy, kCL, kRM, kCL, c.stride, c.padding, c.dilation, c.groups);
    EXPECT_TRUE(is_channels_last(got.out)) << "output";
    EXPECT_TRUE(is_channels_last(got.gx)) << "input gradient";
    EXPECT_TRUE(is_row_major(got.gw)) << "a row-major weight's gradient";
    EXPECT_TRUE(close(got.out, ref.out)) << "output";
    EXPECT_TRUE(close(got.gx, ref.gx)) << "input gradient";
    EXPECT_TRUE(close(got.gw, ref.gw)) << "weight gradient";
    EXPECT_TRUE(close(got.gb, ref.gb)) << "bias gradient";
    // The upstream gradient row-major: the same values, the leaves' layouts.
    const ConvRun mixed =
        run_conv(x, w, b, gy, kCL, kRM, kRM, c.stride, c.padding, c.dilation, c.groups);
    EXPECT_TRUE(is_channels_last(mixed.out));
    EXPECT_TRUE(is_channels_last(mixed.gx)) << "input gradient (row-major upstream)";
    EXPECT_TRUE(is_row_major(mixed.gw));
    EXPECT_TRUE(close(mixed.gx, ref.gx));
    EXPECT_TRUE(close(mixed.gw, ref.gw));
    // A channels_last weight with a row-major input: channels_last output (PyTorch's rule),
    // the weight's gradient channels_last, the input's row-major.
    const ConvRun wcl =
        run_conv(x, w, b, gy, kRM, kCL, kRM, c.stride, c.padding, c.dilation, c.groups);
    if (c.w[1] > 1 && c.w[2] * c.w[3] > 1) {  // else the weight is row-major as well
      EXPECT_TRUE(is_channels_last(wcl.out)) << "output of a channels_last weight";
      EXPECT_TRUE(is_channels_last(wcl.gw)) << "a channels_last weight's gradient";
    }
    EXPECT_TRUE(is_row_major(wcl.gx)) << "a row-major input's gradient";
    EXPECT_TRUE(close(wcl.out, ref.out));
    EXPECT_TRUE(close(wcl.gx, ref.gx));
    EXPECT_TRUE(close(wcl.gw, ref.gw));
    EXPECT_TRUE(close(wcl.gb, ref.gb));
    // Both channels_last.
    const ConvRun both_cl =
        run_conv(x, w, b, gy, kCL, kCL, kCL, c.stride, c.padding, c.dilation, c.groups);
    EXPECT_TRUE(is_channels_last(both_cl.out));
    EXPECT_TRUE(close(both_cl.out, ref.out));
    EXPECT_TRUE(close(both_cl.gx, ref.gx));
    EXPECT_TRUE(close(both_cl.gw, ref.gw));
  }
}

// The raw ops follow PyTorch's rule: channels_last when either 4-D operand is.
TEST(ChannelsLast, Conv2dRawOpsLayouts) {
  const Tensor x = rand_tensor({2, 3, 6, 5}, DType::float32, 120, -1, 1);
  const Tensor w = rand_tensor({4, 3, 3, 3}, DType::float32, 121, -1, 1);
  const Tensor y = ops::conv2d(x, w, {}, 1, 1);
  const Tensor gy = rand_tensor(y.sizes(), DType::float32, 122, -1, 1);
  const Tensor gx = ops::conv2d_backward_input(gy, w, x.sizes(), 1, 1, 1, 1);
  const Tensor gw = ops::conv2d_backward_weight(gy, x, w.sizes(), 1, 1, 1, 1);
  EXPECT_TRUE(is_row_major(y));
  EXPECT_TRUE(is_row_major(gx));
  EXPECT_TRUE(is_row_major(gw));
  const Tensor yc = ops::conv2d(cl(x), w, {}, 1, 1);
  EXPECT_TRUE(cl_close(yc, y));
  const Tensor gxc = ops::conv2d_backward_input(cl(gy), w, x.sizes(), 1, 1, 1, 1);
  EXPECT_TRUE(cl_close(gxc, gx));
  const Tensor gxw = ops::conv2d_backward_input(gy, cl(w), x.sizes(), 1, 1, 1, 1);
  EXPECT_TRUE(cl_close(gxw, gx));
  const Tensor gwc = ops::conv2d_backward_weight(cl(gy), x, w.sizes(), 1, 1, 1, 1);
  EXPECT_TRUE(cl_close(gwc, gw));
  const Tensor gwx = ops::conv2d_backward_weight(gy, cl(x), w.sizes(), 1, 1, 1, 1);
  EXPECT_TRUE(cl_close(gwx, gw));
  // float64 and bfloat16 keep the layout too.
  for (DType d : {DType::float64, DType::bfloat16}) {
    SCOPED_TRACE(dtype_name(d));
    const Tensor xd = ops::to(x, d), wd = ops::to(w, d);
    const Tensor r = ops::conv2d(cl(xd), wd, {}, 1, 1);
    EXPECT_EQ(r.dtype(), d);
    EXPECT_TRUE(is_channels_last(r));
    EXPECT_TRUE(same_values(r, ops::conv2d(xd, wd, {}, 1, 1)));
  }
  // Unbatched [C, H, W] with a channels_last weight: the values.
  const Tensor x3 = rand_tensor({3, 6, 5}, DType::float32, 123, -1, 1);
  const Tensor y3 = ops::conv2d(x3, cl(w), {}, 1, 1);
  EXPECT_EQ(y3.sizes(), (Shape{4, 6, 5}));
  EXPECT_TRUE(close(y3, ops::conv2d(x3, w, {}, 1, 1)));
}

// The gradient conv2d's backward hands to a channels_last input that is not a leaf (so no
// AccumulateGrad re-lays it), when the upstream gradient is row-major: PyTorch gives it in the
// input's layout (convolution_backward picks the layout from input and weight).
TEST(ChannelsLast, Conv2dInputGradientFollowsTheInputLayout) {
  const Tensor x0 = rand_tensor({2, 4, 6, 6}, DType::float32, 130, -1, 1);
  const Tensor w = leaf_as(rand_tensor({5, 4, 3, 3}, DType::float32, 131, -1, 1), kRM);
  const Tensor x = leaf_as(x0, kCL);
  const Tensor xi = mul(x, 1.0);  // a channels_last non-leaf
  ASSERT_EQ(xi.suggest_memory_format(), kCL);
  Tensor seen;
  xi.register_hook([&](const Tensor& g) {
    seen = g;
    return Tensor();
  });
  const Tensor y = conv2d(xi, w, {}, 1, 1);
  const Tensor gy = rand_tensor(y.sizes(), DType::float32, 132, -1, 1);
  sum(mul(y, gy)).backward();
  ASSERT_TRUE(seen.defined());
  EXPECT_TRUE(is_channels_last(seen))
      << "gradient into a channels_last input from a row-major upstream";
  const Tensor ref = ops::conv2d_backward_input(gy, w.detach(), x0.sizes(), 1, 1, 1, 1);
  EXPECT_TRUE(close(seen, ref));
  EXPECT_TRUE(is_channels_last(x.grad()));
}

// ================================================================ batch_norm

TEST(ChannelsLast, BatchNormTrainingMatchesRowMajor) {
  for (const Shape& s : {Shape{4, 3, 5, 6}, Shape{2, 16, 3, 3}, Shape{3, 5, 1, 7}}) {
    SCOPED_TRACE(shape_str(s));
    const int64_t c = s[1];
    const Tensor x0 = rand_tensor(s, DType::float32, 200, -2, 2);
    const Tensor w0 = rand_tensor({c}, DType::float32, 201, 0.5, 1.5);
    const Tensor b0 = rand_tensor({c}, DType::float32, 202, -1, 1);
    const Tensor gy = rand_tensor(s, DType::float32, 203, -1, 1);
    const Tensor rm0 = rand_tensor({c}, DType::float32, 204, -0.5, 0.5);
    const Tensor rv0 = rand_tensor({c}, DType::float32, 205, 0.5, 1.5);
    struct Run {
      Tensor out, gx, gw, gb, rm, rv;
      std::vector<Tensor> all() const { return {out, gx, gw, gb, rm, rv}; }
    };
    auto run = [&](MemoryFormat f) {
      const Tensor x = leaf_as(x0, f), w = leaf_as(w0, kRM), b = leaf_as(b0, kRM);
      const Tensor rm = ops::clone(rm0), rv = ops::clone(rv0);
      Tensor out = batch_norm(x, rm, rv, w, b, /*training=*/true, 0.1, 1e-5);
      // a second step (the running statistics updated twice)
      (void)batch_norm(x.detach(), rm, rv, w.detach(), b.detach(), true, 0.3, 1e-5);
      out.backward(ops::contiguous(gy, f));
      return Run{out, x.grad(), w.grad(), b.grad(), rm, rv};
    };
    const Run ref = run(kRM), got = run(kCL);
    EXPECT_TRUE(is_row_major(ref.out));
    EXPECT_TRUE(is_channels_last(got.out)) << "output";
    EXPECT_TRUE(is_channels_last(got.gx)) << "input gradient";
    expect_all_close(got.all(), ref.all(),
                     {"out", "dx", "dweight", "dbias", "running_mean", "running_var"}, 1e-6);
    EXPECT_EQ(got.gw.sizes(), (Shape{c}));
  }
}

TEST(ChannelsLast, BatchNormRawOpsAndEval) {
  const Shape s{3, 4, 5, 2};
  const Tensor x = rand_tensor(s, DType::float32, 210, -2, 2);
  const Tensor w = rand_tensor({4}, DType::float32, 211, 0.5, 1.5);
  const Tensor b = rand_tensor({4}, DType::float32, 212, -1, 1);
  const Tensor dy = rand_tensor(s, DType::float32, 213, -1, 1);
  const Tensor rm = rand_tensor({4}, DType::float32, 214, -0.5, 0.5);
  const Tensor rv = rand_tensor({4}, DType::float32, 215, 0.5, 1.5);
  for (bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "eval");
    auto [o, m, i] = ops::batch_norm(x, rm, rv, w, b, training);
    auto [oc, mc, ic] = ops::batch_norm(cl(x), rm, rv, w, b, training);
    EXPECT_TRUE(cl_close(oc, o));
    EXPECT_TRUE(close(mc, m));
    EXPECT_TRUE(close(ic, i));
    // dy and x channels_last; dy row-major with x channels_last: dx channels_last both times.
    for (bool dy_cl : {true, false}) {
      SCOPED_TRACE(dy_cl ? "dy channels_last" : "dy row-major");
      auto [dx, dw, db] = ops::batch_norm_backward(dy, x, m, i, w, training, {true, true, true});
      auto [dxc, dwc, dbc] = ops::batch_norm_backward(dy_cl ? cl(dy) : dy, cl(x), mc, ic, w,
                                                      training, {true, true, true});
      EXPECT_TRUE(cl_close(dxc, dx));
      EXPECT_TRUE(close(dwc, dw));
      EXPECT_TRUE(close(dbc, db));
    }
  }
  // 16-bit channels_last: the same as the row-major run.
  for (DType d : {DType::float16, DType::bfloat16}) {
    SCOPED_TRACE(dtype_name(d));
    const Tensor xd = ops::to(x, d);
    auto [o, m, i] = ops::batch_norm(xd, {}, {}, w, b, true);
    auto [oc, mc, ic] = ops::batch_norm(cl(xd), {}, {}, w, b, true);
    EXPECT_EQ(oc.dtype(), d);
    EXPECT_TRUE(is_channels_last(oc));
    EXPECT_TRUE(close(oc, o, 1e-3));
  }
}

// ================================================================ pooling

TEST(ChannelsLast, MaxPoolMatchesRowMajor) {
  const Tensor x0 = rand_tensor({2, 5, 8, 7}, DType::float32, 300, -1, 1);
  struct Case {
    const char* name;
    Int2 k, s, p, d;
    bool ceil;
  };
  for (const Case& c :
       {Case{"2x2", 2, 2, 0, 1, false}, Case{"3x3 s2 p1", 3, 2, 1, 1, false},
        Case{"3x3 s2 ceil", 3, 2, 0, 1, true}, Case{"2x2 dil2", 2, 1, 0, 2, false}}) {
    SCOPED_TRACE(c.name);
    const Tensor xr = leaf_as(x0, kRM), xc = leaf_as(x0, kCL);
    auto [yr, ir] = max_pool2d_with_indices(xr, c.k, c.s, c.p, c.d, c.ceil);
    auto [yc, ic] = max_pool2d_with_indices(xc, c.k, c.s, c.p, c.d, c.ceil);
    EXPECT_TRUE(is_channels_last(yc)) << "output";
    EXPECT_TRUE(same_values(yc, yr));
    EXPECT_TRUE(same_values(ic, ir)) << "indices";
    const Tensor gy = rand_tensor(yr.sizes(), DType::float32, 301, -1, 1);
    sum(mul(yr, gy)).backward();
    sum(mul(yc, cl(gy))).backward();
    EXPECT_TRUE(is_channels_last(xc.grad()));
    EXPECT_TRUE(same_values(xc.grad(), xr.grad()));
  }
  // max_pool2d (no indices) and avg_pool2d.
  const Tensor xr = leaf_as(x0, kRM), xc = leaf_as(x0, kCL);
  const Tensor mr = max_pool2d(xr, 2), mc = max_pool2d(xc, 2);
  EXPECT_TRUE(cl_same(mc, mr));
  const Tensor ar = avg_pool2d(xr, 3, 2, 1), ac = avg_pool2d(xc, 3, 2, 1);
  EXPECT_TRUE(cl_same(ac, ar));
  const Tensor g1 = rand_tensor(mr.sizes(), DType::float32, 302, -1, 1);
  const Tensor g2 = rand_tensor(ar.sizes(), DType::float32, 303, -1, 1);
  sum(add(sum(mul(mr, g1)), sum(mul(ar, g2)))).backward();
  sum(add(sum(mul(mc, g1)), sum(mul(ac, g2)))).backward();
  EXPECT_TRUE(is_channels_last(xc.grad()));
  EXPECT_TRUE(close(xc.grad(), xr.grad()));
}

// The gradient a pool's backward hands to a channels_last non-leaf input: in its layout
// ("the gradient comes back in the input's layout"), whatever the upstream layout.
TEST(ChannelsLast, PoolGradientsComeBackInTheInputLayout) {
  const Tensor x0 = rand_tensor({2, 4, 6, 6}, DType::float32, 310, -1, 1);
  using PoolFn = std::function<Tensor(const Tensor&)>;
  const std::vector<std::pair<const char*, PoolFn>> pools = {
      {"max_pool2d", [](const Tensor& t) { return max_pool2d(t, 2); }},
      {"avg_pool2d", [](const Tensor& t) { return avg_pool2d(t, 3, 1, 1); }},
      {"adaptive_avg_pool2d",
       [](const Tensor& t) {
         return adaptive_avg_pool2d(t, {2, 3});
       }},
  };
  for (const auto& [name, fn] : pools) {
    SCOPED_TRACE(name);
    const Tensor x = leaf_as(x0, kCL);
    const Tensor xi = mul(x, 1.0);
    ASSERT_EQ(xi.suggest_memory_format(), kCL);
    Tensor seen;
    xi.register_hook([&](const Tensor& g) {
      seen = g;
      return Tensor();
    });
    const Tensor y = fn(xi);
    sum(mul(y, rand_tensor(y.sizes(), DType::float32, 311, -1, 1))).backward();
    ASSERT_TRUE(seen.defined());
    EXPECT_TRUE(is_channels_last(seen));
  }
}

TEST(ChannelsLast, AdaptiveAvgPoolMatchesRowMajor) {
  const Tensor x0 = rand_tensor({3, 6, 7, 9}, DType::float32, 320, -1, 1);
  for (Int2 o : {Int2{1, 1}, Int2{2, 3}, Int2{7, 9}, Int2{10, 4}}) {
    SCOPED_TRACE(::testing::Message() << o.h << "x" << o.w);
    const Tensor xr = leaf_as(x0, kRM), xc = leaf_as(x0, kCL);
    const Tensor yr = adaptive_avg_pool2d(xr, o), yc = adaptive_avg_pool2d(xc, o);
    if (o.h * o.w > 1) {
      EXPECT_TRUE(is_channels_last(yc)) << "output";
    } else {
      EXPECT_TRUE(yc.is_contiguous(kCL)) << "[N, C, 1, 1]: both layouts";
    }
    EXPECT_TRUE(same_values(yc, yr));
    const Tensor gy = rand_tensor(yr.sizes(), DType::float32, 321, -1, 1);
    sum(mul(yr, gy)).backward();
    sum(mul(yc, gy)).backward();
    EXPECT_TRUE(is_channels_last(xc.grad()));
    EXPECT_TRUE(close(xc.grad(), xr.grad()));
  }
}

// ================================================================ autograd's .grad

TEST(ChannelsLast, AccumulatedGradTakesTheParameterLayout) {
  const Tensor v = rand_tensor({2, 3, 4, 5}, DType::float32, 400);
  // A channels_last leaf getting a row-major gradient (mul by a row-major tensor).
  const Tensor p = leaf_as(v, kCL);
  const Tensor g = rand_tensor({2, 3, 4, 5}, DType::float32, 401);
  sum(mul(p, g)).backward();
  EXPECT_TRUE(is_channels_last(p.grad()));
  EXPECT_TRUE(same_values(p.grad(), g));
  // A second backward accumulates into it, in place, layout kept.
  sum(mul(p, g)).backward();
  EXPECT_TRUE(is_channels_last(p.grad()));
  EXPECT_TRUE(same_values(p.grad(), ops::mul(g, 2.0)));
  // The expanded gradient of a sum (stride 0 everywhere).
  const Tensor q = leaf_as(v, kCL);
  sum(q).backward();
  EXPECT_TRUE(is_channels_last(q.grad()));
  EXPECT_TRUE(same_values(q.grad(), ops::ones({2, 3, 4, 5})));
  // A row-major leaf getting a channels_last gradient: row-major .grad.
  const Tensor r = leaf_as(v, kRM);
  sum(mul(r, cl(g))).backward();
  EXPECT_TRUE(is_row_major(r.grad()));
  EXPECT_TRUE(same_values(r.grad(), g));
  // A channels_last leaf getting a channels_last gradient.
  const Tensor s = leaf_as(v, kCL);
  sum(mul(s, cl(g))).backward();
  EXPECT_TRUE(is_channels_last(s.grad()));
  EXPECT_TRUE(same_values(s.grad(), g));
  // A float64 gradient into a float32 channels_last leaf (dtype and layout both converted).
  const Tensor t = leaf_as(v, kCL);
  sum(mul(t.to(DType::float64), ops::to(g, DType::float64))).backward();
  EXPECT_EQ(t.grad().dtype(), DType::float32);
  EXPECT_TRUE(is_channels_last(t.grad()));
  EXPECT_TRUE(same_values(t.grad(), g));
}

// ================================================================ a small block end to end

TEST(ChannelsLast, ConvBnReluBlockMatchesRowMajor) {
  const Tensor x0 = rand_tensor({2, 4, 6, 6}, DType::float32, 500, -1, 1);
  const Tensor w10 = rand_tensor({4, 4, 3, 3}, DType::float32, 501, -0.3, 0.3);
  const Tensor w20 = rand_tensor({4, 4, 3, 3}, DType::float32, 502, -0.3, 0.3);
  struct Run {
    Tensor out, gx, gw1, gw2, gbw, gbb;
    std::vector<Tensor> all() const { return {out, gx, gw1, gw2, gbw, gbb}; }
  };
  auto run = [&](MemoryFormat f) {
    const Tensor x = leaf_as(x0, f), w1 = leaf_as(w10, f), w2 = leaf_as(w20, f);
    const Tensor bw = leaf_as(ops::ones({4}), kRM), bb = leaf_as(ops::zeros({4}), kRM);
    const Tensor rm = ops::zeros({4}), rv = ops::ones({4});
    Tensor h = relu(batch_norm(conv2d(x, w1, {}, 1, 1), rm, rv, bw, bb, true));
    h = batch_norm(conv2d(h, w2, {}, 1, 1), rm, rv, bw, bb, true);
    Tensor out = add_relu(h, x);
    Tensor pooled = adaptive_avg_pool2d(out, {1, 1});
    sum(mul(pooled, pooled)).backward();
    return Run{out, x.grad(), w1.grad(), w2.grad(), bw.grad(), bb.grad()};
  };
  const Run ref = run(kRM), got = run(kCL);
  EXPECT_TRUE(is_channels_last(got.out));
  EXPECT_TRUE(is_channels_last(got.gx));
  EXPECT_TRUE(is_channels_last(got.gw1));
  EXPECT_TRUE(is_channels_last(got.gw2));
  expect_all_close(got.all(), ref.all(), {"out", "dx", "dw1", "dw2", "bn weight", "bn bias"}, 1e-5);
}

// ================================================================ errors

TEST(ChannelsLast, ErrorsNameTheOpAndShape) {
  const Tensor t3 = ops::zeros({2, 3, 4});
  expect_error<std::invalid_argument>([&] { ops::contiguous(t3, kCL); },
                                      {"contiguous", "[2, 3, 4]", "channels_last"});
  expect_error<std::invalid_argument>([&] { ops::contiguous(ops::zeros({6}), kCL); },
                                      {"contiguous", "[6]"});
  expect_error<std::invalid_argument>(
      [&] {
        ops::contiguous(ops::zeros({1, 2, 3, 4, 5}), kCL);
      },
      {"contiguous", "[1, 2, 3, 4, 5]"});
  // Through Tensor::contiguous (autograd) too.
  expect_error<std::invalid_argument>([&] { (void)t3.contiguous(kCL); },
                                      {"contiguous", "[2, 3, 4]"});
  // alloc_output with channels_last and a 3-D shape.
  expect_error<std::invalid_argument>(
      [&] {
        alloc_output({2, 3, 4}, DType::float32, Device::cpu(), kCL);
      },
      {"alloc_output", "[2, 3, 4]"});
  // A 3-D tensor asked for row-major is fine.
  EXPECT_EQ(ops::contiguous(t3, kRM).storage().data(), t3.storage().data());
  // flat_view of a non-dense tensor is a logic error naming its shape.
  expect_error<std::logic_error>(
      [&] {
        flat_view(ops::slice(ops::zeros({2, 3, 4, 6}), 3, 0, 6, 2));
      },
      {"flat_view", "[2, 3, 4, 3]"});
}

// ================================================================ modules and optimizers

// Module::to(MemoryFormat) lays the 4-D parameters out channels_last in place (same handles; a
// 1x1 kernel's [O, C, 1, 1] is the same memory either way, so is_contiguous(channels_last) is
// what is checked);
// SGD with momentum and AdamW then train a conv-bn-relu model exactly as the row-major copy
// does (the CPU kernels run both as NCHW): the parameters, their gradients and the optimizer
// state stay channels_last, and the optimizer's state_dict round trip keeps the values.
TEST(ChannelsLast, ModuleToChannelsLastTrainsLikeRowMajor) {
  for (const bool adam : {false, true}) {
    SCOPED_TRACE(adam ? "AdamW" : "SGD momentum");
    auto make = [] {
      Generator gen(7);
      return std::make_shared<nn::Sequential>(
          std::make_shared<nn::Conv2d>(3, 8, 3, nn::Conv2dOptions{.padding = 1}, &gen),
          std::make_shared<nn::BatchNorm2d>(8), std::make_shared<nn::ReLU>(),
          std::make_shared<nn::Conv2d>(8, 4, 1, nn::Conv2dOptions{.bias = false}, &gen));
    };
    auto rm_model = make(), cl_model = make();
    const Tensor w_handle = cl_model->parameters()[0];
    cl_model->to(kCL);
    EXPECT_TRUE(w_handle.is_same(cl_model->parameters()[0])) << "the same handle, restrided";
    for (const Tensor& p : cl_model->parameters()) {
      if (p.dim() == 4) {
        EXPECT_TRUE(p.is_contiguous(kCL)) << p.shape_string();
      }
    }
    auto make_opt = [&](nn::Module& m) -> std::unique_ptr<optim::Optimizer> {
      if (adam)
        return std::make_unique<optim::AdamW>(m.parameters(), optim::AdamOptions{.lr = 1e-2});
      return std::make_unique<optim::SGD>(m.parameters(),
                                          optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    };
    auto rm_opt = make_opt(*rm_model), cl_opt = make_opt(*cl_model);
    const Tensor x = rand_tensor({2, 3, 6, 5}, DType::float32, 11);
    for (int step = 0; step < 3; ++step) {
      for (auto [m, o, in] : {std::tuple{rm_model.get(), rm_opt.get(), x},
                              std::tuple{cl_model.get(), cl_opt.get(), cl(x)}}) {
        o->zero_grad(true);
        const Tensor y = (*m)(in);
        tally::mul(y, y).sum().backward();
        o->step();
      }
    }
    const auto rp = rm_model->parameters(), cp = cl_model->parameters();
    ASSERT_EQ(rp.size(), cp.size());
    for (size_t i = 0; i < rp.size(); ++i) {
      EXPECT_TRUE(close(cp[i], rp[i], 1e-5)) << "parameter " << i;
      if (cp[i].dim() == 4) {
        EXPECT_TRUE(cp[i].grad().is_contiguous(kCL)) << "gradient " << i;
        for (const auto& [name, t] : cl_opt->state(i).tensors) {
          if (t.dim() == 4) {
            EXPECT_TRUE(t.is_contiguous(kCL)) << "state " << name << " of parameter " << i;
          }
        }
      }
    }
    // The state_dict's values are the element values (a row-major optimizer's, here).
    const optim::OptimizerStateDict rs = rm_opt->state_dict(), cs = cl_opt->state_dict();
    for (const auto& [key, t] : rs.tensors) EXPECT_TRUE(close(cs.tensors.at(key), t, 1e-5)) << key;
    cl_opt->load_state_dict(cs);
    for (size_t i = 0; i < cp.size(); ++i) {
      for (const auto& [name, t] : cl_opt->state(i).tensors) {
        if (t.dim() == 4) {
          EXPECT_TRUE(t.is_contiguous(kCL)) << "reloaded state " << name;
        }
      }
    }
  }
}

// A parameter that is neither row-major nor channels_last is refused by name.
TEST(ChannelsLast, OptimizerRefusesAParameterInNoMemoryFormat) {
  Tensor p = ops::permute(rand_tensor({2, 3, 4, 5}, DType::float32, 3), {0, 2, 1, 3});
  p.requires_grad_(true);
  try {
    optim::SGD opt({p}, optim::SGDOptions{.lr = 0.1});
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("neither contiguous nor channels_last"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tally
