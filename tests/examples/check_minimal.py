"""examples/minimal end to end: the loss falls, the category table names the categories a
training step uses (the input batch as `input`, none `unknown`), and the snapshot is read back
by Python's pickle and by the project's reader (tally_memdiff, inspect/unpickle).

    check_minimal.py MINIMAL TALLY_MEMDIFF
"""
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile

from example_checks import check, fails, run_program

minimal, memdiff = sys.argv[1], sys.argv[2]
tmp = tempfile.mkdtemp(prefix="tally_minimal_")
snap_path = os.path.join(tmp, "minimal.pickle")
out = run_program([minimal, "--snapshot", snap_path], "minimal", 300).stdout

# The loss falls over the 30 steps.
losses = {int(s): float(v) for s, v in re.findall(r"^step\s+(\d+)\s+loss ([0-9.]+)$", out, re.M)}
check(sorted(losses) == [1, 10, 20, 30], f"loss lines at steps {sorted(losses)}, expected 1, 10, 20, 30")
if 1 in losses and 30 in losses:
    check(losses[30] < 0.5 * losses[1], f"loss {losses[1]} -> {losses[30]}: expected it to halve")
check(f"snapshot written to {snap_path}" in out, "no 'snapshot written to' line")

# The category table: KiB now, at the peak, at the allocated peak.
rows = {m[0]: [float(x) for x in m[1:]]
        for m in re.findall(r"^(\w+)\s+([0-9.]+) KiB\s+([0-9.]+) KiB\s+([0-9.]+) KiB$", out, re.M)}
for cat in ("parameter", "gradient", "optimizer_state", "activation", "input"):
    check(cat in rows and rows[cat][1] > 0, f"no category row {cat} with a peak: {rows}")
check("unknown" not in rows, f"untagged memory in the table: {rows.get('unknown')}")
# Parameters: 64x256 + 256 + 256x10 + 10 floats, each tensor rounded up to 512 bytes.
params = sum((n * 4 + 511) // 512 * 512 for n in (64 * 256, 256, 256 * 10, 10)) / 1024
check(rows.get("parameter", [0])[0] == params, f"parameter now {rows.get('parameter')}, expected {params} KiB")
check(rows.get("input", [0])[0] >= 128, f"input now {rows.get('input')}: expected the 512x64 batch (128 KiB)")
check(rows.get("optimizer_state", [0])[0] == 2 * params,
      f"optimizer_state {rows.get('optimizer_state')}: expected AdamW's two moments ({2 * params} KiB)")
peak = re.search(r"^peak allocated ([0-9.]+) KiB, peak reserved ([0-9.]+) KiB$", out, re.M)
check(peak is not None, "no peak line")

# Python's pickle reads the snapshot: every allocation in the trace has a category, none unknown.
snap = pickle.load(open(snap_path, "rb"))
check(snap.get("segments"), "the snapshot has no segments")
trace = [e for t in snap.get("device_traces", []) for e in t]
cats = {e.get("category") for e in trace if e.get("action") == "alloc"}
for cat in ("parameter", "gradient", "optimizer_state", "activation", "input"):
    check(cat in cats, f"no `alloc` of category {cat} in the trace ({sorted(map(str, cats))})")
check("unknown" not in cats, "an `alloc` of category unknown in the trace")

# The project's reader (inspect/unpickle via tally_memdiff): the snapshot against itself.
json_path = os.path.join(tmp, "diff.json")
p = subprocess.run([memdiff, snap_path, snap_path, "--json", json_path], capture_output=True,
                   text=True, timeout=120)
check(p.returncode == 0, f"tally_memdiff exited {p.returncode}: {p.stderr}")
if p.returncode == 0:
    d = json.load(open(json_path))
    check(d["a"]["peak_allocated"] == d["b"]["peak_allocated"] > 0,
          f"tally_memdiff read peaks {d['a'].get('peak_allocated')} / {d['b'].get('peak_allocated')}")
    if peak:
        # The trace's peak (replayed from the history) is within 1% of the allocator's.
        check(abs(d["a"]["peak_allocated"] / 1024 / float(peak.group(1)) - 1) < 0.01,
              f"tally_memdiff's peak {d['a']['peak_allocated']} B, minimal printed {peak.group(1)} KiB")

# A bad flag: exit 2 with a usage line.
p = subprocess.run([minimal, "--steps", "3"], capture_output=True, text=True, timeout=60)
check(p.returncode == 2 and "usage: minimal" in p.stderr, f"bad flag: exit {p.returncode}, {p.stderr!r}")

if fails:
    print(f"{len(fails)} check(s) failed")
    sys.exit(1)
print("minimal: all checks passed")
