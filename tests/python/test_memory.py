"""The memory API (stats, summary, snapshots, the allocation context), the estimator, the
profiler and the A/B runner."""

import json
import os
import pickle
import sys

import numpy as np
import pytest

import tally
import tally.nn as nn
import tally.nn.functional as F


def test_memory_stats_count_parameters():
    before = tally.memory.memory_by_category("cpu")["parameter"]
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    param_bytes = sum(p.nbytes for p in model.parameters())
    after = tally.memory.memory_by_category("cpu")["parameter"]
    assert after - before >= param_bytes > 0
    stats = tally.memory_stats("cpu")
    assert stats["category.parameter.current"] >= param_bytes
    assert stats["allocated_bytes.all.current"] >= param_bytes
    assert tally.memory_allocated("cpu") == stats["allocated_bytes.all.current"]
    del model
    assert tally.memory.memory_by_category("cpu")["parameter"] == before
    assert "parameter" in tally.memory_summary("cpu")
    assert set(tally.memory.categories()) >= {"parameter", "gradient", "optimizer_state",
                                              "activation", "input", "temporary", "workspace"}


def test_memory_summary_splits_a_models_parameters():
    # A frozen base beside a trainable head (as LoRA's): the parameter row, then its split.
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 4))
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    lines = tally.memory.memory_summary("cpu", model=model).splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("| parameter "))
    assert lines[row + 1].startswith("|   trainable 260 "), lines[row + 1]
    assert lines[row + 2].startswith("|   frozen 2112 "), lines[row + 2]
    assert len(lines[row + 1]) == len(lines[row])
    assert "trainable" not in tally.memory.memory_summary("cpu")


def test_training_step_fills_the_categories():
    tally.memory.reset_peak_memory_stats("cpu")
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = tally.optim.Adam(model.parameters(), lr=1e-3)
    with tally.memory.context(category="input"):
        x = tally.randn(16, 32)
        y = tally.randint(0, 4, (16,))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    cats = tally.memory.memory_by_category("cpu")
    pbytes = sum(p.nbytes for p in model.parameters())
    assert cats["gradient"] >= pbytes
    assert cats["optimizer_state"] >= 2 * pbytes
    assert cats["input"] >= x.nbytes + y.nbytes


def test_snapshot_is_a_pickle_with_the_context_tags(tmpdir_path):
    tally.record_memory_history("all", device="cpu")
    try:
        with tally.memory.context(category="input", module="mymod", phase="loading"):
            x = tally.zeros(12345)
        y = x * 2.0
        path = os.path.join(tmpdir_path, "snap.pickle")
        tally.dump_snapshot(path, device="cpu")
    finally:
        tally.record_memory_history(None, device="cpu")
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert {"segments", "device_traces"} <= set(snap)
    entries = [e for trace in snap["device_traces"] for e in trace]
    tagged = [e for e in entries if e["action"] == "alloc" and e["size"] >= 12345 * 4
              and "module=mymod" in e.get("user_metadata", "")]
    assert tagged, "no alloc of the tagged tensor in the trace"
    assert tagged[0]["category"] == "input"
    assert "phase=loading" in tagged[0]["user_metadata"]
    assert y.shape == (12345,)


def test_record_memory_history_takes_pytorchs_max_entries(tmpdir_path):
    # PyTorch's default max_entries is sys.maxsize: a bound, not memory set aside (a reservation
    # of that size used to fail after recording was on, and the next allocation crashed).
    tally.record_memory_history("all", max_entries=sys.maxsize, device="cpu")
    path = os.path.join(tmpdir_path, "huge.pickle")
    try:
        x = tally.zeros(1000) + 1.0
        tally.dump_snapshot(path, device="cpu")
    finally:
        tally.record_memory_history(None, device="cpu")
    assert float(x.sum().item()) == 1000.0
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert any(e["action"] == "alloc" for trace in snap["device_traces"] for e in trace)
    with pytest.raises(ValueError, match="enabled must be 'all', 'state', None"):
        tally.record_memory_history("yes", device="cpu")


def test_unknown_category_is_a_value_error():
    with pytest.raises(ValueError, match="unknown memory category 'weights'"):
        tally.memory.context(category="weights")


def test_estimate_predicts_a_cpu_run():
    def step(device):
        tally.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
        opt = tally.optim.AdamW(model.parameters(), lr=1e-3)
        x = tally.randn(32, 64, device=device)
        y = tally.randint(0, 10, (32,), device=device)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    est = tally.memory.estimate(step, target="cpu")
    assert est.fits and est.peak_allocated > 0
    pbytes = (64 * 256 + 256 + 256 * 10 + 10) * 4
    assert est.at_peak["parameter"] >= pbytes
    assert est.at_peak["optimizer_state"] >= 2 * pbytes
    assert "peak allocated" in est.report()
    # the real run on the CPU reaches the predicted peak
    dev = "cpu"
    tally.memory.empty_cache(dev)
    base = tally.memory_allocated(dev)
    tally.memory.reset_peak_memory_stats(dev)
    step(tally.device(dev))
    measured = tally.max_memory_allocated(dev) - base
    assert abs(measured - est.peak_allocated) <= 0.05 * est.peak_allocated, (measured, est.peak_allocated)

    with tally.memory.DryRun("h200") as dry:
        assert dry.device.type == "meta"
        step(dry.device)
    assert dry.estimate.target == "h200"
    assert dry.estimate.peak_allocated > 0
    # The recorded GPUs are named targets, predictable from any machine.
    assert {"cpu", "h100", "h200"} <= set(tally.memory.meta_targets())
    h100 = tally.memory.estimate(step, target="h100")
    assert h100.target == "h100" and h100.peak_allocated == dry.estimate.peak_allocated
    with pytest.raises(Exception, match="h100"):
        tally.memory.estimate(step, target="h300")


def test_meta_tensor_has_no_values():
    with tally.memory.DryRun("cpu") as dry:
        t = tally.zeros(4, device=dry.device)
        assert t.is_meta
        with pytest.raises(Exception, match="meta"):
            t.numpy()


def test_profiler_exports_a_chrome_trace(tmpdir_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    x = tally.randn(4, 16)
    with tally.profiler.profile(record_shapes=True, profile_memory=True) as prof:
        with tally.profiler.record_function("my_step"):
            model(x).sum().backward()
    path = os.path.join(tmpdir_path, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "my_step" in names and "linear" in names
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=5)
    assert "Self CPU" in table
    assert any(r["key"] == "linear" for r in prof.key_averages().rows)


def test_ab_runner_report(monkeypatch, tmpdir_path):
    try:
        tally.ab.program()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    rep = tally.ab.run(model="resnet", arch="tiny", steps=2, batch=8,
                       checkpoint=["none", "blocks"], amp=["off"])
    assert len(rep.results) == 2
    none, blocks = rep.results
    assert blocks["peak_allocated"] < none["peak_allocated"]
    assert none["at_peak"]["parameter"] > 0
    page = rep._repr_html_()
    assert page.startswith("<iframe srcdoc=") and ("&lt;svg" in page or "&lt;script" in page)
    assert "peak" in repr(rep)
    # Links resolve against the notebook's folder: a <base> names the report folder when it
    # is under the working directory, else a note says where the files are.
    monkeypatch.chdir(os.path.dirname(rep.folder))
    name = os.path.basename(rep.folder)
    page = rep._repr_html_()
    assert f'&lt;base href=&quot;{name}/&quot; target=&quot;_blank&quot;&gt;' in page
    assert "allow-popups" in page and "this run's files are in" not in page
    monkeypatch.chdir(tmpdir_path)
    page = rep._repr_html_()
    assert "&lt;base" not in page and "this run's files are in" in page


def test_out_of_memory_is_a_python_exception_and_a_dry_run_result():
    with tally.memory.DryRun("cpu", capacity="4MiB") as dry:
        tally.zeros(8 << 20, device=dry.device)    # 32 MiB on a 4 MiB device
    assert not dry.estimate.fits
    assert "out of memory" in dry.estimate.out_of_memory
    with pytest.raises(tally.OutOfMemoryError, match="out of memory") as e:
        tally.zeros(8 << 20, device=dry.device)
    assert isinstance(e.value, RuntimeError)


def test_building_on_a_meta_device():
    with tally.memory.DryRun("cpu") as dry:
        with dry.device:
            model = nn.Linear(1000, 1000)
        assert model.weight.is_meta
        assert tally.memory.memory_by_category(dry.device)["parameter"] >= 1000 * 1000 * 4
