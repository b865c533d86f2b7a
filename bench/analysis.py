#!/usr/bin/env python3
"""What the memory analysis tools cost on the GPU machine, Tally and PyTorch side by side in
one call: memory history recorded through every step (what a snapshot needs; every frame
names the user's line, memory::CallSiteScope) and the leak detector (a inspect::LeakDetector
boundary after every step), on GPT-2 124M (B16, T1024, bf16 autocast, AdamW) and ResNet-50
(bs64, 224x224, bf16 autocast, SGD momentum 0.9). PyTorch's row is
torch.cuda.memory._record_memory_history(max_entries=1e6) (Python and C++ stacks, its
default). Each configuration runs in a fresh process, ROUNDS times, alternating; the table
gives the median of the per-run median step times, the spread (min..max) and the cost
against the plain step of the same framework.

    python3 bench/analysis.py BUILD_DIR [gpt] [resnet] [--rounds 5] [--steps 20]
"""
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from levers import tally_rows, torch_rows  # noqa: E402

TALLY = ["amp-bf16", "amp-bf16+hist", "amp-bf16+hist+leaks", "amp-bf16+leaks"]
TORCH = ["amp-bf16", "amp-bf16+hist"]
# The compute floor at the H200's measured 790 TFLOP/s bf16 (bench/RESULTS.md).
FLOOR_MS = {"gpt": 14.0e12 / 790e12 * 1e3, "resnet": 3 * 4.1e9 * 64 / 790e12 * 1e3}


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    build, args = sys.argv[1], sys.argv[2:]
    rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 5
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 20
    models = [m for m in ("gpt", "resnet") if m in args] or ["gpt", "resnet"]
    times = {}  # (model, framework, cfg) -> [median step ms per run]
    for r in range(rounds):
        for model in models:
            # Alternate the order every round so drift does not favour one configuration.
            order = TALLY if r % 2 == 0 else list(reversed(TALLY))
            for cfg in order:
                for row in tally_rows(build, model, [cfg], steps):
                    times.setdefault((model, "tally", cfg), []).append(row["step_ms"])
            for cfg in (TORCH if r % 2 == 0 else list(reversed(TORCH))):
                row = torch_rows(model, cfg, steps)
                if row:
                    times.setdefault((model, "torch", cfg), []).append(row["step_ms"])
    print()
    hdr = (f"{'model':7} {'framework':9} {'config':22} {'median ms':>10} {'spread ms':>15} "
           f"{'cost':>8} {'runs':>5} {'floor ms':>9}")
    print(hdr)
    print("-" * len(hdr))
    for model in models:
        for fw, cfgs in (("tally", TALLY), ("torch", TORCH)):
            base = times.get((model, fw, "amp-bf16"))
            for cfg in cfgs:
                ts = times.get((model, fw, cfg))
                if not ts:
                    print(f"{model:7} {fw:9} {cfg:22} (no runs)")
                    continue
                med = statistics.median(ts)
                cost = (f"{(med / statistics.median(base) - 1) * 100:+7.2f}%"
                        if base and cfg != "amp-bf16" else f"{'-':>8}")
                print(f"{model:7} {fw:9} {cfg:22} {med:10.2f} {min(ts):7.2f}..{max(ts):6.2f} "
                      f"{cost} {len(ts):5d} {FLOOR_MS[model]:9.2f}")


if __name__ == "__main__":
    main()
