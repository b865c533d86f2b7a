// Design rule 2 on real models, on every device of the binary (test_model_invariants on the
// CPU, test_model_invariants_cuda on cuda:0, skipping without a device): a full training step
// (forward, backward, SGD with momentum or AdamW) of resnet_tiny (batch 4, 3x16x16) and GPT
// "tiny" (B=2, T=16), with the allocator's categories reconciled to the byte after forward,
// after backward, after the step and at the recorded peak, no `unknown` allocation anywhere in
// the step, a module path on every forward allocation, and the same under autocast (bf16, and
// the device's default dtype: bf16 on the CPU, fp16 on CUDA) and with checkpointing. Plus the
// `workspace` category: the CPU convolution's im2col buffers, cuDNN's and cuBLASLt's
// workspaces on CUDA, are taken from the allocator under the op that used them and returned by
// the end of the op (tests/nn/model_invariants.h has the checks; this file the models and the
// comparisons).
#include <gtest/gtest.h>

#include "model_invariants.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace invariants;

class ModelInvariants : public testing::OnDevice {
 protected:
  // The device's autocast dtype, as PyTorch's default: bfloat16 on the CPU, float16 on CUDA.
  StepOptions autocast() const {
    return {.autocast = true, .autocast_dtype = on_cpu() ? DType::bfloat16 : DType::float16};
  }
  StepOptions autocast_bf16() const {
    return {.autocast = true, .autocast_dtype = DType::bfloat16};
  }
};

// The workspace part of a step's history: taken (> 0), returned, and under one of the ops
// named by `op_prefixes` (all of them on the CPU, where only the convolution takes one).
void expect_workspaces(const StepReport& r, const std::vector<std::string>& op_prefixes,
                       bool only_these) {
  EXPECT_GT(r.history.workspace_allocs, 0) << "no workspace taken from the allocator";
  EXPECT_EQ(r.history.workspace_frees, r.history.workspace_allocs);
  bool found = false;
  std::string ops;
  for (const std::string& op : r.history.workspace_ops) {
    ops += op + " ";
    bool known = false;
    for (const std::string& want : op_prefixes) known = known || op.rfind(want, 0) == 0;
    found = found || known;
    if (only_these) {
      EXPECT_TRUE(known) << "a workspace under op '" << op << "'";
    }
  }
  EXPECT_TRUE(found) << "workspace ops: " << ops;
}

TEST_P(ModelInvariants, ResnetTinySgdMomentum) {
  const Case c = resnet_case(dev());
  auto opt = make_sgd(*c.model);
  for (const StepReport& r : two_steps(c, *opt, {}, dev())) {
    if (on_cpu())  // the CPU convolution's im2col buffers
      expect_workspaces(r, {"conv2d"}, /*only_these=*/true);
    else  // cuDNN's and cuBLASLt's
      expect_workspaces(r, {"conv2d", "linear"}, /*only_these=*/false);
  }
  EXPECT_GT(memory::get_allocator(dev()).stats().cat_bytes(Category::workspace).peak, 0);
}

TEST_P(ModelInvariants, ResnetTinyAdamW) {
  const Case c = resnet_case(dev());
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, {}, dev());
}

TEST_P(ModelInvariants, GptTinySgdMomentum) {
  const Case c = gpt_case(dev());
  auto opt = make_sgd(*c.model);
  two_steps(c, *opt, {}, dev());
}

TEST_P(ModelInvariants, GptTinyAdamW) {
  const Case c = gpt_case(dev());
  auto opt = make_adamw(*c.model);
  const auto reports = two_steps(c, *opt, {}, dev());
  if (!on_cpu())  // cuBLASLt's workspace (the CPU's products take none)
    for (const StepReport& r : reports)
      expect_workspaces(r, {"linear", "matmul", "mm", "bmm"}, /*only_these=*/false);
}

// With dropout (embeddings, attention, residuals, MLP): the masks are activations too.
TEST_P(ModelInvariants, GptTinyDropoutAdamW) {
  const Case c = gpt_case(dev(), 0.1);
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, {}, dev());
}

// Autocast: the forward runs in the region; inside it autocast_cache holds exactly one cast of
// each Linear / Conv2d parameter, after it only the casts backward still needs.
TEST_P(ModelInvariants, ResnetTinyAutocast) {
  const Case c = resnet_case(dev());
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, autocast(), dev());
}

TEST_P(ModelInvariants, GptTinyAutocast) {
  const Case c = gpt_case(dev());
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, autocast(), dev());
}

TEST_P(ModelInvariants, GptTinyAutocastBf16) {
  const Case c = gpt_case(dev());
  auto opt = make_sgd(*c.model);
  two_steps(c, *opt, autocast_bf16(), dev());
}

// The GPT checkpoint comparisons use a batch of 4 x 64 tokens: at 2 x 16 the tiny GPT's
// activations are so small that, once GELU's backward became one fused pass (fewer
// temporaries), the CPU step's allocator peak no longer fell in forward/backward, which these
// comparisons are about.
TEST_P(ModelInvariants, GptTinyDropoutCheckpointBlocks) {
  const Case c = gpt_case(dev(), 0.1, 4, 64);
  auto opt = make_adamw(*c.model);
  checkpoint_comparison(c, *opt, "transformer.h.", dev());
}

TEST_P(ModelInvariants, ResnetTinyCheckpointBlocks) {
  const Case c = resnet_case(dev());
  auto opt = make_sgd(*c.model);
  checkpoint_comparison(c, *opt, "layer", dev());
}

TEST_P(ModelInvariants, GptTinyCheckpointBlocks) {
  const Case c = gpt_case(dev(), 0.0, 4, 64);
  auto opt = make_adamw(*c.model);
  checkpoint_comparison(c, *opt, "transformer.h.", dev());
}

// Both at once: the recompute replays the autocast state (its casts are made again, tagged
// autocast_cache, and released with the recomputed tensors).
TEST_P(ModelInvariants, GptTinyCheckpointBlocksUnderAutocast) {
  const Case c = gpt_case(dev(), 0.0, 4, 64);
  auto opt = make_adamw(*c.model);
  checkpoint_comparison(c, *opt, "transformer.h.", dev(), autocast());
}

TEST_P(ModelInvariants, ResnetTinyCheckpointBlocksUnderAutocastBf16) {
  const Case c = resnet_case(dev());
  auto opt = make_sgd(*c.model);
  checkpoint_comparison(c, *opt, "layer", dev(), autocast_bf16());
}

TALLY_ON_DEVICES(ModelInvariants);

}  // namespace
}  // namespace tally
