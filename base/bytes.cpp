#include "base/bytes.h"

#include <fmt/format.h>

namespace tally::base {

std::string format_bytes(double bytes, int decimals) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{:.0f} B", bytes);
  return fmt::format("{:.{}f} {}", bytes, decimals, kUnits[u]);
}

}  // namespace tally::base
