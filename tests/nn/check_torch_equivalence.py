#!/usr/bin/env python3
"""Replays equivalence_dump's training step in PyTorch and compares loss and gradients.

Usage: check_torch_equivalence.py [--device cpu|cuda] [--tol 1e-4] DIR [DIR ...]

Each DIR holds weights.safetensors (the Tally model's state_dict before the step; its
__metadata__ says which model: resnet18 | resnet_tiny | gpt-small | gpt-tiny and the
configuration), batch.safetensors (input, target) and grads.safetensors (loss and one
gradient per parameter name), as examples/equivalence_dump writes them. The script builds
torchvision.models.resnet18(num_classes=...) (conv1 adapted to in_channels), a
ResNetTiny mirror, or a nanoGPT-style GPT defined below (GELU tanh, tied lm_head), loads
the weights strictly, runs forward + cross-entropy + backward in train mode in float32
with TF32 off, and asserts that the loss and every gradient agree with Tally's to a
norm-wise relative error <= tol (||a - b|| / ||b||). Prints one table per DIR.

Exit 0 when every comparison passes, 1 on a mismatch, 2 on bad usage or unreadable files.
The files are read with check_safetensors.read_safetensors (stdlib), so the safetensors
package is not needed.
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_safetensors import FormatError, read_safetensors  # noqa: E402

TORCH_DTYPES = None


def to_torch(entry):
    import torch
    dtype, shape, buf = entry
    dt = TORCH_DTYPES[dtype]
    if len(buf) == 0:
        return torch.zeros(shape, dtype=dt)
    return torch.frombuffer(bytearray(buf), dtype=dt).reshape(shape).clone()


def load(path):
    tensors, meta = read_safetensors(path)
    return {k: to_torch(v) for k, v in tensors.items()}, meta


# ---- a nanoGPT-style GPT (Karpathy's model.py), GELU tanh as in Tally ----
def make_gpt(cfg):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(cfg["n_embd"], 3 * cfg["n_embd"], bias=cfg["bias"])
            self.c_proj = nn.Linear(cfg["n_embd"], cfg["n_embd"], bias=cfg["bias"])
            self.resid_dropout = nn.Dropout(0.0)
            self.n_head = cfg["n_head"]
            self.n_embd = cfg["n_embd"]

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.c_proj(y))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(cfg["n_embd"], 4 * cfg["n_embd"], bias=cfg["bias"])
            self.gelu = nn.GELU(approximate="tanh")
            self.c_proj = nn.Linear(4 * cfg["n_embd"], cfg["n_embd"], bias=cfg["bias"])
            self.dropout = nn.Dropout(0.0)

        def forward(self, x):
            return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(cfg["n_embd"], bias=cfg["bias"])
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(cfg["n_embd"], bias=cfg["bias"])
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(cfg["vocab_size"], cfg["n_embd"]),
                wpe=nn.Embedding(cfg["block_size"], cfg["n_embd"]),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList([Block() for _ in range(cfg["n_layer"])]),
                ln_f=nn.LayerNorm(cfg["n_embd"], bias=cfg["bias"]),
            ))
            self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # weight tying

        def forward(self, idx, targets):
            b, t = idx.size()
            pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    return GPT()


def make_resnet_tiny(num_classes, in_channels):
    import torch.nn as nn
    from torchvision.models.resnet import BasicBlock

    def down(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 1, stride=2, bias=False), nn.BatchNorm2d(o))

    class ResNetTiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(16)
            self.relu = nn.ReLU(inplace=True)
            self.layer1 = nn.Sequential(BasicBlock(16, 16))
            self.layer2 = nn.Sequential(BasicBlock(16, 32, 2, down(16, 32)))
            self.layer3 = nn.Sequential(BasicBlock(32, 64, 2, down(32, 64)))
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(64, num_classes)

        def forward(self, x):
            x = self.relu(self.bn1(self.conv1(x)))
            x = self.layer3(self.layer2(self.layer1(x)))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNetTiny()


def rel_err(a, b):
    import torch
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    if a.shape != b.shape:
        return math.inf
    nb = torch.linalg.vector_norm(b).item()
    diff = torch.linalg.vector_norm(a - b).item()
    return diff / nb if nb > 0 else diff


def check_dir(d, device, tol):
    import torch
    import torch.nn.functional as F
    weights, meta = load(os.path.join(d, "weights.safetensors"))
    batch, _ = load(os.path.join(d, "batch.safetensors"))
    grads, _ = load(os.path.join(d, "grads.safetensors"))
    name = meta["model"]
    registry = None
    if meta.get("registry") == "1":
        # A model of nn/models/registry.h: bench/models/<name>.py defines build(preset) and
        # loss(model, input, target), the model as PyTorch writes it.
        import importlib.util
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                            "models", f"{name}.py")
        if not os.path.exists(path):
            raise FormatError(f"{d}: model {name!r} has no PyTorch definition at {path}")
        spec = importlib.util.spec_from_file_location(f"tally_ref_{name}", path)
        registry = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(registry)
        model = registry.build(meta["preset"])
    elif name == "resnet18":
        import torchvision
        model = torchvision.models.resnet18(num_classes=int(meta["num_classes"]))
        cin = int(meta["in_channels"])
        if cin != 3:
            model.conv1 = torch.nn.Conv2d(cin, 64, kernel_size=7, stride=2, padding=3, bias=False)
    elif name == "resnet_tiny":
        model = make_resnet_tiny(int(meta["num_classes"]), int(meta["in_channels"]))
    elif name in ("gpt-small", "gpt-tiny"):
        cfg = {k: int(meta[k]) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
        cfg["bias"] = meta.get("bias", "1") == "1"
        model = make_gpt(cfg)
    else:
        raise FormatError(f"{d}: unknown model {name!r} in the metadata")
    model.load_state_dict(weights, strict=True)
    model = model.to(device=device, dtype=torch.float32)
    model.train()
    x = batch["input"].to(device)
    y = batch["target"].to(device)
    if registry is not None:
        loss = registry.loss(model, x, y)
    elif name.startswith("gpt"):
        loss = model(x, y)
    else:
        loss = F.cross_entropy(model(x), y)
    loss.backward()

    rows = [("loss", rel_err(loss, grads["loss"]), float(grads["loss"]), loss.item())]
    torch_params = dict(model.named_parameters())
    missing = [n for n in torch_params if n not in grads]
    extra = [n for n in grads if n != "loss" and n not in torch_params]
    for n, p in torch_params.items():
        if n in grads:
            if p.grad is None:
                rows.append((n, math.inf, grads[n].norm().item(), 0.0))
            else:
                rows.append((n, rel_err(p.grad, grads[n]), grads[n].norm().item(), p.grad.norm().item()))
    ok = True
    print(f"\n{d}: {name} on {device} (Tally ran on {meta.get('device')})")
    print(f"  {'tensor':48s} {'rel err':>10s} {'|tally|':>12s} {'|torch|':>12s}")
    for n, err, a, b in rows:
        bad = not (err <= tol)
        ok &= not bad
        print(f"  {n:48s} {err:10.2e} {a:12.6g} {b:12.6g}{'  FAIL' if bad else ''}")
    if missing or extra:
        ok = False
        print(f"  FAIL: names differ: missing in Tally {missing}, only in Tally {extra}")
    print(f"  {'PASS' if ok else 'FAIL'}: {len(rows)} comparisons, max rel err "
          f"{max(r[1] for r in rows):.2e} (tol {tol:g})")
    return ok


def main(argv):
    global TORCH_DTYPES
    device, tol, dirs = None, 1e-4, []
    it = iter(argv)
    for a in it:
        if a == "--device":
            device = next(it, None)
        elif a == "--tol":
            tol = float(next(it, "nan"))
        else:
            dirs.append(a)
    if not dirs:
        print(__doc__, file=sys.stderr)
        return 2
    import torch
    TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                    "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                    "BOOL": torch.bool}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = True
    try:
        for d in dirs:
            ok &= check_dir(d, device, tol)
    except (OSError, FormatError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
