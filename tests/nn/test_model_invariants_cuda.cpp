// Design rule 2 on real models, on CUDA: the checks of test_model_invariants.cpp (a training
// step of resnet_tiny and GPT "tiny" reconciled to the byte after forward, after backward,
// after the step and at the peak; no `unknown`; module paths in forward; autocast and
// checkpointing) on the GPU's allocator, plus the `workspace` category: cuDNN's and
// cuBLASLt's workspaces are taken from the allocator in forward and backward under the op
// that used them, and every one is returned by the end of the op. Skips without a device.
#include <gtest/gtest.h>

#include "model_invariants.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using namespace invariants;

const Device kGpu = Device::cuda(0);

// The workspace part of a step's history: taken (> 0), returned, and under a library op.
void expect_workspaces(const StepReport& r, const std::vector<std::string>& op_prefixes) {
  EXPECT_GT(r.history.workspace_allocs, 0)
      << "cuBLASLt / cuDNN took no workspace from the allocator";
  EXPECT_EQ(r.history.workspace_frees, r.history.workspace_allocs);
  bool found = false;
  std::string ops;
  for (const std::string& op : r.history.workspace_ops) {
    ops += op + " ";
    for (const std::string& want : op_prefixes) found = found || op.rfind(want, 0) == 0;
  }
  EXPECT_TRUE(found) << "workspace ops: " << ops;
}

TEST(ModelInvariantsCuda, ResnetTinySgdMomentum) {
  REQUIRE_GPU();
  const Case c = resnet_case(kGpu);
  auto opt = make_sgd(*c.model);
  const auto reports = two_steps(c, *opt, {}, kGpu);
  for (const StepReport& r : reports) expect_workspaces(r, {"conv2d", "linear"});
  EXPECT_GT(memory::get_allocator(kGpu).stats().cat_bytes(Category::workspace).peak, 0);
}

TEST(ModelInvariantsCuda, ResnetTinyAdamW) {
  REQUIRE_GPU();
  const Case c = resnet_case(kGpu);
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, {}, kGpu);
}

TEST(ModelInvariantsCuda, GptTinySgdMomentum) {
  REQUIRE_GPU();
  const Case c = gpt_case(kGpu);
  auto opt = make_sgd(*c.model);
  two_steps(c, *opt, {}, kGpu);
}

TEST(ModelInvariantsCuda, GptTinyAdamW) {
  REQUIRE_GPU();
  const Case c = gpt_case(kGpu);
  auto opt = make_adamw(*c.model);
  const auto reports = two_steps(c, *opt, {}, kGpu);
  for (const StepReport& r : reports) expect_workspaces(r, {"linear", "matmul", "mm", "bmm"});
}

TEST(ModelInvariantsCuda, GptTinyDropoutAdamW) {
  REQUIRE_GPU();
  const Case c = gpt_case(kGpu, 0.1);
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, {}, kGpu);
}

// CUDA's autocast dtype is float16 (PyTorch's default there); bf16 too.
TEST(ModelInvariantsCuda, ResnetTinyAutocastFp16) {
  REQUIRE_GPU();
  const Case c = resnet_case(kGpu);
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, {.autocast = true, .autocast_dtype = DType::float16}, kGpu);
}

TEST(ModelInvariantsCuda, GptTinyAutocastFp16) {
  REQUIRE_GPU();
  const Case c = gpt_case(kGpu);
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, {.autocast = true, .autocast_dtype = DType::float16}, kGpu);
}

TEST(ModelInvariantsCuda, GptTinyAutocastBf16) {
  REQUIRE_GPU();
  const Case c = gpt_case(kGpu);
  auto opt = make_sgd(*c.model);
  two_steps(c, *opt, {.autocast = true, .autocast_dtype = DType::bfloat16}, kGpu);
}

TEST(ModelInvariantsCuda, ResnetTinyCheckpointBlocks) {
  REQUIRE_GPU();
  const Case c = resnet_case(kGpu);
  auto opt = make_sgd(*c.model);
  checkpoint_comparison(c, *opt, "layer", kGpu);
}

TEST(ModelInvariantsCuda, GptTinyCheckpointBlocks) {
  REQUIRE_GPU();
  const Case c = gpt_case(kGpu);
  auto opt = make_adamw(*c.model);
  checkpoint_comparison(c, *opt, "transformer.h.", kGpu);
}

TEST(ModelInvariantsCuda, GptTinyCheckpointBlocksUnderAutocast) {
  REQUIRE_GPU();
  const Case c = gpt_case(kGpu);
  auto opt = make_adamw(*c.model);
  checkpoint_comparison(c, *opt, "transformer.h.", kGpu,
                        {.autocast = true, .autocast_dtype = DType::float16});
}

}  // namespace
}  // namespace tally
