#!/usr/bin/env python3
"""End-to-end test of examples/ab_memory: runs a 2x2 matrix (checkpointing x precision) of a
small ResNet on the CPU, then checks every output with the real readers:
- results.json: checkpointing lowers the activation bytes at the peak; nothing is `unknown`.
- *.pickle: Python's pickle loads each snapshot (segments, device_traces); recorded from before
  the batches and the model exist, its trace allocates the parameters, optimizer state and
  inputs, and no live block lacks its alloc entry (memory_viz would draw it `unknown`).
- *.timeline.json: PyTorch's [times, sizes] layout with 13 columns, and the sample with the
  largest total matches the allocator's own peak split.
- the headlines ("per-block checkpointing: peak −38% (−2,084 MiB), step +19%"), on stdout and in
  the report, with the numbers recomputed here from results.json; the caveat on a CPU bf16 run
  (and none on runs without 16-bit autocast or without a measured CPU step).
- report.html: opened in headless Chromium (Debian's `chromium`): the script ran, one chart per
  configuration was drawn, and Chromium's net log shows no request other than the file itself.
  At 1,400 and 1,920 px wide: nothing past the right edge, no labels touching, every chart with
  x and y ticks evenly spaced by 1, 2 or 5 x 10^k, the tables within the page, one band per
  phase, every link resolving to a file in the output folder, every area in
  memory::category_color's colour (read from memory/category.cpp). The same for a timeline page
  and a diff page. Skipped (exit 77, reported as skipped by ctest) only when chromium is not
  installed.

    test_ab_memory.py BUILD_DIR
"""
import glob
from html.parser import HTMLParser
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile

from example_checks import check, fails, run_program

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINUS, PLUSMINUS = "\u2212", "\u00b1"


def cpp_category_colours():
    """memory::category_color's table: memory/category.cpp's kNames and kColors."""
    src = open(os.path.join(ROOT, "memory", "category.cpp"), encoding="utf-8").read()
    arrays = [re.findall(r'"([^"]*)"', re.search(n + r"\[\]\s*=\s*\{(.*?)\};", src, re.S).group(1))
              for n in ("kNames", "kColors")]
    return dict(zip(*arrays))


def signed_percent(d, base):
    p = 100.0 * d / base
    digits = f"{abs(p):.0f}" if abs(p) >= 1 else f"{abs(p):.1f}"
    if digits in ("0", "0.0"):
        return PLUSMINUS + "0%"
    return ("+" if p > 0 else MINUS) + digits + "%"


def signed_size(d):
    m = abs(d) / 2**20
    s = f"{m:,.0f} MiB" if m >= 100 else f"{m:.1f} MiB" if m >= 1 else f"{abs(d) / 1024:.0f} KiB"
    return PLUSMINUS + "0 MiB" if d == 0 else ("+" if d > 0 else MINUS) + s


def describe(name, base_name):
    """The change of configuration `name` against `base_name` in words (ab_report's rules for
    the checkpoint and amp axes this test runs)."""
    words = {("ckpt", "none"): "no checkpointing", ("ckpt", "blocks"): "per-block checkpointing",
             ("amp", "off"): "fp32 (no autocast)", ("amp", "bf16"): "bf16 autocast",
             ("amp", "fp16"): "fp16 autocast"}
    cfg = dict(kv.split("=", 1) for kv in name.split())
    base = dict(kv.split("=", 1) for kv in base_name.split())
    return " + ".join(words[(k, v)] for k, v in cfg.items() if base.get(k) != v)


def change(v, b):
    d = v - b
    return f"{signed_percent(d, b)} ({signed_size(d)})"


def expected_headline(r, b):
    """(text up to the step, the step's signed percent) of r against b, from results.json."""
    head = (f"{describe(r['name'], b['name'])}: peak allocated {change(r['peak_allocated'], b['peak_allocated'])}, "
            f"reserved {change(r['peak_reserved'], b['peak_reserved'])}")
    return head, 100.0 * (r["median_ms"] - b["median_ms"]) / b["median_ms"]


def check_headline(text, r, b, where):
    head, step = expected_headline(r, b)
    check(text.startswith(head + ", step "), f"{where}: headline {text!r}, expected it to start {head + ', step '!r}")
    # Inside the timing rounds' spread the headline says so instead of a percentage.
    spread = max(r["max_ms"] - r["min_ms"], b["max_ms"] - b["min_ms"])
    noise = re.search(r", step within noise \(difference ([\d.]+) ms, rounds' spread ([\d.]+) ms\)$", text)
    if noise:
        check(abs(float(noise.group(2)) - spread) <= 0.01 and float(noise.group(1)) <= float(noise.group(2)),
              f"{where}: {text!r}: results.json's rounds give a spread of {spread:.3f} ms")
        return
    m = re.search(r", step ([+\u2212\u00b1])([\d.]+)%(?: \(rounds' spread ([\d.]+) ms\))?$", text)
    if check(m is not None, f"{where}: no step change in {text!r}"):
        check(abs(r["median_ms"] - b["median_ms"]) >= spread - 0.002,
              f"{where}: {text!r} gives a percentage inside the rounds' spread {spread:.3f} ms")
        got = float(m.group(2)) * (-1 if m.group(1) == MINUS else 1 if m.group(1) == "+" else 0)
        # results.json rounds the times to µs: allow the last digit to differ.
        check(abs(got - step) <= 1.0 and (m.group(1) == PLUSMINUS or (got > 0) == (step > 0)),
              f"{where}: step change {got}% in {text!r}, results.json says {step:.2f}%")

build = sys.argv[1]
exe = os.path.join(build, "examples", "ab_memory")
out = tempfile.mkdtemp(prefix="ab_memory_")

cmd = [exe, "--model", "resnet", "--arch", "tiny", "--dataset", "synthetic", "--image-size", "16",
       "--batch", "8", "--steps", "2", "--checkpoint", "none,blocks", "--amp", "off,bf16", "--out", out]
p = run_program(cmd, "ab_memory", timeout=600)

res = json.load(open(os.path.join(out, "results.json")))
check(len(res) == 4, f"4 configurations expected, got {len(res)}")
# The headlines on stdout: one per configuration after the first, numbers from results.json.
lines = p.stdout.splitlines()
if check(f"what each option bought, against {res[0]['name']}:" in lines, "no headlines on stdout"):
    at = lines.index(f"what each option bought, against {res[0]['name']}:")
    for k, r in enumerate(res[1:]):
        check_headline(lines[at + 1 + k].strip(), r, res[0], f"stdout ({r['name']})")
ck_line = [l for l in lines if l.strip().startswith("per-block checkpointing: peak ")]
check(ck_line and ck_line[0].strip().startswith("per-block checkpointing: peak allocated " + MINUS),
      f"checkpointing's headline should show a lower peak: {ck_line}")
CAVEAT = "Caveat: these steps ran on the CPU, where 16-bit autocast (bf16) saves memory but not time"
check(CAVEAT in p.stdout and "float32" in p.stdout, "no caveat on stdout for a CPU bf16 run")
by = {r["name"]: r for r in res}
base, ck = by.get("ckpt=none amp=off"), by.get("ckpt=blocks amp=off")
check(base is not None and ck is not None, f"configuration names: {list(by)}")
if base and ck:
    check(ck["at_peak"]["activation"] < base["at_peak"]["activation"],
          f"checkpointing should lower activations at the peak: {ck['at_peak']['activation']} vs "
          f"{base['at_peak']['activation']}")
    check(ck["peak_allocated"] < base["peak_allocated"], "checkpointing should lower the peak")
for r in res:
    check(r["at_peak"]["unknown"] == 0, f"{r['name']}: unknown bytes at the peak: {r['at_peak']['unknown']}")
    check(r["at_peak"]["parameter"] > 0, f"{r['name']}: no parameter bytes at the peak")
    check(r["final_loss"] == r["final_loss"] and r["final_loss"] > 0, f"{r['name']}: bad loss {r['final_loss']}")
    # Step times from 3 interleaved rounds: the median of the rounds, within their range.
    check(len(r["round_ms"]) == 3 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
          and r["median_ms"] in r["round_ms"], f"{r['name']}: rounds {r['round_ms']}, median {r['median_ms']}")
    # bf16 and float32 have no loss scaler: no step is ever skipped.
    check(r["skipped_steps"] == 0, f"{r['name']}: skipped_steps {r['skipped_steps']} without a GradScaler")
# Each run next to its prediction: on the CPU the dry run replays the same allocations, so
# the predicted peak and categories are the measured ones exactly.
for r in res:
    check(r.get("estimate_target") == "cpu" and r.get("measured") is True,
          f"{r['name']}: expected a measured run with a cpu prediction, got {r.get('estimate_target')}")
    check(r.get("estimated_peak_allocated") == r["peak_allocated"],
          f"{r['name']}: predicted peak {r.get('estimated_peak_allocated')} != measured {r['peak_allocated']}")
    check(r.get("estimated_at_peak") == r["at_peak"],
          f"{r['name']}: predicted categories at the peak differ: {r.get('estimated_at_peak')} vs {r['at_peak']}")
bf = by.get("ckpt=none amp=bf16")
if bf and base:
    check(bf["at_peak"]["autocast_cache"] > 0 or bf["at_peak"]["activation"] < base["at_peak"]["activation"],
          "bf16 should show an autocast cache or smaller activations")

def check_nothing_unknown(path, snap, categories=("parameter", "optimizer_state", "input")):
    """Recorded from before the batches and the model exist: the trace allocates parameters,
    optimizer state and inputs, and every live block has its alloc entry (memory_viz draws a
    live block without one as `unknown`)."""
    trace = [e for t in snap["device_traces"] for e in t]
    allocated = {e["category"] for e in trace if e["action"] == "alloc"}
    for c in categories:
        check(c in allocated, f"{path}: no `alloc` entry of category {c} in the trace ({sorted(allocated)})")
    live = set()
    for e in trace:
        if e["action"] == "alloc":
            live.add(e["addr"])
        elif e["action"] == "free_completed":
            live.discard(e["addr"])
    ghosts = [b for s in snap["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated" and b["address"] not in live]
    check(not ghosts, f"{path}: {len(ghosts)} live blocks allocated before the trace (memory_viz: unknown)")


for r in res:
    snap = pickle.load(open(r["snapshot"], "rb"))
    check(isinstance(snap, dict) and "segments" in snap and "device_traces" in snap,
          f"{r['snapshot']}: not a memory snapshot")
    check_nothing_unknown(r["snapshot"], snap)
    times, sizes = json.load(open(r["timeline"]))
    check(len(times) == len(sizes) and len(times) > 10, f"{r['timeline']}: {len(times)} samples")
    check(all(len(row) == 13 and row[0] == 0 and row[7] == 0 for row in sizes),
          f"{r['timeline']}: rows must have 13 columns, column 0 and 7 zero")
    check(all(times[i] <= times[i + 1] for i in range(len(times) - 1)), f"{r['timeline']}: times not sorted")
    check(all(v >= 0 for row in sizes for v in row), f"{r['timeline']}: negative bytes")
    check(max(row[8] for row in sizes) == 0, f"{r['timeline']}: unknown column not zero")

# The snapshot diff of every configuration against the first (diff/<name>.{html,txt,json},
# inspect/memdiff.h): listed in the output; the JSON names both snapshots, its rows add up to each
# peak (requested bytes: at most the allocator's rounded peak), and checkpointing shows as less
# activation at the peak; the page is self-contained.
check("snapshot diffs against ckpt=none amp=off" in p.stdout, "ab_memory lists its snapshot diffs")
for r in res[1:]:
    stem = os.path.join(out, "diff", re.sub(r"[^A-Za-z0-9_-]", "_", r["name"]))
    missing = [stem + e for e in (".html", ".txt", ".json") if not os.path.exists(stem + e)]
    check(not missing, f"diff files missing: {missing}")
    check(stem + ".html" in p.stdout, f"{stem}.html is not listed in the output")
    if missing:
        continue
    dj = json.load(open(stem + ".json"))
    check(dj["a"]["path"] == res[0]["snapshot"] and dj["b"]["path"] == r["snapshot"],
          f"{stem}.json compares {dj['a']['path']} and {dj['b']['path']}")
    check(dj["a"]["format"] == "tally" and dj["b"]["format"] == "tally", f"{stem}.json: not read as Tally's")
    for side, rr in (("a", res[0]), ("b", r)):
        check(0 < dj[side]["peak_allocated"] <= rr["peak_allocated"],
              f"{stem}.json: {side} peak {dj[side]['peak_allocated']} vs the allocator's {rr['peak_allocated']}")
    sections = {s["dimension"]: s for s in dj["sections"]}
    check({"category", "phase", "module", "op"} <= set(sections), f"{stem}.json: sections {list(sections)}")
    for s in dj["sections"]:
        check(sum(row["a_bytes"] for row in s["rows"]) == dj["a"]["peak_allocated"]
              and sum(row["b_bytes"] for row in s["rows"]) == dj["b"]["peak_allocated"],
              f"{stem}.json: the {s['dimension']} rows do not add up to the peaks")
    if r["name"] == "ckpt=blocks amp=off" and "category" in sections:
        act = [row for row in sections["category"]["rows"] if row["name"] == "activation"]
        check(act and act[0]["delta_bytes"] < 0, f"{stem}.json: checkpointing should lower activations: {act}")
    text = open(stem + ".txt").read()
    check("peak allocated" in text and "by module" in text, f"{stem}.txt: not the diff table")
    page = open(stem + ".html", encoding="utf-8").read()
    check("<svg" in page and "http" not in page, f"{stem}.html: not a self-contained page")

# --estimate h200: dry runs only, for a CUDA target, on this machine: no step time, no loss.
est = os.path.join(out, "estimate")
ep = run_program([exe, "--model", "resnet", "--arch", "tiny", "--dataset", "synthetic", "--image-size", "16",
                  "--batch", "8", "--steps", "2", "--checkpoint", "none,blocks", "--amp", "bf16",
                  "--estimate", "h200", "--out", est], "ab_memory --estimate", timeout=600)
check("Caveat" not in ep.stdout, "--estimate: a dry run has no step time, so no CPU autocast caveat")
check("largest activations at the predicted peak" in ep.stdout and "ckpt=blocks amp=bf16: " in ep.stdout,
      "--estimate: the activations by module at each predicted peak are printed")
eres = json.load(open(os.path.join(est, "results.json")))
check(len(eres) == 2, f"--estimate: 2 configurations expected, got {len(eres)}")
for r in eres:
    check(r["measured"] is False and r["median_ms"] is None and r["final_loss"] is None
          and r["skipped_steps"] == 0, f"--estimate {r['name']}: a dry run has no time, loss or skipped step: {r}")
    check(r["estimate_target"] == "h200" and r["estimated_peak_allocated"] == r["peak_allocated"] > 0,
          f"--estimate {r['name']}: the figures are the prediction's")
    check_nothing_unknown(r["snapshot"], pickle.load(open(r["snapshot"], "rb")))
check(eres[1]["peak_allocated"] < eres[0]["peak_allocated"], "--estimate: checkpointing should lower the peak")
# Each dry run replays on a meta device of its own: the diff still compares them.
est_diff = os.path.join(est, "diff", "ckpt_blocks_amp_bf16.json")
check(os.path.exists(est_diff), f"--estimate: {est_diff} missing")
if os.path.exists(est_diff):
    ed = json.load(open(est_diff))
    check(ed["b"]["peak_allocated"] < ed["a"]["peak_allocated"], "--estimate diff: checkpointing should lower the peak")

html_path = os.path.join(out, "report.html")
html = open(html_path, encoding="utf-8").read()
# Nothing that would make a browser fetch: no external src/href, CSS url(), @import, fetch/XHR.
ext = re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
ext += re.findall(r"url\(\s*['\"]?(?:https?:)?//", html, re.I)
ext += re.findall(r"@import|fetch\(|XMLHttpRequest|<link\b|<iframe\b|<img\b", html, re.I)
check(not ext, f"report.html references external resources: {ext}")

# The levers' axes: offload and step-in-backward against the same baseline, each predicted
# exactly by its dry run.
lever_out = tempfile.mkdtemp(prefix="ab_levers_")
lp = run_program([exe, "--model", "gpt", "--preset", "tiny", "--batch", "4", "--seq", "32", "--steps", "2",
                  "--checkpoint", "none", "--amp", "off", "--offload", "none,activations",
                  "--optimizer", "adamw,adamw8bit", "--step-in-backward", "off,on", "--rounds", "0",
                  "--out", lever_out],
                 "ab_memory levers", timeout=600)
check("Caveat" not in lp.stdout, "levers: no 16-bit autocast, so no caveat")
check("  8-bit AdamW: peak " in lp.stdout and "  activation offload: peak " in lp.stdout
      and "  step-in-backward: peak " in lp.stdout, "levers: a headline per lever in words")
lv = {r["name"]: r for r in json.load(open(os.path.join(lever_out, "results.json")))}
check(len(lv) == 8, f"8 lever configurations expected, got {list(lv)}")
lbase = lv.get("ckpt=none amp=off offload=none opt=adamw sib=off")
loff = lv.get("ckpt=none amp=off offload=activations opt=adamw sib=off")
lsib = lv.get("ckpt=none amp=off offload=none opt=adamw sib=on")
l8 = lv.get("ckpt=none amp=off offload=none opt=adamw8bit sib=off")
if lbase and loff and lsib and l8:
    check(loff["at_peak"]["offloaded"] > 0, "offload: no offloaded bytes at the peak")
    check(loff["at_peak"]["activation"] < lbase["at_peak"]["activation"],
          f"offload: activation at the peak {loff['at_peak']['activation']} not below {lbase['at_peak']['activation']}")
    check(lsib["final_loss"] == lbase["final_loss"],
          f"step-in-backward should update as a plain step: loss {lsib['final_loss']} vs {lbase['final_loss']}")
    check(l8["at_peak"]["optimizer_state"] < lbase["at_peak"]["optimizer_state"],
          "adamw8bit: optimizer_state at the peak not below adamw's")
else:
    check(False, f"lever configuration names: {list(lv)}")
for r in lv.values():
    check(r.get("estimated_peak_allocated") == r["peak_allocated"],
          f"{r['name']}: predicted peak {r.get('estimated_peak_allocated')} != measured {r['peak_allocated']}")
    check_nothing_unknown(r["snapshot"], pickle.load(open(r["snapshot"], "rb")))
shutil.rmtree(lever_out, ignore_errors=True)

# Gradient accumulation: the batch in 2 micro-batches, each with its own forward and backward
# phases (forward.0, backward.0, forward.1, backward.1), one optimizer step; the activations of
# half the batch at the peak, predicted exactly.
acc_out = tempfile.mkdtemp(prefix="ab_accum_")
ap = run_program([exe, "--model", "gpt", "--preset", "tiny", "--batch", "4", "--seq", "32", "--steps", "2",
                  "--checkpoint", "none", "--amp", "off", "--grad-accum", "1,2", "--rounds", "1",
                  "--out", acc_out], "ab_memory --grad-accum", timeout=600)
acc = {r["name"]: r for r in json.load(open(os.path.join(acc_out, "results.json")))}
a1, a2 = acc.get("ckpt=none amp=off accum=1"), acc.get("ckpt=none amp=off accum=2")
if check(a1 is not None and a2 is not None, f"grad-accum configuration names: {list(acc)}"):
    check(a2["settings"].get("accum") == "2", f"accum setting: {a2['settings']}")
    check(["forward.0", "backward.0", "forward.1", "backward.1"] == list(a2["phase_peaks"]),
          f"micro-batch phases: {list(a2['phase_peaks'])}")
    check("forward" in a1["phase_peaks"] and "forward.0" not in a1["phase_peaks"], f"accum=1 phases: {list(a1['phase_peaks'])}")
    check(a2["at_peak"]["activation"] < a1["at_peak"]["activation"],
          f"2 micro-batches should hold fewer activations: {a2['at_peak']['activation']} vs {a1['at_peak']['activation']}")
    check(a2["estimated_peak_allocated"] == a2["peak_allocated"], "grad-accum: the dry run predicts the peak exactly")
    check(abs(a2["final_loss"] - a1["final_loss"]) < 1e-3,
          f"the same batch's mean loss either way: {a2['final_loss']} vs {a1['final_loss']}")
    check("peak by phase, ckpt=none amp=off accum=2: forward.0 " in ap.stdout, "the micro-batches' peaks on stdout")
    check("  accum" in ap.stdout or "2 micro-batches" in ap.stdout, f"a headline for the micro-batches: {ap.stdout[-800:]}")
shutil.rmtree(acc_out, ignore_errors=True)

chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
if not chromium:
    print("chromium not installed: rendering check skipped")
    shutil.rmtree(out, ignore_errors=True)
    if fails:
        sys.exit(1)
    sys.exit(77)
netlog = os.path.join(out, "netlog.json")
profile = tempfile.mkdtemp(prefix="chromium_profile_")
r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-background-networking", f"--user-data-dir={profile}", f"--log-net-log={netlog}", "--net-log-capture-mode=Default",
                    "--virtual-time-budget=5000", "--dump-dom", "file://" + html_path],
                   capture_output=True, text=True, timeout=180)
dom = r.stdout
check('data-rendered="1"' in dom, "the report's script did not run in chromium (no data-rendered)")
m = re.search(r'data-charts="(\d+)"', dom)
check(m is not None and int(m.group(1)) == 4, f"expected 4 charts, got {m.group(1) if m else None}")
check(dom.count("<path") >= 4, f"expected stacked areas in the charts, found {dom.count('<path')} paths")
check(dom.count('class="predicted"') == 4, f"expected a dashed predicted-peak line per chart, "
      f"found {dom.count('class=' + chr(34) + 'predicted' + chr(34))}")
urls = set()
if os.path.exists(netlog):
    # Requests the page made (not Chromium's own update/account traffic, whose initiator is
    # "not an origin"): any non-file URL whose request has a page initiator.
    log = json.load(open(netlog, encoding="utf-8", errors="replace"))
    for e in log.get("events", []):
        prm = e.get("params") or {}
        url = prm.get("url", "")
        if url and not url.startswith(("file:", "data:", "about:")) and "initiator" in prm \
                and prm["initiator"] != "not an origin":
            urls.add(url)
check(not urls, f"chromium requested network resources: {sorted(urls)[:5]}")
shutil.rmtree(profile, ignore_errors=True)


class Dom(HTMLParser):
    """The elements of a dumped DOM: (tag, attrs, text, index of the enclosing <svg> or -1)."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.els, self.stack, self.svgs = [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.svgs.append(a)
        svg = len(self.svgs) - 1 if tag == "svg" or any(t == "svg" for t, _ in self.stack) else -1
        self.els.append([tag, a, "", svg])
        if tag not in ("meta", "br", "input", "img", "link") and not self.get_starttag_text().endswith("/>"):
            self.stack.append((tag, len(self.els) - 1))

    def handle_endtag(self, tag):
        while self.stack:
            t, _ = self.stack.pop()
            if t == tag:
                break

    def handle_data(self, data):
        if self.stack:
            self.els[self.stack[-1][1]][2] += data

    def find(self, tag=None, cls=None, **attrs):
        return [e for e in self.els if (tag is None or e[0] == tag)
                and (cls is None or cls in e[1].get("class", "").split())
                and all(e[1].get(k) == v for k, v in attrs.items())]


def render(path, width):
    prof = tempfile.mkdtemp(prefix="chromium_profile_")
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--hide-scrollbars", f"--window-size={width},900", f"--user-data-dir={prof}",
                        "--virtual-time-budget=5000", "--dump-dom", "file://" + path],
                       capture_output=True, text=True, timeout=180)
    shutil.rmtree(prof, ignore_errors=True)
    return r.stdout


def body_int(dom, name):
    m = re.search(r'<body[^>]*\b' + name + r'="(\d+)"', dom)
    return int(m.group(1)) if m else None


def is_round(step):
    m = step / 10 ** math.floor(math.log10(step) + 1e-12)
    return min(abs(m - k) for k in (1, 2, 5)) < 1e-6


def check_page(dom, where, width):
    """What every page must hold at `width` px: rendered, nothing past the right edge, no
    touching labels, every chart with round, evenly spaced x and y ticks."""
    check('data-rendered="1"' in dom, f"{where}: the script did not finish")
    check(body_int(dom, "data-viewport") == width, f"{where}: laid out {body_int(dom, 'data-viewport')} px wide, not {width}")
    check(body_int(dom, "data-overflow") == 0, f"{where}: {body_int(dom, 'data-overflow')} elements past the right edge")
    touching = re.search(r'data-touching="([^"]*)"', dom)
    check(body_int(dom, "data-overlaps") == 0, f"{where}: {body_int(dom, 'data-overlaps')} pairs of labels touch "
          f"({touching.group(1) if touching else ''})")
    check(body_int(dom, "data-untick") == 0, f"{where}: {body_int(dom, 'data-untick')} charts without ticks")
    d = Dom(dom)
    charts = [i for i, a in enumerate(d.svgs) if "chart" in a.get("class", "").split()]
    check(charts, f"{where}: no charts")
    for i in charts:
        for cls in ("xtick", "ytick"):
            ticks = [e for e in d.find("text", cls) if e[3] == i]
            vals = [float(e[1]["data-value"]) for e in ticks]
            if not check(len(vals) >= 2, f"{where}: chart {i} has {len(vals)} {cls} labels"):
                continue
            steps = [b - a for a, b in zip(vals, vals[1:])]
            check(vals[0] == 0 and all(abs(s - steps[0]) <= 1e-6 * steps[0] for s in steps) and is_round(steps[0]),
                  f"{where}: chart {i}'s {cls} values {vals} are not 0, s, 2s, ... with s 1, 2 or 5 x 10^k")
            for e in ticks:
                check(abs(float(e[2].replace(",", "")) - float(e[1]["data-value"])) <= 1e-6 * max(1, steps[0]) + 1e-9,
                      f"{where}: tick label {e[2]!r} is not its value {e[1]['data-value']}")
    return d


colours = cpp_category_colours()
check(len(colours) == 11, f"could not read memory/category.cpp's colours: {colours}")
for width in (1400, 1920):
    dom = render(html_path, width)
    d = check_page(dom, f"report.html at {width} px", width)
    tw = body_int(dom, "data-table-width")
    check(tw is not None and tw <= width - 48, f"report.html at {width} px: table {tw} px wide")
    check(body_int(dom, "data-charts") == 4, f"report.html at {width} px: {body_int(dom, 'data-charts')} timeline charts")
    check(len(d.find("svg", "scatter-chart")) == 1, f"report.html at {width} px: no peak-versus-step-time chart")
    check(len(d.find("g", "point")) == 4, f"report.html at {width} px: {len(d.find('g', 'point'))} points, want 4")
    # Step time and final loss in the table, one value per configuration.
    rows = {e[2].strip(): e for e in d.find("td")}
    check("step time (ms)" in rows and "final loss" in rows, f"report.html at {width} px: no step time or final loss row")
    heads = [e[2].strip() for e in d.find("li", "headline")]
    check(len(heads) == 3, f"report.html at {width} px: {len(heads)} headlines, want 3")
    for r, text in zip(res[1:], heads):
        check_headline(text, r, res[0], f"report.html ({r['name']})")
    cav = d.find("p", "caveat")
    check(cav and cav[0][2].startswith(CAVEAT) and "hidden" not in cav[0][1], f"report.html at {width} px: no CPU bf16 caveat")
    for e in d.find("path", "area"):
        check(e[1].get("fill") == colours.get(e[1].get("data-category")),
              f"report.html: {e[1].get('data-category')} drawn in {e[1].get('fill')}, memory::category_color says "
              f"{colours.get(e[1].get('data-category'))}")
    links = d.find("a")
    hrefs = [e[1].get("href", "") for e in links]
    check(len(hrefs) >= 4 * 3 + 3, f"report.html: {len(hrefs)} links, want snapshot, timeline, JSON per chart and 3 diffs")
    for h in hrefs:
        check(not os.path.isabs(h) and os.path.isfile(os.path.join(out, h)), f"report.html: link {h!r} does not resolve in {out}")
    for r in res:
        stem = re.sub(r"[^A-Za-z0-9_-]", "_", r["name"])
        for want in (stem + ".pickle", stem + ".timeline.html", stem + ".timeline.json"):
            check(want in hrefs, f"report.html: no link to {want}")
    # One band per phase in every timeline chart.
    for i, a in enumerate(d.svgs):
        if "memchart" not in a.get("class", ""):
            continue
        bands = [e[1]["data-phase"] for e in d.find("rect", "phase") if e[3] == i]
        check(len(bands) == len(set(bands)) and {"forward", "backward", "optimizer"} <= set(bands),
              f"report.html: chart {i} bands {bands}: want one each of forward, backward, optimizer")
        check(len([e for e in d.find("text", "phase-label") if e[3] == i]) >= 2, f"report.html: chart {i}: phase labels missing")

# The timeline page and the diff page: the same renderer, ticks and palette.
tl = os.path.join(out, re.sub(r"[^A-Za-z0-9_-]", "_", res[1]["name"]) + ".timeline.html")
df = os.path.join(out, "diff", re.sub(r"[^A-Za-z0-9_-]", "_", res[1]["name"]) + ".html")
tl_html = open(tl, encoding="utf-8").read()
check(f"<title>{res[1]['name']}: memory timeline" in tl_html and 'href="report.html"' in tl_html,
      f"{tl}: not titled with its configuration or no link back to the report")
for page in (tl, df):
    for width in (1400, 1920):
        d = check_page(render(page, width), f"{os.path.basename(page)} at {width} px", width)
        if page == tl:
            areas = d.find("path", "area")
            check(len(areas) >= 3, f"{tl}: {len(areas)} areas")
            for e in areas:
                check(e[1].get("fill") == colours.get(e[1].get("data-category")),
                      f"{tl}: {e[1].get('data-category')} drawn in {e[1].get('fill')}")
            check(len(d.find("rect", "phase")) >= 3, f"{tl}: no phase bands")
shutil.rmtree(out, ignore_errors=True)
if fails:
    print(f"{len(fails)} failures")
    sys.exit(1)
print("ab_memory outputs ok: 4 configurations, snapshots, timelines, report rendered in chromium")
