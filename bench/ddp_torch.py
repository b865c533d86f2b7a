#!/usr/bin/env python3
"""One rank of PyTorch's DistributedDataParallel on synthetic data: the reference for
examples/train_ddp. Started like torchrun does it (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT in the environment), e.g. by Tally's own launcher:

    tools/tally_launch --nproc-per-node 8 python3 bench/ddp_torch.py --model resnet50 --batch 64
    python3 bench/ddp_torch.py --model gpt2 --batch 8 --amp bf16        (a single process)

Same workload as train_ddp: ResNet-50 (torchvision, 1000 classes, 3x224x224, SGD momentum
0.9, weight decay 5e-4) or GPT-2 124M (vocab 50257, T=1024, tied embeddings, GELU tanh,
SDPA, AdamW), DDP with bucket_cap_mb 25, fp32 at PyTorch's precision defaults (convolutions on TF32, matmuls exact unless --tf32). Rank 0's last
line: "RESULT model=... world=... step_ms=... throughput=... unit=..." like train_ddp.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch_gpt import GPT


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", choices=["resnet50", "resnet18", "gpt2"])
    p.add_argument("--batch", type=int, default=0, help="per rank (0: 64 ResNet, 8 GPT)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--amp", default="off", choices=["off", "fp16", "bf16"])
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--tf32", action="store_true",
                   help="also allow TF32 in fp32 matmuls (off, as in PyTorch and Tally); fp32 convolutions use "
                        "TF32 by default in both (torch.backends.cudnn.allow_tf32, cuda::cudnn_allow_tf32)")
    a = p.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default, and Tally's
    torch.backends.cudnn.benchmark = False
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)

    gpt = a.model == "gpt2"
    B = a.batch or (8 if gpt else 64)
    torch.manual_seed(0)
    if gpt:
        model = GPT(T=a.seq, float_logits=True).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    else:
        import torchvision
        model = getattr(torchvision.models, a.model)(num_classes=1000).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, foreach=True)
    model.train()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], bucket_cap_mb=a.bucket_cap_mb) \
        if world > 1 else model
    scaler = torch.amp.GradScaler("cuda") if a.amp == "fp16" else None
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(a.amp)

    g = torch.Generator(device=dev)
    g.manual_seed(1000 + rank)
    # A few distinct synthetic batches per rank, cycled (data loading is not measured).
    if gpt:
        batches = [(torch.randint(0, 50257, (B, a.seq), device=dev, generator=g),
                    torch.randint(0, 50257, (B, a.seq), device=dev, generator=g)) for _ in range(4)]
    else:
        s = a.image_size
        batches = [(torch.randn(B, 3, s, s, device=dev, generator=g),
                    torch.randint(0, 1000, (B,), device=dev, generator=g)) for _ in range(4)]

    def step(i):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            loss = ddp(x, y) if gpt else F.cross_entropy(ddp(x), y)
        if scaler:
            scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        else:
            loss.backward(); opt.step()
        return loss

    for i in range(a.warmup):
        step(i)
    torch.cuda.synchronize()
    if world > 1:
        dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(a.steps):
        loss = step(a.warmup + i)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1000 / a.steps
    t = torch.tensor([ms], device=dev, dtype=torch.float64)
    if world > 1:
        all_ms = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(all_ms, t)
        slowest = max(x.item() for x in all_ms)
    else:
        slowest = ms
    items = B * (a.seq if gpt else 1) * world
    unit = "tokens/s" if gpt else "images/s"
    print(f"rank {rank}: {ms:.2f} ms/step, loss {loss.item():.4f}, peak allocated "
          f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", flush=True)
    if rank == 0:
        print(f"RESULT model={a.model} world={world} batch={B} seq={a.seq if gpt else 0} amp={a.amp} "
              f"step_ms={slowest:.3f} throughput={items / (slowest / 1000):.1f} unit={unit} "
              f"peak_alloc_mib={torch.cuda.max_memory_allocated() / 2**20:.1f} "
              f"peak_reserved_mib={torch.cuda.max_memory_reserved() / 2**20:.1f}", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
