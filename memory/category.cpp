#include "memory/category.h"

#include "memory/enum_table.h"

namespace tally::memory {

std::string_view category_name(Category c) {
  static constexpr std::string_view kNames[] = {
      "parameter", "gradient",       "optimizer_state", "activation", "input",  "temporary",
      "workspace", "autocast_cache", "communication",   "offloaded",  "unknown"};
  return enum_table<Category::unknown>(c, kNames, std::string_view("unknown"));
}

std::optional<Category> parse_category(std::string_view name) {
  for (Category c : kAllCategories) {
    if (category_name(c) == name) return c;
  }
  return std::nullopt;
}

}  // namespace tally::memory
