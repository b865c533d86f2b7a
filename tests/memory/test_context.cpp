// The thread-local allocation context and its RAII scopes.
#include <gtest/gtest.h>

#include <thread>

#include "memory/context.h"

namespace tally::memory {
namespace {

TEST(Context, ScopesNestAndRestore) {
  EXPECT_EQ(current_tag().category, Category::unknown);
  {
    CategoryScope c(Category::parameter);
    ModuleScope m1("layer1");
    {
      ModuleScope m2("0");
      ModuleScope m3("conv1");
      OpScope op("conv2d");
      PhaseScope ph("forward");
      const AllocTag t = current_tag();
      EXPECT_EQ(t.category, Category::parameter);
      EXPECT_EQ(interned(t.module), "layer1.0.conv1");
      EXPECT_EQ(interned(t.op), "conv2d");
      EXPECT_EQ(interned(t.phase), "forward");
    }
    EXPECT_EQ(interned(current_tag().module), "layer1");
    EXPECT_EQ(current_tag().op, 0u);
  }
  EXPECT_EQ(current_tag().category, Category::unknown);
  EXPECT_EQ(current_tag().module, 0u);
}

TEST(Context, IsPerThread) {
  CategoryScope c(Category::gradient);
  Category seen = Category::gradient;
  std::thread([&] { seen = current_tag().category; }).join();
  EXPECT_EQ(seen, Category::unknown);
}

TEST(Context, InternIsStable) {
  const StrId a = intern("hello");
  EXPECT_EQ(intern("hello"), a);
  EXPECT_NE(intern("world"), a);
  EXPECT_EQ(intern(""), 0u);
  EXPECT_EQ(interned(a), "hello");
}

TEST(Category, NamesRoundTrip) {
  for (Category c : kAllCategories) EXPECT_EQ(parse_category(category_name(c)), c);
  EXPECT_FALSE(parse_category("weights").has_value());
  EXPECT_EQ(category_name(Category::optimizer_state), "optimizer_state");
}

}  // namespace
}  // namespace tally::memory
