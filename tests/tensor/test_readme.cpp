// The README's "API in ten lines", compiled and run as written.
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "autograd/ops.h"
#include "memory/memory.h"

using namespace tally;

TEST(Readme, ApiInTenLines) {
  const auto dir = std::filesystem::temp_directory_path();
  std::filesystem::current_path(dir);
  memory::record_memory_history(true, 100000, Device::cpu());
  Tensor w = mul(randn({784, 10}), 0.01).detach().requires_grad_();  // ops outputs: `temporary`
  Tensor x;
  {
    memory::CategoryScope in(memory::Category::input);
    x = randn({64, 784});
  }
  Tensor loss =
      cross_entropy(matmul(x, w), randint(0, 10, {64}));    // saved for backward: `activation`
  loss.backward();                                          // w.grad(): `gradient`
  fmt::print("{}", memory::memory_summary(Device::cpu()));  // PyTorch's table + categories
  memory::dump_snapshot("step.pickle", Device::cpu());      // opens in memory_viz
  EXPECT_TRUE(std::filesystem::exists(dir / "step.pickle"));
  EXPECT_EQ(w.grad().storage().category(), memory::Category::gradient);
  EXPECT_EQ(x.storage().category(), memory::Category::input);
  memory::record_memory_history(false, 0, Device::cpu());
}
