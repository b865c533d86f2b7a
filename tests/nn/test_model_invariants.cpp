// Design rule 2 on real models, on the CPU: a full training step (forward, backward, SGD with
// momentum or AdamW) of resnet_tiny (batch 4, 3x16x16) and GPT "tiny" (B=2, T=16), with the
// allocator's categories reconciled to the byte after forward, after backward, after the
// step and at the recorded peak, no `unknown` allocation anywhere in the step, a module path
// on every forward allocation, and the same under bf16 autocast and with checkpointing
// (tests/nn/model_invariants.h has the checks; this file the models and the comparisons).
#include <gtest/gtest.h>

#include "model_invariants.h"

namespace tally {
namespace {

using namespace invariants;

const Device kDev = Device::cpu();

TEST(ModelInvariants, ResnetTinySgdMomentum) {
  const Case c = resnet_case(kDev);
  auto opt = make_sgd(*c.model);
  for (const StepReport& r : two_steps(c, *opt, {}, kDev)) {
    // The CPU convolution's im2col buffers are `workspace`, taken and returned by the op.
    EXPECT_GT(r.history.workspace_allocs, 0);
    EXPECT_EQ(r.history.workspace_frees, r.history.workspace_allocs);
    for (const std::string& op : r.history.workspace_ops)
      EXPECT_EQ(op.rfind("conv2d", 0), 0u) << "a workspace under op '" << op << "'";
  }
}

TEST(ModelInvariants, ResnetTinyAdamW) {
  const Case c = resnet_case(kDev);
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, {}, kDev);
}

TEST(ModelInvariants, GptTinySgdMomentum) {
  const Case c = gpt_case(kDev);
  auto opt = make_sgd(*c.model);
  two_steps(c, *opt, {}, kDev);
}

TEST(ModelInvariants, GptTinyAdamW) {
  const Case c = gpt_case(kDev);
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, {}, kDev);
}

// With dropout (embeddings, attention, residuals, MLP): the masks are activations too.
TEST(ModelInvariants, GptTinyDropoutAdamW) {
  const Case c = gpt_case(kDev, 0.1);
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, {}, kDev);
}

// The checkpoint comparisons use a batch of 4 x 64 tokens: at 2 x 16 the tiny GPT's activations
// are so small that, once GELU's backward became one fused pass (fewer temporaries), the CPU
// step's allocator peak no longer fell in forward/backward, which these comparisons are about.
TEST(ModelInvariants, GptTinyDropoutCheckpointBlocks) {
  const Case c = gpt_case(kDev, 0.1, 4, 64);
  auto opt = make_adamw(*c.model);
  checkpoint_comparison(c, *opt, "transformer.h.", kDev);
}

// bf16 autocast: the forward runs in the region; inside it autocast_cache holds exactly one
// cast of each Linear / Conv2d parameter, after it only the casts backward still needs.
TEST(ModelInvariants, ResnetTinyAutocastBf16) {
  const Case c = resnet_case(kDev);
  auto opt = make_adamw(*c.model);
  two_steps(c, *opt, {.autocast = true, .autocast_dtype = DType::bfloat16}, kDev);
}

TEST(ModelInvariants, GptTinyAutocastBf16) {
  const Case c = gpt_case(kDev);
  auto opt = make_sgd(*c.model);
  two_steps(c, *opt, {.autocast = true, .autocast_dtype = DType::bfloat16}, kDev);
}

TEST(ModelInvariants, ResnetTinyCheckpointBlocks) {
  const Case c = resnet_case(kDev);
  auto opt = make_sgd(*c.model);
  checkpoint_comparison(c, *opt, "layer", kDev);
}

TEST(ModelInvariants, GptTinyCheckpointBlocks) {
  const Case c = gpt_case(kDev, 0.0, 4, 64);
  auto opt = make_adamw(*c.model);
  checkpoint_comparison(c, *opt, "transformer.h.", kDev);
}

// Both at once: the recompute replays the autocast state (its casts are made again, tagged
// autocast_cache, and released with the recomputed tensors).
TEST(ModelInvariants, GptTinyCheckpointBlocksUnderAutocastBf16) {
  const Case c = gpt_case(kDev, 0.0, 4, 64);
  auto opt = make_adamw(*c.model);
  checkpoint_comparison(c, *opt, "transformer.h.", kDev,
                        {.autocast = true, .autocast_dtype = DType::bfloat16});
}

TEST(ModelInvariants, ResnetTinyCheckpointBlocksUnderAutocastBf16) {
  const Case c = resnet_case(kDev);
  auto opt = make_sgd(*c.model);
  checkpoint_comparison(c, *opt, "layer", kDev,
                        {.autocast = true, .autocast_dtype = DType::bfloat16});
}

}  // namespace
}  // namespace tally
