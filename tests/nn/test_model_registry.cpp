// The model registry (nn/models/registry.h): every entry's default preset builds, takes its own
// synthetic batch, and trains one step on the CPU with a finite loss and a gradient for every
// trainable parameter; unknown names and presets are refused, naming what exists.
#include <gtest/gtest.h>

#include <cmath>

#include "nn/models/registry.h"

using namespace tally;
using namespace tally::nn;

TEST(ModelRegistry, EveryDefaultPresetTrainsOneStepOnTheCpu) {
  ASSERT_GE(model_registry().size(), 2u);
  for (const ModelEntry& e : model_registry()) {
    SCOPED_TRACE(e.name);
    manual_seed(0);
    const ModelOptions o = resolve_options(e, {});
    std::shared_ptr<Module> m = e.build(o);
    m->train();
    const data::Example b = e.synthetic_batch(o, 2, 0, 7);
    EXPECT_EQ(b.input.size(0), 2);
    EXPECT_EQ(b.target.size(0), 2);
    Tensor loss = e.loss(*m, b);
    ASSERT_EQ(loss.numel(), 1);
    EXPECT_TRUE(std::isfinite(loss.item()));
    loss.backward();
    for (const auto& [name, p] : m->named_parameters())
      if (p.requires_grad()) {
        EXPECT_TRUE(p.grad().defined()) << name;
      }
    // The same step and seed give the same batch.
    const data::Example again = e.synthetic_batch(o, 2, 0, 7);
    const Tensor a = again.input.to(DType::float64), c = b.input.to(DType::float64);
    EXPECT_EQ(a.sum().item(), c.sum().item());
    EXPECT_EQ((a * a).sum().item(), (c * c).sum().item());
  }
}

TEST(ModelRegistry, UnknownNamesAndPresetsNameWhatExists) {
  try {
    (void)model_entry("mycnn");
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'mycnn'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("resnet | gpt"), std::string::npos) << e.what();
  }
  try {
    (void)resolve_options(model_entry("gpt"), {.preset = "huge"});
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'huge'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("tiny, small"), std::string::npos) << e.what();
  }
}
