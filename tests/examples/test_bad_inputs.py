#!/usr/bin/env python3
"""The bad inputs left from the probe of issue 54, end to end through the example programs.

    test_bad_inputs.py BUILD_DIR

Each bad input exits 2 with one line "PROGRAM: message" naming the file, flag or key, before
any training (the run's folder stays empty); and ab_memory re-run into an earlier report's
folder either replaces the report whole or, when it fails part-way, leaves it untouched.
"""
import gzip
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile

ex = os.path.join(os.path.abspath(sys.argv[1]), "examples")
tmp = tempfile.mkdtemp(prefix="tally_bad_inputs_")
failures = []


def check(cond, what):
    print(("ok: " if cond else "FAIL: ") + what)
    if not cond:
        failures.append(what)
    return cond


def run(args, env_extra=None, cwd=None, timeout=300):
    cwd = cwd or tempfile.mkdtemp(dir=tmp, prefix="run_")
    env = {k: v for k, v in os.environ.items() if k not in ("TALLY_ALLOC_CONF", "WORLD_SIZE", "RANK")}
    env.update(env_extra or {})
    p = subprocess.run([os.path.join(ex, args[0])] + args[1:], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=cwd)
    return p, sorted(os.listdir(cwd))


def expect_error(args, wants, env_extra=None):
    p, left = run(args, env_extra)
    lines = p.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    name = " ".join(f"{k}={v}" for k, v in (env_extra or {}).items()) + " " + " ".join(args)
    ok = p.returncode == 2 and last.startswith(args[0]) and all(w in last for w in wants) and not left
    check(ok, f"{name.strip()} -> exit {p.returncode}: {last!r}"
              + ("" if ok else f" (wanted {wants}; left {left}; stdout {p.stdout[-300:]!r})"))


def mnist(name, rows, cols, images_as_dir=False):
    """A folder of MNIST IDX files: 2 images rows x cols (as the header says), labels 1, 2."""
    root = os.path.join(tmp, name)
    os.makedirs(root)
    for prefix in ("train", "t10k"):
        images = os.path.join(root, f"{prefix}-images-idx3-ubyte.gz")
        if images_as_dir:
            os.makedirs(images)
        else:
            with gzip.open(images, "wb") as f:
                f.write(struct.pack(">IIII", 0x803, 2, rows, cols) + bytes(2 * rows * cols))
        with gzip.open(os.path.join(root, f"{prefix}-labels-idx1-ubyte.gz"), "wb") as f:
            f.write(struct.pack(">II", 0x801, 2) + bytes([1, 2]))
    return root


TRAIN = ["train_resnet", "--device", "cpu", "--arch", "tiny", "--batch", "2", "--steps", "1"]
SYNTH = ["train_resnet", "--device", "cpu", "--arch", "tiny", "--dataset", "synthetic",
         "--image-size", "8", "--batch", "2", "--steps", "1", "--eval-batches", "1"]

# An IDX header of another image size than the dataset's (it used to train on scrambled
# images), and of 0x0 (it used to fail in conv2d): refused at the reader, naming the file.
scrambled = mnist("scrambled", 14, 56)
expect_error(TRAIN + ["--dataset", "fashion-mnist", "--data-root", scrambled],
             ["--data-root", os.path.join(scrambled, "train-images-idx3-ubyte.gz"),
              "gives 14x56 images, expected 28x28"])
empty_images = mnist("zero_by_zero", 0, 0)
expect_error(TRAIN + ["--dataset", "mnist", "--data-root", empty_images],
             [os.path.join(empty_images, "train-images-idx3-ubyte.gz"), "gives 0x0 images"])
# A file where a folder is expected, a folder where a file is expected: said as such.
a_file = os.path.join(tmp, "a_file")
open(a_file, "w").write("x")
expect_error(TRAIN + ["--dataset", "mnist", "--data-root", a_file], [a_file, "is not a directory (a file)"])
dir_images = mnist("images_are_a_folder", 28, 28, images_as_dir=True)
expect_error(TRAIN + ["--dataset", "mnist", "--data-root", dir_images], ["is a directory, not a file"])
expect_error(["train_gpt", "--device", "cpu", "--data", tmp], ["--data", tmp, "is a directory, not a file"])

# More segments than the model has stages: refused, naming the count.
expect_error(SYNTH + ["--checkpoint", "99-segments"], ["99-segments", "stages", "from 1 to"])

# TALLY_ALLOC_CONF: a key given twice, and divisions out of range.
expect_error(SYNTH, ["TALLY_ALLOC_CONF", "key 'max_split_size_mb' is given twice"],
             {"TALLY_ALLOC_CONF": "max_split_size_mb:64,max_split_size_mb:128"})
expect_error(SYNTH, ["roundup_power2_divisions", "at most 2^30"],
             {"TALLY_ALLOC_CONF": "roundup_power2_divisions:9223372036854775808"})

# An output that fails only when written (/dev/full) is found out before the run.
if os.path.exists("/dev/full"):
    expect_error(SYNTH + ["--snapshot", "/dev/full"], ["--snapshot /dev/full", os.strerror(28)])
    expect_error(SYNTH + ["--metrics", "/dev/full"], ["--metrics /dev/full"])
p, _ = run(SYNTH + ["--snapshot", "/dev/null"])
check(p.returncode == 0, f"--snapshot /dev/null still runs (exit {p.returncode}: {p.stderr[-300:]!r})")

# ab_memory into an earlier report's folder: a run that fails part-way leaves it whole.
AB = ["ab_memory", "--device", "cpu", "--model", "resnet", "--arch", "tiny", "--dataset", "synthetic",
      "--image-size", "8", "--batch", "2", "--steps", "2", "--amp", "off"]
out = os.path.join(tmp, "report")


def contents(folder):
    got = {}
    for d, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(d, f)
            got[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return got


def leftovers():
    return sorted(n for n in os.listdir(tmp) if n.startswith("report."))


p, _ = run(AB + ["--checkpoint", "none,blocks", "--out", out])
if check(p.returncode == 0, f"ab_memory first run (exit {p.returncode}: {p.stderr[-400:]!r})"):
    before = contents(out)
    check("report.html" in before and "ckpt_none_amp_off.pickle" in before and "diff/ckpt_blocks_amp_off.html" in before,
          f"the first report's files: {sorted(before)}")
    p, _ = run(AB + ["--checkpoint", "none,99-segments", "--out", out])
    check(p.returncode == 2 and "99-segments" in p.stderr, f"ab_memory fails part-way (exit {p.returncode})")
    check(contents(out) == before, "the failed run left the earlier report untouched")
    check(not leftovers(), f"no staging folder left: {leftovers()}")
    # A successful re-run replaces the report whole: the old configuration's files go, a file
    # of the user's (not one of the report's) stays, and the recorded paths name --out.
    open(os.path.join(out, "notes.txt"), "w").write("mine")
    p, _ = run(AB + ["--checkpoint", "blocks", "--out", out])
    check(p.returncode == 0, f"ab_memory re-run (exit {p.returncode}: {p.stderr[-400:]!r})")
    after = contents(out)
    check("ckpt_none_amp_off.pickle" not in after and "diff/ckpt_blocks_amp_off.html" not in after and "ckpt_blocks_amp_off.pickle" in after,
          f"the new report alone: {sorted(after)}")
    check(open(os.path.join(out, "notes.txt")).read() == "mine", "the user's own file is kept")
    results = open(os.path.join(out, "results.json")).read()
    check(os.path.join(out, "ckpt_blocks_amp_off.pickle") in results and ".tmp" not in results,
          "results.json names the files under --out")
    check(f"report: {out}/report.html" in p.stdout, "the printed report path is under --out")
    check(not leftovers(), f"no staging or old folder left: {leftovers()}")

shutil.rmtree(tmp, ignore_errors=True)
if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("bad inputs: OK")
