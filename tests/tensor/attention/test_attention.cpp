// Attention, one file for every device (tests/testing/devices.h).
// What the cases cover: docs/notes.md §21.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

#include "autograd/node.h"
#include "tensor/attention/autograd.h"
#include "tensor/attention/ops.h"
#include "tensor/linalg/ops.h"
#include "tensor/shape/autograd.h"
#include "tensor/softmax/autograd.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

#if defined(TALLY_WITH_CUDA)
#include "memory/caching_allocator.h"
#include "memory/meta.h"
#include "tensor/attention/cuda.h"
#include "tensor/cuda/graph.h"
#include "tensor/cuda/runtime.h"
#include "tensor/precision.h"
#endif

namespace tally {
namespace {

using namespace testing;

// scaled_dot_product_attention on every device; inputs are float64 CPU leaves put on dev().
class Attention : public OnDevice {};
TALLY_ON_DEVICES(Attention);

TEST_P(Attention, MatchesTheDefinition) {
  const Tensor q = put(rand_input({2, 3, 4}, -1, 1, 1)), k = put(rand_input({2, 5, 4}, -1, 1, 2)),
               v = put(rand_input({2, 5, 6}, -1, 1, 3));
  const Tensor out = scaled_dot_product_attention(q, k, v);
  EXPECT_EQ(out.sizes(), (Shape{2, 3, 6}));
  const Tensor ref = matmul(softmax(matmul(q, k.transpose(1, 2)) * 0.5, -1), v);
  EXPECT_TRUE(values_near(out, ref.tolist(), 1e-12));
}

TEST_P(Attention, CausalMaskKeepsThePast) {
  // With v = identity rows, row i of the output is the attention distribution: zero for j > i.
  const Tensor q = put(rand_input({4, 3}, -1, 1, 4)), k = put(rand_input({4, 3}, -1, 1, 5));
  const Tensor v = from_vector({1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1}, {4, 4}, on(f64));
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
                                  on(TensorOptions{}.with_dtype(DType::bool_)));
  EXPECT_TRUE(values_near(scaled_dot_product_attention(q, k, v, mask), p, 1e-12));
  EXPECT_THROW(scaled_dot_product_attention(q, k, v, mask, 0.0, true), std::invalid_argument);
  EXPECT_THROW(scaled_dot_product_attention(q, put(rand_input({4, 2})), v), std::invalid_argument);
}

TEST_P(Attention, Gradients) {
  const Tensor q = rand_input({2, 3, 4}, -1, 1, 6), k = rand_input({2, 3, 4}, -1, 1, 7),
               v = rand_input({2, 3, 2}, -1, 1, 8);
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& x) { return scaled_dot_product_attention(x[0], x[1], x[2]); },
      {q, k, v}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& x) {
                             return scaled_dot_product_attention(x[0], x[1], x[2], {}, 0.0, true);
                           },
                           {q, k, v}));
  const Tensor bias = from_vector({0, -1, 2, 0.5, 0, -3, 1, 1, 0}, {3, 3}, on(f64));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& x) {
                             return scaled_dot_product_attention(x[0], x[1], x[2], bias, 0.0, false,
                                                                 0.3);
                           },
                           {q, k, v}));
}

TEST_P(Attention, DropoutReplaysWithTheSameGenerator) {
  const Tensor q = put(rand_input({8, 4}, -1, 1, 9)), k = put(rand_input({8, 4}, -1, 1, 10)),
               v = put(rand_input({8, 4}, -1, 1, 11));
  Generator g1(3), g2(3);
  const Tensor a = scaled_dot_product_attention(q, k, v, {}, 0.5, false, std::nullopt, false, &g1);
  const Tensor b = scaled_dot_product_attention(q, k, v, {}, 0.5, false, std::nullopt, false, &g2);
  EXPECT_TRUE(values_near(a, b.tolist(), 0));
  EXPECT_FALSE(values_near(a, scaled_dot_product_attention(q, k, v).tolist(), 1e-9));
}

// Masks broadcast over the batch and heads; a bool mask and the float mask of 0 / -inf agree.
TEST_P(Attention, MasksBroadcastBoolAndFloatAgree) {
  const Tensor q = put(rand_input({2, 3, 4, 5}, -1, 1, 21)),
               k = put(rand_input({2, 3, 6, 5}, -1, 1, 22)),
               v = put(rand_input({2, 3, 6, 2}, -1, 1, 23));
  const auto b = on(TensorOptions{}.with_dtype(DType::bool_));
  // [L, S]: row i may see keys j <= i + 1, and [2, 1, 1, S]: batch 1 drops the last key.
  std::vector<double> m(24), pad(12, 1.0);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) m[static_cast<size_t>(i * 6 + j)] = j <= i + 1;
  pad[11] = 0;
  const Tensor lm = from_vector(m, {4, 6}, b), pm = from_vector(pad, {2, 1, 1, 6}, b);
  const double ninf = -std::numeric_limits<double>::infinity();
  const auto as_float = [&](const std::vector<double>& x, const Shape& shape) {
    std::vector<double> f(x.size());
    for (size_t i = 0; i < x.size(); ++i) f[i] = x[i] != 0 ? 0.0 : ninf;
    return from_vector(f, shape, on(f64));
  };
  EXPECT_TRUE(values_near(scaled_dot_product_attention(q, k, v, lm),
                          scaled_dot_product_attention(q, k, v, as_float(m, {4, 6})).tolist(),
                          1e-12));
  EXPECT_TRUE(values_near(
      scaled_dot_product_attention(q, k, v, pm),
      scaled_dot_product_attention(q, k, v, as_float(pad, {2, 1, 1, 6})).tolist(), 1e-12));
  // The padding mask leaves batch 0 as without a mask and batch 1 as without its last key.
  const Tensor out = scaled_dot_product_attention(q, k, v, pm);
  EXPECT_TRUE(values_near(out.select(0, 0),
                          scaled_dot_product_attention(q, k, v).select(0, 0).tolist(), 1e-12));
  EXPECT_TRUE(
      values_near(out.select(0, 1),
                  scaled_dot_product_attention(q.select(0, 1), k.select(0, 1).narrow(1, 0, 5),
                                               v.select(0, 1).narrow(1, 0, 5))
                      .tolist(),
                  1e-12));
}

// A row the mask leaves without any key gives zeros (PyTorch's _safe_softmax), with finite
// gradients.
TEST_P(Attention, FullyMaskedRowGivesZeros) {
  const auto b = on(TensorOptions{}.with_dtype(DType::bool_));
  const Tensor mask = from_vector({1, 1, 0, 0, 0, 0, 0, 1, 1}, {3, 3}, b);
  const Tensor q = rand_input({2, 3, 4}, -1, 1, 24), k = rand_input({2, 3, 4}, -1, 1, 25),
               v = rand_input({2, 3, 2}, -1, 1, 26);
  const std::vector<double> out =
      scaled_dot_product_attention(put(q), put(k), put(v), mask).tolist();
  for (int n = 0; n < 2; ++n)
    for (int c = 0; c < 2; ++c) EXPECT_EQ(out[static_cast<size_t>(n * 6 + 2 + c)], 0.0);
  EXPECT_TRUE(gradcheck_on(
      dev(),
      [&](const TensorList& x) { return scaled_dot_product_attention(x[0], x[1], x[2], mask); },
      {q, k, v}));
}

// enable_gqa: 4 query heads over 2 key/value heads equal attention with each key/value head
// repeated for its two query heads; gradients for masks, causal and GQA in float64.
TEST_P(Attention, GroupedQueryAttention) {
  const Tensor q = rand_input({2, 4, 3, 4}, -1, 1, 27), k = rand_input({2, 2, 5, 4}, -1, 1, 28),
               v = rand_input({2, 2, 5, 3}, -1, 1, 29);
  for (const bool causal : {false, true}) {
    const Tensor out =
        scaled_dot_product_attention(put(q), put(k), put(v), {}, 0.0, causal, std::nullopt, true);
    EXPECT_EQ(out.sizes(), (Shape{2, 4, 3, 3}));
    for (int64_t h = 0; h < 4; ++h) {
      const Tensor ref = scaled_dot_product_attention(put(q).select(1, h), put(k).select(1, h / 2),
                                                      put(v).select(1, h / 2), {}, 0.0, causal);
      EXPECT_TRUE(values_near(out.select(1, h), ref.tolist(), 1e-12)) << "head " << h;
    }
  }
  const auto b = on(TensorOptions{}.with_dtype(DType::bool_));
  const Tensor mask = from_vector({1, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 1}, {3, 5}, b);
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& x) {
                             return scaled_dot_product_attention(x[0], x[1], x[2], mask, 0.0, false,
                                                                 std::nullopt, true);
                           },
                           {q, k, v}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& x) {
                             return scaled_dot_product_attention(x[0], x[1], x[2], {}, 0.0, true,
                                                                 std::nullopt, true);
                           },
                           {q, k, v}));
  const Tensor bias = put(rand_input({1, 3, 5}, -2, 2, 30));  // float mask over batch and heads
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& x) {
                             return scaled_dot_product_attention(x[0], x[1], x[2], bias, 0.0, false,
                                                                 0.4, true);
                           },
                           {q, k, v}));
}

TEST_P(Attention, BadMasksAndHeadsNameTheShapes) {
  const Tensor q = put(rand_input({2, 4, 3, 4}, -1, 1, 31)),
               k = put(rand_input({2, 2, 5, 4}, -1, 1, 32)),
               v = put(rand_input({2, 2, 5, 4}, -1, 1, 33));
  const auto expect_error = [](const auto& fn, const std::string& part) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one naming " << part;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  const Tensor k4 = put(rand_input({2, 4, 5, 4}, -1, 1, 34)),
               v4 = put(rand_input({2, 4, 5, 4}, -1, 1, 35));
  expect_error(
      [&] {
        scaled_dot_product_attention(q, k4, v4, put(rand_input({3, 4}, -1, 1, 36)));
      },
      "attn_mask of shape [3, 4] does not broadcast to the attention weights' shape [2, 4, 3, 5]");
  expect_error(
      [&] {
        scaled_dot_product_attention(
            q, k4, v4,
            from_vector({1, 0, 1, 0, 1}, {5}, on(TensorOptions{}.with_dtype(DType::int64))));
      },
      "attn_mask must be bool");
  expect_error([&] { scaled_dot_product_attention(q, k, v); }, "need enable_gqa=True");
  const Tensor k3 = put(rand_input({2, 3, 5, 4}, -1, 1, 37));
  expect_error([&] { scaled_dot_product_attention(q, k3, k3, {}, 0.0, false, std::nullopt, true); },
               "query heads (4) to be a multiple of the key heads (3)");
}

// The fused rotary embedding (HF's apply_rotary_pos_emb) against its composite, on every device
// in float64 (CUDA's kernel against the CPU's composite), with LLaMA's [B, T, H, D] layout and
// its [T, 1, D] tables, a strided x, and in bfloat16 against the CPU kernel.
TEST_P(Attention, RotaryEmbeddingEqualsTheComposite) {
  const auto composite = [](const Tensor& x, const Tensor& c, const Tensor& s) {
    const int64_t h = x.size(-1) / 2;
    return add(mul(x, c), mul(cat({neg(x.narrow(-1, h, h)), x.narrow(-1, 0, h)}, -1), s));
  };
  const Tensor x = put(rand_input({2, 5, 3, 8}, -1, 1, 41)).detach();
  // Tables whose halves differ (HF's repeat their halves; the kernel must not rely on it).
  const Tensor c = put(rand_input({5, 1, 8}, -1, 1, 42)).detach(),
               s = put(rand_input({5, 1, 8}, -1, 1, 43)).detach();
  EXPECT_TRUE(values_near(rotary_embedding(x, c, s), composite(x, c, s).tolist(), 1e-14));
  const Tensor xg = put(rand_input({2, 5, 3, 8}, -1, 1, 41)).detach().requires_grad_(true);
  EXPECT_EQ(rotary_embedding(xg, c, s).autograd_meta()->grad_fn->name(), "RotaryEmbeddingBackward");
  const Tensor xt = x.transpose(1, 2);  // [2, 3, 5, 8], strided
  const Tensor ct = c.transpose(0, 1), st = s.transpose(0, 1);
  EXPECT_TRUE(values_near(rotary_embedding(xt, ct, st), composite(xt, ct, st).tolist(), 1e-14));
  EXPECT_TRUE(gradcheck_on(dev(), [&](const TensorList& v) { return rotary_embedding(v[0], c, s); },
                           {rand_input({2, 5, 3, 8}, -1, 1, 44)}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& v) { return rotary_embedding(v[0].transpose(1, 2), ct, st); },
      {rand_input({2, 5, 3, 8}, -1, 1, 45)}));
  // Tables that require grad take the composite, whose gradients reach them too.
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& v) { return rotary_embedding(v[0], v[1], v[2]); },
      {rand_input({4, 6}, -1, 1, 46), rand_input({6}, -1, 1, 47), rand_input({4, 6}, -1, 1, 48)}));
  // bfloat16 on this device against the CPU's kernel in bfloat16.
  const auto bf = [](const Tensor& t) { return ops::to(t, DType::bfloat16); };
  const auto cpu_bf = [](const Tensor& t) { return ops::to(t, Device::cpu(), DType::bfloat16); };
  EXPECT_TRUE(values_near(rotary_embedding(bf(x), bf(c), bf(s)),
                          ops::rotary_embedding(cpu_bf(x), cpu_bf(c), cpu_bf(s)).tolist(), 1e-2));
  EXPECT_TRUE(values_near(ops::rotary_embedding_backward(bf(x), bf(c), bf(s)),
                          ops::rotary_embedding_backward(cpu_bf(x), cpu_bf(c), cpu_bf(s)).tolist(),
                          1e-2));
  // Errors name the op and what is wrong.
  using testing::expect_error;
  const Tensor odd = put(rand_input({3, 5}, -1, 1, 49));
  expect_error<std::invalid_argument>([&] { rotary_embedding(odd, odd, odd); },
                                      {"rotary_embedding", "needs a last dim of even size"});
  const Tensor wide = put(rand_input({3, 2, 5, 1, 8}, -1, 1, 50));
  expect_error<std::invalid_argument>([&] { ops::rotary_embedding(x, wide, s); },
                                      {"rotary_embedding", "does not broadcast to x [2, 5, 3, 8]"});
  expect_error<std::invalid_argument>([&] { ops::rotary_embedding(x, bf(c), s); },
                                      {"rotary_embedding", "must share one floating dtype"});
}

// The fused op's CPU reference kernel, in float64: a CPU internal (the CUDA kernels take float32
// and 16-bit inputs; AttentionVsCpu measures them against this reference).
class FlashAttentionReference : public OnDevice {
 protected:
  void SetUp() override {
    OnDevice::SetUp();
    if (!on_cpu()) GTEST_SKIP() << "the fused op's float64 reference kernel is the CPU's";
  }
};
TALLY_ON_DEVICES(FlashAttentionReference);

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

TEST_P(FlashAttentionReference, EqualsTheComposite) {
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

TEST_P(FlashAttentionReference, FloatLseAndLowPrecision) {
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

TEST_P(FlashAttentionReference, Gradients) {
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

// t [B, Hk, S, D] with each head repeated twice ([B, 2 Hk, S, D]): the heads G = 2 gives.
Tensor repeat2(const Tensor& t) {
  const int64_t B = t.size(0), H = t.size(1), S = t.size(2), D = t.size(3);
  return t.unsqueeze(2).expand({B, H, 2, S, D}).reshape({B, 2 * H, S, D});
}

// A bool mask [2, 4, 5, 6] of a fixed pattern with row (0, 1, 2) left without any key.
Tensor pattern_mask(const Device& device) {
  std::vector<double> m(2 * 4 * 5 * 6);
  for (size_t i = 0; i < m.size(); ++i) m[i] = (i * 7 + i / 6) % 5 != 0;
  for (size_t j = 0; j < 6; ++j) m[((0 * 4 + 1) * 5 + 2) * 6 + j] = 0;
  return from_vector(m, {2, 4, 5, 6}, TensorOptions{}.with_dtype(DType::bool_).with_device(device));
}

// The fused op's mask and grouped-query heads equal the composite (masked_fill / add,
// _safe_softmax, key/value heads repeated): bool masks [B, 1, 1, S] (key padding), [L, S] and
// [B, H, L, S] (a row without keys: out 0, lse -inf), a float mask [H, 1, S], with G = 1 and 2.
TEST_P(FlashAttentionReference, MasksAndGroupedHeadsEqualTheComposite) {
  const Tensor q = rand_input({2, 4, 5, 3}, -1, 1, 40), k = rand_input({2, 2, 6, 3}, -1, 1, 41),
               v = rand_input({2, 2, 6, 2}, -1, 1, 42);
  const TensorOptions b = TensorOptions{}.with_dtype(DType::bool_);
  std::vector<double> pad(12, 1.0), lower(30);
  pad[5] = pad[10] = pad[11] = 0;
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 6; ++j) lower[static_cast<size_t>(i * 6 + j)] = j <= i + 1;
  const Tensor masks[] = {from_vector(pad, {2, 1, 1, 6}, b), from_vector(lower, {5, 6}, b),
                          pattern_mask(Device::cpu()), rand_input({4, 1, 6}, -2, 2, 43)};
  for (size_t mi = 0; mi < std::size(masks); ++mi) {
    for (const bool gqa : {false, true}) {
      SCOPED_TRACE(fmt::format("mask {} gqa {}", mi, gqa));
      const Tensor kk = gqa ? k : repeat2(k), vv = gqa ? v : repeat2(v);
      const ops::FlashAttentionOutput r =
          ops::flash_attention_forward(q, kk, vv, false, 0.5, masks[mi]);
      const Tensor ref =
          scaled_dot_product_attention(q, k, v, masks[mi], 0.0, false, 0.5, /*enable_gqa=*/true);
      EXPECT_TRUE(values_near(r.out, ref.tolist(), 1e-12));
      EXPECT_TRUE(
          values_near(flash_attention(q, kk, vv, false, 0.5, masks[mi]), ref.tolist(), 1e-12));
      if (mi == 2) {
        const std::vector<double> lse = r.lse.tolist(), out = r.out.tolist();
        EXPECT_EQ(lse[(0 * 4 + 1) * 5 + 2], -std::numeric_limits<double>::infinity());
        EXPECT_EQ(out[((0 * 4 + 1) * 5 + 2) * 2], 0.0);
        EXPECT_EQ(out[((0 * 4 + 1) * 5 + 2) * 2 + 1], 0.0);
      }
    }
  }
  // Masks that do not broadcast, or are not bool/floating, are named before any work.
  expect_error<std::invalid_argument>(
      [&] { (void)ops::flash_attention_forward(q, k, v, false, 1.0, masks[1].narrow(1, 0, 5)); },
      {"flash_attention_forward", "[2, 4, 5, 6]", "[5, 5]"});
  expect_error<std::invalid_argument>(
      [&] {
        (void)ops::flash_attention_forward(q, rand_input({2, 3, 6, 3}), rand_input({2, 3, 6, 2}),
                                           false, 1.0);
      },
      {"flash_attention_forward", "dim -3"});
}

// float64 gradcheck of q, k, v through a bool mask (with a row without keys: zero gradients),
// a float mask and grouped-query heads (G = 2: dk, dv sum over the group's query heads).
TEST_P(FlashAttentionReference, MaskAndGroupedHeadGradients) {
  const Tensor q = rand_input({2, 4, 5, 3}, -1, 1, 44), k = rand_input({2, 2, 6, 3}, -1, 1, 45),
               v = rand_input({2, 2, 6, 2}, -1, 1, 46);
  const Tensor bool_mask = pattern_mask(Device::cpu()), float_mask = rand_input({5, 6}, -2, 2, 47);
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& x) { return flash_attention(x[0], x[1], x[2], false, 0.7, bool_mask); },
      {q, k, v}));
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& x) {
        return flash_attention(x[0], x[1], x[2], false, 0.7, float_mask);
      },
      {q, repeat2(k).detach().requires_grad_(true), repeat2(v).detach().requires_grad_(true)}));
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& x) { return flash_attention(x[0], x[1], x[2], true); }, {q, k, v}));
  // The row without keys has zero gradients.
  Tensor ql = q.detach().clone();
  ql.requires_grad_(true);
  flash_attention(ql, k, v, false, 0.7, bool_mask).sum().backward();
  const std::vector<double> gq = ql.grad().tolist();
  for (size_t d = 0; d < 3; ++d) EXPECT_EQ(gq[((0 * 4 + 1) * 5 + 2) * 3 + d], 0.0);
}

// The meta kernels give the CPU's shapes and dtypes for a masked grouped-query problem.
TEST_P(FlashAttentionReference, MetaMatchesTheCpuForMasksAndGroupedHeads) {
  const auto run = [](const Device& d) {
    const Tensor q = ops::to(rand_input({2, 4, 5, 8}), d, DType::bfloat16),
                 k = ops::to(rand_input({2, 2, 6, 8}), d, DType::bfloat16),
                 v = ops::to(rand_input({2, 2, 6, 8}), d, DType::bfloat16);
    const Tensor mask =
        d.is_meta()
            ? ops::empty({2, 1, 1, 6}, DType::bool_, d)
            : ops::to(pattern_mask(Device::cpu()).narrow(1, 0, 1).narrow(2, 0, 1), d, DType::bool_);
    const ops::FlashAttentionOutput r = ops::flash_attention_forward(q, k, v, false, 0.5, mask);
    const ops::FlashAttentionGrads g =
        ops::flash_attention_backward(r.out, q, k, v, r.out, r.lse, false, 0.5, mask);
    return std::vector<Tensor>{r.out, r.lse, g.dq, g.dk, g.dv};
  };
  const std::vector<Tensor> m = run(Device::meta(0)), c = run(Device::cpu());
  for (size_t i = 0; i < c.size(); ++i) {
    EXPECT_TRUE(m[i].device().is_meta());
    EXPECT_EQ(m[i].sizes(), c[i].sizes()) << i;
    EXPECT_EQ(m[i].dtype(), c[i].dtype()) << i;
  }
}

TEST_P(FlashAttentionReference, BackwardOpEqualsTheCompositeGradients) {
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

TEST_P(FlashAttentionReference, StridedSplitHeadsAndErrors) {
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
TEST_P(FlashAttentionReference, PackedQkvIsReadAndWrittenInPlace) {
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

// ================================================================ CUDA against the CPU
// (compiled where the CUDA backend is: its settings, counters and runtime are CUDA code)
#if defined(TALLY_WITH_CUDA)

struct Case {
  int64_t B, H, L, S, E;
  bool causal;
};

const Case kCases[] = {
    {2, 3, 64, 64, 64, false},    // one tile
    {2, 3, 130, 130, 64, true},   // T not a multiple of 64
    {1, 2, 77, 77, 128, false},   // head dim 128, partial tile
    {1, 2, 200, 200, 128, true},  // causal, head dim 128
    {2, 2, 50, 190, 64, false},   // L != S
    {1, 3, 100, 100, 40, true},   // head dim padded to 64
    {8, 24, 64, 64, 64, true},    // B * H many
    {1, 1, 1, 1, 64, true},       // a single row
    // Several 128-row forward tiles and 64-key backward tiles, none of them full.
    {1, 2, 300, 300, 64, true},    // causal: skipped, diagonal and partial tiles
    {2, 1, 257, 257, 128, true},   // head dim 128, one row past a 128-row tile
    {1, 2, 70, 333, 128, false},   // L < S, partial key tiles
    {1, 1, 333, 70, 64, false},    // L > S: warps past the last key tile
    {1, 2, 200, 90, 64, true},     // causal with L > S (top-left mask)
    {1, 2, 90, 200, 64, true},     // causal with L < S: keys no query sees
    {1, 2, 96, 96, 8, true},       // the smallest head dim
    {1, 1, 129, 129, 120, false},  // head dim 120 padded to 128
};

// Inputs of dtype d on the device and the same values in the reference dtype on the CPU
// (float32 for 16-bit inputs, float64 for float32 ones).
struct Inputs {
  Tensor q, k, v, qf, kf, vf;
};

Inputs make_inputs(const Case& c, DType d, Device device, uint64_t seed) {
  const DType ref = d == DType::float32 ? DType::float64 : DType::float32;
  Inputs in;
  const Tensor q = rand_tensor({c.B, c.H, c.L, c.E}, d, seed, -2, 2);
  const Tensor k = rand_tensor({c.B, c.H, c.S, c.E}, d, seed + 1, -2, 2);
  const Tensor v = rand_tensor({c.B, c.H, c.S, c.E}, d, seed + 2, -2, 2);
  in.q = ops::to(q, device, d);
  in.k = ops::to(k, device, d);
  in.v = ops::to(v, device, d);
  in.qf = ops::to(q, ref);
  in.kf = ops::to(k, ref);
  in.vf = ops::to(v, ref);
  return in;
}

std::string describe(const Case& c, DType d) {
  return fmt::format("[{}, {}, {}/{}, {}] causal {} {}", c.B, c.H, c.L, c.S, c.E, c.causal,
                     dtype_name(d));
}

Tensor f32_cpu(const Tensor& t) {
  return ops::to(t, kCpu, DType::float32);
}

// The cases that compare the device's kernels with the CPU reference (accelerators only).
class AttentionVsCpu : public VsCpu {
 protected:
  void expect_fused_sdpa_matches_composite(DType d, DType ref, int64_t T, bool causal,
                                           uint64_t seed, double tol_out, double tol_grad) const;
};
TALLY_VS_CPU(AttentionVsCpu);

// Selects the bfloat16/float16 route for a scope (cuDNN's kernels or Tally's own).
class Route {
 public:
  explicit Route(bool cudnn) : saved_(cuda::cudnn_sdp_enabled()) {
    cuda::set_cudnn_sdp_enabled(cudnn);
  }
  ~Route() { cuda::set_cudnn_sdp_enabled(saved_); }
  Route(const Route&) = delete;
  Route& operator=(const Route&) = delete;

 private:
  bool saved_;
};

// Both routes, or only Tally's kernels when the process starts with TALLY_CUDNN_SDP=0 (the
// racecheck run: it checks Tally's kernels, not cuDNN's).
std::vector<bool> routes() {
  if (!cuda::cudnn_sdp_enabled()) return {false};
  return {true, false};
}

const char* route_name(bool cudnn) {
  return cudnn ? "cuDNN route" : "Tally kernels";
}

// Calls check(c, d, inputs, scale, seed) on both routes for every case of kCases in bfloat16
// and float16, on fresh inputs: the seed advances by `step` each time.
template <typename Check>
void for_each_16bit_case(Device device, uint64_t seed, uint64_t step, Check&& check) {
  for (const bool cudnn : routes()) {
    const Route route(cudnn);
    SCOPED_TRACE(route_name(cudnn));
    for (const Case& c : kCases) {
      for (const DType d : {DType::bfloat16, DType::float16}) {
        seed += step;
        check(c, d, make_inputs(c, d, device, seed), 1.0 / std::sqrt(static_cast<double>(c.E)),
              seed);
      }
    }
  }
}

TEST_P(AttentionVsCpu, ForwardMatchesTheCpu) {
  for_each_16bit_case(dev(), 100, 3,
                      [&](const Case& c, DType d, const Inputs& in, double scale, uint64_t) {
                        const ops::FlashAttentionOutput g =
                            ops::flash_attention_forward(in.q, in.k, in.v, c.causal, scale);
                        const ops::FlashAttentionOutput r =
                            ops::flash_attention_forward(in.qf, in.kf, in.vf, c.causal, scale);
                        EXPECT_EQ(g.out.device(), dev());
                        EXPECT_EQ(g.out.dtype(), d);
                        EXPECT_EQ(g.out.sizes(), r.out.sizes());
                        EXPECT_EQ(g.lse.dtype(), DType::float32);
                        EXPECT_TRUE(close_scaled(f32_cpu(g.out), r.out, 1e-2)) << describe(c, d);
                        // lse is a float32 sum of exponentials of scores from 16-bit inputs: 1e-3
                        // relative.
                        EXPECT_TRUE(close_scaled(f32_cpu(g.lse), r.lse, 1e-3)) << describe(c, d);
                      });
}

TEST_P(AttentionVsCpu, BackwardMatchesTheCpu) {
  for_each_16bit_case(
      dev(), 200, 4, [&](const Case& c, DType d, const Inputs& in, double scale, uint64_t seed) {
        const Tensor dout = rand_tensor({c.B, c.H, c.L, c.E}, d, seed + 3, -1, 1);
        const ops::FlashAttentionOutput g =
            ops::flash_attention_forward(in.q, in.k, in.v, c.causal, scale);
        // The reference backward from the GPU's own (rounded) output and lse, so that only the
        // backward kernel is under test.
        const ops::FlashAttentionGrads gg = ops::flash_attention_backward(
            put(dout), in.q, in.k, in.v, g.out, g.lse, c.causal, scale);
        const ops::FlashAttentionGrads rr =
            ops::flash_attention_backward(ops::to(dout, DType::float32), in.qf, in.kf, in.vf,
                                          f32_cpu(g.out), f32_cpu(g.lse), c.causal, scale);
        EXPECT_EQ(gg.dq.dtype(), d);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dq), rr.dq, 2e-2)) << "dq " << describe(c, d);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dk), rr.dk, 2e-2)) << "dk " << describe(c, d);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dv), rr.dv, 2e-2)) << "dv " << describe(c, d);
      });
}

// Many tiles with large scores (inputs in [-4, 4] and a scale of 1: the online softmax
// rescales often), forward and backward against the CPU in float32.
TEST_P(AttentionVsCpu, LongSequencesWithLargeScores) {
  const Case cases[] = {{1, 2, 1024, 1024, 64, true}, {1, 1, 640, 640, 128, false}};
  uint64_t seed = 500;
  for (const bool cudnn : routes()) {
    const Route route(cudnn);
    SCOPED_TRACE(route_name(cudnn));
    for (const Case& c : cases) {
      for (const DType d : {DType::bfloat16, DType::float16}) {
        const Tensor q = rand_tensor({c.B, c.H, c.L, c.E}, d, seed += 5, -4, 4);
        const Tensor k = rand_tensor({c.B, c.H, c.S, c.E}, d, seed + 1, -4, 4);
        const Tensor v = rand_tensor({c.B, c.H, c.S, c.E}, d, seed + 2, -2, 2);
        const Tensor dout = rand_tensor({c.B, c.H, c.L, c.E}, d, seed + 3, -1, 1);
        const double scale = 1.0 / 4;
        const ops::FlashAttentionOutput g =
            ops::flash_attention_forward(put(q), put(k), put(v), c.causal, scale);
        const Tensor qf = ops::to(q, DType::float32), kf = ops::to(k, DType::float32),
                     vf = ops::to(v, DType::float32);
        const ops::FlashAttentionOutput r =
            ops::flash_attention_forward(qf, kf, vf, c.causal, scale);
        EXPECT_TRUE(close_scaled(f32_cpu(g.out), r.out, 1e-2)) << describe(c, d);
        EXPECT_TRUE(close_scaled(f32_cpu(g.lse), r.lse, 1e-3)) << describe(c, d);
        const ops::FlashAttentionGrads gg = ops::flash_attention_backward(
            put(dout), put(q), put(k), put(v), g.out, g.lse, c.causal, scale);
        const ops::FlashAttentionGrads rr =
            ops::flash_attention_backward(ops::to(dout, DType::float32), qf, kf, vf, f32_cpu(g.out),
                                          f32_cpu(g.lse), c.causal, scale);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dq), rr.dq, 3e-2)) << "dq " << describe(c, d);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dk), rr.dk, 3e-2)) << "dk " << describe(c, d);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dv), rr.dv, 2e-2)) << "dv " << describe(c, d);
      }
    }
  }
}

// GPT's layout: [B, T, H, D] tensors of dtype d viewed as [B, H, T, D] and read in place through
// the strides. scaled_dot_product_attention on dev() takes the fused path (it saves q, k, v, out
// and the float32 lse only) and agrees with the composite (matmul, mask, softmax, matmul) run on
// the CPU in dtype ref: the output within tol_out, the gradients of q, k, v within tol_grad.
void AttentionVsCpu::expect_fused_sdpa_matches_composite(DType d, DType ref, int64_t T, bool causal,
                                                         uint64_t seed, double tol_out,
                                                         double tol_grad) const {
  SCOPED_TRACE(::testing::Message() << dtype_name(d) << " T " << T << " causal " << causal);
  const int64_t B = 2, H = 4, D = 64;
  Tensor g[3], c[3];  // q, k, v on the device and on the CPU
  for (int i = 0; i < 3; ++i) {
    const Tensor base = rand_tensor({B, T, H, D}, d, seed + static_cast<uint64_t>(i));
    g[i] = ops::transpose(put(base), 1, 2);
    c[i] = ops::to(ops::transpose(base, 1, 2), ref);
    g[i].requires_grad_();
    c[i].requires_grad_();
  }
  const Tensor &qg = g[0], &kg = g[1], &vg = g[2], &qc = c[0], &kc = c[1], &vc = c[2];
  ASSERT_FALSE(qg.is_contiguous());
  const Tensor out = scaled_dot_product_attention(qg, kg, vg, {}, 0.0, causal);
  EXPECT_EQ(out.dtype(), d);
  const std::vector<Tensor> saved = saved_by(out);
  ASSERT_EQ(saved.size(), 5u) << "should take the fused path";
  EXPECT_EQ(saved[4].dtype(), DType::float32);
  EXPECT_EQ(saved[4].sizes(), (Shape{B, H, T}));
  const Tensor r = scaled_dot_product_attention(qc, kc, vc, {}, 0.0, causal);
  ASSERT_NE(saved_by(r).size(), 5u);  // the CPU runs the composite
  EXPECT_TRUE(close_scaled(ops::to(out, kCpu, ref), r, tol_out));
  const Tensor w = rand_tensor({B, H, T, D}, DType::float32, seed + 3, -1, 1);
  tally::sum(tally::mul(out.to(DType::float32), put(w))).backward();
  tally::sum(tally::mul(r, ops::to(w, ref))).backward();
  EXPECT_TRUE(close_scaled(ops::to(qg.grad(), kCpu, ref), qc.grad(), tol_grad)) << "dq";
  EXPECT_TRUE(close_scaled(ops::to(kg.grad(), kCpu, ref), kc.grad(), tol_grad)) << "dk";
  EXPECT_TRUE(close_scaled(ops::to(vg.grad(), kCpu, ref), vc.grad(), tol_grad)) << "dv";
}

TEST_P(AttentionVsCpu, SplitHeadViewsAndSdpaRouting) {
  // bfloat16 against the float32 composite.
  const int64_t T = 100;
  expect_fused_sdpa_matches_composite(DType::bfloat16, DType::float32, T, true, 301, 1e-2, 2e-2);
  // With a mask (or dropout) it stays on the composite (which saves more).
  Tensor q = ops::transpose(put(rand_tensor({2, T, 4, 64}, DType::float32, 301)), 1, 2);
  q.requires_grad_();
  const Tensor plain =
      scaled_dot_product_attention(q, q, q, ops::zeros({T, T}, DType::float32, dev()), 0.0, false);
  EXPECT_NE(saved_by(plain).size(), 5u);
}

// GPT-2's attention (heads of a [B, T, 3C] projection, causal, head dim 64) runs on cuDNN's
// fused kernels on sm_80+, reading q, k, v in place and writing the gradients into one
// packed buffer; it agrees with Tally's own kernels on the same inputs. The counters prove
// which route ran.
TEST_P(AttentionVsCpu, CudnnRunsGptAttentionAndMatchesTallysKernels) {
  const int64_t B = 2, T = 512, H = 12, D = 64, C = H * D;
  const double scale = 1.0 / 8;
  for (const DType d : {DType::bfloat16, DType::float16}) {
    SCOPED_TRACE(dtype_name(d));
    const Tensor x = put(rand_tensor({B, T, 3 * C}, d, 700, -2, 2));
    const Tensor dout = put(rand_tensor({B, H, T, D}, d, 701, -1, 1));
    const TensorList parts = ops::split(x, C, 2);
    Tensor qkv[3];
    for (int i = 0; i < 3; ++i)
      qkv[i] = ops::transpose(ops::view(parts[static_cast<size_t>(i)], {B, T, H, D}), 1, 2);
    std::string why;
    ASSERT_TRUE(cuda::cudnn_sdp_supported(qkv[0], qkv[1], qkv[2], true, scale, &why)) << why;

    ops::FlashAttentionOutput f[2];
    ops::FlashAttentionGrads g[2];
    for (const bool cudnn : {true, false}) {
      const Route route(cudnn);
      const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
      f[cudnn] = ops::flash_attention_forward(qkv[0], qkv[1], qkv[2], true, scale);
      g[cudnn] = ops::flash_attention_backward(dout, qkv[0], qkv[1], qkv[2], f[cudnn].out,
                                               f[cudnn].lse, true, scale);
      const cuda::CudnnSdpCounts after = cuda::cudnn_sdp_counts();
      EXPECT_EQ(after.forward - before.forward, cudnn ? 1 : 0);
      EXPECT_EQ(after.backward - before.backward, cudnn ? 1 : 0);
      EXPECT_EQ(after.fallbacks, before.fallbacks);
      // The gradients are the three parts of one [B, T, 3C] buffer.
      EXPECT_TRUE(g[cudnn].dq.storage().is_same(g[cudnn].dv.storage()));
      EXPECT_EQ(g[cudnn].dk.storage_offset() - g[cudnn].dq.storage_offset(), C);
    }
    EXPECT_TRUE(close_scaled(f32_cpu(f[1].out), f32_cpu(f[0].out), 1e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(f[1].lse), f32_cpu(f[0].lse), 1e-4));
    EXPECT_TRUE(close_scaled(f32_cpu(g[1].dq), f32_cpu(g[0].dq), 2e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(g[1].dk), f32_cpu(g[0].dk), 2e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(g[1].dv), f32_cpu(g[0].dv), 2e-2));
    // Each route's backward takes the other's forward (same log-sum-exp convention).
    {
      const Route route(true);
      const ops::FlashAttentionGrads mixed = ops::flash_attention_backward(
          dout, qkv[0], qkv[1], qkv[2], f[0].out, f[0].lse, true, scale);
      EXPECT_TRUE(close_scaled(f32_cpu(mixed.dq), f32_cpu(g[0].dq), 2e-2));
      EXPECT_TRUE(close_scaled(f32_cpu(mixed.dk), f32_cpu(g[0].dk), 2e-2));
    }
  }
}

// Grouped-query heads run natively on cuDNN's fused kernels (K and V with 2 heads for 8 query
// heads, read in place; dK and dV summed over each group inside cuDNN's graph), causal and not,
// and agree with Tally's kernels, which read the shared heads in place too. The counters prove
// which route ran.
TEST_P(AttentionVsCpu, CudnnRunsGroupedQueryHeadsNatively) {
  const int64_t B = 2, H = 8, Hk = 2, T = 256, D = 64;
  const double scale = 1.0 / 8;
  for (const bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    const Tensor q = put(rand_tensor({B, H, T, D}, DType::bfloat16, 720, -2, 2));
    const Tensor k = put(rand_tensor({B, Hk, T, D}, DType::bfloat16, 721, -2, 2));
    const Tensor v = put(rand_tensor({B, Hk, T, D}, DType::bfloat16, 722, -2, 2));
    const Tensor dout = put(rand_tensor({B, H, T, D}, DType::bfloat16, 723, -1, 1));
    std::string why;
    ASSERT_TRUE(cuda::cudnn_sdp_supported(q, k, v, causal, scale, &why)) << why;
    ops::FlashAttentionOutput f[2];
    ops::FlashAttentionGrads g[2];
    for (const bool cudnn : {true, false}) {
      const Route route(cudnn);
      const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
      f[cudnn] = ops::flash_attention_forward(q, k, v, causal, scale);
      g[cudnn] =
          ops::flash_attention_backward(dout, q, k, v, f[cudnn].out, f[cudnn].lse, causal, scale);
      const cuda::CudnnSdpCounts after = cuda::cudnn_sdp_counts();
      EXPECT_EQ(after.forward - before.forward, cudnn ? 1 : 0);
      EXPECT_EQ(after.backward - before.backward, cudnn ? 1 : 0);
      EXPECT_EQ(after.fallbacks, before.fallbacks);
      EXPECT_EQ(g[cudnn].dk.sizes(), k.sizes());
      EXPECT_EQ(g[cudnn].dv.sizes(), v.sizes());
    }
    EXPECT_TRUE(close_scaled(f32_cpu(f[1].out), f32_cpu(f[0].out), 1e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(f[1].lse), f32_cpu(f[0].lse), 1e-4));
    EXPECT_TRUE(close_scaled(f32_cpu(g[1].dq), f32_cpu(g[0].dq), 2e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(g[1].dk), f32_cpu(g[0].dk), 2e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(g[1].dv), f32_cpu(g[0].dv), 2e-2));
  }
}

// Masks run on cuDNN's fused kernels as an additive bias in q's dtype, read through its
// broadcast strides: a bool key-padding mask [B, 1, 1, S] with grouped-query heads, and a float
// [1, 1, L, S] bias with -inf entries; rows 5 and 70 see no key (out 0, lse -inf, zero
// gradients, as in Tally's kernels). Both routes agree; the counters prove which ran.
TEST_P(AttentionVsCpu, CudnnTakesMasksAsABias) {
  const int64_t B = 2, H = 4, T = 192, D = 64;
  for (const bool boolean : {true, false}) {
    for (const DType d : {DType::bfloat16, DType::float16}) {
      SCOPED_TRACE(fmt::format("{} mask, {}", boolean ? "bool" : "float", dtype_name(d)));
      const int64_t Hk = boolean ? 2 : H;
      const Tensor q = put(rand_tensor({B, H, T, D}, d, 730, -2, 2));
      const Tensor k = put(rand_tensor({B, Hk, T, D}, d, 731, -2, 2));
      const Tensor v = put(rand_tensor({B, Hk, T, D}, d, 732, -2, 2));
      const Tensor dout = put(rand_tensor({B, H, T, D}, d, 733, -1, 1));
      const Shape own = boolean ? Shape{B, 1, 1, T} : Shape{1, 1, T, T};
      std::vector<double> m = ops::to_vector(rand_tensor(own, DType::float64, 734, 0, 1));
      for (double& x : m) x = boolean ? (x > 0.3 ? 1 : 0) : (x > 0.3 ? 4 * x - 2 : -INFINITY);
      if (!boolean)  // rows 5 and 70 without keys
        for (int64_t j = 0; j < T; ++j)
          m[static_cast<size_t>(5 * T + j)] = m[static_cast<size_t>(70 * T + j)] = -INFINITY;
      const Tensor mask =
          put(ops::to(from_vector(m, own), boolean ? DType::bool_ : DType::float32));
      const double scale = 1.0 / 8;
      std::string why;
      ASSERT_TRUE(
          cuda::cudnn_sdp_supported(q, k, v, false, scale, &why, ops::expand(mask, {B, H, T, T})))
          << why;
      ops::FlashAttentionOutput f[2];
      ops::FlashAttentionGrads g[2];
      for (const bool cudnn : {true, false}) {
        const Route route(cudnn);
        const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
        f[cudnn] = ops::flash_attention_forward(q, k, v, false, scale, mask);
        g[cudnn] = ops::flash_attention_backward(dout, q, k, v, f[cudnn].out, f[cudnn].lse, false,
                                                 scale, mask);
        const cuda::CudnnSdpCounts after = cuda::cudnn_sdp_counts();
        EXPECT_EQ(after.forward - before.forward, cudnn ? 1 : 0);
        EXPECT_EQ(after.backward - before.backward, cudnn ? 1 : 0);
        EXPECT_EQ(after.fallbacks, before.fallbacks);
      }
      EXPECT_TRUE(close_scaled(f32_cpu(f[1].out), f32_cpu(f[0].out), 1e-2));
      EXPECT_TRUE(close_scaled(f32_cpu(g[1].dq), f32_cpu(g[0].dq), 2e-2));
      EXPECT_TRUE(close_scaled(f32_cpu(g[1].dk), f32_cpu(g[0].dk), 2e-2));
      EXPECT_TRUE(close_scaled(f32_cpu(g[1].dv), f32_cpu(g[0].dv), 2e-2));
      const std::vector<double> lse1 = ops::to_vector(f32_cpu(f[1].lse)),
                                lse0 = ops::to_vector(f32_cpu(f[0].lse));
      for (size_t i = 0; i < lse0.size(); ++i) {
        if (std::isinf(lse0[i]) || std::isinf(lse1[i])) {
          EXPECT_EQ(lse1[i], lse0[i]) << "row " << i;
        } else {
          EXPECT_NEAR(lse1[i], lse0[i], 1e-2 * std::max(1.0, std::abs(lse0[i]))) << "row " << i;
        }
      }
      if (!boolean) {  // the rows without keys: out 0, dq 0 (every head, every batch)
        const std::vector<double> o = ops::to_vector(f32_cpu(f[1].out)),
                                  dq = ops::to_vector(f32_cpu(g[1].dq));
        for (const int64_t row : {int64_t{5}, int64_t{70}})
          for (int64_t e = 0; e < D; ++e) {
            EXPECT_EQ(o[static_cast<size_t>(row * D + e)], 0.0);
            EXPECT_EQ(dq[static_cast<size_t>(row * D + e)], 0.0);
          }
        EXPECT_EQ(lse1[5], -INFINITY);
      }
    }
  }
}

// A dry run replaying this GPU (target "cuda") charges the masked cuDNN route what the run
// allocates (tensor/attention/meta.cpp): the bias, the mask's own part in q's dtype, in forward
// and backward, and the backward's statistics. A masked 16-bit forward + backward has the same
// workspace and temporary peaks on both, for a key-padding mask with grouped heads and for a
// float [1, 1, L, S] bias.
TEST_P(AttentionVsCpu, ADryRunChargesTheMaskedCudnnRoute) {
  if (!cuda::cudnn_sdp_enabled()) GTEST_SKIP() << "the cuDNN route is off (TALLY_CUDNN_SDP=0)";
  const int64_t B = 2, H = 4, T = 192, D = 64;
  for (const bool boolean : {true, false}) {
    SCOPED_TRACE(boolean ? "bool key-padding mask" : "float bias");
    const int64_t Hk = boolean ? 2 : H;
    const Shape own = boolean ? Shape{B, 1, 1, T} : Shape{1, 1, T, T};
    const DType md = boolean ? DType::bool_ : DType::float32;
    auto peaks = [&](Device d) {
      const DType bf = DType::bfloat16;
      const Tensor q = ops::zeros({B, H, T, D}, bf, d), k = ops::zeros({B, Hk, T, D}, bf, d),
                   v = ops::zeros({B, Hk, T, D}, bf, d), dout = ops::zeros({B, H, T, D}, bf, d);
      const Tensor mask = ops::ones(own, md, d);
      for (int i = 0; i < 2; ++i) {  // the first builds (and tunes) cuDNN's plans
        memory::synchronize(d);
        memory::reset_peak_memory_stats(d);
        const ops::FlashAttentionOutput f =
            ops::flash_attention_forward(q, k, v, false, 0.125, mask);
        (void)ops::flash_attention_backward(dout, q, k, v, f.out, f.lse, false, 0.125, mask);
      }
      memory::synchronize(d);
      const memory::DeviceStats st = memory::get_allocator(d).stats();
      return std::make_pair(st.cat_bytes(memory::Category::workspace).peak,
                            st.cat_bytes(memory::Category::temporary).peak);
    };
    const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
    const auto real = peaks(dev());
    const cuda::CudnnSdpCounts after = cuda::cudnn_sdp_counts();
    EXPECT_EQ(after.forward - before.forward, 2);
    EXPECT_EQ(after.backward - before.backward, 2);
    const Device meta = memory::new_meta_device(memory::meta_target("cuda"));
    const auto dry = peaks(meta);
    EXPECT_TRUE(memory::unreplayed(meta).empty());
    EXPECT_EQ(dry.first, real.first) << "workspace peak";
    EXPECT_EQ(dry.second, real.second) << "temporary peak";
    EXPECT_GT(real.first, 0);
  }
}

// The 0/1 environment switches (TALLY_CUDNN_SDP, TALLY_CUDNN_CONV_LEGACY) read through
// cuda::env_switch: unset or empty gives the default, anything but 0 or 1 is an error naming the
// variable and its value. Host-only: runs without a GPU too.
TEST(CudaRuntime, EnvSwitchTakesZeroOrOneAndNamesABadValue) {
  const char* name = "TALLY_TEST_ENV_SWITCH";
  ::unsetenv(name);
  EXPECT_TRUE(cuda::env_switch(name, true));
  EXPECT_FALSE(cuda::env_switch(name, false));
  ::setenv(name, "", 1);
  EXPECT_TRUE(cuda::env_switch(name, true));
  ::setenv(name, "0", 1);
  EXPECT_FALSE(cuda::env_switch(name, true));
  ::setenv(name, "1", 1);
  EXPECT_TRUE(cuda::env_switch(name, false));
  for (const char* bad : {"off", "true", "2", "0 "}) {
    ::setenv(name, bad, 1);
    try {
      cuda::env_switch(name, true);
      ADD_FAILURE() << "no error for '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
  ::unsetenv(name);
}

// Tuning (set_tunable_enabled): a problem's first cuDNN forward and backward time the usable
// engine configurations on the call's own tensors and still give Tally's kernels' answer; the
// second call takes the cached choice; a problem first met inside a CUDA graph capture takes
// the heuristics' plan (no host wait) and its replay computes the same.
TEST_P(AttentionVsCpu, TunedCudnnPlansGiveTheSameAnswer) {
  struct Reset {
    ~Reset() { set_tunable_enabled(false); }
  } reset;
  const int64_t B = 2, H = 3, T = 320, D = 64;  // a shape no other test uses
  const double scale = 0.125;
  const Tensor q = put(rand_tensor({B, H, T, D}, DType::bfloat16, 720, -2, 2));
  const Tensor k = put(rand_tensor({B, H, T, D}, DType::bfloat16, 721, -2, 2));
  const Tensor v = put(rand_tensor({B, H, T, D}, DType::bfloat16, 722, -2, 2));
  const Tensor dout = put(rand_tensor({B, H, T, D}, DType::bfloat16, 723, -1, 1));
  std::string why;
  if (!cuda::cudnn_sdp_supported(q, k, v, true, scale, &why)) GTEST_SKIP() << why;
  ops::FlashAttentionOutput ref;
  ops::FlashAttentionGrads ref_g;
  {
    const Route route(false);
    ref = ops::flash_attention_forward(q, k, v, true, scale);
    ref_g = ops::flash_attention_backward(dout, q, k, v, ref.out, ref.lse, true, scale);
  }
  const Route route(true);
  set_tunable_enabled(true);
  for (int rep = 0; rep < 2; ++rep) {
    SCOPED_TRACE(rep == 0 ? "tuned now" : "the cached choice");
    const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
    const ops::FlashAttentionOutput f = ops::flash_attention_forward(q, k, v, true, scale);
    const ops::FlashAttentionGrads g =
        ops::flash_attention_backward(dout, q, k, v, f.out, f.lse, true, scale);
    const cuda::CudnnSdpCounts after = cuda::cudnn_sdp_counts();
    EXPECT_EQ(after.forward - before.forward, 1);
    EXPECT_EQ(after.backward - before.backward, 1);
    EXPECT_EQ(after.tuned - before.tuned, rep == 0 ? 2 : 0);
    EXPECT_TRUE(close_scaled(f32_cpu(f.out), f32_cpu(ref.out), 1e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(f.lse), f32_cpu(ref.lse), 1e-4));
    EXPECT_TRUE(close_scaled(f32_cpu(g.dq), f32_cpu(ref_g.dq), 2e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(g.dk), f32_cpu(ref_g.dk), 2e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(g.dv), f32_cpu(ref_g.dv), 2e-2));
  }
  // A new problem inside a capture: not tuned, and the replay gives the answer.
  const Tensor q2 = put(rand_tensor({B, H, T + 64, D}, DType::bfloat16, 724, -2, 2));
  ops::FlashAttentionOutput ref2;
  {
    const Route tally_kernels(false);
    ref2 = ops::flash_attention_forward(q2, q2, q2, true, scale);
  }
  const Tensor out = ops::empty({B, H, T + 64, D}, DType::bfloat16, dev());
  const Tensor lse = ops::empty({B, H, T + 64}, DType::float32, dev());
  const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
  cuda::Graph graph;
  graph.capture([&] {
    const ops::FlashAttentionOutput f = ops::flash_attention_forward(q2, q2, q2, true, scale);
    ops::copy_(out, f.out);
    ops::copy_(lse, f.lse);
  });
  graph.replay();
  EXPECT_EQ(cuda::cudnn_sdp_counts().tuned, before.tuned);
  EXPECT_TRUE(close_scaled(f32_cpu(out), f32_cpu(ref2.out), 1e-2));
  EXPECT_TRUE(close_scaled(f32_cpu(lse), f32_cpu(ref2.lse), 1e-4));
}

// A problem cuDNN declines falls back to Tally's kernels with the right answer, and is
// counted; float32 never asks for cuDNN.
TEST_P(AttentionVsCpu, CudnnDeclinedProblemsFallBack) {
  const Route route(true);
  const Tensor q = put(rand_tensor({1, 2, 64, 64}, DType::float32, 710, -1, 1));
  std::string why;
  EXPECT_FALSE(cuda::cudnn_sdp_supported(q, q, q, true, 0.125, &why));
  EXPECT_FALSE(why.empty());
  const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
  ops::flash_attention_forward(q, q, q, true, 0.125);
  const cuda::CudnnSdpCounts after = cuda::cudnn_sdp_counts();
  EXPECT_EQ(after.forward, before.forward);
  EXPECT_EQ(after.fallbacks, before.fallbacks) << "float32 is not a cuDNN problem at all";
}

// No T x T matrix during a causal forward + backward, in bfloat16 (Tally's kernels or cuDNN's)
// and in float32 (attention_fp32.cu). Above the inputs: out, lse, the float32 dQ accumulator (D
// in float32) and the three gradients, about 12 bytes per element of q in bfloat16 (0.4 MB per
// head here) against 2 MB per head for one bfloat16 T x T matrix, and about 16 bytes per element
// in float32 (1 MB per head) against 4 MB per head for one float32 T x T matrix.
TEST_P(AttentionVsCpu, NoTxTMatrixDuringForwardAndBackward) {
  const int64_t B = 4, H = 8, T = 1024, D = 64;
  const struct {
    DType d;
    double bound;  // the peak's bound, in T x T matrices of d
  } cases[] = {{DType::bfloat16, 0.6}, {DType::float32, 0.5}};
  for (const auto& [d, bound] : cases) {
    SCOPED_TRACE(dtype_name(d));
    Tensor q = ops::to(ops::randn({B, H, T, D}, DType::float32, dev()), d);
    Tensor k = ops::to(ops::randn({B, H, T, D}, DType::float32, dev()), d);
    Tensor v = ops::to(ops::randn({B, H, T, D}, DType::float32, dev()), d);
    const Tensor dout = ops::to(ops::randn({B, H, T, D}, DType::float32, dev()), d);
    q.requires_grad_();
    k.requires_grad_();
    v.requires_grad_();
    const size_t before = memory::memory_allocated(dev());
    memory::reset_peak_memory_stats(dev());
    {
      const Tensor out = scaled_dot_product_attention(q, k, v, {}, 0.0, true);
      out.backward(dout);
    }
    const size_t peak = memory::max_memory_allocated(dev()) - before;
    const double txt = static_cast<double>(B * H * T * T * dtype_size(d));
    EXPECT_LT(static_cast<double>(peak), bound * txt) << "peak " << peak << " bytes";
    EXPECT_TRUE(q.grad().defined() && k.grad().defined() && v.grad().defined());
  }
}

// ------------------------------------------------------------------ float32 (attention_fp32.cu)
//
// The float32 kernels against the float64 CPU reference run on the very same (float32)
// values: 1e-5 relative (max |got - ref| / max |ref|), the tolerance growing with sqrt(T)
// past one 64-row tile, as float32 sums of T terms do.

const Case kFp32Cases[] = {
    {2, 3, 64, 64, 64, false},    // one tile
    {2, 3, 130, 130, 64, true},   // T not a multiple of 64
    {1, 2, 300, 300, 64, true},   // several tiles, causal
    {1, 2, 77, 77, 128, false},   // head dim 128, partial tile
    {1, 2, 200, 200, 128, true},  // causal, head dim 128
    {2, 2, 50, 190, 64, false},   // L < S
    {2, 2, 190, 50, 64, true},    // L > S, causal (rows past S see every key)
    {1, 3, 100, 100, 40, true},   // head dim 40 (padded to 64 inside)
    {2, 2, 90, 90, 32, true},     // head dim 32
    {1, 2, 70, 70, 33, false},    // head dim 33: unaligned rows, scalar loads
    {8, 24, 64, 64, 64, true},    // B * H many
    {1, 1, 1, 1, 64, true},       // a single row
};

double fp32_tol(const Case& c, double base) {
  return base * std::max(1.0, std::sqrt(static_cast<double>(std::max(c.L, c.S)) / 64.0));
}

Tensor f64_cpu(const Tensor& t) {
  return ops::to(t, kCpu, DType::float64);
}

TEST_P(AttentionVsCpu, Fp32ForwardMatchesTheFloat64Cpu) {
  uint64_t seed = 500;
  for (const Case& c : kFp32Cases) {
    const Inputs in = make_inputs(c, DType::float32, dev(), seed += 3);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.E));
    ASSERT_TRUE(ops::flash_attention_supported(in.q, in.k, in.v)) << describe(c, DType::float32);
    const ops::FlashAttentionOutput g =
        ops::flash_attention_forward(in.q, in.k, in.v, c.causal, scale);
    const ops::FlashAttentionOutput r =
        ops::flash_attention_forward(in.qf, in.kf, in.vf, c.causal, scale);
    EXPECT_EQ(g.out.device(), dev());
    EXPECT_EQ(g.out.dtype(), DType::float32);
    EXPECT_EQ(g.lse.dtype(), DType::float32);
    EXPECT_EQ(g.out.sizes(), r.out.sizes());
    EXPECT_TRUE(close_scaled(f64_cpu(g.out), r.out, fp32_tol(c, 1e-5)))
        << describe(c, DType::float32);
    EXPECT_TRUE(close_scaled(f64_cpu(g.lse), r.lse, fp32_tol(c, 1e-5)))
        << "lse " << describe(c, DType::float32);
  }
}

TEST_P(AttentionVsCpu, Fp32BackwardMatchesTheFloat64Cpu) {
  uint64_t seed = 600;
  for (const Case& c : kFp32Cases) {
    const Inputs in = make_inputs(c, DType::float32, dev(), seed += 4);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.E));
    const Tensor dout = rand_tensor({c.B, c.H, c.L, c.E}, DType::float32, seed + 3, -1, 1);
    const ops::FlashAttentionOutput g =
        ops::flash_attention_forward(in.q, in.k, in.v, c.causal, scale);
    const ops::FlashAttentionGrads gg =
        ops::flash_attention_backward(put(dout), in.q, in.k, in.v, g.out, g.lse, c.causal, scale);
    // The whole chain in float64 on the CPU from the same float32 values.
    const ops::FlashAttentionOutput r =
        ops::flash_attention_forward(in.qf, in.kf, in.vf, c.causal, scale);
    const ops::FlashAttentionGrads rr = ops::flash_attention_backward(
        ops::to(dout, DType::float64), in.qf, in.kf, in.vf, r.out, r.lse, c.causal, scale);
    EXPECT_EQ(gg.dq.dtype(), DType::float32);
    EXPECT_EQ(gg.dk.sizes(), rr.dk.sizes());
    const double tol = fp32_tol(c, 2e-5);
    EXPECT_TRUE(close_scaled(f64_cpu(gg.dq), rr.dq, tol)) << "dq " << describe(c, DType::float32);
    EXPECT_TRUE(close_scaled(f64_cpu(gg.dk), rr.dk, tol)) << "dk " << describe(c, DType::float32);
    EXPECT_TRUE(close_scaled(f64_cpu(gg.dv), rr.dv, tol)) << "dv " << describe(c, DType::float32);
  }
}

TEST_P(AttentionVsCpu, Fp32UnalignedAndStridedInputs) {
  // q, k, v views at an odd element offset (copied to aligned memory by the op) and a
  // [B, T, H, D] split-head view read in place; both against the float64 reference.
  const int64_t B = 2, T = 96, H = 3, D = 64;
  const Tensor base = rand_tensor({3 * B * H * T * D + 1}, DType::float32, 701);
  const Tensor flat = put(base);
  auto piece = [&](const Tensor& t, int i) {
    return ops::reshape(ops::narrow(t, 0, 1 + i * B * H * T * D, B * H * T * D), {B, H, T, D});
  };
  const Tensor q = piece(flat, 0), k = piece(flat, 1), v = piece(flat, 2);
  const Tensor q64 = ops::to(piece(base, 0), DType::float64),
               k64 = ops::to(piece(base, 1), DType::float64),
               v64 = ops::to(piece(base, 2), DType::float64);
  const Case c{B, H, T, T, D, true};
  const ops::FlashAttentionOutput g = ops::flash_attention_forward(q, k, v, true, 0.125);
  const ops::FlashAttentionOutput r = ops::flash_attention_forward(q64, k64, v64, true, 0.125);
  EXPECT_TRUE(close_scaled(f64_cpu(g.out), r.out, fp32_tol(c, 1e-5)));
  const Tensor qs = ops::transpose(put(ops::transpose(piece(base, 0), 1, 2).contiguous()), 1, 2);
  ASSERT_FALSE(qs.is_contiguous());
  const ops::FlashAttentionOutput gs = ops::flash_attention_forward(qs, k, v, true, 0.125);
  EXPECT_TRUE(close_scaled(f64_cpu(gs.out), r.out, fp32_tol(c, 1e-5)));
  const Tensor dout = rand_tensor({B, H, T, D}, DType::float32, 702, -1, 1);
  const ops::FlashAttentionGrads gg =
      ops::flash_attention_backward(put(dout), qs, k, v, gs.out, gs.lse, true, 0.125);
  const ops::FlashAttentionGrads rr = ops::flash_attention_backward(
      ops::to(dout, DType::float64), q64, k64, v64, r.out, r.lse, true, 0.125);
  EXPECT_TRUE(close_scaled(f64_cpu(gg.dq), rr.dq, fp32_tol(c, 2e-5)));
  EXPECT_TRUE(close_scaled(f64_cpu(gg.dk), rr.dk, fp32_tol(c, 2e-5)));
  EXPECT_TRUE(close_scaled(f64_cpu(gg.dv), rr.dv, fp32_tol(c, 2e-5)));
  // What the float32 kernel does not take: E != Ev, E > 128.
  EXPECT_FALSE(ops::flash_attention_supported(q, k, ops::narrow(v, 3, 0, 32)));
  const Tensor wide = ops::zeros({1, 1, 4, 136}, DType::float32, dev());
  EXPECT_FALSE(ops::flash_attention_supported(wide, wide, wide));
}

TEST_P(AttentionVsCpu, Fp32SdpaTakesTheFusedPathWithTheCompositesGradients) {
  // float32 against the float64 composite.
  const int64_t T = 150;
  for (const bool causal : {true, false}) {
    const Case c{2, 4, T, T, 64, causal};
    expect_fused_sdpa_matches_composite(DType::float32, DType::float64, T, causal,
                                        causal ? 800 : 810, fp32_tol(c, 1e-5), fp32_tol(c, 2e-5));
  }
}

// Grouped-query attention and masked attention (both the fused path, key/value heads read in
// place) on the device against the CPU in float64: outputs and the three gradients.
TEST_P(AttentionVsCpu, GqaAndMasksMatchTheCpu) {
  const auto rel = [](const Tensor& a, const Tensor& b) {
    const Tensor d = ops::to(a, Device::cpu(), DType::float64),
                 r = ops::to(b, Device::cpu(), DType::float64);
    double most = 0, err = 0;
    const std::vector<double> dv = ops::to_vector(d), rv = ops::to_vector(r);
    for (size_t i = 0; i < dv.size(); ++i) {
      most = std::max(most, std::abs(rv[i]));
      err = std::max(err, std::abs(dv[i] - rv[i]));
    }
    return err / std::max(most, 1e-30);
  };
  const Tensor keep = ops::binary_scalar(ops::BinaryOp::gt, ops::rand({45, 45}), 0.3);
  for (const DType d : {DType::float32, DType::bfloat16}) {
    for (const int mode : {0, 1, 2}) {  // 0: GQA causal, 1: GQA, 2: bool mask + GQA
      SCOPED_TRACE(fmt::format("{} mode {}", dtype_name(d), mode));
      Generator g(900 + mode);
      const Tensor q64 = ops::randn({2, 4, 45, 64}, DType::float64, Device::cpu(), &g),
                   k64 = ops::randn({2, 2, 45, 64}, DType::float64, Device::cpu(), &g),
                   v64 = ops::randn({2, 2, 45, 64}, DType::float64, Device::cpu(), &g),
                   w64 = ops::randn({2, 4, 45, 64}, DType::float64, Device::cpu(), &g);
      const auto run = [&](Device dev_, DType dt) {
        Tensor q = ops::to(q64, dev_, dt), k = ops::to(k64, dev_, dt), v = ops::to(v64, dev_, dt);
        for (Tensor* t : {&q, &k, &v}) t->requires_grad_(true);
        const Tensor mask = mode == 2 ? ops::to(keep, dev_, DType::bool_) : Tensor();
        const Tensor out =
            scaled_dot_product_attention(q, k, v, mask, 0.0, mode == 0, std::nullopt, true);
        mul(out.to(DType::float64), ops::to(w64, dev_, DType::float64)).sum().backward();
        return std::vector<Tensor>{out, q.grad(), k.grad(), v.grad()};
      };
      const std::vector<Tensor> got = run(dev(), d), want = run(Device::cpu(), DType::float64);
      const double tol = d == DType::float32 ? 1e-4 : 3e-2;
      for (size_t i = 0; i < 4; ++i) EXPECT_LT(rel(got[i], want[i]), tol) << "tensor " << i;
    }
  }
}

// Masks and grouped-query heads in the fused CUDA kernels (bfloat16, float16: Tally's kernels
// with a mask, cuDNN's where it takes unmasked grouped heads; float32) against the CPU kernel
// (float32 reference for 16-bit inputs, float64 for float32): bool and float masks of shapes [B, 1,
// 1, S], [1, 1, L, S] and [B, H, L, S] (a row without keys: out 0, lse -inf, zero gradients), GQA G
// = 4 causal and not, and the masked GQA problem; forward, and backward from the device's own out
// and lse.
TEST_P(AttentionVsCpu, MasksAndGroupedHeadsMatchTheCpu) {
  struct MaskCase {
    int64_t B, H, Hk, L, S, E;
    bool causal;
    Shape mask;  // empty: none
    bool boolean;
  };
  const MaskCase cases[] = {
      {2, 4, 4, 130, 190, 64, false, {2, 1, 1, 190}, true},   // key padding
      {2, 4, 4, 130, 190, 64, false, {2, 1, 1, 190}, false},  // key padding as a float bias
      {1, 2, 2, 77, 77, 128, false, {1, 1, 77, 77}, true},    // [L, S], head dim 128
      {1, 2, 2, 100, 70, 64, false, {1, 1, 100, 70}, false},  // [L, S] float bias, L > S
      {2, 2, 2, 90, 150, 64, false, {2, 2, 90, 150}, true},   // [B, H, L, S] with dead rows
      {1, 3, 3, 64, 64, 40, false, {1, 3, 64, 64}, false},    // [B, H, L, S] float, E 40
      {2, 2, 2, 70, 99, 64, false, {2, 1, 70, 99}, false},    // S odd: one load a column
      {1, 8, 2, 200, 200, 64, true, {}, false},               // GQA G = 4 causal
      {2, 8, 2, 96, 140, 64, false, {}, false},               // GQA G = 4
      {1, 8, 2, 120, 120, 128, true, {}, false},              // GQA G = 4 causal, E 128
      {2, 8, 2, 100, 130, 64, false, {2, 1, 1, 130}, true},   // GQA G = 4 with key padding
  };
  // lse with -inf where a row has no key: the -inf positions must agree, the rest be close.
  const auto lse_close = [](const Tensor& got, const Tensor& ref, double tol) {
    const std::vector<double> a = ops::to_vector(got), b = ops::to_vector(ref);
    double worst = 0, most = 1;
    for (size_t i = 0; i < b.size(); ++i) {
      if (std::isinf(b[i]) || std::isinf(a[i])) {
        if (a[i] != b[i])
          return ::testing::AssertionFailure() << "lse " << a[i] << " vs " << b[i] << " at " << i;
        continue;
      }
      most = std::max(most, std::abs(b[i]));
      worst = std::max(worst, std::abs(a[i] - b[i]));
    }
    if (worst / most <= tol) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "lse relative error " << worst / most;
  };
  uint64_t seed = 5000;
  for (const MaskCase& c : cases) {
    for (const DType d : {DType::bfloat16, DType::float16, DType::float32}) {
      seed += 10;
      const std::string what = fmt::format("[{}, {}|{}, {}/{}, {}] causal {} mask {} {} {}", c.B,
                                           c.H, c.Hk, c.L, c.S, c.E, c.causal, shape_str(c.mask),
                                           c.boolean ? "bool" : "float", dtype_name(d));
      SCOPED_TRACE(what);
      const DType ref = d == DType::float32 ? DType::float64 : DType::float32;
      const Tensor q = rand_tensor({c.B, c.H, c.L, c.E}, d, seed);
      const Tensor k = rand_tensor({c.B, c.Hk, c.S, c.E}, d, seed + 1);
      const Tensor v = rand_tensor({c.B, c.Hk, c.S, c.E}, d, seed + 2);
      const Tensor dout = rand_tensor({c.B, c.H, c.L, c.E}, d, seed + 3, -1, 1);
      Tensor mask;
      if (!c.mask.empty()) {
        const Tensor u = rand_tensor(c.mask, DType::float64, seed + 4, 0, 1);
        if (c.boolean) {
          mask = ops::binary_scalar(ops::BinaryOp::gt, u, 0.25);
          if (c.mask[2] > 1) {  // rows 3 and 40 of the first (b, h) slice see no key
            std::vector<double> m = ops::to_vector(ops::to(mask, DType::float64));
            for (int64_t j = 0; j < c.S; ++j) m[static_cast<size_t>(3 * c.S + j)] = 0;
            for (int64_t j = 0; j < c.S; ++j) m[static_cast<size_t>(40 * c.S + j)] = 0;
            mask = ops::to(from_vector(m, c.mask), DType::bool_);
          }
        } else {
          mask = ops::affine(u, 4.0, -2.0);  // a bias in [-2, 2]
        }
      }
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.E));
      const Tensor md = mask.defined() ? put(mask) : Tensor();
      const Tensor mr = mask.defined() && !c.boolean ? ops::to(mask, ref) : mask;
      const ops::FlashAttentionOutput g =
          ops::flash_attention_forward(put(q), put(k), put(v), c.causal, scale, md);
      const ops::FlashAttentionOutput r = ops::flash_attention_forward(
          ops::to(q, ref), ops::to(k, ref), ops::to(v, ref), c.causal, scale, mr);
      const double tol = d == DType::float32 ? 1e-4 : 1e-2;
      EXPECT_TRUE(close_scaled(ops::to(g.out, kCpu, ref), r.out, tol)) << "out";
      EXPECT_TRUE(lse_close(g.lse, r.lse, d == DType::float32 ? 1e-5 : 1e-3));
      const ops::FlashAttentionGrads gg = ops::flash_attention_backward(
          put(dout), put(q), put(k), put(v), g.out, g.lse, c.causal, scale, md);
      const ops::FlashAttentionGrads rr = ops::flash_attention_backward(
          ops::to(dout, ref), ops::to(q, ref), ops::to(k, ref), ops::to(v, ref),
          ops::to(g.out, kCpu, ref), ops::to(g.lse, kCpu, r.lse.dtype()), c.causal, scale, mr);
      const double gtol = d == DType::float32 ? 1e-4 : 2e-2;
      EXPECT_TRUE(close_scaled(ops::to(gg.dq, kCpu, ref), rr.dq, gtol)) << "dq";
      EXPECT_TRUE(close_scaled(ops::to(gg.dk, kCpu, ref), rr.dk, gtol)) << "dk";
      EXPECT_TRUE(close_scaled(ops::to(gg.dv, kCpu, ref), rr.dv, gtol)) << "dv";
      if (c.boolean && c.mask.size() == 4 && c.mask[2] > 1) {  // the dead rows: 0 out, 0 dq
        const std::vector<double> o = ops::to_vector(g.out), dq = ops::to_vector(gg.dq);
        for (int64_t e = 0; e < c.E; ++e) {
          EXPECT_EQ(o[static_cast<size_t>(3 * c.E + e)], 0.0);
          EXPECT_EQ(dq[static_cast<size_t>(40 * c.E + e)], 0.0);
        }
      }
    }
  }
}

// scaled_dot_product_attention on CUDA takes the fused kernel for a bool key-padding mask and
// for enable_gqa (no [B, H, L, S] tensor, no repeated heads) and gives the composite's values.
TEST_P(AttentionVsCpu, SdpaMaskAndGqaTakeTheFusedKernel) {
  const Tensor q = rand_tensor({2, 8, 64, 64}, DType::bfloat16, 7100),
               k = rand_tensor({2, 2, 96, 64}, DType::bfloat16, 7101),
               v = rand_tensor({2, 2, 96, 64}, DType::bfloat16, 7102);
  const Tensor pad = ops::binary_scalar(
      ops::BinaryOp::gt, rand_tensor({2, 1, 1, 96}, DType::float64, 7103, 0, 1), 0.2);
  EXPECT_TRUE(ops::flash_attention_supported(put(q), put(k), put(v), put(pad)));
  const Tensor qg = put(q).requires_grad_(true);
  const Tensor got =
      scaled_dot_product_attention(qg, put(k), put(v), put(pad), 0.0, false, std::nullopt, true);
  // The fused op saved q, k and v (k, v with their 2 heads, not repeated), out, lse and the
  // mask at its own shape.
  const std::vector<Tensor> saved = saved_by(got);
  ASSERT_EQ(saved.size(), 6u) << "should take the fused path";
  EXPECT_EQ(saved[1].sizes(), (Shape{2, 2, 96, 64}));
  EXPECT_EQ(saved[5].sizes(), (Shape{2, 1, 1, 96}));
  const Tensor want =
      scaled_dot_product_attention(ops::to(q, DType::float64), ops::to(k, DType::float64),
                                   ops::to(v, DType::float64), pad, 0.0, false, std::nullopt, true);
  EXPECT_TRUE(close_scaled(ops::to(got, kCpu, DType::float64), want, 1e-2));
}

// The repeat route for grouped-query heads (ops::set_gqa_repeat): the heads are repeated, the
// fused op saves k and v with q's head count, and 16-bit causal attention goes to cuDNN; the
// values and gradients still match the float64 CPU composite.
TEST_P(AttentionVsCpu, GqaRepeatRouteTakesEqualHeads) {
  struct Restore {
    bool was = ops::gqa_repeat();
    ~Restore() { ops::set_gqa_repeat(was); }
  } restore;
  ops::set_gqa_repeat(true);
  const Tensor q = rand_tensor({2, 8, 64, 64}, DType::bfloat16, 7200),
               k = rand_tensor({2, 2, 64, 64}, DType::bfloat16, 7201),
               v = rand_tensor({2, 2, 64, 64}, DType::bfloat16, 7202);
  const Tensor qg = put(q).requires_grad_(true), kg = put(k).requires_grad_(true);
  const int64_t before = cuda::cudnn_sdp_counts().forward;
  const Tensor got =
      scaled_dot_product_attention(qg, kg, put(v), {}, 0.0, true, std::nullopt, true);
  const std::vector<Tensor> saved = saved_by(got);
  ASSERT_GE(saved.size(), 5u) << "should take the fused path";
  EXPECT_EQ(saved[1].sizes(), (Shape{2, 8, 64, 64}));  // k repeated to q's heads
  if (cuda::cudnn_sdp_enabled()) EXPECT_GT(cuda::cudnn_sdp_counts().forward, before);
  const Tensor q64 = ops::to(q, DType::float64).requires_grad_(true),
               k64 = ops::to(k, DType::float64).requires_grad_(true);
  const Tensor want = scaled_dot_product_attention(q64, k64, ops::to(v, DType::float64), {}, 0.0,
                                                   true, std::nullopt, true);
  EXPECT_TRUE(close_scaled(ops::to(got, kCpu, DType::float64), want, 1e-2));
  sum(mul(got, got)).backward();
  sum(mul(want, want)).backward();
  EXPECT_TRUE(close_scaled(ops::to(kg.grad(), kCpu, DType::float64), k64.grad(), 2e-2));
}

#endif  // TALLY_WITH_CUDA

}  // namespace
}  // namespace tally
