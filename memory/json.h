// JSON text helpers for the files Tally writes (profiler traces, safetensors headers). In
// memory/, the lowest layer, so that every layer that writes JSON shares them.
#pragma once

#include <string>
#include <string_view>

namespace tally::memory {

// `s` as a JSON string literal, quotes included: `"`, `\` and control characters escaped
// (\n, \r, \t by name, others as \u00XX); other bytes, UTF-8 included, pass unchanged.
std::string json_quote(std::string_view s);

}  // namespace tally::memory
