#include "memory/category.h"

namespace tally::memory {

std::string_view category_name(Category c) {
  switch (c) {
    case Category::parameter:
      return "parameter";
    case Category::gradient:
      return "gradient";
    case Category::optimizer_state:
      return "optimizer_state";
    case Category::activation:
      return "activation";
    case Category::input:
      return "input";
    case Category::temporary:
      return "temporary";
    case Category::workspace:
      return "workspace";
    case Category::autocast_cache:
      return "autocast_cache";
    case Category::communication:
      return "communication";
    case Category::unknown:
      return "unknown";
  }
  return "unknown";
}

std::optional<Category> parse_category(std::string_view name) {
  for (Category c : kAllCategories) {
    if (category_name(c) == name) return c;
  }
  return std::nullopt;
}

}  // namespace tally::memory
