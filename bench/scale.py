#!/usr/bin/env python3
"""The largest models one GPU trains (issue 52), one row per model size, on the GPU machine:

    python3 bench/scale.py BUILD_DIR [--out DIR] [--only gpt2-large,gpt2-xl] [--steps N]
                                     [--no-torch] [--checkpoint SPEC] [--grad-accum K]
                                     [--overlap-update]

For each row, Tally's `train_gpt --optimizer adamw:cpu` (fp32 master weights and moments in
pinned host memory, optim/cpu_offload.h) under bf16 autocast:
  1. predicted: `--estimate cuda` (a dry run for this GPU): the device's peak reserved and the
     host's (the pinned state), from the estimate's report;
  2. measured: the same run on the GPU (`--metrics`): peak reserved on the device and in the
     pinned host allocator, step time (median of the steps after the first two), tokens/s, and
     model FLOPs utilisation against 790 TFLOP/s (bf16 dense, H200);
  3. PyTorch's nearest equivalent in the same call, in a child process per attempt
     (bench/torch_gpt.py's GPT of the same shape, bf16 autocast): plain fused AdamW on the
     device; if that runs out of memory, FSDP2 (`fully_shard`) at world size 1 with
     `CPUOffloadPolicy` (parameters, gradients and optimizer state on the host). Its device
     peak reserved, host peak (pinned, torch.cuda.host_memory_stats, else the process's VmHWM),
     step time and tokens/s.
Printed: one table row per model and the errors of the predicted peaks (targets: device within
2%, host within 5%), and the speed ratio against PyTorch (target >= 1.2x, or PyTorch cannot run
it). JSON of every row in OUT/scale.json.

--memory-budget SIZE: the planner chooses instead (`--checkpoint auto --memory-budget SIZE`, no
--optimizer: the optimizer stays on the device when it fits); its `Chosen:` line is printed
under the row and kept in scale.json.

--torch-host-memory GIB: the host memory PyTorch's FSDP2 row may take (default 128); a model
whose float32 weights, gradients and AdamW moments (16 bytes a parameter) exceed it, or the
device's memory for plain AdamW, is reported as one PyTorch cannot run, and not started.

--torch-timeout SECONDS: PyTorch's run stops there and its row reports the steps it finished
(each step prints its own line); without it the run has no limit.

--grad-accum K: K micro-batches of the row's batch a step (the batch is K times larger, one
optimizer step; PyTorch accumulates the same way). The host update is paid once a step, so
its share of the step falls as K grows. With --memory-budget, Tally gets the K-times-larger
batch and its planner picks the micro-batches; PyTorch still runs K of the row's batch.

--overlap-update: Tally's host optimizer leaves the updates not done when the last gradient
reaches the host to the next forward (CpuOffload::overlap_with_forward).

The LLaMA rows (1B, 3B, 7B, 13B) run `train_model --model llama --preset P` (its --optimizer
list must include adamw:cpu) and, for PyTorch, bench/models/llama.py's build(preset) and loss.
"""
import json
import os
import re
import statistics
import subprocess
import sys

PEAK_FLOPS = 790e12  # H200 bf16 dense, as the issue states
GIB = 1 << 30

# name: (Tally preset, layers, heads, width, vocabulary, batch, sequence)
GPT_ROWS = {
    "gpt2-large": ("gpt2-large", 36, 20, 1280, 50257, 8, 1024),
    "gpt2-xl": ("gpt2-xl", 48, 25, 1600, 50257, 8, 1024),
}
# LLaMA-style decoders (nn/models/llama.*, trained by examples/train_model): preset, layers,
# width, batch, sequence. The parameter count comes from the program's own banner.
LLAMA_ROWS = {
    "llama-1b": ("1b", 16, 2048, 8, 2048),
    "llama-3b": ("3b", 28, 3072, 4, 2048),
    "llama-7b": ("7b", 32, 4096, 4, 2048),
    "llama-13b": ("13b", 40, 5120, 2, 2048),
}


def gpt_params(L, d, V, T):
    """GPT-2's parameter count (tied embeddings): what 6N counts."""
    return V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d


def flops_per_token(n_params, L, d, T):
    """6N plus attention's 12 L T d (PaLM's appendix B)."""
    return 6 * n_params + 12 * L * T * d


def grad_accum():
    return int(sys.argv[sys.argv.index("--grad-accum") + 1]) if "--grad-accum" in sys.argv else 1


def torch_timeout():
    """--torch-timeout SECONDS: stop PyTorch's run there and report the steps it made."""
    return float(option("--torch-timeout")) if option("--torch-timeout") else None


def option(name):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def tally_command(build, row, extra):
    budget = option("--memory-budget")
    optimizer = ["--optimizer", "adamw:cpu"]
    if budget:  # the planner picks checkpointing, precision, micro-batches and the optimizer
        extra = [*extra, "--checkpoint", "auto", "--memory-budget", budget]
        optimizer = []
    elif "--checkpoint" in sys.argv:  # e.g. blocks: an 80 GB card needs it for the 7B row
        extra = [*extra, "--checkpoint", sys.argv[sys.argv.index("--checkpoint") + 1]]
    if "--overlap-update" in sys.argv:
        extra = [*extra, "--overlap-update"]
    k = grad_accum()
    if k > 1 and not budget:  # with a budget the planner splits the K-times-larger batch itself
        extra = [*extra, "--grad-accum", str(k)]
    if row in GPT_ROWS:
        preset, *_, batch, seq = GPT_ROWS[row]
        batch *= k
        return [os.path.join(build, "examples", "train_gpt"), "--preset", preset, "--data",
                "synthetic", "--batch", str(batch), "--seq", str(seq), "--amp", "bf16",
                *optimizer, *extra]
    preset, _, _, batch, seq = LLAMA_ROWS[row]
    batch *= k
    return [os.path.join(build, "examples", "train_model"), "--model", "llama", "--preset", preset,
            "--batch", str(batch), "--seq", str(seq), "--amp", "bf16", *optimizer, *extra]


def parse_estimate(text):
    """The device's and the host's predicted peak reserved (bytes) from Estimate::report."""
    dev = re.search(r"peak reserved\s+\S+ \S+\s+\((\d+) B", text)
    host = re.search(r"host peak\s+\S+ \S+\s+\((\d+) B reserved", text)
    return (int(dev.group(1)) if dev else None, int(host.group(1)) if host else None)


def run_tally(build, row, steps, out):
    pred = subprocess.run(tally_command(build, row, ["--estimate", "cuda", "--steps", "3"]),
                          capture_output=True, text=True)
    predicted = parse_estimate(pred.stdout + pred.stderr)
    metrics = os.path.join(out, f"{row}.jsonl")
    real = subprocess.run(tally_command(build, row, ["--device", "cuda", "--steps", str(steps),
                                                     "--log-every", "1", "--metrics", metrics]),
                          capture_output=True, text=True)
    if real.returncode != 0:
        return {"predicted": predicted, "error": (real.stderr or real.stdout)[-2000:]}
    banner = re.search(r"\(([0-9.]+) M parameters\)", real.stdout)
    records = [json.loads(line) for line in open(metrics) if line.strip()]
    steps_ = [r for r in records if "ms_per_step" in r and r.get("step", 0) > 2]
    # The last step's record (the validation's, after it, has no peaks).
    last = next((r for r in reversed(records) if "peak_reserved" in r), {})
    return {
        "predicted_device": predicted[0], "predicted_host": predicted[1],
        "device_peak": last.get("peak_reserved"), "host_peak": last.get("host_peak_reserved"),
        "ms_per_step": statistics.median(r["ms_per_step"] for r in steps_) if steps_ else None,
        "params": float(banner.group(1)) * 1e6 if banner else None,
        "plan": next((ln for ln in real.stdout.splitlines() if ln.startswith("Chosen:")), None),
    }


TORCH_WORKER = r"""
import json, os, sys, time, torch
root, spec = sys.argv[1], json.loads(sys.argv[2])
kind, shape, B, T, mode, steps, K = spec
torch.manual_seed(0)
dev = torch.device("cuda")
if kind == "gpt":
    sys.path.insert(0, os.path.join(root, "bench"))
    from torch_gpt import GPT
    L, h, d, V = shape
    make = lambda: GPT(V=V, T=T, L=L, d=d, h=h, init_std=0.02)
    step_loss = lambda m, x: m(x, x)
    V_tokens = V
else:  # a registry model of bench/models/NAME.py: build(preset), loss(model, input, target)
    sys.path.insert(0, os.path.join(root, "bench", "models"))
    import importlib
    mod = importlib.import_module(kind)
    make = lambda: mod.build(shape)
    step_loss = lambda m, x: mod.loss(m, x, x)
    V_tokens = 32000
def host_peak():
    try:
        return torch.cuda.host_memory_stats()["reserved_bytes.all.peak"]
    except Exception:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
try:
    if mode == "plain":
        model = make().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:  # FSDP2 at world size 1 with its CPU offload
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
        model = make()
        policy = CPUOffloadPolicy(pin_memory=True)
        blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
        for block in blocks:
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for s in range(steps):
        x = torch.randint(0, V_tokens, (B, T), device=dev)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for k in range(K):  # micro-batches of B rows (gradient accumulation)
            with torch.autocast("cuda", torch.bfloat16):
                loss = step_loss(model, x) / K
            loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
        # A line a step: a run cut short by a time limit still reports the steps it made.
        t = sorted(times[2:] or times)
        print(json.dumps({"mode": mode, "device_peak": torch.cuda.max_memory_reserved(),
                          "host_peak": host_peak(), "ms_per_step": 1000 * t[len(t) // 2],
                          "steps": len(times), "last_ms": 1000 * times[-1]}), flush=True)
except torch.cuda.OutOfMemoryError as e:
    print(json.dumps({"mode": mode, "oom": str(e)[:300]}))
"""


def device_mib():
    """The GPU's memory (nvidia-smi), None where it cannot be read."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
        return int(q.stdout.split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cannot_run(mode, params):
    """Why PyTorch's `mode` cannot hold `params` parameters' float32 weights, gradients and AdamW
    moments (16 bytes each, before any activation), or None. Plain AdamW keeps them on the
    device; FSDP2's CPUOffloadPolicy in host memory (--torch-host-memory GIB, default 128: the
    GPU machine's; its MemTotal can read low while memory is still being granted)."""
    need = 16 * params
    if mode == "plain":
        mib = device_mib()
        have, where = (mib << 20 if mib else None), "the device"
    else:
        have, where = float(option("--torch-host-memory") or 128) * GIB, "the host"
    if have and need > have:
        return (f"{mode} needs {need / 1e9:.0f} GB on {where} for float32 weights, gradients and "
                f"AdamW moments alone; {where} has {have / 1e9:.0f} GB")
    return None


def run_torch(row, steps, params=None):
    if row in GPT_ROWS:
        _, L, h, d, V, B, T = GPT_ROWS[row]
        kind, shape = "gpt", [L, h, d, V]
    else:
        preset, _, _, B, T = LLAMA_ROWS[row]
        kind, shape = "llama", preset
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for mode in ("plain", "fsdp2-cpu-offload"):
        why = cannot_run(mode, params) if params else None
        if why:  # not started: a host that runs out of memory can take the machine down
            r = {"mode": mode, "cannot": why}
            continue
        try:
            p = subprocess.run([sys.executable, "-c", TORCH_WORKER, here,
                                json.dumps([kind, shape, B, T, mode, steps, grad_accum()])],
                               capture_output=True, text=True, timeout=torch_timeout())
        except subprocess.TimeoutExpired as e:  # the steps it finished, if any
            out = e.stdout or b""
            p = subprocess.CompletedProcess(e.cmd, -1, out.decode() if isinstance(out, bytes) else out,
                                            f"timed out after {e.timeout:.0f} s")
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            return {"mode": mode, "error": p.stderr[-2000:]}
        r = json.loads(lines[-1])
        if "oom" not in r:
            return r
    return r  # the last mode's out-of-memory, or why it could not start


def pct(pred, meas):
    return None if not pred or not meas else 100.0 * (pred - meas) / meas


def main():
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    build = sys.argv[1]
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "/tmp/tally_scale"
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 10
    rows = (sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv
            else list(GPT_ROWS) + list(LLAMA_ROWS))
    os.makedirs(out, exist_ok=True)
    results = {}
    print(f"{'model':<11} {'params':>7} {'dev pred/meas GiB (err)':>26} "
          f"{'host pred/meas GiB (err)':>26} {'ms/step':>8} {'tok/s':>8} {'MFU':>6} "
          f"{'torch':>18} {'torch ms':>9} {'speedup':>7}")
    for row in rows:
        if row in GPT_ROWS:
            _, L, _, d, V, B, T = GPT_ROWS[row]
        elif row in LLAMA_ROWS:
            _, L, d, B, T = LLAMA_ROWS[row]
        else:
            sys.exit(f"scale.py: --only: unknown row '{row}' (expected {', '.join(GPT_ROWS)}, "
                     f"{', '.join(LLAMA_ROWS)})")
        t = run_tally(build, row, steps, out)
        n = t.get("params") or (gpt_params(L, d, V, T) if row in GPT_ROWS else 0)
        tr = run_torch(row, steps, n) if "--no-torch" not in sys.argv else {}
        results[row] = {"tally": t, "torch": tr}
        if "error" in t:
            print(f"{row:<11} Tally failed: {t['error'][-300:]}")
            continue
        ms = t["ms_per_step"]
        tok_s = B * grad_accum() * T / (ms / 1000) if ms else 0
        mfu = flops_per_token(n, L, d, T) * tok_s / PEAK_FLOPS
        g = lambda b: f"{b / GIB:.1f}" if b else "-"
        e = lambda p, m: f"{pct(p, m):+.1f}%" if pct(p, m) is not None else "-"
        torch_ms = tr.get("ms_per_step")
        speed = (f"{torch_ms / ms:.2f}x" if torch_ms and ms else "torch OOM" if "oom" in tr
                 else "cannot" if "cannot" in tr else "-")
        print(f"{row:<11} {n / 1e9:>6.2f}B "
              f"{g(t['predicted_device']):>6}/{g(t['device_peak']):<6} ({e(t['predicted_device'], t['device_peak']):>7}) "
              f"{g(t['predicted_host']):>6}/{g(t['host_peak']):<6} ({e(t['predicted_host'], t['host_peak']):>7}) "
              f"{ms or 0:>8.0f} {tok_s:>8.0f} {100 * mfu:>5.1f}% "
              f"{tr.get('mode', '-'):>18} {torch_ms or 0:>9.0f} {speed:>7}")
        if t.get("plan"):
            print(f"{'':<11} {t['plan']}")
        if "cannot" in tr:
            print(f"{'':<11} PyTorch: {tr['cannot']}")
        if tr.get("steps") is not None and tr["steps"] < steps:
            print(f"{'':<11} PyTorch: {tr['steps']} of {steps} steps before --torch-timeout")
    with open(os.path.join(out, "scale.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
