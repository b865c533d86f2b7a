"""Tally against PyTorch on the GPU, in one process: a small CNN and a small transformer written
in tally.nn and the same models in torch.nn, PyTorch's weights copied into Tally's. Under bf16
autocast, the first step's loss and every gradient, then the losses of 10 AdamW steps and the
parameters after them, agree within bf16's tolerances. Skips without CUDA or without torch."""
import math

import numpy as np
import pytest

import tally
import tally.nn as tnn
import tally.nn.functional as TF
from attention_block import add_attention_block_layers

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (tally.cuda.is_available() and torch.cuda.is_available()),
    reason="needs a CUDA device for both Tally and PyTorch")
tn = torch.nn
F = torch.nn.functional

STEPS = 10
LR = 1e-3
# bf16 keeps 8 bits of mantissa: one rounding is 2**-9 relative; sums of a few hundred
# products in different orders (cuBLAS and cuDNN pick their own algorithms in each framework)
# differ by a few of those. The norm-wise errors below are measured over whole tensors.
LOSS_RTOL = 2e-2
GRAD_RTOL = 5e-2
# After AdamW steps the parameters are compared by their updates (final - initial): Adam
# divides by sqrt(v), so an element whose gradient is near zero moves by up to lr either way
# on a bf16 rounding; the update as a whole must point the same way and have the same size.
UPDATE_MIN_COSINE = 0.9
UPDATE_NORM_RTOL = 0.2


# ---- the models, written once over either framework's nn, functional and arange ----

D, HEADS, VOCAB, T = 64, 4, 96, 32


def _heads(x, b):
    return x.view(b, T, HEADS, D // HEADS).transpose(1, 2)


def _models(nn, F, arange):
    """(CNN, Transformer) classes built from one framework's modules."""

    # The convolutions feed batch norms, so they have no bias (as ResNet's): a bias there has a
    # gradient of zero up to rounding, which no relative tolerance can compare.
    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(16)
            self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(32)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            x = self.bn1(self.conv1(x)).relu()
            x = self.bn2(self.conv2(x)).relu()
            return self.fc(self.pool(x).flatten(1))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            add_attention_block_layers(self, nn, D)

        def forward(self, x):
            b = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).split(D, 2)
            a = F.scaled_dot_product_attention(_heads(q, b), _heads(k, b), _heads(v, b),
                                               is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, T, D))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, D)
            self.pos = nn.Embedding(T, D)
            blocks = [Block(), Block()]
            self.blocks = nn.ModuleList(blocks)
            self._python_blocks = blocks  # keeps Tally's Python side (forward) of each block alive
            self.ln_f = nn.LayerNorm(D)
            self.head = nn.Linear(D, VOCAB)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(arange(T, device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x)).view(-1, VOCAB)

    return CNN, Transformer


TallyCNN, TallyTransformer = _models(tnn, TF, tally.arange)
TorchCNN, TorchTransformer = _models(tn, F, torch.arange)


# ---- helpers ----

def _copy_weights(tmodel, pmodel):
    """PyTorch's initial weights (and BatchNorm's buffers) into Tally's model."""
    ours = dict(tmodel.state_dict())
    theirs = {k: v for k, v in pmodel.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert set(theirs) <= set(ours), sorted(set(theirs) ^ set(ours))
    tmodel.load_state_dict(
        {k: tally.tensor(v.detach().cpu().numpy()).to("cuda") for k, v in theirs.items()},
        strict=False)
    for k, v in theirs.items():
        np.testing.assert_array_equal(tmodel.state_dict()[k].numpy(), v.detach().cpu().numpy())


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def _run(make, inputs, targets):
    torch.manual_seed(0)
    pmodel = make[1]().cuda()
    tmodel = make[0]()
    tmodel.to("cuda")
    _copy_weights(tmodel, pmodel)
    pmodel.train()
    tmodel.train()
    p_opt = torch.optim.AdamW(pmodel.parameters(), lr=LR, weight_decay=0.01)
    t_opt = tally.optim.AdamW(tmodel.parameters(), lr=LR, weight_decay=0.01)
    initial = {n: p.detach().double().cpu().numpy().copy() for n, p in pmodel.named_parameters()}
    x_p = torch.from_numpy(inputs).cuda()
    y_p = torch.from_numpy(targets).cuda()
    x_t = tally.tensor(inputs).to("cuda")
    y_t = tally.tensor(targets).to("cuda")
    tparams = dict(tmodel.named_parameters())
    losses = []
    for step in range(STEPS + 1):
        p_opt.zero_grad()
        t_opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p_loss = F.cross_entropy(pmodel(x_p), y_p)
        with tally.autocast("cuda", dtype=tally.bfloat16):
            t_loss = TF.cross_entropy(tmodel(x_t), y_t)
        p_loss.backward()
        t_loss.backward()
        losses.append((t_loss.item(), p_loss.item()))
        if step == 0:
            assert math.isfinite(losses[0][0])
            assert abs(losses[0][0] - losses[0][1]) <= LOSS_RTOL * abs(losses[0][1]), losses[0]
            for name, p in pmodel.named_parameters():
                err = _rel(tparams[name].grad.numpy(), p.grad.float().cpu().numpy())
                assert err < GRAD_RTOL, f"gradient of {name}: relative error {err:.3g}"
        if step < STEPS:
            p_opt.step()
            t_opt.step()
    for t_l, p_l in losses:
        assert abs(t_l - p_l) <= LOSS_RTOL * abs(p_l), losses
    assert losses[-1][1] < losses[0][1]  # both trained
    for name, p in pmodel.named_parameters():
        d_t = (np.asarray(tparams[name].numpy(), np.float64) - initial[name]).ravel()
        d_p = (p.detach().double().cpu().numpy() - initial[name]).ravel()
        n_t, n_p = np.linalg.norm(d_t), np.linalg.norm(d_p)
        assert n_p > 0, f"{name}: PyTorch did not move it"
        cos = float(d_t @ d_p / max(n_t * n_p, 1e-30))
        assert cos >= UPDATE_MIN_COSINE, f"{name} after {STEPS} AdamW steps: update cosine {cos:.3f}"
        assert abs(n_t - n_p) <= UPDATE_NORM_RTOL * n_p, (
            f"{name} after {STEPS} AdamW steps: update norm {n_t:.4g} against PyTorch's {n_p:.4g}")


def test_cnn_matches_pytorch_under_bf16_autocast():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3, 16, 16)).astype(np.float32)
    y = rng.integers(0, 10, 16).astype(np.int64)
    _run((TallyCNN, TorchCNN), x, y)


def test_transformer_matches_pytorch_under_bf16_autocast():
    rng = np.random.default_rng(1)
    idx = rng.integers(0, VOCAB, (8, T)).astype(np.int64)
    targets = np.roll(idx, -1, axis=1).reshape(-1)
    _run((TallyTransformer, TorchTransformer), idx, targets)


# ---- a registry model's Python class against its PyTorch definition (bench/models/) ----

def _bench_model(name):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "models",
                        name + ".py")
    spec = importlib.util.spec_from_file_location("bench_" + name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("amp", ["fp32", "bf16"])
def test_llama_class_matches_pytorch(amp):
    """tally.nn.LlamaForCausalLM (rotary, SwiGLU and the RMSNorm adds fused) against
    bench/models/llama.py with the same weights: the first step's loss and every gradient, in
    float32 (TF32 off) and under bf16 autocast, then 10 AdamW steps' losses under bf16."""
    ref = _bench_model("llama")
    torch.manual_seed(0)
    pmodel = ref.build("tiny").cuda()
    tmodel = tnn.LlamaForCausalLM(tnn.LlamaConfig.preset("tiny"))
    tmodel.to("cuda")
    _copy_weights(tmodel, pmodel)
    rng = np.random.default_rng(1)
    idx = rng.integers(0, 256, (4, 64)).astype(np.int64)
    tgt = rng.integers(0, 256, (4, 64)).astype(np.int64)
    x_p, y_p = torch.from_numpy(idx).cuda(), torch.from_numpy(tgt).cuda()
    x_t, y_t = tally.tensor(idx).to("cuda"), tally.tensor(tgt).to("cuda")
    low = amp == "bf16"
    loss_rtol, grad_rtol = (LOSS_RTOL, GRAD_RTOL) if low else (1e-5, 1e-4)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    p_opt = torch.optim.AdamW(pmodel.parameters(), lr=LR, weight_decay=0.01)
    t_opt = tally.optim.AdamW(tmodel.parameters(), lr=LR, weight_decay=0.01)
    tparams = dict(tmodel.named_parameters())
    losses = []
    try:
        for step in range(STEPS + 1 if low else 1):
            p_opt.zero_grad()
            t_opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=low):
                p_loss = ref.loss(pmodel, x_p, y_p)
            with tally.autocast("cuda", dtype=tally.bfloat16, enabled=low):
                t_loss = tmodel(x_t, y_t)[1]
            p_loss.backward()
            t_loss.backward()
            losses.append((t_loss.item(), p_loss.item()))
            if step == 0:
                assert abs(losses[0][0] - losses[0][1]) <= loss_rtol * abs(losses[0][1]), losses
                for name, p in pmodel.named_parameters():
                    err = _rel(tparams[name].grad.numpy(), p.grad.float().cpu().numpy())
                    assert err < grad_rtol, f"{amp}: gradient of {name}: relative error {err:.3g}"
            p_opt.step()
            t_opt.step()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    for t_l, p_l in losses:
        assert abs(t_l - p_l) <= loss_rtol * abs(p_l), losses
