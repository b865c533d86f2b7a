"""Attention from Python as a PyTorch user writes it: F.scaled_dot_product_attention with masks
and grouped key/value heads, nn.MultiheadAttention, nn.TransformerEncoderLayer and
nn.TransformerEncoder. References are float64 numpy."""

import math

import numpy as np
import pytest

import tally
import tally.nn as nn
import tally.nn.functional as F
from test_layers_habits import npy, t64  # float64 tensors from numpy and back


def softmax(s):
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    return np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)


def sdpa_ref(q, k, v, bias=None, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    if bias is not None:
        s = s + bias
    return softmax(s) @ v


def test_sdpa_masks_and_gqa():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 3, 8))
    k = rng.standard_normal((2, 2, 5, 8))
    v = rng.standard_normal((2, 2, 5, 6))
    keep = rng.random((3, 5)) > 0.3
    keep[:, 0] = True
    bias = np.where(keep, 0.0, -np.inf)
    kr, vr = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    want = sdpa_ref(q, kr, vr, bias)
    got = F.scaled_dot_product_attention(t64(q), t64(k), t64(v), attn_mask=tally.tensor(keep),
                                         enable_gqa=True)
    np.testing.assert_allclose(npy(got), want, rtol=1e-10, atol=1e-12)
    got = F.scaled_dot_product_attention(t64(q), t64(kr), t64(vr), attn_mask=t64(bias))
    np.testing.assert_allclose(npy(got), want, rtol=1e-10, atol=1e-12)
    # causal is top-left aligned
    causal = np.where(np.tril(np.ones((3, 5), dtype=bool)), 0.0, -np.inf)
    got = F.scaled_dot_product_attention(t64(q), t64(k), t64(v), is_causal=True, enable_gqa=True)
    np.testing.assert_allclose(npy(got), sdpa_ref(q, kr, vr, causal), rtol=1e-10, atol=1e-12)
    # a fully masked row attends to nothing
    none = np.zeros((3, 5), dtype=bool)
    none[0] = True
    out = npy(F.scaled_dot_product_attention(t64(q), t64(kr), t64(vr), attn_mask=tally.tensor(none)))
    assert np.all(out[:, :, 1:] == 0) and np.all(np.isfinite(out))
    with pytest.raises(ValueError, match="enable_gqa"):
        F.scaled_dot_product_attention(t64(q), t64(k), t64(v))
    with pytest.raises(ValueError, match=r"attn_mask of shape \[4, 5\]"):
        F.scaled_dot_product_attention(t64(q), t64(kr), t64(vr), attn_mask=t64(np.zeros((4, 5))))


def mha_ref(m, q, k, v, bias):
    """q [N, L, E], k/v [N, S, E], bias [N, L, S] or None: output, head-averaged weights."""
    W = npy(m.in_proj_weight)
    b = npy(m.in_proj_bias)
    E, H = m.embed_dim, m.num_heads
    hd = E // H

    def proj(x, i):
        y = x @ W[i * E:(i + 1) * E].T + b[i * E:(i + 1) * E]
        return y.reshape(y.shape[0], y.shape[1], H, hd).transpose(0, 2, 1, 3)

    s = proj(q, 0) @ proj(k, 1).transpose(0, 1, 3, 2) / math.sqrt(hd)
    if bias is not None:
        s = s + bias[:, None]
    p = softmax(s)
    o = (p @ proj(v, 2)).transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[1], E)
    return o @ npy(m.out_proj.weight).T + npy(m.out_proj.bias), p.mean(1)


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_matches_numpy(batch_first):
    tally.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=batch_first).to(tally.float64)
    assert [n for n, _ in m.named_parameters()] == [
        "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]
    assert np.all(npy(m.in_proj_bias) == 0) and np.all(npy(m.out_proj.bias) == 0)
    assert np.abs(npy(m.in_proj_weight)).max() <= math.sqrt(6 / 32)
    with tally.no_grad():
        nn.init.uniform_(m.in_proj_bias, -0.5, 0.5)
        nn.init.uniform_(m.out_proj.bias, -0.5, 0.5)
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 8))
    kpm = np.zeros((2, 4), dtype=bool)
    kpm[1, 3] = True  # batch 1 ignores its last key
    am = rng.standard_normal((3, 4))
    bias = am[None] + np.where(kpm, -np.inf, 0.0)[:, None, :]
    want, want_w = mha_ref(m, q, k, k, bias)
    io = (lambda a: a) if batch_first else (lambda a: np.swapaxes(a, 0, 1))
    out, w = m(t64(io(q)), t64(io(k)), t64(io(k)), key_padding_mask=tally.tensor(kpm),
               attn_mask=t64(am))
    np.testing.assert_allclose(io(npy(out)), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(npy(w), want_w, rtol=1e-10, atol=1e-12)
    out, w = m(t64(io(q)), t64(io(k)), t64(io(k)), key_padding_mask=tally.tensor(kpm),
               need_weights=False, attn_mask=t64(am))
    assert w is None
    np.testing.assert_allclose(io(npy(out)), want, rtol=1e-10, atol=1e-12)
    _, w = m(t64(io(q)), t64(io(k)), t64(io(k)), average_attn_weights=False)
    assert tuple(w.shape) == (2, 2, 3, 4)


def test_multihead_attention_gradient_and_kdim():
    tally.manual_seed(1)
    m = nn.MultiheadAttention(4, 2, kdim=3, vdim=5).to(tally.float64)
    assert [n for n, _ in m.named_parameters()] == [
        "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "out_proj.weight",
        "out_proj.bias"]
    assert not m._qkv_same_embed_dim
    rng = np.random.default_rng(2)
    q0, k, v = rng.standard_normal((3, 2, 4)), rng.standard_normal((5, 2, 3)), \
        rng.standard_normal((5, 2, 5))

    def f(qa):
        return m(t64(qa), t64(k), t64(v))[0].sum()

    q = t64(q0, requires_grad=True)
    m(q, t64(k), t64(v))[0].sum().backward()
    num = np.zeros_like(q0)
    for i in np.ndindex(q0.shape):
        d = np.zeros_like(q0)
        d[i] = 1e-6
        num[i] = (f(q0 + d).item() - f(q0 - d).item()) / 2e-6
    np.testing.assert_allclose(npy(q.grad), num, rtol=1e-5, atol=1e-7)
    assert m.k_proj_weight.grad is not None and m.out_proj.weight.grad is not None


def test_multihead_attention_errors():
    m = nn.MultiheadAttention(8, 2)
    x = tally.zeros((3, 2, 8))
    with pytest.raises(ValueError, match=r"key_padding_mask should have shape \[2, 3\]"):
        m(x, x, x, key_padding_mask=tally.zeros((3, 3), dtype=tally.bool))
    with pytest.raises(ValueError, match="Need attn_mask"):
        m(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        nn.MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(ValueError, match="divisible"):
        nn.MultiheadAttention(8, 3)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer_and_encoder(norm_first):
    tally.manual_seed(2)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=norm_first)
    assert [n for n, _ in layer.named_parameters()] == [
        "self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight",
        "self_attn.out_proj.bias", "linear1.weight", "linear1.bias", "linear2.weight",
        "linear2.bias", "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"]
    enc = nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(8))
    names = [n for n, _ in enc.named_parameters()]
    assert names[0] == "layers.0.self_attn.in_proj_weight" and names[-1] == "norm.bias"
    assert "layers.1.linear2.bias" in names and len(names) == 26
    # deep copies: equal to the prototype, not shared
    np.testing.assert_array_equal(npy(enc.layers[1].linear1.weight), npy(layer.linear1.weight))
    x = tally.randn((2, 5, 8))
    x.requires_grad_(True)
    mask = nn.generate_square_subsequent_mask(5)
    kpm = tally.tensor(np.array([[False] * 5, [False] * 4 + [True]]))
    y = enc(x, mask=mask, src_key_padding_mask=kpm)
    assert tuple(y.shape) == (2, 5, 8)
    # the same as running the layers one by one
    h = x
    for i in range(2):
        h = enc.layers[i](h, src_mask=mask, src_key_padding_mask=kpm)
    np.testing.assert_allclose(npy(enc.norm(h)), npy(y), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert x.grad is not None
    assert enc.layers[0].self_attn.in_proj_weight.grad is not None
    # is_causal with its mask gives the same values as the mask alone
    np.testing.assert_allclose(npy(layer(x, src_mask=mask, is_causal=True)),
                               npy(layer(x, src_mask=mask)), rtol=1e-5, atol=1e-6)


def test_transformer_encoder_layer_activations_and_errors():
    assert nn.TransformerEncoderLayer(8, 2, activation=F.gelu).norm_first is False
    nn.TransformerEncoderLayer(8, 2, activation=nn.ReLU())
    with pytest.raises(ValueError, match="activation"):
        nn.TransformerEncoderLayer(8, 2, activation="tanh")
    layer = nn.TransformerEncoderLayer(8, 2)
    with pytest.raises(ValueError, match="embed_dim"):
        layer(tally.zeros((3, 2, 6)))
