#!/usr/bin/env python3
"""End-to-end test of examples/tally_memdiff on PyTorch's own snapshots (tests/memory/fixtures):

- the JSON's peaks, allocation counts and per-frame bytes at each peak equal an independent
  replay written here in Python (alloc / free_completed; blocks live before the trace: freed
  without an alloc, or active in the segments; key: the innermost frame under no torch/ folder);
- a snapshot against itself has no deltas; the text table and the HTML page are written, the page
  has no network reference and, when Debian's chromium is installed, renders both timelines;
- bad input exits 2 with one line "tally_memdiff: FILE: what is wrong": a truncated pickle (the
  byte offset and the opcode), a pickle of an int, a dict without segments, a snapshot without
  history, two snapshots of different devices, a missing file, a bad --top.

    test_memdiff.py BUILD_DIR
"""
import collections
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_checks import check, fails  # noqa: E402

build = sys.argv[1]
exe = os.path.join(build, "examples", "tally_memdiff")
fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "memory", "fixtures")
EXP = os.path.join(fixtures, "torch211-snapshot-expandable.pickle")
OOM = os.path.join(fixtures, "torch211-snapshot-oom-segfree.pickle")
PEND = os.path.join(fixtures, "torch211-snapshot-pending-free.pickle")
tmp = tempfile.mkdtemp(prefix="tally_memdiff_")


def site(frames):
    if not frames:
        return "(no frames)"
    first_py = first_named = outer_op = None
    for f in frames:
        if f.get("name", "").startswith("at::_ops::"):
            outer_op = f["name"].split("(")[0]
        fn = f.get("filename", "")
        if fn.endswith(".py"):
            if not (fn.startswith("torch/") or "/torch/" in fn):
                return f"{fn}:{f['line']}:{f['name']}"
            first_py = first_py or f
        elif first_named is None and fn not in ("", "??"):
            first_named = f
    if first_py is None and outer_op:
        return outer_op
    p = first_py or first_named or frames[0]
    return f"{p['filename']}:{p['line']}:{p['name']}"


def replay(path):
    """peak, allocations, {frame: bytes at the peak}, {frame: allocations}"""
    s = pickle.load(open(path, "rb"))
    trace = s["device_traces"][0]
    live, initial = {}, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], site(e["frames"]))
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                del live[e["addr"]]
            else:
                initial.setdefault(e["addr"], (e["size"], site(e["frames"])))
    for seg in s["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "inactive" or b["address"] in live or b["address"] in initial:
                continue
            size = b["requested_size"] if 0 < b.get("requested_size", 0) <= b["size"] else b["size"]
            initial[b["address"]] = (size, site(b.get("frames", [])))
    live = dict(initial)
    peak, at_peak = sum(v[0] for v in live.values()), dict(live)
    allocs = collections.Counter()
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], site(e["frames"]))
            allocs[site(e["frames"])] += 1
        elif e["action"] == "free_completed" and e["addr"] in live:
            del live[e["addr"]]
        else:
            continue
        total = sum(v[0] for v in live.values())
        if total >= peak:
            peak, at_peak = total, dict(live)
    by = collections.Counter()
    for size, key in at_peak.values():
        by[key] += size
    return peak, sum(allocs.values()), by, allocs


def run(args):
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


# ---- A vs B: the numbers against the replay
html, js = os.path.join(tmp, "d.html"), os.path.join(tmp, "d.json")
r = run([PEND, EXP, "--html", html, "--json", js, "--top", "3"])
print(r.stdout, r.stderr)
check(r.returncode == 0, f"tally_memdiff exited {r.returncode}: {r.stderr}")
d = json.load(open(js))
for side, path in (("a", PEND), ("b", EXP)):
    peak, n, by, allocs = replay(path)
    check(d[side]["peak_allocated"] == peak, f"{side}: peak {d[side]['peak_allocated']} != replay {peak}")
    check(d[side]["allocations"] == n, f"{side}: allocations {d[side]['allocations']} != {n}")
    check(d[side]["format"] == "pytorch" and d[side]["device"] == 0, f"{side}: {d[side]}")
    frames = {s["dimension"]: s for s in d["sections"]}.get("frame")
    check(frames is not None, f"no frame section: {[s['dimension'] for s in d['sections']]}")
    if frames:
        got = {row["name"]: row[f"{side}_bytes"] for row in frames["rows"] if row[f"{side}_bytes"]}
        check(got == {k: v for k, v in by.items() if v}, f"{side}: bytes at the peak by frame {got} != {dict(by)}")
        got_n = {row["name"]: row[f"{side}_allocations"] for row in frames["rows"] if row[f"{side}_allocations"]}
        check(got_n == dict(allocs), f"{side}: allocations by frame {got_n} != {dict(allocs)}")
check([s["dimension"] for s in d["sections"]] == ["frame"], "PyTorch's snapshots group by frame only")
for s in d["sections"]:
    for row in s["rows"]:
        check(row["delta_bytes"] == row["b_bytes"] - row["a_bytes"], f"delta of {row}")
# The text: totals, one table, --top 3 rows and the note of the rest.
check("peak allocated" in r.stdout and "by frame" in r.stdout, "text table")
check("exp.py:45:<module>" in r.stdout, "the largest change is listed")
check(re.search(r"\(\d+ more rows", r.stdout) is not None, "--top 3 leaves a note of the other rows")
page = open(html, encoding="utf-8").read()
check("<svg" in page and "http" not in page, "the page is self-contained (inline SVG, no URL)")

# ---- a snapshot against itself
r = run([OOM, OOM, "--json", js])
check(r.returncode == 0, f"self diff exited {r.returncode}: {r.stderr}")
d = json.load(open(js))
check(all(row["delta_bytes"] == 0 and row["delta_allocations"] == 0 for s in d["sections"] for row in s["rows"]),
      "a snapshot against itself has no deltas")

# ---- bad input: exit 2, one line naming the file and what is wrong
def bad_file(name, data):
    p = os.path.join(tmp, name)
    with open(p, "wb") as f:
        f.write(data)
    return p


whole = open(PEND, "rb").read()
truncated = bad_file("truncated.pickle", whole[:20000])
an_int = bad_file("int.pickle", pickle.dumps(5, protocol=4))
no_segments = bad_file("nosegs.pickle", pickle.dumps({"device_traces": [[]], "blocks": 1}, protocol=4))
no_history = bad_file("nohistory.pickle", pickle.dumps({"segments": [], "device_traces": [[]]}, protocol=4))
a_class = bad_file("class.pickle", pickle.dumps(collections.OrderedDict(a=1), protocol=4))
snap = pickle.loads(whole)
snap["device_traces"] = [[], snap["device_traces"][0]]
for seg in snap["segments"]:
    seg["device"] = 1
device1 = bad_file("device1.pickle", pickle.dumps(snap, protocol=4))
cases = [
    ([truncated, EXP], rf"^tally_memdiff: {re.escape(truncated)}: (byte \d+: opcode [A-Z_0-9]+ \(0x[0-9a-f]{{2}}\): "
                       r"truncated|the pickle ends at byte 20000 without STOP)"),
    ([EXP, an_int], rf"^tally_memdiff: {re.escape(an_int)}: not a memory snapshot: the pickle holds an int"),
    ([no_segments, EXP], rf"^tally_memdiff: {re.escape(no_segments)}: not a memory snapshot: the dict has no 'segments'"),
    ([no_history, EXP], rf"^tally_memdiff: {re.escape(no_history)}: no allocation history"),
    ([a_class, EXP], rf"^tally_memdiff: {re.escape(a_class)}: byte \d+: opcode [A-Z_]+ \(0x[0-9a-f]{{2}}\): classes"),
    ([EXP, device1], rf"^tally_memdiff: cannot diff {re.escape(EXP)} and {re.escape(device1)}: they are snapshots "
                     r"of different devices"),
    ([EXP, device1, "--device", "1"], rf"^tally_memdiff: {re.escape(EXP)}: no allocation history on device 1"),
    ([EXP, os.path.join(tmp, "missing.pickle")], r"^tally_memdiff: .*missing\.pickle: cannot open"),
    ([EXP, EXP, "--top", "-1"], r"^tally_memdiff: .*--top"),
    ([EXP], r"^tally_memdiff: .*B"),
    ([EXP, EXP, "--html", "/nonexistent/dir/d.html"], r"^tally_memdiff: --html"),
]
for args, pattern in cases:
    r = run(args)
    msg = r.stderr.strip()
    check(r.returncode == 2, f"{args}: exit {r.returncode}, expected 2 ({msg})")
    check(len(msg.splitlines()) == 1 and re.search(pattern, msg) is not None,
          f"{args}: message {msg!r} does not match {pattern!r}")
check(not os.path.exists("/nonexistent/dir/d.html"), "nothing written on a bad --html")
# The other device of a two-device file is fine.
r = run([device1, device1, "--device", "1"])
check(r.returncode == 0, f"--device 1 of a device-1 snapshot: {r.stderr}")
# Snapshots that stand for one device under different ordinals (dry runs): --any-device.
r = run([EXP, device1, "--any-device", "--json", js])
check(r.returncode == 0, f"--any-device: {r.stderr}")
if r.returncode == 0:
    d = json.load(open(js))
    check(d["a"]["device"] == 0 and d["b"]["device"] == 1 and d["a"]["peak_allocated"] == replay(EXP)[0],
          f"--any-device: {d['a']} {d['b']}")

# ---- the page in a browser (skipped without chromium)
chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
if chromium:
    profile = tempfile.mkdtemp(prefix="chromium_profile_")
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom",
                        "file://" + html], capture_output=True, text=True, timeout=180)
    dom = r.stdout
    check('data-rendered="1"' in dom, "the page's script did not run in chromium")
    check('data-series="2"' in dom, "both timelines drawn")
    check(dom.count('class="diff"') == 1, "one table (frame)")
    shutil.rmtree(profile, ignore_errors=True)
else:
    print("chromium not installed: rendering check skipped")

shutil.rmtree(tmp, ignore_errors=True)
if fails:
    print(f"{len(fails)} failures")
    sys.exit(1)
print("tally_memdiff ok: PyTorch fixtures match the replay, self diff is zero, bad input exits 2")
