"""scatter(reduce=...), scatter_, index_add_, index_fill(_) and cumprod as PyTorch users
write them (issue 50). Values against numpy; gradients against float64 central differences."""

import numpy as np
import pytest

import tally
from test_ops_habits import close, gradcheck, t  # the shared value and gradient checks

RNG = np.random.default_rng(1)


X = np.arange(1.0, 7.0).reshape(2, 3)
DUP = np.array([[0, 0], [2, 2]])
SRC = np.array([[10.0, 20.0], [30.0, 40.0]])


def test_scatter_reduce():
    close(t(X).scatter(1, t(DUP), t(SRC), reduce="multiply"), [[200, 2, 3], [4, 5, 7200]])
    close(tally.scatter(t(X), 1, t(DUP), t(SRC), reduce="add"), [[31, 2, 3], [4, 5, 76]])
    close(t(X).scatter(1, t(np.array([[1], [1]])), 2.0, reduce="multiply"), [[1, 4, 3], [4, 10, 6]])
    with pytest.raises(ValueError, match="reduce"):
        t(X).scatter(1, t(DUP), t(SRC), reduce="max")
    src = np.array([[0.5, 0.0, 2.0], [0.7, -1.3, 0.9]])
    idx = t(np.array([[0, 0, 1], [1, 3, 1]]))
    gradcheck(lambda x, s: x.scatter(1, idx, s, reduce="multiply"), RNG.standard_normal((2, 4)),
              src)


def test_in_place_index_writes():
    y = t(X)
    assert y.index_add_(0, t(np.array([1])), t(np.ones((1, 3))), alpha=2.0) is y
    close(y, [[1, 2, 3], [6, 7, 8]])
    y.scatter_(0, t(np.array([[1, 0, 0]])), 9.0)
    close(y, [[1, 9, 9], [9, 7, 8]])
    y.scatter_(1, t(DUP), t(SRC), reduce="add")
    close(y, [[31, 9, 9], [9, 7, 78]])
    y.index_fill_(0, t(np.array([-1])), 0.0)
    close(y, [[31, 9, 9], [0, 0, 0]])
    w = tally.tensor(X, requires_grad=True)
    with pytest.raises(ValueError, match="index_fill_"):
        w.index_fill_(0, t(np.array([0])), 1.0)


def test_index_fill():
    out = tally.index_fill(t(X), 1, t(np.array([0, 2])), -1.0)
    expected = X.copy()
    expected[:, [0, 2]] = -1
    close(out, expected)
    gradcheck(lambda x: x.index_fill(0, t(np.array([1])), 3.0), RNG.standard_normal((3, 2)))
    # A 0-dim tensor value: its gradient is the output's gradient summed where it was written.
    gradcheck(lambda x, v: x.index_fill(1, t(np.array([2, 0, 0])), v), RNG.standard_normal((2, 3)),
              np.array(0.5))
    with pytest.raises(ValueError, match="0-dimensional"):
        t(X).index_fill(1, t(np.array([0])), t(np.array([1.0, 2.0])))


def test_cumprod():
    a = np.array([[1.0, 2, 3], [0, 5, 2]])
    close(tally.cumprod(t(a), 1), np.cumprod(a, 1))
    close(t(a).cumprod(0), np.cumprod(a, 0))
    assert tally.cumprod(t(np.array([1, 2, 3])), 0).dtype == tally.int64
    zeros = np.array([[2.0, 0, 3, 0.5], [1.5, -1, 0, 2], [0.7, 1.2, -0.4, 0.9]])
    gradcheck(lambda x: x.cumprod(1), zeros)
    gradcheck(lambda x: tally.cumprod(x, 0), zeros)


def test_mask_on_a_later_dim():
    a = RNG.standard_normal((2, 3, 4))
    m = np.array([True, False, True, True])
    close(t(a)[:, :, t(m)], a[:, :, m])
    close(t(a)[..., m], a[..., m])
    m2 = RNG.standard_normal((3, 4)) > 0
    close(t(a)[:, t(m2)], a[:, m2])
    close(t(a)[0, t(m2[:, 0].copy())], a[0, m2[:, 0]])
    with pytest.raises(IndexError):
        t(a)[:, t(np.array([True, False]))]
    gradcheck(lambda x: x[:, t(m)], RNG.standard_normal((2, 4)))


def test_mask_assignment():
    a = np.arange(24.0).reshape(2, 3, 4)
    m = np.array([True, False, True])
    y, e = t(a), a.copy()
    y[:, t(m)] = 7.0
    e[:, m] = 7.0
    close(y, e)
    y[:, t(m)] = t(np.array([[[[1.0, 2, 3, 4]]]]))  # broadcast to the selected [2, 2, 4]
    e[:, m] = np.array([1.0, 2, 3, 4])
    close(y, e)
    m2 = a[:, :, 0] > 5
    y[t(m2)] = t(-np.arange(4.0 * m2.sum()).reshape(-1, 4))
    e[m2] = -np.arange(4.0 * m2.sum()).reshape(-1, 4)
    close(y, e)
    m3 = np.array([False, True, True, False])
    y[..., m3] = t(np.array([[5.0], [6], [7]]))
    e[..., m3] = np.array([[5.0], [6], [7]])
    close(y, e)
    with pytest.raises(IndexError):
        y[:, t(np.array([True, False]))] = 0.0
    # An integer beside the mask selects first, as PyTorch's x[0, mask] = v.
    y[0, t(m)] = t(np.array([-1.0, -2, -3, -4]))
    e[0, m] = np.array([-1.0, -2, -3, -4])
    close(y, e)
    y[-1, :, t(m3)] = 0.5
    e[-1, :, m3] = 0.5
    close(y, e)
    y[..., 1, t(m3)] = t(np.array([[8.0, 9]]))
    e[..., 1, m3] = np.array([[8.0, 9]])
    close(y, e)
    with pytest.raises(IndexError, match="out of bounds"):
        y[2, t(m)] = 0.0
    with pytest.raises(IndexError, match="full slices"):
        y[0:1, t(m)] = 0.0
    w = tally.tensor(a, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        w[:, t(m)] = 0.0

    # Differentiable in x (the entries not written) and in v, as PyTorch's index_put_.
    def put(x, v):
        out = x * 1.0
        out[:, t(m)] = v
        return out
    gradcheck(put, RNG.standard_normal((2, 3, 2)), RNG.standard_normal((2, 1)))

    def put_row(x, v):
        out = x * 1.0
        out[1, t(m)] = v
        return out
    gradcheck(put_row, RNG.standard_normal((2, 3, 2)), RNG.standard_normal((2,)))
    out = tally.tensor(a, requires_grad=True) * 1.0
    out[1, t(m)] = 0.0
    assert out.grad_fn.name() == "IndexPutBackward0"  # PyTorch's name

    def put_number(x):
        out = x * 2.0
        out[t(m2[:, :2].copy())] = 0.5
        return out
    gradcheck(put_number, RNG.standard_normal((2, 2, 3)))
