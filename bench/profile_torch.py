#!/usr/bin/env python3
"""torch.profiler's overhead on the models of examples/profile_models, printed next to
Tally's: ResNet-50 (torchvision, batch 64, 224x224, SGD momentum 0.9) and a GPT-2 124M
(B x 1024 tokens, AdamW). For each model: the median step time without the profiler, with
torch.profiler (CPU+CUDA activities, profile_memory, record_shapes, with_stack) and the
overhead in %, and the sum of the CUDA kernel times per step against the synchronised step
time. Runs BUILD_DIR/examples/profile_models first (same models, same settings) and prints
one table with both frameworks. Needs a GPU and torch + torchvision (the GPU machine).
With --rounds N both frameworks alternate plain and profiled measurements N times: the
figures are medians over the rounds, and the overhead's spread (lowest..highest round) is
printed next to them.

    python3 bench/profile_torch.py BUILD_DIR [--out DIR] [--steps 8] [--gpt-batch 8] [--rounds 5]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("build")
ap.add_argument("--out", default="profile_models_out")
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--warmup", type=int, default=3)
ap.add_argument("--resnet-batch", type=int, default=64)
ap.add_argument("--gpt-batch", type=int, default=8)
ap.add_argument("--models", default="resnet,gpt")
ap.add_argument("--rounds", type=int, default=1, help="alternating plain / profiled measurements")
ap.add_argument("--skip-tally", action="store_true", help="only torch")
ap.add_argument("--amp", default="off", choices=["off", "fp16", "bf16"],
                help="the forward under autocast (both frameworks)")
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)

# ---- Tally
tally = []
if not args.skip_tally:
    exe = os.path.join(args.build, "examples", "profile_models")
    cmd = [exe, "--device", "cuda", "--out", args.out, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--resnet-batch", str(args.resnet_batch), "--gpt-batch", str(args.gpt_batch), "--models", args.models,
           "--amp", args.amp, "--rounds", str(args.rounds)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    tally = json.load(open(os.path.join(args.out, "profile_models.json")))

import torch  # noqa: E402  (after Tally's run: the GPU is free for it)
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function, schedule  # noqa: E402
from torch_gpt import GPT  # noqa: E402

dev = "cuda"
torch.backends.cudnn.benchmark = False


def make(which):
    torch.manual_seed(0)
    if which == "resnet":
        m = torchvision.models.resnet50(num_classes=1000).to(dev).train()
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(args.resnet_batch, 3, 224, 224, device=dev)
        y = torch.randint(0, 1000, (args.resnet_batch,), device=dev)
        desc = f"ResNet-50 batch {args.resnet_batch} 224x224"
        loss_fn = lambda: F.cross_entropy(m(x), y)  # noqa: E731
    else:
        m = GPT(init_std=0.02).to(dev).train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        x = torch.randint(0, 50257, (args.gpt_batch, 1024), device=dev)
        y = torch.randint(0, 50257, (args.gpt_batch, 1024), device=dev)
        desc = f"GPT gpt2 (124M) B={args.gpt_batch} T=1024"
        loss_fn = lambda: m(x, y)  # noqa: E731

    def step():
        opt.zero_grad(set_to_none=True)
        with record_function("## Forward Pass ##"), torch.autocast(
                "cuda", dtype=torch.bfloat16 if args.amp == "bf16" else torch.float16, enabled=args.amp != "off"):
            loss = loss_fn()
        with record_function("## Backward Pass ##"):
            loss.backward()
        with record_function("## Optimizer ##"):
            opt.step()

    return desc, step


def timed(step):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


torch_rows = []
for which in [m for m in args.models.split(",") if m]:
    desc, step = make(which)
    print(f"== torch: {desc}", flush=True)
    for _ in range(args.warmup):
        timed(step)
    plains, meds, overheads = [], [], []
    for rnd in range(args.rounds):
        plain = statistics.median(timed(step) for _ in range(args.steps))
        profiled = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True,
                     record_shapes=True, with_stack=True,
                     schedule=schedule(wait=1, warmup=1, active=args.steps, repeat=1)) as prof:
            for i in range(args.steps + 2):
                ms = timed(step)
                if i >= 2:
                    profiled.append(ms)
                prof.step()
        med = statistics.median(profiled)
        plains.append(plain)
        meds.append(med)
        overheads.append(100 * (med - plain) / plain)
        if args.rounds > 1:
            print(f"torch {desc} round {rnd + 1}: {plain:.2f} ms, profiled {med:.2f} ms: {overheads[-1]:+.1f}%",
                  flush=True)
        if rnd == 0:
            prof.export_chrome_trace(os.path.join(args.out, f"torch_{which}.trace.json"))
            # Device-side ranges of record_function ("## Forward Pass ##", "Optimizer.step#...") are
            # CUDA events too, spanning kernels already counted: leave them out.
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                       and not getattr(e, "is_user_annotation", False)]
            kernel_ms = sum(e.device_time for e in kernels) / 1e3 / args.steps
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
        del prof
    plain, med = statistics.median(plains), statistics.median(meds)
    print(table)
    row = {"model": which, "desc": desc, "median_ms": plain, "median_ms_profiled": med,
           "overhead_pct": 100 * (med - plain) / plain, "overhead_min_pct": min(overheads),
           "overhead_max_pct": max(overheads), "rounds": args.rounds, "kernel_ms_per_step": kernel_ms}
    print(f"torch {desc}: median step {plain:.2f} ms, profiled {med:.2f} ms, overhead {row['overhead_pct']:+.1f}%, "
          f"kernels {kernel_ms:.2f} ms/step ({100 * kernel_ms / plain:.1f}% of the step)", flush=True)
    torch_rows.append(row)
    del step
    torch.cuda.empty_cache()

json.dump(torch_rows, open(os.path.join(args.out, "profile_torch.json"), "w"), indent=1)
print()
print(f"{'framework':<8} {'model':<32} {'step ms':>9} {'profiled':>9} {'overhead':>9} {'spread (rounds)':>17} "
      f"{'kernels ms/step':>16} {'kernels/step':>13}")
for fw, rows in (("tally", tally), ("torch", torch_rows)):
    for r in rows:
        ratio = 100 * r["kernel_ms_per_step"] / r["median_ms"] if r["median_ms"] else math.nan
        spread = (f"{r.get('overhead_min_pct', r['overhead_pct']):+.1f}..{r.get('overhead_max_pct', r['overhead_pct']):+.1f}%"
                  f" ({r.get('rounds', 1)})")
        print(f"{fw:<8} {r['desc']:<32} {r['median_ms']:>9.2f} {r['median_ms_profiled']:>9.2f} "
              f"{r['overhead_pct']:>8.1f}% {spread:>17} {r['kernel_ms_per_step']:>16.2f} {ratio:>12.1f}%")
sys.exit(0)
