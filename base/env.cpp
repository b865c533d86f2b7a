#include "base/env.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace tally::base {

bool env_switch(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  if (std::strcmp(v, "0") == 0) return false;
  if (std::strcmp(v, "1") == 0) return true;
  throw std::invalid_argument(
      fmt::format("environment variable {}='{}': expected 0 or 1 (or unset)", name, v));
}

}  // namespace tally::base
