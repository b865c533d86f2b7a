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

The registry models (nn/models/registry.h), one row each, chosen with --only (MODEL_ROWS):
LLaMA-1B in bf16, ViT-B/16 in bf16, the DDPM U-Net in fp16, the LSTM LM in fp32. Tally's side
is `bench_train --model NAME` (the registry's model and synthetic batch); PyTorch's builds the
same model from bench/models/NAME.py (build(preset), loss(model, input, target): the
definitions the equivalence tests compare with), eager and, with --compile, torch.compile, both
with fused AdamW (lr 1e-4, weight decay 0.01) and autocast to the row's dtype (a GradScaler for
fp16), TF32 off. The floor is bench_train's: the step's FLOPs and bytes as the meta device's
cost model counts them (an H200 dry run of the same step), the FLOPs over 790 TFLOP/s under
autocast (67 TFLOP/s for the float32 row), the bytes over 4.3 TB/s, whichever is longer.

    python3 bench/train.py BUILD_DIR --only llama,vit,unet,lstm [--compile] [--steps N]
    python3 bench/train.py BUILD_DIR --only llama,vit,unet,lstm --smoke   (tiny presets on the
        CPU, Tally's side only, no torch: the plumbing)
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


# The registry models' rows (--only): Tally's bench_train --model flags, and the smoke run's
# (--smoke: the tiny preset on the CPU).
MODEL_ROWS = {
    "llama": dict(model="llama", preset="1b", batch=8, seq=2048, amp="bf16",
                  smoke=dict(preset="tiny", batch=2, seq=32)),
    "vit": dict(model="vit", preset="vit_b_16", batch=64, image_size=224, amp="bf16",
                smoke=dict(preset="tiny", batch=2, image_size=32)),
    "unet": dict(model="unet", preset="ddpm-cifar", batch=128, image_size=32, amp="fp16",
                 smoke=dict(preset="tiny", batch=2, image_size=8)),
    "lstm": dict(model="lstm", preset="medium", batch=64, seq=35, amp="off",
                 smoke=dict(preset="tiny", batch=2, seq=16)),
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


def model_row(name, smoke=False):
    """MODEL_ROWS[name] with the smoke run's values over it when `smoke`."""
    row = {k: v for k, v in MODEL_ROWS[name].items() if k != "smoke"}
    if smoke:
        row.update(MODEL_ROWS[name]["smoke"])
    return row


def tally_model_command(build, row, steps, warmup, device):
    cmd = [os.path.join(build, "bench", "bench_train"), "--model", row["model"], "--preset",
           row["preset"], "--batch", str(row["batch"]), "--amp", row["amp"], "--device", device,
           "--steps", str(steps), "--warmup", str(warmup)]
    if "seq" in row:
        cmd += ["--seq", str(row["seq"])]
    if "image_size" in row:
        cmd += ["--image-size", str(row["image_size"])]
    return cmd


def run_tally_models(build, names, steps, warmup, smoke):
    """One bench_train --model run per row (a process each: one model's memory at a time)."""
    rows = []
    for name in names:
        cmd = tally_model_command(build, model_row(name, smoke), steps, warmup,
                                  "cpu" if smoke else "cuda")
        print("$", " ".join(cmd), flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write(p.stdout)
        sys.stderr.write(p.stderr[-4000:])
        check_tally_exit("train.py", p.returncode)
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                r["row"] = name
                rows.append(r)
    return rows


def torch_model_batch(row, mod):
    """The registry's synthetic batch's shapes and ranges, on the GPU: tokens [B, T] int64 with
    targets [B, T]; ViT images [B, 3, S, S] float32 with 10 classes; the U-Net's [B, 6, S, S]
    (x0 and the noise) with timesteps [B] in [0, 1000)."""
    import torch
    dev = "cuda"
    B = row["batch"]
    if row["model"] == "llama":
        V = mod.PRESETS[row["preset"]]["vocab"]
        return (torch.randint(0, V, (B, row["seq"]), device=dev),
                torch.randint(0, V, (B, row["seq"]), device=dev))
    if row["model"] == "lstm":
        V = mod.PRESETS[row["preset"]][0]
        return (torch.randint(0, V, (B, row["seq"]), device=dev),
                torch.randint(0, V, (B, row["seq"]), device=dev))
    S = row["image_size"]
    if row["model"] == "unet":
        return (torch.randn(B, 6, S, S, device=dev), torch.randint(0, 1000, (B,), device=dev))
    return torch.randn(B, 3, S, S, device=dev), torch.randint(0, 10, (B,), device=dev)


def timed_steps(step, warm, n):
    """Median and minimum ms of n steps after warm ones, each synchronized (bench_train's
    timing); the CUDA allocator's peaks reset after the warm-up."""
    import time
    import torch
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ts.append(1e3 * (time.perf_counter() - t0))
    ts.sort()
    return ts[len(ts) // 2], ts[0]


def torch_model_row(name, steps, warmup, compiled):
    """PyTorch's step of MODEL_ROWS[name], eager or under torch.compile (the model compiled,
    default mode): bench/models/NAME.py's model built on the GPU, its loss, fused AdamW. Run out
    of memory, the row says so."""
    import gc
    import time
    import torch
    label = "torch.compile" if compiled else "eager"

    def measure():
        row = model_row(name)
        sys.path.insert(0, os.path.join(HERE, "models"))
        mod = importlib.import_module(row["model"])
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = mod.build(row["preset"])
        model.train()
        x, y = torch_model_batch(row, mod)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        fwd = torch.compile(model) if compiled else model
        amp = None if row["amp"] == "off" else row["amp"]
        step = amp_train_step(opt, lambda: mod.loss(fwd, x, y), amp)
        extra = {}
        if compiled:
            t0 = time.perf_counter()
            step()  # compiles
            torch.cuda.synchronize()
            extra["compile_s"] = round(time.perf_counter() - t0, 1)
        torch.cuda.empty_cache()
        med, mn = timed_steps(step, warmup, steps)
        return result_row(name, label, med, mn, **extra)

    # float32 as Tally's: no TF32 in matmuls or cuDNN (the LSTM row's float32 products).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        r = measure()
    except torch.cuda.OutOfMemoryError as e:
        r = dict(model=name, cfg=label, oom=str(e)[:200])
    print(("compile " if compiled else "") + json.dumps(r), flush=True)
    gc.collect()
    if compiled:
        torch._dynamo.reset()
    torch.cuda.empty_cache()
    return r


def models_table(names, tally_rows, eager, compiled, smoke):
    """One line per registry model: Tally against PyTorch eager and torch.compile (speed: their
    time over Tally's, >= 1 when Tally is as fast), peak allocated of each, and the floor."""
    def ms(r):
        return f"{r['step_ms']:9.1f}" if r and "step_ms" in r else f"{'OOM' if r else '-':>9}"

    def mib(r):
        return f"{r['peak_alloc_mib']:9.0f}" if r and "peak_alloc_mib" in r else f"{'-':>9}"

    def ratio(r, t):
        return f"{r['step_ms'] / t['step_ms']:7.2f}" if r and "step_ms" in r else f"{'-':>7}"

    print_header(f"{'model':26} {'cfg':13} {'tally ms':>9} {'eager ms':>9} {'compile ms':>10} "
                 f"{'vs eager':>8} {'vs comp':>7} {'tally MiB':>9} {'eager MiB':>9} "
                 f"{'comp MiB':>9} {'floor ms':>9} {'GFLOP':>8} {'GB':>7}")
    out = []
    for t in tally_rows:
        e, c = eager.get(t["row"]), compiled.get(t["row"])
        flops = t["gflop_16bit"] + t["gflop_32bit"]
        print(f"{t['model']:26} {t['cfg']:13} {t['step_ms']:9.1f} {ms(e)} {ms(c):>10} "
              f"{ratio(e, t):>8} {ratio(c, t)} {t['peak_alloc_mib']:9.0f} {mib(e)} {mib(c)} "
              f"{t['floor_ms']:9.2f} {flops:8.1f} {t['gbytes']:7.2f}")
        out.append({"tally": t, "torch": e, "torch_compile": c})
    if smoke:
        print("(--smoke: tiny presets on the CPU, no PyTorch; the floor is the H200's)")
    return out


def run_models(build, names, args):
    smoke = "--smoke" in args
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else (2 if smoke else 10)
    warmup = 1 if smoke else 3
    tally = run_tally_models(build, names, steps, warmup, smoke)
    eager, compiled = {}, {}
    if not smoke and "--no-torch" not in args:
        for name in names:
            eager[name] = torch_model_row(name, steps, warmup, False)
            if "--compile" in args:
                compiled[name] = torch_model_row(name, steps, warmup, True)
    return models_table(names, tally, eager, compiled, smoke)


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
    if "--only" in args:
        names = args[args.index("--only") + 1].split(",")
        unknown = [n for n in names if n not in MODEL_ROWS]
        if unknown:
            print(f"train.py: --only: unknown row(s) {', '.join(unknown)} (rows: "
                  f"{', '.join(MODEL_ROWS)})", file=sys.stderr)
            return 2
        out = run_models(build, names, args)
        print("JSON " + json.dumps(out))
        return 1 if FAILED else 0
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
