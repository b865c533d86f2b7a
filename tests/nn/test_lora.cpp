// LoRA (nn/lora.h) on GPT's tiny preset: target matching, the adapters' names, shapes and
// initialisation, the output unchanged at injection (lora_B zero), gradients only for the
// adapters, the base weights unchanged by an optimizer step, and the errors.
#include <gtest/gtest.h>

#include "autograd/ops.h"
#include "nn/layers.h"
#include "nn/lora.h"
#include "nn/models/gpt.h"
#include "nn/parameter_split.h"
#include "optim/sgd.h"

namespace tally::nn {
namespace {

TEST(Lora, TargetsMatchWholePathsSuffixesAndPatterns) {
  EXPECT_TRUE(lora::matches("transformer.h.0.attn.c_attn", "c_attn"));
  EXPECT_TRUE(lora::matches("transformer.h.0.attn.c_attn", "attn.c_attn"));
  EXPECT_TRUE(lora::matches("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_attn"));
  EXPECT_TRUE(lora::matches("transformer.h.1.mlp.c_proj", "*.mlp.c_proj"));
  EXPECT_FALSE(lora::matches("transformer.h.0.attn.c_attn", "attn"));
  EXPECT_FALSE(lora::matches("transformer.h.0.attn.xc_attn", "c_attn"));
  EXPECT_FALSE(lora::matches("transformer.h.0.attn.c_proj", "*.mlp.c_proj"));
}

struct Tiny {
  std::shared_ptr<GPT> model;
  Tensor idx, targets;
  Tiny() {
    GPTConfig cfg = GPTConfig::preset("tiny");
    model = std::make_shared<GPT>(cfg);
    Generator g(3);
    idx = ops::randint(0, cfg.vocab_size, {2, 8}, DType::int64, Device::cpu(), &g);
    targets = ops::randint(0, cfg.vocab_size, {2, 8}, DType::int64, Device::cpu(), &g);
  }
};

TEST(Lora, AdaptersTrainAloneAndStartAtTheBaseOutput) {
  Tiny t;
  const Tensor before = (*t.model)(t.idx, t.targets).first.detach();
  const auto names = lora::inject(*t.model, {"c_attn", "mlp.c_fc"}, 4, 8.0);
  ASSERT_EQ(names.size(), 4u);  // two blocks, two targets each
  auto* c_attn = &t.model->get_submodule<Linear>(names[0]);
  EXPECT_EQ(c_attn->lora_A->weight.sizes(), (Shape{4, 64}));
  EXPECT_EQ(c_attn->lora_B->weight.sizes(), (Shape{192, 4}));
  EXPECT_DOUBLE_EQ(c_attn->lora_scaling, 2.0);
  for (double v : ops::to_vector(c_attn->lora_B->weight)) EXPECT_EQ(v, 0.0);

  int64_t trainable = 0;
  for (const auto& [name, p] : t.model->named_parameters()) {
    const bool is_lora = name.find(".lora_A.weight") != std::string::npos ||
                         name.find(".lora_B.weight") != std::string::npos;
    EXPECT_EQ(p.requires_grad(), is_lora) << name;
    trainable += is_lora;
  }
  EXPECT_EQ(trainable, 8);
  EXPECT_NE(lora::trainable_summary(*t.model).find("trainable params: 4,608 || all params: "),
            std::string::npos)
      << lora::trainable_summary(*t.model);
  // memory_summary with the model: the `parameter` row, then its trainable and frozen rows.
  const memory::ParameterSplit split = parameter_split(*t.model);
  EXPECT_EQ(split.trainable, 4608);
  EXPECT_GT(split.frozen, 0);
  EXPECT_GE(split.trainable_bytes, 4 * 4608);
  EXPECT_GE(split.frozen_bytes, 4 * split.frozen);
  const std::string summary = memory_summary(*t.model, Device::cpu());
  const size_t row = summary.find("| parameter ");
  ASSERT_NE(row, std::string::npos) << summary;
  const size_t next = summary.find('\n', row) + 1;
  EXPECT_EQ(summary.compare(next, 19, "|   trainable 4608 "), 0) << summary;
  EXPECT_EQ(summary.compare(summary.find('\n', next) + 1, 11, "|   frozen "), 0) << summary;
  EXPECT_EQ(summary.find('\n', next) - next, summary.find('\n', row) - row);  // one width

  auto [logits, loss] = (*t.model)(t.idx, t.targets);
  EXPECT_EQ(ops::to_vector(logits), ops::to_vector(before));
  loss.backward();
  std::map<std::string, std::vector<double>> base;
  for (const auto& [name, p] : t.model->named_parameters()) {
    EXPECT_EQ(p.grad().defined(), p.requires_grad()) << name;
    if (!p.requires_grad()) base[name] = ops::to_vector(p);
  }
  optim::SGD opt(t.model->parameters(), {.lr = 0.1});
  opt.step();
  for (const auto& [name, p] : t.model->named_parameters()) {
    if (!p.requires_grad()) {
      EXPECT_EQ(ops::to_vector(p), base[name]) << name;
    }
  }
  // lora_B moved (A's gradient is zero while B is zero), so the output now differs.
  EXPECT_NE(ops::to_vector(c_attn->lora_B->weight), std::vector<double>(192 * 4, 0.0));
  EXPECT_NE(ops::to_vector((*t.model)(t.idx, t.targets).first), ops::to_vector(before));
}

TEST(Lora, ErrorsNameTheTargets) {
  Tiny t;
  auto message = [&](const std::vector<std::string>& targets, int64_t r) {
    try {
      lora::inject(*t.model, targets, r);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({"q_proj"}, 8).find("target modules [q_proj] not found"), std::string::npos);
  EXPECT_NE(message({"attn"}, 8).find("'transformer.h.0.attn' is a CausalSelfAttention"),
            std::string::npos)
      << message({"attn"}, 8);
  EXPECT_NE(message({"c_attn"}, 0).find("r must be positive"), std::string::npos);
  // Nothing was changed by the failed calls.
  for (const Tensor& p : t.model->parameters()) EXPECT_TRUE(p.requires_grad());
  lora::inject(*t.model, {"c_attn"}, 2);
  EXPECT_NE(message({"c_attn"}, 2).find("already has a LoRA adapter"), std::string::npos);
}

}  // namespace
}  // namespace tally::nn
