// ResNet and GPT: torchvision / nanoGPT parameter names and exact counts, forward shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <tuple>

#include "autograd/autocast.h"
#include "nn/checkpoint.h"
#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "testing/gradcheck.h"

using namespace tally;
using namespace tally::nn;

namespace {
std::map<std::string, Shape> shapes_of(const NamedTensors& v) {
  std::map<std::string, Shape> r;
  for (const auto& [n, t] : v) r[n] = t.sizes();
  return r;
}
}  // namespace

TEST(ResNet, Resnet18NamesAndCount) {
  SkipInitGuard cheap;
  auto m = resnet18();
  EXPECT_EQ(m->num_parameters(), 11689512);
  auto p = shapes_of(m->named_parameters());
  EXPECT_EQ(p.size(), 62u);  // torchvision: len(list(resnet18().parameters())) == 62
  EXPECT_EQ(p.at("conv1.weight"), (Shape{64, 3, 7, 7}));
  EXPECT_EQ(p.at("layer1.0.conv1.weight"), (Shape{64, 64, 3, 3}));
  EXPECT_EQ(p.at("layer2.0.downsample.0.weight"), (Shape{128, 64, 1, 1}));
  EXPECT_EQ(p.at("layer2.0.downsample.1.bias"), (Shape{128}));
  EXPECT_EQ(p.at("layer4.1.bn2.weight"), (Shape{512}));
  EXPECT_EQ(p.at("fc.weight"), (Shape{1000, 512}));
  EXPECT_EQ(p.count("layer1.0.downsample.0.weight"), 0u);
  auto sd = shapes_of(m->state_dict());
  EXPECT_EQ(sd.size(), 122u);  // torchvision resnet18 state_dict has 122 entries
  EXPECT_EQ(sd.at("layer3.1.bn1.num_batches_tracked"), Shape{});
  EXPECT_EQ(m->state_dict().front().first, "conv1.weight");
  EXPECT_EQ(m->state_dict().back().first, "fc.bias");
}

TEST(ResNet, Resnet50NamesAndCounts) {
  SkipInitGuard cheap;
  EXPECT_EQ(resnet50({.num_classes = 10})->num_parameters(), 23528522);
  auto m = resnet50();
  EXPECT_EQ(m->num_parameters(), 25557032);
  auto p = shapes_of(m->named_parameters());
  EXPECT_EQ(p.size(), 161u);
  EXPECT_EQ(p.at("layer1.0.conv3.weight"), (Shape{256, 64, 1, 1}));
  EXPECT_EQ(p.at("layer1.0.downsample.0.weight"), (Shape{256, 64, 1, 1}));
  EXPECT_EQ(p.at("layer3.5.bn3.weight"), (Shape{1024}));
  EXPECT_EQ(p.at("fc.weight"), (Shape{1000, 2048}));
  // v1.5: the stride sits on conv2 (3x3) -> checked through the forward shape below.
  auto* conv2 = dynamic_cast<Bottleneck*>((*m->layer2)[0].get())->conv2.get();
  EXPECT_EQ(conv2->options.stride.h, 2);
  EXPECT_EQ(dynamic_cast<Bottleneck*>((*m->layer2)[0].get())->conv1->options.stride.h, 1);
  EXPECT_EQ(resnet34()->num_parameters(), 21797672);
}

TEST(ResNet, ForwardShapesAndInit) {
  manual_seed(0);
  auto m = resnet18({.num_classes = 7, .in_channels = 1});
  EXPECT_EQ(m->conv1->weight.sizes(), (Shape{64, 1, 7, 7}));
  Tensor y = (*m)(ops::randn({2, 1, 32, 32}));
  EXPECT_EQ(y.sizes(), (Shape{2, 7}));
  // kaiming_normal_(fan_out, relu) on layer4 convs: std sqrt(2 / (512 * 9))
  const auto v = m->layer4->named_parameters()[0].second.tolist();
  double ss = 0;
  for (double x : v) ss += x * x;
  EXPECT_NEAR(std::sqrt(ss / v.size()), std::sqrt(2.0 / (512 * 9)), 0.002);
  auto tiny = resnet_tiny({.num_classes = 10, .in_channels = 1});
  EXPECT_EQ((*tiny)(ops::randn({3, 1, 28, 28})).sizes(), (Shape{3, 10}));
  EXPECT_LT(tiny->num_parameters(), 200000);
}

TEST(GPT, Gpt2ParameterCountAndNames) {
  SkipInitGuard cheap;  // allocate the 124M parameters, do not initialise them
  GPT gpt(GPTConfig::preset("gpt2"));
  EXPECT_EQ(gpt.num_parameters(), 124439808);
  EXPECT_EQ(gpt.get_num_params(), 124439808 - 1024 * 768);
  auto p = shapes_of(gpt.named_parameters());
  EXPECT_EQ(p.at("transformer.wte.weight"), (Shape{50257, 768}));
  EXPECT_EQ(p.at("transformer.wpe.weight"), (Shape{1024, 768}));
  EXPECT_EQ(p.at("transformer.h.0.ln_1.weight"), (Shape{768}));
  EXPECT_EQ(p.at("transformer.h.0.attn.c_attn.weight"), (Shape{2304, 768}));
  EXPECT_EQ(p.at("transformer.h.0.attn.c_attn.bias"), (Shape{2304}));
  EXPECT_EQ(p.at("transformer.h.11.attn.c_proj.weight"), (Shape{768, 768}));
  EXPECT_EQ(p.at("transformer.h.5.mlp.c_fc.weight"), (Shape{3072, 768}));
  EXPECT_EQ(p.at("transformer.h.5.mlp.c_proj.weight"), (Shape{768, 3072}));
  EXPECT_EQ(p.at("transformer.ln_f.bias"), (Shape{768}));
  EXPECT_EQ(p.count("lm_head.weight"), 0u);  // tied: listed once, under wte
  EXPECT_EQ(p.size(), 148u);
}

// Every parameter of `a` has a gradient within tol * max |b's| of b's parameter of the same
// place (two models of one architecture after backward); tol 0: equal to the bit.
namespace {
void expect_same_grads(GPT& a, GPT& b, double tol) {
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].second.grad().defined()) << pa[i].first;
    EXPECT_EQ(pa[i].second.grad().sizes(), pb[i].second.sizes()) << pa[i].first;
    const std::vector<double> x = ops::to_vector(pa[i].second.grad()),
                              y = ops::to_vector(pb[i].second.grad());
    if (tol == 0) {
      EXPECT_EQ(x, y) << pa[i].first;
      continue;
    }
    double err = 0, scale = 0;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      err = std::max(err, std::abs(x[k] - y[k]));
      scale = std::max(scale, std::abs(y[k]));
    }
    EXPECT_LE(err, tol * scale) << pa[i].first;
  }
}

// A tiny GPT of vocabulary 96 (weights drawn after manual_seed(seed)) and one with the same
// weights whose config has `flag` off.
struct TwinGpts {
  GPTConfig cfg;  // on's
  std::unique_ptr<GPT> on, off;
};
TwinGpts twin_gpts(uint64_t seed, bool GPTConfig::*flag) {
  manual_seed(seed);
  GPTConfig cfg = GPTConfig::preset("tiny");
  cfg.vocab_size = 96;
  auto on = std::make_unique<GPT>(cfg);
  GPTConfig off_cfg = cfg;
  off_cfg.*flag = false;
  auto off = std::make_unique<GPT>(off_cfg);
  off->load_state_dict(on->state_dict());
  return {cfg, std::move(on), std::move(off)};
}

// (idx, targets) [2, 16] of tokens below `vocab`, drawn from `gen`.
std::pair<Tensor, Tensor> random_tokens(int64_t vocab, Generator& gen) {
  Tensor idx = ops::randint(0, vocab, {2, 16}, DType::int64, Device::cpu(), &gen);
  return {idx, ops::randint(0, vocab, {2, 16}, DType::int64, Device::cpu(), &gen)};
}

// One step of `a` and `b` from zeroed gradients, under bf16 autocast when `bf16`: the losses
// agree within loss_rtol (relative to b's) and every gradient within grad_tol
// (expect_same_grads). Returns the two losses.
std::pair<double, double> expect_same_step(GPT& a, GPT& b, const Tensor& idx, const Tensor& tgt,
                                           bool bf16, double loss_rtol, double grad_tol) {
  a.zero_grad();
  b.zero_grad();
  Tensor loss_a, loss_b;
  {
    std::optional<AutocastGuard> autocast;
    if (bf16) autocast.emplace(DeviceType::cpu, DType::bfloat16);
    loss_a = a(idx, tgt).second;
    loss_b = b(idx, tgt).second;
  }
  EXPECT_NEAR(loss_a.item(), loss_b.item(), loss_rtol * std::abs(loss_b.item()));
  loss_a.backward();
  loss_b.backward();
  expect_same_grads(a, b, grad_tol);
  return {loss_a.item(), loss_b.item()};
}
}  // namespace

// A vocabulary that is not a multiple of 64, under bf16 autocast: the classifier computes over
// 128 columns, the 28 extra at -inf, and gives the unpadded model's logits, loss and gradients
// (to bf16 roundings: the products run at another width). Ignored targets (-1) too. float32 is
// not padded: the logits are then the whole (contiguous) product.
TEST(GPT, PaddedClassifierMatchesUnpadded) {
  manual_seed(3);
  GPTConfig cfg = GPTConfig::preset("tiny");
  cfg.vocab_size = 100;
  GPT padded(cfg);
  cfg.classifier_pad_multiple = 0;
  GPT plain(cfg);
  plain.load_state_dict(padded.state_dict());
  Generator g(4);
  const auto [idx, tgt] = random_tokens(100, g);
  ops::fill_(ops::narrow(ops::select(tgt, 0, 1), 0, 12, 4), -1.0);
  EXPECT_TRUE(padded(idx, tgt).first.is_contiguous());  // float32: unpadded
  Tensor lp, loss_p, lu, loss_u;
  {
    AutocastGuard autocast(DeviceType::cpu, DType::bfloat16);
    std::tie(lp, loss_p) = padded(idx, tgt);
    std::tie(lu, loss_u) = plain(idx, tgt);
  }
  EXPECT_EQ(lp.sizes(), (Shape{2, 16, 100}));
  EXPECT_FALSE(lp.is_contiguous());  // a view of the padded product's first 100 columns
  EXPECT_TRUE(tally::testing::values_near(lp, ops::to_vector(lu), 2e-2));
  EXPECT_NEAR(loss_p.item(), loss_u.item(), 1e-3 * std::abs(loss_u.item()));
  loss_p.backward();
  loss_u.backward();
  expect_same_grads(padded, plain, 2e-2);
}

// GPTConfig::fused_mlp: each MLP as one LinearGeluLinearBackward node gives the loss and every
// gradient of c_fc -> gelu -> c_proj as three modules, in float32 and under bf16 autocast; a
// module checkpointed on its own turns the fusion off for its MLP.
TEST(GPT, FusedMlpMatchesTheThreeModules) {
  const TwinGpts gpts = twin_gpts(5, &GPTConfig::fused_mlp);
  GPT &fused = *gpts.on, &three = *gpts.off;
  Generator g(6);
  const auto [idx, tgt] = random_tokens(96, g);
  Tensor h = ops::randn({2, 16, gpts.cfg.n_embd});
  h.requires_grad_();
  auto& mlp = *std::dynamic_pointer_cast<Block>((*fused.transformer->h)[0])->mlp;
  EXPECT_EQ(mlp(h).autograd_meta()->grad_fn->name(), "LinearGeluLinearBackward");
  auto& mlp3 = *std::dynamic_pointer_cast<Block>((*three.transformer->h)[0])->mlp;
  EXPECT_EQ(mlp3(h).autograd_meta()->grad_fn->name(), "LinearBackward");
  mlp.c_fc->set_checkpoint(true);
  EXPECT_EQ(mlp(h).autograd_meta()->grad_fn->name(), "LinearBackward");
  mlp.c_fc->set_checkpoint(false);
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 autocast" : "float32");
    expect_same_step(fused, three, idx, tgt, bf16, bf16 ? 1e-2 : 1e-5, bf16 ? 3e-2 : 1e-5);
  }
}

// GPTConfig::fused_add_norm: every residual add inside a layer norm (AddLayerNormBackward nodes,
// the blocks' outputs deferred to the next ln_1 and to ln_f) gives the loss and gradients of
// the adds run apart, in float32 (to the bit: the same arithmetic) and under bf16 autocast;
// per-block checkpointing takes the unfused blocks and still agrees.
TEST(GPT, FusedAddNormMatchesTheAdds) {
  const TwinGpts gpts = twin_gpts(7, &GPTConfig::fused_add_norm);
  GPT &fused = *gpts.on, &apart = *gpts.off;
  Generator g(8);
  const auto [idx, tgt] = random_tokens(96, g);
  const Tensor hidden = fused.transformer->forward(idx);
  EXPECT_EQ(hidden.autograd_meta()->grad_fn->name(), "AddLayerNormBackward");
  EXPECT_EQ(apart.transformer->forward(idx).autograd_meta()->grad_fn->name(), "LayerNormBackward");
  for (int mode = 0; mode < 3; ++mode) {
    const bool bf16 = mode == 1, ckpt = mode == 2;
    SCOPED_TRACE(bf16 ? "bf16 autocast" : ckpt ? "checkpointed blocks" : "float32");
    if (ckpt) enable_checkpointing(fused, parse_checkpoint_spec("blocks"));
    const auto losses = expect_same_step(fused, apart, idx, tgt, bf16, 1e-3, bf16 ? 3e-2 : 1e-5);
    if (!bf16) {
      EXPECT_EQ(losses.first, losses.second);
    }
  }
}

// Under bf16 autocast the blocks' ln_1 and ln_2 write bfloat16 themselves (LayerNorm::
// autocast_output): the loss, the logits and every gradient are those of the same model
// with the float32 outputs cast by the Linears, to the bit; outside autocast nothing changes.
TEST(GPT, BlockLayerNormsWriteTheAutocastDtype) {
  manual_seed(5);
  const GPTConfig cfg = GPTConfig::preset("tiny");
  GPT fused(cfg), plain(cfg);
  plain.load_state_dict(fused.state_dict());
  for (const auto& m : *plain.transformer->h) {
    auto block = std::dynamic_pointer_cast<Block>(m);
    ASSERT_TRUE(block && block->ln_1->autocast_output && block->ln_2->autocast_output);
    block->ln_1->autocast_output = block->ln_2->autocast_output = false;
  }
  EXPECT_FALSE(fused.transformer->ln_f->autocast_output);  // its output leaves the blocks
  Generator g(6);
  const auto [idx, tgt] = random_tokens(256, g);
  Tensor lf, loss_f, lp, loss_p, ln_out;
  {
    AutocastGuard autocast(DeviceType::cpu, DType::bfloat16);
    std::tie(lf, loss_f) = fused(idx, tgt);
    std::tie(lp, loss_p) = plain(idx, tgt);
    auto block = std::dynamic_pointer_cast<Block>((*fused.transformer->h)[0]);
    ln_out = (*block->ln_1)(ops::randn({2, 16, cfg.n_embd}, DType::float32, Device::cpu(), &g));
  }
  EXPECT_EQ(ln_out.dtype(), DType::bfloat16);
  EXPECT_EQ(loss_f.item(), loss_p.item());
  const std::vector<double> a = ops::to_vector(lf), b = ops::to_vector(lp);
  EXPECT_EQ(a, b);
  loss_f.backward();
  loss_p.backward();
  expect_same_grads(fused, plain, 0);
  // Outside autocast: float32, as PyTorch's LayerNorm.
  auto block = std::dynamic_pointer_cast<Block>((*fused.transformer->h)[0]);
  EXPECT_EQ((*block->ln_1)(ops::zeros({1, 2, cfg.n_embd}, DType::float32, Device::cpu())).dtype(),
            DType::float32);
}

TEST(GPT, TinyForwardLossAndInit) {
  manual_seed(1);
  GPT gpt(GPTConfig::preset("tiny"));
  Generator g(2);
  const auto [idx, tgt] = random_tokens(256, g);
  auto [logits, loss] = gpt(idx, tgt);
  EXPECT_EQ(logits.sizes(), (Shape{2, 16, 256}));
  EXPECT_NEAR(loss.item(), std::log(256.0), 0.1);
  auto [l2, none] = gpt(idx);
  EXPECT_FALSE(none.defined());
  loss.backward();
  EXPECT_TRUE(gpt.transformer->wte->weight.grad().defined());
  EXPECT_TRUE(gpt.transformer->h->operator[](1)->named_parameters()[0].second.grad().defined());
  // GPT-2 init: c_proj std 0.02 / sqrt(2 * n_layer), others 0.02
  auto sd = gpt.named_parameters();
  auto stdev = [&](const std::string& name) {
    for (auto& [n, t] : sd)
      if (n == name) {
        double ss = 0;
        for (double v : t.tolist()) ss += v * v;
        return std::sqrt(ss / t.numel());
      }
    return -1.0;
  };
  EXPECT_NEAR(stdev("transformer.h.0.attn.c_attn.weight"), 0.02, 0.002);
  EXPECT_NEAR(stdev("transformer.h.0.mlp.c_proj.weight"), 0.01, 0.001);
  EXPECT_EQ(stdev("transformer.h.0.attn.c_attn.bias"), 0.0);
  // causality: changing a later token leaves earlier logits unchanged
  Tensor idx2 = ops::clone(idx);
  ops::fill_(ops::select(ops::select(idx2, 0, 0), 0, 15), 3.0);
  auto [l3, n3] = gpt(idx2);
  EXPECT_TRUE(tally::testing::values_near(
      ops::select(ops::select(l3, 0, 0), 0, 3),
      ops::to_vector(ops::select(ops::select(logits, 0, 0), 0, 3)), 1e-5));
  tally::testing::expect_error<std::invalid_argument>(
      [&] {
        gpt(ops::zeros({1, 65}, DType::int64));
      },
      {"block size is only 64"});
}
