#!/usr/bin/env python3
"""Open a memory snapshot with PyTorch's own `torch.cuda._memory_viz` and check the results.

Usage: check_memviz.py SNAPSHOT.pickle OUTDIR [--memviz-path PATH] [--strict]

Meant for the GPU machine (PyTorch 2.11, no network). Every tool of `_memory_viz` runs on the
snapshot the way its CLI (`python -m torch.cuda._memory_viz CMD FILE`) would, and writes its
output to OUTDIR:

  trace_plot.html                trace_plot(data)                       "Active Memory Timeline"
  trace_plot_segments.html       trace_plot(data, plot_segments=True)   (CLI trace_plot -s)
  trace_plot_filter_freed.html   trace_plot(data, filter_freed=True)    (CLI trace_plot -f, 2.11+)
  segment_plot.html              segment_plot(data)                     "Allocator State History"
  segments.folded / memory.folded   segments(data, format_flamegraph=F) / memory(...): the
                                 flame-graph lines, written by a formatter F given here (the
                                 default one downloads flamegraph.pl; it is never called)
  compare.folded                 compare(segs, segs, format_flamegraph=F) of the snapshot with
                                 itself (compare takes segment lists; it breaks on dicts)
  stats.txt                      segsum(data) (CLI `stats`)
  trace.txt                      trace(data) (CLI `trace`)

Checks: each HTML page is non-empty, names a view the viewer has and embeds, as base64 padded
with NULs (no '='), a pickle of protocol <= 4 that loads to the snapshot (or to the filtered
snapshot); the folded lines parse and add up to the reserved bytes; segsum's totals match
the segments; trace() lists every event.

Replay: `_memory_viz` has no function that returns a replayed state (trace() only prints
text; its name bookkeeping never releases names). Its `filter_alloc_free_pairs` (used by
trace_plot(filter_freed=True)) pairs alloc/free_requested/free_completed: the allocs it
keeps that are not freed later must be exactly the `active_allocated` blocks the trace
allocated. Besides that, the script replays the trace as the viewer does:
  * forward, as process_alloc_data.js (Active Memory Timeline): `alloc` makes an address
    live, the next `free_completed` (or merged `free`) at that address ends it, an unmatched
    `free_completed` is "initially allocated", `active_allocated` blocks with no live alloc
    are "ghosts"; the live allocations must be the snapshot's active blocks, with
    alloc size == requested_size;
  * backward, as MemoryViz.js simulate_memory (Allocator State History): from the
    segments, undo every event down to the first; nothing the viewer would throw on
    (free_requested of an absent block, a block outside every segment, segment_map with no
    holder) and no segment_alloc of an absent segment (the viewer then drops an unrelated
    one); the blocks left before the first event must be the forward replay's ghosts plus
    its initially-allocated ones.
  * viewer pitfalls (docs/memory-formats.md §7): categories without 'unknown', an alloc
    without size, a segment device with no device_traces entry.

Warnings (errors with --strict): a block the Allocator State History draws as "freed but
waiting due to record_stream" (red) while it is live, because its `free_completed` has no
`free_requested` before it (e.g. a re-tag written as free_completed + alloc); ghost blocks
in a trace with no sign of truncation.

`_memory_viz` comes from `torch.cuda._memory_viz`, or from --memviz-path / $TALLY_MEMVIZ_PATH
(a `_memory_viz.py` file or the folder holding it), or, without torch, from a plain
`import _memory_viz` on PYTHONPATH. Stdlib only besides that.

Prints one line per output with its size, then the replay summary. Exit 0: all passed;
1: a check failed or a tool raised (each reported on a FAIL line); 2: the snapshot or
_memory_viz cannot be loaded.
"""

import argparse
import base64
import contextlib
import copy
import importlib.util
import inspect
import io
import json
import os
import pickle
import re
import sys
import traceback
from pathlib import Path

# View names MemoryViz.js knows (its `kinds` table).
VIEWER_VIEWS = {
    "Active Memory Timeline",
    "Allocated Memory (incl. Private Pools)",
    "Allocator State History",
    "Active Cached Segment Timeline",
    "Allocator Settings",
}
# trace_plot(plot_segments=True) asks for this name, which no viewer version has (PyTorch bug).
KNOWN_BAD_VIEWS = {"Active Cached Memory Timeline"}
MAX_LISTED = 20  # failures / warnings listed per kind


class Report:
    def __init__(self, strict):
        self.strict = strict
        self.out = sys.stdout  # not the StringIO of a redirect_stdout around a tool
        self.errors = []
        self.warnings = []

    def fail(self, msg):
        self.errors.append(msg)
        print(f"FAIL {msg}", file=self.out, flush=True)

    def warn(self, msg):
        if self.strict:
            self.fail(msg)
        else:
            self.warnings.append(msg)
            print(f"WARN {msg}", file=self.out, flush=True)

    def output(self, path, what):
        size = path.stat().st_size if path.exists() else -1
        print(f"{path.name:<30} {size:>12,} bytes  {what}", file=self.out, flush=True)
        return size


# ---------------------------------------------------------------------------- loading


def load_memory_viz(path):
    """Returns (module, description)."""
    path = path or os.environ.get("TALLY_MEMVIZ_PATH")
    if path:
        p = Path(path)
        if p.is_dir():
            p = p / "_memory_viz.py"
        if not p.is_file():
            raise ImportError(f"no _memory_viz.py at {p}")
        spec = importlib.util.spec_from_file_location("_memory_viz", p)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, f"{p} (given path)"
    try:
        import torch  # noqa: F401
    except ImportError:
        try:
            import _memory_viz as mod  # a copy on PYTHONPATH
        except ImportError as e:
            raise ImportError("torch is not installed and no _memory_viz was given "
                              "(--memviz-path, $TALLY_MEMVIZ_PATH or PYTHONPATH)") from e
        return mod, f"{mod.__file__} (PYTHONPATH, torch absent)"
    import torch
    from torch.cuda import _memory_viz as mod
    return mod, f"torch {torch.__version__}: {mod.__file__}"


def flamegraph_formatter(mv, fn_name):
    """Keyword to pass a formatter to mv.<fn_name>; fails clearly if the signature changed."""
    params = inspect.signature(getattr(mv, fn_name)).parameters
    if "format_flamegraph" not in params:
        raise TypeError(f"_memory_viz.{fn_name}{inspect.signature(getattr(mv, fn_name))} has no "
                        f"format_flamegraph parameter")
    return "format_flamegraph"


class NoDownload:
    """Makes any attempt to reach the network (flamegraph.pl download) raise at once."""

    def __enter__(self):
        import urllib.request
        self._mod = urllib.request
        self._saved = urllib.request.urlretrieve, urllib.request.urlopen

        def refuse(*args, **kwargs):
            raise RuntimeError(f"check_memviz: refusing network access {args[:1]}")

        urllib.request.urlretrieve = refuse
        urllib.request.urlopen = refuse
        return self

    def __exit__(self, *exc):
        self._mod.urlretrieve, self._mod.urlopen = self._saved
        return False


# ---------------------------------------------------------------------------- checks of outputs


def block_addresses(seg):
    """Block addresses as the viewer computes them (segment address + sizes before)."""
    addr = seg["address"]
    for b in seg["blocks"]:
        yield addr, b
        addr += b["size"]


def check_html(rep, name, html, expected_data, allowed_views):
    if not html:
        rep.fail(f"{name}: empty HTML")
        return
    m = re.search(r"const local_files = (\[.*?\])\s*\n", html, re.S)
    if not m:
        rep.fail(f"{name}: no `const local_files = [...]` in the HTML")
        return
    try:
        files = json.loads(m.group(1))
        b64 = files[0]["base64"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        rep.fail(f"{name}: local_files is not [{{name, base64}}]: {e}")
        return
    if not b64 or "=" in b64 or len(b64) % 4:
        rep.fail(f"{name}: base64 has padding or a bad length; the viewer's decoder assumes "
                 f"NUL padding to a multiple of 3 bytes")
    raw = base64.b64decode(b64)
    if raw[:1] != b"\x80" or not 2 <= raw[1] <= 4:
        rep.fail(f"{name}: embedded pickle header {raw[:2].hex()}: the viewer reads protocols "
                 f"2-4 only")
    try:
        obj = pickle.loads(raw)
    except Exception as e:  # noqa: BLE001
        rep.fail(f"{name}: embedded pickle does not load: {e!r}")
        return
    if obj != expected_data:
        rep.fail(f"{name}: embedded pickle differs from the snapshot given to the tool")
    v = re.search(r"add_local_files\(local_files, (['\"])(.*?)\1\)", html)
    if not v:
        rep.fail(f"{name}: no add_local_files(local_files, 'VIEW') call")
    elif v.group(2) not in allowed_views:
        rep.fail(f"{name}: view {v.group(2)!r} is not one the viewer has")
    elif v.group(2) in KNOWN_BAD_VIEWS:
        print(f"     note: {name} asks for view {v.group(2)!r}, which no viewer has "
              f"(PyTorch's trace_plot(plot_segments=True) bug: in a browser the view menu "
              f"matches no option, so the page likely draws nothing)")


def check_folded(rep, name, text, data, per_segment):
    """Lines `stream_S[;seg_A];STATE;frames COUNT`; counts add up to the reserved bytes."""
    lines = text.splitlines()
    total = 0
    bad = 0
    for line in lines:
        stack, sep, count = line.rpartition(" ")
        if not sep or not re.fullmatch(r"-?\d+", count):
            bad += 1
            if bad <= MAX_LISTED:
                rep.fail(f"{name}: unparsable line {line!r}")
            continue
        n = int(count)
        parts = stack.split(";")
        state = parts[2 if per_segment else 1] if len(parts) > 2 else ""
        if n < 0 and state != "inactive":  # PyTorch leaves inactive requested_size stale
            rep.fail(f"{name}: negative count in {line!r} (requested_size > size)")
        total += n
        want = 4 if per_segment else 3
        if len(parts) < want or not parts[0].startswith("stream_") or (
                per_segment and not parts[1].startswith("seg_")):
            rep.fail(f"{name}: unexpected stack {stack!r}")
    reserved = sum(s["total_size"] for s in data["segments"])
    if total != reserved:
        rep.fail(f"{name}: counts add up to {total}, the segments reserve {reserved}")
    if data["segments"] and not lines:
        rep.fail(f"{name}: no lines for {len(data['segments'])} segments")
    for seg in data["segments"]:
        for _, b in block_addresses(seg):
            for f in b.get("frames", []):
                if ";" in f.get("name", "") or ";" in f.get("filename", ""):
                    rep.warn(f"{name}: frame {f} contains ';', which splits a flame-graph frame")
                    return


def check_stats(rep, mv, text, data):
    reserved = sum(s["total_size"] for s in data["segments"])
    allocated = sum(b["requested_size"] for s in data["segments"] for b in s["blocks"]
                    if b["state"] == "active_allocated")
    for label, value in (("segments", len(data["segments"])),
                         ("total_reserved", mv.Bytes(reserved)),
                         ("total_allocated", mv.Bytes(allocated))):
        if f"{label}: {value}\n" not in text:
            rep.fail(f"stats.txt: no line '{label}: {value}'")


def check_trace_text(rep, text, data):
    for d, entries in enumerate(data["device_traces"]):
        if not entries:
            continue
        header = f"Device {d} ----------------\n{len(entries)} entries\n"
        if header not in text:
            rep.fail(f"trace.txt: no header for device {d} with {len(entries)} entries")
    counts = {
        "alloc": len(re.findall(r"^\w+ = (?:seg_\d+|MEM|\w+)\[", text, re.M)),
        "free_requested": len(re.findall(r"^del ", text, re.M)),
        "free_completed": len(re.findall(r"^# free completed for ", text, re.M)),
        "segment_alloc": len(re.findall(r"^\w+ = cudaMalloc\(", text, re.M)),
        "segment_free": len(re.findall(r"^cudaFree\(", text, re.M)),
        "oom": len(re.findall(r"^raise OutOfMemoryError", text, re.M)),
    }
    for action, n in counts.items():
        want = sum(1 for t in data["device_traces"] for e in t if e["action"] == action)
        if n != want:
            rep.fail(f"trace.txt: {n} lines for {action}, the trace has {want}")


# ---------------------------------------------------------------------------- replays


def viewer_pitfalls(rep, data):
    """Returns False when entries are too malformed to replay."""
    ok = True
    traces = data["device_traces"]
    entries = [e for t in traces for e in t]
    cats = {e["category"] for e in entries if "category" in e}
    if cats and "unknown" not in cats:
        rep.fail("trace entries carry `category` but none is 'unknown': MemoryViz.js "
                 "annotate_snapshot throws (snapshot.categores typo) and draws nothing")
    for d, t in enumerate(traces):
        for j, e in enumerate(t):
            if e["action"] in ("alloc", "free_requested", "free_completed", "free",
                               "segment_alloc", "segment_free", "segment_map",
                               "segment_unmap"):
                if not isinstance(e.get("size"), int) or not isinstance(e.get("addr"), int):
                    ok = False
                    rep.fail(f"device {d} entry {j} ({e['action']}): addr/size missing or not "
                             f"int (the timeline's geometry becomes NaN)")
    for s in data["segments"]:
        if not 0 <= s["device"] < len(traces):
            rep.fail(f"segment {s['address']:#x} on device {s['device']} but device_traces has "
                     f"{len(traces)} lists: the viewer cannot show that device")
    for s in data["segments"]:
        for addr, b in block_addresses(s):
            if b.get("address", addr) != addr:
                rep.fail(f"block address {b['address']:#x} != segment address + sizes before "
                         f"({addr:#x}), the address the viewer uses")
                return ok
    return ok


def active_blocks(data, device):
    out = {}
    for s in data["segments"]:
        if s["device"] != device:
            continue
        for addr, b in block_addresses(s):
            if b["state"] in ("active_allocated", "active_pending_free"):
                out[addr] = b
    return out


def replay_forward(rep, device, trace, data):
    """process_alloc_data.js's pairing. Returns (live, initially, ghosts, truncated)."""
    where = f"device {device} forward replay (Active Memory Timeline)"
    live = {}  # addr -> (index, alloc entry)
    initially = {}  # addr -> index of an unmatched free_completed
    truncated = False
    requested = set()
    for j, e in enumerate(trace):
        a = e["action"]
        if a == "alloc":
            if e["addr"] in live:
                rep.fail(f"{where}: entry {j} allocates {e['addr']:#x}, still live from entry "
                         f"{live[e['addr']][0]}; the timeline never ends the first one")
            live[e["addr"]] = (j, e)
        elif a == "free_requested":
            requested.add(e["addr"])
            if e["addr"] not in live:
                truncated = True
        elif a in ("free", "free_completed"):
            if e["addr"] in live:
                _, alloc = live.pop(e["addr"])
                if e["size"] != alloc["size"]:
                    rep.fail(f"{where}: entry {j} frees {e['addr']:#x} with size {e['size']}, "
                             f"allocated with {alloc['size']}")
            else:
                initially[e["addr"]] = j
                truncated = True
    blocks = active_blocks(data, device)
    for addr, (j, e) in sorted(live.items()):
        b = blocks.get(addr)
        if b is None:
            rep.fail(f"{where}: {addr:#x} allocated at entry {j} is live at the end, but the "
                     f"snapshot has no active block there")
        elif b["requested_size"] != e["size"]:
            rep.fail(f"{where}: block {addr:#x} requested_size {b['requested_size']} != its "
                     f"alloc size {e['size']} (entry {j})")
    touched = {e["addr"] for e in trace
               if e["action"] in ("alloc", "free_requested", "free", "free_completed")}
    # Active blocks with no live alloc: drawn from time 0 ("ghosts") when active_allocated.
    untraced = {addr: b for addr, b in blocks.items() if addr not in live}
    for addr, b in sorted(untraced.items()):
        if addr in touched:
            rep.fail(f"{where}: block {addr:#x} is {b['state']} at the end but the trace frees "
                     f"it and never allocates it again")
    return live, initially, untraced, truncated


def replay_filter_freed(rep, mv, device, data, live_fwd):
    """_memory_viz.filter_alloc_free_pairs (alloc + free_requested + free_completed pairs are
    dropped), then the viewer's pairing on what it keeps: the live allocations must be those
    of the forward replay that are still active_allocated. Returns (live, printed lines)."""
    if not hasattr(mv, "filter_alloc_free_pairs"):
        return None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        filtered = mv.filter_alloc_free_pairs(copy.deepcopy(data))
    printed = [ln for ln in out.getvalue().splitlines() if ln]
    live = {}
    for e in filtered["device_traces"][device]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] in ("free", "free_completed"):
            live.pop(e["addr"], None)
    where = f"device {device} _memory_viz.filter_alloc_free_pairs"
    blocks = active_blocks(data, device)
    want = {a for a in live_fwd if a in blocks and blocks[a]["state"] == "active_allocated"}
    for addr in sorted(set(live) ^ want)[:MAX_LISTED]:
        if addr in live:
            rep.fail(f"{where}: keeps an unfreed alloc at {addr:#x} that is not a live "
                     f"active_allocated block in the viewer's replay")
        else:
            rep.fail(f"{where}: drops the alloc of live block {addr:#x}")
    for addr, e in live.items():
        b = blocks.get(addr)
        if b is not None and b["requested_size"] != e["size"]:
            rep.fail(f"{where}: alloc {addr:#x} size {e['size']} != requested_size "
                     f"{b['requested_size']}")
    return live, printed


def merge_frees(trace):
    """MemoryViz.js annotate_snapshot: free_requested directly followed by free_completed of
    the same address becomes one `free` event."""
    out = []
    for e in trace:
        if (e["action"] == "free_completed" and out and out[-1]["action"] == "free_requested"
                and out[-1]["addr"] == e["addr"]):
            out[-1] = dict(out[-1], action="free")
            continue
        out.append(e)
    return out


def replay_backward(rep, device, trace, data):
    """MemoryViz.js simulate_memory: undo events from the end down to the first. Returns
    (blocks before the first event, [(addr, from, to)] drawn pending-free while live)."""
    where = f"device {device} backward replay (Allocator State History)"
    events = merge_frees(trace)
    blocks = {}  # addr -> [size, free_requested, index of the event that made it, or None]
    segs = {}  # addr -> [size, stream]
    for s in data["segments"]:
        if s["device"] != device:
            continue
        segs[s["address"]] = [s["total_size"], s["stream"]]
        for addr, b in block_addresses(s):
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[addr] = [b["size"], b["state"] == "active_pending_free", None]
    red = []
    nerr = 0

    def err(msg):
        nonlocal nerr
        nerr += 1
        if nerr <= MAX_LISTED:
            rep.fail(f"{where}: {msg}")

    def holder(addr, size=1):
        for a, (n, _) in segs.items():
            if a <= addr and addr + size <= a + n:
                return a
        return None

    def blocks_in(a, n):
        return sorted(x for x in blocks if a <= x < a + n)

    def map_merged(addr, size, stream):  # map_segment(merge=true)
        segs[addr] = [size, stream]
        nxt = addr + size
        if nxt in segs and segs[nxt][1] == stream:
            segs[addr][0] += segs.pop(nxt)[0]
        prev = [a for a, (n, st) in segs.items() if a + n == addr and st == stream]
        if prev:
            segs[prev[0]][0] += segs.pop(addr)[0]

    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        a = e["action"]
        here = f"event {i} ({a} {e.get('addr', 0):#x})"
        if a in ("free", "free_completed"):
            blocks[e["addr"]] = [e["size"], a == "free_completed", i]
            if holder(e["addr"]) is None:
                err(f"{here}: the block lies in no segment at that point (draw() throws)")
        elif a == "free_requested":
            if e["addr"] not in blocks:
                err(f"{here}: no block at this address at that point; the viewer throws "
                    f"(l_block_map[addr] is undefined) when an earlier event is selected")
            else:
                blocks[e["addr"]][1] = False
        elif a == "alloc":
            b = blocks.pop(e["addr"], None)
            if b is None:
                err(f"{here}: allocated here but neither active at the end nor freed later")
            elif b[1]:
                red.append((e["addr"], i, b[2]))
        elif a == "segment_free":
            if e["addr"] in segs:
                err(f"{here}: the segment is present at the end without a later segment_alloc")
            segs[e["addr"]] = [e["size"], e["stream"]]
        elif a == "segment_unmap":
            map_merged(e["addr"], e["size"], e["stream"])
        elif a == "segment_alloc":
            if e["addr"] not in segs:
                err(f"{here}: no segment at this address at that point; the viewer's findIndex "
                    f"gives -1 and it removes the last segment instead")
                continue
            if segs[e["addr"]][0] != e["size"]:
                err(f"{here}: size {e['size']} != the segment's {segs[e['addr']][0]}")
            n = segs.pop(e["addr"])[0]
            inside = blocks_in(e["addr"], n)
            if inside:
                err(f"{here}: blocks {[hex(x) for x in inside[:4]]} are live in the segment "
                    f"before it exists (draw() throws: block in no segment)")
        elif a == "segment_map":
            h = holder(e["addr"], e["size"])
            if h is None:
                err(f"{here}: no segment holds the mapped range at that point (the viewer "
                    f"throws)")
                continue
            n, stream = segs.pop(h)
            end, h_end = e["addr"] + e["size"], h + n
            if h < e["addr"]:
                segs[h] = [e["addr"] - h, stream]
            if end < h_end:
                segs[end] = [h_end - end, stream]
            inside = blocks_in(e["addr"], e["size"])
            if inside:
                err(f"{here}: blocks {[hex(x) for x in inside[:4]]} are live in the range "
                    f"before it is mapped (draw() throws: block in no segment)")
    for addr, b in blocks.items():
        if b[1] and b[2] is not None:
            red.append((addr, None, b[2]))
    return blocks, red


# ---------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot")
    ap.add_argument("outdir")
    ap.add_argument("--memviz-path", help="a _memory_viz.py (or its folder) to use instead of "
                    "torch.cuda._memory_viz (default: $TALLY_MEMVIZ_PATH)")
    ap.add_argument("--strict", action="store_true", help="treat warnings as failures")
    args = ap.parse_args(argv)

    try:
        mv, where = load_memory_viz(args.memviz_path)
    except Exception as e:  # noqa: BLE001
        print(f"check_memviz: cannot load _memory_viz: {e}", file=sys.stderr)
        return 2
    print(f"_memory_viz: {where}")
    try:
        raw = Path(args.snapshot).read_bytes()
        with open(args.snapshot, "rb") as f:
            data = pickle.load(f)  # as the CLI's _read()
    except Exception as e:  # noqa: BLE001
        print(f"check_memviz: cannot load {args.snapshot}: {e!r}", file=sys.stderr)
        return 2
    if not isinstance(data, dict) or "segments" not in data or "device_traces" not in data:
        print(f"check_memviz: {args.snapshot} is not a snapshot dict with segments and "
              f"device_traces", file=sys.stderr)
        return 2
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(args.strict)
    print(f"snapshot: {args.snapshot}: {len(raw):,} bytes, protocol {raw[1]}, "
          f"{len(data['segments'])} segments, "
          f"{sum(len(t) for t in data['device_traces'])} trace entries")
    if raw[:1] != b"\x80" or not 2 <= raw[1] <= 4:
        rep.fail(f"snapshot header {raw[:2].hex()}: the viewer reads pickle protocols 2-4 only")
    pristine = copy.deepcopy(data)

    def step(name, fn):
        """Runs one tool; a raise is a failure with its traceback's last line."""
        try:
            with NoDownload():
                return fn()
        except Exception as e:  # noqa: BLE001
            tb = traceback.extract_tb(e.__traceback__)[-1]
            rep.fail(f"{name} raised {type(e).__name__}: {e} "
                     f"({Path(tb.filename).name}:{tb.lineno})")
            return None
        finally:
            if data != pristine:
                rep.fail(f"{name} modified the snapshot dict it was given")
                data.clear()
                data.update(copy.deepcopy(pristine))

    def write(name, text, what, expect_nonempty=True):
        if text is None:
            return
        p = out / name
        p.write_text(text)
        if rep.output(p, what) <= 0 and expect_nonempty:
            rep.fail(f"{name}: empty output")

    # HTML views.
    html = step("trace_plot", lambda: mv.trace_plot(data))
    write("trace_plot.html", html, "trace_plot(data)")
    if html:
        check_html(rep, "trace_plot.html", html, data, VIEWER_VIEWS)
    html = step("trace_plot(plot_segments=True)", lambda: mv.trace_plot(data, plot_segments=True))
    write("trace_plot_segments.html", html, "trace_plot(data, plot_segments=True)")
    if html:
        check_html(rep, "trace_plot_segments.html", html, data, VIEWER_VIEWS | KNOWN_BAD_VIEWS)
    if "filter_freed" in inspect.signature(mv.trace_plot).parameters:
        # trace_plot(filter_freed=True) filters the dict it is given in place: give it a copy.
        mine = copy.deepcopy(data)
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink):
            html = step("trace_plot(filter_freed=True)",
                        lambda: mv.trace_plot(mine, filter_freed=True))
        write("trace_plot_filter_freed.html", html, "trace_plot(data, filter_freed=True)")
        if html:
            with contextlib.redirect_stdout(io.StringIO()):
                expected = mv.filter_alloc_free_pairs(copy.deepcopy(data)) \
                    if hasattr(mv, "filter_alloc_free_pairs") else mine
            check_html(rep, "trace_plot_filter_freed.html", html, expected, VIEWER_VIEWS)
    html = step("segment_plot", lambda: mv.segment_plot(data))
    write("segment_plot.html", html, "segment_plot(data)")
    if html:
        check_html(rep, "segment_plot.html", html, data, VIEWER_VIEWS)

    # Flame-graph lines, through a formatter that writes them instead of running flamegraph.pl.
    for fn_name, per_segment in (("segments", True), ("memory", False)):
        path = out / f"{fn_name}.folded"
        path.unlink(missing_ok=True)

        def formatter(lines, flamegraph_script=None, _path=path):
            """format_flamegraph's signature; writes the folded lines, returns them."""
            _path.write_text(lines)
            return lines

        def run(fn_name=fn_name, formatter=formatter):
            kw = flamegraph_formatter(mv, fn_name)
            return getattr(mv, fn_name)(data, **{kw: formatter})

        result = step(fn_name, run)
        if result is not None:
            if not path.exists():
                rep.fail(f"{fn_name}: the formatter was not called")
                continue
            text = path.read_text()
            if result != text:
                rep.fail(f"{fn_name}: did not return what the formatter returned")
            if rep.output(path, f"{fn_name}(data, format_flamegraph=<writer>)") <= 0:
                rep.fail(f"{path.name}: empty output")
            check_folded(rep, path.name, text, data, per_segment)

    # compare() takes segment lists (a dict snapshot breaks it): the snapshot against itself.
    folded = {}
    sink = io.StringIO()

    def compare_self():
        def formatter(lines, flamegraph_script=None):
            folded["text"] = lines
            return lines
        with contextlib.redirect_stdout(sink):
            return mv.compare(data["segments"], data["segments"],
                              **{flamegraph_formatter(mv, "compare"): formatter})

    if step("compare", compare_self) is not None:
        write("compare.folded", folded.get("text", ""),
              "compare(segments, segments, format_flamegraph=<writer>)", expect_nonempty=False)
        if folded.get("text"):
            rep.fail("compare.folded: a snapshot compared with itself has differences")
        if "only_before = []" not in sink.getvalue() or "only_after = []" not in sink.getvalue():
            rep.fail(f"compare: unexpected report {sink.getvalue()!r}")

    text = step("segsum (stats)", lambda: mv.segsum(data))
    write("stats.txt", text, "segsum(data) (CLI stats)")
    if text:
        check_stats(rep, mv, text, data)
    text = step("trace", lambda: mv.trace(data))
    write("trace.txt", text, "trace(data) (CLI trace)",
          expect_nonempty=any(data["device_traces"]))
    if text is not None:
        check_trace_text(rep, text, data)

    # Replays.
    if viewer_pitfalls(rep, data):
        try:
            replays(rep, mv, data)
        except Exception as e:  # noqa: BLE001
            tb = traceback.extract_tb(e.__traceback__)[-1]
            rep.fail(f"replay raised {type(e).__name__}: {e} (line {tb.lineno}); the snapshot "
                     f"is malformed")
    else:
        print("replays skipped: malformed trace entries")

    if rep.errors:
        print(f"check_memviz: FAILED {args.snapshot}: {len(rep.errors)} failures, "
              f"{len(rep.warnings)} warnings (outputs in {out})")
        return 1
    print(f"check_memviz: OK {args.snapshot}: {len(rep.warnings)} warnings (outputs in {out})")
    return 0


def replays(rep, mv, data):
    """The forward, filter_alloc_free_pairs and backward replays of every device, compared."""
    for device, trace in enumerate(data["device_traces"]):
        has_segments = any(s["device"] == device for s in data["segments"])
        if not trace and not has_segments:
            continue
        live, initially, untraced, truncated = replay_forward(rep, device, trace, data)
        ghosts = {a: b for a, b in untraced.items() if b["state"] == "active_allocated"}
        filt = None
        try:
            filt = replay_filter_freed(rep, mv, device, data, live)
        except Exception as e:  # noqa: BLE001
            rep.fail(f"device {device}: _memory_viz.filter_alloc_free_pairs raised "
                     f"{type(e).__name__}: {e}")
        before, red = replay_backward(rep, device, trace, data)
        want_before = set(untraced) | set(initially)
        got_before = set(before)
        for addr in sorted(got_before ^ want_before)[:MAX_LISTED]:
            rep.fail(f"device {device}: block {addr:#x} is "
                     f"{'live' if addr in got_before else 'not live'} before the first event in "
                     f"the backward replay but "
                     f"{'not ' if addr not in want_before else ''}in the forward replay's "
                     f"initial state (untraced active blocks + initially allocated)")
        if ghosts and not truncated:
            rep.warn(f"device {device}: {len(ghosts)} active_allocated blocks have no alloc in a "
                     f"trace with no sign of truncation (drawn as ghosts from time 0), e.g. "
                     f"{min(ghosts):#x}")
        for addr, frm, to in red[:MAX_LISTED]:
            span = "while events " + (f"{frm}" if frm is not None else "0") + ".." + \
                (f"{to - 1}" if to is not None else "(last)") + " are selected"
            rep.warn(f"device {device}: Allocator State History draws live block {addr:#x} as "
                     f"'freed but waiting due to record_stream' (red) {span} (the viewer's "
                     f"event list numbering): no free_requested precedes its free_completed")
        if len(red) > MAX_LISTED:
            rep.warn(f"device {device}: ... {len(red) - MAX_LISTED} more such blocks")
        live_bytes = {}
        for _, e in live.values():
            c = e.get("category", "-")
            live_bytes[c] = live_bytes.get(c, 0) + e["size"]
        for b in ghosts.values():
            live_bytes["(ghost)"] = live_bytes.get("(ghost)", 0) + b["requested_size"]
        blocks = active_blocks(data, device)
        print(f"replay device {device}: {len(trace)} events; timeline ends with {len(live)} live "
              f"allocations + {len(ghosts)} ghosts, {len(initially)} initially allocated; "
              f"snapshot has {sum(b['state'] == 'active_allocated' for b in blocks.values())} "
              f"active_allocated + "
              f"{sum(b['state'] == 'active_pending_free' for b in blocks.values())} pending-free "
              f"blocks; state history before event 0: {len(before)} blocks")
        if filt is not None:
            kept, printed = filt
            print(f"  filter_alloc_free_pairs keeps {len(kept)} unfreed allocs"
                  + (f"; it printed {len(printed)} 'free_completed without free_requested'"
                     if printed else ""))
        print("  live requested bytes by category: "
              + ", ".join(f"{k}={v:,}" for k, v in sorted(live_bytes.items())))


if __name__ == "__main__":
    sys.exit(main())
