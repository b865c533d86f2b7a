#!/usr/bin/env python3
"""The fragmentation example (examples/memory_patterns.cpp --pattern fragmentation: an MLP on
batch x T rows, T random in 64..2048 each step) on the GPU, Tally and PyTorch side by side in
one call, each allocator with its default settings and with expandable segments: peak
allocated, peak reserved and their ratio. PyTorch replays Tally's lengths (read from
patterns.json), each setting in a fresh process. Tally's reclaim_on_growth row has no
PyTorch setting beside it (PyTorch has none).

    python3 bench/fragmentation.py BUILD_DIR [--steps N] [--batch N]

The batch defaults to 64 rows per unit of T (peaks of about 650 MiB), so that the large
pool's 20 MiB pages (both allocators map expandable segments in those) are a small part of
what is reserved.
"""
import json
import os
import subprocess
import sys
import tempfile


def torch_one(conf, batch, lengths):
    import torch
    import torch.nn.functional as F
    dev = "cuda"
    torch.manual_seed(0)
    d_in, d_hidden = 64, 256

    def param(*shape, scale):
        return (torch.randn(*shape, device=dev) * scale).requires_grad_()

    w1, b1 = param(d_hidden, d_in, scale=0.1), param(d_hidden, scale=0.0)
    w2, b2 = param(d_hidden, d_hidden, scale=0.05), param(d_hidden, scale=0.0)
    w3, b3 = param(d_in, d_hidden, scale=0.05), param(d_in, scale=0.0)
    params = [w1, b1, w2, b2, w3, b3]
    step_peak, reserved = [], []
    for t in lengths:
        torch.cuda.reset_peak_memory_stats()
        x = torch.randn(batch * t, d_in, device=dev)
        for p in params:
            p.grad = None
        h = F.gelu(F.linear(x, w1, b1))
        h = F.gelu(F.linear(h, w2, b2))
        loss = (F.linear(h, w3, b3) - x).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-0.01)
        del loss, x, h
        torch.cuda.synchronize()
        step_peak.append(torch.cuda.max_memory_allocated())
        reserved.append(torch.cuda.memory_reserved())
    print(json.dumps({"conf": conf, "peak_allocated": max(step_peak),
                      "peak_reserved": max(reserved)}))


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--torch-one":
        spec = json.loads(sys.argv[2])
        torch_one(spec["conf"], spec["batch"], spec["lengths"])
        return
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    build = sys.argv[1]
    steps = sys.argv[sys.argv.index("--steps") + 1] if "--steps" in sys.argv else "24"
    batch = sys.argv[sys.argv.index("--batch") + 1] if "--batch" in sys.argv else "64"
    with tempfile.TemporaryDirectory() as out:
        cmd = [os.path.join(build, "examples", "memory_patterns"), "--pattern", "fragmentation",
               "--device", "cuda", "--frag-steps", steps, "--batch", batch, "--out", out]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stdout[-3000:], p.stderr[-3000:])
            sys.exit(1)
        fr = json.load(open(os.path.join(out, "patterns.json")))["fragmentation"]
    rows = []
    for name, v in fr.items():
        if v["padded"] or name.startswith("max_split"):
            continue
        if "reclaim_on_growth" in v["conf"]:  # Tally's own setting
            rows.append((name, v, None))
            continue
        spec = {"conf": v["conf"], "batch": v["batch"], "lengths": v["lengths"]}
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if v["conf"]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = v["conf"]
        q = subprocess.run([sys.executable, __file__, "--torch-one", json.dumps(spec)],
                           capture_output=True, text=True, env=env)
        t = json.loads(q.stdout.strip().splitlines()[-1]) if q.returncode == 0 else None
        if t is None:
            print(f"PyTorch ({name}) failed: {q.stderr[-2000:]}")
        rows.append((name, v, t))
    mib = 1 << 20
    print(f"fragmentation MLP, {len(fr[next(iter(fr))]['lengths'])} steps, batch "
          f"{fr[next(iter(fr))]['batch']} x T in 64..2048 (the same T for both)")
    print(f"{'setting':28} {'tally alloc':>12} {'resv':>9} {'resv/alloc':>10} | "
          f"{'torch alloc':>12} {'resv':>9} {'resv/alloc':>10}")
    for name, v, t in rows:
        line = (f"{name:28} {v['peak_allocated'] / mib:12.1f} {v['peak_reserved'] / mib:9.1f} "
                f"{v['peak_reserved'] / v['peak_allocated']:10.3f} | ")
        if t:
            line += (f"{t['peak_allocated'] / mib:12.1f} {t['peak_reserved'] / mib:9.1f} "
                     f"{t['peak_reserved'] / t['peak_allocated']:10.3f}")
        print(line)


if __name__ == "__main__":
    main()
