#!/usr/bin/env python3
"""The memory levers on the GPU machine, Tally and PyTorch side by side in one call:
activation offload, step-in-backward, AdamW8bit, the fused classifier, the real vocabulary
and expandable segments, on GPT-2 124M (B16, T1024, bf16 autocast, AdamW) and ResNet-50
(bs64, 224x224, bf16 autocast, SGD momentum 0.9). For every configuration: median step time,
peak allocated and reserved, and Tally's bytes per category at the peak; PyTorch's
equivalent where one exists (torch.autograd.graph.save_on_cpu(pin_memory=True),
register_post_accumulate_grad_hook with one optimizer per parameter,
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), each in a fresh process.

    python3 bench/levers.py BUILD_DIR [gpt] [resnet] [--steps N] [--only WORD]

--only WORD keeps the rows whose configuration names WORD (e.g. offload), with the plain
amp-bf16 row they are compared against.

The copy floor next to an offload row: the bytes offloaded, once each way, over the H200's
host link (~50 GB/s each way measured by the row itself when the copies do not overlap).
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# (Tally cfg, PyTorch cfg or None). Tally's tokens: bench/bench_train.cpp.
LEVERS = {
    "gpt": [
        ("amp-bf16", "amp-bf16"),
        ("amp-bf16+offload", "amp-bf16+offload"),
        ("amp-bf16+ckpt+offload", "amp-bf16+ckpt+offload"),
        ("amp-bf16+offloadlink", None),  # --offload link: what the link hides (nn/offload.h)
        ("amp-bf16+ckpt+offloadlink", None),
        ("amp-bf16+sib", "amp-bf16+sib"),
        ("amp-bf16+adamw8bit", None),
        ("amp-bf16+fusedce", None),
        ("amp-bf16+v50257", "amp-bf16+v50257"),
        ("amp-bf16+v50257+nopad", None),  # the classifier's products unpadded (slow kernels)
        ("amp-bf16+v50257+fusedce", None),
        ("amp-bf16+fusedce+sib+adamw8bit", None),
        ("amp-bf16+varyseq", "amp-bf16+varyseq"),
    ],
    "resnet": [
        ("amp-bf16", "amp-bf16"),
        ("amp-bf16+offload", "amp-bf16+offload"),
        ("amp-bf16+offloadlink", None),
        ("amp-bf16+sib", "amp-bf16+sib"),
    ],
}
# Each also with expandable segments (Tally's TALLY_ALLOC_CONF, PyTorch's
# PYTORCH_CUDA_ALLOC_CONF); varyseq: GPT-2 with the sequence length varying per step.
EXPANDABLE = {"gpt": ["amp-bf16", "amp-bf16+varyseq"], "resnet": ["amp-bf16"]}


FAILED = []  # bench_train runs that failed part-way: the script exits 1 after its table


def tally_rows(build, model, cfgs, steps, env=None):
    exe = os.path.join(build, "bench", "bench_train")
    cmd = [exe, f"--{model}", "--steps", str(steps), "--configs",
           ",".join(c if c in ("amp-bf16",) else f"{model}:{c}" for c in cfgs)]
    print("$", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    sys.stderr.write(p.stderr[-3000:])
    if p.returncode == 2:  # a refused command line: nothing of this run can be measured
        print("levers.py: bench_train refused the command line (exit 2, its message above)",
              file=sys.stderr)
        sys.exit(2)
    if p.returncode != 0:
        print(f"levers.py: bench_train failed (exit {p.returncode}); its rows so far are kept",
              file=sys.stderr)
        FAILED.append(p.returncode)
    rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    for r in rows:
        print("  tally", json.dumps(r), flush=True)
    return rows


# ---- PyTorch side: one configuration per process (allocator settings are per process) ----
def torch_one(model, cfg, steps):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda"
    torch.manual_seed(0)
    if model == "gpt":
        sys.path.insert(0, HERE)
        from torch_gpt import GPT
        V = 50257 if "v50257" in cfg else 50304
        m = GPT(V=V).to(dev).train()
        idx = torch.randint(0, 50257, (16, 1024), device=dev)
        if "varyseq" in cfg:  # bench_train's lengths: 128 + 64 ((7k + 3) mod 15)
            k = [0]

            def loss_fn():
                t = 128 + 64 * ((7 * k[0] + 3) % 15)
                k[0] += 1
                return m(idx[:, :t].contiguous(), idx[:, :t].contiguous())
        else:
            loss_fn = lambda: m(idx, idx)
        make_opt = lambda ps: torch.optim.AdamW(ps, lr=3e-4, fused=True)
    else:
        import torchvision
        m = torchvision.models.resnet50(num_classes=10).to(dev).train()
        x = torch.randn(64, 3, 224, 224, device=dev)
        y = torch.randint(0, 10, (64,), device=dev)
        loss_fn = lambda: torch.nn.functional.cross_entropy(m(x), y)
        make_opt = lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)
    if "ckpt" in cfg and model == "gpt":
        import functools
        import torch.utils.checkpoint as cp
        for b in m.h:  # every block checkpointed, non-reentrant (Tally's --checkpoint blocks)
            b.forward = functools.partial(
                lambda f, x: cp.checkpoint(f, x, use_reentrant=False), b.forward)
    sib = "sib" in cfg
    if sib:
        opts = {p: make_opt([p]) for p in m.parameters()}
        def hook(p):
            opts[p].step()
            opts[p].zero_grad(set_to_none=True)
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(hook)
    else:
        opt = make_opt(list(m.parameters()))

    def step():
        if not sib:
            opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if "offload" in cfg:
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    loss = loss_fn()
            else:
                loss = loss_fn()
        loss.backward()
        if not sib:
            opt.step()

    if "hist" in cfg:  # bench/analysis.py: PyTorch's memory history (Python + C++ stacks)
        torch.cuda.memory._record_memory_history(max_entries=1000000)
    from train import timed_steps
    med, mn = timed_steps(step, 3, steps)
    mib = 1024 * 1024
    print(json.dumps({"model": model, "cfg": cfg, "step_ms": round(med, 2),
                      "step_ms_min": round(mn, 2),
                      "peak_alloc_mib": round(torch.cuda.max_memory_allocated() / mib, 1),
                      "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / mib, 1)}))


def torch_rows(model, cfg, steps, env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-one", model, cfg,
                        str(steps)], capture_output=True, text=True, env=env)
    rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    if not rows:
        print(f"  torch {model} {cfg}: failed\n{p.stderr[-1500:]}", flush=True)
        return None
    print("  torch", json.dumps(rows[0]), flush=True)
    return rows[0]


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--torch-one":
        torch_one(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    build = sys.argv[1]
    args = sys.argv[2:]

    def fail(msg):
        print(f"levers.py: {msg}", file=sys.stderr)
        sys.exit(2)

    # The whole command line is checked before anything runs.
    steps, only, models, i = 10, None, [], 0
    while i < len(args):
        a = args[i]
        if a in ("gpt", "resnet"):
            models.append(a)
        elif a in ("--steps", "--only"):
            if i + 1 >= len(args):
                fail(f"{a} needs a value")
            i += 1
            if a == "--only":
                only = args[i]
            elif not args[i].isdigit() or not 1 <= int(args[i]) <= 100000:
                fail(f"--steps takes an integer in [1, 100000], got '{args[i]}'")
            else:
                steps = int(args[i])
        else:
            fail(f"unknown argument '{a}' (usage: levers.py BUILD [gpt] [resnet] [--steps N] "
                 "[--only TOKEN])")
        i += 1
    models = models or ["gpt", "resnet"]
    if only is not None and not any(
            only in t for m in models for t, _ in LEVERS[m]) and only not in "expandable":
        fail(f"--only '{only}' names no lever of {', '.join(models)} (levers: "
             f"{', '.join(sorted({t for m in models for t, _ in LEVERS[m]}))}, expandable)")
    table = []
    for model in models:
        levers = [(t, p) for t, p in LEVERS[model]
                  if only is None or t == "amp-bf16" or only in t]
        cfgs = [t for t, _ in levers]
        rows = {r["cfg"]: r for r in tally_rows(build, model, cfgs, steps)}
        exp = [c for c in EXPANDABLE[model] if only is None or only in "expandable" or only in c]
        if exp:
            exp_env = dict(os.environ, TALLY_ALLOC_CONF="expandable_segments:True")
            for r in tally_rows(build, model, exp, steps, exp_env):
                rows["expandable:" + r["cfg"].split(":")[-1]] = r
            levers = levers + [("expandable:" + c, "expandable:" + c) for c in exp]
        for tcfg, pcfg in levers:
            t = rows.get(tcfg)
            p = None
            if pcfg and pcfg.startswith("expandable:"):
                p = torch_rows(model, pcfg.split(":", 1)[1], steps,
                               {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
            elif pcfg:
                p = torch_rows(model, pcfg, steps)
            table.append((model, tcfg, t, p))
    print()
    hdr = (f"{'model':7} {'config':32} {'tally ms':>9} {'alloc MiB':>10} {'resv MiB':>9} "
           f"{'act@pk':>8} {'grad@pk':>8} {'opt@pk':>8} {'host MiB':>9} | {'torch ms':>9} "
           f"{'alloc MiB':>10} {'resv MiB':>9} {'t/T time':>8}")
    print(hdr)
    print("-" * len(hdr))
    for model, cfg, t, p in table:
        if not t:
            print(f"{model:7} {cfg:32} (no Tally row)")
            continue
        line = (f"{model:7} {cfg:32} {t['step_ms']:9.2f} {t['peak_alloc_mib']:10.1f} "
                f"{t['peak_reserved_mib']:9.1f} {t.get('activation_at_peak_mib', 0):8.1f} "
                f"{t.get('gradient_at_peak_mib', 0):8.1f} {t.get('optimizer_state_at_peak_mib', 0):8.1f} "
                f"{t.get('offloaded_host_peak_mib', 0):9.1f} | ")
        if p:
            line += (f"{p['step_ms']:9.2f} {p['peak_alloc_mib']:10.1f} {p['peak_reserved_mib']:9.1f} "
                     f"{p['step_ms'] / t['step_ms']:8.2f}")
        else:
            line += f"{'-':>9} {'-':>10} {'-':>9} {'-':>8}"
        print(line)
        if "offload" in cfg:
            floor_ms = 2 * t.get("offloaded_host_peak_mib", 0) * 1048576 / 50e9 * 1e3
            print(f"{'':7} {'':32} copy floor (offloaded bytes both ways at 50 GB/s): "
                  f"{floor_ms:.1f} ms")
    if FAILED:
        sys.exit(1)


if __name__ == "__main__":
    main()
