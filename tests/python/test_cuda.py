"""tally.cuda: CUDA graphs from Python (torch.cuda.CUDAGraph / graph / graph_pool_handle).
Without a GPU a capture is refused naming why; with one, a captured training step replays to
the same numbers as the eager step."""
import numpy as np
import pytest

import tally

HAS_GPU = tally.memory.cuda_available()


def test_pool_handles_are_unique_and_nothing_is_capturing():
    a, b = tally.cuda.graph_pool_handle(), tally.cuda.graph_pool_handle()
    assert a != b and a > 0 and b > 0
    assert not tally.cuda.is_current_stream_capturing()


@pytest.mark.skipif(HAS_GPU, reason="a CUDA device is present")
def test_capture_without_a_device_is_a_value_error():
    g = tally.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="built without CUDA|no CUDA device 0"):
        with tally.cuda.graph(g):
            pass
    assert not g.captured
    with pytest.raises(RuntimeError, match="nothing captured"):
        g.replay()


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_replayed_step_matches_the_eager_step():
    def make():
        tally.manual_seed(0)
        model = tally.nn.Sequential(tally.nn.Linear(32, 64), tally.nn.GELU(), tally.nn.Linear(64, 4))
        model.to("cuda")
        return model, tally.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)

    rng = np.random.default_rng(0)
    batches = [(tally.tensor(rng.standard_normal((16, 32)).astype(np.float32)).to("cuda"),
                tally.tensor(rng.integers(0, 4, 16)).to("cuda")) for _ in range(5)]

    def step(model, opt, x, y):
        opt.zero_grad()
        loss = tally.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    eager, eopt = make()
    expected = [step(eager, eopt, x, y).item() for x, y in batches]

    model, opt = make()
    sx, sy = batches[0][0].clone(), batches[0][1].clone()
    assert step(model, opt, sx, sy).item() == expected[0]
    g = tally.cuda.CUDAGraph()
    with tally.cuda.graph(g):
        loss = step(model, opt, sx, sy)
    assert g.captured and g.pool() > 0
    for (x, y), want in zip(batches[1:], expected[1:]):
        sx.copy_(x)
        sy.copy_(y)
        g.replay()
        assert loss.item() == want
    assert "Graph pool" in tally.memory.memory_summary()
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        with tally.cuda.graph(tally.cuda.CUDAGraph()):
            loss.item()
