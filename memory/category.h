// Categories of memory: every byte Tally allocates is tagged with one of these, by
// construction, so a training step's memory can be reconciled to the seven consumers.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace tally::memory {

enum class Category : uint8_t {
  parameter,
  gradient,
  optimizer_state,
  activation,
  input,
  temporary,
  workspace,
  autocast_cache,
  communication,
  offloaded,  // host copies of saved activations (autograd/offload.h)
  unknown,
};

inline constexpr int kNumCategories = 11;

inline constexpr std::array<Category, kNumCategories> kAllCategories = {
    Category::parameter,  Category::gradient,       Category::optimizer_state,
    Category::activation, Category::input,          Category::temporary,
    Category::workspace,  Category::autocast_cache, Category::communication,
    Category::offloaded,  Category::unknown};

// Lower-case name as written into snapshots ("optimizer_state").
std::string_view category_name(Category c);
// Inverse of category_name; nullopt for an unknown spelling.
std::optional<Category> parse_category(std::string_view name);
// The category's colour on Tally's HTML pages (the A/B report, the snapshot diff), as CSS
// "#rrggbb": one palette, so a category looks the same everywhere.
std::string_view category_color(Category c);

}  // namespace tally::memory
