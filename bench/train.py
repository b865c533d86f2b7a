#!/usr/bin/env python3
"""Training-step comparison on the GPU machine: Tally's bench_train next to PyTorch's
reference runs (.ref/torch_baseline.py: the project's PyTorch baseline script, which is
not part of this repository; the caller copies it into the git-ignored .ref/) in one
call. Prints step time and peak allocated/reserved memory for each configuration, both
sides, and their ratios (PyTorch / Tally: >= 1 means Tally is as fast or as lean).

    python3 bench/train.py BUILD_DIR [resnet] [gpt] [--configs baseline-fp32,ckpt4,...]
"""
import importlib.util
import json
import os
import subprocess
import sys

from table import print_header

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Floors: FLOPs of one step over the H200's measured 790 TFLOP/s (bf16 tensor cores) and an
# fp32 SIMT figure (67 TFLOP/s nominal) for the fp32 runs, TF32 off.
FLOORS = {
    # ResNet-50 forward 4.09 GFLOP/image (2 * MACs) at 224x224; backward 2x forward.
    "resnet50-bs64": 3 * 4.09e9 * 64,
    # GPT-2 124M: 6 * params * tokens + attention 12 * L * T^2 * C per sequence (fwd+bwd).
    "gpt2-124M-B16T1024": 6 * 124.4e6 * 16 * 1024 + 12 * 12 * 1024 * 1024 * 768 * 16,
}


def run_tally(build, which, configs):
    exe = os.path.join(build, "bench", "bench_train")
    cmd = [exe] + [f"--{w}" for w in which]
    if configs:
        cmd += ["--configs", ",".join(configs)]
    print("$", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr[-4000:])
    rows = []
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def run_torch(which, configs):
    path = os.path.join(ROOT, ".ref", "torch_baseline.py")
    if not os.path.exists(path):
        print(f"no {path}: copy the PyTorch baseline script torch_baseline.py (kept outside "
              "this repository) there to compare with PyTorch")
        return []
    spec = importlib.util.spec_from_file_location("torch_baseline", path)
    tb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tb)
    plan = {
        "resnet": [("baseline-fp32", {}), ("ckpt4", {"ckpt": True}), ("amp-fp16", {"amp": "fp16"}),
                   ("amp-bf16", {"amp": "bf16"}), ("amp-fp16+ckpt4", {"ckpt": True, "amp": "fp16"})],
        "gpt": [("baseline-fp32", {}), ("ckpt-per-block", {"ckpt": True}), ("amp-bf16", {"amp": "bf16"}),
                ("amp-bf16+ckpt", {"ckpt": True, "amp": "bf16"})],
    }
    for w in which:
        for name, kw in plan[w]:
            if configs and name not in configs:
                continue
            (tb.resnet_cfg if w == "resnet" else tb.gpt_cfg)(name, **kw)
    return tb.results


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    build = args[0]
    which = [a for a in args[1:] if a in ("resnet", "gpt")] or ["resnet", "gpt"]
    configs = []
    if "--configs" in args:
        configs = args[args.index("--configs") + 1].split(",")
    tally = run_tally(build, which, configs)
    torch_rows = run_torch(which, configs)
    tkey = {(r["model"], r["cfg"]): r for r in torch_rows}
    print_header(f"{'model':22} {'cfg':16} {'tally ms':>9} {'torch ms':>9} {'speed':>6} "
                 f"{'tally MiB':>10} {'torch MiB':>10} {'mem':>6} {'tally resv':>10} {'torch resv':>10} "
                 f"{'floor ms':>9}")
    out = []
    for r in tally:
        t = tkey.get((r["model"], r["cfg"]))
        flops = FLOORS.get(r["model"])
        floor = f"{flops / 790e12 * 1e3:9.2f}" if flops else f"{'':9}"
        if t:
            sp = t["step_ms"] / r["step_ms"]
            mem = t["peak_alloc_mib"] / r["peak_alloc_mib"]
            print(f"{r['model']:22} {r['cfg']:16} {r['step_ms']:9.1f} {t['step_ms']:9.1f} {sp:6.2f} "
                  f"{r['peak_alloc_mib']:10.0f} {t['peak_alloc_mib']:10.0f} {mem:6.2f} "
                  f"{r['peak_reserved_mib']:10.0f} {t['peak_reserved_mib']:10.0f} {floor}")
        else:
            print(f"{r['model']:22} {r['cfg']:16} {r['step_ms']:9.1f} {'-':>9} {'-':>6} "
                  f"{r['peak_alloc_mib']:10.0f} {'-':>10} {'-':>6} {r['peak_reserved_mib']:10.0f} {'-':>10} {floor}")
        out.append({"tally": r, "torch": t})
    print("JSON " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
