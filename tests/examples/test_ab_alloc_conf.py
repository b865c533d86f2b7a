#!/usr/bin/env python3
"""ab_memory --alloc-conf: one configuration per allocator setting, each run (and its dry run)
under its own settings. Read back: results.json's rows and settings, and the snapshots by
Python's pickle: the expandable run's segments are all expandable, the default run's none.

    test_ab_alloc_conf.py BUILD_DIR
"""
import json
import os
import pickle
import subprocess
import sys
import tempfile

build = sys.argv[1]
exe = os.path.join(build, "examples", "ab_memory")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "ab")
    cmd = [exe, "--model", "resnet", "--arch", "tiny", "--batch", "8", "--steps", "2",
           "--checkpoint", "none", "--amp", "off", "--alloc-conf", "default",
           "--alloc-conf", "expandable_segments:True", "--out", out]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    check(p.returncode == 0, f"ab_memory exited {p.returncode}: {p.stdout[-2000:]}{p.stderr}")
    if p.returncode == 0:
        with open(os.path.join(out, "results.json")) as f:
            rows = json.load(f)
        check([r["settings"].get("alloc") for r in rows] == ["default", "expandable_segments:True"],
              f"settings: {[r['settings'] for r in rows]}")
        check(all("alloc=" in r["name"] for r in rows), f"names: {[r['name'] for r in rows]}")
        expandable = []
        for r in rows:
            with open(r["snapshot"], "rb") as f:
                snap = pickle.load(f)
            segs = [s for s in snap["segments"]]
            check(len(segs) > 0, f"{r['name']}: no segments")
            expandable.append({bool(s.get("is_expandable")) for s in segs})
            # The same model, batch and steps: the same bytes allocated at the peak.
            check(r["peak_allocated"] == rows[0]["peak_allocated"],
                  f"{r['name']}: peak allocated {r['peak_allocated']} vs {rows[0]['peak_allocated']}")
            check(r["estimated_peak_allocated"] == r["peak_allocated"],
                  f"{r['name']}: predicted {r['estimated_peak_allocated']} vs {r['peak_allocated']}")
        check(expandable == [{False}, {True}], f"is_expandable per run: {expandable}")
        report = open(os.path.join(out, "report.html"), encoding="utf-8").read()
        check("expandable_segments:True" in report, "the report names the setting")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("ab_memory --alloc-conf: ok")
