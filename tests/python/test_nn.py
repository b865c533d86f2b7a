"""Modules (Python subclasses, layers, ResNet, GPT), optimizers, autocast, GradScaler and
checkpointing."""

import numpy as np
import pytest

import tally
import tally.nn as nn
import tally.nn.functional as F


def blobs(n=96, seed=0):
    rng = np.random.default_rng(seed)
    centers = np.array([[2.0, 0.0], [-2.0, 1.0], [0.0, -2.5]])
    y = rng.integers(0, 3, n)
    x = centers[y] + 0.4 * rng.standard_normal((n, 2))
    return tally.tensor(x.astype(np.float32)), tally.tensor(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 32)
        self.fc2 = nn.Linear(32, 3)
        self.scale = nn.Parameter(tally.ones(3))

    def forward(self, x):
        return self.fc2(self.fc1(x).relu()) * self.scale


@pytest.mark.parametrize("make_opt", [
    lambda p: tally.optim.SGD(p, lr=0.5, momentum=0.9),
    lambda p: tally.optim.Adam(p, lr=0.05),
    lambda p: tally.optim.AdamW(p, lr=0.05),
    lambda p: tally.optim.AdamW8bit(p, lr=0.05, min_8bit_size=64),
])
def test_training_loop_loss_decreases(make_opt):
    tally.manual_seed(0)
    x, y = blobs()
    model = MLP()
    names = [n for n, _ in model.named_parameters()]
    assert names == ["scale", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    opt = make_opt(model.parameters())
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses
    with tally.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    assert acc > 0.9


def test_python_module_attributes_and_state_dict():
    m = MLP()
    assert isinstance(m.fc1, nn.Linear)
    assert m.fc1.weight.shape == (32, 2)
    assert m.num_parameters() == 2 * 32 + 32 + 32 * 3 + 3 + 3
    sd = m.state_dict()
    assert set(sd) == {"scale", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    m2 = MLP()
    m2.load_state_dict({k: v.numpy() for k, v in sd.items()})
    np.testing.assert_array_equal(m2.fc1.weight.numpy(), m.fc1.weight.numpy())
    assert m.train() is m and m.training
    m.eval()
    assert not m.training and not m.fc1.training
    assert m.get_submodule("fc2") is not None
    assert repr(m).startswith("MLP(\n  (fc1): Linear(in_features=2, out_features=32")
    with pytest.raises(AttributeError):
        m.nope


def test_non_persistent_buffers_stay_out_of_the_state_dict():
    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", tally.ones(3), persistent=False)
            self.register_buffer("count", tally.ones(1))

    m = Rope()
    assert [n for n, _ in m.named_buffers()] == ["table", "count"]
    assert set(m.state_dict()) == {"count"}
    m.load_state_dict(m.state_dict())  # strict: "table" is not asked for


def test_dict_arguments_take_mappings_or_pairs_only(tmp_path):
    path = str(tmp_path / "w.safetensors")
    nn.save_safetensors(path, {"a": tally.ones(2)})
    nn.save_safetensors(path, [("a", tally.ones(2)), ("b", tally.zeros(3))])
    assert sorted(nn.load_safetensors(path)) == ["a", "b"]
    d = nn.ModuleDict({"fc": nn.Linear(2, 3)})
    assert isinstance(d["fc"], nn.Linear)
    assert isinstance(nn.ModuleDict([("act", nn.ReLU())])["act"], nn.ReLU)
    # Any other iterable is refused by type, not walked: dict() of this tensor would list its
    # 2^31 rows (the API walk's seed 111 was killed at that).
    big = tally.zeros(1, 2 ** 31, 0)
    with pytest.raises(TypeError, match="save_safetensors: expected a Module or a dict of "
                                        "name -> Tensor, got Tensor"):
        nn.save_safetensors(path, big)
    with pytest.raises(TypeError, match="ModuleDict: expected a dict"):
        nn.ModuleDict(big)


def test_sequential_and_module_errors_name_the_module():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert len(seq) == 3 and isinstance(seq[0], nn.Linear)
    assert seq(tally.randn(5, 4)).shape == (5, 2)
    with pytest.raises(ValueError) as e:
        seq(tally.randn(5, 3))
    assert "0 (Linear)" in str(e.value), str(e.value)


def test_resnet_and_gpt():
    tally.manual_seed(0)
    r = nn.resnet_tiny(num_classes=10, in_channels=1)
    out = r(tally.randn(2, 1, 28, 28))
    assert out.shape == (2, 10)
    assert any(n == "layer1.0.conv1.weight" for n, _ in r.named_parameters())
    r18 = nn.resnet18(num_classes=5)
    assert r18.fc.out_features == 5
    cfg = nn.GPTConfig.preset("tiny", n_layer=1)
    assert cfg.n_layer == 1 and cfg.vocab_size == 256
    g = nn.GPT(cfg)
    idx = tally.randint(0, 256, (2, 16))
    logits, loss = g(idx, idx)
    assert logits.shape == (2, 16, 256)
    assert loss.item() == pytest.approx(np.log(256), rel=0.2)
    assert g(idx)[1] is None
    assert "transformer.h.0.attn.c_attn.weight" in dict(g.named_parameters())


def test_linear_gelu_linear_and_gpt_fused_mlp():
    tally.manual_seed(0)
    fc, proj = nn.Linear(8, 16), nn.Linear(16, 4)
    x = tally.randn(3, 8)
    y = F.linear_gelu_linear(x, fc.weight, fc.bias, proj.weight, proj.bias)
    ref = F.linear(F.gelu(F.linear(x, fc.weight, fc.bias), approximate="tanh"), proj.weight,
                   proj.bias)
    np.testing.assert_allclose(y.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert fc.weight.grad is not None and proj.bias.grad is not None
    cfg = nn.GPTConfig.preset("tiny", n_layer=1)
    assert cfg.fused_mlp is True
    cfg.fused_mlp = False
    assert nn.GPT(cfg).config.fused_mlp is False
    # The residual add fused into ln_2 (GPTConfig.fused_add_norm) gives the unfused model's loss.
    idx = tally.randint(0, 64, (2, 8))
    losses = []
    for fused in (True, False):
        c = nn.GPTConfig.preset("tiny", n_layer=2)
        c.fused_add_norm = fused
        tally.manual_seed(1)
        losses.append(nn.GPT(c)(idx, idx)[1].item())
    assert abs(losses[0] - losses[1]) < 1e-6


def test_autocast_and_grad_scaler():
    lin = nn.Linear(8, 4)
    x = tally.randn(3, 8)
    with tally.autocast("cpu", dtype=tally.bfloat16):
        assert tally.amp.is_autocast_enabled("cpu")
        y = lin(x)
    assert y.dtype == tally.bfloat16
    assert lin(x).dtype == tally.float32
    scaler = tally.GradScaler(init_scale=1024.0)
    opt = tally.optim.SGD(lin.parameters(), lr=0.1)
    w0 = lin.weight.numpy().copy()
    loss = lin(x).sum()
    scaler.scale(loss).backward()
    assert scaler.step(opt)
    scaler.update()
    # the step used the unscaled gradient: 0.1 * dL/dW, not 1024 times it
    expected = w0 - 0.1 * np.tile(x.numpy().sum(0), (4, 1))
    np.testing.assert_allclose(lin.weight.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert scaler.get_scale() == 1024.0


def test_layer_norm_autocast_output():
    ln = nn.LayerNorm(8)
    assert ln.autocast_output is False
    x = tally.randn(3, 8)
    with tally.autocast("cpu", dtype=tally.bfloat16):
        plain = ln(x)
        ln.autocast_output = True
        fused = ln(x)
    assert plain.dtype == tally.float32 and fused.dtype == tally.bfloat16
    np.testing.assert_array_equal(fused.float().numpy(), plain.to(tally.bfloat16).float().numpy())
    assert ln(x).dtype == tally.float32  # outside autocast


def test_checkpointing_lowers_the_activation_peak():
    def peak(spec):
        tally.manual_seed(0)
        model = nn.resnet_tiny(num_classes=10, in_channels=1)
        if spec:
            nn.enable_checkpointing(model, spec)
        x = tally.randn(32, 1, 28, 28)
        y = tally.randint(0, 10, (32,))
        tally.memory.reset_peak_memory_stats("cpu")
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return tally.memory.memory_by_category("cpu", "at_peak")["activation"], \
            [p.grad.numpy().copy() for p in model.parameters()]
    plain, g_plain = peak(None)
    ckpt, g_ckpt = peak("blocks")
    assert ckpt < 0.8 * plain, (plain, ckpt)
    for a, b in zip(g_plain, g_ckpt):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_checkpoint_function_recomputes():
    from tally.utils.checkpoint import checkpoint, checkpoint_stats, reset_checkpoint_stats
    reset_checkpoint_stats()
    w = tally.randn(4, 4, requires_grad=True)
    x = tally.randn(2, 4)
    y = checkpoint(lambda a: (a @ w).tanh() @ w, x).sum()
    y.backward()
    g = w.grad.numpy().copy()
    w.grad = None
    ((x @ w).tanh() @ w).sum().backward()
    np.testing.assert_allclose(g, w.grad.numpy(), rtol=1e-5)
    s = checkpoint_stats()
    assert s["segments"] == 1 and s["recomputations"] == 1


def test_checkpoint_early_stop_from_a_python_function():
    # The recompute stops inside the last product (its operands are all backward needs): the
    # stop crosses the Python function and the gradients are the full recompute's.
    from tally.utils.checkpoint import (checkpoint, checkpoint_stats, reset_checkpoint_stats,
                                        set_checkpoint_early_stop)
    w = tally.randn(4, 4, requires_grad=True)
    x = tally.randn(2, 4)
    finished = []

    def fn(a):
        out = (a @ w).tanh() @ w
        finished.append(1)
        return out

    grads = []
    for early in (True, False):
        reset_checkpoint_stats()
        finished.clear()
        w.grad = None
        with set_checkpoint_early_stop(early):
            y = checkpoint(fn, x).sum()
        y.backward()
        grads.append(w.grad.numpy().copy())
        assert len(finished) == (1 if early else 2)
        assert checkpoint_stats()["early_stops"] == (1 if early else 0)
    np.testing.assert_array_equal(grads[0], grads[1])
