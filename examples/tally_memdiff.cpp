// tally_memdiff: what changed in memory between two runs, from their memory snapshots
// (Tally's, or PyTorch's own torch.cuda.memory._dump_snapshot pickles; inspect/memdiff.h).
// Prints the peaks and, per category, phase, module (matched by dotted path), op and frame, the
// bytes live at each run's peak, the allocation counts and the deltas (B - A). --html writes a
// self-contained page with both allocated-memory timelines overlaid and the tables; --json
// every number.
//
//   tally_memdiff ab_report/ckpt_none_amp_off.pickle ab_report/ckpt_blocks_amp_off.pickle
//   tally_memdiff before.pickle after.pickle --html diff.html --json diff.json --top 10
//
// A file that is not a snapshot (truncated, another pickle, not a pickle), or two snapshots of
// different devices, exit 2 with one line naming the file and what is wrong.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "examples/cli_common.h"
#include "inspect/memdiff.h"

using namespace tally;
namespace ex = tally::examples;

int main(int argc, char** argv) {
  std::string a_path, b_path, html, json;
  int64_t top = 20;
  int64_t device = -1;
  CLI::App app{
      "Snapshot diff: A vs B per category, phase, module, op and frame (bytes at each run's "
      "peak, allocations, deltas)."};
  app.add_option("A", a_path, "the baseline snapshot (.pickle)")->required();
  app.add_option("B", b_path, "the snapshot compared with it (.pickle)")->required();
  app.add_option("--html", html, "also write a self-contained HTML page: both timelines, tables");
  app.add_option("--json", json, "also write every number as JSON");
  ex::add_checked_option(app, "--top", top, "rows per table (0: all)", ex::int_range(0));
  bool any_device = false;
  app.add_option("--device", device,
                 "the device ordinal to compare (default: the one device with a trace)")
      ->check(ex::int_range(0, 1 << 16));
  app.add_flag("--any-device", any_device,
               "compare snapshots of different device ordinals (dry runs: each replays on a meta "
               "device of its own)");
  return ex::run_cli("tally_memdiff", app, argc, argv, [&] {
    if (!html.empty()) ex::check_output_file(html, "--html");
    if (!json.empty()) ex::check_output_file(json, "--json");
    const int dev = static_cast<int>(device);
    const inspect::SnapshotSummary a = inspect::read_snapshot_summary(a_path, dev);
    const inspect::SnapshotSummary b = inspect::read_snapshot_summary(b_path, dev);
    const inspect::SnapshotDiff d = inspect::diff_snapshots(a, b, {.any_device = any_device});
    fmt::print("{}", inspect::format_snapshot_diff(d, static_cast<size_t>(top)));
    if (!html.empty()) {
      inspect::write_snapshot_diff_html(html, d, static_cast<size_t>(top));
      fmt::print("\nhtml: {}\n", html);
    }
    if (!json.empty()) {
      inspect::write_snapshot_diff_json(json, d);
      fmt::print("{}json: {}\n", html.empty() ? "\n" : "", json);
    }
    std::fflush(stdout);
    return 0;
  });
}
