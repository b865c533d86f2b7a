#!/usr/bin/env python3
"""Data-parallel scaling on an N-GPU machine, Tally next to PyTorch, in one call:
Tally's examples/train_ddp and PyTorch's DDP (bench/ddp_torch.py) at 1 GPU and at N GPUs,
for ResNet-50 (synthetic 224x224, batch 64 per GPU) and GPT-2 124M (synthetic tokens,
T=1024, batch 8 per GPU). Both sides are started by tools/tally_launch, which sets
torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
Prints throughput, scaling efficiency = throughput_N / (N * throughput_1) for each, and
the Tally / PyTorch throughput ratios.

    python3 bench/ddp.py BUILD_DIR [--gpus N] [--models resnet50,gpt2] [--steps 20]
                         [--resnet-amp off] [--gpt-amp bf16] [--no-torch]
"""
import argparse
import json
import os
import re
import subprocess
import sys

from table import print_header

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAUNCH = os.path.join(ROOT, "tools", "tally_launch")

WORKLOADS = {
    "resnet50": {"batch": 64, "extra": []},
    "gpt2": {"batch": 8, "extra": ["--seq", "1024"]},
}


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
        return sum(1 for l in out.splitlines() if l.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def parse_result(text):
    """The RESULT line of rank 0 (with or without the launcher's "[rank0] " prefix)."""
    for line in text.splitlines()[::-1]:
        m = re.search(r"RESULT (.*)$", line)
        if m:
            kv = dict(item.split("=", 1) for item in m.group(1).split())
            for k in ("step_ms", "throughput", "peak_alloc_mib", "peak_reserved_mib", "comm_mib"):
                if k in kv:
                    kv[k] = float(kv[k])
            return kv
    return None


def run(cmd, log, timeout):
    print("$", " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ)
        text = p.stdout + p.stderr
        rc = p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n" + text + "\n")
    r = parse_result(text)
    if r is None:
        print(f"  no RESULT (exit {rc}); last lines:\n" + "\n".join(text.splitlines()[-15:]), flush=True)
    else:
        print(f"  {r['throughput']:.0f} {r['unit']} at {r['step_ms']:.1f} ms/step", flush=True)
    return r


def launch(n, prog):
    # The launcher for N > 1; a single process runs directly (world size 1, no NCCL).
    return [sys.executable, LAUNCH, "--nproc-per-node", str(n), "--master-port", "0"] + prog if n > 1 else prog


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("build", help="Tally's build folder (with examples/train_ddp)")
    p.add_argument("--gpus", type=int, default=0, help="N (0: all visible GPUs)")
    p.add_argument("--models", default="resnet50,gpt2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--resnet-amp", default="off", choices=["off", "fp16", "bf16"])
    p.add_argument("--gpt-amp", default="bf16", choices=["off", "fp16", "bf16"])
    p.add_argument("--no-torch", action="store_true", help="Tally only")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for ddp_bench.log / ddp_bench.json")
    a = p.parse_args()

    n = a.gpus or gpu_count()
    if n < 1:
        print("no GPU visible")
        return 77
    exe = os.path.join(a.build, "examples", "train_ddp")
    if not os.path.exists(exe):
        print(f"{exe} not found: build the train_ddp target first")
        return 1
    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, "ddp_bench.log")
    open(log, "w").close()
    worlds = [1] if n == 1 else [1, n]
    rows = []
    for model in a.models.split(","):
        if model not in WORKLOADS:
            print(f"unknown model {model}: expected one of {', '.join(WORKLOADS)}")
            return 2
        w = WORKLOADS[model]
        amp = a.gpt_amp if model == "gpt2" else a.resnet_amp
        common = ["--model", model, "--batch", str(w["batch"]), "--steps", str(a.steps), "--warmup",
                  str(a.warmup), "--amp", amp] + w["extra"]
        for world in worlds:
            row = {"model": model, "world": world, "amp": amp, "batch_per_gpu": w["batch"]}
            row["tally"] = run(launch(world, [exe] + common), log, a.timeout)
            if not a.no_torch:
                row["torch"] = run(launch(world, [sys.executable, os.path.join(HERE, "ddp_torch.py")] + common),
                                   log, a.timeout)
            rows.append(row)

    def tput(model, world, side):
        for r in rows:
            if r["model"] == model and r["world"] == world and r.get(side):
                return r[side]["throughput"]
        return None

    def fmt(x, spec):
        return format(x, spec) if x is not None else "-"

    print_header(f"{'model':10} {'amp':5} {'N':>3} | {'tally /s':>12} {'eff':>6} {'ms':>8} | "
                 f"{'torch /s':>12} {'eff':>6} {'ms':>8} | {'tally/torch':>11}")
    summary = []
    for r in rows:
        m, world = r["model"], r["world"]
        t, q = r.get("tally"), r.get("torch")
        t1, q1 = tput(m, 1, "tally"), tput(m, 1, "torch")
        t_eff = t["throughput"] / (world * t1) if t and t1 else None
        q_eff = q["throughput"] / (world * q1) if q and q1 else None
        ratio = t["throughput"] / q["throughput"] if t and q else None
        unit = (t or q or {}).get("unit", "")
        print(f"{m:10} {r['amp']:5} {world:3d} | {fmt(t and t['throughput'], '12.0f')} {fmt(t_eff, '6.3f')} "
              f"{fmt(t and t['step_ms'], '8.1f')} | {fmt(q and q['throughput'], '12.0f')} {fmt(q_eff, '6.3f')} "
              f"{fmt(q and q['step_ms'], '8.1f')} | {fmt(ratio, '11.3f')}   {unit}")
        summary.append({**r, "tally_efficiency": t_eff, "torch_efficiency": q_eff, "tally_over_torch": ratio})
    print("\nefficiency = throughput_N / (N * throughput_1); tally/torch = Tally's throughput over PyTorch's")
    for r in rows:
        if r.get("tally") and "comm_mib" in r["tally"]:
            print(f"tally {r['model']} N={r['world']}: peak allocated {r['tally']['peak_alloc_mib']:.0f} MiB, "
                  f"communication (buckets) {r['tally']['comm_mib']:.0f} MiB")
    with open(os.path.join(a.out, "ddp_bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("JSON " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
