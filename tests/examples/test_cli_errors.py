#!/usr/bin/env python3
"""Bad command-line input to the example programs gives a clear error and exit 1, never a crash.

    test_cli_errors.py BUILD_DIR
"""
import os
import subprocess
import sys

ex = os.path.join(sys.argv[1], "examples")
cases = [
    (["train_resnet", "--amp", "fp8"], "--amp: expected off, fp16 or bf16, got 'fp8'"),
    (["train_resnet", "--checkpoint", "3-chunks"], "--checkpoint: expected none, blocks, N-segments"),
    (["train_resnet", "--device", "tpu"], "--device: expected cpu or cuda, got 'tpu'"),
    (["train_resnet", "--arch", "vgg"], "--arch: expected tiny, resnet18, resnet34 or resnet50, got 'vgg'"),
    (["train_resnet", "--dataset", "cifar10"], "--dataset cifar10 needs --data-root"),
    (["train_resnet", "--dataset", "mnist", "--data-root", "/nonexistent"], "/nonexistent"),
    (["train_gpt", "--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["train_gpt", "--preset", "tiny", "--seq", "4096"], "exceeds the preset's block size"),
    (["ab_memory", "--model", "vit"], "--model: expected resnet or gpt, got 'vit'"),
    (["ab_memory", "--steps", "1"], "--steps must be at least 2"),
    (["profile_models", "--amp", "fp8"], "--amp: expected off, fp16 or bf16, got 'fp8'"),
    (["train_ddp", "--device", "cpu", "--model", "vit"], "--model: expected resnet50, resnet18, tiny"),
    (["train_ddp", "--device", "cpu", "--model", "tiny", "--amp", "fp8"], "--amp: expected off, fp16 or bf16"),
]
fails = 0
for args, want in cases:
    p = subprocess.run([os.path.join(ex, args[0])] + args[1:], capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    if p.returncode != 1 or want not in out:
        fails += 1
        print(f"FAIL: {' '.join(args)}: exit {p.returncode}, expected 1 and '{want}' in:\n{out[-600:]}")
    else:
        print(f"ok: {' '.join(args)} -> {out.strip().splitlines()[-1]}")
sys.exit(1 if fails else 0)
