"""The registry's reference models as Python classes (python/models.cpp): each built from a
preset's name or its config class, called as the PyTorch reference is, with the properties
its structure promises (causality, padding masks, the timestep's effect), a gradient for
every parameter, the reference's parameter names, and a state dict that round-trips."""

import numpy as np
import pytest

import tally
import tally.nn as nn


def npy(t):
    return np.asarray(t.detach().numpy(), dtype=np.float64)


def tokens(vocab, b, t, seed):
    rng = np.random.default_rng(seed)
    return tally.tensor(rng.integers(0, vocab, size=(b, t)).tolist())


def every_parameter_has_a_gradient(model, loss):
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_llama_is_causal_and_trains():
    cfg = nn.LlamaConfig.preset("tiny")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)  # grouped-query heads
    tally.manual_seed(0)
    m = nn.LlamaForCausalLM("tiny")
    idx = tokens(cfg.vocab_size, 2, 16, 1)
    logits, loss = m(idx, idx)
    assert logits.shape == (2, 16, cfg.vocab_size)
    # At initialisation the logits are near 0: the loss is about ln(vocab).
    assert abs(loss.item() - np.log(cfg.vocab_size)) < 0.1
    every_parameter_has_a_gradient(m, loss)
    # Changing the last 6 tokens leaves the first 10 positions' logits alone.
    other = npy(idx)
    other[:, 10:] = (other[:, 10:] + 7) % cfg.vocab_size
    logits2, none = m(tally.tensor(other.astype(np.int64).tolist()))
    assert none is None
    np.testing.assert_allclose(npy(logits)[:, :10], npy(logits2)[:, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(npy(logits)[:, 10:], npy(logits2)[:, 10:])
    names = list(m.state_dict().keys())
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names and "lm_head.weight" in names


def test_bert_padding_does_not_reach_real_tokens():
    cfg = nn.BertConfig.preset("tiny")
    tally.manual_seed(0)
    m = nn.Bert(cfg)
    m.eval()
    ids = npy(tokens(cfg.vocab_size, 2, 8, 2)).astype(np.int64)
    mask = np.ones((2, 8), dtype=np.int64)
    mask[:, 6:] = 0
    a = m(tally.tensor(ids.tolist()), attention_mask=tally.tensor(mask.tolist()))
    ids[:, 6:] = (ids[:, 6:] + 3) % cfg.vocab_size  # other padding tokens
    b = m(tally.tensor(ids.tolist()), attention_mask=tally.tensor(mask.tolist()))
    assert a.shape == (2, 8, cfg.vocab_size)
    np.testing.assert_allclose(npy(a)[:, :6], npy(b)[:, :6], rtol=1e-5, atol=1e-5)
    # Without the mask the padding is attended to.
    c = m(tally.tensor(ids.tolist()))
    assert not np.allclose(npy(b)[:, :6], npy(c)[:, :6])
    m.train()
    every_parameter_has_a_gradient(m, m(tally.tensor(ids.tolist())).sum())
    assert "encoder.layers.0.self_attn.in_proj_weight" in m.state_dict()


def test_vit_unet_and_lstm_lm():
    tally.manual_seed(0)
    v = nn.VisionTransformer(nn.ViTConfig.preset("tiny"))
    x = tally.randn(2, 3, 32, 32)
    out = v(x)
    assert out.shape == (2, 10)
    every_parameter_has_a_gradient(v, out.sum())
    assert "encoder.layers.encoder_layer_0.self_attention.in_proj_weight" in v.state_dict()

    u = nn.UNet(nn.UNetConfig.preset("tiny", ch=16, num_groups=4))
    assert u.__class__.__name__ == "UNet"
    x = tally.randn(2, 3, 32, 32)
    y1 = u(x, tally.tensor([1, 1]))
    y2 = u(x, tally.tensor([1, 500]))
    assert y1.shape == (2, 3, 32, 32)
    # The timestep reaches the output: sample 0 is unchanged, sample 1 is not.
    np.testing.assert_allclose(npy(y1)[0], npy(y2)[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(npy(y1)[1], npy(y2)[1])
    every_parameter_has_a_gradient(u, y2.pow(2).mean())

    cfg = nn.LSTMLMConfig.preset("tiny")
    lm = nn.LSTMLM(cfg)
    idx = tokens(cfg.vocab_size, 2, 8, 3)
    a = lm(idx)
    other = npy(idx).astype(np.int64)
    other[:, 5:] = (other[:, 5:] + 1) % cfg.vocab_size
    b = lm(tally.tensor(other.tolist()))
    assert a.shape == (2, 8, cfg.vocab_size)
    np.testing.assert_allclose(npy(a)[:, :5], npy(b)[:, :5], rtol=1e-5, atol=1e-6)
    every_parameter_has_a_gradient(lm, a.sum())


def test_state_dicts_round_trip(tmp_path):
    tally.manual_seed(0)
    a = nn.LlamaForCausalLM("tiny")
    path = str(tmp_path / "llama.safetensors")
    tally.save(a.state_dict(), path)
    tally.manual_seed(1)
    b = nn.LlamaForCausalLM("tiny")
    idx = tokens(256, 1, 12, 4)
    assert not np.allclose(npy(a(idx)[0]), npy(b(idx)[0]))
    b.load_state_dict(tally.load(path))
    np.testing.assert_array_equal(npy(a(idx)[0]), npy(b(idx)[0]))


def test_configs_name_their_errors():
    with pytest.raises(TypeError, match="LlamaConfig has no field 'hidden'"):
        nn.LlamaConfig(hidden=64)
    with pytest.raises(ValueError, match="tiny"):  # the known presets
        nn.ViTConfig.preset("vit_h_99")
    cfg = nn.LlamaConfig.preset("tiny", num_key_value_heads=3)  # does not divide 4 heads
    with pytest.raises(ValueError, match="num_key_value_heads"):
        nn.LlamaForCausalLM(cfg)
    assert "ch_mult=[1, 2]" in repr(nn.UNetConfig.preset("tiny"))
