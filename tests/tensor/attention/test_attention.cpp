// scaled_dot_product_attention: values against a hand composition, causal and explicit
// masks, dropout, gradients in float64. The fused attention op's CPU reference
// (ops::flash_attention_forward/backward, tally::flash_attention): equal to the composite in
// float64, its log-sum-exp, its gradients by finite differences, strided inputs, errors.
#include <cmath>
#include <limits>

#include "tensor/attention/autograd.h"
#include "tensor/attention/ops.h"
#include "tensor/linalg/ops.h"
#include "tensor/shape/autograd.h"
#include "tensor/softmax/autograd.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using namespace testing;

TEST(Attention, MatchesTheDefinition) {
  const Tensor q = rand_input({2, 3, 4}, -1, 1, 1), k = rand_input({2, 5, 4}, -1, 1, 2),
               v = rand_input({2, 5, 6}, -1, 1, 3);
  const Tensor out = scaled_dot_product_attention(q, k, v);
  EXPECT_EQ(out.sizes(), (Shape{2, 3, 6}));
  const Tensor ref = matmul(softmax(matmul(q, k.transpose(1, 2)) * 0.5, -1), v);
  EXPECT_TRUE(values_near(out, ref.tolist(), 1e-12));
}

TEST(Attention, CausalMaskKeepsThePast) {
  // With v = identity rows, row i of the output is the attention distribution: zero for j > i.
  const Tensor q = rand_input({4, 3}, -1, 1, 4), k = rand_input({4, 3}, -1, 1, 5);
  const Tensor v = ops::to(from_vector({1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1}, {4, 4}),
                           DType::float64);
  const std::vector<double> p = scaled_dot_product_attention(q, k, v, {}, 0.0, true).tolist();
  for (int i = 0; i < 4; ++i) {
    double row = 0;
    for (int j = 0; j < 4; ++j) {
      if (j > i) {
        EXPECT_EQ(p[static_cast<size_t>(i * 4 + j)], 0.0);
      }
      row += p[static_cast<size_t>(i * 4 + j)];
    }
    EXPECT_NEAR(row, 1.0, 1e-12);
  }
  EXPECT_NEAR(p[0], 1.0, 1e-12);  // the first query sees only the first key
  // A bool mask equal to the causal one gives the same result.
  const Tensor mask = from_vector({1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1}, {4, 4},
                                  TensorOptions{}.with_dtype(DType::bool_));
  EXPECT_TRUE(values_near(scaled_dot_product_attention(q, k, v, mask), p, 1e-12));
  EXPECT_THROW(scaled_dot_product_attention(q, k, v, mask, 0.0, true), std::invalid_argument);
  EXPECT_THROW(scaled_dot_product_attention(q, rand_input({4, 2}), v), std::invalid_argument);
}

TEST(Attention, Gradients) {
  const Tensor q = rand_input({2, 3, 4}, -1, 1, 6), k = rand_input({2, 3, 4}, -1, 1, 7),
               v = rand_input({2, 3, 2}, -1, 1, 8);
  EXPECT_TRUE(
      gradcheck([](const TensorList& x) { return scaled_dot_product_attention(x[0], x[1], x[2]); },
                {q, k, v}));
  EXPECT_TRUE(gradcheck(
      [](const TensorList& x) {
        return scaled_dot_product_attention(x[0], x[1], x[2], {}, 0.0, true);
      },
      {q, k, v}));
  const Tensor bias = ops::to(from_vector({0, -1, 2, 0.5, 0, -3, 1, 1, 0}, {3, 3}), DType::float64);
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& x) {
        return scaled_dot_product_attention(x[0], x[1], x[2], bias, 0.0, false, 0.3);
      },
      {q, k, v}));
}

TEST(Attention, DropoutReplaysWithTheSameGenerator) {
  const Tensor q = rand_input({8, 4}, -1, 1, 9), k = rand_input({8, 4}, -1, 1, 10),
               v = rand_input({8, 4}, -1, 1, 11);
  Generator g1(3), g2(3);
  const Tensor a = scaled_dot_product_attention(q, k, v, {}, 0.5, false, std::nullopt, &g1);
  const Tensor b = scaled_dot_product_attention(q, k, v, {}, 0.5, false, std::nullopt, &g2);
  EXPECT_TRUE(values_near(a, b.tolist(), 0));
  EXPECT_FALSE(values_near(a, scaled_dot_product_attention(q, k, v).tolist(), 1e-9));
}

// The log-sum-exp of the scaled scores per row, by the composite ops (float64).
Tensor reference_lse(const Tensor& q, const Tensor& k, double scale, bool causal) {
  NoGradGuard ng;
  Tensor s = ops::mul(ops::matmul(q, ops::transpose(k, -2, -1)), scale);
  if (causal) {
    const int64_t L = q.size(-2), S = k.size(-2);
    const Tensor rows = ops::reshape(ops::arange(0, static_cast<double>(L)), {L, 1});
    const Tensor cols = ops::reshape(ops::arange(0, static_cast<double>(S)), {1, S});
    s = ops::masked_fill(s, ops::binary(ops::BinaryOp::gt, cols, rows),
                         -std::numeric_limits<double>::infinity());
  }
  return ops::unary(ops::UnaryOp::log, ops::sum(ops::unary(ops::UnaryOp::exp, s), {-1}));
}

TEST(FlashAttentionReference, EqualsTheComposite) {
  for (const bool causal : {false, true}) {
    for (const int64_t S : {5, 7}) {  // L == S and L != S (causal: top-left aligned)
      const Tensor q = rand_input({2, 3, 5, 4}, -1, 1, 21), k = rand_input({2, 3, S, 4}, -1, 1, 22),
                   v = rand_input({2, 3, S, 6}, -1, 1, 23);
      const ops::FlashAttentionOutput r = ops::flash_attention_forward(q, k, v, causal, 0.5);
      EXPECT_EQ(r.out.sizes(), (Shape{2, 3, 5, 6}));
      EXPECT_EQ(r.lse.sizes(), (Shape{2, 3, 5}));
      EXPECT_EQ(r.lse.dtype(), DType::float64);
      const Tensor ref = scaled_dot_product_attention(q, k, v, {}, 0.0, causal, 0.5);
      EXPECT_TRUE(values_near(r.out, ref.tolist(), 1e-12)) << "causal " << causal << " S " << S;
      EXPECT_TRUE(values_near(r.lse, reference_lse(q, k, 0.5, causal).tolist(), 1e-12));
      // The differentiable wrapper gives the same values and saves q, k, v, out and lse only.
      const Tensor f = flash_attention(q, k, v, causal, 0.5);
      EXPECT_TRUE(values_near(f, ref.tolist(), 1e-12));
      const std::vector<Tensor> saved = saved_by(f);
      ASSERT_EQ(saved.size(), 5u);
      EXPECT_EQ(saved[4].sizes(), (Shape{2, 3, 5}));
      int64_t saved_elems = 0;
      for (const Tensor& t : saved) saved_elems += t.numel();
      EXPECT_EQ(saved_elems, q.numel() + k.numel() + v.numel() + f.numel() + 2 * 3 * 5);
    }
  }
}

TEST(FlashAttentionReference, FloatLseAndLowPrecision) {
  const Tensor q = rand_input({3, 6, 8}, -1, 1, 24), k = rand_input({3, 6, 8}, -1, 1, 25),
               v = rand_input({3, 6, 8}, -1, 1, 26);
  const Tensor ref = scaled_dot_product_attention(q, k, v, {}, 0.0, true);
  for (const DType d : {DType::float32, DType::bfloat16}) {
    const ops::FlashAttentionOutput r = ops::flash_attention_forward(
        ops::to(q, d), ops::to(k, d), ops::to(v, d), true, 1 / std::sqrt(8.0));
    EXPECT_EQ(r.out.dtype(), d);
    EXPECT_EQ(r.lse.dtype(), DType::float32);
    EXPECT_TRUE(values_near(r.out, ref.tolist(), d == DType::float32 ? 1e-5 : 2e-2));
  }
}

TEST(FlashAttentionReference, Gradients) {
  const Tensor q = rand_input({2, 4, 3}, -1, 1, 27), k = rand_input({2, 5, 3}, -1, 1, 28),
               v = rand_input({2, 5, 2}, -1, 1, 29);
  EXPECT_TRUE(
      gradcheck([](const TensorList& x) { return flash_attention(x[0], x[1], x[2]); }, {q, k, v}));
  EXPECT_TRUE(gradcheck(
      [](const TensorList& x) { return flash_attention(x[0], x[1], x[2], true, 0.7); }, {q, k, v}));
  const Tensor q4 = rand_input({1, 2, 4, 3}, -1, 1, 30), k4 = rand_input({1, 2, 4, 3}, -1, 1, 31),
               v4 = rand_input({1, 2, 4, 3}, -1, 1, 32);
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return flash_attention(x[0], x[1], x[2], true); },
                        {q4, k4, v4}));
}

TEST(FlashAttentionReference, BackwardOpEqualsTheCompositeGradients) {
  const Tensor q = rand_input({2, 2, 6, 4}, -1, 1, 33), k = rand_input({2, 2, 6, 4}, -1, 1, 34),
               v = rand_input({2, 2, 6, 4}, -1, 1, 35);
  const Tensor g = ops::randn({2, 2, 6, 4}, DType::float64);
  for (const bool causal : {false, true}) {
    const Tensor ref = scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
    ref.backward(g);
    const std::vector<double> gq = q.grad().tolist(), gk = k.grad().tolist(),
                              gv = v.grad().tolist();
    q.set_grad(Tensor());
    k.set_grad(Tensor());
    v.set_grad(Tensor());
    const ops::FlashAttentionOutput r = ops::flash_attention_forward(q, k, v, causal, 0.5);
    const ops::FlashAttentionGrads d =
        ops::flash_attention_backward(g, q, k, v, r.out, r.lse, causal, 0.5);
    EXPECT_TRUE(values_near(d.dq, gq, 1e-10));
    EXPECT_TRUE(values_near(d.dk, gk, 1e-10));
    EXPECT_TRUE(values_near(d.dv, gv, 1e-10));
  }
}

TEST(FlashAttentionReference, StridedSplitHeadsAndErrors) {
  // GPT's split heads: [B, T, H, D] viewed as [B, H, T, D] (not contiguous).
  const Tensor base_q = rand_input({2, 5, 3, 4}, -1, 1, 36),
               base_k = rand_input({2, 5, 3, 4}, -1, 1, 37),
               base_v = rand_input({2, 5, 3, 4}, -1, 1, 38);
  const Tensor q = ops::transpose(base_q, 1, 2), k = ops::transpose(base_k, 1, 2),
               v = ops::transpose(base_v, 1, 2);
  ASSERT_FALSE(q.is_contiguous());
  const ops::FlashAttentionOutput r = ops::flash_attention_forward(q, k, v, true, 0.5);
  const ops::FlashAttentionOutput c = ops::flash_attention_forward(
      ops::contiguous(q), ops::contiguous(k), ops::contiguous(v), true, 0.5);
  EXPECT_TRUE(values_near(r.out, c.out.tolist(), 0));
  EXPECT_TRUE(values_near(r.lse, c.lse.tolist(), 0));
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::flash_attention_forward(q, rand_input({2, 3, 5, 2}), v, false, 1.0);
      },
      {"flash_attention_forward", "[2, 3, 5, 2]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::flash_attention_forward(q, rand_input({2, 4, 5, 4}), v, false, 1.0);
      },
      {"flash_attention_forward", "leading"});
  EXPECT_FALSE(ops::flash_attention_supported(q, rand_input({2, 4, 5, 4}), v));
  EXPECT_TRUE(ops::flash_attention_supported(q, k, v));
}

// GPT's layout: q, k, v split from one [B, T, 3C] projection and viewed as heads. The output
// comes back token-major (its transpose(1, 2) is contiguous: no copy before c_proj), the
// gradients of q, k, v land in one [B, T, 3C] buffer and the split's backward hands that buffer
// on as a view instead of concatenating. Values equal the unpacked path's.
TEST(FlashAttentionReference, PackedQkvIsReadAndWrittenInPlace) {
  const int64_t B = 2, T = 5, H = 3, D = 4, C = H * D;
  const Tensor x = rand_input({B, T, 3 * C}, -1, 1, 40);
  auto heads = [&](const Tensor& t) {
    return t.reshape({t.size(0), t.size(1), H, D}).transpose(1, 2);
  };
  const Tensor g = ops::randn({B, H, T, D}, DType::float64);
  const TensorList qkv = split(x, C, 2);
  const Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  const Tensor out = flash_attention(q, k, v, true, 0.5);
  EXPECT_TRUE(out.transpose(1, 2).is_contiguous());
  out.backward(g);
  const Tensor packed_grad = x.grad();
  ASSERT_TRUE(packed_grad.defined());

  const ops::FlashAttentionOutput r = ops::flash_attention_forward(q, k, v, true, 0.5);
  const ops::FlashAttentionGrads d =
      ops::flash_attention_backward(g, q, k, v, r.out, r.lse, true, 0.5);
  EXPECT_TRUE(d.dq.storage().is_same(d.dk.storage()));
  EXPECT_TRUE(d.dq.storage().is_same(d.dv.storage()));
  EXPECT_EQ(d.dk.storage_offset() - d.dq.storage_offset(), C);

  // The same attention on contiguous copies (separate gradients, concatenated by the split).
  x.set_grad(Tensor());
  const TensorList qkv2 = split(x, C, 2);
  const Tensor out2 = flash_attention(heads(qkv2[0]).contiguous(), heads(qkv2[1]).contiguous(),
                                      heads(qkv2[2]).contiguous(), true, 0.5);
  EXPECT_TRUE(values_near(out, out2.tolist(), 1e-12));
  out2.backward(g);
  EXPECT_TRUE(values_near(packed_grad, x.grad().tolist(), 1e-12));

  // And against finite differences through the split.
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& in) {
        const TensorList p = split(in[0], C, 2);
        return flash_attention(heads(p[0]), heads(p[1]), heads(p[2]), true, 0.5);
      },
      {rand_input({1, 3, 3 * C}, -1, 1, 41)}));
}

}  // namespace
}  // namespace tally
