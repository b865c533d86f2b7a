// Chrome trace event JSON for a recorded window (opened by Perfetto and chrome://tracing):
// CPU spans ("X": ops cat cpu_op, record_function and ProfilerStep cat user_annotation,
// module scopes cat module, phases cat phase), GPU kernels / memcpys / memsets on a track
// per device (pid) and stream (tid), CUDA runtime calls, launch->kernel flows ("s"/"f",
// cat ac2g, id = correlation), PyTorch's "[memory]" instant events ("i") with Tally's
// Category/Module/Op, and one counter track ("C") per device and memory category.
#pragma once

#include <ostream>
#include <string>

#include "profiler/events.h"

namespace tally::profiler {

void write_chrome_trace(const ProfileData& data, std::ostream& out);
// Writes `path`; throws std::runtime_error naming it on I/O failure.
void write_chrome_trace_file(const ProfileData& data, const std::string& path);

// JSON string literal (quotes included) for `s`: base::json_quote.
std::string json_string(const std::string& s);

}  // namespace tally::profiler
