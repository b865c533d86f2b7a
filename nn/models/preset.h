// A model config's named presets, one lookup for every model: each preset edits the default
// config, and an unknown name throws one message, `<who>: unknown preset '<name>' (<expected>)`.
#pragma once

#include <fmt/format.h>

#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

namespace tally::nn {

template <typename Config>
using PresetEdit = void (*)(Config&);

template <typename Config>
Config preset_of(const char* who, const std::string& name, const char* expected,
                 std::initializer_list<std::pair<const char*, PresetEdit<Config>>> presets) {
  for (const std::pair<const char*, PresetEdit<Config>>& p : presets)
    if (name == p.first) {
      Config c;
      p.second(c);
      return c;
    }
  throw std::invalid_argument(fmt::format("{}: unknown preset '{}' ({})", who, name, expected));
}

}  // namespace tally::nn
