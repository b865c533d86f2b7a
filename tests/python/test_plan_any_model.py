"""Memory policies and the planner for a model written in Python (issue 51): checkpoint and
offload by type name, dotted-name glob, every K-th and a callable; checkpoint_sequential over
a Sequential; tally.memory.plan over the levers with the user's own loss and evaluation."""

import numpy as np
import pytest

import tally
import tally.nn as nn
import tally.nn.functional as F
from tally.utils.checkpoint import checkpoint_sequential


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d=32, n=4):
        super().__init__()
        self.stem = nn.Linear(16, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def batch(n=512):
    tally.manual_seed(1)
    return tally.randn(n, 16), tally.randint(0, 10, (n,))


def step(policy=None, **kw):
    tally.manual_seed(0)
    model = Net()
    if policy is not None:
        nn.enable_checkpointing(model, policy, **kw)
    x, y = batch()
    tally.memory.reset_peak_memory_stats("cpu")
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    peak = tally.memory.memory_by_category("cpu", "at_peak")["activation"]
    return model, loss.item(), [p.grad.numpy().copy() for p in model.parameters()], peak


def test_policies_select_by_type_name_and_every():
    model = Net()

    def checkpointed():
        return [name for name, m in model.named_modules() if m.is_checkpointed]
    nn.enable_checkpointing(model, "type:Block/2")
    assert checkpointed() == ["blocks.0", "blocks.2"]
    nn.enable_checkpointing(model, "name:blocks.*.up")
    assert checkpointed() == [f"blocks.{i}.up" for i in range(4)]
    nn.enable_checkpointing(model, lambda name, m: name == "blocks.3")
    assert checkpointed() == ["blocks.3"]
    nn.enable_checkpointing(model, "none")
    assert checkpointed() == []


@pytest.mark.parametrize("policy,kw", [
    ("type:Block", {}),
    ("name:blocks.*/2", {}),
    ("type:Block", {"selective": True}),
    (lambda name, m: isinstance(m, Block), {}),
    (lambda name, m: m.type_name == "Block", {"every": 2}),
])
def test_a_policy_on_a_python_module_keeps_the_step_and_lowers_the_peak(policy, kw):
    _, plain_loss, plain_grads, plain_peak = step()
    _, loss, grads, peak = step(policy, **kw)
    assert loss == plain_loss
    for a, b in zip(grads, plain_grads):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert peak < plain_peak, (peak, plain_peak)


def test_policy_errors_name_the_spec():
    with pytest.raises(ValueError, match="type:Nothing"):
        nn.enable_checkpointing(Net(), "type:Nothing")
    with pytest.raises(ValueError, match="every= and selective="):
        nn.enable_checkpointing(Net(), "blocks", every=2)
    with pytest.raises(TypeError):
        nn.enable_checkpointing(Net(), 3)


def test_offload_policy_by_callable():
    model = Net()
    off = nn.offload_activations(model, lambda name, m: name.startswith("blocks."), every=2)
    assert off is not None
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    assert nn.offload_activations(model, "none") is None


def test_offload_link_on_a_python_model_keeps_the_loss():
    x, y = batch(64)
    tally.manual_seed(0)
    plain = Net()
    want = F.cross_entropy(plain(x), y)
    want.backward()
    tally.manual_seed(0)
    model = Net()
    fwd = lambda: F.cross_entropy(model(x), y)
    # A link as fast as memory takes every block; a link of 1 byte/s takes nothing.
    wide = nn.choose_link_offload(model, fwd, link_bytes_per_second=1e15)
    assert wide["modules"] and wide["bytes"] > 0 and "offload link" in wide["summary"], wide
    assert nn.choose_link_offload(model, fwd, link_bytes_per_second=1.0)["modules"] == []
    off = nn.offload_activations(model, "link", forward=fwd)
    if off is not None:  # the CPU's measured "link" (a host copy) is fast: something fits
        assert off.link_choice["modules"] and off.link_choice["forward_seconds"] > 0
        assert off.link_choice["prefetch_lead"] > 0 and off.link_choice["forward_saved_bytes"] > 0
    got = F.cross_entropy(model(x), y)
    got.backward()
    assert got.item() == want.item()
    for p, q in zip(plain.parameters(), model.parameters()):
        np.testing.assert_allclose(q.grad.numpy(), p.grad.numpy(), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="forward"):
        nn.offload_activations(model, "link")


def test_checkpoint_sequential_over_a_sequential():
    tally.manual_seed(0)
    model = Net()
    x, _ = batch()
    h = model.stem(x)
    want = model.blocks(h).numpy().copy()
    got = checkpoint_sequential(model.blocks, 2, h)
    np.testing.assert_array_equal(got.numpy(), want)


def test_plan_for_a_python_model_and_step():
    x, y = batch()
    evals = []

    def loss_fn(model, b):
        return F.cross_entropy(model(b[0]), b[1])

    def eval_fn(model, b):
        evals.append(1)
        model(b[0])

    common = dict(eval_fn=eval_fn, precisions=[None], micro_batches=[1, 4],
                  step_in_backward=[False])
    everything = tally.memory.plan(Net, loss_fn, [x, y], "1GiB", **common)
    peaks = [c.estimate.peak_reserved for c in everything.candidates]
    assert all(c.error == "" for c in everything.candidates)
    assert evals, "the evaluation is dry-run too"
    assert [p.phase for p in everything.chosen.estimate.phases] == ["setup", "train", "eval"]
    assert any(c.candidate.checkpoint == "type:Block" for c in everything.candidates)
    assert any(c.candidate.optimizer == "adamw8bit" for c in everything.candidates)
    assert any(c.candidate.micro_batches == 4 for c in everything.candidates)
    smallest = min(peaks)
    plan = tally.memory.plan(Net, loss_fn, [x, y], smallest, **common)
    assert plan.chosen.fits and plan.chosen.estimate.peak_reserved <= smallest
    assert "chosen" in str(plan)
    with pytest.raises(ValueError, match="smallest peak"):
        tally.memory.plan(Net, loss_fn, [x, y], smallest - 1, **common)


def test_a_dry_run_names_its_phases():
    with tally.memory.DryRun("cpu") as dry:
        model = Net().to(dry.device)
        x = tally.randn(256, 16, device=dry.device)
        y = tally.randint(0, 10, (256,), device=dry.device)
        dry.phase("train")
        F.cross_entropy(model(x), y).backward()
        dry.phase("eval")
        with tally.no_grad():
            model(x)
    e = dry.estimate
    assert [p.phase for p in e.phases] == ["setup", "train", "eval"]
    assert e.peak_allocated == max(p.peak_allocated for p in e.phases)
    assert "peak by phase" in str(e)
