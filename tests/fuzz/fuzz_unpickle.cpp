// The pickle reader (inspect/unpickle.cpp) and the snapshot reader on top of it
// (inspect/memdiff.cpp): the input is the pickle. What unpickles and is small enough to walk
// must survive Tally's PickleWriter and unpickle again equal (when the writer can express it:
// ASCII strings, no bytes, tuples of 0 or 2 items); what summarises as a snapshot must add up:
// the bytes at the peak by key are the peak, the timeline's largest sample is the peak, and a
// diff against itself has no deltas.
#include <algorithm>
#include <sstream>

#include "fuzz_common.h"
#include "inspect/memdiff.h"
#include "inspect/unpickle.h"
#include "memory/pickle.h"

using namespace tally;
using namespace tally::memory;
using namespace tally::inspect;

namespace {

// Walks v as a tree, at most `budget` nodes; false when it is larger or the writer cannot
// express it.
bool writable(const PickleValue& v, size_t& budget) {
  if (budget == 0) return false;
  --budget;
  switch (v.type()) {
    case PickleValue::Type::bytes:
      return false;
    case PickleValue::Type::string:
      return std::all_of(v.as_string().begin(), v.as_string().end(),
                         [](char c) { return static_cast<unsigned char>(c) < 0x80; });
    case PickleValue::Type::tuple:
      if (v.as_list().size() != 0 && v.as_list().size() != 2) return false;
      [[fallthrough]];
    case PickleValue::Type::list:
      for (const PickleValue& x : v.as_list())
        if (!writable(x, budget)) return false;
      return true;
    case PickleValue::Type::dict:
      for (const auto& [k, x] : v.as_dict().items) {
        if (!std::all_of(k.begin(), k.end(),
                         [](char c) { return static_cast<unsigned char>(c) < 0x80; }))
          return false;
        if (!writable(x, budget)) return false;
      }
      return true;
    default:
      return true;
  }
}

void write(PickleWriter& w, const PickleValue& v) {
  switch (v.type()) {
    case PickleValue::Type::none:
      w.none();
      break;
    case PickleValue::Type::boolean:
      w.boolean(v.as_bool());
      break;
    case PickleValue::Type::integer:
      w.integer(v.as_int());
      break;
    case PickleValue::Type::floating:
      w.floating(v.as_float());
      break;
    case PickleValue::Type::string:
    case PickleValue::Type::bytes:
      w.string(v.as_string());
      break;
    case PickleValue::Type::list:
      w.begin_list();
      for (const PickleValue& x : v.as_list()) write(w, x);
      w.end_list();
      break;
    case PickleValue::Type::tuple:
      w.begin_tuple();
      for (const PickleValue& x : v.as_list()) write(w, x);
      w.end_tuple();
      break;
    case PickleValue::Type::dict:
      w.begin_dict();
      for (const auto& [k, x] : v.as_dict().items) {
        w.key(k);
        write(w, x);
      }
      w.end_dict();
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  PickleValue v;
  if (!fuzz::accepts([&] { v = unpickle(in, "<fuzz>"); })) return 0;
  FUZZ_CHECK(v.height() <= UnpickleLimits{}.max_depth);

  size_t budget = 20000;
  if (writable(v, budget)) {
    std::ostringstream out;
    {
      PickleWriter w(out);
      write(w, v);
      w.finish();
    }
    FUZZ_CHECK(unpickle(out.str()) == v);
  }

  SnapshotSummary s;
  if (!fuzz::accepts([&] { s = summarize_snapshot(v, "<fuzz>"); })) return 0;
  FUZZ_CHECK(s.t.size() == s.allocated.size() && !s.allocated.empty());
  FUZZ_CHECK(*std::max_element(s.allocated.begin(), s.allocated.end()) == s.peak_allocated);
  FUZZ_CHECK(s.allocated.front() == s.start_allocated);
  FUZZ_CHECK(s.peak_reserved >= s.peak_allocated);
  int64_t at_peak = 0, allocations = 0;
  for (const auto& [key, st] : s.keys) {
    FUZZ_CHECK(st.bytes_at_peak >= 0 && st.allocations >= 0);
    at_peak += st.bytes_at_peak;
    allocations += st.allocations;
  }
  FUZZ_CHECK(at_peak == s.peak_allocated);
  FUZZ_CHECK(allocations == s.allocations);
  const SnapshotDiff d = diff_snapshots(s, s);
  for (const DiffSection& sec : d.sections)
    for (const DiffRow& r : sec.rows)
      FUZZ_CHECK(r.bytes_delta() == 0 && r.allocations_delta() == 0);
  FUZZ_CHECK(!format_snapshot_diff(d).empty());
  FUZZ_CHECK(!snapshot_diff_json(d).empty());
  return 0;
}
