"""Datasets and the DataLoader, learning-rate schedulers, optimizer state round trips,
step-in-backward, activation offload and indexing with tensors."""

import numpy as np
import pytest

import tally
import tally.nn as nn
import tally.nn.functional as F
from tally.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, StepLR, WarmupCosineLR
from tally.utils.data import DataLoader, SyntheticImages, SyntheticTokens, TextCorpus


def test_dataloader_batches_shuffles_and_drops_last():
    ds = SyntheticImages(10, [1, 4, 4], classes=3, seed=7)
    assert len(ds) == 10
    x0, y0 = ds[0]
    assert x0.shape == (1, 4, 4) and y0.dtype == tally.int64
    assert int(y0.item()) == ds.label(0)

    loader = DataLoader(ds, batch_size=4, shuffle=True, seed=3)
    assert len(loader) == 3
    batches = list(loader)
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    order = loader.epoch_order(0)
    assert sorted(order) == list(range(10)) and order != list(range(10))
    # The first batch is the examples of the epoch's order, stacked.
    np.testing.assert_array_equal(batches[0][0].numpy(),
                                  np.stack([ds[i][0].numpy() for i in order[:4]]))
    assert loader.epoch == 1
    # The same seed gives the same epoch; the next epoch another order.
    again = DataLoader(ds, batch_size=4, shuffle=True, seed=3)
    np.testing.assert_array_equal(next(iter(again))[1].numpy(), batches[0][1].numpy())
    assert loader.epoch_order(1) != order

    dropped = DataLoader(ds, batch_size=4, drop_last=True)
    assert len(dropped) == 2 and len(list(dropped)) == 2
    tokens = SyntheticTokens(6, vocab=50, shape=[8], seed=1)
    x, y = next(iter(DataLoader(tokens, batch_size=3)))
    assert x.shape == (3, 8) and y.shape == (3, 8)
    with pytest.raises(IndexError):
        ds[10]


def test_dataloader_feeds_a_training_loop():
    tally.manual_seed(0)
    ds = SyntheticImages(64, [1, 8, 8], classes=4, seed=0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 4))
    opt = tally.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for epoch in range(3):
        for x, y in DataLoader(ds, batch_size=16, shuffle=True, seed=epoch):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_text_corpus():
    try:
        corpus = TextCorpus()
    except (ValueError, RuntimeError, OSError) as e:
        pytest.skip(f"no fortunes file: {e}")
    assert corpus.vocab_size == 256
    assert corpus.num_tokens("train") + corpus.num_tokens("val") == corpus.num_tokens()
    x, y = corpus.get_batch(4, 32, seed=1)
    assert x.shape == (4, 32)
    np.testing.assert_array_equal(x.numpy()[:, 1:], y.numpy()[:, :-1])
    assert TextCorpus.decode(TextCorpus.encode("memory")) == b"memory"
    windows = corpus.windows("val", 64)
    # Non-overlapping windows whose targets (one token later) stay inside the split.
    assert windows.seq_len == 64
    assert len(windows) == (corpus.num_tokens("val") - 1) // 64
    wx, wy = windows[1]
    np.testing.assert_array_equal(wx.numpy(), corpus.tokens("val").numpy()[64:128])
    with pytest.raises(ValueError, match="split"):
        corpus.tokens("test")


def test_lr_schedulers_follow_pytorch_closed_forms():
    p = [tally.zeros(2, requires_grad=True)]
    opt = tally.optim.SGD(p, lr=1.0)
    s = StepLR(opt, step_size=2, gamma=0.5)
    lrs = [opt.lr]
    for _ in range(5):
        opt.step()
        s.step()
        lrs.append(opt.lr)
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    assert s.get_last_lr() == [0.25] and s.last_epoch == 5 and s.base_lrs == [1.0]
    s.last_epoch = 1
    assert opt.lr == 1.0

    opt = tally.optim.SGD(p, lr=0.1)
    c = CosineAnnealingLR(opt, T_max=10, eta_min=0.0)
    for _ in range(5):
        c.step()
    assert opt.lr == pytest.approx(0.05)

    opt = tally.optim.SGD(p, lr=2.0)
    calls = []
    lam = LambdaLR(opt, lambda e: calls.append(e) or 0.9 ** e)
    lam.step()
    lam.step()
    assert calls == [0, 1, 2] and opt.lr == pytest.approx(2.0 * 0.81)

    opt = tally.optim.AdamW(p, lr=1e-3)
    w = WarmupCosineLR(opt, warmup_steps=4, total_steps=20, min_lr=1e-4)
    assert opt.lr == pytest.approx(1e-3 * 1 / 5)
    for _ in range(4):
        w.step()
    assert opt.lr == pytest.approx(1e-3)
    for _ in range(30):
        w.step()
    assert opt.lr == pytest.approx(1e-4)
    with pytest.raises(TypeError, match="lr_lambda.0. returned a <class 'str'>"):
        LambdaLR(opt, lambda e: "not a number")


def _grads(model, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def test_optimizer_state_dict_round_trip():
    tally.manual_seed(0)
    x, y = tally.randn(16, 5), tally.randint(0, 3, (16,))
    a = nn.Linear(5, 3)
    b = nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    opt_a = tally.optim.Adam(a.parameters(), lr=0.01)
    for _ in range(3):
        opt_a.zero_grad()
        _grads(a, x, y)
        opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b = tally.optim.Adam(b.parameters(), lr=0.5)
    sd = opt_a.state_dict()
    assert sd["state.0.step"] == 3 and "state.0.exp_avg" in sd
    opt_b.load_state_dict(sd)
    assert opt_b.lr == pytest.approx(0.01)
    for opt, model in ((opt_a, a), (opt_b, b)):
        opt.zero_grad()
        _grads(model, x, y)
        opt.step()
    np.testing.assert_array_equal(a.weight.numpy(), b.weight.numpy())

    bad = dict(sd)
    bad["state.0.exp_avg"] = tally.zeros(2, 2)
    with pytest.raises(ValueError, match="load_state_dict"):
        opt_b.load_state_dict(bad)
    with pytest.raises(TypeError, match="state.0.step"):
        opt_b.load_state_dict({**sd, "state.0.step": "three"})


def _twin_mlps():
    """A batch and two MLPs with the same weights (seed 0)."""
    tally.manual_seed(0)
    x, y = tally.randn(8, 6), tally.randint(0, 4, (8,))
    a = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    b = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    b.load_state_dict(a.state_dict())
    return x, y, a, b


def test_step_in_backward_matches_a_plain_step_and_frees_gradients():
    x, y, plain, hooked = _twin_mlps()
    opt = tally.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_h = tally.optim.SGD(hooked.parameters(), lr=0.1, momentum=0.9)
    with tally.optim.StepInBackward(opt_h) as sib:
        for _ in range(2):
            opt.zero_grad()
            _grads(plain, x, y)
            opt.step()
            _grads(hooked, x, y)
            assert all(p.grad is None for p in hooked.parameters())
    assert sib.updates == 2 * len(list(hooked.parameters()))
    for p, q in zip(plain.parameters(), hooked.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-6, atol=1e-7)
    # Closed: backward accumulates gradients again.
    _grads(hooked, x, y)
    assert all(p.grad is not None for p in hooked.parameters())


def test_cpu_offload_equals_adamw_step_for_step():
    x, y, plain, off = _twin_mlps()
    opt = tally.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt_o = tally.optim.CpuOffload(off.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for model, o in ((plain, opt), (off, opt_o)):
            o.zero_grad()
            _grads(model, x, y)
            o.step()
    for p, q in zip(plain.parameters(), off.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy())  # bit for bit


class _TwoLayers(nn.Module):
    """A model written in Python: its forward calls its children."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def test_cpu_offload_overlap_with_forward_equals_adamw():
    tally.manual_seed(0)
    x, y = tally.randn(8, 6), tally.randint(0, 4, (8,))
    plain, off = _TwoLayers(), _TwoLayers()
    off.load_state_dict(plain.state_dict())
    opt = tally.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt_o = tally.optim.CpuOffload(off.parameters(), lr=1e-2, weight_decay=0.1)
    opt_o.overlap_with_forward(off)
    for step in range(3):
        for model, o in ((plain, opt), (off, opt_o)):
            o.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            o.step()
        assert opt_o.deferred_updates > 0  # left to the next forward
    assert opt_o.updates_in_forward > 0
    opt_o.finish_updates()
    assert opt_o.deferred_updates == 0
    for p, q in zip(plain.parameters(), off.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy())  # bit for bit


def test_cpu_offload_clip_grad_norm_equals_clipping_then_adamw():
    x, y, plain, off = _twin_mlps()
    opt = tally.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt_o = tally.optim.CpuOffload(off.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        _grads(plain, x, y)
        norm = tally.optim.clip_grad_norm_(plain.parameters(), 0.05)
        opt.step()
        opt_o.zero_grad()
        _grads(off, x, y)
        assert opt_o.clip_grad_norm_(0.05).item() == norm.item() > 0.05
        opt_o.step()
    for p, q in zip(plain.parameters(), off.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy())  # bit for bit


def test_save_on_cpu_and_offload_activations_keep_gradients():
    tally.manual_seed(0)
    model = nn.resnet_tiny(num_classes=10, in_channels=1)
    x, y = tally.randn(4, 1, 28, 28), tally.randint(0, 10, (4,))
    _grads(model, x, y)
    ref = [p.grad.numpy().copy() for p in model.parameters()]
    model.zero_grad()
    with tally.autograd.graph.save_on_cpu(pin_memory=False) as scope:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert scope.offloader.stats()["tensors_offloaded"] > 0
    for r, p in zip(ref, model.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), r, rtol=1e-5, atol=1e-6)

    model.zero_grad()
    off = nn.offload_activations(model, "activations", pin_memory=False)
    _grads(model, x, y)
    stats = off.stats()
    assert stats["tensors_offloaded"] > 0 and stats["groups"] > 1, stats
    for r, p in zip(ref, model.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), r, rtol=1e-5, atol=1e-6)
    assert nn.offload_activations(model, "none") is None
    with pytest.raises(ValueError, match="offload"):
        nn.offload_activations(model, "sideways")


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_indexing_with_a_tensor_gathers_and_backpropagates(dim):
    rng = np.random.default_rng(dim)
    a = rng.standard_normal((4, 5, 6)).astype(np.float32)
    idx = np.array([[0, 2], [3, 0]])
    x = tally.tensor(a, requires_grad=True)
    key = (slice(None),) * dim + (tally.tensor(idx),)
    y = x[key]
    np.testing.assert_array_equal(y.numpy(), a[key[:dim] + (idx,)])
    y.sum().backward()
    counts = np.bincount(idx.ravel(), minlength=a.shape[dim]).astype(np.float32)
    shape = [1, 1, 1]
    shape[dim] = a.shape[dim]
    np.testing.assert_array_equal(x.grad.numpy(), np.broadcast_to(counts.reshape(shape), a.shape))
    # Lists and numpy arrays index too.
    np.testing.assert_array_equal(x[[1, 1, 0]].numpy(), a[[1, 1, 0]])
    np.testing.assert_array_equal(x[np.array([3])].numpy(), a[np.array([3])])


def test_indexing_with_a_tensor_refuses_what_it_cannot_do():
    x = tally.randn(3, 4)
    # A boolean mask is a read (x[mask], test_ops_habits.py); a mask of the wrong length is not.
    assert x[tally.tensor([True, False, True])].shape == (2, 4)
    with pytest.raises(IndexError):
        x[tally.tensor([True, False])]
    with pytest.raises(IndexError, match="more than one tensor"):
        x[tally.tensor([0]), tally.tensor([1])]
    with pytest.raises(IndexError, match="out of range"):
        x[tally.tensor([3])]
    with pytest.raises(IndexError, match="int64"):
        x[tally.tensor([0.5])]
    with tally.no_grad():
        with pytest.raises(IndexError, match="index_put_"):
            x[tally.tensor([0])] = 1.0


def test_new_submodules_import_by_name():
    import importlib
    for name in ("tally.utils.data", "tally.optim.lr_scheduler", "tally.autograd.graph"):
        assert importlib.import_module(name) is not None
    assert tally.utils.data.DataLoader is DataLoader
