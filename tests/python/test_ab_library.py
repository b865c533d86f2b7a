"""tally.ab.run in process (tally::ab::run, ab/ab.h): models written here in Python (a small CNN,
a small transformer) with their own step functions and data, a registry model by name, and the
outputs ab_memory writes. Tiny shapes, 2 steps, one timing round: a few seconds in all."""
import json
import os

import numpy as np
import pytest

import tally
import tally.nn as nn
import tally.nn.functional as F
from attention_block import add_attention_block_layers


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.pool(self.conv1(x).relu())
        x = self.gap(self.conv2(x).relu())
        return self.head(x.reshape(x.shape[0], -1))


class TinyTransformer(nn.Module):
    """One pre-norm causal self-attention block and an MLP over token embeddings."""

    def __init__(self, vocab=32, dim=16, heads=2, context=8):
        super().__init__()
        self.vocab, self.heads = vocab, heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(tally.zeros(context, dim))
        add_attention_block_layers(self, nn, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        b, t = idx.shape
        x = self.tok(idx) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        split = lambda z: z.reshape(b, t, self.heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return self.head(x)


def cnn_step(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def lm_step(model, batch):
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def images(n, batch=4, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 3, 8, 8)).astype(np.float32),
             rng.integers(0, 4, (batch,)).astype(np.int64)) for _ in range(n)]


def test_a_python_cnn_instance_with_its_step_and_gradient_accumulation(tmp_path):
    model = SmallCNN()
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    rep = tally.ab.run(model=model, step=cnn_step, data=images(2), precision=["off"],
                       optimizer=["sgd"], grad_accum=[1, 2], rounds=1, out=tmp_path / "ab")
    names = [r["name"] for r in rep.results]
    assert names == ["ckpt=none amp=off accum=1", "ckpt=none amp=off accum=2"], names
    one, two = rep.results
    assert list(two["phase_peaks"]) == ["forward.0", "backward.0", "forward.1", "backward.1"]
    for r in rep.results:
        assert r["estimated_peak_allocated"] == r["peak_allocated"] > 0  # the dry run, exactly
        assert r["at_peak"]["parameter"] > 0 and r["at_peak"]["unknown"] == 0
        assert np.isfinite(r["final_loss"]) and len(r["round_ms"]) == 1
        for key in ("snapshot", "timeline", "timeline_html"):
            assert os.path.isfile(r[key]), r[key]
    assert two["at_peak"]["activation"] < one["at_peak"]["activation"]
    assert os.path.isfile(two["diff"]) and len(rep.headlines) == 1
    assert rep.headlines[0].startswith("2 micro-batches: peak allocated ")
    # The caller's module has its values back.
    after = {k: v.numpy() for k, v in model.state_dict().items()}
    assert all(np.array_equal(before[k], after[k]) for k in before)
    page = rep._repr_html_()
    assert page.startswith("<iframe srcdoc=") and "&lt;svg" in page or "&lt;script" in page


def test_a_python_transformer_factory_with_eval_and_precisions(tmp_path):
    calls = []

    def evaluate(model, batch):
        calls.append(model.training)
        lm_step(model, batch)

    def batches(step):
        rng = np.random.default_rng(step)
        idx = rng.integers(0, 32, (2, 8)).astype(np.int64)
        return idx, np.roll(idx, -1, axis=1)

    rep = tally.ab.run(model=TinyTransformer, step=lm_step, eval=evaluate, data=batches, steps=2,
                       precision="off,bf16", optimizer="adamw", rounds=1, out=tmp_path / "lm")
    assert [r["settings"]["amp"] for r in rep.results] == ["off", "bf16"]
    assert calls and not any(calls)  # eval mode, after the steps of each run
    for r in rep.results:
        assert "eval" in r["phase_peaks"] and "forward" in r["phase_peaks"]
        assert r["estimated_peak_allocated"] == r["peak_allocated"]
    with open(tmp_path / "lm" / "report.html", encoding="utf-8") as f:
        assert "TinyTransformer" in f.read()


def test_a_registry_model_by_name(tmp_path):
    rep = tally.ab.run(model="gpt", preset="tiny", seq=32, batch=4, steps=2,
                       checkpoint=["none", "blocks"], precision=["off"], rounds=1,
                       out=tmp_path / "gpt")
    none, blocks = rep.results
    assert blocks["at_peak"]["activation"] < none["at_peak"]["activation"]
    rows = json.load(open(tmp_path / "gpt" / "results.json"))
    assert rows[1]["name"] == "ckpt=blocks amp=off"
    assert all("predicted_ms" in r for r in rows), rows[0].keys()


def test_checkpoint_auto_plans_a_python_model_within_its_budget(tmp_path):
    # No planner given: the library's plans the row (tally.memory.plan's levers) for the budget.
    rep = tally.ab.run(model=SmallCNN(), step=cnn_step, data=images(2), checkpoint=["auto"],
                       precision=["off"], memory_budget="64MiB", rounds=0, out=tmp_path / "plan")
    (row,) = rep.results
    assert row["name"].startswith("ckpt=auto("), row["name"]
    assert 0 < row["estimated_peak_reserved"] <= 64 << 20 and row["peak_reserved"] <= 64 << 20
    with pytest.raises(ValueError, match="memory_budget"):
        tally.ab.run(model=SmallCNN(), step=cnn_step, data=images(1), checkpoint=["auto"],
                     out=tmp_path / "nobudget")


def test_bad_arguments_fail_before_any_run(tmp_path):
    with pytest.raises(TypeError, match="model"):
        tally.ab.run(model=42, out=tmp_path / "a")
    with pytest.raises(ValueError, match="grad_accum 3"):
        tally.ab.run(model=SmallCNN(), step=cnn_step, data=images(1), grad_accum=[3],
                     out=tmp_path / "b")
    with pytest.raises(TypeError, match="loss tensor"):
        tally.ab.run(model=SmallCNN(), step=lambda m, b: 1.0, data=images(1), out=tmp_path / "c")
    with pytest.raises(ValueError, match="needs its batches"):
        tally.ab.run(model=SmallCNN, out=tmp_path / "d")
