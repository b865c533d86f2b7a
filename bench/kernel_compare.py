#!/usr/bin/env python3
"""Where a training step's GPU time goes, Tally next to PyTorch, from two Chrome traces
(examples/profile_models' <model>.trace.json and bench/profile_torch.py's
torch_<model>.trace.json). Kernel times are summed per class (matmul, attention,
layer norm, softmax / cross-entropy, optimizer, copies, other elementwise ...) and per
kernel name, and divided by the number of steps in each trace (its "## Forward Pass ##"
ranges), so the two columns are ms per step.

    python3 bench/kernel_compare.py TALLY_TRACE TORCH_TRACE [--top 25]
"""
import argparse
import collections
import json
import re
import sys

CLASSES = [
    ("attention", r"flash|fmha|attention|attn|efficient|fa2::"),
    ("matmul", r"gemm|sgemm|xmma|cutlass|cublas|splitk|nvjet|sm90_|sm80_|ampere_|reduce_kernel.*gemm"),
    ("conv", r"conv|cudnn|implicit|winograd|fft"),
    ("layer_norm", r"layer_?norm|LayerNorm"),
    ("batch_norm", r"batch_?norm|bn_"),
    ("softmax/xent", r"softmax|cross_entropy|nll|log_softmax|row_stats"),
    ("optimizer", r"adam|sgd|multi_tensor|fused_adam|optim"),
    ("embedding", r"embedding|index_select|gather|scatter|indexSelect|index_add"),
    ("reduce", r"reduce|sum_|sum<|column_sum|full_sum|partial"),
    ("copy/cast", r"copy|memcpy|cat|transpose|contiguous|convert|unrolled_elementwise_kernel.*copy|CatArray"),
    ("memset", r"memset|fill|zero"),
    ("elementwise", r"."),
]


def classify(name):
    for cls, pat in CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls
    return "other"


def short(name, n=90):
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= n else name[: n - 3] + "..."


def load(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    steps = 0
    per_name = collections.Counter()
    count = collections.Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("name") == "## Forward Pass ##" and e.get("cat") in ("user_annotation", "cpu_op", "python_function", "cpu"):
            steps += 1
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"):
            per_name[e["name"]] += float(e.get("dur", 0)) / 1e3
            count[e["name"]] += 1
    if steps == 0:
        # fall back: any event named like a forward annotation
        steps = sum(1 for e in events if e.get("ph") == "X" and e.get("name") == "## Forward Pass ##") or 1
    return per_name, count, steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tally")
    ap.add_argument("torch")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    rows = {}
    for fw, path in (("tally", a.tally), ("torch", a.torch)):
        per_name, count, steps = load(path)
        rows[fw] = (per_name, count, steps)
        print(f"{fw}: {path}: {steps} steps, {sum(per_name.values()) / steps:.2f} ms of kernels per step, "
              f"{sum(count.values()) // steps} kernels per step")
    print()
    print(f"{'class':<14} {'tally ms':>9} {'n':>6} {'torch ms':>9} {'n':>6} {'diff ms':>8}")
    cls_tot = {fw: collections.Counter() for fw in rows}
    cls_n = {fw: collections.Counter() for fw in rows}
    for fw, (per_name, count, steps) in rows.items():
        for name, ms in per_name.items():
            c = classify(name)
            cls_tot[fw][c] += ms / steps
            cls_n[fw][c] += count[name] / steps
    order = sorted(set(cls_tot["tally"]) | set(cls_tot["torch"]),
                   key=lambda c: -max(cls_tot["tally"][c], cls_tot["torch"][c]))
    for c in order:
        t, p = cls_tot["tally"][c], cls_tot["torch"][c]
        print(f"{c:<14} {t:>9.2f} {cls_n['tally'][c]:>6.0f} {p:>9.2f} {cls_n['torch'][c]:>6.0f} {t - p:>+8.2f}")
    t, p = sum(cls_tot["tally"].values()), sum(cls_tot["torch"].values())
    print(f"{'total':<14} {t:>9.2f} {'':>6} {p:>9.2f} {'':>6} {t - p:>+8.2f}")
    for fw, (per_name, count, steps) in rows.items():
        print(f"\n{fw}: top {a.top} kernels (ms per step, launches per step, class)")
        for name, ms in per_name.most_common(a.top):
            print(f"  {ms / steps:>8.3f} {count[name] / steps:>6.0f}  {classify(name):<12} {short(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
