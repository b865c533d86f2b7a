// The meta device and the dry run (memory/meta.h, memory/estimate.h): a meta run replaying
// the CPU goes through the same allocations as a real CPU run, in the same order, with the
// same tags, and reaches the same peaks; a dry run of a CUDA target runs on a machine without
// a GPU; bad input is an error before anything runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <span>
#include <tuple>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "memory/estimate.h"
#include "memory/memory.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/models/gpt.h"
#include "nn/models/llama.h"
#include "nn/models/resnet.h"
#include "nn/norm.h"
#include "optim/adam.h"
#include "optim/grad_scaler.h"
#include "optim/sgd.h"
#include "tensor/conv/ops.h"
#include "tensor/conv/workspaces_h100.inc"
#include "tensor/conv/workspaces_h200.inc"
#include "tensor/norm/kernels.h"

namespace tally {
namespace {

using memory::Category;
using memory::TraceAction;

// One allocator event with everything but the address.
using Event = std::tuple<TraceAction, size_t, Category, std::string, std::string, std::string>;

std::vector<Event> events_of(Device d) {
  std::vector<Event> out;
  for (const memory::TraceEntry& e : memory::get_allocator(d).history())
    if (e.action == TraceAction::alloc || e.action == TraceAction::free_requested ||
        e.action == TraceAction::retag)
      out.emplace_back(e.action, e.size, e.tag.category, memory::interned(e.tag.module),
                       memory::interned(e.tag.op), memory::interned(e.tag.phase));
  return out;
}

// A convolution, a GroupNorm (the U-Net's normalization: NativeGroupNormBackward0 and, on a
// CUDA target, its per-(sample, channel) partial sums) and a classifier over the pooled
// channels.
struct GroupNormNet : nn::Module {
  std::shared_ptr<nn::Conv2d> conv;
  std::shared_ptr<nn::GroupNorm> norm;
  std::shared_ptr<nn::Linear> fc;
  GroupNormNet() : Module("GroupNormNet") {
    conv = register_module("conv", std::make_shared<nn::Conv2d>(3, 8, 3, 1, 1, true));
    norm = register_module("norm", std::make_shared<nn::GroupNorm>(4, 8));
    fc = register_module("fc", std::make_shared<nn::Linear>(8, 10));
  }
  Tensor forward(const Tensor& x) override {
    return (*fc)(mean(silu((*norm)((*conv)(x))), {2, 3}));
  }
};

struct Config {
  std::string model;  // "resnet", "gpt", "llama" or "groupnorm"
  std::string checkpoint = "none";
  bool amp = false;  // bf16 autocast (+ a GradScaler, to run its meta path)
  bool sgd = false;
};

// Builds the model on `d` and trains two steps, as the training programs do.
void train_two_steps(Device d, const Config& c) {
  manual_seed(0);
  std::shared_ptr<nn::Module> model;
  std::shared_ptr<nn::CausalLM> gpt;  // GPT or LLaMA
  Tensor x, y;
  {
    nn::BuildOnDevice on(d);
    if (c.model == "resnet") {
      model = nn::resnet_tiny({.num_classes = 10});
    } else if (c.model == "groupnorm") {
      model = std::make_shared<GroupNormNet>();
    } else if (c.model == "llama") {  // rotary, SwiGLU and the fused RMSNorm adds
      gpt = std::make_shared<nn::LlamaForCausalLM>(nn::LlamaConfig::preset("tiny"));
      model = gpt;
    } else {
      gpt = std::make_shared<nn::GPT>(nn::GPTConfig::preset("tiny"));
      model = gpt;
    }
  }
  nn::enable_checkpointing(*model, nn::parse_checkpoint_spec(c.checkpoint));
  {
    memory::CategoryScope input(Category::input);
    if (gpt) {
      x = ops::randint(0, 256, {2, 64}, DType::int64, d);
      y = ops::randint(0, 256, {2, 64}, DType::int64, d);
    } else {
      x = ops::randn({4, 3, c.model == "groupnorm" ? 8 : 32, c.model == "groupnorm" ? 8 : 32},
                     DType::float32, d);
      y = ops::randint(0, 10, {4}, DType::int64, d);
    }
  }
  std::unique_ptr<optim::Optimizer> opt;
  if (c.sgd)
    opt = std::make_unique<optim::SGD>(model->parameters(),
                                       optim::SGDOptions{.lr = 0.01, .momentum = 0.9});
  else
    opt = std::make_unique<optim::AdamW>(model->parameters(), optim::AdamOptions{.lr = 1e-3});
  optim::GradScaler scaler(optim::GradScalerOptions{.enabled = c.amp});
  for (int step = 0; step < 2; ++step) {
    opt->zero_grad(true);
    Tensor loss;
    {
      memory::PhaseScope phase("forward");
      AutocastGuard autocast(d.type, DType::bfloat16, c.amp);
      loss = gpt ? (*gpt)(x, y).second : cross_entropy((*model)(x), y);
    }
    {
      memory::PhaseScope phase("backward");
      scaler.scale(loss).backward();
    }
    scaler.step(*opt);
    scaler.update();
  }
}

struct RunRecord {
  std::vector<Event> events;
  int64_t peak_allocated, peak_reserved;
  std::array<int64_t, memory::kNumCategories> at_peak;
};

RunRecord real_cpu_run(const Config& c) {
  const Device cpu = Device::cpu();
  memory::empty_cache(cpu);
  if (memory::memory_allocated(cpu) != 0 || memory::memory_reserved(cpu) != 0)
    ADD_FAILURE() << "the CPU allocator is not empty before the run: "
                  << memory::memory_allocated(cpu) << " B allocated";
  memory::reset_peak_memory_stats(cpu);
  memory::record_memory_history(true, 1000000, cpu);
  train_two_steps(cpu, c);
  RunRecord r{events_of(cpu), static_cast<int64_t>(memory::max_memory_allocated(cpu)),
              static_cast<int64_t>(memory::max_memory_reserved(cpu)),
              memory::get_allocator(cpu).stats().category_at_peak};
  memory::record_memory_history(false, 0, cpu);
  memory::empty_cache(cpu);
  return r;
}

class MetaReplaysCpu : public ::testing::TestWithParam<Config> {};

TEST_P(MetaReplaysCpu, SameAllocationsTagsAndPeaks) {
  const Config c = GetParam();
  const RunRecord real = real_cpu_run(c);
  const memory::Estimate e =
      memory::estimate([&](Device d) { train_two_steps(d, c); }, {.target = "cpu"});
  ASSERT_TRUE(e.fits()) << e.out_of_memory;
  const std::vector<Event> dry = events_of(e.device);
  ASSERT_GT(real.events.size(), 100u);
  ASSERT_EQ(dry.size(), real.events.size());
  auto str = [](const Event& e) {
    const auto& [a, sz, c, m, o, p] = e;
    return std::string(memory::trace_action_name(a)) + " " + std::to_string(sz) + " B " +
           std::string(memory::category_name(c)) + " module '" + m + "' op '" + o + "' phase '" +
           p + "'";
  };
  for (size_t i = 0; i < dry.size(); ++i) {
    if (dry[i] == real.events[i]) continue;
    std::string context;
    for (size_t k = i >= 6 ? i - 6 : 0; k < std::min(dry.size(), i + 4); ++k)
      context += "\n  " + std::to_string(k) + (k == i ? " > " : "   ") + "real " +
                 str(real.events[k]) + "\n  " + std::string(std::to_string(k).size() + 3, ' ') +
                 "meta " + str(dry[k]);
    FAIL() << "event " << i << " differs:" << context;
  }
  EXPECT_EQ(e.peak_allocated, real.peak_allocated);
  EXPECT_EQ(e.peak_reserved, real.peak_reserved);
  EXPECT_EQ(e.at_peak, real.at_peak);
  EXPECT_GT(e.at_peak[static_cast<size_t>(Category::parameter)], 0);
  EXPECT_GT(e.at_peak[static_cast<size_t>(Category::optimizer_state)] +
                e.at_peak[static_cast<size_t>(Category::activation)],
            0);
}

INSTANTIATE_TEST_SUITE_P(
    Models, MetaReplaysCpu,
    ::testing::Values(Config{.model = "resnet"}, Config{.model = "resnet", .sgd = true},
                      Config{.model = "resnet", .checkpoint = "blocks"}, Config{.model = "gpt"},
                      Config{.model = "gpt", .checkpoint = "blocks"},
                      Config{.model = "gpt", .amp = true},
                      Config{.model = "gpt", .checkpoint = "selective", .amp = true},
                      Config{.model = "llama"}, Config{.model = "llama", .amp = true},
                      Config{.model = "groupnorm"}, Config{.model = "groupnorm", .amp = true}),
    [](const auto& info) {
      const Config& c = info.param;
      return c.model + "_" + c.checkpoint + (c.amp ? "_bf16" : "") + (c.sgd ? "_sgd" : "");
    });

TEST(Estimate, ReportNamesPeaksCategoriesAndModules) {
  const memory::Estimate e = memory::estimate(
      [&](Device d) { train_two_steps(d, Config{.model = "gpt"}); }, {.target = "cpu"});
  EXPECT_GT(e.peak_reserved, 0);
  EXPECT_GE(e.peak_reserved, e.peak_allocated);
  ASSERT_FALSE(e.activations_at_peak.empty());
  for (size_t i = 1; i < e.activations_at_peak.size(); ++i)
    EXPECT_GE(e.activations_at_peak[i - 1].bytes, e.activations_at_peak[i].bytes);
  const std::string r = e.report();
  EXPECT_NE(r.find("peak allocated"), std::string::npos) << r;
  EXPECT_NE(r.find("parameter"), std::string::npos) << r;
  EXPECT_NE(r.find("largest activations"), std::string::npos) << r;
  // The dry run's allocator answers like a real one.
  EXPECT_EQ(static_cast<int64_t>(memory::max_memory_allocated(e.device)), e.peak_allocated);
  EXPECT_NE(memory::memory_summary(e.device).find("meta"), std::string::npos);
}

TEST(Estimate, CudaTargetRunsWithoutAGpuAndCountsLibraryWorkspaces) {
  // The H200's dry run of a tiny GPT, bf16: the CUDA path (flash attention, cuBLASLt) on any
  // machine. Each product takes cuBLASLt's 32 MiB workspace, so the workspace category
  // reaches it; the CPU replay of the same run takes none.
  const Config c{.model = "gpt", .amp = true};
  const memory::Estimate h200 =
      memory::estimate([&](Device d) { train_two_steps(d, c); }, {.target = "h200"});
  const memory::Estimate cpu =
      memory::estimate([&](Device d) { train_two_steps(d, c); }, {.target = "cpu"});
  ASSERT_TRUE(h200.fits()) << h200.out_of_memory;
  EXPECT_EQ(h200.target.name, "h200");
  const memory::DeviceStats h200_stats = memory::get_allocator(h200.device).stats();
  const memory::DeviceStats cpu_stats = memory::get_allocator(cpu.device).stats();
  EXPECT_GE(h200_stats.cat_bytes(Category::workspace).peak, int64_t{32} << 20);
  EXPECT_EQ(cpu_stats.cat_bytes(Category::workspace).peak, 0);
  // Flash attention saves log-sum-exps instead of the [T, T] probabilities of the CPU path.
  EXPECT_LT(h200.at_peak[static_cast<size_t>(Category::activation)],
            cpu.at_peak[static_cast<size_t>(Category::activation)]);
}

TEST(Estimate, GroupNormBackwardPartialsOnACudaTargetOnly) {
  // The CUDA group_norm_backward sums dweight/dbias through [N][C][2] float partials (scratch,
  // tagged workspace under the op): 4 * 8 * 2 floats a step; the CPU kernel allocates none.
  const Config c{.model = "groupnorm"};
  for (const char* target : {"h200", "cpu"}) {
    SCOPED_TRACE(target);
    const memory::Estimate e =
        memory::estimate([&](Device d) { train_two_steps(d, c); }, {.target = target});
    ASSERT_TRUE(e.fits()) << e.out_of_memory;
    int partials = 0;
    for (const Event& ev : events_of(e.device))
      if (std::get<0>(ev) == TraceAction::alloc && std::get<4>(ev) == "group_norm_backward" &&
          std::get<2>(ev) == Category::workspace) {
        ++partials;
        EXPECT_EQ(std::get<1>(ev), 4u * 8 * 2 * sizeof(float));
      }
    EXPECT_EQ(partials, std::string(target) == "h200" ? 2 : 0);  // one a step
  }
}

// A forward row of a GPU's table (ResNet-50's stem at batch 32, float32): the dry run for that
// target asks for exactly the workspace cuDNN's plan took on the GPU.
void expect_forward_row_replayed(std::span<const ConvWorkspace> table, const char* target) {
  SCOPED_TRACE(target);
  const auto row = std::find_if(table.begin(), table.end(),
                                [](const ConvWorkspace& r) { return r.kind == 0 && r.bytes > 0; });
  ASSERT_NE(row, table.end());
  const Device d = memory::new_meta_device(memory::meta_target(target));
  const DType dt = static_cast<DType>(row->dtype);
  const Tensor x = ops::empty({row->x[0], row->x[1], row->x[2], row->x[3]}, dt, d);
  const Tensor w = ops::empty({row->w[0], row->w[1], row->w[2], row->w[3]}, dt, d);
  memory::reset_peak_memory_stats(d);
  const Tensor y =
      ops::conv2d(x, w, {}, {row->stride[0], row->stride[1]}, {row->pad[0], row->pad[1]},
                  {row->dilation[0], row->dilation[1]}, row->groups);
  EXPECT_EQ(y.sizes(), (Shape{row->y[0], row->y[1], row->y[2], row->y[3]}));
  const memory::DeviceStats st = memory::get_allocator(d).stats();
  EXPECT_EQ(st.cat_bytes(Category::workspace).peak,
            static_cast<int64_t>(memory::get_allocator(d).round_size(row->bytes)));
  EXPECT_TRUE(memory::unreplayed(d).empty());
  // A batch the table has no row for: no workspace, and a note saying so.
  const Tensor x2 = ops::empty({row->x[0] + 1, row->x[1], row->x[2], row->x[3]}, dt, d);
  ops::conv2d(x2, w, {}, {row->stride[0], row->stride[1]}, {row->pad[0], row->pad[1]},
              {row->dilation[0], row->dilation[1]}, row->groups);
  const auto notes = memory::unreplayed(d);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].first.find("cuDNN convolution workspace"), std::string::npos);
}

TEST(Estimate, CudaConvolutionWorkspacesComeFromTheTargetsRecordedTable) {
  expect_forward_row_replayed(meta::kConvWorkspacesH200, "h200");
  expect_forward_row_replayed(meta::kConvWorkspacesH100, "h100");
  // The two cards' cuDNN plans differ: the H100's table is its own, not the H200's again.
  size_t differing = 0;
  ASSERT_EQ(meta::kConvWorkspacesH100.size(), meta::kConvWorkspacesH200.size());
  for (size_t i = 0; i < meta::kConvWorkspacesH100.size(); ++i)
    differing += meta::kConvWorkspacesH100[i].bytes != meta::kConvWorkspacesH200[i].bytes;
  EXPECT_GT(differing, 0u);
  EXPECT_EQ(memory::meta_target("h100").capacity, size_t{81079} << 20);
}

TEST(Estimate, ChannelsLastConvolutionsTakeTheirOwnRowsOrTheNchwCallsNoted) {
  // A channels_last call is a different cuDNN plan (tensor/conv/cuda_conv.cpp keys it apart):
  // its own row when the table has one, else the NCHW call's bytes and a note saying so.
  const auto& table = meta::kConvWorkspacesH200;
  const auto row = std::find_if(table.begin(), table.end(), [](const ConvWorkspace& r) {
    return r.kind == 0 && r.bytes > 0 && r.nhwc == 0;
  });
  ASSERT_NE(row, table.end());
  ConvWorkspace cl_call = *row;
  cl_call.nhwc = 1;
  EXPECT_FALSE(cl_call.same_call(*row)) << "the layout is part of the call";
  const auto cl_row = std::find_if(table.begin(), table.end(),
                                   [&](const ConvWorkspace& r) { return r.same_call(cl_call); });
  const Device d = memory::new_meta_device(memory::meta_target("h200"));
  const DType dt = static_cast<DType>(row->dtype);
  const MemoryFormat cl = MemoryFormat::channels_last;
  const Tensor x =
      ops::contiguous(ops::empty({row->x[0], row->x[1], row->x[2], row->x[3]}, dt, d), cl);
  const Tensor w =
      ops::contiguous(ops::empty({row->w[0], row->w[1], row->w[2], row->w[3]}, dt, d), cl);
  memory::reset_peak_memory_stats(d);
  const Tensor y =
      ops::conv2d(x, w, {}, {row->stride[0], row->stride[1]}, {row->pad[0], row->pad[1]},
                  {row->dilation[0], row->dilation[1]}, row->groups);
  EXPECT_TRUE(y.is_contiguous(cl)) << "the meta device runs the CUDA kernels' layout";
  const int64_t bytes = cl_row != table.end() ? cl_row->bytes : row->bytes;
  EXPECT_EQ(memory::get_allocator(d).stats().cat_bytes(Category::workspace).peak,
            static_cast<int64_t>(memory::get_allocator(d).round_size(bytes)));
  const auto notes = memory::unreplayed(d);
  if (cl_row != table.end()) {
    EXPECT_TRUE(notes.empty());
  } else {
    ASSERT_EQ(notes.size(), 1u);
    EXPECT_NE(notes[0].first.find("channels_last call"), std::string::npos) << notes[0].first;
    EXPECT_NE(notes[0].first.find("NCHW call's"), std::string::npos) << notes[0].first;
  }
}

TEST(Estimate, TooSmallACapacityIsReportedNotThrown) {
  const memory::Estimate e =
      memory::estimate([&](Device d) { train_two_steps(d, Config{.model = "resnet"}); },
                       {.target = "h200", .capacity = 4 << 20});
  EXPECT_FALSE(e.fits());
  EXPECT_NE(e.out_of_memory.find("out of memory"), std::string::npos) << e.out_of_memory;
  EXPECT_NE(e.report().find("DOES NOT FIT"), std::string::npos);
}

TEST(Estimate, BadInputIsAnErrorBeforeAnythingRuns) {
  bool ran = false;
  EXPECT_THROW(memory::estimate([&](Device) { ran = true; }, {.target = "tpu-v9"}),
               std::invalid_argument);
  EXPECT_FALSE(ran);
  try {
    memory::meta_target("a100");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("h200"), std::string::npos) << e.what();
  }
  EXPECT_THROW(memory::new_meta_device(memory::MetaTarget{
                   .name = "empty", .description = "", .type = DeviceType::cpu, .capacity = 0}),
               std::invalid_argument);
  EXPECT_THROW(memory::meta_target_of(Device::cpu()), std::invalid_argument);
  EXPECT_THROW(memory::get_allocator(Device::meta(100000)), std::invalid_argument);
}

TEST(MetaDevice, TensorsHaveShapesAndTagsButNoData) {
  const Device m = Device::meta();
  EXPECT_EQ(m.str(), "meta:0");
  const size_t before = memory::memory_allocated(m);
  Tensor a = ops::randn({64, 128}, DType::float32, m);
  Tensor b = matmul(a, ops::transpose(a, 0, 1));
  EXPECT_EQ(b.sizes(), (Shape{64, 64}));
  EXPECT_EQ(b.device(), m);
  EXPECT_GE(memory::memory_allocated(m), before + 64 * 128 * 4 + 64 * 64 * 4);
  // Reading values is an error naming the meta tensor, not a crash.
  try {
    (void)b.sum().item();
    FAIL() << "item() on a meta tensor";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("meta"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ops::to(b, Device::cpu(), b.dtype()), std::invalid_argument);
  // The host -> meta direction is fine: shapes only.
  Tensor c = ops::to(ops::ones({3}), m, DType::float32);
  EXPECT_EQ(c.device(), m);
  EXPECT_NE(c.str().find("meta"), std::string::npos);
}

TEST(MetaDevice, AnOpWithoutAMetaKernelNamesItself) {
  // A family registered without a meta table (what a new family that forgot its meta.cpp
  // gets) raises an error naming the op; it never counts zero.
  const Backends<NormKernels> no_meta{&cpu::norm_kernels, nullptr, nullptr};
  static const OpInfo info("layer_norm");
  try {
    no_meta.get(info, Device::meta(), &NormKernels::layer_norm);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("layer_norm: no kernel for device meta:0"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("dry run"), std::string::npos) << e.what();
  }
}

TEST(ParseBytes, UnitsAndErrors) {
  EXPECT_EQ(memory::parse_bytes("6GiB"), size_t{6} << 30);
  EXPECT_EQ(memory::parse_bytes("900MiB"), size_t{900} << 20);
  EXPECT_EQ(memory::parse_bytes("512KiB"), size_t{512} << 10);
  EXPECT_EQ(memory::parse_bytes("1.5GB"), size_t{1500000000});
  EXPECT_EQ(memory::parse_bytes("4096"), size_t{4096});
  for (const char* bad : {"", "-1GiB", "six", "6 parsecs", "nan", "1e30", "inf"})
    EXPECT_THROW(memory::parse_bytes(bad, "--memory-budget"), std::invalid_argument) << bad;
  // Whole numbers count exactly past 2^53 (a double would round them), up to 2^63 - 1.
  EXPECT_EQ(memory::parse_bytes("9007199254740993"), size_t{9007199254740993});
  EXPECT_EQ(memory::parse_bytes("9223372036854775807"), size_t{9223372036854775807});
  EXPECT_EQ(memory::parse_bytes("8589934591GiB"), size_t{8589934591} << 30);
  EXPECT_EQ(memory::parse_bytes("0GiB"), size_t{0});
  for (const char* bad :
       {"9223372036854775808", "8589934592GiB", "99999999999999999999999", "9.3e18", "8388608TiB"})
    EXPECT_THROW(memory::parse_bytes(bad), std::invalid_argument) << bad;
  try {
    memory::parse_bytes("-3GiB", "--memory-budget");
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--memory-budget"), std::string::npos);
  }
}

}  // namespace
}  // namespace tally
