"""Allocations made from Python name the Python file and line that asked for them in
snapshots (the first frame of each trace entry), not the binding's C++ line, and a module
called from Python is tagged with the phase "forward" (backward and the optimizer already
carry theirs). Read back with the pickle module, as memory_viz reads them."""
import os
import pickle
import sys

import tally
import tally.nn as nn
import tally.nn.functional as F

THIS = os.path.basename(__file__)


def _line():
    """The caller's line number plus one: the line after the call."""
    return sys._getframe(1).f_lineno + 1


def _snapshot(fn, path):
    tally.memory.record_memory_history("all", device="cpu")
    try:
        fn()
        tally.memory.dump_snapshot(path, "cpu")
    finally:
        tally.memory.record_memory_history(None, device="cpu")
    with open(path, "rb") as f:
        snap = pickle.load(f)
    # A re-tag (an input saved as an activation, a gradient handed on) is written as
    # free_completed + alloc of the same block, which keeps the tags of its creation: left out.
    out = []
    for trace in snap["device_traces"]:
        for prev, e in zip([None] + trace[:-1], trace):
            retag = prev is not None and prev["action"] == "free_completed" and prev["addr"] == e["addr"]
            if e["action"] == "alloc" and not retag:
                out.append(e)
    return out


def _phase(entry):
    names = [f["name"] for f in entry["frames"] if f["name"].startswith("phase ")]
    return names[0][len("phase "):] if names else None


def _at(entries, line):
    return [e for e in entries
            if e["frames"] and e["frames"][0]["filename"].endswith(THIS)
            and e["frames"][0]["line"] == line]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x):
        FORWARD_LINE[0] = _line()
        h = self.fc(x)
        return h.relu()


FORWARD_LINE = [0]


def test_snapshot_names_the_python_line_and_the_phase(tmpdir_path):
    lines = {}

    def run():
        lines["build"] = _line()
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        lines["input"] = _line()
        x = tally.randn(8, 16)
        y = tally.randint(0, 4, (8,))
        opt = tally.optim.AdamW(model.parameters(), lr=1e-3)
        lines["forward"] = _line()
        out = model(x)
        loss = F.cross_entropy(out, y)
        lines["backward"] = _line()
        loss.backward()
        lines["step"] = _line()
        opt.step()

    entries = _snapshot(run, os.path.join(tmpdir_path, "sites.pickle"))
    assert entries
    # No entry names a binding's C++ line when Python asked for it.
    assert not [e for e in entries if e["frames"][0]["filename"].startswith("python/")]
    build = _at(entries, lines["build"])
    assert build and "parameter" in {e["category"] for e in build}  # (and init temporaries)
    assert {_phase(e) for e in build} == {"none"}
    assert _at(entries, lines["input"])
    fwd = _at(entries, lines["forward"])
    assert fwd and {_phase(e) for e in fwd} == {"forward"}
    bwd = _at(entries, lines["backward"])
    # backward()'s seed gradient (`full`, ones) is made before the engine opens its phase.
    assert bwd and {_phase(e) for e in bwd if e["frames"][0]["name"] != "full"} == {"backward"}
    step = _at(entries, lines["step"])
    assert step and {_phase(e) for e in step} == {"optimizer"}
    assert step[0]["frames"][0]["name"] != ""


def test_a_python_forward_names_its_own_lines(tmpdir_path):
    model = Net()
    x = tally.randn(4, 16)
    outer = {}

    def run():
        outer["call"] = _line()
        y = model(x)
        assert y.shape == (4, 32)

    entries = _snapshot(run, os.path.join(tmpdir_path, "forward.pickle"))
    inner = _at(entries, FORWARD_LINE[0])  # self.fc(x) inside Net.forward
    assert inner, [(e["frames"][0]["filename"], e["frames"][0]["line"]) for e in entries]
    assert {_phase(e) for e in inner} == {"forward"}
    assert any(e["frames"][1]["name"] == "fc" for e in inner)  # the module path frame
    relu = _at(entries, FORWARD_LINE[0] + 1)  # h.relu()
    assert relu and {_phase(e) for e in relu} == {"forward"}


def test_wrappers_in_the_package_name_the_users_line(tmpdir_path):
    model = nn.Linear(8, 8)
    model(tally.randn(2, 8)).sum().backward()
    at = {}

    def run():
        at["clip"] = _line()
        tally.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    entries = _snapshot(run, os.path.join(tmpdir_path, "clip.pickle"))
    assert _at(entries, at["clip"])
    assert not [e for e in entries if e["frames"][0]["filename"].endswith("_torch.py")]


def test_an_explicit_phase_is_kept(tmpdir_path):
    model = nn.Linear(8, 8)
    at = {}

    def run():
        with tally.memory.context(category="activation", phase="eval"):
            at["call"] = _line()
            model(tally.randn(2, 8))

    entries = _snapshot(run, os.path.join(tmpdir_path, "eval.pickle"))
    hits = _at(entries, at["call"])
    assert hits and {_phase(e) for e in hits} == {"eval"}
