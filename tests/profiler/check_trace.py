#!/usr/bin/env python3
"""Checks a Chrome trace written by tally::profiler (run by test_profiler.cpp).

usage: check_trace.py TRACE.json [--gpu]

Asserts: the file parses with json; it has the top-level keys Perfetto and PyTorch's tools
read; "X" op spans (cat cpu_op) with names, ts, dur, pid, tid, args; module and
user_annotation spans; "[memory]" instant events with PyTorch's argument names plus
Category; one "C" counter track per category that moved; X spans nest properly on every
(pid, tid) track (a child ends inside its parent); flows pair up ("s" and "f" per id).
With --gpu: kernel spans exist and each kernel's External id names a cpu_op span.
Exit 0 when all hold; prints the first failure and exits 1 otherwise.
"""
import json
import sys
from collections import defaultdict

EPS = 0.0015  # µs: ts/dur are printed with 3 decimals


def fail(msg):
    print("check_trace: FAIL:", msg)
    sys.exit(1)


def main():
    path = sys.argv[1]
    gpu = "--gpu" in sys.argv[2:]
    with open(path) as f:
        trace = json.load(f)
    for key in ("schemaVersion", "traceEvents", "displayTimeUnit", "baseTimeNanoseconds"):
        if key not in trace:
            fail(f"missing top-level key {key}")
    events = trace["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X"]
    for e in xs:
        for k in ("ph", "ts", "dur", "pid", "tid", "name", "cat", "args"):
            if k not in e:
                fail(f"X event without {k}: {e}")
        if e["dur"] < 0:
            fail(f"negative duration: {e}")
    cats = defaultdict(list)
    for e in xs:
        cats[e["cat"]].append(e)
    if not cats["cpu_op"]:
        fail("no cpu_op spans")
    names = {e["name"] for e in cats["cpu_op"]}
    if not gpu:
        for want in ("linear", "conv2d", "relu", "cross_entropy"):
            if want not in names:
                fail(f"no cpu_op named {want} (have {sorted(names)})")
        if not any(e["name"].endswith("fc1") for e in cats["module"]):
            fail("no module span for fc1")
        users = {e["name"] for e in cats["user_annotation"]}
        if "## Forward Pass ##" not in users or not any(u.startswith("ProfilerStep#") for u in users):
            fail(f"user ranges missing: {sorted(users)}")
        mem = [e for e in events if e.get("ph") == "i" and e.get("name") == "[memory]"]
        if not mem:
            fail("no [memory] events")
        for e in mem:
            for k in ("Addr", "Bytes", "Total Allocated", "Total Reserved", "Device Id",
                      "Device Type", "Category"):
                if k not in e["args"]:
                    fail(f"[memory] without {k}: {e}")
            if e.get("s") != "t" or e.get("cat") != "cpu_instant_event":
                fail(f"[memory] event scope/cat wrong: {e}")
        counters = {e["name"] for e in events if e.get("ph") == "C"}
        for cat in ("parameter", "activation", "gradient"):
            if not any(c.endswith(": " + cat) for c in counters):
                fail(f"no counter track for {cat} (have {sorted(counters)})")
    # Nesting: on each track, sorted by (ts, -dur), every span lies inside the open ones.
    tracks = defaultdict(list)
    for e in xs:
        tracks[(e["pid"], e["tid"])].append(e)
    for key, spans in tracks.items():
        if any(e["cat"] in ("cuda_runtime", "cuda_driver") for e in spans):
            continue  # CUPTI's host clock is converted, not exact to the ns
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in spans:
            while stack:
                p = stack[-1]
                pend = p["ts"] + p["dur"]
                if e["ts"] + e["dur"] <= pend + EPS:
                    break  # inside p (it started no later: sorted)
                if e["ts"] < pend - EPS:
                    fail(f"track {key}: {e['name']} [{e['ts']}, +{e['dur']}] overlaps "
                         f"{p['name']} [{p['ts']}, +{p['dur']}]")
                stack.pop()
            stack.append(e)
    flows = defaultdict(set)
    for e in events:
        if e.get("ph") in ("s", "f"):
            flows[e["id"]].add(e["ph"])
    for fid, phs in flows.items():
        if phs != {"s", "f"}:
            fail(f"flow {fid} has only {phs}")
    if gpu:
        kernels = cats["kernel"]
        if not kernels:
            fail("no kernel spans")
        op_ids = {e["args"]["External id"] for e in cats["cpu_op"]}
        attributed = [k for k in kernels if k["args"].get("External id") in op_ids]
        if not attributed:
            fail("no kernel is attributed to a cpu_op")
        if not flows:
            fail("no launch->kernel flows")
    print(f"check_trace: OK ({len(events)} events, {len(xs)} spans)")


if __name__ == "__main__":
    main()
