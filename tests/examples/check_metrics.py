#!/usr/bin/env python3
"""--metrics FILE.jsonl on train_gpt and train_resnet: one JSON record per logged step plus the
final evaluation, read back by Python's json; a bad path fails before training, naming the flag.

    check_metrics.py BUILD_DIR
"""
import json
import math
import os
import subprocess
import sys
import tempfile

build = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


with tempfile.TemporaryDirectory() as d:
    # train_gpt: steps 4, 8, 12, then the validation.
    path = os.path.join(d, "gpt.jsonl")
    rc, out = run([os.path.join(build, "examples", "train_gpt"), "--preset", "tiny", "--steps", "12",
                   "--batch", "4", "--log-every", "4", "--eval-batches", "1", "--metrics", path])
    check(rc == 0, f"train_gpt exited {rc}:\n{out[-3000:]}")
    check(not [f for f in os.listdir(d) if ".tmp" in f], "train_gpt left a temporary file behind")
    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    check([r["step"] for r in records] == [4, 8, 12, 12], f"gpt steps {records}")
    for r in records[:-1]:
        for key in ("loss", "ms_per_step", "tokens_per_s", "lr", "peak_allocated", "peak_reserved"):
            check(key in r, f"gpt record lacks {key}: {r}")
        check(math.isfinite(r.get("loss", math.nan)) and r.get("loss", 0) > 0, f"gpt loss {r}")
        check(r.get("peak_allocated", 0) > 0, f"gpt peak {r}")
    check(records and "val_loss" in records[-1], f"gpt last record {records[-1:]}")
    # The progress bar's end: the total time.
    check("done: 12 steps in " in out, "train_gpt prints no 'done: 12 steps in'")

    # train_resnet: the tiny ResNet on a few batches of Fashion-MNIST (or synthetic data).
    path = os.path.join(d, "resnet.jsonl")
    rc, out = run([os.path.join(build, "examples", "train_resnet"), "--arch", "tiny", "--steps", "6",
                   "--batch", "16", "--log-every", "3", "--eval-batches", "1", "--metrics", path])
    if rc == 0:
        records = [json.loads(line) for line in open(path)]
        check([r["step"] for r in records][:2] == [3, 6], f"resnet steps {records}")
        check("test_accuracy" in records[-1], f"resnet last record {records[-1:]}")
        check(all(0 <= r.get("accuracy", 0) <= 1 for r in records), f"resnet accuracy {records}")
    else:
        check(False, f"train_resnet exited {rc}:\n{out[-3000:]}")

    # A path in a folder that does not exist: exit status 2-ish, the flag named, nothing run.
    rc, out = run([os.path.join(build, "examples", "train_gpt"), "--preset", "tiny", "--steps", "2",
                   "--metrics", os.path.join(d, "no", "such", "dir", "m.jsonl")])
    check(rc != 0 and "--metrics" in out and "step 1/" not in out,
          f"bad --metrics path: rc {rc}, output:\n{out[-2000:]}")

print("ok" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
