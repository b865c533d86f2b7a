// nn::Module and the layers: registration and PyTorch-style names, dedup of tied weights,
// in-place to(), zero_grad, train/eval, module paths on allocations and in errors,
// state_dict / load_state_dict, init, and a float64 gradient check of small layer stacks.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "nn/container.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/loss.h"
#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "nn/norm.h"
#include "testing/gradcheck.h"

using namespace tally;
using namespace tally::nn;
using tally::testing::contains;
using tally::testing::gradcheck;

namespace {
std::vector<std::string> names_of(const NamedTensors& v) {
  std::vector<std::string> r;
  for (const auto& [n, t] : v) r.push_back(n);
  return r;
}
struct Net : Module {
  Net() : Module("Net") {
    fc1 = register_module("fc1", std::make_shared<Linear>(3, 4));
    seq = register_module(
        "seq", std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
                   std::make_shared<ReLU>(), std::make_shared<Linear>(4, 2)}));
    scale = register_parameter("scale", ops::ones({2}));
    register_buffer("counter", ops::zeros({1}));
  }
  Tensor forward(const Tensor& x) override { return mul((*seq)((*fc1)(x)), scale); }
  std::shared_ptr<Linear> fc1;
  std::shared_ptr<Sequential> seq;
  Tensor scale;
};
}  // namespace

TEST(Module, NamedParametersInPyTorchOrder) {
  Net net;
  EXPECT_EQ(
      names_of(net.named_parameters()),
      (std::vector<std::string>{"scale", "fc1.weight", "fc1.bias", "seq.1.weight", "seq.1.bias"}));
  EXPECT_EQ(names_of(net.named_buffers()), (std::vector<std::string>{"counter"}));
  EXPECT_EQ(names_of(net.state_dict()),
            (std::vector<std::string>{"scale", "counter", "fc1.weight", "fc1.bias", "seq.1.weight",
                                      "seq.1.bias"}));
  std::vector<std::string> mods;
  for (auto& [n, m] : net.named_modules()) mods.push_back(n);
  EXPECT_EQ(mods, (std::vector<std::string>{"", "fc1", "seq", "seq.0", "seq.1"}));
  EXPECT_EQ(net.children().size(), 2u);
  EXPECT_EQ(net.num_parameters(), 2 + 12 + 4 + 8 + 2);
  // parameters() are the leaves themselves
  EXPECT_TRUE(net.parameters()[1].is_same(net.fc1->weight));
  for (const Tensor& p : net.parameters()) EXPECT_TRUE(p.requires_grad() && p.is_leaf());
}

TEST(Module, ParametersAreTaggedParameter) {
  Linear lin(8, 8);
  EXPECT_EQ(lin.weight.storage().category(), memory::Category::parameter);
  BatchNorm2d bn(4);
  EXPECT_EQ(bn.running_mean.storage().category(), memory::Category::parameter);
  EXPECT_EQ(bn.num_batches_tracked.dtype(), DType::int64);
  EXPECT_EQ(bn.num_batches_tracked.dim(), 0);
}

TEST(Module, ToDtypeKeepsHandlesAndIntBuffers) {
  auto bn = std::make_shared<BatchNorm2d>(3);
  Sequential seq{std::make_shared<Linear>(2, 3), bn};
  Tensor w = seq.named_parameters()[0].second;
  seq.to(DType::float64);
  EXPECT_EQ(w.dtype(), DType::float64);
  EXPECT_TRUE(w.is_same(seq.parameters()[0]));
  EXPECT_TRUE(w.requires_grad());
  EXPECT_EQ(bn->running_var.dtype(), DType::float64);
  EXPECT_EQ(bn->num_batches_tracked.dtype(), DType::int64);
  EXPECT_EQ(w.storage().category(), memory::Category::parameter);
}

TEST(Module, ZeroGrad) {
  Net net;
  Tensor x = ops::ones({2, 3});
  net(x).sum().backward();
  for (const Tensor& p : net.parameters()) EXPECT_TRUE(p.grad().defined());
  net.zero_grad(false);
  for (const Tensor& p : net.parameters()) {
    ASSERT_TRUE(p.grad().defined());
    for (double v : p.grad().tolist()) EXPECT_EQ(v, 0.0);
  }
  net.zero_grad();
  for (const Tensor& p : net.parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(Module, DefaultInitIsSeededAndBounded) {
  manual_seed(7);
  Linear a(50, 20);
  manual_seed(7);
  Linear b(50, 20);
  EXPECT_EQ(a.weight.tolist(), b.weight.tolist());
  const double bound = 1.0 / std::sqrt(50.0);
  double maxabs = 0;
  for (double v : a.weight.tolist()) maxabs = std::max(maxabs, std::abs(v));
  EXPECT_LE(maxabs, bound);
  EXPECT_GT(maxabs, 0.8 * bound);
  Generator g(3);
  Conv2d c(4, 8, 3, Conv2dOptions{}, &g);
  const double cb = 1.0 / std::sqrt(4.0 * 9.0);
  for (double v : c.bias.tolist()) EXPECT_LE(std::abs(v), cb);
  // kaiming_normal_(fan_out, relu): std sqrt(2 / (out * k * k))
  Tensor t = make_parameter({64, 32, 3, 3});
  init::kaiming_normal_(t, 0.0, "fan_out", "relu", &g);
  double ss = 0;
  for (double v : t.tolist()) ss += v * v;
  const double sd = std::sqrt(ss / static_cast<double>(t.numel()));
  EXPECT_NEAR(sd, std::sqrt(2.0 / (64 * 9)), 0.01 * sd * 3);
  Embedding e(10, 4, 2);
  for (double v : ops::select(e.weight, 0, 2).tolist()) EXPECT_EQ(v, 0.0);
}

TEST(Module, TrainEvalChangesBatchNormAndDropout) {
  BatchNorm2d bn(2);
  Generator g(1);
  Tensor x = ops::affine(ops::randn({4, 2, 3, 3}, DType::float32, Device::cpu(), &g), 2.0, 5.0);
  Tensor y = bn(x);  // training: batch statistics -> mean ~0
  EXPECT_NEAR(ops::item(ops::mean(y)), 0.0, 1e-5);
  EXPECT_EQ(ops::item(bn.num_batches_tracked), 1.0);
  const double rm = bn.running_mean.tolist()[0];
  EXPECT_NEAR(rm, 0.1 * ops::item(ops::mean(ops::select(x, 1, 0))), 1e-5);
  bn.eval();
  EXPECT_FALSE(bn.is_training());
  Tensor ye = bn(x);  // running statistics: far from zero mean
  EXPECT_GT(std::abs(ops::item(ops::mean(ye))), 1.0);
  EXPECT_EQ(ops::item(bn.num_batches_tracked), 1.0);
  EXPECT_EQ(bn.running_mean.tolist()[0], rm);

  Sequential s{std::make_shared<Dropout>(0.5)};
  Tensor ones = ops::ones({1000});
  int zeros = 0;
  for (double v : s(ones).tolist()) zeros += v == 0.0;
  EXPECT_GT(zeros, 400);
  EXPECT_LT(zeros, 600);
  s.eval();
  EXPECT_EQ(s(ones).tolist(), ones.tolist());
  s.train();
  EXPECT_TRUE(s[0]->is_training());
}

TEST(Module, ForwardAllocationsCarryModulePath) {
  auto model = resnet_tiny({.num_classes = 10, .in_channels = 1});
  auto& alloc = memory::get_allocator(Device::cpu());
  alloc.record_memory_history(true);
  Tensor x = ops::randn({2, 1, 28, 28});
  Tensor loss = cross_entropy((*model)(x), ops::from_vector({1, 2}, {2}, DType::int64));
  std::set<std::string> paths;
  for (const auto& e : alloc.history())
    if (e.action == memory::TraceAction::alloc) paths.insert(memory::interned(e.tag.module));
  alloc.record_memory_history(false);
  for (const char* p : {"conv1", "bn1", "layer1.0.conv1", "layer1.0.bn2", "layer2.0.downsample.0",
                        "layer3.0.conv2", "fc"})
    EXPECT_TRUE(paths.count(p)) << p;
  EXPECT_EQ(memory::interned(memory::current_tag().module), "");
}

TEST(Module, ErrorNamesModulePathOnce) {
  auto inner = std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(3, 4, 3), std::make_shared<Conv2d>(5, 6, 3)});
  Sequential outer{std::make_shared<Identity>(), inner};
  const std::string msg = tally::testing::error_of<std::exception>([&] {
    outer(ops::zeros({1, 3, 8, 8}));
  });
  EXPECT_TRUE(msg.rfind("1.1 (Conv2d): ", 0) == 0) << msg;
  EXPECT_TRUE(contains(msg, "conv2d")) << msg;
  EXPECT_FALSE(contains(msg, "Sequential")) << msg;

  auto r = resnet_tiny({.num_classes = 10, .in_channels = 1});
  const std::string m2 = tally::testing::error_of<std::exception>([&] {
    (*r)(ops::zeros({1, 3, 28, 28}));
  });
  EXPECT_TRUE(m2.rfind("conv1 (Conv2d): ", 0) == 0) << m2;
  // Errors keep their standard type.
  Linear lin(4, 2);
  EXPECT_THROW(lin(ops::zeros({3, 5})), std::exception);
}

// register_forward_pre_hook: hooks run at each call, before the forward, in registration order,
// inside the module's scope (a throw carries its path); a removed hook no longer runs, and an
// empty one is refused.
TEST(Module, ForwardPreHooksRunBeforeTheForwardInOrder) {
  auto fc = std::make_shared<Linear>(4, 2);
  Sequential seq{std::make_shared<Identity>(), fc};
  std::vector<std::string> calls;
  const uint64_t a = fc->register_forward_pre_hook([&](Module& m) {
    calls.push_back("a " + m.type_name() + " " + memory::interned(memory::current_tag().module));
  });
  fc->register_forward_pre_hook([&](Module&) { calls.push_back("b"); });
  seq(ops::zeros({3, 4}));
  EXPECT_EQ(calls, (std::vector<std::string>{"a Linear 1", "b"}));
  fc->remove_forward_pre_hook(a);
  fc->remove_forward_pre_hook(a);  // already gone: ignored
  seq(ops::zeros({3, 4}));
  EXPECT_EQ(calls, (std::vector<std::string>{"a Linear 1", "b", "b"}));
  fc->register_forward_pre_hook([](Module&) { throw std::runtime_error("not ready"); });
  const std::string msg = tally::testing::error_of<std::exception>([&] {
    seq(ops::zeros({3, 4}));
  });
  EXPECT_TRUE(msg.rfind("1 (Linear): not ready", 0) == 0) << msg;
  EXPECT_THROW(fc->register_forward_pre_hook({}), std::invalid_argument);
}

TEST(Module, LoadStateDictErrors) {
  Net a, b;
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.fc1->weight.tolist(), a.fc1->weight.tolist());
  NamedTensors sd = a.state_dict();
  sd.erase(sd.begin() + 2);                          // fc1.weight missing
  sd.emplace_back("extra.weight", ops::zeros({1}));  // unexpected
  tally::testing::expect_error<std::runtime_error>(
      [&] { b.load_state_dict(sd); },
      {"Missing key(s)", "\"fc1.weight\"", "Unexpected key(s)", "\"extra.weight\"", "Net"});
  b.load_state_dict(sd, /*strict=*/false);
  NamedTensors bad = a.state_dict();
  bad[2].second = ops::zeros({5, 3});
  tally::testing::expect_error<std::runtime_error>(
      [&] { b.load_state_dict(bad, false); }, {"size mismatch for fc1.weight", "[5, 3]", "[4, 3]"});
}

TEST(Module, TiedWeightCountedOnceAndLoadableUnderEitherName) {
  GPT gpt(GPTConfig::preset("tiny"));
  EXPECT_TRUE(gpt.lm_head->weight.is_same(gpt.transformer->wte->weight));
  auto names = names_of(gpt.named_parameters());
  EXPECT_EQ(names.front(), "transformer.wte.weight");
  EXPECT_EQ(std::count(names.begin(), names.end(), "lm_head.weight"), 0);
  auto sd = gpt.state_dict();
  auto sdn = names_of(sd);
  EXPECT_EQ(sdn.back(), "lm_head.weight");
  EXPECT_EQ(std::count(sdn.begin(), sdn.end(), "transformer.wte.weight"), 1);
  // A file without lm_head.weight (safetensors' save_model drops it) loads strictly.
  GPT other(GPTConfig::preset("tiny"));
  NamedTensors without;
  for (auto& [n, t] : sd)
    if (n != "lm_head.weight") without.emplace_back(n, t);
  other.load_state_dict(without);
  EXPECT_EQ(other.lm_head->weight.tolist(), gpt.transformer->wte->weight.tolist());
}

TEST(Module, GradcheckLinearStack) {
  Generator g(5);
  Sequential s{std::make_shared<Linear>(3, 4, true, &g), std::make_shared<GELU>("tanh"),
               std::make_shared<LayerNorm>(4), std::make_shared<Linear>(4, 2, true, &g)};
  s.to(DType::float64);
  // LayerNorm's affine parameters away from ones/zeros, so their gradients matter.
  init::uniform_(s.parameters()[2], 0.5, 1.5, &g);
  init::uniform_(s.parameters()[3], -0.5, 0.5, &g);
  TensorList inputs{tally::testing::rand_input({5, 3})};
  for (const Tensor& p : s.parameters()) inputs.push_back(p);
  EXPECT_TRUE(gradcheck([&](const TensorList& in) { return s(in[0]); }, inputs));
}

TEST(Module, GradcheckConvBatchNormStack) {
  Generator g(6);
  auto bn = std::make_shared<BatchNorm2d>(3);
  Sequential s{std::make_shared<Conv2d>(2, 3, 3, Conv2dOptions{.padding = 1}, &g),
               bn,
               std::make_shared<GELU>(),
               std::make_shared<AdaptiveAvgPool2d>(2),
               std::make_shared<Flatten>(),
               std::make_shared<Linear>(12, 3, true, &g)};
  s.to(DType::float64);
  init::uniform_(bn->weight, 0.5, 1.5, &g);
  TensorList inputs{tally::testing::rand_input({2, 2, 4, 4})};
  for (const Tensor& p : s.parameters()) inputs.push_back(p);
  Tensor target = ops::from_vector({0, 2}, {2}, DType::int64);
  CrossEntropyLoss ce(-100, "mean", 0.1);
  EXPECT_TRUE(gradcheck([&](const TensorList& in) { return ce(s(in[0]), target); }, inputs));
}

// ---- issue 20's API gaps ----

TEST(Module, ParameterRegisteredFromAnyTensorIsTaggedParameter) {
  struct Custom : Module {
    Custom() : Module("Custom") {
      w = register_parameter("w", randn({16, 16}) * 0.02);  // a product: a temporary first
      b = register_buffer("b", ones({16}) + 1.0);
    }
    Tensor w, b;
  } m;
  EXPECT_EQ(m.w.storage().category(), memory::Category::parameter);
  EXPECT_EQ(m.b.storage().category(), memory::Category::parameter);
  EXPECT_TRUE(m.w.requires_grad() && m.w.is_leaf());
}

TEST(Module, GetSubmoduleWalksDottedPaths) {
  auto model = resnet_tiny({.num_classes = 10, .in_channels = 1});
  EXPECT_EQ(&model->get_submodule(""), model.get());
  Module& conv = model->get_submodule("layer1.0.conv1");
  EXPECT_EQ(conv.type_name(), "Conv2d");
  EXPECT_EQ(&model->get_submodule<Conv2d>("layer1.0.conv1"), &conv);
  try {
    model->get_submodule("layer1.0.conv9");
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_TRUE(contains(e.what(), "layer1.0")) << e.what();
    EXPECT_TRUE(contains(e.what(), "'conv9'")) << e.what();
  }
  EXPECT_THROW(model->get_submodule("layer1..conv1"), std::invalid_argument);
  EXPECT_THROW(model->get_submodule<Linear>("layer1.0.conv1"), std::invalid_argument);
  EXPECT_EQ(model->get_submodule("layer1.0.conv1").parent(), &model->get_submodule("layer1.0"));
}

TEST(Module, ModuleDictKeepsOrderAndNamesItsChildren) {
  ModuleDict d{{"enc", std::make_shared<Linear>(4, 8)}, {"act", std::make_shared<ReLU>()}};
  d.insert("dec", std::make_shared<Linear>(8, 2));
  EXPECT_EQ(d.size(), 3u);
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"enc", "act", "dec"}));
  EXPECT_TRUE(d.contains("dec"));
  EXPECT_FALSE(d.contains("x"));
  EXPECT_EQ(d.get<Linear>("dec")->out_features, 2);
  EXPECT_EQ(names_of(d.named_parameters()),
            (std::vector<std::string>{"enc.weight", "enc.bias", "dec.weight", "dec.bias"}));
  try {
    d["nope"];
    FAIL() << "no throw";
  } catch (const std::out_of_range& e) {
    EXPECT_TRUE(contains(e.what(), "'nope'")) << e.what();
    EXPECT_TRUE(contains(e.what(), "enc, act, dec")) << e.what();
  }
  EXPECT_THROW(d.get<ReLU>("enc"), std::invalid_argument);
  EXPECT_THROW(d.insert("a.b", std::make_shared<ReLU>()), std::invalid_argument);
}

TEST(Module, SequentialThroughMakeShared) {
  auto seq = std::make_shared<Sequential>(std::make_shared<Linear>(3, 4), std::make_shared<ReLU>(),
                                          std::make_shared<Linear>(4, 2));
  EXPECT_EQ(seq->size(), 3u);
  EXPECT_EQ((*seq)(ones({5, 3})).shape(), (Shape{5, 2}));
  auto seq2 = std::make_shared<Sequential>(
      std::vector<std::shared_ptr<Module>>{std::make_shared<ReLU>(), std::make_shared<ReLU>()});
  EXPECT_EQ(seq2->size(), 2u);
}

namespace {
// A model whose forward calls its blocks' layers directly: past the ModuleList (no forward of
// its own), past each block (its fc called without the block's forward), and from a dict.
struct DirectCalls : Module {
  DirectCalls() : Module("DirectCalls") {
    blocks = register_module("blocks", std::make_shared<ModuleList>());
    for (int i = 0; i < 2; ++i) {
      auto blk = std::make_shared<Sequential>();
      blk->push_back(std::make_shared<Linear>(4, 4));
      blocks->push_back(blk);
    }
    heads = register_module("heads", std::make_shared<ModuleDict>());
    heads->insert("out", std::make_shared<Linear>(4, 2));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*(*blocks)[0])(x);  // blocks.0 (its forward)
    h = (*std::static_pointer_cast<Sequential>((*blocks)[1])->operator[](0))(h);  // blocks.1.0
    return (*(*heads)["out"])(h);                                                 // heads.out
  }
  std::shared_ptr<ModuleList> blocks;
  std::shared_ptr<ModuleDict> heads;
};
}  // namespace

TEST(Module, ChildCalledDirectlyCarriesItsFullPath) {
  auto model = std::make_shared<DirectCalls>();
  auto& alloc = memory::get_allocator(Device::cpu());
  alloc.record_memory_history(true);
  (*model)(ones({2, 4}));
  std::set<std::string> paths;
  for (const auto& e : alloc.history())
    if (e.action == memory::TraceAction::alloc && memory::interned(e.tag.op) == "linear")
      paths.insert(memory::interned(e.tag.module));
  alloc.record_memory_history(false);
  EXPECT_EQ(paths, (std::set<std::string>{"blocks.0.0", "blocks.1.0", "heads.out"}));

  // Under an enclosing path (a wrapper that calls the model as its child), the same paths
  // follow it.
  struct Wrapper : Module {
    Wrapper() : Module("Wrapper") {
      inner = register_module("model", std::make_shared<DirectCalls>());
    }
    Tensor forward(const Tensor& x) override { return (*inner)(x); }
    std::shared_ptr<DirectCalls> inner;
  } wrapper;
  alloc.record_memory_history(true);
  wrapper(ones({2, 4}));
  paths.clear();
  for (const auto& e : alloc.history())
    if (e.action == memory::TraceAction::alloc && memory::interned(e.tag.op) == "linear")
      paths.insert(memory::interned(e.tag.module));
  alloc.record_memory_history(false);
  EXPECT_EQ(paths,
            (std::set<std::string>{"model.blocks.0.0", "model.blocks.1.0", "model.heads.out"}));
}

// register_buffer(name, t, /*persistent=*/false), torch's persistent=False: the buffer is a
// buffer (named_buffers, moved and converted with the module) but not in the state dict, and a
// strict load does not ask for it. Registering it again as persistent puts it back.
TEST(Module, NonPersistentBuffersStayOutOfTheStateDict) {
  struct Custom : Module {
    Custom() : Module("Custom") {
      w = register_parameter("w", ones({2}));
      table = register_buffer("table", ones({3}), /*persistent=*/false);
    }
    Tensor w, table;
  } m;
  EXPECT_EQ(m.named_buffers().size(), 1u);
  const NamedTensors sd = m.state_dict();
  ASSERT_EQ(sd.size(), 1u);
  EXPECT_EQ(sd[0].first, "w");
  m.load_state_dict(sd);  // strict: "table" is not missing
  m.to(DType::float64);
  EXPECT_EQ(m.table.dtype(), DType::float64);
  m.register_buffer("table", m.table);
  EXPECT_EQ(m.state_dict().size(), 2u);
}
