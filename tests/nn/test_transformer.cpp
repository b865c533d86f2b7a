// MultiheadAttention, TransformerEncoderLayer and TransformerEncoder (nn/transformer.h), on each
// device of the binary (CPU here, CUDA in the _cuda twin): PyTorch's parameter names and
// initialisation, outputs against a reference computed head by head with 2-D products, masks
// (bool and float, key padding), float64 gradient checks, deep copies, errors naming the
// shapes, and a dry run on the meta device. Then the two reference models built on them, ViT
// (torchvision's names and parameter counts) and the BERT-style encoder.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "nn/checkpoint.h"
#include "nn/init.h"
#include "nn/models/bert.h"
#include "nn/models/registry.h"
#include "nn/models/vit.h"
#include "nn/transformer.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace testing;

std::vector<double> host(const Tensor& t) {
  return ops::to_vector(ops::to(t.detach(), Device::cpu(), DType::float64));
}

std::vector<std::string> names(const nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& [n, p] : m.named_parameters()) out.push_back(n);
  return out;
}

template <typename Fn>
void expect_error(const Fn& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing " << part;
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// MultiheadAttention by its definition, one batch element and one head at a time with 2-D
// products: q, k, v [N, T, E] (batch first), mask [N, L, S] floating (added) or undefined.
// Returns the output [N, L, E] and the head-averaged weights [N, L, S].
std::pair<Tensor, Tensor> reference(const nn::MultiheadAttention& m, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& mask) {
  const int64_t E = m.embed_dim, H = m.num_heads, hd = m.head_dim, N = q.size(0);
  TensorList outs, weights;
  for (int64_t n = 0; n < N; ++n) {
    TensorList heads;
    Tensor wsum;
    for (int64_t h = 0; h < H; ++h) {
      const auto proj = [&](const Tensor& x, int64_t part) {
        const Tensor w = m.in_proj_weight.narrow(0, part * E + h * hd, hd);
        const Tensor b = m.in_proj_bias.narrow(0, part * E + h * hd, hd);
        return add(matmul(x.select(0, n), w.t()), b);
      };
      Tensor s = mul(matmul(proj(q, 0), proj(k, 1).t()), 1.0 / std::sqrt(double(hd)));
      if (mask.defined()) s = add(s, mask.select(0, n));
      const Tensor p = softmax(s, -1);
      heads.push_back(matmul(p, proj(v, 2)));
      wsum = wsum.defined() ? add(wsum, p) : p;
    }
    outs.push_back(add(matmul(cat(heads, 1), m.out_proj->weight.t()), m.out_proj->bias));
    weights.push_back(mul(wsum, 1.0 / double(H)));
  }
  return {stack(outs, 0), stack(weights, 0)};
}

class Transformer : public OnDevice {
 protected:
  // A float64 module on the device under test, with nonzero biases (the initialisation's are 0).
  template <typename M>
  std::shared_ptr<M> prepared(std::shared_ptr<M> m) {
    m->to(dev(), DType::float64);
    NoGradGuard ng;
    uint64_t seed = 100;
    for (const auto& [n, p] : m->named_parameters())
      if (n.find("bias") != std::string::npos)
        ops::copy_(p, ops::to(rand_input(p.sizes(), -0.5, 0.5, seed++), dev(), DType::float64));
    return m;
  }
};
TALLY_ON_DEVICES(Transformer);

TEST_P(Transformer, MultiheadAttentionNamesAndInitialisation) {
  manual_seed(0);
  nn::MultiheadAttention m(8, 2);
  EXPECT_EQ(names(m), (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                                "out_proj.bias"}));
  EXPECT_EQ(m.in_proj_weight.sizes(), (Shape{24, 8}));
  for (double b : host(m.in_proj_bias)) EXPECT_EQ(b, 0.0);
  for (double b : host(m.out_proj->bias)) EXPECT_EQ(b, 0.0);
  const double bound = std::sqrt(6.0 / (8 + 24));  // xavier_uniform_ over [3E, E]
  double most = 0;
  for (double w : host(m.in_proj_weight)) most = std::max(most, std::abs(w));
  EXPECT_LE(most, bound);
  EXPECT_GT(most, 0.8 * bound);
  nn::MultiheadAttention kv(8, 2, 0.0, false, false, false, 5, 3);
  EXPECT_EQ(names(kv), (std::vector<std::string>{"q_proj_weight", "k_proj_weight", "v_proj_weight",
                                                 "out_proj.weight"}));
  EXPECT_EQ(kv.k_proj_weight.sizes(), (Shape{8, 5}));
  EXPECT_EQ(kv.v_proj_weight.sizes(), (Shape{8, 3}));
}

TEST_P(Transformer, MultiheadAttentionMatchesTheDefinition) {
  manual_seed(1);
  for (const bool batch_first : {true, false}) {
    auto m = prepared(std::make_shared<nn::MultiheadAttention>(
        6, 2, 0.0, true, false, false, std::nullopt, std::nullopt, batch_first));
    const Tensor q = put(rand_input({2, 3, 6}, -1, 1, 1)), k = put(rand_input({2, 4, 6}, -1, 1, 2)),
                 v = put(rand_input({2, 4, 6}, -1, 1, 3));
    const auto io = [&](const Tensor& t) { return batch_first ? t : t.transpose(0, 1); };
    // A key padding mask (batch 1 drops its last key) and a float attention mask [L, S].
    const Tensor kpm =
        from_vector({0, 0, 0, 0, 0, 0, 0, 1}, {2, 4}, on(TensorOptions{}.with_dtype(DType::bool_)));
    const Tensor am = put(rand_input({3, 4}, -1, 1, 4));
    std::vector<double> merged = host(am.unsqueeze(0).expand({2, 3, 4}).contiguous());
    for (int i = 0; i < 3; ++i) merged[static_cast<size_t>(12 + i * 4 + 3)] = -INFINITY;
    const Tensor mask = from_vector(merged, {2, 3, 4}, on(f64));
    const auto [want, want_w] = reference(*m, q, k, v, mask);
    const auto [out, w] = (*m)(io(q), io(k), io(v), kpm, true, am);
    EXPECT_TRUE(values_near(io(out), host(want), 1e-12)) << "batch_first " << batch_first;
    EXPECT_TRUE(values_near(w, host(want_w), 1e-12));
    // need_weights=False takes scaled_dot_product_attention: the same output, no weights.
    const auto [out2, none] = (*m)(io(q), io(k), io(v), kpm, false, am);
    EXPECT_FALSE(none.defined());
    EXPECT_TRUE(values_near(io(out2), host(want), 1e-12));
    // The float key padding mask of -inf is the bool one.
    const Tensor kpm_f = from_vector({0, 0, 0, 0, 0, 0, 0, -INFINITY}, {2, 4}, on(f64));
    EXPECT_TRUE(values_near((*m)(io(q), io(k), io(v), kpm_f, false, am).first, host(out), 1e-12));
  }
}

TEST_P(Transformer, SelfAttentionCausalHintAndUnbatched) {
  manual_seed(2);
  auto m = prepared(std::make_shared<nn::MultiheadAttention>(4, 2, 0.0, true, false, false,
                                                             std::nullopt, std::nullopt, true));
  const Tensor x = put(rand_input({2, 5, 4}, -1, 1, 5));
  const Tensor causal = nn::generate_square_subsequent_mask(5, DType::float64, dev());
  const auto [want, w] = (*m)(x, x, x, {}, true, causal);
  // is_causal with the mask and no weights runs the causal kernel: the same values.
  EXPECT_TRUE(values_near((*m)(x, x, x, {}, false, causal, true, true).first, host(want), 1e-12));
  // The weights above the diagonal are zero.
  const std::vector<double> wv = host(w);
  EXPECT_EQ(wv[1], 0.0);
  EXPECT_EQ(wv[4], 0.0);
  // Unbatched [L, E] is batch 1 squeezed.
  const Tensor x0 = x.select(0, 0);
  const auto [y0, w0] = (*m)(x0, x0, x0, {}, true, causal);
  EXPECT_EQ(y0.sizes(), (Shape{5, 4}));
  EXPECT_EQ(w0.sizes(), (Shape{5, 5}));
  EXPECT_TRUE(values_near(y0, host(want.select(0, 0)), 1e-12));
  // Per-head weights.
  EXPECT_EQ((*m)(x, x, x, {}, true, {}, false).second.sizes(), (Shape{2, 2, 5, 5}));
}

TEST_P(Transformer, MultiheadAttentionGradients) {
  manual_seed(3);
  auto m = prepared(std::make_shared<nn::MultiheadAttention>(4, 2));
  auto kv = prepared(std::make_shared<nn::MultiheadAttention>(4, 2, 0.0, true, false, false, 3, 5));
  const Tensor q = rand_input({3, 2, 4}, -1, 1, 6), k = rand_input({5, 2, 3}, -1, 1, 7),
               v = rand_input({5, 2, 5}, -1, 1, 8), k4 = rand_input({5, 2, 4}, -1, 1, 9);
  const Tensor kpm = from_vector({0, 0, 1, 0, 0, 0, 0, 0, 0, 1}, {2, 5},
                                 on(TensorOptions{}.with_dtype(DType::bool_)));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& x) { return (*m)(x[0], x[0], x[0], {}, true).first; }, {q}));
  EXPECT_TRUE(gradcheck_on(dev(),
                           [&](const TensorList& x) {
                             const auto [o, w] = (*m)(x[0], x[1], x[1], kpm, true);
                             return add(o.sum(), w.sum());
                           },
                           {q, k4}));
  EXPECT_TRUE(gradcheck_on(
      dev(), [&](const TensorList& x) { return (*kv)(x[0], x[1], x[2], kpm, false).first; },
      {q, k, v}));
}

TEST_P(Transformer, EncoderLayerPostAndPreNorm) {
  for (const bool norm_first : {false, true}) {
    manual_seed(4);
    auto layer = prepared(std::make_shared<nn::TransformerEncoderLayer>(4, 2, 8, 0.0, "gelu", 1e-5,
                                                                        true, norm_first));
    EXPECT_EQ(names(*layer),
              (std::vector<std::string>{
                  "self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight",
                  "self_attn.out_proj.bias", "linear1.weight", "linear1.bias", "linear2.weight",
                  "linear2.bias", "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"}));
    const Tensor x = put(rand_input({2, 3, 4}, -1, 1, 10));
    const auto sa = [&](const Tensor& h) { return (*layer->self_attn)(h, h, h, {}, false).first; };
    const auto ff = [&](const Tensor& h) { return (*layer->linear2)(gelu((*layer->linear1)(h))); };
    Tensor want;
    if (norm_first) {
      const Tensor h = add(x, sa((*layer->norm1)(x)));
      want = add(h, ff((*layer->norm2)(h)));
    } else {
      const Tensor h = (*layer->norm1)(add(x, sa(x)));
      want = (*layer->norm2)(add(h, ff(h)));
    }
    EXPECT_TRUE(values_near((*layer)(x), host(want), 1e-12));
    EXPECT_TRUE(gradcheck_on(dev(), [&](const TensorList& in) { return (*layer)(in[0]); },
                             {rand_input({2, 3, 4}, -1, 1, 11)}));
  }
}

TEST_P(Transformer, EncoderDeepCopiesTheLayer) {
  manual_seed(5);
  nn::TransformerEncoderLayer proto(4, 2, 8, 0.0);
  nn::TransformerEncoder enc(proto, 2, std::make_shared<nn::LayerNorm>(4));
  const std::vector<std::string> n = names(enc);
  EXPECT_EQ(n.size(), 2 * 12u + 2);
  EXPECT_EQ(n.front(), "layers.0.self_attn.in_proj_weight");
  EXPECT_EQ(n[12], "layers.1.self_attn.in_proj_weight");
  EXPECT_EQ(n.back(), "norm.bias");
  // Copies: the same values as the prototype, separate tensors.
  EXPECT_EQ(host(enc.layer(1).linear1->weight), host(proto.linear1->weight));
  EXPECT_FALSE(enc.layer(0).linear1->weight.is_same(enc.layer(1).linear1->weight));
  enc.to(dev(), DType::float64);
  // Sequence first [S, N, E] with masks: layer by layer, then the norm.
  const Tensor x = put(rand_input({3, 2, 4}, -1, 1, 12));
  const Tensor mask = nn::generate_square_subsequent_mask(3, DType::float64, dev());
  const Tensor kpm =
      from_vector({0, 0, 1, 0, 0, 0}, {2, 3}, on(TensorOptions{}.with_dtype(DType::bool_)));
  Tensor want = x;
  for (size_t i = 0; i < 2; ++i) want = enc.layer(i)(want, mask, kpm);
  want = (*enc.norm)(want);
  EXPECT_TRUE(values_near(enc(x, mask, kpm), host(want), 1e-12));
}

// A checkpointed layer called with masks runs under nn::checkpoint (issue 50: the masked call
// ignored set_checkpoint): the forward keeps only its inputs, backward recomputes, and the
// gradients equal the plain layer's.
TEST_P(Transformer, CheckpointedEncoderLayerWithMasks) {
  manual_seed(6);
  auto plain = prepared(std::make_shared<nn::TransformerEncoderLayer>(4, 2, 8, 0.0));
  std::shared_ptr<nn::TransformerEncoderLayer> ckpt = plain->clone();
  ckpt->set_checkpoint(true);
  const Tensor mask = nn::generate_square_subsequent_mask(3, DType::float64, dev());
  const Tensor kpm =
      from_vector({0, 0, 1, 0, 0, 0}, {2, 3}, on(TensorOptions{}.with_dtype(DType::bool_)));
  std::vector<std::vector<double>> grads[2];
  for (const bool on_ckpt : {false, true}) {
    nn::TransformerEncoderLayer& l = on_ckpt ? *ckpt : *plain;
    const Tensor x = leaf(rand_input({3, 2, 4}, -1, 1, 13));
    nn::reset_checkpoint_stats();
    const Tensor y = l(x, mask, kpm);
    EXPECT_EQ(nn::checkpoint_stats().segments, on_ckpt ? 1 : 0);
    mul(y, y).sum().backward();
    EXPECT_EQ(nn::checkpoint_stats().recomputations, on_ckpt ? 1 : 0);
    grads[on_ckpt].push_back(host(x.grad()));
    for (const auto& [n, p] : l.named_parameters()) grads[on_ckpt].push_back(host(p.grad()));
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_EQ(grads[0][i], grads[1][i]) << i;
}

// A float32 encoder layer with a key padding mask gives the float64 layer's output and input
// gradient: on CUDA the attention takes the fused kernel with the padding as a float bias
// [N, 1, 1, S] (tensor/attention), on the CPU the composite.
TEST_P(Transformer, EncoderLayerKeyPaddingFloat32MatchesFloat64) {
  manual_seed(7);
  auto l64 = prepared(std::make_shared<nn::TransformerEncoderLayer>(16, 2, 32, 0.0));
  std::shared_ptr<nn::TransformerEncoderLayer> l32 = l64->clone();
  l32->to(DType::float32);
  const Tensor kpm = from_vector({0, 0, 0, 1, 1, 0, 0, 0, 0, 1}, {2, 5},
                                 on(TensorOptions{}.with_dtype(DType::bool_)));
  std::vector<double> out[2], grad[2];
  for (const bool f32 : {false, true}) {
    const Tensor x0 = rand_input({5, 2, 16}, -1, 1, 17);
    const Tensor x = leaf(f32 ? ops::to(x0, DType::float32) : x0);
    const Tensor y = (f32 ? *l32 : *l64)(x, Tensor(), kpm);
    mul(y, y).sum().backward();
    out[f32] = host(y);
    grad[f32] = host(x.grad());
  }
  for (size_t i = 0; i < out[0].size(); ++i) EXPECT_NEAR(out[1][i], out[0][i], 1e-4) << i;
  for (size_t i = 0; i < grad[0].size(); ++i) EXPECT_NEAR(grad[1][i], grad[0][i], 1e-3) << i;
}

// TransformerEncoder's is_causal, unset, is PyTorch's _detect_is_causal_mask: a float mask
// equal to generate_square_subsequent_mask, or a bool mask True above the diagonal.
TEST_P(Transformer, EncoderDetectsTheCausalMask) {
  const Tensor causal = nn::generate_square_subsequent_mask(3, DType::float64, dev());
  const auto bools = [&](std::vector<double> v) {
    return from_vector(v, {3, 3}, on(TensorOptions{}.with_dtype(DType::bool_)));
  };
  const Tensor causal_bool = bools({0, 1, 1, 0, 0, 1, 0, 0, 0});
  EXPECT_TRUE(nn::detect_is_causal_mask(causal, std::nullopt, 3));
  EXPECT_TRUE(nn::detect_is_causal_mask(causal_bool, std::nullopt, 3));
  EXPECT_TRUE(nn::detect_is_causal_mask(causal.t().t(), std::nullopt, 3));
  EXPECT_FALSE(nn::detect_is_causal_mask(causal.t(), std::nullopt, 3));  // lower triangle
  EXPECT_FALSE(nn::detect_is_causal_mask(bools({0, 1, 0, 0, 0, 1, 0, 0, 0}), std::nullopt, 3));
  EXPECT_FALSE(nn::detect_is_causal_mask(causal, false, 3));  // an explicit hint wins
  EXPECT_TRUE(nn::detect_is_causal_mask({}, true, 3));
  EXPECT_FALSE(nn::detect_is_causal_mask({}, std::nullopt, 3));
  EXPECT_FALSE(nn::detect_is_causal_mask(causal, std::nullopt, 4));  // not the sequence's size
  EXPECT_FALSE(nn::detect_is_causal_mask(
      nn::generate_square_subsequent_mask(3, DType::float32, Device::meta()), std::nullopt, 3));
  // Detected, the causal kernel runs: the output is the masked one's.
  manual_seed(7);
  nn::TransformerEncoder enc(nn::TransformerEncoderLayer(4, 2, 8, 0.0), 2);
  enc.to(dev(), DType::float64);
  const Tensor x = put(rand_input({3, 2, 4}, -1, 1, 14));
  Tensor want = x;
  for (size_t i = 0; i < 2; ++i) want = enc.layer(i)(want, causal, {}, false);
  EXPECT_TRUE(values_near(enc(x, causal_bool), host(want), 1e-12));
}

TEST_P(Transformer, ErrorsNameTheShapes) {
  nn::MultiheadAttention m(8, 2);
  m.to(dev());
  const Tensor x = ops::zeros({3, 2, 8}, DType::float32, dev());
  expect_error(
      [&] {
        (void)m(x, x, ops::zeros({4, 2, 8}, DType::float32, dev()));
      },
      "value [4, 2, 8]");
  expect_error(
      [&] {
        (void)m(x, x, x, ops::zeros({3, 3}, DType::bool_, dev()));
      },
      "key_padding_mask should have shape [2, 3], got [3, 3]");
  expect_error(
      [&] {
        (void)m(x, x, x, {}, true, ops::zeros({3, 4}, DType::bool_, dev()));
      },
      "attn_mask should have shape [3, 3] or [4, 3, 3]");
  expect_error([&] { (void)m(x, x, x, {}, false, {}, true, true); }, "Need attn_mask");
  expect_error([&] { (void)m(ops::zeros({3, 2, 6}, DType::float32, dev())); }, "embed_dim (8)");
  expect_error([&] { nn::MultiheadAttention(8, 3); }, "divisible by num_heads");
  expect_error([&] { nn::MultiheadAttention(8, 2, 0.0, true, true); }, "add_bias_kv");
  expect_error([&] { nn::TransformerEncoderLayer(8, 2, 16, 0.1, "tanh"); }, "relu/gelu");
}

TEST_P(Transformer, DryRunOnTheMetaDevice) {
  if (!on_cpu()) GTEST_SKIP() << "one dry run is enough";
  const Device meta = Device::meta();
  nn::BuildOnDevice on_meta(meta);
  nn::TransformerEncoder enc(nn::TransformerEncoderLayer(16, 4, 32, 0.1, "relu", 1e-5, true), 2);
  EXPECT_EQ(enc.layer(1).linear1->weight.device(), meta);
  const Tensor x = ops::empty({2, 5, 16}, DType::float32, meta);
  const Tensor kpm = ops::empty({2, 5}, DType::bool_, meta);
  const Tensor y = enc(x, {}, kpm);
  EXPECT_EQ(y.sizes(), (Shape{2, 5, 16}));
  y.sum().backward();
  EXPECT_EQ(enc.layer(0).self_attn->in_proj_weight.grad().device(), meta);
}

// ---- the reference models on these layers (their training step: test_model_registry) ----
bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

TEST(TransformerModels, VitHasTorchvisionsNamesAndCounts) {
  manual_seed(6);
  nn::VisionTransformer vit(nn::ViTConfig::preset("tiny"));
  const std::vector<std::string> n = names(vit);
  EXPECT_EQ(n.front(), "class_token");  // the root's own parameter first, as PyTorch lists it
  for (const char* want :
       {"conv_proj.weight", "conv_proj.bias", "encoder.pos_embedding",
        "encoder.layers.encoder_layer_0.ln_1.weight",
        "encoder.layers.encoder_layer_0.self_attention.in_proj_weight",
        "encoder.layers.encoder_layer_0.self_attention.out_proj.bias",
        "encoder.layers.encoder_layer_1.mlp.0.weight", "encoder.layers.encoder_layer_1.mlp.3.bias",
        "encoder.layers.encoder_layer_1.ln_2.bias", "encoder.ln.weight", "heads.head.weight",
        "heads.head.bias"})
    EXPECT_TRUE(has(n, want)) << want;
  EXPECT_EQ(vit.encoder->pos_embedding.sizes(), (Shape{1, 17, 64}));  // 4 x 4 patches + class
  for (double w : host(vit.heads->get_submodule<nn::Linear>("head").weight)) EXPECT_EQ(w, 0.0);
  const Tensor logits = vit(ops::randn({2, 3, 32, 32}));
  EXPECT_EQ(logits.sizes(), (Shape{2, 10}));
  expect_error([&] { (void)vit(ops::randn({2, 3, 28, 28})); }, "[2, 3, 28, 28]");
  // torchvision's vit_b_16 (1000 classes) has 86,567,656 parameters; built on meta, no memory.
  nn::BuildOnDevice on_meta(Device::meta());
  nn::SkipInitGuard skip;
  nn::ViTConfig b16 = nn::ViTConfig::preset("vit_b_16");
  EXPECT_EQ(nn::VisionTransformer(b16).num_parameters(), 86567656);
}

TEST(TransformerModels, BertTiesItsDecoderAndCountsLikeBertBase) {
  manual_seed(7);
  nn::Bert bert(nn::BertConfig::preset("tiny"));
  const std::vector<std::string> n = names(bert);
  EXPECT_TRUE(has(n, "embeddings.word_embeddings.weight"));
  EXPECT_TRUE(has(n, "encoder.layers.1.self_attn.in_proj_weight"));
  EXPECT_TRUE(has(n, "mlm_head.decoder.bias"));
  EXPECT_FALSE(has(n, "mlm_head.decoder.weight"));  // tied: listed once, as PyTorch does
  EXPECT_TRUE(bert.mlm_head->decoder->weight.is_same(bert.embeddings->word_embeddings->weight));
  const Tensor ids = ops::randint(0, 256, {2, 8});
  EXPECT_EQ(bert(ids).sizes(), (Shape{2, 8, 256}));
  // Padding: the real tokens' logits do not depend on what the padded ones hold.
  const Tensor mask =
      ops::from_vector({1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}, {2, 8}, DType::int64);
  Tensor ids2 = ids.clone();
  ops::fill_(ids2.select(0, 0).narrow(0, 6, 2), 5.0);
  const Tensor a = bert.forward(ids, {}, mask), b = bert.forward(ids2, {}, mask);
  EXPECT_TRUE(
      values_near(a.select(0, 0).narrow(0, 0, 6), host(b.select(0, 0).narrow(0, 0, 6)), 1e-5));
  expect_error([&] { (void)bert(ops::randint(0, 256, {2, 40})); }, "[2, 40]");
  // BERT-base's masked-LM parameter count (HuggingFace's BertForMaskedLM: 109,514,298).
  nn::BuildOnDevice on_meta(Device::meta());
  nn::SkipInitGuard skip;
  EXPECT_EQ(nn::Bert(nn::BertConfig::preset("bert-base")).num_parameters(), 109514298);
}

// ViT and BERT from the model registry, with their default options: each test below runs once
// per model.
class TransformerModel : public ::testing::TestWithParam<const char*> {
 protected:
  const nn::ModelEntry& e = nn::model_entry(GetParam());
  const nn::ModelOptions o = nn::resolve_options(e, {});
};
INSTANTIATE_TEST_SUITE_P(Registry, TransformerModel, ::testing::Values("vit", "bert"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

// Each model's training step as a dry run on the meta device (what --estimate replays).
TEST_P(TransformerModel, TrainingStepRunsOnTheMetaDevice) {
  const data::Example b = e.synthetic_batch(o, 2, 0, 3);
  const Device meta = Device::meta();
  nn::BuildOnDevice on_meta(meta);
  std::shared_ptr<nn::Module> m = e.build(o);
  Tensor loss = e.loss(
      *m, {ops::to(b.input, meta, b.input.dtype()), ops::to(b.target, meta, b.target.dtype())});
  loss.backward();
  for (const auto& [n, p] : m->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << n;
    EXPECT_EQ(p.grad().device(), meta) << n;
  }
}

// ViT's encoder blocks and BERT's encoder layers are checkpoint blocks: the step with
// --checkpoint blocks gives the same loss and gradients as without.
TEST_P(TransformerModel, CheckpointedBlocksGiveTheSameGradients) {
  const data::Example b = e.synthetic_batch(o, 2, 0, 4);
  std::vector<std::vector<double>> grads[2];
  for (const bool ckpt : {false, true}) {
    manual_seed(8);
    std::shared_ptr<nn::Module> m = e.build(o);
    // ViT's head starts at zero (torchvision's), which would zero every other gradient.
    for (const auto& [n, p] : m->named_parameters())
      if (n == "heads.head.weight") nn::init::normal_(p, 0.0, 0.1);
    if (ckpt) {
      nn::enable_checkpointing(*m, nn::parse_checkpoint_spec("blocks"));
      EXPECT_EQ(nn::checkpoint_block_count(*m), 2);
    }
    e.loss(*m, b).backward();
    for (const auto& [n, p] : m->named_parameters()) grads[ckpt].push_back(host(p.grad()));
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_EQ(grads[0][i], grads[1][i]) << i;
}

}  // namespace
}  // namespace tally
