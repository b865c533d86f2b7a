// The user's line on every allocation (memory::CallSiteScope, AllocTag::loc): factories,
// modules, Tally's own models, backward() and step() called from this file are attributed to
// this file's lines, the innermost user line winning; snapshots, the profiler's memory events
// and display_source_path name the file relative to the source root.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "autograd/ops.h"
#include "memory/context.h"
#include "memory/memory.h"
#include "memory/snapshot.h"
#include "nn/layers.h"
#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "optim/adam.h"
#include "optim/grad_scaler.h"
#include "profiler/profiler.h"

namespace tally {
namespace {

using memory::AllocTag;
using memory::TraceAction;
using memory::TraceEntry;

constexpr std::string_view kThisFile = "tests/memory/test_call_site.cpp";

const Device cpu = Device::cpu();

AllocTag tag_of(const Tensor& t) {
  return memory::get_allocator(cpu).block_tag(t.data_ptr());
}

std::string file_of(const AllocTag& tag) {
  return std::string(memory::display_source_path(tag.loc.file));
}

// The allocator's history on the CPU while `fn` runs: the alloc entries it made.
template <typename Fn>
std::vector<TraceEntry> allocs_during(Fn&& fn) {
  memory::CachingAllocator& alloc = memory::get_allocator(cpu);
  alloc.record_memory_history(true, 1000000);
  fn();
  std::vector<TraceEntry> out;
  for (const TraceEntry& e : alloc.history())
    if (e.action == TraceAction::alloc) out.push_back(e);
  alloc.record_memory_history(false, 0);
  return out;
}

// Where the entries' lines are, as "file:line" -> count.
std::multiset<std::string> sites_of(const std::vector<TraceEntry>& entries) {
  std::multiset<std::string> s;
  for (const TraceEntry& e : entries)
    s.insert(file_of(e.tag) + ":" + std::to_string(e.tag.loc.line));
  return s;
}

std::string at_line(uint32_t line) {
  return std::string(kThisFile) + ":" + std::to_string(line);
}

TEST(CallSite, FactoryNamesTheCallersLine) {
  const uint32_t line = __LINE__ + 1;
  const Tensor t = zeros({64});
  const AllocTag tag = tag_of(t);
  EXPECT_EQ(file_of(tag), kThisFile);
  EXPECT_EQ(tag.loc.line, line);

  const uint32_t line2 = __LINE__ + 1;
  const Tensor u = randn({4, 4}).to(DType::float64);
  EXPECT_EQ(tag_of(u).loc.line, line2);  // Tensor::to takes the site too
}

TEST(CallSite, ModuleCallNamesTheCallersLine) {
  nn::Linear lin(8, 4);
  const Tensor x = ones({2, 8});
  const uint32_t line = __LINE__ + 1;
  const Tensor y = lin(x);
  const AllocTag tag = tag_of(y);
  EXPECT_EQ(file_of(tag), kThisFile);
  EXPECT_EQ(tag.loc.line, line);
  EXPECT_EQ(memory::interned(tag.op), "linear");
}

TEST(CallSite, TallysModelsNameTheUsersLineNotTheirOwn) {
  manual_seed(0);
  nn::GPT gpt(nn::GPTConfig::preset("tiny"));
  const Tensor idx = randint(0, 256, {2, 16});
  std::shared_ptr<nn::ResNetTiny> resnet = nn::resnet_tiny({.num_classes = 10});
  const Tensor img = randn({2, 3, 32, 32});
  optim::AdamW opt(gpt.parameters(), optim::AdamOptions{.lr = 1e-3});
  optim::GradScaler scaler(optim::GradScalerOptions{.enabled = true});

  Tensor loss;
  uint32_t gpt_line = 0, backward_line = 0, step_line = 0, resnet_line = 0;
  const std::vector<TraceEntry> gpt_allocs = allocs_during([&] {
    gpt_line = __LINE__ + 1;
    loss = gpt(idx, idx).second;
  });
  const std::vector<TraceEntry> backward_allocs = allocs_during([&] {
    backward_line = __LINE__ + 1;
    scaler.scale(loss).backward(Tensor(), false);
  });
  const std::vector<TraceEntry> step_allocs = allocs_during([&] {
    step_line = __LINE__ + 1;
    scaler.step(opt);
  });
  scaler.update();
  const std::vector<TraceEntry> resnet_allocs = allocs_during([&] {
    resnet_line = __LINE__ + 1;
    const Tensor logits = (*resnet)(img);
  });

  ASSERT_GT(gpt_allocs.size(), 20u);
  ASSERT_GT(backward_allocs.size(), 20u);
  ASSERT_GT(step_allocs.size(), 5u);  // AdamW's state, created at its first step
  ASSERT_GT(resnet_allocs.size(), 10u);
  const std::multiset<std::string> g = sites_of(gpt_allocs);
  EXPECT_EQ(g.count(at_line(gpt_line)), g.size()) << *g.begin();
  const std::multiset<std::string> b = sites_of(backward_allocs);
  // The scaled loss is made by scaler.scale on the same line; backward's gradients too.
  EXPECT_EQ(b.count(at_line(backward_line)), b.size()) << *b.begin();
  const std::multiset<std::string> s = sites_of(step_allocs);
  EXPECT_EQ(s.count(at_line(step_line)), s.size()) << *s.begin();
  const std::multiset<std::string> r = sites_of(resnet_allocs);
  EXPECT_EQ(r.count(at_line(resnet_line)), r.size()) << *r.begin();
  for (const std::string& site : g) EXPECT_FALSE(site.starts_with("nn/")) << site;
}

// A user module of this file: its forward's own lines are deeper user sites than the line
// that called it.
class Outer : public nn::Module {
 public:
  Outer() : Module("Outer") {
    inner = register_module("inner", std::make_shared<nn::Linear>(8, 8));
  }
  Tensor forward(const Tensor& x) override {
    inner_line = __LINE__ + 1;
    const Tensor h = (*inner)(x);
    zeros_line = __LINE__ + 1;
    extra = zeros({16});
    relu_line = __LINE__ + 1;
    return relu(h);  // an op takes its caller's line too
  }
  std::shared_ptr<nn::Linear> inner;
  Tensor extra;
  uint32_t inner_line = 0, zeros_line = 0, relu_line = 0;
};

TEST(CallSite, NestedUserSitesTakeTheInnermost) {
  Outer outer;
  const Tensor x = ones({2, 8});
  const Tensor y = outer(x);
  ASSERT_NE(outer.inner_line, 0u);
  EXPECT_EQ(tag_of(y).loc.line, outer.relu_line);
  // An operator cannot take a site: with no user line open, the library's line stands in.
  const Tensor y2 = outer(x) * 2.0;
  EXPECT_EQ(file_of(tag_of(y2)), "tensor/elementwise/autograd.cpp");
  EXPECT_EQ(tag_of(outer.extra).loc.line, outer.zeros_line);
  const std::vector<TraceEntry> allocs = allocs_during([&] { outer(x); });
  std::set<uint32_t> linear_lines;
  for (const TraceEntry& e : allocs)
    if (memory::interned(e.tag.op) == "linear") linear_lines.insert(e.tag.loc.line);
  EXPECT_EQ(linear_lines, std::set<uint32_t>{outer.inner_line});

  // CallSiteScope itself: open, the current tag carries its line; closed, none.
  {
    memory::CallSiteScope user;  // this line
    const uint32_t user_line = __LINE__ - 1;
    EXPECT_EQ(memory::current_tag().loc.line, user_line);
  }
  EXPECT_EQ(memory::current_tag().loc.line, 0u);  // closed
}

TEST(CallSite, SnapshotAndProfilerNameTheFileRelativeToTheSourceRoot) {
  memory::CachingAllocator& alloc = memory::get_allocator(cpu);
  alloc.record_memory_history(true, 100000);
  profiler::ProfilerOptions po;
  po.activities = {profiler::ProfilerActivity::cpu};
  po.profile_memory = true;
  po.with_stack = true;
  profiler::Profiler prof(po);
  prof.start();
  const uint32_t line = __LINE__ + 1;
  const Tensor t = full({128}, 2.0);
  prof.stop();

  std::ostringstream pickle;
  memory::write_snapshot_pickle(alloc.snapshot(), pickle);
  alloc.record_memory_history(false, 0);
  const std::string bytes = pickle.str();
  EXPECT_NE(bytes.find(std::string(kThisFile)), std::string::npos);
  EXPECT_EQ(bytes.find(std::string(TALLY_SOURCE_DIR) + "/tests"), std::string::npos);

  bool found = false;
  for (const profiler::MemoryEvent& m : prof.data().memory)
    found = found || (m.bytes > 0 && m.file == kThisFile && m.line == line);
  EXPECT_TRUE(found) << "no profiler memory event at " << at_line(line);
}

TEST(CallSite, DisplaySourcePath) {
  namespace fs = std::filesystem;
  const std::string root = TALLY_SOURCE_DIR;
  EXPECT_EQ(memory::display_source_path((root + "/examples/train_gpt.cpp").c_str()),
            "examples/train_gpt.cpp");
  EXPECT_EQ(memory::display_source_path("../nn/layers.cpp"), "nn/layers.cpp");
  EXPECT_EQ(memory::display_source_path("/nonexistent/dir/train.cpp"),
            "/nonexistent/dir/train.cpp");
  EXPECT_EQ(memory::display_source_path(""), "");
  EXPECT_EQ(memory::display_source_path(nullptr), "");
  // A file under the working directory (when that is outside the source root, as a user's
  // project is): relative to it.
  const std::string cwd = fs::current_path().string();
  if (!cwd.starts_with(root + "/") && cwd != "/") {
    const std::string user_file = cwd + "/src/train.cpp";
    EXPECT_EQ(memory::display_source_path(user_file.c_str()), "src/train.cpp");
  }
  EXPECT_TRUE(memory::is_library_source((root + "/nn/layers.cpp").c_str()));
  EXPECT_FALSE(memory::is_library_source((root + "/tests/nn/test_layers.cpp").c_str()));
}

TEST(CallSite, DifferentiableOpsNameTheCallersLine) {
  const Tensor a = ones({8, 8}, TensorOptions{}.with_requires_grad(true));
  const Tensor target = zeros({8}, TensorOptions{}.with_dtype(DType::int64));
  const uint32_t mm_line = __LINE__ + 1;
  const Tensor h = matmul(a, a);
  const uint32_t relu_line = __LINE__ + 1;
  const Tensor r = relu(h);
  const uint32_t sum_line = __LINE__ + 1;
  const Tensor s = sum(r, {1});
  const uint32_t ce_line = __LINE__ + 1;
  const Tensor loss = cross_entropy(r, target);
  EXPECT_EQ(file_of(tag_of(h)), kThisFile);
  EXPECT_EQ(tag_of(h).loc.line, mm_line);
  EXPECT_EQ(tag_of(r).loc.line, relu_line);
  EXPECT_EQ(tag_of(s).loc.line, sum_line);
  EXPECT_EQ(tag_of(loss).loc.line, ce_line);
  // An op Tally calls inside another op (cross_entropy's pieces) keeps the user's line.
  const std::vector<TraceEntry> allocs =
      allocs_during([&] { const Tensor l = cross_entropy(r, target, -100, 0.1); });
  ASSERT_FALSE(allocs.empty());
  for (const TraceEntry& e : allocs) EXPECT_EQ(file_of(e.tag), kThisFile);
}

TEST(CallSite, LibraryLineStandsInUntilAUserLineOpens) {
  // Built outside any user scope: the parameters name the library line that made them,
  // never the allocator's own call in tensor/storage.cpp.
  nn::Linear lin(4, 4);
  const std::string built = file_of(tag_of(lin.weight));
  EXPECT_EQ(built, "nn/layers.cpp");
  // Moved by the user's line: that line.
  const uint32_t line = __LINE__ + 1;
  lin.to(DType::float64);
  EXPECT_EQ(file_of(tag_of(lin.weight)), kThisFile);
  EXPECT_EQ(tag_of(lin.weight).loc.line, line);
  // A user line opened inside a library one still wins.
  {
    memory::CallSiteScope library(std::source_location::current());  // this file: a user line
    EXPECT_EQ(memory::current_tag().loc.line, __LINE__ - 1);
  }
}

}  // namespace
}  // namespace tally
