#include "base/check_arg.h"

#include <fmt/format.h>

#include <stdexcept>

namespace tally::base {

void check_at_least(int64_t value, int64_t min, std::string_view what) {
  if (value < min)
    throw std::invalid_argument(fmt::format("{} must be >= {}, got {}", what, min, value));
}

}  // namespace tally::base
