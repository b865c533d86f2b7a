// The two tuple forms PickleWriter writes, for the pickle tests.
#pragma once

#include "memory/pickle.h"

namespace tally::testing {

// Writes () and (0, 0): one tuple of each size the writer supports (EMPTY_TUPLE, TUPLE2).
inline void write_both_tuple_sizes(memory::PickleWriter& w) {
  w.begin_tuple();
  w.end_tuple();
  w.begin_tuple();
  w.integer(0);
  w.integer(0);
  w.end_tuple();
}

}  // namespace tally::testing
