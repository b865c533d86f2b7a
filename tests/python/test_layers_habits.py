"""The everyday layers of issue 50 from Python, as a PyTorch user writes them: activations,
losses, norms, Conv1d, ConvTranspose2d, AvgPool2d, Upsample / F.interpolate, Embedding's
padding_idx, tally.nn.init, Module.apply and frozen parameters. References are float64 numpy."""

import math

import numpy as np
import pytest

import tally
import tally.nn as nn
import tally.nn.functional as F
import tally.nn.init as init


def t64(a, requires_grad=False):
    x = tally.tensor(np.asarray(a, dtype=np.float64))
    if requires_grad:
        x.requires_grad_(True)
    return x


def npy(t):
    return np.asarray(t.detach().numpy(), dtype=np.float64)


def numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar f(x) over the numpy array x."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        g[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return g


def check_grad(fn, x_np, rtol=1e-5, atol=1e-7):
    """fn maps a tally tensor to a scalar tensor: its backward against central differences."""
    x = t64(x_np, requires_grad=True)
    fn(x).backward()
    want = numeric_grad(lambda a: fn(t64(a)).item(), np.asarray(x_np, dtype=np.float64))
    np.testing.assert_allclose(npy(x.grad), want, rtol=rtol, atol=atol)


X = np.array([[-3.0, -0.5, 0.0], [0.25, 2.0, 7.0]])


def test_activations_match_numpy():
    x = t64(X)
    sig = 1 / (1 + np.exp(-X))
    np.testing.assert_allclose(npy(nn.Sigmoid()(x)), sig, rtol=1e-12)
    np.testing.assert_allclose(npy(nn.SiLU()(x)), X * sig, rtol=1e-12)
    np.testing.assert_allclose(npy(nn.Tanh()(x)), np.tanh(X), rtol=1e-12)
    np.testing.assert_array_equal(npy(nn.LeakyReLU(0.2)(x)), np.where(X > 0, X, 0.2 * X))
    np.testing.assert_array_equal(npy(F.leaky_relu(x)), np.where(X > 0, X, 0.01 * X))
    e = np.exp(X - X.max(1, keepdims=True))
    sm = e / e.sum(1, keepdims=True)
    np.testing.assert_allclose(npy(nn.Softmax(dim=1)(x)), sm, rtol=1e-12)
    np.testing.assert_allclose(npy(nn.LogSoftmax(dim=-1)(x)), np.log(sm), rtol=1e-12)
    gelu_tanh = 0.5 * X * (1 + np.tanh(math.sqrt(2 / math.pi) * (X + 0.044715 * X**3)))
    np.testing.assert_allclose(npy(nn.GELU(approximate="tanh")(x)), gelu_tanh, rtol=1e-12)
    assert repr(nn.LeakyReLU(0.2)) == "LeakyReLU(negative_slope=0.2)"
    check_grad(lambda a: (F.leaky_relu(a, 0.1) * t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])).sum(),
               X + 0.1)


A = np.array([[0.1, -1.7, 2.5], [0.4, -0.05, 3.0]])
B = np.array([[0.3, -0.2, 0.5], [0.45, 0.0, -1.0]])


def test_regression_losses():
    a, b = t64(A), t64(B)
    d = np.abs(A - B)
    assert nn.MSELoss()(a, b).item() == pytest.approx((d**2).mean(), rel=1e-12)
    assert nn.L1Loss(reduction="sum")(a, b).item() == pytest.approx(d.sum(), rel=1e-12)
    sl1 = np.where(d < 0.5, 0.5 * d**2 / 0.5, d - 0.25)
    np.testing.assert_allclose(npy(nn.SmoothL1Loss(reduction="none", beta=0.5)(a, b)), sl1,
                               rtol=1e-12)
    hub = np.where(d < 1.5, 0.5 * d**2, 1.5 * (d - 0.75))
    assert nn.HuberLoss(delta=1.5)(a, b).item() == pytest.approx(hub.mean(), rel=1e-12)
    assert F.huber_loss(a, b, delta=1.5).item() == pytest.approx(hub.mean(), rel=1e-12)
    assert F.l1_loss(a, b).item() == pytest.approx(d.mean(), rel=1e-12)
    with pytest.raises(ValueError, match="reduction"):
        nn.MSELoss(reduction="avg")
    check_grad(lambda x: F.smooth_l1_loss(x, t64(B), beta=0.5), A)
    check_grad(lambda x: F.huber_loss(x, t64(B), reduction="sum", delta=1.5), A)


def test_bce_with_logits_and_pos_weight():
    x = np.array([[-30.0, -1.2, 0.0], [0.7, 4.0, 40.0]])
    y = np.array([[0.0, 1.0, 0.5], [1.0, 0.0, 1.0]])
    pw = np.array([2.0, 0.5, 3.0])
    sp = np.maximum(-x, 0) + np.log1p(np.exp(-np.abs(x)))  # -log(sigmoid(x))
    ref = ((1 - y) * x + (1 + (pw - 1) * y) * sp).mean()
    loss = nn.BCEWithLogitsLoss(pos_weight=t64(pw))
    assert loss(t64(x), t64(y)).item() == pytest.approx(ref, rel=1e-12)
    assert [n for n, _ in loss.named_buffers()] == ["pos_weight"]
    plain = F.binary_cross_entropy_with_logits(t64(x), t64(y), reduction="sum").item()
    assert plain == pytest.approx(((1 - y) * x + sp).sum(), rel=1e-12)
    check_grad(lambda a: F.binary_cross_entropy_with_logits(a, t64(y), pos_weight=t64(pw)),
               np.array([[-1.2, 0.3, 2.0], [-0.4, 0.9, 1.1]]))


def test_nll_and_kl_div():
    p = np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    logp = t64(np.log(p))
    target = tally.tensor(np.array([1, 2]))
    assert nn.NLLLoss()(logp, target).item() == pytest.approx(-(np.log(0.5) + np.log(0.3)) / 2)
    assert nn.NLLLoss(ignore_index=2, reduction="sum")(logp, target).item() == pytest.approx(
        -np.log(0.5))
    q = np.array([[0.0, 0.25, 0.75], [0.5, 0.5, 0.0]])
    terms = np.where(q > 0, q * (np.log(np.where(q > 0, q, 1)) - np.log(p)), 0)
    assert nn.KLDivLoss(reduction="batchmean")(logp, t64(q)).item() == pytest.approx(
        terms.sum() / 2, rel=1e-12)
    assert F.kl_div(logp, t64(q)).item() == pytest.approx(terms.mean(), rel=1e-12)
    lq = np.log(np.array([[0.1, 0.25, 0.65], [0.5, 0.4, 0.1]]))
    assert F.kl_div(logp, t64(lq), reduction="sum", log_target=True).item() == pytest.approx(
        (np.exp(lq) * (lq - np.log(p))).sum(), rel=1e-12)
    check_grad(lambda a: F.kl_div(a, t64(q), reduction="batchmean"), np.log(p))


def test_group_norm_rms_norm_batch_norm1d():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 5))
    gn = nn.GroupNorm(3, 6)
    assert [n for n, _ in gn.named_parameters()] == ["weight", "bias"]
    g = x.reshape(2, 3, -1)
    ref = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + 1e-5)).reshape(x.shape)
    np.testing.assert_allclose(npy(gn(t64(x).float())), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(npy(F.group_norm(t64(x), 3)), ref, rtol=1e-10, atol=1e-12)
    check_grad(lambda a: (F.group_norm(a, 2, t64(np.arange(1, 7) / 3.0)) * t64(x)).sum(), x)

    rms = nn.RMSNorm(5, eps=1e-6)
    np.testing.assert_allclose(npy(rms(t64(x))), x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6),
                               rtol=1e-12)
    assert repr(nn.RMSNorm([5])) == "RMSNorm((5,), eps=None, elementwise_affine=True)"

    for shape in [(8, 6), (4, 6, 5)]:
        xs = rng.standard_normal(shape) * 2 + 1
        bn = nn.BatchNorm1d(6, momentum=0.5)
        bn.to("float64")
        y = npy(bn(t64(xs)))
        axes = (0,) if len(shape) == 2 else (0, 2)
        mean, var = xs.mean(axes, keepdims=True), xs.var(axes, keepdims=True)
        np.testing.assert_allclose(y, (xs - mean) / np.sqrt(var + 1e-5), rtol=1e-9, atol=1e-10)
        n = xs.size // 6
        np.testing.assert_allclose(npy(bn.running_mean), 0.5 * mean.ravel(), rtol=1e-12)
        np.testing.assert_allclose(npy(bn.running_var), 0.5 + 0.5 * var.ravel() * n / (n - 1),
                                   rtol=1e-12)
        bn.eval()
        rm, rv = npy(bn.running_mean), npy(bn.running_var)
        sh = (1, 6) if len(shape) == 2 else (1, 6, 1)
        np.testing.assert_allclose(npy(bn(t64(xs))),
                                   (xs - rm.reshape(sh)) / np.sqrt(rv.reshape(sh) + 1e-5),
                                   rtol=1e-9, atol=1e-10)


def test_conv1d_conv_transpose2d_avgpool_upsample():
    rng = np.random.default_rng(1)
    conv = nn.Conv1d(2, 3, 3, stride=2, padding=1)
    assert conv.weight.shape == (3, 2, 3)
    bound = 1 / math.sqrt(6)
    assert np.all(np.abs(npy(conv.bias)) <= bound)
    x = rng.standard_normal((2, 2, 7)).astype(np.float32)
    w, b = npy(conv.weight), npy(conv.bias)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1)))
    ref = np.stack([np.einsum("nck,ock->no", xp[:, :, 2 * i:2 * i + 3], w) for i in range(4)], -1)
    np.testing.assert_allclose(npy(conv(tally.tensor(x))), ref + b[None, :, None], rtol=1e-5,
                               atol=1e-5)

    up = nn.ConvTranspose2d(4, 2, kernel_size=4, stride=2, padding=1)
    assert up.weight.shape == (4, 2, 4, 4)
    y = up(tally.tensor(rng.standard_normal((1, 4, 5, 5)).astype(np.float32)))
    assert y.shape == (1, 2, 10, 10)
    # The adjoint of conv2d: <conv2d(a, w), x> == <a, conv_transpose2d(x, w)>.
    wt = t64(rng.standard_normal((3, 2, 3, 3)))
    a = t64(rng.standard_normal((1, 2, 8, 7)))
    ca = F.conv2d(a, wt, stride=2, padding=1)
    xt = t64(rng.standard_normal(tuple(ca.shape)))
    ta = F.conv_transpose2d(xt, wt, stride=2, padding=1, output_padding=(1, 0))
    assert ta.shape == (1, 2, 8, 7)
    assert (ca * xt).sum().item() == pytest.approx((a * ta).sum().item(), rel=1e-10)
    check_grad(lambda v: (F.conv_transpose2d(v, wt, stride=2, padding=1) ** 2).sum(),
               rng.standard_normal((1, 3, 2, 2)))

    img = t64(np.arange(1, 10, dtype=np.float64).reshape(1, 1, 3, 3))
    np.testing.assert_allclose(npy(nn.AvgPool2d(2, padding=1, count_include_pad=False)(img)).ravel(),
                               [1, 2.5, 5.5, 7])
    np.testing.assert_allclose(npy(F.avg_pool2d(img, 2, ceil_mode=True)).ravel(), [3, 4.5, 7.5, 9])

    small = t64(np.arange(1, 7, dtype=np.float64).reshape(1, 1, 2, 3))
    np.testing.assert_array_equal(npy(nn.Upsample(scale_factor=2)(small))[0, 0],
                                  np.repeat(np.repeat(np.arange(1, 7).reshape(2, 3), 2, 0), 2, 1))
    np.testing.assert_array_equal(npy(F.interpolate(small, size=(3, 2)))[0, 0],
                                  [[1, 2], [1, 2], [4, 5]])
    # align_corners=True at the corners reads the corner pixels; the centre is their mean.
    bil = npy(F.interpolate(small, size=(3, 5), mode="bilinear", align_corners=True))[0, 0]
    np.testing.assert_allclose(bil[[0, 0, 2, 2], [0, 4, 0, 4]], [1, 3, 4, 6])
    assert bil[1, 2] == pytest.approx(3.5)
    # align_corners=False, size 2x: PyTorch's values for [[1, 2, 3], [4, 5, 6]] -> (4, 6).
    bil2 = npy(F.interpolate(small, scale_factor=2, mode="bilinear"))[0, 0]
    np.testing.assert_allclose(bil2[0], [1.0, 1.25, 1.75, 2.25, 2.75, 3.0])
    np.testing.assert_allclose(bil2[1], [1.75, 2.0, 2.5, 3.0, 3.5, 3.75])
    with pytest.raises(ValueError, match="align_corners"):
        nn.Upsample(scale_factor=2, align_corners=True)



def test_interpolate_3d_and_5d():
    line = t64(np.array([[[1.0, 2, 4]]]))
    np.testing.assert_allclose(npy(F.interpolate(line, size=5, mode="linear"))[0, 0],
                               [1, 1.4, 2, 3.2, 4])
    corners = F.interpolate(line, size=5, mode="linear", align_corners=True)
    np.testing.assert_allclose(npy(corners)[0, 0], [1, 1.5, 2, 3, 4])
    np.testing.assert_allclose(npy(F.interpolate(line, scale_factor=2, mode="linear"))[0, 0],
                               [1, 1.25, 1.75, 2.5, 3.5, 4])
    np.testing.assert_array_equal(npy(F.interpolate(line, scale_factor=2))[0, 0],
                                  [1, 1, 2, 2, 4, 4])
    vol = t64(np.arange(1, 9, dtype=np.float64).reshape(1, 1, 2, 2, 2))
    near = npy(F.interpolate(vol, scale_factor=(1, 2, 2)))
    assert near.shape == (1, 1, 2, 4, 4)
    np.testing.assert_array_equal(near[0, 0, 1],
                                  np.repeat(np.repeat([[5, 6], [7, 8]], 2, 0), 2, 1))
    tri = npy(F.interpolate(vol, size=(3, 3, 3), mode="trilinear", align_corners=True))[0, 0]
    assert tri[1, 1, 1] == pytest.approx(4.5)  # the centre: the mean of the 8 corners
    np.testing.assert_allclose(tri[[0, 2], [0, 2], [0, 2]], [1, 8])
    assert nn.Upsample(scale_factor=2, mode="trilinear")(vol).shape == (1, 1, 4, 4, 4)
    up = nn.Upsample(size=5, mode="linear", align_corners=True)
    np.testing.assert_allclose(npy(up(line))[0, 0], [1, 1.5, 2, 3, 4])
    with pytest.raises(ValueError, match="bilinear"):
        F.interpolate(vol, size=(3, 3, 3), mode="bilinear")
    with pytest.raises(ValueError, match="spatial dimensions"):
        F.interpolate(vol, size=(3, 3))
    check_grad(lambda v: (F.interpolate(v, size=(3, 2, 3), mode="trilinear") ** 2).sum(),
               np.random.default_rng(3).standard_normal((1, 1, 2, 2, 2)))

def test_embedding_padding_idx():
    emb = nn.Embedding(5, 3, padding_idx=1)
    assert np.all(npy(emb.weight)[1] == 0)
    out = emb(tally.tensor(np.array([1, 2, 1, 4])))
    out.sum().backward()
    g = npy(emb.weight.grad)
    assert np.all(g[1] == 0) and np.all(g[2] == 1) and np.all(g[0] == 0)
    w = t64(np.arange(15, dtype=np.float64).reshape(5, 3), requires_grad=True)
    F.embedding(tally.tensor(np.array([0, 4])), w, padding_idx=-1).sum().backward()
    assert np.all(npy(w.grad)[4] == 0) and np.all(npy(w.grad)[0] == 1)


def test_init_functions_and_apply():
    tally.manual_seed(0)
    lin = nn.Linear(400, 300)
    assert init.xavier_uniform_(lin.weight, gain=2.0) is not None
    w = npy(lin.weight)
    bound = 2.0 * math.sqrt(6 / 700)
    assert w.min() >= -bound and w.max() <= bound and w.max() > 0.99 * bound
    assert lin.weight.requires_grad and lin.weight.grad is None
    init.xavier_normal_(lin.weight)
    assert npy(lin.weight).std() == pytest.approx(math.sqrt(2 / 700), rel=0.02)
    init.kaiming_normal_(lin.weight, mode="fan_out", nonlinearity="relu")
    assert npy(lin.weight).std() == pytest.approx(math.sqrt(2 / 300), rel=0.02)
    init.kaiming_uniform_(lin.weight, a=math.sqrt(5))
    assert np.abs(npy(lin.weight)).max() <= 1 / math.sqrt(400) + 1e-7
    init.trunc_normal_(lin.weight, std=0.02, a=-0.04, b=0.04)
    tw = npy(lin.weight)
    assert tw.min() >= -0.04 and tw.max() <= 0.04
    assert tw.std() == pytest.approx(0.02 * 0.8796, rel=0.03)  # truncated at 2 std
    init.constant_(lin.bias, 0.5)
    assert np.all(npy(lin.bias) == 0.5)
    init.zeros_(lin.bias)
    init.ones_(lin.weight)
    assert np.all(npy(lin.bias) == 0) and np.all(npy(lin.weight) == 1)
    init.uniform_(lin.bias, -0.1, 0.1)
    init.normal_(lin.bias, 3.0, 0.01)
    assert npy(lin.bias).mean() == pytest.approx(3.0, abs=0.01)
    assert init.calculate_gain("leaky_relu", 0.2) == pytest.approx(math.sqrt(2 / 1.04))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(2, 3), nn.SiLU())
            self.head = nn.Linear(3, 1)

        def forward(self, x):
            return self.head(self.body(x))

    net = Net()
    seen = []

    def fn(m):
        seen.append(type(m).__name__)
        if isinstance(m, nn.Linear):
            init.zeros_(m.weight)

    assert net.apply(fn) is net
    assert seen == ["Linear", "SiLU", "Sequential", "Linear", "Net"]
    assert all(np.all(npy(p) == 0) for n, p in net.named_parameters() if n.endswith("weight"))


def test_frozen_parameters_get_no_grad_and_no_optimizer_state():
    tally.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = npy(model[0].weight).copy()
    trained = npy(model[2].weight).copy()
    opt = tally.optim.AdamW(model.parameters(), lr=0.1)
    x = tally.tensor(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
    for _ in range(2):
        opt.zero_grad()
        (model(x) ** 2).sum().backward()
        assert model[0].weight.grad is None and model[0].bias.grad is None
        assert model[2].weight.grad is not None
        opt.step()
    np.testing.assert_array_equal(npy(model[0].weight), frozen)
    assert not np.array_equal(npy(model[2].weight), trained)
    owners = {int(k.split(".")[1]) for k in opt.state_dict() if k.startswith("state.")}
    assert owners == {2, 3}
