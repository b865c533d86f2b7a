"""Index, scan, sort and shape ops as PyTorch users write them (issue 50): tally.gather,
x.scatter_add(...), tally.topk, x[mask], F.pad, F.one_hot, tally.einsum, the arithmetic
methods. Values against numpy; gradients against float64 central differences."""

import numpy as np
import pytest

import tally
import tally.nn.functional as F

RNG = np.random.default_rng(0)


def t(a, **kw):
    return tally.tensor(np.asarray(a), **kw)


def close(x, expected, tol=1e-6):
    np.testing.assert_allclose(x.numpy(), np.asarray(expected), rtol=tol, atol=tol)


def gradcheck(fn, *arrays, eps=1e-6, tol=1e-5):
    """d(sum(fn(*inputs) * w))/d(inputs) against central differences, float64."""
    leaves = [tally.tensor(a.astype(np.float64), requires_grad=True) for a in arrays]
    out = fn(*leaves)
    w = RNG.standard_normal(tuple(out.shape))
    (out * t(w)).sum().backward()
    for k, a in enumerate(arrays):
        num = np.zeros(a.shape)
        for i in np.ndindex(a.shape):
            vals = []
            for s in (eps, -eps):
                moved = [x.astype(np.float64).copy() for x in arrays]
                moved[k][i] += s
                with tally.no_grad():
                    o = fn(*[tally.tensor(m) for m in moved]).numpy()
                vals.append((o * w).sum())
            num[i] = (vals[0] - vals[1]) / (2 * eps)
        np.testing.assert_allclose(leaves[k].grad.numpy(), num, rtol=tol, atol=tol)


X = np.arange(1, 7, dtype=np.float32).reshape(2, 3)


def test_gather_scatter_index_select_index_add():
    x = t(X)
    idx = t([[2, 0], [1, 1]])
    close(tally.gather(x, 1, idx), np.take_along_axis(X, idx.numpy(), 1))
    close(x.gather(1, idx), [[3, 1], [5, 5]])
    src = t(np.float32([[10, 20], [30, 40]]))
    close(x.scatter(1, t([[2, 0], [1, 0]]), src), [[20, 2, 10], [40, 30, 6]])
    close(x.scatter(1, t([[2], [0]]), 0.0), [[1, 2, 0], [0, 5, 6]])
    close(tally.scatter(x, 1, t([[2], [0]]), value=-1.0), [[1, 2, -1], [-1, 5, 6]])
    close(x.scatter_add(1, t([[0, 0], [2, 2]]), src), [[31, 2, 3], [4, 5, 76]])
    close(tally.index_select(x, 1, t([2, 0])), X[:, [2, 0]])
    close(x.index_select(0, t([1, 1])), X[[1, 1]])
    close(x.index_add(0, t([1, 1]), t(np.ones((2, 3), np.float32)), alpha=2), X + [[0], [4]])
    y = tally.zeros(3)
    with tally.no_grad():
        y.scatter_add_(0, t([0, 0, 2]), t(np.float32([1, 2, 3])))
    close(y, [3, 0, 3])
    with pytest.raises(IndexError, match="gather"):
        tally.gather(x, 1, t([[3]]))
    with pytest.raises(ValueError, match="int64"):
        tally.gather(x, 1, t([[0.5]]))


def test_gather_scatter_gradients():
    idx = t([[2, 0, 1], [1, 1, 0]])
    gradcheck(lambda a: a.gather(1, idx), RNG.standard_normal((2, 4)))
    gradcheck(lambda a, s: a.scatter_add(1, idx, s), RNG.standard_normal((2, 4)),
              RNG.standard_normal((2, 3)))
    gradcheck(lambda a, s: a.scatter(1, t([[2, 0, 1], [1, 0, 2]]), s),
              RNG.standard_normal((2, 4)), RNG.standard_normal((2, 3)))
    gradcheck(lambda a: a.index_select(0, t([2, 0, 2])), RNG.standard_normal((3, 2)))
    gradcheck(lambda a, s: a.index_add(1, t([0, 0]), s, alpha=3), RNG.standard_normal((2, 3)),
              RNG.standard_normal((2, 2)))


def test_cumsum_sort_topk():
    a = np.float32([[3, 1, 2], [1, 5, 4]])
    x = t(a)
    close(x.cumsum(1), np.cumsum(a, 1))
    close(tally.cumsum(x, dim=0), np.cumsum(a, 0))
    assert tally.cumsum(t([1, 2, 3]), 0).dtype == tally.int64
    values, indices = tally.sort(x, dim=1)
    close(values, np.sort(a, 1))
    np.testing.assert_array_equal(indices.numpy(), np.argsort(a, 1, kind="stable"))
    r = x.sort(descending=True)
    close(r.values, -np.sort(-a, 1))
    r = tally.topk(x, 2)
    close(r.values, [[3, 2], [5, 4]])
    np.testing.assert_array_equal(r.indices.numpy(), [[0, 2], [1, 2]])
    v, i = x.topk(1, dim=0, largest=False)
    close(v, [[1, 1, 2]])
    np.testing.assert_array_equal(i.numpy(), [[1, 0, 0]])
    gradcheck(lambda a: a.cumsum(0), RNG.standard_normal((3, 4)))
    gradcheck(lambda a: a.sort(dim=0).values, RNG.standard_normal((4, 3)))
    gradcheck(lambda a: a.topk(2).values, RNG.standard_normal((3, 5)))


def test_shape_ops():
    a = np.arange(9, dtype=np.float32).reshape(3, 3)
    x = t(a)
    close(x.tril(), np.tril(a))
    close(tally.triu(x, diagonal=1), np.triu(a, 1))
    close(tally.tril(x, -1), np.tril(a, -1))
    close(x.repeat(2, 1), np.tile(a, (2, 1)))
    close(t(np.float32([1, 2])).repeat(2, 3), np.tile([1, 2], (2, 3)))
    close(x.flip(0), a[::-1])
    close(tally.flip(x, dims=(0, 1)), a[::-1, ::-1])
    close(x.roll(1, 1), np.roll(a, 1, 1))
    close(tally.roll(x, shifts=(1, -1), dims=(0, 1)), np.roll(a, (1, -1), (0, 1)))
    close(x.roll(4), np.roll(a, 4))
    gradcheck(lambda a: a.tril(), RNG.standard_normal((3, 4)))
    gradcheck(lambda a: a.repeat(2, 2), RNG.standard_normal((2, 3)))
    gradcheck(lambda a: a.flip(1), RNG.standard_normal((2, 3)))
    gradcheck(lambda a: a.roll(1, 0), RNG.standard_normal((3, 2)))


def test_pad_and_one_hot():
    a = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    x = t(a)
    close(F.pad(x, (1, 2)), np.pad(a, ((0, 0), (0, 0), (1, 2))))
    close(F.pad(x, (1, 0, 0, 1), value=7.0),
          np.pad(a, ((0, 0), (0, 1), (1, 0)), constant_values=7))
    close(F.pad(x, (2, 1), mode="reflect"), np.pad(a, ((0, 0), (0, 0), (2, 1)), mode="reflect"))
    close(F.pad(x, (-1, 0)), a[:, :, 1:])
    with pytest.raises(ValueError, match="replicate"):
        F.pad(x, (1, 1), mode="replicate")
    gradcheck(lambda a: F.pad(a, (1, 2, 0, 1)), RNG.standard_normal((2, 3)))
    gradcheck(lambda a: F.pad(a, (1, 1), mode="reflect"), RNG.standard_normal((2, 3)))
    oh = F.one_hot(t([0, 2, 1]), num_classes=4)
    assert oh.dtype == tally.int64
    np.testing.assert_array_equal(oh.numpy(), np.eye(4, dtype=np.int64)[[0, 2, 1]])
    assert F.one_hot(t([[1], [3]])).shape == (2, 1, 4)
    with pytest.raises(ValueError, match="one_hot"):
        F.one_hot(t([0, 5]), 3)


def test_boolean_masks():
    x = t(X.copy())
    mask = x > 2.5
    close(x[mask], X[X > 2.5])
    close(tally.masked_select(x, mask), X[X > 2.5])
    rows = t(np.array([True, False]))
    close(x[rows], X[[True, False]])
    close(x[X > 2.5], X[X > 2.5])  # a numpy bool array too
    close(x.masked_fill(mask, 0.0), np.where(X > 2.5, 0, X))
    close(tally.masked_fill(x, mask, -1.0), np.where(X > 2.5, -1, X))
    y = t(X.copy())
    y[mask] = 0.0
    close(y, np.where(X > 2.5, 0, X))
    y[mask] = t(np.float32([9, 8, 7, 6]))
    expect = X.copy()
    expect[X > 2.5] = [9, 8, 7, 6]
    close(y, expect)
    y[rows] = t(np.float32([1, 1, 1]))
    expect[0] = 1
    close(y, expect)
    y.masked_fill_(t(np.array([True, False, True])), 5.0)
    expect[:, [0, 2]] = 5
    close(y, expect)
    y[0] = 3.0  # ints and slices still index as before
    expect[0] = 3
    close(y, expect)
    with pytest.raises(IndexError, match="mask"):
        x[t(np.array([True, False, True]))]
    gradcheck(lambda a: a[a.detach() > 0], RNG.standard_normal((3, 4)))


def test_norm_einsum():
    a = np.float32([[3, -4], [0, 0]])
    x = t(a)
    close(x.norm(), 5.0)
    close(tally.norm(x, dim=1), np.linalg.norm(a, axis=1))
    close(x.norm(p=1, dim=0, keepdim=True), np.abs(a).sum(0, keepdims=True))
    close(x.norm(p=float("inf")), 4.0)
    close(x.norm(3, dim=1), np.cbrt((np.abs(a) ** 3).sum(1)), tol=1e-5)
    z = tally.tensor(np.zeros(3), requires_grad=True)
    z.norm().backward()
    close(z.grad, [0, 0, 0])
    gradcheck(lambda a: a.norm(dim=0), RNG.standard_normal((3, 4)))
    gradcheck(lambda a: a.norm(p=3), RNG.standard_normal((3, 4)))
    b = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    c = RNG.standard_normal((2, 4, 5)).astype(np.float32)
    close(tally.einsum("bij,bjk->bik", t(b), t(c)), np.einsum("bij,bjk->bik", b, c), tol=1e-5)
    close(tally.einsum("bij,bkj->bki", [t(b), t(b)]), np.einsum("bij,bkj->bki", b, b), tol=1e-5)
    close(tally.einsum("ij->ji", t(X)), X.T)
    close(tally.einsum("ij", t(X)), X)
    close(tally.einsum("i,j", t(X[0]), t(X[1])), np.outer(X[0], X[1]))
    close(tally.einsum("ij,jk", t(X), t(X.T)), X @ X.T)
    with pytest.raises(ValueError, match=r"einsum\('ii->i'\)"):
        tally.einsum("ii->i", t(np.eye(2, dtype=np.float32)))
    gradcheck(lambda p, q: tally.einsum("bij,bjk->bki", p, q), RNG.standard_normal((2, 3, 2)),
              RNG.standard_normal((2, 2, 4)))


def test_arithmetic_methods():
    x = t(X)
    o = t(np.float32([[1, 1, 1], [2, 2, 2]]))
    close(x.add(o), X + o.numpy())
    close(x.add(o, alpha=2), X + 2 * o.numpy())
    close(x.add(1), X + 1)
    close(x.sub(o), X - o.numpy())
    close(x.sub(1, alpha=3), X - 3)
    close(x.mul(2), X * 2)
    close(x.mul(o), X * o.numpy())
    close(x.div(2), X / 2)
    close(x.div(o), X / o.numpy())
    close(x.pow(2), X ** 2)
    close(x.pow(o), X ** o.numpy())
    close(x.neg(), -X)
    close(x.abs(), X)
    close(x.exp(), np.exp(X), tol=1e-5)
    close(x.log(), np.log(X), tol=1e-6)
    close(x.sqrt(), np.sqrt(X))
    close(x.rsqrt(), 1 / np.sqrt(X))
    close(x.clamp(min=2, max=5), np.clip(X, 2, 5))
    close(x.maximum(o), np.maximum(X, o.numpy()))
    close(x.minimum(o), np.minimum(X, o.numpy()))
    np.testing.assert_array_equal(x.gt(3).numpy(), X > 3)
    np.testing.assert_array_equal(x.eq(o).numpy(), X == o.numpy())
    close(x.where(x > 3, 0.0), np.where(X > 3, X, 0))
    gradcheck(lambda a, b: a.add(b, alpha=2).mul(b).div(2).pow(2).neg(),
              RNG.standard_normal((2, 3)), RNG.standard_normal((2, 3)))


def test_everyday_methods_composed_from_ops():
    y = np.float32([[3, 1, 2], [0, 5, -1], [0, 7, -1]])
    x = t(y)
    assert x.argmin().item() == np.argmin(y)
    np.testing.assert_array_equal(x.argmin(1).numpy(), np.argmin(y, 1))
    np.testing.assert_array_equal(tally.argmin(x, 0, keepdim=True).numpy(), [np.argmin(y, 0)])
    close(x.amin(1), y.min(1))
    close(x.logsumexp(1), np.log(np.exp(y.astype(np.float64)).sum(1)), tol=1e-5)
    assert [u.numpy().tolist() for u in x.unbind(1)] == y.T.tolist()
    assert len(tally.unbind(x)) == 3 and x.unbind(-1)[2].numpy().tolist() == [2, -1, -1]
    with pytest.raises(IndexError, match="0-D"):
        tally.tensor(1.0).unbind()
    close(x.clamp_min(1), np.maximum(y, 1))
    close(x.clamp_max(1), np.minimum(y, 1))
    close(t(np.float32([[1], [2], [3]])).expand_as(x), np.repeat([[1], [2], [3]], 3, 1))
    assert x.view_as(tally.zeros(9)).shape == (9,)
    assert x.reshape_as(tally.zeros(1, 9)).shape == (1, 9)
    assert tally.tensor([1, 2]).type_as(x).dtype == tally.float32
    # new_*: the size as ints or one sequence; x's dtype and device unless given.
    z = x.new_zeros(2, 3)
    assert z.shape == (2, 3) and z.dtype == x.dtype and z.device == x.device and not z.numpy().any()
    assert x.new_ones((4,)).numpy().tolist() == [1, 1, 1, 1]
    assert x.new_full([2], 7).numpy().tolist() == [7, 7]
    assert x.new_empty(3, dtype=tally.int64).dtype == tally.int64
    assert x.new_zeros(2, requires_grad=True).requires_grad
    with pytest.raises(TypeError, match="unexpected keyword"):
        x.new_zeros(2, colour="red")
    # NaN and infinities: bool tensors, none in an integer tensor.
    v = np.float32([1, np.nan, np.inf, -np.inf, -0.0, 3e38])
    for dtype in (tally.float32, tally.float16, tally.bfloat16, tally.float64):
        w = t(v).to(dtype)
        with np.errstate(over="ignore"):
            ref = w.to(tally.float32).numpy()
        np.testing.assert_array_equal(w.isnan().numpy(), np.isnan(ref))
        np.testing.assert_array_equal(tally.isinf(w).numpy(), np.isinf(ref))
        np.testing.assert_array_equal(w.isfinite().numpy(), np.isfinite(ref))
    k = t(np.int64([1, -2]))
    assert k.isfinite().numpy().all()
    assert not k.isnan().numpy().any() and not k.isinf().numpy().any()
    gradcheck(lambda a, b: a.bmm(b), RNG.standard_normal((2, 3, 4)), RNG.standard_normal((2, 4, 2)))
    gradcheck(lambda a: a.unbind(1)[1] * a.unbind(1)[0], RNG.standard_normal((3, 2)))
    gradcheck(lambda a: a.logsumexp(0), RNG.standard_normal((3, 2)))


def test_normalize_outer_movedim_unflatten_addc_and_comparisons():
    a = RNG.standard_normal((3, 4)).astype(np.float32)
    x = t(a)
    n = np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    close(F.normalize(x), a / n, tol=1e-6)
    close(F.normalize(x, p=1.0, dim=0), a / np.abs(a).sum(0, keepdims=True), tol=1e-6)
    close(F.normalize(tally.zeros(2, 3)), np.zeros((2, 3)))  # eps keeps 0 / 0 away
    gradcheck(lambda v: F.normalize(v, dim=-1), RNG.standard_normal((2, 3)))
    u, v = np.float32([1, 2, 3]), np.float32([4, 5])
    close(tally.outer(t(u), t(v)), np.outer(u, v))
    close(t(u).outer(t(v)), np.outer(u, v))
    with pytest.raises(ValueError, match="outer: expected two 1-D"):
        tally.outer(x, t(v))
    gradcheck(lambda p, q: tally.outer(p, q), RNG.standard_normal(3), RNG.standard_normal(2))
    b = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    y = t(b)
    close(y.movedim(0, -1), np.moveaxis(b, 0, -1))
    close(tally.movedim(y, [0, 2], [2, 0]), np.moveaxis(b, [0, 2], [2, 0]))
    close(y.movedim((1,), (0,)), np.moveaxis(b, 1, 0))
    with pytest.raises(ValueError, match="repeated"):
        y.movedim([0, 0], [1, 2])
    with pytest.raises(IndexError):
        y.movedim(3, 0)
    assert y.unflatten(2, (2, 2)).shape == (2, 3, 2, 2)
    close(y.unflatten(-1, [-1, 2]), b.reshape(2, 3, 2, 2))
    c, d = RNG.standard_normal((3, 4)), RNG.standard_normal((3, 4)) + 3
    close(x.addcmul(t(c.astype(np.float32)), t(d.astype(np.float32)), value=0.5),
          a + 0.5 * c * d, tol=1e-5)
    close(x.addcdiv(t(c.astype(np.float32)), t(d.astype(np.float32)), value=-2),
          a - 2 * c / d, tol=1e-5)
    gradcheck(lambda p, q, r: p.addcdiv(q, r, value=0.5), c, c, d)
    # zero is false, NaN is true
    z = t(np.float32([0, 1, np.nan, -0.0, 2]))
    assert z.logical_not().numpy().tolist() == [True, False, False, True, False]
    assert tally.count_nonzero(z).item() == 3
    assert t(np.int64([[0, 1], [2, 0]])).count_nonzero(0).numpy().tolist() == [1, 1]
    # allclose / equal, against numpy's isclose rule
    p = np.float32([1.0, np.inf, np.nan, 1e-9])
    for q in (np.float32([1.0 + 1e-6, np.inf, np.nan, 0.0]), np.float32([1.1, -np.inf, 1, 0]),
              np.float32([1.0, 1.0, np.nan, 1e-9])):
        for equal_nan in (False, True):
            assert tally.allclose(t(p), t(q), equal_nan=equal_nan) == np.allclose(
                p, q, equal_nan=equal_nan), (q, equal_nan)
    assert t(p[:1]).allclose(t(np.float32([1.5])), rtol=0.5)
    with pytest.raises(TypeError, match="dtypes differ"):
        tally.allclose(t(p), t(p).to(tally.float64))
    assert tally.equal(x, t(a.copy())) and x.equal(x)
    assert not tally.equal(x, x + 1) and not tally.equal(x, x.reshape(4, 3))
