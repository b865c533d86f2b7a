// The LLaMA-style decoder (nn/models/llama.h): HF's parameter names and counts (tiny, and 1b to
// 13b built on a dry run's meta device), the rotary tables kept out of the state dict, rotary
// embeddings' properties, grouped-query attention against multi-head attention with the kv
// heads repeated, a float64 gradcheck of a whole forward, checkpointing, the fused classifier,
// tied embeddings; on each device (test_llama_cuda on the GPU): a dry run's prediction of two
// steps, the model built on the device, and (accelerators) a step against the CPU's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "memory/estimate.h"
#include "memory/memory.h"
#include "nn/checkpoint.h"
#include "nn/models/llama.h"
#include "optim/adam.h"
#include "testing/devices.h"

using namespace tally;
using namespace tally::nn;

namespace {

// A float64-friendly miniature: 1 layer, 2 heads sharing 1 kv head.
LlamaConfig micro() {
  LlamaConfig c;
  c.vocab_size = 11, c.hidden_size = 8, c.intermediate_size = 12, c.num_hidden_layers = 1;
  c.num_attention_heads = 2, c.num_key_value_heads = 1, c.max_position_embeddings = 8;
  return c;
}

// Norm-wise relative error of a against b (both read back to the host).
double rel_err(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = ops::to_vector(a.to(Device::cpu())),
                            y = ops::to_vector(b.to(Device::cpu()));
  if (x.size() != y.size()) return INFINITY;
  double d = 0, n = 0;
  for (size_t i = 0; i < x.size(); ++i) d += (x[i] - y[i]) * (x[i] - y[i]), n += y[i] * y[i];
  return n > 0 ? std::sqrt(d / n) : std::sqrt(d);
}

using tally::testing::max_abs_diff;

void expect_same_grads(const Module& a, const Module& b, double tol) {
  const NamedTensors pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    SCOPED_TRACE(pa[i].first);
    ASSERT_EQ(pa[i].first, pb[i].first);
    const Tensor ga = pa[i].second.grad(), gb = pb[i].second.grad();
    ASSERT_TRUE(ga.defined() && gb.defined());
    EXPECT_LE(max_abs_diff(ga, gb), tol);
  }
}

Tensor tokens(int64_t vocab, const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return ops::randint(0, vocab, shape, DType::int64, Device::cpu(), &g);
}

// Two AdamW steps of tiny under bf16 autocast with its first block checkpointed, built on `d`.
void two_steps(Device d) {
  manual_seed(0);
  std::shared_ptr<LlamaForCausalLM> m;
  {
    BuildOnDevice on(d);
    m = std::make_shared<LlamaForCausalLM>(LlamaConfig::preset("tiny"));
  }
  enable_checkpointing(*m, parse_checkpoint_spec("1-blocks"));
  Tensor x, y;
  {
    memory::CategoryScope input(memory::Category::input);
    x = ops::randint(0, 256, {2, 32}, DType::int64, d);
    y = ops::randint(0, 256, {2, 32}, DType::int64, d);
  }
  optim::AdamW opt(m->parameters(), optim::AdamOptions{.lr = 1e-3});
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad(true);
    Tensor loss;
    {
      memory::PhaseScope phase("forward");
      AutocastGuard autocast(d.type, DType::bfloat16);
      loss = (*m)(x, y).second;
    }
    {
      memory::PhaseScope phase("backward");
      loss.backward();
    }
    opt.step();
  }
}

// Every allocation, free and re-tag of `d`'s history: action, size, category, module, op.
std::vector<std::string> events_of(Device d) {
  std::vector<std::string> out;
  for (const memory::TraceEntry& e : memory::get_allocator(d).history())
    if (e.action == memory::TraceAction::alloc || e.action == memory::TraceAction::free_requested ||
        e.action == memory::TraceAction::retag)
      out.push_back(std::string(memory::trace_action_name(e.action)) + " " +
                    std::to_string(e.size) + " " +
                    std::string(memory::category_name(e.tag.category)) + " '" +
                    memory::interned(e.tag.module) + "' '" + memory::interned(e.tag.op) + "'");
  return out;
}

}  // namespace

class LlamaOnDevice : public tally::testing::OnDevice {};
TALLY_ON_DEVICES(LlamaOnDevice);

// A dry run predicts two bf16 checkpointed AdamW steps: on the CPU, the very same allocator
// events (sizes, categories, modules, ops), peak and categories at the peak; on CUDA (the meta
// target "cuda" replays its backend: cuBLAS workspaces, flash attention) the peak within 1%.
TEST_P(LlamaOnDevice, DryRunPredictsTwoSteps) {
  const Device d = dev();
  memory::empty_cache(d);
  const int64_t before = static_cast<int64_t>(memory::memory_allocated(d));
  memory::reset_peak_memory_stats(d);
  memory::record_memory_history(true, 1000000, d);
  two_steps(d);
  const std::vector<std::string> real = events_of(d);
  const int64_t peak = static_cast<int64_t>(memory::max_memory_allocated(d)) - before;
  const auto at_peak = memory::get_allocator(d).stats().category_at_peak;
  memory::record_memory_history(false, 0, d);
  const memory::Estimate e = memory::estimate(two_steps, {.target = on_cpu() ? "cpu" : "cuda"});
  ASSERT_TRUE(e.fits()) << e.out_of_memory;
  if (!on_cpu()) {
    EXPECT_NEAR(static_cast<double>(e.peak_allocated), static_cast<double>(peak), 0.01 * peak);
    return;
  }
  const std::vector<std::string> dry = events_of(e.device);
  ASSERT_GT(real.size(), 100u);
  for (size_t i = 0; i < std::min(real.size(), dry.size()); ++i)
    ASSERT_EQ(dry[i], real[i]) << "event " << i;
  EXPECT_EQ(dry.size(), real.size());
  EXPECT_EQ(e.peak_allocated, peak);
  EXPECT_EQ(e.at_peak, at_peak);
}

// Built under BuildOnDevice: parameters and rotary tables made on the device itself (no host
// copy of a large model), the tables equal to the CPU's.
TEST_P(LlamaOnDevice, BuiltOnTheDevice) {
  std::shared_ptr<LlamaForCausalLM> m;
  {
    BuildOnDevice on(dev());
    m = std::make_shared<LlamaForCausalLM>(LlamaConfig::preset("tiny"));
  }
  for (const auto& [n, p] : m->named_parameters()) {
    EXPECT_EQ(p.device(), dev()) << n;
    EXPECT_EQ(p.storage().category(), memory::Category::parameter) << n;
  }
  const LlamaRotaryEmbedding host(LlamaConfig::preset("tiny"));
  const LlamaRotaryEmbedding& rope = *m->model->rotary_emb;
  EXPECT_EQ(rope.cos_cached.device(), dev());
  EXPECT_EQ(max_abs_diff(rope.cos_cached.to(Device::cpu()), host.cos_cached), 0);
  EXPECT_EQ(max_abs_diff(rope.sin_cached.to(Device::cpu()), host.sin_cached), 0);
  const Tensor idx = ops::to(tokens(256, {2, 8}, 3), dev(), DType::int64);
  EXPECT_TRUE(std::isfinite((*m)(idx, idx).second.item()));
}

class LlamaVsCpu : public tally::testing::VsCpu {};
TALLY_VS_CPU(LlamaVsCpu);

// One step of tiny on the accelerator against the CPU: float32 (TF32 off), and under bf16
// autocast (the flash attention path there), loss and every gradient norm-wise.
TEST_P(LlamaVsCpu, StepMatchesTheCpu) {
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 autocast" : "float32");
    manual_seed(41);
    LlamaForCausalLM cpu(LlamaConfig::preset("tiny")), acc(LlamaConfig::preset("tiny"));
    acc.load_state_dict(cpu.state_dict());
    acc.to(dev());
    const Tensor idx = tokens(256, {4, 32}, 42), tgt = tokens(256, {4, 32}, 43);
    Tensor lc, la;
    {
      AutocastGuard autocast(DeviceType::cpu, DType::bfloat16, bf16);
      lc = cpu(idx, tgt).second;
    }
    {
      AutocastGuard autocast(dev().type, DType::bfloat16, bf16);
      la = acc(put(idx), put(tgt)).second;
    }
    lc.backward();
    la.backward();
    EXPECT_LE(rel_err(la, lc), bf16 ? 1e-2 : 1e-5) << la.item() << " vs " << lc.item();
    const NamedTensors pc = cpu.named_parameters(), pa = acc.named_parameters();
    for (size_t i = 0; i < pc.size(); ++i)
      EXPECT_LE(rel_err(pa[i].second.grad(), pc[i].second.grad()), bf16 ? 5e-2 : 1e-4)
          << pc[i].first;
  }
}

TEST(Llama, TinyNamesAndCount) {
  LlamaForCausalLM m(LlamaConfig::preset("tiny"));
  std::vector<std::string> names;
  for (const auto& [n, p] : m.named_parameters()) names.push_back(n);
  std::vector<std::string> expected{"model.embed_tokens.weight"};
  for (const std::string l : {"0", "1"})
    for (const std::string s : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                "input_layernorm", "post_attention_layernorm"})
      expected.push_back("model.layers." + l + "." + s + ".weight");
  expected.push_back("model.norm.weight");
  expected.push_back("lm_head.weight");
  EXPECT_EQ(names, expected);
  // embed 256*64, per layer q 64*64, k and v 64*32, o 64*64, MLP 3*64*176, norms 2*64; norm;
  // the untied lm_head 256*64.
  EXPECT_EQ(m.num_parameters(), 16384 + 2 * (4096 + 2048 + 2048 + 4096 + 33792 + 128) + 64 + 16384);
  EXPECT_EQ(m.model->layers->size(), 2u);
  EXPECT_EQ(
      dynamic_cast<LlamaDecoderLayer&>(*(*m.model->layers)[0]).self_attn->k_proj->weight.sizes(),
      (Shape{32, 64}));
  // The rotary tables are buffers, left out of the state dict (HF's persistent=False), so the
  // state dict is the parameters and loads back strictly.
  const NamedTensors sd = m.state_dict();
  ASSERT_EQ(sd.size(), names.size());
  for (size_t i = 0; i < sd.size(); ++i) EXPECT_EQ(sd[i].first, names[i]);
  std::vector<std::string> buffers;
  for (const auto& [n, b] : m.named_buffers()) buffers.push_back(n);
  EXPECT_EQ(buffers, (std::vector<std::string>{"model.rotary_emb.cos_cached",
                                               "model.rotary_emb.sin_cached"}));
  LlamaForCausalLM other(LlamaConfig::preset("tiny"));
  other.load_state_dict(sd);
  EXPECT_EQ(max_abs_diff(other.lm_head->weight, m.lm_head->weight), 0);
  // Buffers convert with the model.
  m.to(DType::float64);
  EXPECT_EQ(m.model->rotary_emb->cos_cached.dtype(), DType::float64);
}

TEST(Llama, LargePresetCountsOnTheMetaDevice) {
  SkipInitGuard cheap;
  // A dry run's meta device replaying an H200 (141 GB): 13B float32 parameters fit.
  memory::DryRun dry({.target = "h200", .max_history = 0});
  BuildOnDevice on(dry.device());
  // Llama-2-7B's and -13B's published counts; 1b and 3b: Llama-3.2's layers with vocab 32000.
  for (const auto& [preset, count] : std::vector<std::pair<std::string, int64_t>>{
           {"7b", 6738415616}, {"13b", 13015864320}, {"1b", 1104218112}, {"3b", 3015355392}}) {
    SCOPED_TRACE(preset);
    LlamaForCausalLM m(LlamaConfig::preset(preset));
    EXPECT_EQ(m.num_parameters(), count);
    EXPECT_TRUE(m.lm_head->weight.device().is_meta());
  }
  const LlamaConfig c7 = LlamaConfig::preset("7b");
  EXPECT_EQ(c7.hidden_size, 4096);
  EXPECT_EQ(c7.intermediate_size, 11008);
  EXPECT_EQ(c7.max_position_embeddings, 4096);
  EXPECT_EQ(c7.vocab_size, 32000);
}

TEST(Llama, TiedEmbeddingsAndBadConfigs) {
  LlamaConfig c = LlamaConfig::preset("tiny");
  c.tie_word_embeddings = true;
  LlamaForCausalLM m(c);
  EXPECT_TRUE(m.lm_head->weight.is_same(m.model->embed_tokens->weight));
  EXPECT_EQ(m.num_parameters(),
            LlamaForCausalLM(LlamaConfig::preset("tiny")).num_parameters() - 256 * 64);
  c.num_key_value_heads = 3;
  try {
    LlamaForCausalLM bad(c);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(LlamaConfig::preset("70b"), std::invalid_argument);
  LlamaForCausalLM tiny(LlamaConfig::preset("tiny"));
  EXPECT_THROW(tiny(tokens(256, {1, 65}, 1)), std::invalid_argument);  // beyond the tables
}

TEST(Llama, RotaryEmbeddingProperties) {
  LlamaConfig c = micro();
  c.hidden_size = 16, c.num_attention_heads = 2, c.max_position_embeddings = 12;  // D = 8
  const LlamaRotaryEmbedding rope(c);
  const int64_t T = 12, D = 8;
  // The tables: cos(t * 10000^(-2i/D)) in columns i and i + D/2.
  const std::vector<double> cs = ops::to_vector(rope.cos_cached),
                            sn = ops::to_vector(rope.sin_cached);
  for (int64_t t : {0, 5, 11})
    for (int64_t i = 0; i < D / 2; ++i) {
      const double a = static_cast<double>(t) * std::pow(10000.0, -2.0 * i / D);
      EXPECT_NEAR(cs[t * D + i], std::cos(a), 1e-7);
      EXPECT_NEAR(cs[t * D + i + D / 2], std::cos(a), 1e-7);
      EXPECT_NEAR(sn[t * D + i + D / 2], std::sin(a), 1e-7);
    }
  // rotate_half of [1..8] is [-5 -6 -7 -8 1 2 3 4].
  EXPECT_TRUE(tally::testing::values_near(rotate_half(ops::arange(1, 9, 1, DType::float32)),
                                          {-5, -6, -7, -8, 1, 2, 3, 4}, 0));
  const Tensor cos = rope.cos_cached.to(DType::float64), sin = rope.sin_cached.to(DType::float64);
  // The same query and key vector at every position.
  Generator g(3);
  const Tensor qv = ops::randn({1, D}, DType::float64, Device::cpu(), &g);
  const Tensor kv = ops::randn({1, D}, DType::float64, Device::cpu(), &g);
  const Tensor q = apply_rotary_pos_emb(ops::expand(qv, {T, D}), cos, sin);
  const Tensor k = apply_rotary_pos_emb(ops::expand(kv, {T, D}), cos, sin);
  // Position 0 is the identity, and every rotation keeps the norm.
  EXPECT_TRUE(tally::testing::values_near(q.narrow(0, 0, 1), ops::to_vector(qv), 1e-7));
  const std::vector<double> qn = ops::to_vector(ops::sum(ops::mul(q, q), {1}));
  for (double n : qn) EXPECT_NEAR(n, qn[0], 1e-6);
  // The score q_m . k_n depends on m - n only.
  const std::vector<double> s = ops::to_vector(ops::matmul(q, ops::transpose(k, 0, 1)));
  for (int64_t m = 0; m + 3 < T; ++m)
    for (int64_t n = 0; n + 3 < T; ++n)
      EXPECT_NEAR(s[m * T + n], s[(m + 3) * T + (n + 3)], 1e-6) << m << " " << n;
}

TEST(Llama, GroupedQueryAttentionEqualsMultiHeadWithRepeatedKv) {
  manual_seed(4);
  LlamaConfig gc = micro();
  gc.hidden_size = 16, gc.num_attention_heads = 4, gc.num_key_value_heads = 2;
  LlamaConfig mc = gc;
  mc.num_key_value_heads = 4;
  const LlamaRotaryEmbedding rope(gc);
  LlamaAttention gqa(gc, &rope), mha(mc, &rope);
  {
    NoGradGuard ng;
    ops::copy_(mha.q_proj->weight, gqa.q_proj->weight);
    ops::copy_(mha.o_proj->weight, gqa.o_proj->weight);
    // MHA head h = GQA kv head h / 2 (rows of D = 4 per head).
    for (int64_t h = 0; h < 4; ++h) {
      ops::copy_(mha.k_proj->weight.narrow(0, h * 4, 4),
                 gqa.k_proj->weight.narrow(0, h / 2 * 4, 4));
      ops::copy_(mha.v_proj->weight.narrow(0, h * 4, 4),
                 gqa.v_proj->weight.narrow(0, h / 2 * 4, 4));
    }
  }
  Generator g(5);
  const Tensor x = ops::randn({2, 6, 16}, DType::float32, Device::cpu(), &g);
  const Tensor a = gqa(x), b = mha(x);
  EXPECT_LE(max_abs_diff(a, b), 1e-6);
  // repeat_kv: head h reads kv head h / n_rep.
  const Tensor r = repeat_kv(ops::reshape(ops::arange(0, 2, 1, DType::float32), {1, 1, 2, 1}), 3);
  EXPECT_TRUE(tally::testing::values_near(r, {0, 0, 0, 1, 1, 1}, 0));
}

TEST(Llama, Float64GradcheckOfAWholeForward) {
  LlamaConfig c = micro();
  c.initializer_range = 0.5;  // away from the near-linear regime of N(0, 0.02)
  manual_seed(11);
  LlamaForCausalLM m(c);
  m.to(DType::float64);
  {
    NoGradGuard ng;  // norms away from ones, so their gradients are not symmetric
    for (const auto& [n, p] : m.named_parameters())
      if (n.find("norm") != std::string::npos)
        ops::copy_(p, ops::add(ops::rand(p.sizes(), DType::float64), 0.5));
  }
  const Tensor idx = tokens(11, {2, 5}, 12);
  const Tensor tgt = tokens(11, {2, 5}, 13);
  const auto& l0 = dynamic_cast<LlamaDecoderLayer&>(*(*m.model->layers)[0]);
  TensorList params{m.model->embed_tokens->weight, l0.self_attn->q_proj->weight,
                    l0.self_attn->k_proj->weight,  l0.self_attn->v_proj->weight,
                    l0.self_attn->o_proj->weight,  l0.mlp->gate_proj->weight,
                    l0.mlp->up_proj->weight,       l0.mlp->down_proj->weight,
                    l0.input_layernorm->weight,    l0.post_attention_layernorm->weight,
                    m.model->norm->weight,         m.lm_head->weight};
  EXPECT_TRUE(tally::testing::gradcheck([&](const TensorList&) { return m(idx).first; }, params));
  EXPECT_TRUE(
      tally::testing::gradcheck([&](const TensorList&) { return m(idx, tgt).second; }, params));
}

TEST(Llama, CheckpointedStepsEqualThePlainStep) {
  manual_seed(21);
  const LlamaConfig c = LlamaConfig::preset("tiny");
  LlamaForCausalLM plain(c), ckpt(c);
  ckpt.load_state_dict(plain.state_dict());
  const Tensor idx = tokens(256, {2, 16}, 22), tgt = tokens(256, {2, 16}, 23);
  Tensor ref = plain(idx, tgt).second;
  ref.backward();
  EXPECT_EQ(checkpoint_block_count(ckpt), 2);
  for (const std::string spec : {"1-blocks", "blocks", "2-segments", "selective"}) {
    SCOPED_TRACE(spec);
    enable_checkpointing(ckpt, parse_checkpoint_spec(spec));
    ckpt.zero_grad();
    Tensor loss = ckpt(idx, tgt).second;
    EXPECT_EQ(loss.item(), ref.item());
    loss.backward();
    expect_same_grads(plain, ckpt, 1e-7);
  }
}

TEST(Llama, FusedClassifierMatchesTheLogits) {
  manual_seed(31);
  LlamaConfig c = LlamaConfig::preset("tiny");
  LlamaForCausalLM plain(c);
  c.fused_classifier = true;
  LlamaForCausalLM fused(c);
  fused.load_state_dict(plain.state_dict());
  const Tensor idx = tokens(256, {2, 16}, 32), tgt = tokens(256, {2, 16}, 33);
  auto [logits, lf] = fused(idx, tgt);
  EXPECT_FALSE(logits.defined());
  Tensor lp = plain(idx, tgt).second;
  EXPECT_NEAR(lf.item(), lp.item(), 1e-5);
  lf.backward();
  lp.backward();
  expect_same_grads(plain, fused, 1e-6);
}
