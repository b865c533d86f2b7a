"""tally.nn.LSTM and tally.nn.GRU from Python, as PyTorch's: constructor arguments, parameter
names, forward(input, hx=None) results, values against a float64 numpy recurrence, and
tally.nn.lora.inject on a small model."""

import numpy as np
import pytest

import tally
import tally.nn as nn


def npy(t):
    return np.asarray(t.detach().numpy(), dtype=np.float64)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_lstm(x, w_ih, w_hh, b_ih, b_hh):
    T, B, _ = x.shape
    H = w_hh.shape[1]
    h = np.zeros((B, H))
    c = np.zeros((B, H))
    out = []
    for t in range(T):
        g = x[t] @ w_ih.T + b_ih + h @ w_hh.T + b_hh
        i, f, gg, o = sigmoid(g[:, :H]), sigmoid(g[:, H:2 * H]), np.tanh(g[:, 2 * H:3 * H]), \
            sigmoid(g[:, 3 * H:])
        c = f * c + i * gg
        h = o * np.tanh(c)
        out.append(h)
    return np.stack(out), h, c


def np_gru(x, w_ih, w_hh, b_ih, b_hh):
    T, B, _ = x.shape
    H = w_hh.shape[1]
    h = np.zeros((B, H))
    out = []
    for t in range(T):
        gi = x[t] @ w_ih.T + b_ih
        gh = h @ w_hh.T + b_hh
        r = sigmoid(gi[:, :H] + gh[:, :H])
        z = sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
        n = np.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
        h = (1 - z) * n + z * h
        out.append(h)
    return np.stack(out), h


def test_lstm_matches_numpy_and_names():
    m = nn.LSTM(3, 4)
    names = [n for n, _ in m.named_parameters()]
    assert names == ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"]
    x = np.random.RandomState(0).randn(5, 2, 3).astype(np.float32)
    out, (h, c) = m(tally.tensor(x))
    p = {n: npy(t) for n, t in m.named_parameters()}
    ref_out, ref_h, ref_c = np_lstm(x.astype(np.float64), p["weight_ih_l0"], p["weight_hh_l0"],
                                    p["bias_ih_l0"], p["bias_hh_l0"])
    np.testing.assert_allclose(npy(out), ref_out, atol=1e-5)
    np.testing.assert_allclose(npy(h)[0], ref_h, atol=1e-5)
    np.testing.assert_allclose(npy(c)[0], ref_c, atol=1e-5)
    out.sum().backward()
    assert m.weight_hh_l0.grad is not None


def test_gru_matches_numpy_batch_first_and_hx():
    m = nn.GRU(input_size=3, hidden_size=4, num_layers=2, batch_first=True, bidirectional=True)
    assert m.hidden_size == 4 and m.bidirectional and m.batch_first
    x = tally.randn(2, 5, 3)
    out, h = m(x, tally.zeros(4, 2, 4))
    assert tuple(out.shape) == (2, 5, 8) and tuple(h.shape) == (4, 2, 4)
    one = nn.GRU(3, 4)
    xs = np.random.RandomState(1).randn(6, 1, 3).astype(np.float32)
    out, h = one(tally.tensor(xs))
    p = {n: npy(t) for n, t in one.named_parameters()}
    ref, ref_h = np_gru(xs.astype(np.float64), p["weight_ih_l0"], p["weight_hh_l0"],
                        p["bias_ih_l0"], p["bias_hh_l0"])
    np.testing.assert_allclose(npy(out), ref, atol=1e-5)


def test_rnn_errors():
    with pytest.raises(ValueError, match="input_size"):
        nn.LSTM(3, 4)(tally.randn(5, 2, 7))


def test_lora_inject_trains_only_the_adapters():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = tally.randn(4, 6)
    before = npy(model(x))
    import tally.nn.lora as lora
    assert lora.inject(model, targets=["0", "2"], r=2, alpha=4) == ["0", "2"]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names == ["0.lora_A.weight", "0.lora_B.weight", "2.lora_A.weight", "2.lora_B.weight"]
    np.testing.assert_array_equal(npy(model(x)), before)
    model(x).sum().backward()
    frozen = {n: npy(p) for n, p in model.named_parameters() if not p.requires_grad}
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)
    opt = tally.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            np.testing.assert_array_equal(npy(p), frozen[n])
    assert "trainable params: 50 || all params: 133" in lora.trainable_summary(model)
    with pytest.raises(ValueError, match="not found"):
        lora.inject(model, targets=["q_proj"])
    with pytest.raises(TypeError):  # None is no model (it was a null dereference)
        lora.inject(None, targets=["0"])
    with pytest.raises(TypeError):
        lora.trainable_summary(None)
