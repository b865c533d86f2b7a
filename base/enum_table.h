// enum_table: a value per enumerator of a scoped enum (the name a format writes, a column
// per category), read from a table in the enum's declaration order instead of a switch.
// The caller names the enum's last enumerator, so a table that does not have one entry per
// enumerator fails to compile; a value outside the enum (a corrupt byte) gets `fallback`.
#pragma once

#include <cstddef>
#include <type_traits>

namespace tally::base {

template <auto Last, typename V, size_t N>
constexpr V enum_table(decltype(Last) e, const V (&table)[N], V fallback) {
  using E = decltype(Last);
  static_assert(std::is_enum_v<E>);
  static_assert(N == static_cast<size_t>(Last) + 1, "one table entry per enumerator");
  const auto i = static_cast<size_t>(static_cast<std::underlying_type_t<E>>(e));
  return i < N ? table[i] : fallback;
}

}  // namespace tally::base
