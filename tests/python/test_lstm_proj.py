"""nn.LSTM(proj_size=...) as PyTorch users build it (issue 50): weight_hr_l{k} and the
shapes of the output and states."""

import numpy as np

import tally


def test_lstm_proj_size():
    m = tally.nn.LSTM(3, 4, num_layers=2, proj_size=2, batch_first=True)
    assert m.proj_size == 2
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["weight_hr_l0"] == (2, 4) and shapes["weight_hr_l1"] == (2, 4)
    assert shapes["weight_hh_l0"] == (16, 2) and shapes["weight_ih_l1"] == (16, 2)
    out, (h, c) = m(tally.tensor(np.zeros((1, 5, 3), dtype=np.float32)))
    assert tuple(out.shape) == (1, 5, 2)
    assert tuple(h.shape) == (2, 1, 2) and tuple(c.shape) == (2, 1, 4)
    assert tally.nn.LSTM(3, 4).proj_size == 0
