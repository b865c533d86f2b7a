// Per-rank file names for data-parallel runs: every rank of a job writes its own snapshot,
// history and timeline, so the rank goes into the file name ("x.pickle" -> "x.rank1.pickle")
// whenever the process is one of several (torchrun's WORLD_SIZE > 1 with RANK set). The
// snapshot and timeline writers apply it, so every program gets it without a flag.
#pragma once

#include <string>

namespace tally::base {

// `path` with ".rank<R>" before its extension (appended when it has none) when WORLD_SIZE
// > 1; unchanged for a single process or when the name already carries ".rank<R>.".
std::string per_rank_path(const std::string& path);
// The same with an explicit rank and world size (tests).
std::string per_rank_path(const std::string& path, int rank, int world_size);

}  // namespace tally::base
