// Switches read from the environment (TALLY_CUDNN_SDP, TALLY_GQA_REPEAT, ...).
#pragma once

namespace tally::base {

// A 0/1 switch from the environment: `fallback` when unset or empty; throws
// std::invalid_argument naming the variable and its value otherwise.
bool env_switch(const char* name, bool fallback);

}  // namespace tally::base
