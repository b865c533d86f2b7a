// A byte count for people: "512 B", "1.5 KiB", "12.0 MiB" (binary units up to TiB).
#pragma once

#include <string>

namespace tally::base {

// `decimals` digits after the point above 1 KiB; whole bytes below.
std::string format_bytes(double bytes, int decimals = 1);

}  // namespace tally::base
