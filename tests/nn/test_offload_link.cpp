// `--offload link` (issue 51, "offload that the link hides"): the policy's choice given a link
// speed and a forward time, what each block of a user's model saves, the link-speed cache file,
// and a training step with the policy equal in loss to one without offload (CPU).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "autograd/ops.h"
#include "memory/estimate.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/offload.h"
#include "optim/plan_training.h"
#include "tensor/host_link.h"
#include "testing/residual_mlp.h"

namespace tally {
namespace {

using testing::my_loss;
using testing::MyNet;
constexpr int64_t kIn = 8, kD = 16, kBlocks = 4, kClasses = 5, kBatch = 64;

// The planner tests' user model (tests/testing/residual_mlp.h), smaller.
auto make_net = [] { return testing::seeded_my_net(kIn, kD, kBlocks, kClasses); };
auto make_batch = [] { return testing::my_batch(kBatch, kIn, kClasses); };

TEST(OffloadLink, TakesCheckpointsFirstThenTheLargestThatFitTheForward) {
  const std::vector<nn::LinkCandidate> c = {
      {"a", 100, false}, {"b", 300, false}, {"c", 50, true}, {"d", 200, false}, {"e", 0, false}};
  // 1000 B/s over 80% of 0.5 s: 400 B. c (checkpointed) first, then b; d and a no longer fit.
  nn::LinkOffloadChoice x = nn::choose_link_offload(c, 1000, 0.5);
  EXPECT_EQ(x.modules, (std::vector<std::string>{"c", "b"}));
  EXPECT_EQ(x.bytes, 350);
  EXPECT_EQ(x.candidate_bytes, 650);
  EXPECT_EQ(x.candidates, 5);
  // The whole forward (500 B): d is passed over, the smaller a still fits.
  x = nn::choose_link_offload(c, 1000, 0.5, 1.0);
  EXPECT_EQ(x.modules, (std::vector<std::string>{"c", "b", "a"}));
  // A fast link takes everything that saves something; no forward time, nothing.
  EXPECT_EQ(nn::choose_link_offload(c, 1e6, 0.5).modules.size(), 4u);
  EXPECT_TRUE(nn::choose_link_offload(c, 1000, 0).modules.empty());
  const std::string s = nn::choose_link_offload(c, 2e9, 1e-6).str();
  EXPECT_NE(s.find("GB/s"), std::string::npos) << s;
  EXPECT_NE(s.find("forward"), std::string::npos) << s;
  // A module inside one taken, or around it, is not taken again.
  const std::vector<nn::LinkCandidate> nested = {
      {"b", 300, false}, {"b.x", 200, false}, {"b.y", 80, false}, {"c", 150, false}};
  EXPECT_EQ(nn::choose_link_offload(nested, 1000, 0.29, 1.0).modules,
            (std::vector<std::string>{"b.x", "b.y"}));
  EXPECT_EQ(nn::choose_link_offload(nested, 1000, 0.5, 1.0).modules,
            (std::vector<std::string>{"b", "c"}));
  // Where a module sits counts: its copies start at its end, one after another on the link.
  // 1000 B/s, 400 ms of the 500 ms forward: "late" ends at 450 ms, past the window.
  const std::vector<nn::LinkCandidate> placed = {
      {"early", 300, false, 1.0}, {"late", 50, false, 0.1}, {"mid", 150, false, 0.5}};
  x = nn::choose_link_offload(placed, 1000, 0.5);
  EXPECT_EQ(x.modules, (std::vector<std::string>{"early"}));  // mid: 300 ms busy, then 450
  EXPECT_EQ(x.blocks, (std::vector<std::string>{"early", "late", "mid"}));
  EXPECT_EQ(nn::choose_link_offload({placed[2]}, 1000, 0.5).modules,
            (std::vector<std::string>{"mid"}));  // alone: 250 + 150 ms
  EXPECT_THROW(nn::choose_link_offload(c, 0, 1), std::invalid_argument);
  EXPECT_THROW(nn::choose_link_offload(c, 1, 1, 1.5), std::invalid_argument);
  EXPECT_EQ(nn::parse_offload_spec("link").str(), "link");
  EXPECT_EQ(nn::parse_offload_spec("link").kind, nn::OffloadSpec::Kind::link);
}

TEST(OffloadLink, CandidatesOfAUserModelAndWhatEachSaves) {
  const std::vector<Tensor> batch = make_batch();
  auto net = make_net();
  nn::enable_checkpointing(*net, nn::parse_checkpoint_spec("name:blocks.*/2"));
  double forward = -1;
  const auto c = nn::link_candidates(
      *net, [&] { (void)my_loss(*net, batch); }, &forward);
  // The checkpointed blocks, the other blocks, then the modules inside those (norm, up, down).
  ASSERT_EQ(c.size(), 10u);
  EXPECT_EQ(c[0].name, "blocks.0");
  EXPECT_TRUE(c[0].checkpointed);
  EXPECT_EQ(c[1].name, "blocks.2");
  EXPECT_EQ(c[2].name, "blocks.1");
  EXPECT_FALSE(c[2].checkpointed);
  EXPECT_EQ(c[3].name, "blocks.3");
  EXPECT_EQ(c[4].name, "blocks.1.norm");
  EXPECT_EQ(c[9].name, "blocks.3.down");
  // A checkpointed block keeps its input; the others save more, their modules' saves included.
  EXPECT_EQ(c[0].saved_bytes, kBatch * kD * 4);
  EXPECT_GT(c[2].saved_bytes, 5 * c[0].saved_bytes);
  EXPECT_GE(c[2].saved_bytes, c[4].saved_bytes + c[5].saved_bytes + c[6].saved_bytes);
  EXPECT_EQ(c[5].saved_bytes, kBatch * kD * 4);  // up: its input
  EXPECT_GE(forward, 0);
  // Where each sits: the share of the forward's saves after its last one.
  EXPECT_GT(c[0].after, c[2].after);  // blocks.0, then blocks.1
  EXPECT_GT(c[2].after, c[3].after);  // blocks.3
  EXPECT_GT(c[3].after, 0);           // the head saves after it
  EXPECT_LE(c[0].after, 1);
  EXPECT_GT(c[4].after, c[5].after);  // blocks.1.norm, then blocks.1.up
  // The measuring forward keeps nothing.
  EXPECT_EQ(memory::get_allocator(Device::cpu())
                .stats()
                .category_bytes[static_cast<size_t>(memory::Category::activation)]
                .current,
            0);
  // Without a forward, and for a model with no block: errors naming the model.
  EXPECT_THROW(nn::offload_activations(*net, nn::parse_offload_spec("link")),
               std::invalid_argument);
  nn::Linear lin(4, 4);
  EXPECT_THROW(nn::link_candidates(
                   lin, [] {}, nullptr),
               std::invalid_argument);
}

// blocks b0..b2, each a Linear then a ReLU, and a head: each ReLU's output is saved by the ReLU
// and by the next block's Linear (or the head).
class LinRelu : public nn::Module {
 public:
  LinRelu() : Module("LinRelu") {
    lin = register_module("lin", std::make_shared<nn::Linear>(8, 8));
    act = register_module("act", std::make_shared<nn::ReLU>());
  }
  Tensor forward(const Tensor& x) override { return (*act)((*lin)(x)); }
  std::shared_ptr<nn::Linear> lin;
  std::shared_ptr<nn::ReLU> act;
};
class Chain : public nn::Module {
 public:
  Chain() : Module("Chain") {
    for (int i = 0; i < 3; ++i)
      blocks.push_back(register_module("b" + std::to_string(i), std::make_shared<LinRelu>()));
    head = register_module("head", std::make_shared<nn::Linear>(8, 2));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (const auto& b : blocks) h = (*b)(h);
    return (*head)(h);
  }
  std::vector<std::shared_ptr<LinRelu>> blocks;
  std::shared_ptr<nn::Linear> head;
};

TEST(OffloadLink, ASaveAModuleOutsideAlsoSavesIsNotCounted) {
  manual_seed(0);
  Chain net;
  const Tensor x = ops::randn({16, 8});
  int64_t total = 0;
  const auto c = nn::link_candidates(
      net, [&] { (void)net(x).sum(); }, nullptr, &total);
  std::map<std::string, int64_t> saved;
  for (const nn::LinkCandidate& k : c) saved[k.name] = k.saved_bytes;
  ASSERT_EQ(saved.size(), 9u) << "b0..b2 and their lin and act";
  // Offloading b0 frees x (its Linear's input) alone: its ReLU's output stays with b1's Linear.
  const int64_t row = 16 * 8 * 4;
  EXPECT_EQ(saved["b0"], row);
  EXPECT_EQ(saved["b0.lin"], row);
  EXPECT_EQ(saved["b0.act"], 0);
  EXPECT_EQ(saved["b1"], 0);
  EXPECT_EQ(saved["b2.act"], 0);  // the head keeps it
  // Every tensor counts once in the forward's total: x and the three ReLU outputs.
  EXPECT_EQ(total, 4 * row);
}

TEST(OffloadLink, ATrainingStepEqualsOneWithoutOffload) {
  const std::vector<Tensor> batch = make_batch();
  nn::TrainingPlanOptions o;
  nn::PlanCandidate plain;
  auto a = make_net();
  const double want = nn::train_candidate(*a, plain, my_loss, batch, 2, o).item();
  nn::PlanCandidate link = plain;
  link.offload = nn::parse_offload_spec("link");
  auto b = make_net();
  const double got = nn::train_candidate(*b, link, my_loss, batch, 2, o).item();
  EXPECT_EQ(got, want);
  // What it chose, on this machine: the link (memcpy) is fast against a tiny forward.
  auto net = make_net();
  nn::LinkOffloadChoice choice;
  const auto off = nn::offload_activations(
      *net, link.offload, {}, [&] { (void)my_loss(*net, batch); }, &choice);
  EXPECT_GT(choice.link_bytes_per_second, 0);
  EXPECT_EQ(choice.candidates, 4 * kBlocks);  // each block and its norm, up and down
  int offloading = 0;
  for (auto& [name, m] : net->named_modules()) offloading += m->offloader() != nullptr;
  EXPECT_EQ(offloading, static_cast<int>(choice.modules.size())) << choice.str();
  EXPECT_EQ(off != nullptr, !choice.modules.empty());
  // The blocks not offloaded report backward's progress to the restores' lead.
  EXPECT_GT(choice.forward_saved_bytes, 0);
  EXPECT_GT(choice.prefetch_lead, 0);
  ASSERT_EQ(choice.blocks.size(), static_cast<size_t>(kBlocks));
  for (const std::string& b : choice.blocks) {
    const nn::Module* m = nullptr;
    for (auto& [name, mod] : net->named_modules())
      if (name == b) m = mod;
    ASSERT_NE(m, nullptr) << b;
    EXPECT_EQ(m->offloader() != nullptr || m->offload_progress() != nullptr, off != nullptr) << b;
  }
}

TEST(OffloadLink, TheDryRunTakesTheTargetsLinkAndThePlannerSearchesIt) {
  {
    memory::DryRun dry({.spec = memory::meta_target("h200"), .max_history = 0});
    EXPECT_EQ(ops::host_link_bandwidth(dry.device()), 50e9);
  }
  EXPECT_GT(ops::host_link_bandwidth(Device::cpu()), 0);
  std::shared_ptr<MyNet> meta;
  {
    nn::BuildOnDevice on(Device::meta());
    meta = make_net();
  }
  nn::TrainingPlanOptions o;
  o.target = "h200";
  bool link = false;
  for (const nn::PlanCandidate& c : nn::training_plan_grid(*meta, kBatch, o))
    link |= c.offload.kind == nn::OffloadSpec::Kind::link;
  EXPECT_TRUE(link);
  // One candidate's dry run with the link policy.
  o.budget = size_t{1} << 30;
  o.checkpoints = {nn::CheckpointSpec{}};
  o.precisions = {std::nullopt};
  o.optimizers = {"adamw"};
  o.step_in_backward = {false};
  o.micro_batches = {1};
  o.offloads = {nn::parse_offload_spec("link")};
  const nn::MemoryPlan plan = nn::plan_memory([](const nn::PlanCandidate&) { return make_net(); },
                                              my_loss, make_batch(), o);
  ASSERT_EQ(plan.candidates.size(), 1u);
  EXPECT_TRUE(plan.candidates[0].error.empty()) << plan.candidates[0].error;
  EXPECT_GT(plan.candidates[0].step_seconds, 0);
}

// A temporary folder as $XDG_CACHE_HOME, restored after.
struct CacheHome {
  std::filesystem::path dir;
  std::string old;
  bool had = false;
  CacheHome() {
    dir = std::filesystem::temp_directory_path() / ("tally_link_" + std::to_string(getpid()));
    std::filesystem::remove_all(dir);
    if (const char* v = std::getenv("XDG_CACHE_HOME")) {
      had = true;
      old = v;
    }
    setenv("XDG_CACHE_HOME", dir.c_str(), 1);
  }
  ~CacheHome() {
    if (had)
      setenv("XDG_CACHE_HOME", old.c_str(), 1);
    else
      unsetenv("XDG_CACHE_HOME");
    std::filesystem::remove_all(dir);
  }
};

TEST(OffloadLink, TheCacheFileRoundTripsAndACorruptOneNamesFileAndByte) {
  CacheHome home;
  const std::string path = ops::host_link_cache_path();
  EXPECT_EQ(path, (home.dir / "tally" / "host_link.json").string());
  EXPECT_TRUE(ops::read_host_link_cache(path).empty());  // no file yet
  const std::map<std::string, double> entries = {{"NVIDIA H100 80GB HBM3", 5.3e10},
                                                 {"NVIDIA H200", 5.5e10}};
  ops::write_host_link_cache(path, entries);
  EXPECT_EQ(ops::read_host_link_cache(path), entries);
  {
    std::ofstream out(path, std::ios::trunc);
    out << "{\"host_link_bytes_per_second\": {\"x\": 1e9,,}}";
  }
  try {
    ops::read_host_link_cache(path);
    FAIL() << "a corrupt cache was read";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find("at byte 42"), std::string::npos) << m;
  }
  {
    std::ofstream out(path, std::ios::trunc);
    out << "{\"host_link_bytes_per_second\": {\"x\": -1}}";
  }
  EXPECT_THROW(ops::read_host_link_cache(path), std::runtime_error);
}

}  // namespace
}  // namespace tally
