#!/usr/bin/env python3
"""The out-of-memory post-mortem of the training programs, on the CPU under --memory-limit.

    test_oom_report.py BUILD_DIR

train_resnet and train_gpt each run with a cap their run does not fit in and
TALLY_ALLOC_CONF=oom_snapshot:FILE (history off). Each must:
- exit 3 (out of memory), with "PROGRAM: Tally out of memory on cpu ..." naming the snapshot;
- print what would fit: "as run, the predicted peak is X (does not fit in CAP)" and lines
  "with FLAGS the predicted peak is X (fits|does not fit in CAP)", at least one that fits;
- leave a snapshot that tests/memory/check_snapshot.py passes, with the live blocks' categories
  in their frames and no trace (history was off).
Then the first variation predicted to fit runs under the same cap and finishes (exit 0).
"""
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile

from example_checks import check, fails

build = os.path.abspath(sys.argv[1])
src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
tmp = tempfile.mkdtemp(prefix="tally_oom_report_")
LINE = re.compile(r"^  (as run,|with (.+?)) the predicted peak is (over )?([0-9.]+ [KMGT]?i?B) "
                  r"\((fits|does not fit) in ([0-9.]+ [KMGT]?i?B)\)$")


def run(cmd, env_extra=None, timeout=600):
    env = dict(os.environ)
    env.pop("TALLY_ALLOC_CONF", None)
    env.update(env_extra or {})
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    print("$", " ".join(cmd))
    print(p.stdout)
    print(p.stderr)
    return p


def check_program(prog, args, limit_text):
    exe = os.path.join(build, "examples", prog)
    snap = os.path.join(tmp, f"{prog}_oom.pickle")
    cmd = [exe, *args, "--memory-limit", limit_text]
    p = run(cmd, {"TALLY_ALLOC_CONF": f"oom_snapshot:{snap}"})
    check(p.returncode == 3, f"{prog}: expected exit 3 (out of memory), got {p.returncode}")
    check(re.search(rf"^{prog}: .*Tally out of memory on cpu: ", p.stderr, re.M) is not None,
          f"{prog}: no out-of-memory error line")
    check(f"Snapshot written to {snap} (segments and blocks; no trace: history is off)." in p.stderr,
          f"{prog}: the error does not name the snapshot {snap}")
    check("what would fit on cpu" in p.stderr, f"{prog}: no 'what would fit' heading")
    lines = [m for m in (LINE.match(l) for l in p.stderr.splitlines()) if m]
    check(len(lines) >= 3, f"{prog}: expected the run and at least two variations, got {len(lines)}")
    if lines:
        check(lines[0].group(1) == "as run," and lines[0].group(5) == "does not fit",
              f"{prog}: the run as given must be predicted not to fit: {lines[0].group(0)}")
    check(all(m.group(6) == limit_text.replace("MiB", ".0 MiB") for m in lines),
          f"{prog}: every line compares against the limit {limit_text}")
    fitting = [m.group(2) for m in lines if m.group(5) == "fits"]
    check(fitting, f"{prog}: no variation is predicted to fit")
    check(any(m.group(2) == "--checkpoint blocks" for m in lines), f"{prog}: --checkpoint blocks not tried")
    check(any(m.group(2) and m.group(2).startswith("--batch ") for m in lines), f"{prog}: no smaller --batch tried")

    # The post-mortem snapshot: the viewer's format, tags on the blocks, no trace.
    check(os.path.exists(snap), f"{prog}: {snap} not written")
    if os.path.exists(snap):
        c = subprocess.run([sys.executable, os.path.join(src, "tests", "memory", "check_snapshot.py"), snap],
                           capture_output=True, text=True)
        check(c.returncode == 0, f"{prog}: check_snapshot.py failed: {c.stdout}{c.stderr}")
        d = pickle.load(open(snap, "rb"))
        check(all(t == [] for t in d["device_traces"]), f"{prog}: history was off, the trace must be empty")
        cats = {f["filename"] for s in d["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
                for f in b["frames"] if f["filename"].startswith("category=")}
        for want in ("category=parameter", "category=activation"):
            check(want in cats, f"{prog}: no live {want} block in the snapshot ({sorted(cats)})")
        modules = {f["name"] for s in d["segments"] for b in s["blocks"] for f in b["frames"]
                   if f["filename"] == "module"}
        check(modules, f"{prog}: no block names its module")

    # The first variation predicted to fit does fit.
    if fitting:
        variation = list(cmd)
        flags = fitting[0].split()
        for flag, value in zip(flags[::2], flags[1::2]):
            if flag in variation:
                variation[variation.index(flag) + 1] = value
            else:
                variation += [flag, value]
        ok = run(variation)
        check(ok.returncode == 0, f"{prog} {fitting[0]} --memory-limit {limit_text}: predicted to fit, "
                                  f"exit {ok.returncode}")


check_program("train_resnet", ["--arch", "tiny", "--dataset", "synthetic", "--batch", "256", "--steps", "3",
                               "--eval-batches", "1"], "120MiB")
check_program("train_gpt", ["--preset", "tiny", "--data", "synthetic", "--batch", "64", "--steps", "2",
                            "--eval-batches", "1"], "40MiB")

shutil.rmtree(tmp, ignore_errors=True)
if fails:
    print(f"{len(fails)} failures")
    sys.exit(1)
print("out-of-memory reports ok: train_resnet, train_gpt")
