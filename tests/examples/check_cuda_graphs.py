#!/usr/bin/env python3
"""--cuda-graphs on both training programs (label gpu): the same run with and without the graph
logs the same losses (within 1e-3: cuDNN and the attention backward may sum in another order)
and the same learning rates, so the replays follow the warm-up-cosine scheduler; the program says
it runs CUDA graphs. Exits 77 (skipped) without a GPU.

    check_cuda_graphs.py BUILD_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

from example_checks import check, fails

build = sys.argv[1]


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


RUNS = {
    "train_gpt": ["--preset", "tiny", "--data", "synthetic", "--steps", "60", "--batch", "8",
                  "--log-every", "10", "--eval-batches", "1", "--amp", "bf16", "--lr", "3e-3"],
    "train_resnet": ["--arch", "tiny", "--dataset", "synthetic", "--steps", "40", "--batch", "32",
                     "--log-every", "10", "--lr", "0.05"],
}

with tempfile.TemporaryDirectory() as d:
    for prog, args in RUNS.items():
        exe = os.path.join(build, "examples", prog)
        logs = {}
        for graphs in (False, True):
            path = os.path.join(d, f"{prog}-{graphs}.jsonl")
            cmd = [exe, "--device", "cuda", "--metrics", path] + args + (["--cuda-graphs"] if graphs else [])
            rc, out = run(cmd)
            if rc == 2 and "--device cuda" in out:
                print(f"skipped: no GPU ({out.strip()[:200]})")
                sys.exit(77)
            check(rc == 0, f"{' '.join(cmd)} exited {rc}:\n{out[-3000:]}")
            check(("CUDA graphs" in out) == graphs, f"{prog}: the start line's 'CUDA graphs'")
            logs[graphs] = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        eager, graphed = logs[False], logs[True]
        check(len(eager) == len(graphed) and len(eager) > 3, f"{prog}: records {eager} / {graphed}")
        for e, g in zip(eager, graphed):
            for key in ("loss", "val_loss", "test_loss"):
                if key in e:
                    rel = abs(e[key] - g.get(key, float("nan"))) / max(abs(e[key]), 1e-9)
                    check(rel <= 1e-3, f"{prog} step {e['step']}: {key} {e[key]} eager, "
                          f"{g.get(key)} graphed")
            if "lr" in e:
                check(e["lr"] == g.get("lr"), f"{prog} step {e['step']}: lr {e['lr']} / {g.get('lr')}")
        print(f"{prog}: {len(eager)} records agree: "
              + ", ".join(f"{r.get('loss', r.get('val_loss', r.get('test_loss')))}" for r in graphed))

print("FAILED" if fails else "ok")
sys.exit(1 if fails else 0)
