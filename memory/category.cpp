#include "memory/category.h"

#include "base/enum_table.h"

namespace tally::memory {

std::string_view category_name(Category c) {
  static constexpr std::string_view kNames[] = {
      "parameter", "gradient",       "optimizer_state", "activation", "input",  "temporary",
      "workspace", "autocast_cache", "communication",   "offloaded",  "unknown"};
  return base::enum_table<Category::unknown>(c, kNames, std::string_view("unknown"));
}

std::string_view category_color(Category c) {
  static constexpr std::string_view kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                                 "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
                                                 "#17becf", "#c7c7c7", "#7f7f7f"};
  return base::enum_table<Category::unknown>(c, kColors, std::string_view("#7f7f7f"));
}

std::optional<Category> parse_category(std::string_view name) {
  for (Category c : kAllCategories) {
    if (category_name(c) == name) return c;
  }
  return std::nullopt;
}

}  // namespace tally::memory
