// tally::ab::run (ab/ab.h) on models written here, each with its own loss and data: a small
// CNN as a module instance and a small transformer from a factory, plus a registry model by
// name. Tiny shapes, 2 steps, one timing round.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ab/ab.h"
#include "ab/staged_dir.h"
#include "autograd/ops.h"
#include "nn/layers.h"
#include "nn/norm.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

class SmallCNN : public nn::Module {
 public:
  SmallCNN() : Module("SmallCNN") {
    conv1 = register_module("conv1",
                            std::make_shared<nn::Conv2d>(3, 8, 3, nn::Conv2dOptions{.padding = 1}));
    conv2 = register_module("conv2",
                            std::make_shared<nn::Conv2d>(8, 8, 3, nn::Conv2dOptions{.padding = 1}));
    head = register_module("head", std::make_shared<nn::Linear>(8, 4));
  }
  Tensor forward(const Tensor& x) override {
    const Tensor h = relu((*conv2)(relu((*conv1)(x))));
    return (*head)(mean(h, {2, 3}));
  }
  std::shared_ptr<nn::Conv2d> conv1, conv2;
  std::shared_ptr<nn::Linear> head;
};

// Causal self-attention of q, k, v [B, T, D] split into `heads` heads: [B, T, D].
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t heads) {
  const int64_t b = q.size(0), t = q.size(1), d = q.size(2);
  auto split = [&](const Tensor& z) { return z.reshape({b, t, heads, d / heads}).transpose(1, 2); };
  const Tensor y =
      scaled_dot_product_attention(split(q), split(k), split(v), Tensor(), 0.0, /*is_causal=*/true);
  return y.transpose(1, 2).reshape({b, t, d});
}

// One causal self-attention layer and an MLP over token embeddings; forward gives logits.
class TinyTransformer : public nn::Module {
 public:
  static constexpr int64_t kVocab = 32, kDim = 16, kHeads = 2;
  TinyTransformer() : Module("TinyTransformer") {
    tok = register_module("tok", std::make_shared<nn::Embedding>(kVocab, kDim));
    ln = register_module("ln", std::make_shared<nn::LayerNorm>(kDim));
    q = register_module("q", std::make_shared<nn::Linear>(kDim, kDim));
    k = register_module("k", std::make_shared<nn::Linear>(kDim, kDim));
    v = register_module("v", std::make_shared<nn::Linear>(kDim, kDim));
    fc = register_module("fc", std::make_shared<nn::Linear>(kDim, 4 * kDim));
    out = register_module("out", std::make_shared<nn::Linear>(4 * kDim, kVocab));
  }
  Tensor forward(const Tensor& idx) override {
    const Tensor x = (*ln)((*tok)(idx));
    const Tensor h = add(x, causal_attention((*q)(x), (*k)(x), (*v)(x), kHeads));
    return (*out)(gelu((*fc)(h)));
  }
  std::shared_ptr<nn::Embedding> tok;
  std::shared_ptr<nn::LayerNorm> ln;
  std::shared_ptr<nn::Linear> q, k, v, fc, out;
};

// A residual conv block, and a CNN of three: a repeated module type for the planner's
// checkpointing policies (type:ConvBlock, ...).
class ConvBlock : public nn::Module {
 public:
  ConvBlock() : Module("ConvBlock") {
    conv = register_module("conv",
                           std::make_shared<nn::Conv2d>(8, 8, 3, nn::Conv2dOptions{.padding = 1}));
  }
  Tensor forward(const Tensor& x) override { return add(x, relu((*conv)(x))); }
  std::shared_ptr<nn::Conv2d> conv;
};

class BlockCNN : public nn::Module {
 public:
  BlockCNN() : Module("BlockCNN") {
    stem = register_module("stem",
                           std::make_shared<nn::Conv2d>(3, 8, 3, nn::Conv2dOptions{.padding = 1}));
    for (int i = 0; i < 3; ++i)
      blocks.push_back(register_module(fmt::format("b{}", i), std::make_shared<ConvBlock>()));
    head = register_module("head", std::make_shared<nn::Linear>(8, 4));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*stem)(x);
    for (const auto& b : blocks) h = (*b)(h);
    return (*head)(mean(h, {2, 3}));
  }
  std::shared_ptr<nn::Conv2d> stem;
  std::vector<std::shared_ptr<ConvBlock>> blocks;
  std::shared_ptr<nn::Linear> head;
};

// A pre-norm transformer block (causal attention and an MLP, residual), and a language model
// of two.
class AttnBlock : public nn::Module {
 public:
  static constexpr int64_t kDim = 16, kHeads = 2;
  AttnBlock() : Module("AttnBlock") {
    ln = register_module("ln", std::make_shared<nn::LayerNorm>(kDim));
    qkv = register_module("qkv", std::make_shared<nn::Linear>(kDim, 3 * kDim));
    fc = register_module("fc", std::make_shared<nn::Linear>(kDim, 4 * kDim));
    proj = register_module("proj", std::make_shared<nn::Linear>(4 * kDim, kDim));
  }
  Tensor forward(const Tensor& x) override {
    const Tensor z = (*qkv)((*ln)(x));
    const Tensor h = add(x, causal_attention(z.narrow(2, 0, kDim), z.narrow(2, kDim, kDim),
                                             z.narrow(2, 2 * kDim, kDim), kHeads));
    return add(h, (*proj)(gelu((*fc)(h))));
  }
  std::shared_ptr<nn::LayerNorm> ln;
  std::shared_ptr<nn::Linear> qkv, fc, proj;
};

class BlockLM : public nn::Module {
 public:
  static constexpr int64_t kVocab = 32;
  BlockLM() : Module("BlockLM") {
    tok = register_module("tok", std::make_shared<nn::Embedding>(kVocab, AttnBlock::kDim));
    for (int i = 0; i < 2; ++i)
      blocks.push_back(register_module(fmt::format("h{}", i), std::make_shared<AttnBlock>()));
    out = register_module("out", std::make_shared<nn::Linear>(AttnBlock::kDim, kVocab));
  }
  Tensor forward(const Tensor& idx) override {
    Tensor h = (*tok)(idx);
    for (const auto& b : blocks) h = (*b)(h);
    return (*out)(h);
  }
  std::shared_ptr<nn::Embedding> tok;
  std::vector<std::shared_ptr<AttnBlock>> blocks;
  std::shared_ptr<nn::Linear> out;
};

std::string temp_dir(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("tally_ab_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

// Options that run `rounds` timing rounds quietly into temp_dir(name).
ab::Options quiet_options(const std::string& name, int rounds) {
  ab::Options o;
  o.rounds = rounds;
  o.verbose = false;
  o.out = temp_dir(name);
  return o;
}

std::vector<float> values(const Tensor& t) {
  const Tensor c = t.contiguous();
  const float* p = static_cast<const float*>(c.data_ptr());
  return std::vector<float>(p, p + c.numel());
}

nlohmann::json results_json(const std::string& out) {
  std::ifstream f(out + "/results.json");
  return nlohmann::json::parse(f);
}

// A killed run (SIGKILL skips the destructor) leaves its "<out>.tmpXXXXXX" staging folder: the
// next run for the same --out removes it (issue 54), and leaves a live run's folder and other
// targets' alone.
TEST(StagedOutputDir, NextRunRemovesStaleStagingFoldersOfItsTarget) {
  std::string root_name = (fs::temp_directory_path() / "tally_staged_XXXXXX").string();
  ASSERT_NE(::mkdtemp(root_name.data()), nullptr);
  const fs::path root(root_name), out = root / "report";
  fs::create_directories(out);
  const auto keep = [](const std::string&) { return true; };
  fs::create_directories(root / "report.tmpAbC123" / "sub");
  std::ofstream(root / "report.tmpAbC123" / "sub" / "old.pickle") << "stale";
  for (const char* other : {"reportx.tmpAbC123", "report.tmpAbC12", "report.oldAbC123"})
    fs::create_directories(root / other);
  {
    ab::StagedOutputDir live(out.string(), keep);  // holds its lock, as a running ab_memory does
    ASSERT_NE(live.path(), out.string());
    ASSERT_TRUE(fs::is_directory(live.path()));
    EXPECT_FALSE(fs::exists(root / "report.tmpAbC123"));  // a dead run's folder
    {
      ab::StagedOutputDir next(out.string(), keep);
      EXPECT_TRUE(fs::is_directory(live.path()));  // a live run's folder stays
      EXPECT_NE(next.path(), live.path());
    }
  }
  for (const char* other : {"reportx.tmpAbC123", "report.tmpAbC12", "report.oldAbC123"})
    EXPECT_TRUE(fs::is_directory(root / other)) << other;
  fs::remove_all(root);
}

TEST(AbRun, ModuleInstanceWithItsLossAndGradientAccumulation) {
  manual_seed(0);
  auto model = std::make_shared<SmallCNN>();
  const std::vector<float> before = values(model->conv1->weight);
  ab::Options o = quiet_options("cnn", 1);
  o.module = model;
  o.loss = [](nn::Module& m, const data::Example& b) {
    return cross_entropy(m(b.input), b.target);
  };
  for (int s = 0; s < 2; ++s) o.data.push_back({randn({4, 3, 8, 8}), randint(0, 4, {4})});
  o.precision = {"off"};
  o.optimizer = {"sgd"};
  o.grad_accum = {1, 2};
  const ab::Results r = ab::run(o);
  ASSERT_EQ(r.configs.size(), 2u);
  EXPECT_EQ(r.configs[0].name, "ckpt=none amp=off accum=1");
  EXPECT_EQ(r.configs[1].name, "ckpt=none amp=off accum=2");
  std::vector<std::string> phases;
  for (const auto& [phase, bytes] : r.configs[1].phase_peaks) phases.push_back(phase);
  EXPECT_EQ(phases,
            (std::vector<std::string>{"forward.0", "backward.0", "forward.1", "backward.1"}));
  for (const ab::ConfigResult& c : r.configs) {
    EXPECT_EQ(c.estimate.peak_allocated, c.peak_allocated) << c.name;  // predicted exactly
    EXPECT_GT(c.at_peak[static_cast<size_t>(memory::Category::parameter)], 0);
    EXPECT_EQ(c.at_peak[static_cast<size_t>(memory::Category::unknown)], 0);
    EXPECT_TRUE(fs::is_regular_file(c.snapshot_path)) << c.snapshot_path;
    EXPECT_TRUE(fs::is_regular_file(c.timeline_html_path));
    EXPECT_EQ(c.round_ms.size(), 1u);
  }
  EXPECT_LT(r.configs[1].at_peak[static_cast<size_t>(memory::Category::activation)],
            r.configs[0].at_peak[static_cast<size_t>(memory::Category::activation)]);
  // The mean gradient either way: the same loss after the first update.
  EXPECT_NEAR(r.configs[0].final_loss, r.configs[1].final_loss, 1e-4);
  ASSERT_EQ(r.headlines.size(), 1u);
  EXPECT_EQ(r.headlines[0].rfind("2 micro-batches: peak allocated ", 0), 0u) << r.headlines[0];
  EXPECT_TRUE(fs::is_regular_file(r.report));
  EXPECT_TRUE(fs::is_regular_file(r.diffs.at(0)));
  EXPECT_EQ(results_json(o.out)[1]["settings"]["accum"], "2");
  // The caller's module has its values back.
  EXPECT_EQ(values(model->conv1->weight), before);
  EXPECT_FALSE(model->conv1->weight.grad().defined());
  fs::remove_all(o.out);
}

TEST(AbRun, FactoryWithEvalAndPrecisions) {
  int evals = 0;
  ab::Options o = quiet_options("lm", 1);
  o.factory = [](Device) {  // a frozen embedding: the report splits the parameters
    auto m = std::make_shared<TinyTransformer>();
    m->tok->weight.requires_grad_(false);
    return m;
  };
  o.loss = [](nn::Module& m, const data::Example& b) {
    const Tensor logits = m(b.input);
    return cross_entropy(logits.reshape({-1, TinyTransformer::kVocab}), b.target.reshape({-1}));
  };
  o.eval = [&](nn::Module& m, const data::Example& b) {
    EXPECT_FALSE(m.is_training());
    ++evals;
    (void)m(b.input);
  };
  o.batches = [](int64_t step) {
    Generator gen(static_cast<uint64_t>(step));
    const Tensor idx =
        randint(0, TinyTransformer::kVocab, {2, 8}, TensorOptions{}.with_dtype(DType::int64), &gen);
    return data::Example{idx, idx};
  };
  o.steps = 2;
  o.precision = {"off", "bf16"};
  const ab::Results r = ab::run(o);
  ASSERT_EQ(r.configs.size(), 2u);
  EXPECT_EQ(r.configs[1].settings[1], (std::pair<std::string, std::string>{"amp", "bf16"}));
  EXPECT_GE(evals, 4);  // after the steps of each prediction, run and round
  for (const ab::ConfigResult& c : r.configs) {
    bool eval_phase = false;
    for (const auto& [phase, bytes] : c.phase_peaks) eval_phase = eval_phase || phase == "eval";
    EXPECT_TRUE(eval_phase) << c.name;
    EXPECT_TRUE(std::isfinite(c.final_loss));
  }
  // The frozen embedding (32 x 16) beside the trainable rest, in the table, JSON and page.
  const int64_t frozen = TinyTransformer::kVocab * TinyTransformer::kDim;
  for (const ab::ConfigResult& c : r.configs) {
    EXPECT_EQ(c.parameters.frozen, frozen) << c.name;
    EXPECT_GE(c.parameters.frozen_bytes, 4 * frozen) << c.name;
    EXPECT_GT(c.parameters.trainable, 0) << c.name;
  }
  EXPECT_NE(r.table.find("frozen param MiB"), std::string::npos) << r.table;
  EXPECT_EQ(results_json(o.out)[0]["parameters"]["frozen"], frozen);
  std::ifstream f(r.report);
  const std::string html((std::istreambuf_iterator<char>(f)), {});
  EXPECT_NE(html.find("TinyTransformer"), std::string::npos);
  EXPECT_NE(html.find("frozen parameters"), std::string::npos);
  fs::remove_all(o.out);
}

// The registry's tiny GPT, `seq` tokens by `batch`, 2 steps, no timing rounds, quiet.
ab::Options registry_gpt(int64_t seq, int64_t batch, const std::string& out) {
  ab::Options o = quiet_options(out, 0);
  o.model = "gpt";
  o.model_options.seq = seq;
  o.batch = batch;
  o.steps = 2;
  return o;
}

TEST(AbRun, RegistryModelByName) {
  ab::Options o = registry_gpt(32, 4, "gpt");
  o.checkpoint = {"none", "blocks"};
  const ab::Results r = ab::run(o);
  ASSERT_EQ(r.configs.size(), 2u);
  EXPECT_LT(r.configs[1].at_peak[static_cast<size_t>(memory::Category::activation)],
            r.configs[0].at_peak[static_cast<size_t>(memory::Category::activation)]);
  EXPECT_EQ(r.configs[0].settings[3].second, "adamw");  // a token model's default optimizer
  fs::remove_all(o.out);
}

// An optimizer with its state in pinned host memory, predicted for an H200 (no run): the host's
// peak gets a column and its JSON fields, and the host memory the dry runs check against is the
// caller's (the host update's time: CpuOffload.ADryRunChargesTheHostUpdate).
TEST(AbRun, OffloadedOptimizerShowsTheHostPeak) {
  ab::Options o = registry_gpt(16, 2, "host");
  o.optimizer = {"adamw", "adamw:cpu"};
  o.estimate = "h200";
  o.host_memory = size_t{64} << 10;  // 64 KiB: the offloaded state does not fit
  const ab::Results r = ab::run(o);
  ASSERT_EQ(r.configs.size(), 2u);
  EXPECT_GT(r.configs[1].host_peak_allocated, r.configs[0].host_peak_allocated);
  EXPECT_EQ(r.configs[1].estimate.host_memory, size_t{64} << 10);
  EXPECT_TRUE(r.configs[0].estimate.host_out_of_memory.empty())
      << r.configs[0].estimate.host_out_of_memory;
  EXPECT_FALSE(r.configs[1].estimate.host_out_of_memory.empty());
  EXPECT_NE(r.table.find("host peak"), std::string::npos) << r.table;
  std::ifstream f(o.out + "/results.json");
  const nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_GT(j[1]["host_peak_allocated"].get<int64_t>(), 0);
  fs::remove_all(o.out);
}

// Under bf16 a host optimizer's row keeps bfloat16 weights on the device, as train_model does:
// half the parameter bytes of the row with AdamW on the device.
TEST(AbRun, HostOptimizerUnderBf16KeepsBf16WeightsOnTheDevice) {
  ab::Options o = registry_gpt(16, 2, "host16");
  o.optimizer = {"adamw", "adamw:cpu"};
  o.precision = {"bf16"};
  o.estimate = "h200";
  const ab::Results r = ab::run(o);
  ASSERT_EQ(r.configs.size(), 2u);
  const auto parameter = static_cast<size_t>(memory::Category::parameter);
  const int64_t device = r.configs[0].estimate.at_peak[parameter];
  const int64_t host = r.configs[1].estimate.at_peak[parameter];
  EXPECT_GT(device, 0);
  EXPECT_NEAR(static_cast<double>(host), device / 2.0, device * 0.02);
  fs::remove_all(o.out);
}

TEST(AbRun, BadOptionsFailBeforeAnyRun) {
  ab::Options o;
  o.out = temp_dir("bad");
  EXPECT_THROW(ab::run(o), std::invalid_argument);  // no model
  o.model = "resnet";
  o.checkpoint = {"bogus"};
  EXPECT_THROW(ab::run(o), std::invalid_argument);
  o.checkpoint = {"auto"};
  EXPECT_THROW(ab::run(o), std::invalid_argument);  // no memory budget, no planner
  o.checkpoint = {"none"};
  o.grad_accum = {3};
  o.batch = 8;
  EXPECT_THROW(ab::run(o), std::invalid_argument);  // 8 rows into 3
  o.grad_accum = {2};
  o.step_in_backward = {true};
  EXPECT_THROW(ab::run(o), std::invalid_argument);
  EXPECT_FALSE(fs::exists(o.out + "/results.json"));
  fs::remove_all(o.out);
}

// checkpoint "auto" with a memory budget: the library planner resolves the row (no planner
// given), its choice named in the row, and the run stays within the budget. `model` is a
// module instance (the CNN) or a factory (the transformer).
ab::Results run_planned(ab::Options o, size_t budget, const std::string& name) {
  o.checkpoint = {"none", "auto"};
  o.memory_budget = budget;
  o.steps = 2;
  o.rounds = 0;
  o.verbose = false;
  o.out = temp_dir(name);
  ab::Results r = ab::run(o);
  fs::remove_all(o.out);
  return r;
}

TEST(AbRun, CheckpointAutoPlansAUserCnnWithinTheBudget) {
  manual_seed(0);
  ab::Options o;
  o.module = std::make_shared<BlockCNN>();
  for (int s = 0; s < 2; ++s) o.data.push_back({randn({8, 3, 16, 16}), randint(0, 4, {8})});
  const size_t budget = size_t{64} << 20;
  const ab::Results r = run_planned(o, budget, "plan_cnn");
  ASSERT_EQ(r.configs.size(), 2u);
  const ab::ConfigResult& planned = r.configs[1];
  EXPECT_EQ(planned.name.rfind("ckpt=auto(", 0), 0u) << planned.name;
  EXPECT_LE(planned.estimate.peak_reserved, static_cast<int64_t>(budget));
  EXPECT_LE(planned.peak_reserved, static_cast<int64_t>(budget));
  // A budget nothing meets: the planner's error, before that row runs.
  o.module = std::make_shared<BlockCNN>();
  try {
    (void)run_planned(o, 1024, "plan_cnn_small");
    FAIL() << "nothing fits in 1 KiB";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint 'auto'"), std::string::npos) << e.what();
  }
  (void)temp_dir("plan_cnn_small");  // removes what the failed run left
}

TEST(AbRun, CheckpointAutoPlansAUserTransformerWithinTheBudget) {
  ab::Options o;
  o.factory = [](Device) { return std::make_shared<BlockLM>(); };
  o.loss = [](nn::Module& m, const data::Example& b) {
    return cross_entropy(m(b.input).reshape({-1, BlockLM::kVocab}), b.target.reshape({-1}));
  };
  o.batches = [](int64_t step) {
    Generator gen(static_cast<uint64_t>(step));
    const Tensor idx =
        randint(0, BlockLM::kVocab, {4, 16}, TensorOptions{}.with_dtype(DType::int64), &gen);
    return data::Example{idx, idx};
  };
  o.precision = {"auto"};
  const size_t budget = size_t{64} << 20;
  const ab::Results r = run_planned(o, budget, "plan_lm");
  ASSERT_EQ(r.configs.size(), 1u);  // precision auto belongs to the planned row
  const ab::ConfigResult& planned = r.configs[0];
  EXPECT_EQ(planned.name.rfind("ckpt=auto(", 0), 0u) << planned.name;
  EXPECT_NE(planned.name.find("amp=auto("), std::string::npos) << planned.name;
  EXPECT_LE(planned.peak_reserved, static_cast<int64_t>(budget));
  EXPECT_TRUE(std::isfinite(planned.final_loss));
}

}  // namespace
}  // namespace tally
