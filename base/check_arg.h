// Argument checks for constructors and functions that refuse bad input before any work, with a
// message that names the caller, the argument and the value.
#pragma once

#include <cstdint>
#include <string_view>

namespace tally::base {

// Throws std::invalid_argument "WHAT must be >= MIN, got VALUE" when value < min; `what` names
// the caller and the argument ("DataLoader: batch_size").
void check_at_least(int64_t value, int64_t min, std::string_view what);

}  // namespace tally::base
