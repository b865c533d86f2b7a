#!/usr/bin/env python3
"""End-to-end test of examples/memory_patterns (docs/patterns.md) on the CPU: runs
`memory_patterns --pattern all --out TMP` and checks the diagnosis numerically from
TMP/patterns.json, then that every file it wrote parses:
- staircase: checkpointing the blocks lowers the activation bytes at the peak and the peak;
  without it the forward's activations rise in many steps (at least one per block).
- leak: allocated grows every step in the leaky run, about linearly (each step's increase
  within 25% of the mean increase), and the growth is `activation` bytes; the fixed run
  (loss.item()) stays flat after the first step. The leak detector names the model call in
  leak_run (examples/memory_patterns.cpp, the line found in the source) as the leaking line,
  with most of the growth per step, and finds nothing in the fixed run.
- fragmentation: with random lengths reserved ends well above the largest step's
  allocation; padding to one length leaves a smaller reserved-minus-allocated gap than the
  default, and max_split_size_mb's run is reported (see docs/patterns.md for what it does).
- files: chrome traces and timelines are JSON ([times, sizes] with 13 columns), snapshots
  load with pickle, the timeline html exists.
Then runs `profile_models --device cpu --small` when its path is given (second argument).

    test_memory_patterns.py MEMORY_PATTERNS_EXE [PROFILE_MODELS_EXE]
"""
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

from example_checks import check, fails, run_program

exe = sys.argv[1]
out = tempfile.mkdtemp(prefix="memory_patterns_")

p = run_program([exe, "--pattern", "all", "--device", "cpu", "--out", out], "memory_patterns",
                timeout=500)
res = json.load(open(os.path.join(out, "patterns.json")))
check(res["device"] == "cpu", f"device {res['device']}")
for word in ("diagnosis: the forward keeps", "diagnosis: with history.push_back(loss)", "fragmentation"):
    check(word in p.stdout, f"stdout lacks '{word}'")

# ---- staircase
st = res["staircase"]
none, ck = st["no_checkpoint"], st["checkpoint_blocks"]
check(ck["peak_activation"] < 0.75 * none["peak_activation"],
      f"checkpointing should lower the activation bytes at the peak: {ck['peak_activation']} vs "
      f"{none['peak_activation']}")
check(ck["peak_allocated"] < none["peak_allocated"],
      f"checkpointing should lower the peak: {ck['peak_allocated']} vs {none['peak_allocated']}")
check(none["forward_rises"] >= st["layers"],
      f"the staircase should rise at least once per block: {none['forward_rises']} rises, {st['layers']} blocks")
check(none["forward_activation"] > ck["forward_activation"],
      f"the forward's activation rise should be smaller with checkpointing: {ck['forward_activation']} vs "
      f"{none['forward_activation']}")

# ---- leak
bad, good = res["leak"]["leaky"], res["leak"]["fixed"]
a, act = bad["allocated"], bad["activation"]
incs = [a[i + 1] - a[i] for i in range(len(a) - 1)]
check(len(incs) >= 3 and all(d > 0 for d in incs), f"leaky allocated should grow every step: {a}")
if incs:
    mean = sum(incs) / len(incs)
    check(all(abs(d - mean) <= 0.25 * mean for d in incs), f"leaky growth should be ~linear: increases {incs}")
    act_growth = act[-1] - act[0]
    check(act_growth >= 0.8 * (a[-1] - a[0]),
          f"the growth should be activation bytes: activation +{act_growth} of allocated +{a[-1] - a[0]}")
g = good["allocated"]
check(max(g[1:]) - min(g[1:]) <= 0.02 * max(g), f"the fixed run should stay flat: {g}")
check(max(good["activation"]) == 0, f"the fixed run should keep no activation between steps: {good['activation']}")
check(a[-1] - a[0] > 10 * (g[-1] - g[0]) + 1, "the leaky run should grow far more than the fixed one")

# The leak detector names the line of leak_run's model call, the one whose graphs are kept.
src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "memory_patterns.cpp")
src_lines = open(src).read().splitlines()
start = next(i for i, l in enumerate(src_lines) if l.startswith("LeakResult leak_run("))
call = next(i for i in range(start, len(src_lines)) if "loss = (*gpt)(idx, tgt).second;" in src_lines[i])
want = f"examples/memory_patterns.cpp:{call + 1}"
lines = bad["leaking_lines"]
check(len(lines) >= 1 and lines[0]["location"] == want,
      f"the leak detector should name {want} first: {lines}")
if lines and incs:
    check(lines[0]["bytes_per_step"] >= 0.8 * mean,
          f"the leaking line should hold most of the growth: {lines[0]['bytes_per_step']} of {mean} per step")
check(f"diagnosis: the leaking line is {want}" in p.stdout, f"stdout should name {want}")
check(good["leaking_lines"] == [], f"the leak detector should find nothing in the fixed run: {good['leaking_lines']}")

# ---- fragmentation
fr = res["fragmentation"]
names = list(fr)
check(len(names) == 5, f"five fragmentation variants expected: {names}")
default, split, padded, expandable, reclaim = (fr[n] for n in names)
check(default["peak_reserved"] > 1.15 * default["peak_allocated"],
      f"random lengths should leave reserved well above allocated: {default['peak_reserved']} vs "
      f"{default['peak_allocated']}")
gap = lambda v: v["peak_reserved"] - v["peak_allocated"]
check(gap(padded) < gap(default), f"padding should shrink the reserved-allocated gap: {gap(padded)} vs {gap(default)}")
check(split["conf"].startswith("max_split_size_mb:"), f"second variant conf {split['conf']}")
check(all(r >= s for r, s in zip(split["reserved"], split["step_peak_allocated"])), "reserved < allocated?")
# Expandable segments: one growing segment, free ranges reused across sizes: a smaller gap
# than the default's (at this size the 20 MiB pages of the large pool are a good part of it).
check(expandable["conf"] == "expandable_segments:True", f"fourth variant conf {expandable['conf']}")
check(expandable["peak_allocated"] == default["peak_allocated"],
      f"expandable segments change what is allocated: {expandable['peak_allocated']} vs "
      f"{default['peak_allocated']}")
check(gap(expandable) < gap(default),
      f"expandable segments should shrink the reserved-allocated gap: {gap(expandable)} vs {gap(default)}")
# reclaim_on_growth: the scattered free pages go back before the segment grows.
check(reclaim["conf"] == "expandable_segments:True,reclaim_on_growth:True", f"fifth variant conf {reclaim['conf']}")
check(reclaim["peak_allocated"] == expandable["peak_allocated"],
      f"reclaim_on_growth changes what is allocated: {reclaim['peak_allocated']} vs {expandable['peak_allocated']}")
check(gap(reclaim) <= gap(expandable),
      f"reclaim_on_growth should not widen the reserved-allocated gap: {gap(reclaim)} vs {gap(expandable)}")

# ---- files
for stem in ("staircase", "staircase_ckpt", "leak"):
    tr = json.load(open(os.path.join(out, stem + ".trace.json")))
    evs = tr["traceEvents"] if isinstance(tr, dict) else tr
    check(len(evs) > 10, f"{stem}.trace.json has {len(evs)} events")
    tl = json.load(open(os.path.join(out, stem + ".timeline.json")))
    check(len(tl) == 2 and len(tl[0]) == len(tl[1]) and len(tl[0]) > 5, f"{stem}.timeline.json layout")
    check(all(len(row) == 13 for row in tl[1]), f"{stem}.timeline.json rows should have 13 columns")
    html = open(os.path.join(out, stem + ".timeline.html")).read()
    check("<html" in html.lower() and len(html) > 1000, f"{stem}.timeline.html looks empty")
for name in ("staircase.pickle", "staircase_ckpt.pickle", "leak.pickle", "fragmentation_0.pickle",
             "fragmentation_1.pickle", "fragmentation_2.pickle", "fragmentation_3.pickle",
             "fragmentation_4.pickle"):
    snap = pickle.load(open(os.path.join(out, name), "rb"))
    check("segments" in snap and "device_traces" in snap, f"{name}: keys {list(snap)}")
leak_snap = pickle.load(open(os.path.join(out, "leak.pickle"), "rb"))
check(any(len(t) > 0 for t in leak_snap["device_traces"]), "leak.pickle has no trace entries")

# ---- profile_models, small CPU path
if len(sys.argv) > 2:
    pout = tempfile.mkdtemp(prefix="profile_models_")
    q = subprocess.run([sys.argv[2], "--device", "cpu", "--small", "--steps", "3", "--rounds", "2",
                        "--out", pout],
                       capture_output=True, text=True, timeout=300)
    print(q.stdout)
    print(q.stderr, file=sys.stderr)
    check(q.returncode == 0, f"profile_models exited {q.returncode}")
    if q.returncode == 0:
        rows = json.load(open(os.path.join(pout, "profile_models.json")))
        check({r["model"] for r in rows} == {"resnet", "gpt"}, f"models {[r['model'] for r in rows]}")
        for r in rows:
            check(r["median_ms"] > 0 and r["median_ms_profiled"] > 0, f"{r['model']}: times {r}")
            check(r["rounds"] == 2 and r["overhead_min_pct"] <= r["overhead_max_pct"],
                  f"{r['model']}: rounds {r['rounds']}, spread {r['overhead_min_pct']}..{r['overhead_max_pct']}")
            for f in ("trace", "timeline"):
                check(os.path.getsize(os.path.join(pout, r[f])) > 100, f"{r['model']}: {f} file empty")
            json.load(open(os.path.join(pout, r["trace"])))
    def meta_run(extra, what):
        """profile_models on a meta device replaying the H200 (ResNet-50 at batch 64 in shapes
        only): its JSON row and its Chrome trace's events, or (None, None) when it failed."""
        q = subprocess.run([sys.argv[2], "--device", "meta:h200", "--models", "resnet", "--steps", "2",
                            "--warmup", "1", "--rounds", "1", "--out", pout, *extra],
                           capture_output=True, text=True, timeout=300)
        print(q.stdout)
        print(q.stderr, file=sys.stderr)
        check(q.returncode == 0, f"profile_models {what} exited {q.returncode}")
        if q.returncode != 0:
            return None, None
        [r] = json.load(open(os.path.join(pout, "profile_models.json")))
        check(f"(profiler: activities {r['activities']}; options {r['options']})" in q.stdout,
              f"{what}: header line")
        return r, json.load(open(os.path.join(pout, r["trace"])))["traceEvents"]

    # The step's host time, profiled and not, and no GPU time; memory events and shapes.
    r, trace = meta_run(["--amp", "fp16"], "--device meta:h200")
    if r:
        check(r["device"].startswith("meta:") and r["desc"] == "ResNet-50 batch 64 224x224",
              f"meta run: {r['device']}, {r['desc']}")
        check(r["median_ms"] > 0 and r["median_ms_profiled"] > 0 and r["kernel_ms_per_step"] == 0,
              f"meta run: {r}")
        check(r["activities"] == "cpu" and r["options"] == "memory,shapes,stack",
              f"meta run: profiler settings {r['activities']}; {r['options']}")
        check(any(e.get("name") == "[memory]" for e in trace), "meta run: no [memory] events")
        check(any("Input Dims" in e.get("args", {}) for e in trace), "meta run: no Input Dims")
    # The profiler's options off: op spans only, no memory events, no shapes, no timeline.
    r, trace = meta_run(["--activities", "cpu", "--options", "none"], "--options none")
    if r:
        check(r["activities"] == "cpu" and r["options"] == "none" and r["timeline"] == "",
              f"--options none: {r}")
        ops = [e for e in trace if e.get("cat") == "cpu_op"]
        check(len(ops) > 100, f"--options none: {len(ops)} op spans")
        check(not any(e.get("name") == "[memory]" for e in trace), "--options none: [memory] events")
        check(not any("Input Dims" in e.get("args", {}) for e in trace), "--options none: Input Dims")

if fails:
    print(f"{len(fails)} check(s) failed")
    sys.exit(1)
shutil.rmtree(out, ignore_errors=True)
if len(sys.argv) > 2:
    shutil.rmtree(pout, ignore_errors=True)
print("all memory_patterns checks passed")
