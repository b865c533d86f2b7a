#!/usr/bin/env python3
"""Quick self-check of examples/plot_snapshot.py.

Usage: python3 tests/memory/test_plot_snapshot.py BUILD_DIR

Runs BUILD_DIR/examples/memory_demo (--device cpu, default --steps) into a temp dir, plots
its snapshot and checks the SVG: it parses with xml.etree; it holds exactly one
<polygon>/<path> per category that ever holds bytes, each filled with the colour of its
legend swatch; the legend names exactly those categories; the title's peak matches an
independent replay of the trace. Then checks a small hand-made snapshot (a block live
before the trace, a free with no alloc, a re-tag written as free_requested + free_completed + alloc) and
that bad input (not a pickle, a missing key) exits 2 with a message naming the file. Checks
that the script's palette is Tally's one palette: its category colours equal
memory::category_color's table (memory/category.cpp) and its phase colours
inspect::phase_color's (inspect/svg_chart.cpp), read from the C++ sources; and that every tick
falls on 1, 2 or 5 times a power of ten.

Exit 0 when all checks pass, 1 on a failure, 2 on bad usage. Stdlib only.
"""

import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "plot_snapshot.py")
SVG_NS = "{http://www.w3.org/2000/svg}"
MIB = 1024.0 * 1024.0

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def plot(snapshot, out, *extra):
    return subprocess.run([sys.executable, SCRIPT, snapshot, out, *extra],
                          capture_output=True, text=True, timeout=120)


def parse_svg(path):
    """Returns (areas {category: fill}, legend [(name, swatch fill)], title text)."""
    root = ET.parse(path).getroot()
    check(root.tag == SVG_NS + "svg", f"{path}: root element is {root.tag}, not svg")
    for el in root.iter():
        for attr in ("href", "{http://www.w3.org/1999/xlink}href", "src"):
            check(attr not in el.attrib, f"{path}: external reference {el.attrib.get(attr)!r}")
        check(el.tag not in (SVG_NS + "script", SVG_NS + "image", SVG_NS + "foreignObject"),
              f"{path}: unexpected <{el.tag}>")
    shapes = [el for el in root.iter() if el.tag in (SVG_NS + "polygon", SVG_NS + "path")]
    areas = {}
    for el in shapes:
        cat = el.get("data-category")
        check(cat is not None, f"{path}: a {el.tag} without data-category")
        check(cat not in areas, f"{path}: two areas for category {cat}")
        areas[cat] = el.get("fill")
    legend_g = [g for g in root.iter(SVG_NS + "g") if g.get("id") == "legend"]
    legend = []
    if check(len(legend_g) == 1, f"{path}: no legend group"):
        children = list(legend_g[0])
        for i, el in enumerate(children):
            if el.tag == SVG_NS + "text" and el.get("class") == "legend-label":
                swatch = children[i - 1] if i > 0 else None
                fill = swatch.get("fill") if swatch is not None and swatch.tag == SVG_NS + "rect" else None
                legend.append((el.text, fill))
    title = root.find(SVG_NS + "title")
    return areas, legend, (title.text if title is not None else "")


def cpp_palette(root=ROOT):
    """The C++ palette: ({category: colour} from memory/category.cpp's kNames and kColors,
    {phase: colour} from inspect/svg_chart.cpp's kPhaseColors)."""
    def array(src, name):
        m = re.search(name + r"\[\]\s*=\s*\{(.*?)\};", src, re.S)
        return re.findall(r'"([^"]*)"', m.group(1)) if m else []
    with open(os.path.join(root, "memory", "category.cpp"), encoding="utf-8") as f:
        cat = f.read()
    names, colours = array(cat, "kNames"), array(cat, "kColors")
    with open(os.path.join(root, "inspect", "svg_chart.cpp"), encoding="utf-8") as f:
        chart = f.read()
    m = re.search(r"kPhaseColors\[\]\s*=\s*\{(.*?)\};", chart, re.S)
    phases = dict(re.findall(r'\{"(\w+)",\s*"(#[0-9a-fA-F]{6})"\}', m.group(1))) if m else {}
    return (dict(zip(names, colours)) if len(names) == len(colours) else {}), phases


def check_palette():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import plot_snapshot  # noqa: E402 (the script under test, as a module)
    cats, phases = cpp_palette()
    check(len(cats) == 11 and all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in cats.values()),
          f"could not read memory/category.cpp's colour table: {cats}")
    py = {k: v.lower() for k, v in plot_snapshot.COLOURS.items()}
    check(py == cats, f"plot_snapshot.py's category colours differ from memory::category_color: "
          f"{ {k: (py.get(k), cats.get(k)) for k in set(py) | set(cats) if py.get(k) != cats.get(k)} }")
    check(len(phases) >= 5 and "other" in phases, f"could not read kPhaseColors: {phases}")
    pyph = {k: v.lower() for k, v in plot_snapshot.PHASE_COLOURS.items()}
    pyph["other"] = plot_snapshot.PHASE_OTHER.lower()
    check(pyph == phases, f"plot_snapshot.py's phase colours differ from inspect::phase_color: {pyph} vs {phases}")
    for span, n in ((1.0, 6), (6.2, 6), (18.7, 6), (0.37, 5), (1234.0, 8), (3e9, 7)):
        step = plot_snapshot.nice_step(span, n)
        m = step / 10 ** math.floor(math.log10(step) + 1e-12)
        check(min(abs(m - k) for k in (1, 2, 5)) < 1e-9, f"nice_step({span}, {n}) = {step}: not 1, 2 or 5 x 10^k")


def round_ticks(path):
    """Checks that the SVG's y and x tick labels are evenly spaced by 1, 2 or 5 x 10^k."""
    root = ET.parse(path).getroot()
    for cls in ("ytick", "xtick"):
        vals = [float(t.text.replace(",", "")) for t in root.iter(SVG_NS + "text") if t.get("class") == cls]
        if not check(len(vals) >= 2, f"{path}: fewer than 2 {cls} labels ({vals})"):
            continue
        steps = [b - a for a, b in zip(vals, vals[1:])]
        step = steps[0]
        check(step > 0 and all(abs(s - step) <= 1e-6 * max(1.0, step) for s in steps),
              f"{path}: {cls} labels not evenly spaced: {vals}")
        if step > 0:
            m = step / 10 ** math.floor(math.log10(step) + 1e-12)
            check(min(abs(m - k) for k in (1, 2, 5)) < 1e-6, f"{path}: {cls} step {step} is not 1, 2 or 5 x 10^k")


def title_peak(title):
    m = re.search(r"peak allocated ([\d,]+\.\d) MiB", title or "")
    return float(m.group(1).replace(",", "")) if m else None


def simple_replay(snapshot):
    """Categories that hold bytes and the peak of live requested bytes (no ghosts/re-tags)."""
    trace = next(t for t in snapshot["device_traces"] if t)
    live, total, peak, cats = {}, 0, 0, set()
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if e["size"] > 0:
                cats.add(e.get("category", "unknown"))
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
        peak = max(peak, total)
    return cats, peak


def check_demo(build_dir, tmp):
    demo = os.path.join(build_dir, "examples", "memory_demo")
    snap = os.path.join(tmp, "demo.pickle")
    out = os.path.join(tmp, "demo.svg")
    r = subprocess.run([demo, "--device", "cpu", "--snapshot", snap], capture_output=True,
                       text=True, timeout=300, cwd=tmp)
    if not check(r.returncode == 0 and os.path.exists(snap),
                 f"memory_demo failed (rc {r.returncode}): {r.stderr.strip()[-500:]}"):
        return
    r = plot(snap, out, "--title", "memory_demo")
    if not check(r.returncode == 0, f"plot_snapshot.py failed (rc {r.returncode}): {r.stderr.strip()}"):
        return
    with open(snap, "rb") as f:
        snapshot = pickle.load(f)
    cats, peak = simple_replay(snapshot)
    areas, legend, title = parse_svg(out)
    check(len(cats) >= 5, f"demo: expected several categories, got {sorted(cats)}")
    check(set(areas) == cats, f"demo: areas {sorted(areas)} != categories with bytes {sorted(cats)}")
    names = [n for n, _ in legend]
    check(sorted(names) == sorted(cats), f"demo: legend {names} != {sorted(cats)}")
    for name, fill in legend:
        check(fill and areas.get(name) == fill,
              f"demo: legend swatch of {name} is {fill}, its area {areas.get(name)}")
    check(len(set(areas.values())) == len(areas), f"demo: colours not distinct: {areas}")
    got = title_peak(title)
    check(got is not None and abs(got - peak / MIB) < 0.051,
          f"demo: title peak {got} MiB, replay says {peak / MIB:.2f} MiB (title {title!r})")
    with open(out, encoding="utf-8") as f:
        text = f.read()
    for phase in ("forward", "backward", "optimizer"):
        check(f">{phase}<" in text, f"demo: no phase label {phase}")
    round_ticks(out)
    cats_cpp, _ = cpp_palette()
    for name, fill in areas.items():
        check(fill and fill.lower() == cats_cpp.get(name), f"demo: {name} drawn in {fill}, "
              f"memory::category_color says {cats_cpp.get(name)}")


def entry(action, addr, size, t, cat, phase=""):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
            "compile_context": "N/A", "frames": [], "category": cat,
            "user_metadata": f"category={cat} module= op= phase={phase}"}


def check_synthetic(tmp):
    mib = 1 << 20
    seg = {"device": 0, "address": 0x10000000, "total_size": 8 * mib, "allocated_size": 1 * mib,
           "active_size": 1 * mib, "requested_size": 1 * mib, "stream": 0, "segment_type": "large",
           "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
           "blocks": [
               # Live before the trace and never touched by it: present throughout.
               {"address": 0x10000000, "size": 1 * mib, "requested_size": 1 * mib,
                "state": "active_allocated",
                "frames": [{"name": "phase init", "filename": "category=parameter", "line": 0}]},
               {"address": 0x10100000, "size": 7 * mib, "requested_size": 0, "state": "inactive",
                "frames": []}]}
    a, b = 0x10100000, 0x10300000
    trace = [
        entry("alloc", a, 2 * mib, 100, "temporary", "forward"),
        # Re-tag temporary -> activation: free_requested + free_completed + alloc, same
        # address/size/time.
        entry("free_requested", a, 2 * mib, 200, "temporary", "forward"),
        entry("free_completed", a, 2 * mib, 200, "temporary", "forward"),
        entry("alloc", a, 2 * mib, 200, "activation", "forward"),
        # A block allocated before the trace window: its free has no alloc.
        entry("free_requested", b, 3 * mib, 300, "gradient", "backward"),
        entry("free_completed", b, 3 * mib, 300, "gradient", "backward"),
        entry("free_requested", a, 2 * mib, 400, "activation", "backward"),
        entry("free_completed", a, 2 * mib, 400, "activation", "backward"),
        entry("segment_alloc", 0x20000000, 2 * mib, 500, "unknown"),
    ]
    snap = os.path.join(tmp, "synthetic.pickle")
    with open(snap, "wb") as f:
        pickle.dump({"segments": [seg], "device_traces": [trace]}, f, protocol=2)
    for mode in ("auto", "time", "index"):
        out = os.path.join(tmp, f"synthetic-{mode}.svg")
        r = plot(snap, out, "--x", mode)
        if not check(r.returncode == 0, f"synthetic --x {mode}: rc {r.returncode}: {r.stderr.strip()}"):
            continue
        areas, legend, title = parse_svg(out)
        want = {"parameter", "gradient", "temporary", "activation"}
        check(set(areas) == want, f"synthetic --x {mode}: areas {sorted(areas)} != {sorted(want)}")
        check(sorted(n for n, _ in legend) == sorted(want), f"synthetic --x {mode}: legend {legend}")
        # 1 (ghost) + 3 (freed without alloc) + 2 (alloc) = 6 MiB; the re-tag must not add.
        check(title_peak(title) == 6.0, f"synthetic --x {mode}: peak in {title!r}, want 6.0 MiB")
        with open(out, encoding="utf-8") as f:
            check("1 re-tag" in f.read(), f"synthetic --x {mode}: re-tag not recognised")


def check_bad_input(tmp):
    garbage = os.path.join(tmp, "garbage.pickle")
    with open(garbage, "wb") as f:
        f.write(b"this is not a pickle\n")
    missing = os.path.join(tmp, "missing-key.pickle")
    with open(missing, "wb") as f:
        pickle.dump({"segments": []}, f)
    for path, what in ((garbage, "not a"), (missing, "device_traces"),
                       (os.path.join(tmp, "absent.pickle"), "cannot read")):
        out = os.path.join(tmp, "bad.svg")
        r = plot(path, out)
        check(r.returncode == 2, f"{os.path.basename(path)}: rc {r.returncode}, want 2")
        check(path in r.stderr and what in r.stderr,
              f"{os.path.basename(path)}: message {r.stderr.strip()!r} should name the file and say "
              f"{what!r}")
        check(not os.path.exists(out), f"{os.path.basename(path)}: an SVG was written anyway")


def main():
    if len(sys.argv) != 2:
        print("usage: test_plot_snapshot.py BUILD_DIR", file=sys.stderr)
        return 2
    build_dir = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory(prefix="plot_snapshot_") as tmp:
        check_palette()
        check_demo(build_dir, tmp)
        check_synthetic(tmp)
        check_bad_input(tmp)
    if failures:
        for f in failures:
            print("FAIL:", f)
        return 1
    print("test_plot_snapshot: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
