#!/usr/bin/env python3
"""Training-step comparison on the GPU machine: Tally's bench_train next to PyTorch's
reference runs (.ref/torch_baseline.py: the project's PyTorch baseline script, which is
not part of this repository; the caller copies it into the git-ignored .ref/) in one
call. Prints step time and peak allocated/reserved memory for each configuration, both
sides, and their ratios (PyTorch / Tally: >= 1 means Tally is as fast or as lean).

With --compile, PyTorch's torch.compile runs each configuration too (the same model and
step, `torch.compile(model)`; GPT-2 with fused AdamW, ResNet-50's 16-bit runs in
channels_last, as their best published eager-vs-compile comparisons do), in the same call:
a "compile ms" column and Tally's speed against it. Compiling takes 30-90 s a configuration.

ResNet-50's channels_last configurations (amp-fp16+channels-last, amp-bf16+channels-last,
baseline-fp32+channels-last: weights and images in NHWC memory on both sides, Tally's
Module::to(MemoryFormat) and PyTorch's memory_format=torch.channels_last) run when --configs
names them.

With --cuda-graphs, Tally also runs each configuration captured into a CUDA graph and replayed
(bench_train --cuda-graphs: rows "<cfg>+graphs", compared with PyTorch's eager and compiled rows
of <cfg>), and a last table shows what the graph saved against Tally's own eager step (fp16's
with a capturable GradScaler: the skip and the next scale decided on the device).

    python3 bench/train.py BUILD_DIR [resnet] [gpt] [--configs baseline-fp32,ckpt4,...] [--compile]
        [--cuda-graphs]
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


FAILED = []  # bench_train runs that failed part-way (their rows so far still count)


def check_tally_exit(prog, code):
    """A refused command line (exit 2) stops the script before PyTorch's side runs; any other
    failure is remembered, and the script exits 1 after printing what it has."""
    if code == 2:
        print(f"{prog}: bench_train refused the command line (exit 2, its message above)",
              file=sys.stderr)
        sys.exit(2)
    if code != 0:
        print(f"{prog}: bench_train failed (exit {code}); its rows so far are kept", file=sys.stderr)
        FAILED.append(code)


def run_tally(build, which, configs, extra=()):
    exe = os.path.join(build, "bench", "bench_train")
    cmd = [exe] + [f"--{w}" for w in which] + list(extra)
    if configs:
        cmd += ["--configs",
                ",".join("resnet:" + c if c.endswith(CHANNELS_LAST) else c for c in configs)]
    print("$", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr[-4000:])
    check_tally_exit("train.py", p.returncode)
    rows = []
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def load_baseline():
    path = os.path.join(ROOT, ".ref", "torch_baseline.py")
    if not os.path.exists(path):
        print(f"no {path}: copy the PyTorch baseline script torch_baseline.py (kept outside "
              "this repository) there to compare with PyTorch")
        return None
    spec = importlib.util.spec_from_file_location("torch_baseline", path)
    tb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tb)
    return tb


# The configurations of both frameworks: name -> checkpointing and autocast.
PLAN = {
    "resnet": [("baseline-fp32", {}), ("ckpt4", {"ckpt": True}), ("amp-fp16", {"amp": "fp16"}),
               ("amp-bf16", {"amp": "bf16"}), ("amp-fp16+ckpt4", {"ckpt": True, "amp": "fp16"})],
    "gpt": [("baseline-fp32", {}), ("ckpt-per-block", {"ckpt": True}), ("amp-bf16", {"amp": "bf16"}),
            ("amp-bf16+ckpt", {"ckpt": True, "amp": "bf16"})],
}
# Named in --configs only: bench_train takes them as resnet:<cfg>.
CHANNELS_LAST = "+channels-last"
PLAN["resnet"] += [("amp-fp16" + CHANNELS_LAST, {"amp": "fp16", "cl": True}),
                   ("amp-bf16" + CHANNELS_LAST, {"amp": "bf16", "cl": True}),
                   ("baseline-fp32" + CHANNELS_LAST, {"cl": True})]


def amp_train_step(opt, loss_fn, amp=None):
    """The baseline's training step around loss_fn() (the forward and the loss): zero_grad,
    autocast to amp ("fp16" / "bf16" / None), backward and the optimizer step, through a
    GradScaler for fp16."""
    import torch
    dtype = torch.float16 if amp == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=amp is not None):
            loss = loss_fn()
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()

    return step


def result_row(label, name, med, mn, **extra):
    """A results row with the baseline's keys: the step times and the CUDA allocator's peaks."""
    import torch
    return dict(model=label, cfg=name, step_ms=round(med, 2), step_ms_min=round(mn, 2), **extra,
                peak_alloc_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1),
                peak_reserved_mib=round(torch.cuda.max_memory_reserved() / 2**20, 1))


def torch_resnet_channels_last(tb, name, amp=None, cl=True):
    """The baseline's ResNet-50 step (torch_baseline.resnet_cfg) with the model and the images
    in torch.channels_last; its row joins the baseline's results."""
    import torch
    import torch.nn.functional as F
    import torchvision
    torch.manual_seed(0)
    dev = "cuda"
    model = torchvision.models.resnet50(num_classes=10).to(dev).to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(64, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (64,), device=dev)
    step = amp_train_step(opt, lambda: F.cross_entropy(model(x), y), amp)
    torch.cuda.empty_cache()
    med, mn = tb.timed_steps(step)
    r = result_row("resnet50-bs64", name, med, mn)
    print(json.dumps(r), flush=True)
    tb.results.append(r)
    del model, opt, x, y
    torch.cuda.empty_cache()


def run_compiled(tb, w, name, ckpt=False, amp=None, cl=False):
    """One configuration under torch.compile: the baseline's model and step, the model compiled
    (default mode). GPT-2 steps with fused AdamW; ResNet-50's 16-bit and channels-last runs use
    channels_last."""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    dev = "cuda"
    if w == "resnet":
        import torchvision
        base = torchvision.models.resnet50(num_classes=10).to(dev)
        model = tb.CkptResNet(base, 4) if ckpt else base
        x = torch.randn(64, 3, 224, 224, device=dev)
        y = torch.randint(0, 10, (64,), device=dev)
        if amp or cl:
            model = model.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        label, warm, n = "resnet50-bs64", 3, 10
    else:
        model = tb.GPT(ckpt=ckpt).to(dev)
        x = torch.randint(0, 50257, (16, 1024), device=dev)
        y = torch.randint(0, 50257, (16, 1024), device=dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        label, warm, n = "gpt2-124M-B16T1024", 2, 8
    model.train()
    compiled = torch.compile(model)

    def loss_fn():
        out = compiled(x)
        return F.cross_entropy(out.view(-1, out.size(-1)), y.view(-1))

    step = amp_train_step(opt, loss_fn, amp)

    import time
    t0 = time.perf_counter()
    step()  # compiles
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    torch.cuda.empty_cache()
    med, mn = tb.timed_steps(step, warm=warm, n=n)
    r = result_row(label, name, med, mn, compile_s=round(compile_s, 1))
    print("compile " + json.dumps(r), flush=True)
    del compiled, model, opt
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return r


def run_torch(which, configs, compile_too=False):
    tb = load_baseline()
    if tb is None:
        return [], []
    compiled = []
    for w in which:
        for name, kw in PLAN[w]:
            if (configs or kw.get("cl")) and name not in configs:
                continue
            if kw.get("cl"):
                torch_resnet_channels_last(tb, name, **kw)
            else:
                (tb.resnet_cfg if w == "resnet" else tb.gpt_cfg)(name, **kw)
            if compile_too:
                compiled.append(run_compiled(tb, w, name, **kw))
    return tb.results, compiled


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
    compile_too = "--compile" in args
    graphs = "--cuda-graphs" in args
    tally = run_tally(build, which, configs)
    if graphs:
        tally += run_tally(build, which, configs, ["--cuda-graphs"])
    torch_rows, compiled_rows = run_torch(which, configs, compile_too)
    # A graphed row ("amp-bf16+graphs") is compared with PyTorch's rows of its configuration.
    tkey = {(r["model"], r["cfg"]): r for r in torch_rows}
    ckey = {(r["model"], r["cfg"]): r for r in compiled_rows}
    for r in tally:
        base = r["cfg"].replace("+graphs", "")
        if base != r["cfg"]:
            tkey.setdefault((r["model"], r["cfg"]), tkey.get((r["model"], base)))
            ckey.setdefault((r["model"], r["cfg"]), ckey.get((r["model"], base)))
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
        out.append({"tally": r, "torch": t, "torch_compile": ckey.get((r["model"], r["cfg"]))})
    if compile_too:
        print_header(f"{'model':22} {'cfg':16} {'tally ms':>9} {'eager ms':>9} {'compile ms':>10} "
                     f"{'vs eager':>8} {'vs compile':>10} {'compile MiB':>11} {'compile resv':>12} "
                     f"{'compile s':>9} {'floor ms':>9}")
        for r in tally:
            t, c = tkey.get((r["model"], r["cfg"])), ckey.get((r["model"], r["cfg"]))
            if not c:
                continue
            flops = FLOORS.get(r["model"])
            floor = f"{flops / 790e12 * 1e3:9.2f}" if flops else f"{'':9}"
            eager = f"{t['step_ms']:9.1f}" if t else f"{'-':>9}"
            vs_eager = f"{t['step_ms'] / r['step_ms']:8.2f}" if t else f"{'-':>8}"
            print(f"{r['model']:22} {r['cfg']:16} {r['step_ms']:9.1f} {eager} {c['step_ms']:10.1f} "
                  f"{vs_eager} {c['step_ms'] / r['step_ms']:10.2f} {c['peak_alloc_mib']:11.0f} "
                  f"{c['peak_reserved_mib']:12.0f} {c['compile_s']:9.1f} {floor}")
    if graphs:
        eager = {(r["model"], r["cfg"]): r for r in tally if "+graphs" not in r["cfg"]}
        print_header(f"{'model':22} {'cfg':16} {'eager ms':>9} {'graphs ms':>9} {'saved ms':>8} "
                     f"{'saved':>6} {'eager MiB':>9} {'graphs MiB':>10} {'eager resv':>10} "
                     f"{'graphs resv':>11} {'floor ms':>9}")
        for r in tally:
            e = eager.get((r["model"], r["cfg"].replace("+graphs", "")))
            if "+graphs" not in r["cfg"] or not e:
                continue
            flops = FLOORS.get(r["model"])
            floor = f"{flops / 790e12 * 1e3:9.2f}" if flops else f"{'':9}"
            saved = e["step_ms"] - r["step_ms"]
            print(f"{r['model']:22} {e['cfg']:16} {e['step_ms']:9.2f} {r['step_ms']:9.2f} "
                  f"{saved:8.2f} {100 * saved / e['step_ms']:5.1f}% {e['peak_alloc_mib']:9.0f} "
                  f"{r['peak_alloc_mib']:10.0f} {e['peak_reserved_mib']:10.0f} "
                  f"{r['peak_reserved_mib']:11.0f} {floor}")
    print("JSON " + json.dumps(out))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
