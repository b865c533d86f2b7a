#!/usr/bin/env python3
"""Bad command lines and environments of every example program (and bench/bench_train) fail
fast and cleanly.

    test_cli_errors.py BUILD_DIR

Each bad invocation must exit 2 (never a signal: returncode < 0), print one message that
starts with the program's name and names the flag or variable, and do no work: it runs in an
empty folder that must stay empty (no snapshot, report or output folder written), within a
few seconds. A few boundary values that are valid must still run (the validators are not too
strict), and --help exits 0.
"""
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ex = os.path.join(os.path.abspath(sys.argv[1]), "examples")
tmp = tempfile.mkdtemp(prefix="tally_cli_errors_")

# Fixtures: an MNIST folder whose IDX files hold 0 images, a text too short for a GPT
# sequence, a plain file where a folder is expected.
empty_mnist = os.path.join(tmp, "empty_mnist")
os.makedirs(empty_mnist)
for prefix in ("train", "t10k"):
    with open(os.path.join(empty_mnist, f"{prefix}-images-idx3-ubyte"), "wb") as f:
        f.write(struct.pack(">IIII", 0x803, 0, 28, 28))
    with open(os.path.join(empty_mnist, f"{prefix}-labels-idx1-ubyte"), "wb") as f:
        f.write(struct.pack(">II", 0x801, 0))
short_text = os.path.join(tmp, "short.txt")
with open(short_text, "w") as f:
    f.write("Q: why? A: because. " * 15)  # 300 bytes: the validation split has 30 tokens
a_file = os.path.join(tmp, "a_file")
open(a_file, "w").close()

BENCH_TRAIN = "../bench/bench_train"  # bench/, beside examples/ in the build tree
NO_DIR = "/nonexistent/dir/out.pickle"  # the folder does not exist
PROC = "/proc/tally_cli_test.pickle"  # the folder exists but takes no new file, even for root
BAD_CONF = {"TALLY_ALLOC_CONF": "max_split_size_mb:abc"}
BAD_OOM = {"TALLY_ALLOC_CONF": "oom_snapshot:/nonexistent/dir/oom.pickle"}
CPU = ["--device", "cpu"]
SNAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "memory", "fixtures",
                    "torch211-snapshot-pending-free.pickle")  # PyTorch's own snapshot


def bad_values(prog, values, base=()):
    """Cases of a flag given a bad value (None: no value at all), whose error must name the flag."""
    return [([prog, *base, flag] + ([] if v is None else [v]), flag, {}) for flag, vs in values.items() for v in vs]


# (program and arguments, text the error must contain, extra environment)
cases = [
    # ---- train_resnet
    *bad_values("train_resnet", {
        "--log-every": ["0"], "--eval-batches": ["-1"], "--batch": ["0", "abc", "99999999999999999999", None],
        "--epochs": ["0"], "--steps": ["-1"], "--lr": ["nan", "inf", "-0.1", "0", ""], "--momentum": ["1.5"],
        "--weight-decay": ["nan"], "--seed": ["-1"], "--image-size": ["-4"], "--optimizer": ["rmsprop"],
        "--dataset": ["imagenet"],
    }),
    (["train_resnet", "--checkpoint", "auto"], "--memory-budget", {}),
    (["train_resnet", "--checkpoint", "auto", "--memory-budget", "-1GiB"], "--memory-budget", {}),
    (["train_resnet", "--checkpoint", "auto", "--memory-budget", "lots"], "--memory-budget", {}),
    (["train_resnet", "--memory-budget", "1GiB"], "--memory-budget", {}),
    (["train_resnet", "--amp", "auto"], "--amp", {}),
    (["train_resnet", "--offload", "everything"], "--offload", {}),
    (["train_resnet", "--offload", "0-blocks"], "--offload", {}),
    (["train_resnet", "--offload", "auto"], "--offload", {}),  # needs --checkpoint auto
    (["train_resnet", "--dataset", "synthetic", "--offload", "99-blocks", "--steps", "1"], "99-blocks", {}),
    (["train_resnet", "--step-in-backward", "--amp", "fp16"], "--step-in-backward", {}),
    (["train_gpt", "--optimizer", "rmsprop"], "--optimizer: expected one of adamw, adamw8bit, sgd", {}),
    (["train_gpt", "--step-in-backward", "--clip", "1"], "--clip", {}),
    (["train_gpt", "--step-in-backward", "--amp", "fp16"], "--amp fp16", {}),
    (["train_gpt", "--step-in-backward", "--grad-accum", "2"], "--grad-accum 2 with --step-in-backward", {}),
    (["train_gpt", "--overlap-update"], "--overlap-update defers a host optimizer's updates", {}),
    (["train_resnet", "--overlap-update", "--optimizer", "adam"],
     "it needs --optimizer adamw:cpu or adamw8bit:cpu, got adam", {}),
    (["train_resnet", "--grad-accum", "0"], "--grad-accum", {}),
    (["train_gpt", "--offload", "activations,blocks"], "--offload", {}),
    # --cuda-graphs: what a replayed step cannot do is refused before any work.
    (["train_resnet", "--cuda-graphs"], "--cuda-graphs captures CUDA work: it needs --device cuda", {}),
    (["train_gpt", "--cuda-graphs", "--estimate", "h200"], "--cuda-graphs with --estimate", {}),
    (["train_resnet", "--cuda-graphs", "--device", "cuda", "--optimizer", "adamw8bit"],
     "--cuda-graphs with --optimizer adamw8bit", {}),
    (["train_gpt", "--cuda-graphs", "--device", "cuda", "--optimizer", "adamw:cpu"],
     "--cuda-graphs with --optimizer adamw:cpu: its update runs on the host", {}),
    (["train_gpt", "--cuda-graphs", "--device", "cuda", "--step-in-backward"],
     "--cuda-graphs with --step-in-backward", {}),
    (["train_resnet", "--cuda-graphs", "--device", "cuda", "--offload", "activations"],
     "--cuda-graphs with --offload", {}),
    (["train_gpt", "--data", "synthetic", "--checkpoint", "auto", "--memory-budget", "1KiB"],
     "--memory-budget", {}),
    (["train_gpt", "--checkpoint", "auto", "--memory-budget", "0"], "--memory-budget", {}),
    (["ab_memory", "--checkpoint", "none,auto"], "--memory-budget", {}),
    (["ab_memory", "--host-memory", "lots"], "--host-memory", {}),
    (["train_gpt", "--host-memory", "64GiB"], "--host-memory applies to a dry run", {}),
    (["train_gpt", "--estimate", "h200", "--host-memory", "lots"], "--host-memory", {}),
    (["ab_memory", "--host-memory", "0"], "--host-memory", {}),
    (["ab_memory", "--optimizer", "adamw:gpu"], "--optimizer", {}),
    (["train_resnet", "--estimate", "tpu-v9"], "--estimate", {}),
    (["train_resnet", "--estimate", "h200", "--device", "cpu"], "--estimate", {}),
    (["train_gpt", "--estimate", "a100"], "--estimate", {}),
    (["train_resnet", "--memory-limit", "lots"], "--memory-limit", {}),
    (["train_resnet", "--memory-limit", "0"], "--memory-limit", {}),
    (["train_gpt", "--memory-limit", "1000TiB"], "--memory-limit", {}),
    (["train_gpt", "--estimate", "h200", "--memory-limit", "1GiB"], "--memory-limit", {}),
    (["train_gpt", "--estimate", "cpu", "--device", "cpu"], "--estimate", {}),
    (["ab_memory", "--estimate", "gpu9000"], "--estimate", {}),
    (["ab_memory", "--estimate", "h200", "--device", "cpu"], "--estimate", {}),
    (["train_resnet", "--no-such-flag"], "--no-such-flag", {}),
    (["train_resnet", "--momentum", "0.5", "--optimizer", "adam"], "--momentum", {}),
    (["train_resnet", "--image-size", "30"], "--image-size", {}),  # 28 does not divide 30
    (["train_resnet", "--snapshot", NO_DIR], "--snapshot", {}),
    (["train_resnet", "--snapshot", PROC], "--snapshot", {}),
    (["train_resnet", "--snapshot", tmp], "--snapshot", {}),  # a folder
    (["train_resnet", "--batch", "100000"], "--batch", {}),  # larger than the 60000 examples
    (["train_resnet", "--dataset", "mnist", "--data-root", empty_mnist, "--steps", "5"], "--data-root", {}),
    (["train_resnet", "--dataset", "synthetic", "--data-root", tmp], "--data-root", {}),
    (["train_resnet", "stray"], "stray", {}),
    (["train_resnet"], "TALLY_ALLOC_CONF", BAD_CONF),
    (["train_resnet"], "TALLY_ALLOC_CONF", BAD_OOM),
    (["train_resnet", "--amp", "fp8"], "--amp: expected off, fp16 or bf16, got 'fp8'", {}),
    (["train_resnet", "--checkpoint", "3-chunks"], "--checkpoint: expected none, blocks, N-blocks", {}),
    (["train_resnet", "--device", "tpu"], "--device: expected cpu or cuda, got 'tpu'", {}),
    (["train_resnet", "--arch", "vgg"], "--arch: expected tiny, resnet18, resnet34 or resnet50, got 'vgg'", {}),
    (["train_resnet", "--dataset", "cifar10"], "--dataset cifar10 needs --data-root", {}),
    (["train_resnet", "--dataset", "mnist", "--data-root", "/nonexistent"], "--data-root", {}),
    # ---- train_gpt
    *bad_values("train_gpt", {
        "--log-every": ["0"], "--eval-batches": ["0"], "--steps": ["0"], "--batch": ["0"], "--seq": ["-1"],
        "--lr": ["nan", "-1e-3"], "--clip": ["nan", "-1"], "--weight-decay": ["inf"], "--sample": ["-1"],
        "--preset": ["huge"], "--seed": ["1.5"],
    }),
    (["train_gpt", "--vocab", "512"], "--vocab", {}),  # text data has 256 byte tokens
    (["train_gpt", "--data", "synthetic", "--sample", "10"], "--sample", {}),
    (["train_gpt", "--data", short_text], "--seq", {}),  # the validation split is too short
    (["train_gpt", "--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt", {}),
    (["train_gpt", "--preset", "tiny", "--seq", "4096"], "exceeds the preset's block size", {}),
    (["train_gpt", "--snapshot", NO_DIR], "--snapshot", {}),
    (["train_gpt"], "TALLY_ALLOC_CONF", BAD_CONF),
    # ---- train_ddp
    *bad_values("train_ddp", {
        "--steps": ["0"], "--warmup": ["-1"], "--lr": ["nan"], "--batch": ["-1"], "--image-size": ["0"],
        "--bucket-cap-mb": ["0", "nan"], "--first-bucket-cap-mb": ["-1"], "--seq": ["16"], "--snapshot": [PROC],
    }, base=[*CPU, "--model", "tiny"]),
    (["train_ddp", *CPU, "--model", "gpt-tiny", "--seq", "4096"], "--seq", {}),
    (["train_ddp", *CPU, "--model", "tiny"], "WORLD_SIZE", {"WORLD_SIZE": "abc"}),
    (["train_ddp", *CPU, "--model", "tiny"], "RANK", {"WORLD_SIZE": "2", "RANK": "3"}),
    (["train_ddp", *CPU, "--model", "tiny"], "MASTER_PORT", {"MASTER_PORT": "70000"}),
    (["train_ddp", *CPU, "--model", "tiny"], "TALLY_ALLOC_CONF", BAD_CONF),
    (["train_ddp", "--device", "cpu", "--model", "vit"], "--model: expected resnet50, resnet18, tiny", {}),
    (["train_ddp", "--device", "cpu", "--model", "tiny", "--amp", "fp8"], "--amp: expected off, fp16 or bf16", {}),
    # ---- ab_memory
    *bad_values("ab_memory", {
        "--batch": ["0"], "--steps": ["1"], "--lr": ["nan"], "--image-size": ["-1"],
        "--checkpoint": ["none,bogus", ","], "--arch": ["vgg"], "--out": ["/proc/tally_ab"],
        "--grad-accum": ["0", "x", "64"], "--rounds": ["-1"],
    }),
    (["ab_memory", "--amp", "off,fp8"], "--amp", {}),
    (["ab_memory", "--alloc-conf", "default", "--alloc-conf", "bogus_key:1"], "--alloc-conf 'bogus_key:1'", {}),  # the bad second value fails before the first runs
    (["ab_memory", "--model", "mycnn"], "--model: unknown model 'mycnn' (expected resnet | gpt | llama", {}),
    (["ab_memory", "--step-in-backward", "on", "--amp", "off", "--grad-accum", "2"], "grad_accum 2", {}),
    (["ab_memory", "--model", "gpt", "--dataset", "fashion-mnist"], "--dataset", {}),
    (["ab_memory", "--model", "gpt", "--seq", "4096"], "--seq", {}),
    (["ab_memory", "--model", "gpt", "--preset", "huge"], "--preset", {}),
    (["ab_memory", "--model", "gpt", "--arch", "resnet18"], "--arch", {}),
    (["ab_memory", "--preset", "gpt2"], "--preset", {}),  # --model resnet has no preset
    (["ab_memory", "--fused-classifier"], "--fused-classifier applies to token models only", {}),
    (["ab_memory", "--out", a_file], "--out", {}),
    (["ab_memory"], "TALLY_ALLOC_CONF", BAD_CONF),
    # ---- memory_demo
    *bad_values("memory_demo", {
        "--steps": ["abc", "0", None], "--device": ["tpu"],
    }),
    (["memory_demo", "--bogus"], "--bogus", {}),
    (["memory_demo", *CPU, "--snapshot", NO_DIR], "--snapshot", {}),
    (["memory_demo", *CPU], "TALLY_ALLOC_CONF", BAD_CONF),
    (["memory_demo", *CPU], "TALLY_ALLOC_CONF", {"TALLY_ALLOC_CONF": "no_such_key:1"}),
    # ---- profile_demo
    *bad_values("profile_demo", {
        "--steps": ["abc"], "--batch": ["0"], "--out": ["/nonexistent/dir/prof"],
    }, base=CPU),
    (["profile_demo", *CPU, "--steps", "3"], "--steps", {}),  # the schedule records steps 3 and 4
    (["profile_demo", "--device", "tpu"], "--device", {}),
    (["profile_demo", "--bogus"], "--bogus", {}),
    (["profile_demo", *CPU], "TALLY_ALLOC_CONF", BAD_CONF),
    # ---- equivalence_dump
    (["equivalence_dump"], "--model", {}),
    (["equivalence_dump", "--model", "resnet_tiny"], "--out", {}),
    (["equivalence_dump", "--model", "vgg", "--out", "eq"], "--model", {}),
    (["equivalence_dump", "--model", "resnet_tiny", "--out", "eq", "--batch", "0"], "--batch", {}),
    (["equivalence_dump", "--model", "resnet_tiny", "--out", "eq", "--seed", "-1"], "--seed", {}),
    (["equivalence_dump", "--model", "resnet_tiny", "--out", "eq", "--device", "tpu"], "--device", {}),
    (["equivalence_dump", "--model", "resnet_tiny", "--out", "/proc/tally_eq"], "--out", {}),
    (["equivalence_dump", "--model", "resnet_tiny", "--out", a_file], "--out", {}),
    (["equivalence_dump", "--model", "resnet_tiny", "--out", "eq"], "TALLY_ALLOC_CONF", BAD_CONF),
    # ---- memory_patterns
    *bad_values("memory_patterns", {
        "--pattern": ["bogus"], "--layers": ["0"], "--batch": ["0"], "--seq": ["0"], "--leak-steps": ["1"],
        "--frag-steps": ["0"], "--max-split-mb": ["5"], "--device": ["tpu"],
        "--out": ["/proc/tally_patterns"],
    }),
    (["memory_patterns"], "TALLY_ALLOC_CONF", BAD_CONF),
    # ---- profile_models
    *bad_values("profile_models", {
        "--steps": ["0"], "--warmup": ["-1"], "--resnet-batch": ["0"], "--gpt-batch": ["abc"],
        "--models": ["resnet,vitx", ","], "--preset": ["huge"], "--batch": ["0"], "--seq": ["-1"],
        "--out": ["/proc/tally_prof"], "--rounds": ["0", "101"],
        "--activities": ["gpu", ","], "--options": ["heap", "none,memory", ""],
    }, base=CPU),
    (["profile_models", *CPU, "--options", "memory,heap"],
     "--options: expected a comma list of memory, shapes, stack or none, got 'heap'", {}),
    (["profile_models", *CPU, "--activities", "cuda"],
     "--activities: the profiler always records the CPU's ops (cpu or cpu,cuda), got 'cuda'", {}),
    (["profile_models", *CPU, "--small", "--resnet-batch", "8"], "--resnet-batch", {}),
    (["profile_models", *CPU, "--models", "vit", "--preset", "huge"], "--models vit: ", {}),
    (["profile_models", *CPU, "--amp", "fp8"], "--amp: expected off, fp16 or bf16, got 'fp8'", {}),
    (["profile_models", "--device", "meta:tpu"], "--device meta:tpu: unknown target device 'tpu'", {}),
    (["profile_models", *CPU, "--models", "resnet", "--fused-classifier"],
     "--fused-classifier applies to GPT", {}),
    (["profile_models", *CPU], "TALLY_ALLOC_CONF", BAD_CONF),
    # ---- tally_memdiff (bad snapshots: tests/examples/test_memdiff.py)
    (["tally_memdiff"], "A is required", {}),
    (["tally_memdiff", SNAP], "B is required", {}),
    *bad_values("tally_memdiff", {"--top": ["-1", "abc", None], "--device": ["-1"],
                                  "--html": [NO_DIR, PROC], "--json": [NO_DIR, a_file + "/x"]},
                base=[SNAP, SNAP]),
    (["tally_memdiff", SNAP, "missing.pickle"], "missing.pickle: cannot open", {}),
    (["tally_memdiff", a_file, SNAP], "a_file: empty file: not a pickle", {}),
    (["tally_memdiff", SNAP, SNAP], "TALLY_ALLOC_CONF", BAD_CONF),
    # ---- bench/bench_train (checked before it looks for a GPU)
    ([BENCH_TRAIN, "--gpt", "--configs", "gpt:ckpt-per-blok"], "unknown token 'ckpt-per-blok'", {}),
    ([BENCH_TRAIN, "--configs", "amp-bf16,ckpt-per-blok"], "'ckpt-per-blok' is not a configuration", {}),
    ([BENCH_TRAIN, "--gpt", "--configs", "amp-bf16+fusedce"], "levers take their model's prefix", {}),
    ([BENCH_TRAIN, "--resnet", "--configs", "ckpt-per-block"], "not a configuration", {}),
    ([BENCH_TRAIN, "--resnet", "--configs", "gpt:amp-bf16"], "needs --gpt", {}),
    ([BENCH_TRAIN, "--configs", "vit:amp-bf16"], "the prefix is resnet: or gpt:", {}),
    ([BENCH_TRAIN, "--configs", "gpt:"], "names no tokens", {}),
    ([BENCH_TRAIN, "--gpt", "--configs", "gpt:amp-bf16+channels-last"], "channels-last is ResNet's", {}),
    *bad_values(BENCH_TRAIN, {"--steps": ["0", "abc", "99999999999999999999"]}),
    ([BENCH_TRAIN, "--model", "bogus"], "--model", {}),
    ([BENCH_TRAIN, "--model", "lstm", "--preset", "huge"], "--preset", {}),
    ([BENCH_TRAIN, "--model", "lstm", "--image-size", "8"], "--image-size applies to image models", {}),
    ([BENCH_TRAIN, "--model", "vit", "--amp", "fp8"], "--amp", {}),
    ([BENCH_TRAIN, "--model", "vit", "--gpt"], "--model runs one registry model", {}),
    ([BENCH_TRAIN, "--batch", "2"], "apply to --model", {}),
    *bad_values(BENCH_TRAIN, {"--batch": ["0"], "--warmup": ["-1"]}, ["--model", "lstm"]),
]

# Valid boundary values that must still run (exit 0), and the files they must write.
good = [
    (["memory_demo", *CPU, "--steps", "1", "--snapshot", "m.pickle"], ["m.pickle"]),
    (["profile_demo", *CPU, "--steps", "4", "--batch", "1", "--out", "p"],
     ["p.trace.json", "p.timeline.json", "p.timeline.html", "p.pickle"]),
    (["train_gpt", "--data", "synthetic", "--steps", "1", "--batch", "1", "--seq", "8", "--log-every", "1",
      "--eval-batches", "1", "--lr", "1e-300", "--clip", "0", "--weight-decay", "0", "--seed", "18446744073709551615",
      "--snapshot", "g.pickle"], ["g.pickle"]),
    (["train_resnet", "--dataset", "synthetic", "--steps", "1", "--batch", "1", "--image-size", "8",
      "--eval-batches", "1", "--log-every", "1", "--momentum", "0"], []),
    (["train_resnet", "--dataset", "synthetic", "--steps", "1", "--batch", "2", "--image-size", "8",
      "--eval-batches", "1", "--channels-last"], []),
    (["train_resnet", "--dataset", "synthetic", "--batch", "2", "--image-size", "8", "--channels-last",
      "--estimate", "h200"], []),
    (["train_resnet", "--help"], []),
    (["tally_memdiff", SNAP, SNAP, "--top", "0", "--html", "d.html", "--json", "d.json"], ["d.html", "d.json"]),
    (["equivalence_dump", "--help"], []),
    ([BENCH_TRAIN, "--resnet", "--steps", "1", "--configs", "amp-bf16,resnet:amp-bf16+tuned"], []),
    ([BENCH_TRAIN, "--resnet", "--steps", "1", "--configs", "resnet:amp-fp16+channels-last"], []),
    ([BENCH_TRAIN, "--model", "lstm", "--device", "cpu", "--batch", "2", "--seq", "8", "--steps", "1",
      "--warmup", "0"], []),
    # --estimate: a dry run for a CUDA target on this machine, its snapshot the only file.
    (["train_gpt", "--data", "synthetic", "--batch", "2", "--seq", "16", "--amp", "bf16",
      "--estimate", "h200", "--snapshot", "e.pickle"], ["e.pickle"]),
    (["train_resnet", "--dataset", "synthetic", "--batch", "2", "--image-size", "8",
      "--checkpoint", "blocks", "--estimate", "cpu"], []),
    (["train_gpt", "--data", "synthetic", "--batch", "2", "--seq", "16", "--optimizer", "adamw:cpu",
      "--estimate", "h200", "--host-memory", "64GiB"], []),
    (["train_gpt", "--data", "synthetic", "--batch", "2", "--seq", "16", "--checkpoint", "auto",
      "--memory-budget", "64MiB", "--amp", "auto", "--estimate", "h200"], []),
    # Gradient accumulation: 2 micro-batches a step, run and dry-run.
    (["train_gpt", "--data", "synthetic", "--batch", "2", "--seq", "16", "--steps", "2",
      "--grad-accum", "2"], []),
    (["train_resnet", "--dataset", "synthetic", "--steps", "1", "--batch", "2", "--image-size", "8",
      "--eval-batches", "1", "--grad-accum", "2"], []),
    (["train_gpt", "--data", "synthetic", "--batch", "4", "--seq", "16", "--grad-accum", "2",
      "--estimate", "h200"], []),
]


def run(args, env_extra):
    """Runs one invocation in a fresh empty folder: (returncode, output, seconds, files left)."""
    cwd = tempfile.mkdtemp(dir=tmp, prefix="run_")
    env = dict(os.environ)
    for k in ("TALLY_ALLOC_CONF", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(env_extra)
    t0 = time.monotonic()
    try:
        p = subprocess.run([os.path.join(ex, args[0])] + args[1:], capture_output=True, text=True,
                           timeout=120, env=env, cwd=cwd)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", str(e.stdout or ""), str(e.stderr or "")
    return rc, out, err, time.monotonic() - t0, sorted(os.listdir(cwd))


def check_bad(case):
    args, want, env_extra = case
    rc, out, err, secs, left = run(args, env_extra)
    prog = os.path.basename(args[0])
    lines = err.strip().splitlines()
    last = lines[-1] if lines else ""
    why = []
    if rc != 2:
        why.append(f"exit {rc} (a signal if negative), expected 2")
    if not last.startswith(prog):
        why.append(f"the last line of stderr does not start with '{prog}'")
    if want not in last:
        why.append(f"'{want}' is not in the message")
    if left:
        why.append(f"it wrote {left} (work started before the error)")
    if secs > 30:
        why.append(f"it took {secs:.1f} s (not a fast failure)")
    env_s = " ".join(f"{k}={v}" for k, v in env_extra.items())
    name = f"{env_s + ' ' if env_s else ''}{' '.join(args)}"
    if why:
        return False, f"FAIL: {name}: {'; '.join(why)}\n  stdout: {out[-400:]!r}\n  stderr: {err[-600:]!r}"
    return True, f"ok ({secs:.1f} s): {name} -> {last}"


def check_good(case):
    args, files = case
    rc, out, err, secs, left = run(args, {})
    missing = [f for f in files if f not in left]
    if rc != 0 or missing:
        return False, f"FAIL (valid input): {' '.join(args)}: exit {rc}, missing {missing}\n  stderr: {err[-600:]!r}"
    return True, f"ok ({secs:.1f} s, valid): {' '.join(args)}"


# bench/ is built only with TALLY_BUILD_BENCH and Google Benchmark: without it, its cases go.
if not os.path.exists(os.path.join(ex, BENCH_TRAIN)):
    print("bench/bench_train is not built: its cases are skipped")
    cases = [c for c in cases if c[0][0] != BENCH_TRAIN]
    good = [g for g in good if g[0][0] != BENCH_TRAIN]
t0 = time.monotonic()
with ThreadPoolExecutor(max_workers=4) as pool:
    results = list(pool.map(check_bad, cases)) + list(pool.map(check_good, good))
# bench/'s scripts: a bad command line exits 2 before any measuring (train.py's through
# bench_train's own check, so it needs bench_train built).
src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
build = os.path.abspath(sys.argv[1])
scripts = [
    (["levers.py", build, "gpt", "--only", "bogus"], "--only 'bogus' names no lever of gpt"),
    (["levers.py", build, "--steps", "0"], "--steps takes an integer"),
    (["levers.py", build, "gpt", "--frob"], "unknown argument '--frob'"),
    (["train.py", build, "--only", "llama,bogus"], "--only: unknown row(s) bogus"),
]
if os.path.exists(os.path.join(ex, BENCH_TRAIN)):
    scripts.append((["train.py", build, "gpt", "--configs", "gpt:bogus"],
                    "bench_train refused the command line"))
for args, want in scripts:
    p = subprocess.run([sys.executable, os.path.join(src, "bench", args[0])] + args[1:],
                       capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    ok = p.returncode == 2 and last.startswith(args[0]) and want in last
    results.append((ok, f"{'ok' if ok else 'FAIL'}: bench/{' '.join(args)} -> exit {p.returncode}: "
                        f"{last if ok else p.stderr[-600:]!r}"))
# bench/train.py's registry rows on the CPU (--smoke: a tiny preset, no PyTorch): the plumbing
# from bench_train --model to the table.
if os.path.exists(os.path.join(ex, BENCH_TRAIN)):
    args = ["train.py", build, "--only", "lstm", "--smoke"]
    p = subprocess.run([sys.executable, os.path.join(src, "bench", args[0])] + args[1:],
                       capture_output=True, text=True, timeout=120)
    ok = p.returncode == 0 and "lstm-tiny-B2T16" in p.stdout and "floor ms" in p.stdout
    results.append((ok, f"{'ok' if ok else 'FAIL'} (valid): bench/{' '.join(args)} -> exit "
                        f"{p.returncode}{'' if ok else ': ' + repr(p.stdout[-600:] + p.stderr[-600:])}"))
# The planner's micro-batches (the whole batch does not fit 31 MiB) change batch norm's
# statistics: the program says so, and prints the step the plan keeps.
args = ["train_resnet", "--dataset", "synthetic", "--batch", "64", "--image-size", "32",
        "--checkpoint", "auto", "--memory-budget", "31MiB", "--estimate", "cpu"]
rc, out, err, secs, _ = run(args, {})
note = re.search(r"the plan runs (\d+) micro-batches of (\d+) rows: batch norm \(bn1, \.\.\.\) "
                 r"takes its statistics", out)
step = re.search(r"^Step: 64 images of 3x32x32 per step in (\d+) micro-batches of (\d+)$", out, re.M)
ok = (rc == 0 and note is not None and step is not None and note.groups() == step.groups()
      and int(step[1]) * int(step[2]) == 64)
results.append((ok, f"{'ok' if ok else 'FAIL'} ({secs:.1f} s, valid): {' '.join(args)} "
                    f"{'says micro-batches change batch norm, and the step' if ok else repr(out[-600:] + err[-600:])}"))
fails = 0
for ok, msg in results:
    print(msg)
    fails += not ok
programs = {os.path.basename(c[0][0]) for c in cases}
print(f"{len(cases)} bad invocations of {len(programs)} programs, {len(good)} valid ones, "
      f"{fails} failures, {time.monotonic() - t0:.1f} s")
expected = {"train_resnet", "train_gpt", "train_ddp", "ab_memory", "memory_demo", "profile_demo",
            "equivalence_dump", "memory_patterns", "profile_models", "tally_memdiff"}
if any(c[0][0] == BENCH_TRAIN for c in cases):
    expected.add("bench_train")
if programs != expected:
    print(f"FAIL: the table must cover {sorted(expected)}, it covers {sorted(programs)}")
    fails += 1
shutil.rmtree(tmp, ignore_errors=True)
sys.exit(1 if fails else 0)
