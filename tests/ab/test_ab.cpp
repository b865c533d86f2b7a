// tally::ab::run (ab/ab.h) on models written here, each with its own loss and data: a small
// CNN as a module instance and a small transformer from a factory, plus a registry model by
// name. Tiny shapes, 2 steps, one timing round.
#include <gtest/gtest.h>

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
    const int64_t b = idx.size(0), t = idx.size(1);
    const Tensor x = (*ln)((*tok)(idx));
    auto heads = [&](const Tensor& z) {
      return z.reshape({b, t, kHeads, kDim / kHeads}).transpose(1, 2);
    };
    const Tensor y = scaled_dot_product_attention(heads((*q)(x)), heads((*k)(x)), heads((*v)(x)),
                                                  Tensor(), 0.0, /*is_causal=*/true);
    const Tensor h = add(x, y.transpose(1, 2).reshape({b, t, kDim}));
    return (*out)(gelu((*fc)(h)));
  }
  std::shared_ptr<nn::Embedding> tok;
  std::shared_ptr<nn::LayerNorm> ln;
  std::shared_ptr<nn::Linear> q, k, v, fc, out;
};

std::string temp_dir(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("tally_ab_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
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
  ab::Options o;
  o.module = model;
  o.loss = [](nn::Module& m, const data::Example& b) {
    return cross_entropy(m(b.input), b.target);
  };
  for (int s = 0; s < 2; ++s) o.data.push_back({randn({4, 3, 8, 8}), randint(0, 4, {4})});
  o.precision = {"off"};
  o.optimizer = {"sgd"};
  o.grad_accum = {1, 2};
  o.rounds = 1;
  o.verbose = false;
  o.out = temp_dir("cnn");
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
  ab::Options o;
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
  o.rounds = 1;
  o.verbose = false;
  o.out = temp_dir("lm");
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

TEST(AbRun, RegistryModelByName) {
  ab::Options o;
  o.model = "gpt";
  o.model_options.seq = 32;
  o.batch = 4;
  o.steps = 2;
  o.checkpoint = {"none", "blocks"};
  o.rounds = 0;
  o.verbose = false;
  o.out = temp_dir("gpt");
  const ab::Results r = ab::run(o);
  ASSERT_EQ(r.configs.size(), 2u);
  EXPECT_LT(r.configs[1].at_peak[static_cast<size_t>(memory::Category::activation)],
            r.configs[0].at_peak[static_cast<size_t>(memory::Category::activation)]);
  EXPECT_EQ(r.configs[0].settings[3].second, "adamw");  // a token model's default optimizer
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
  EXPECT_THROW(ab::run(o), std::invalid_argument);  // no planner
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

}  // namespace
}  // namespace tally
