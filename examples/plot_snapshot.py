#!/usr/bin/env python3
"""Plot a Tally memory snapshot as a stacked area chart of live allocated bytes by category.

Usage: plot_snapshot.py SNAPSHOT.pickle OUT.svg [--title TEXT] [--device N]
                        [--x {auto,time,index}] [--width PX] [--height PX]

Reads a snapshot pickle in PyTorch's memory_viz format (docs/memory-formats.md §1, with
Tally's `category` / `user_metadata` extensions of §7) and writes one self-contained SVG
(no scripts, no external references): live allocated bytes per category over the trace,
stacked, in MiB; a legend with each category's colour and peak; axes with ticks; a title
with the peak allocated MiB; and light phase bands (init/data/forward/backward/optimizer,
from `user_metadata` "phase=…") along the top when the trace carries phases.

Replay, as PyTorch's viewer does (torch/utils/viz/process_alloc_data.js):
  * `alloc` makes an address live with its `size` (the un-rounded request) and category;
    `free_completed` ends it; every other action leaves the live bytes unchanged;
  * a `free_completed` with no earlier `alloc` at that address was allocated before the
    trace window: it is live from the start until that free;
  * an `active_allocated` block in `segments` that the replay does not end with is live
    for the whole trace (size = its requested_size, as the viewer's "ghost" blocks); its
    category is the block's `category` key, else the "category=…" frame Tally writes,
    else `unknown`;
  * a re-tag (a live block changing category) is written as `free_requested` +
    `free_completed` + `alloc` at the same address, size and time (older snapshots: the
    last two only): it is replayed as one step, so the total does not dip.
Sizes are requested bytes, as in memory_viz's Active Memory Timeline; the allocator's
"Allocated memory" stat counts rounded block sizes and can be slightly higher (its
"Requested memory" peak is the one that matches the title).

The x axis is time in ms since the first event, or the allocator event number (alloc and
free_completed events, a re-tag counting once) when many events share a timestamp, as in
fast CPU traces; --x forces one. Phases come from `alloc` events (a free carries the tag
of its allocation, not the phase it happens in); when a long trace has too many phase
runs to read, the phase bands are left out.

Categories and phases keep the colours of every Tally page (the A/B report, the timeline and
diff pages): memory::category_color (memory/category.cpp) and inspect::phase_color
(inspect/svg_chart.cpp); tests/memory/test_plot_snapshot.py checks that the tables below equal
those. An unknown category name gets a grey. Only categories with bytes appear in the chart and
legend. Ticks fall on 1, 2 or 5 times a power of ten (MiB, or GiB from a 1 GiB peak).

Exit status: 0 written; 2 bad arguments or a file that is not a readable snapshot (the
message names the file). Python 3 standard library only.
"""

import argparse
import math
import os
import pickle
import re
import sys
import tempfile
from xml.sax.saxutils import escape

# Stack order, bottom to top: long-lived state first, then the per-step input (flat
# through a step), then activations, then short-lived memory on top.
CATEGORIES = (
    "parameter", "gradient", "optimizer_state", "input", "activation", "temporary",
    "workspace", "autocast_cache", "communication", "offloaded", "unknown",
)
# memory::category_color (memory/category.cpp): one palette on every Tally page.
COLOURS = {
    "parameter": "#1f77b4",
    "gradient": "#ff7f0e",
    "optimizer_state": "#2ca02c",
    "activation": "#d62728",
    "input": "#9467bd",
    "temporary": "#8c564b",
    "workspace": "#e377c2",
    "autocast_cache": "#bcbd22",
    "communication": "#17becf",
    "offloaded": "#c7c7c7",
    "unknown": "#7f7f7f",
}
EXTRA_COLOURS = ("#555555", "#999999", "#444444", "#aaaaaa")
# inspect::phase_color (inspect/svg_chart.cpp).
PHASE_COLOURS = {
    "forward": "#c6dbef",
    "backward": "#fdd0a2",
    "optimizer": "#c7e9c0",
    "recompute": "#e7a9c8",
    "data": "#dadaeb",
}
PHASE_OTHER = "#e5e5e5"  # init and any other phase
PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt", "recompute": "rcp", "init": "init",
               "data": "data"}

MIB = 1024.0 * 1024.0
FONT = "Helvetica, Arial, 'DejaVu Sans', sans-serif"
MAX_SAMPLES = 4000  # beyond this, samples are thinned per pixel column (peaks kept)


class SnapshotError(Exception):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Snapshots hold only dicts, lists, str, int, float, bool, tuples: refuse classes."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load class {module}.{name}")


def load_snapshot(path):
    try:
        with open(path, "rb") as f:
            data = _PlainUnpickler(f).load()
    except OSError as e:
        raise SnapshotError(f"cannot read: {e.strerror or e}")
    except Exception as e:  # pickle raises many types on garbage input
        raise SnapshotError(f"not a snapshot pickle ({type(e).__name__}: {e})")
    if not isinstance(data, dict):
        raise SnapshotError(f"not a snapshot: top level is {type(data).__name__}, expected a dict "
                            "with 'segments' and 'device_traces'")
    for key in ("segments", "device_traces"):
        if key not in data:
            raise SnapshotError(f"not a snapshot: missing key '{key}'")
        if not isinstance(data[key], list):
            raise SnapshotError(f"'{key}' is {type(data[key]).__name__}, expected a list")
    for d, trace in enumerate(data["device_traces"]):
        if not isinstance(trace, list):
            raise SnapshotError(f"device_traces[{d}] is {type(trace).__name__}, expected a list")
        for i, e in enumerate(trace):
            if not isinstance(e, dict) or "action" not in e:
                raise SnapshotError(f"device_traces[{d}][{i}] is not a trace entry (no 'action')")
            if e["action"] in ("alloc", "free_completed"):
                for key in ("addr", "size"):
                    if not isinstance(e.get(key), int):
                        raise SnapshotError(f"device_traces[{d}][{i}] ({e['action']}) lacks an "
                                            f"integer '{key}'")
    for s, seg in enumerate(data["segments"]):
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks", []), list):
            raise SnapshotError(f"segments[{s}] is not a segment dict")
    return data


# --- replay -----------------------------------------------------------------------------

_META_RE = re.compile(r"(?:^|\s)(\w+)=(\S*)")


def metadata(entry):
    um = entry.get("user_metadata")
    if isinstance(um, dict):
        return {str(k): str(v) for k, v in um.items()}
    if isinstance(um, str):
        return dict(_META_RE.findall(um))
    return {}


def entry_category(entry):
    cat = entry.get("category")
    if isinstance(cat, str) and cat:
        return cat
    return metadata(entry).get("category") or "unknown"


def block_category(block):
    cat = block.get("category")
    if isinstance(cat, str) and cat:
        return cat
    for fr in block.get("frames") or []:
        fn = fr.get("filename", "") if isinstance(fr, dict) else ""
        if isinstance(fn, str) and fn.startswith("category="):
            return fn[len("category="):] or "unknown"
    return "unknown"


def block_address(seg, idx):
    b = seg["blocks"][idx]
    if "address" in b:
        return b["address"]
    # Legacy snapshots: blocks tile the segment in order.
    return seg.get("address", 0) + sum(x.get("size", 0) for x in seg["blocks"][:idx])


class Replay:
    """Samples of live bytes per category: samples[k] holds after event k (x = xs[k])."""

    def __init__(self):
        self.categories = []   # in first-seen order
        self.initial = {}      # category -> bytes live before the first event
        self.times = []        # time_us per sample (None when absent)
        self.states = []       # dict category -> bytes, after the sample's event(s)
        self.phases = []       # phase of the sample ('' when unknown)
        self.peak = 0
        self.peak_index = -1   # -1: the initial state
        self.n_events = 0      # alloc/free_completed entries replayed
        self.n_retags = 0


def replay(snapshot, device):
    trace = snapshot["device_traces"][device] if device < len(snapshot["device_traces"]) else []
    r = Replay()
    events = [e for e in trace if e["action"] in ("alloc", "free_completed")]
    r.n_events = len(events)

    def see(cat):
        if cat not in r.categories:
            r.categories.append(cat)

    # Pass 1, as the viewer: a free_completed with no alloc of its address before it was
    # live from the start.
    live_addrs = set()
    initial_free = set()
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live_addrs.add(e["addr"])
        elif e["addr"] in live_addrs:
            live_addrs.discard(e["addr"])
        else:
            initial_free.add(i)
    initial = {}
    for i in initial_free:
        cat = entry_category(events[i])
        initial[cat] = initial.get(cat, 0) + events[i]["size"]
    # Active blocks the trace does not end with: live throughout ("ghost" blocks).
    for seg in snapshot["segments"]:
        if seg.get("device", 0) != device:
            continue
        for j, b in enumerate(seg.get("blocks", [])):
            if b.get("state") != "active_allocated":
                continue
            if block_address(seg, j) in live_addrs:
                continue
            size = b.get("requested_size")
            if not isinstance(size, int) or size <= 0:
                size = b.get("size", 0)
            cat = block_category(b)
            initial[cat] = initial.get(cat, 0) + size
    r.initial = dict(initial)
    for cat in initial:
        see(cat)

    # Pass 2: replay.
    state = dict(initial)
    live = {}  # addr -> (size, category)
    requested = set()  # addresses with a free_requested since their alloc
    total = sum(state.values())
    r.peak = total
    phase = ""
    ev_index = -1  # index into `events` of the entry being replayed
    skip_next = False
    retag_at = set()  # indices of free_completed entries that begin a re-tag
    for t, e in enumerate(trace):
        action = e["action"]
        if action == "free_requested":
            # A re-tag as Tally writes it: free_requested + free_completed + alloc at the
            # same address, size and time. Replayed as one step (no dip).
            if (e.get("addr") in live and t + 2 < len(trace)
                    and trace[t + 1]["action"] == "free_completed"
                    and trace[t + 2]["action"] == "alloc"
                    and all(trace[t + k].get("addr") == e.get("addr")
                            and trace[t + k].get("size") == e.get("size")
                            and trace[t + k].get("time_us") == e.get("time_us") for k in (1, 2))):
                retag_at.add(t + 1)
                continue
            requested.add(e.get("addr"))
            continue
        if action not in ("alloc", "free_completed"):
            continue
        ev_index += 1
        if skip_next:  # the alloc half of a re-tag, already replayed
            skip_next = False
            continue
        group = [(ev_index, e)]
        # A re-tag: a free_completed that no free_requested announced, followed at once by
        # an alloc at the same address, size and time. Replayed as one step.
        if action == "free_completed" and e["addr"] in live \
                and (e["addr"] not in requested or t in retag_at) and t + 1 < len(trace):
            nxt = trace[t + 1]
            if (nxt["action"] == "alloc" and nxt["addr"] == e["addr"] and nxt["size"] == e["size"]
                    and nxt.get("time_us") == e.get("time_us")):
                group.append((ev_index + 1, nxt))
                skip_next = True
                r.n_retags += 1
        for idx, g in group:
            if g["action"] == "alloc":
                requested.discard(g["addr"])
                old = live.pop(g["addr"], None)
                if old is not None:  # alloc over a live address: the old block is gone
                    state[old[1]] -= old[0]
                    total -= old[0]
                cat = entry_category(g)
                see(cat)
                live[g["addr"]] = (g["size"], cat)
                state[cat] = state.get(cat, 0) + g["size"]
                total += g["size"]
                p = metadata(g).get("phase", "")
                if p:
                    phase = p
            else:
                requested.discard(g["addr"])
                if g["addr"] in live:
                    size, cat = live.pop(g["addr"])
                elif idx in initial_free:
                    size, cat = g["size"], entry_category(g)
                else:  # cannot happen: pass 1 found every unmatched free
                    size, cat = 0, "unknown"
                state[cat] = state.get(cat, 0) - size
                total -= size
        # No peak hides inside a re-tag: it frees, then allocates the same size.
        if total > r.peak:
            r.peak = total
            r.peak_index = len(r.states)
        r.times.append(group[-1][1].get("time_us"))
        r.states.append(dict(state))
        r.phases.append(phase)
    return r


def choose_device(snapshot, wanted):
    traces = snapshot["device_traces"]
    if wanted is not None:
        return wanted
    for d, trace in enumerate(traces):
        if any(e["action"] in ("alloc", "free_completed") for e in trace):
            return d
    for seg in snapshot["segments"]:
        if any(b.get("state") == "active_allocated" for b in seg.get("blocks", [])):
            return seg.get("device", 0)
    return 0


def choose_x(r, mode):
    """Returns ('time'|'index', reason)."""
    times = r.times
    have_times = bool(times) and all(isinstance(t, int) for t in times)
    if mode == "time":
        if not have_times:
            raise SnapshotError("--x time: trace entries lack integer 'time_us'")
        return "time", "time"
    if mode == "index":
        return "index", "event number"
    if not have_times:
        return "index", "no timestamps"
    if len(times) < 2 or times[-1] == times[0]:
        return "index", "all events share one timestamp"
    shared = sum(1 for a, b in zip(times, times[1:]) if a == b)
    frac = shared / (len(times) - 1)
    if frac > 0.2:
        return "index", f"{frac:.0%} of events share a timestamp"
    return "time", "time"


# --- drawing helpers ----------------------------------------------------------------------

def text_width(s, size):
    """Rough advance width of s in px (DejaVu Sans, the widest common fallback)."""
    w = 0.0
    for ch in s:
        if ch in "il.,:;|!'":
            w += 0.32
        elif ch in "fjrt ()[]-":
            w += 0.42
        elif ch in "mwMW":
            w += 0.92
        elif ch.isupper() or ch in "_%&":
            w += 0.72
        else:
            w += 0.62
    return w * size


def nice_step(span, target):
    """1, 2 or 5 times a power of ten: about `target` intervals over `span` (as TallyChart's)."""
    if span <= 0:
        return 1.0
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag * (1 + 1e-9):
            return m * mag
    return 10 * mag


def fmt_num(v, step):
    decimals = 0 if step >= 1 else min(6, int(math.ceil(-math.log10(step) - 1e-9)))
    if step < 1 and abs(step * 10 ** decimals - round(step * 10 ** decimals)) > 1e-6:
        decimals += 1
    s = f"{v:,.{decimals}f}"
    return "0" if s.strip("-0.,") == "" else s


def fmt_mib(b):
    mib = b / MIB
    if mib >= 1:
        return f"{mib:,.1f}"
    if mib >= 0.01:
        return f"{mib:.2f}"
    return f"{b / 1024:.1f} KiB"


def thin(indices_count, xs, totals, columns):
    """Keep, per pixel column, the first, last, min and max-total samples."""
    if indices_count <= MAX_SAMPLES:
        return list(range(indices_count))
    x0, x1 = xs[0], xs[-1]
    span = (x1 - x0) or 1.0
    keep = []
    bucket = None
    members = []

    def flush():
        if not members:
            return
        lo = min(members, key=lambda k: totals[k])
        hi = max(members, key=lambda k: totals[k])
        keep.extend(sorted({members[0], lo, hi, members[-1]}))

    for k in range(indices_count):
        b = int((xs[k] - x0) / span * columns)
        if b != bucket:
            flush()
            members = []
            bucket = b
        members.append(k)
    flush()
    return keep


def simplify(points):
    """Drop points lying on a horizontal or vertical line through both neighbours."""
    out = []
    for p in points:
        if out and p == out[-1]:
            continue
        while len(out) >= 2:
            a, b = out[-2], out[-1]
            if (a[0] == b[0] == p[0]) or (a[1] == b[1] == p[1]):
                out.pop()
            else:
                break
        out.append(p)
    return out


class Svg:
    def __init__(self, width, height):
        self.w, self.h = width, height
        self.parts = []

    def add(self, s):
        self.parts.append(s)

    def text(self, x, y, s, size=12, anchor="start", fill="#222", weight=None, extra=""):
        w = f' font-weight="{weight}"' if weight else ""
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                 f'fill="{fill}"{w}{extra}>{escape(s)}</text>')

    def render(self, title):
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
                f'viewBox="0 0 {self.w} {self.h}" font-family="{escape(FONT)}">\n'
                f'<title>{escape(title)}</title>\n'
                f'<rect x="0" y="0" width="{self.w}" height="{self.h}" fill="#ffffff"/>\n')
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + head + "\n".join(self.parts) + "\n</svg>\n"


def plot(r, x_mode, x_reason, title, device, width, height):
    order = [c for c in CATEGORIES if c in r.categories] + \
            [c for c in r.categories if c not in CATEGORIES]
    extra_i = 0
    colours = {}
    for c in order:
        if c in COLOURS:
            colours[c] = COLOURS[c]
        else:
            colours[c] = EXTRA_COLOURS[extra_i % len(EXTRA_COLOURS)]
            extra_i += 1

    # Per-category peaks; only categories that ever hold bytes are drawn.
    cat_peak = {c: r.initial.get(c, 0) for c in order}
    for st in r.states:
        for c, v in st.items():
            if v > cat_peak.get(c, 0):
                cat_peak[c] = v
    shown = [c for c in order if cat_peak.get(c, 0) > 0]

    n = len(r.states)
    # x of each sample's event, and the x range.
    if x_mode == "time":
        t0 = r.times[0]
        xs = [(t - t0) / 1000.0 for t in r.times]
        span = xs[-1] if n else 0.0
        x_max = span * 1.02 if span > 0 else 1.0
        x_label = "Time since first event (ms)"
    else:
        xs = [float(k) for k in range(n)]
        x_max = float(max(n, 1))
        x_label = "Allocator event number (alloc or free)"
        if x_reason not in ("event number", "time"):
            x_label += f" · {x_reason}"

    # Layout.
    pad_l, pad_r = 78, 24
    legend_w = 200
    top = 72
    plot_l = pad_l
    plot_r = width - pad_r - legend_w
    pw = plot_r - plot_l
    # Phase runs: equal phase in a row, a sample's run spanning [x_k, x_{k+1}). Shown only
    # when there are few enough to read (a long trace of many steps would be a barcode).
    runs = []
    cur, start = None, 0.0
    for k in range(n):
        p = r.phases[k] or (cur or "")
        if p != cur:
            if cur:
                runs.append((cur, start, xs[k]))
            cur, start = p, xs[k]
    if cur:
        runs.append((cur, start, x_max))
    if len(runs) > pw / 12:
        runs = []
    has_phases = bool(runs)
    strip_h = 20 if has_phases else 0
    plot_t = top + strip_h + (6 if has_phases else 0)
    plot_b = height - 62
    ph = plot_b - plot_t

    peak_mib = r.peak / MIB
    # The y axis in MiB, or GiB from a 1 GiB peak; Y() takes MiB either way.
    y_unit, y_div = ("GiB", 1024.0) if peak_mib >= 1024 else ("MiB", 1.0)
    peak_u = peak_mib / y_div
    y_step = nice_step(peak_u if peak_u > 0 else 1.0, 6)
    y_max = (max(y_step, math.ceil((peak_u * 1.04) / y_step) * y_step) if peak_u > 0 else y_step) * y_div

    def X(x):
        return plot_l + (x / x_max) * pw

    def Y(mib):
        return plot_b - (mib / y_max) * ph

    # Title.
    full_title = (title + " — " if title else "") + f"peak allocated {peak_mib:,.1f} MiB"
    svg = Svg(width, height)
    svg.text(plot_l, 30, full_title, size=18, weight="bold", fill="#111")
    where = "before the first event" if r.peak_index < 0 else (
        f"at {xs[r.peak_index]:,.3f} ms" if x_mode == "time" else f"at event {r.peak_index + 1:,}")
    sub = (f"device {device} · {r.n_events:,} alloc/free events"
           + (f" · {r.n_retags:,} re-tag{'s' if r.n_retags != 1 else ''}" if r.n_retags else "")
           + f" · requested bytes, as memory_viz · peak {where}")
    svg.text(plot_l, 52, sub, size=12, fill="#555")

    band_y = top
    svg.add('<g id="phases">')
    for name, a, b in runs:
        xa, xb = X(a), X(b)
        colour = PHASE_COLOURS.get(name, PHASE_OTHER)
        svg.add(f'<rect x="{xa:.1f}" y="{plot_t:.1f}" width="{max(xb - xa, 0.5):.1f}" '
                f'height="{ph:.1f}" fill="{colour}" fill-opacity="0.45"/>')
        svg.add(f'<rect x="{xa:.1f}" y="{band_y:.1f}" width="{max(xb - xa, 0.5):.1f}" '
                f'height="{strip_h}" fill="{colour}"/>')
    # Labels: full name if it fits, else a short one, else none.
    for name, a, b in runs:
        xa, xb = X(a), X(b)
        for label in (name, PHASE_SHORT.get(name, name[:3])):
            if text_width(label, 11) + 6 <= xb - xa:
                svg.text((xa + xb) / 2, band_y + 14, label, size=11, anchor="middle", fill="#333")
                break
    if runs:
        svg.text(plot_l - 8, band_y + 14, "phase", size=11, anchor="end", fill="#555")
        # Boundaries, drawn over the bands so neighbouring runs of one colour stay apart.
        for name, a, b in runs[1:]:
            svg.add(f'<line x1="{X(a):.1f}" y1="{band_y:.1f}" x2="{X(a):.1f}" '
                    f'y2="{band_y + strip_h:.1f}" stroke="#ffffff" stroke-width="1"/>')
    svg.add("</g>")

    # Grid and y ticks.
    svg.add('<g id="y-axis">')
    k = 0
    while True:
        v = k * y_step
        if v * y_div > y_max + 1e-9:
            break
        y = Y(v * y_div)
        svg.add(f'<line x1="{plot_l}" y1="{y:.1f}" x2="{plot_r}" y2="{y:.1f}" '
                f'stroke="{"#888" if k == 0 else "#dddddd"}" stroke-width="1"/>')
        svg.text(plot_l - 7, y + 4, fmt_num(v, y_step), size=12, anchor="end", fill="#333",
                 extra=' class="ytick"')
        k += 1
    cy = (plot_t + plot_b) / 2
    svg.add(f'<text x="20" y="{cy:.1f}" font-size="13" text-anchor="middle" fill="#333" '
            f'transform="rotate(-90 20 {cy:.1f})">Allocated ({y_unit})</text>')
    svg.add("</g>")

    # Areas: one polygon per shown category, stacked in `order`.
    totals = [sum(st.get(c, 0) for c in shown) for st in r.states]
    keep = thin(n, xs, totals, int(pw))
    svg.add('<g id="areas">')
    base_init = 0
    base = [0] * len(keep)
    for c in shown:
        init_lo = base_init
        init_hi = base_init + r.initial.get(c, 0)
        up_vals = [base[j] + r.states[keep[j]].get(c, 0) for j in range(len(keep))]
        # Staircase: value before the first event (initial) from x=0, then each sample from
        # its x to the next kept sample's x (the last one to x_max).
        def boundary(v0, vals):
            pts = [(X(0.0), Y(v0 / MIB))]
            for j, kk in enumerate(keep):
                x = X(xs[kk])
                pts.append((x, pts[-1][1]))
                pts.append((x, Y(vals[j] / MIB)))
            pts.append((X(x_max), pts[-1][1]))
            return [(round(px, 1), round(py, 1)) for px, py in pts]
        top_pts = simplify(boundary(init_hi, up_vals))
        bot_pts = simplify(boundary(init_lo, base))
        poly = top_pts + list(reversed(bot_pts))
        pts = " ".join(f"{px:g},{py:g}" for px, py in poly)
        svg.add(f'<polygon data-category="{escape(c)}" fill="{colours[c]}" points="{pts}">'
                f'<title>{escape(c)}: peak {fmt_mib(cat_peak[c])} MiB</title></polygon>')
        base = up_vals
        base_init = init_hi
    svg.add("</g>")

    # Peak marker: a dashed line at the peak's x with a small label in the strip's margin.
    if r.peak > 0:
        px = X(xs[r.peak_index]) if r.peak_index >= 0 else X(0.0)
        py = Y(peak_mib)
        svg.add(f'<line x1="{px:.1f}" y1="{py:.1f}" x2="{px:.1f}" y2="{plot_b:.1f}" stroke="#111" '
                f'stroke-width="1" stroke-dasharray="3,3" stroke-opacity="0.7"/>')
        svg.add(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="#111"/>')
        label = f"peak {peak_mib:,.1f} MiB"
        lw = text_width(label, 11)
        anchor, lx = ("start", px + 6) if px + 6 + lw <= plot_r else ("end", px - 6)
        ly = py - 6 if py - 6 - 11 >= plot_t else py + 15
        svg.add(f'<text x="{lx:.1f}" y="{ly:.1f}" font-size="11" text-anchor="{anchor}" fill="#111" '
                f'stroke="#ffffff" stroke-width="3" stroke-linejoin="round" paint-order="stroke">'
                f'{escape(label)}</text>')

    # X axis: ticks spaced so labels never touch.
    svg.add('<g id="x-axis">')
    svg.add(f'<line x1="{plot_l}" y1="{plot_b}" x2="{plot_r}" y2="{plot_b}" stroke="#888"/>')
    target = 8
    while True:
        x_step = nice_step(x_max, target)
        if x_mode == "index":
            x_step = max(1.0, round(x_step))
        labels = []
        v = 0.0
        while v <= x_max * (1 + 1e-9):
            labels.append((v, fmt_num(v, x_step)))
            v += x_step
        widest = max(text_width(s, 12) for _, s in labels)
        if target <= 2 or (x_step / x_max) * pw >= widest + 16:
            break
        target -= 1
    for v, s in labels:
        x = X(v)
        svg.add(f'<line x1="{x:.1f}" y1="{plot_b}" x2="{x:.1f}" y2="{plot_b + 5}" stroke="#888"/>')
        svg.text(x, plot_b + 19, s, size=12, anchor="middle", fill="#333", extra=' class="xtick"')
    svg.text((plot_l + plot_r) / 2, plot_b + 44, x_label, size=13, anchor="middle", fill="#333")
    svg.add("</g>")

    # Plot frame (left axis line).
    svg.add(f'<line x1="{plot_l}" y1="{plot_t}" x2="{plot_l}" y2="{plot_b}" stroke="#888"/>')

    # Legend: top of the stack first, with each category's peak.
    lx = plot_r + 22
    svg.add('<g id="legend">')
    svg.text(lx, plot_t + 12, "category", size=12, weight="bold", fill="#333")
    svg.text(width - pad_r, plot_t + 12, "peak MiB", size=12, anchor="end", weight="bold", fill="#333")
    y = plot_t + 24
    for c in reversed(shown):
        svg.add(f'<rect x="{lx}" y="{y + 4}" width="14" height="14" fill="{colours[c]}" '
                f'stroke="#00000033" stroke-width="0.5"/>')
        svg.add(f'<text class="legend-label" x="{lx + 20}" y="{y + 16}" font-size="13" fill="#222">'
                f'{escape(c)}</text>')
        svg.text(width - pad_r, y + 16, fmt_mib(cat_peak[c]), size=12, anchor="end", fill="#444")
        y += 22
    if not shown:
        svg.text(lx, y + 16, "(no allocations)", size=12, fill="#777")
    if runs:
        y += 14
        svg.text(lx, y + 12, "phase", size=12, weight="bold", fill="#333")
        y += 18
        seen = []
        for name, _, _ in runs:
            if name not in seen:
                seen.append(name)
        for name in seen:
            svg.add(f'<rect x="{lx}" y="{y + 2}" width="14" height="14" '
                    f'fill="{PHASE_COLOURS.get(name, PHASE_OTHER)}" stroke="#00000022" stroke-width="0.5"/>')
            svg.text(lx + 20, y + 14, name, size=12, fill="#444")
            y += 20
    svg.add("</g>")

    if n == 0 and r.peak == 0:
        svg.text((plot_l + plot_r) / 2, cy, "no allocations in this trace", size=14,
                 anchor="middle", fill="#777")
    return svg.render(full_title)


def write_atomic(path, text):
    """Writes `text` to `path` through a temporary file in the same folder, fsync'ed and renamed
    into place (as Tally's C++ writers do, base/atomic_file.h): a write cut short leaves the
    previous file intact. The replacement keeps the old file's permission bits; a target that is
    not a regular file (/dev/stdout, a FIFO) is written in place."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="plot_snapshot.py",
        description="Stacked area chart (SVG) of live allocated bytes by category in a memory snapshot.")
    ap.add_argument("snapshot", help="snapshot pickle (memory_demo --snapshot FILE)")
    ap.add_argument("out", help="SVG file to write")
    ap.add_argument("--title", default=None, help="chart title (default: the snapshot's file name)")
    ap.add_argument("--device", type=int, default=None,
                    help="device ordinal (default: the first with allocations)")
    ap.add_argument("--x", choices=("auto", "time", "index"), default="auto",
                    help="x axis: time in ms, allocator event number, or auto (event number when "
                         "many events share a timestamp)")
    ap.add_argument("--width", type=int, default=960)
    ap.add_argument("--height", type=int, default=540)
    args = ap.parse_args(argv)
    if args.width < 600 or args.height < 320:
        ap.error("--width must be >= 600 and --height >= 320")

    prog = "plot_snapshot.py"
    try:
        snap = load_snapshot(args.snapshot)
        device = choose_device(snap, args.device)
        if device < 0 or (device >= len(snap["device_traces"])
                          and not any(s.get("device", 0) == device for s in snap["segments"])):
            raise SnapshotError(f"no device {device} in the snapshot "
                                f"({len(snap['device_traces'])} device traces)")
        r = replay(snap, device)
        x_mode, reason = choose_x(r, args.x)
    except SnapshotError as e:
        print(f"{prog}: error: {args.snapshot}: {e}", file=sys.stderr)
        return 2
    title = args.title if args.title is not None else os.path.basename(args.snapshot)
    svg = plot(r, x_mode, reason, title, device, args.width, args.height)
    try:
        write_atomic(args.out, svg)
    except OSError as e:
        print(f"{prog}: error: {args.out}: cannot write: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (device {device}, peak {r.peak / MIB:,.1f} MiB, "
          f"{len(r.states)} samples, x = {'time' if x_mode == 'time' else 'event number'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
