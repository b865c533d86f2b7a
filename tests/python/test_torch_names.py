"""The names a PyTorch user types first exist beside Tally's own and do what PyTorch's do:
tally.cuda's availability and figures, tally.backends' switches (settable attributes that reach
tensor/precision.h), tally.nn.utils' clipping, tally.save / tally.load, tally.manual_seed,
no_grad, inference_mode, device."""
import os

import numpy as np
import pytest

import tally

HAS_GPU = tally.cuda.is_available()


def test_cuda_availability_matches_the_memory_module():
    assert tally.cuda.is_available() == tally.memory.cuda_available()
    assert tally.cuda.device_count() == (tally.memory.device_count() if HAS_GPU else 0)
    import tally.cuda.memory as cm  # the submodules import as torch's do
    assert cm.memory_allocated is tally.cuda.memory_allocated


@pytest.mark.skipif(HAS_GPU, reason="a CUDA device is present")
def test_cuda_figures_without_a_device_are_pytorchs():
    assert tally.cuda.memory_allocated() == 0
    assert tally.cuda.max_memory_allocated(0) == 0
    assert tally.cuda.memory_stats() == {}
    tally.cuda.empty_cache()
    tally.cuda.reset_peak_memory_stats()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        tally.cuda.synchronize()


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_cuda_figures_follow_an_allocation():
    tally.cuda.synchronize()
    before = tally.cuda.memory_allocated()
    x = tally.zeros(1024, 1024, device="cuda")
    assert tally.cuda.memory_allocated() - before >= 4 * 2**20
    assert tally.cuda.memory_allocated("cuda:0") == tally.memory.memory_allocated("cuda:0")
    assert tally.cuda.max_memory_allocated() >= tally.cuda.memory_allocated()
    del x
    tally.cuda.synchronize(0)


def test_backends_switches_are_settable_attributes():
    import tally.backends.cudnn  # noqa: F401  importable as torch.backends.cudnn is
    m, c = tally.backends.cuda.matmul, tally.backends.cudnn
    saved = (m.allow_tf32, c.allow_tf32, c.benchmark)
    assert m.allow_tf32 is False and c.allow_tf32 is True  # PyTorch's defaults
    try:
        m.allow_tf32 = True
        assert tally._C._backends.allow_tf32() is True
        assert tally.get_float32_matmul_precision() == "high"
        c.allow_tf32 = False
        assert tally._C._backends.cudnn_allow_tf32() is False and c.allow_tf32 is False
        c.benchmark = True
        assert tally._C._backends.cudnn_benchmark() is True
        tally.set_float32_matmul_precision("highest")
        assert m.allow_tf32 is False
        with pytest.raises(ValueError, match="set_float32_matmul_precision.*'fast'"):
            tally.set_float32_matmul_precision("fast")
        with pytest.raises(AttributeError, match="allow_tf32 is the one"):
            m.allow_fp16 = True
    finally:
        m.allow_tf32, c.allow_tf32, c.benchmark = saved
    assert tally.backends.cuda.is_built() == tally._C._built_with_cuda


def _model_with_grads():
    tally.manual_seed(0)
    model = tally.nn.Linear(4, 3)
    x = tally.tensor(np.arange(8, dtype=np.float32).reshape(2, 4))
    model(x).sum().backward()
    return model


def test_clip_grad_norm_takes_a_generator_and_clips():
    model = _model_with_grads()
    grads = [p.grad.numpy().copy() for p in model.parameters()]
    total = float(np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads)))
    norm = tally.nn.utils.clip_grad_norm_(iter(model.parameters()), max_norm=1.0)
    assert norm.item() == pytest.approx(total, rel=1e-5)
    after = float(np.sqrt(sum((p.grad.numpy().astype(np.float64) ** 2).sum()
                              for p in model.parameters())))
    assert after == pytest.approx(1.0, rel=1e-4)
    from tally.nn.utils import clip_grad_value_
    clip_grad_value_(model.parameters(), 0.01)
    assert max(np.abs(p.grad.numpy()).max() for p in model.parameters()) <= 0.01 + 1e-7


def test_clip_grad_norm_error_if_nonfinite():
    model = _model_with_grads()
    w = model.weight
    with tally.no_grad():
        w.grad.fill_(float("inf"))
    with pytest.raises(RuntimeError, match="error_if_nonfinite"):
        tally.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def test_save_and_load_a_state_dict_and_a_tensor(tmpdir_path):
    tally.manual_seed(3)
    model = tally.nn.Sequential(tally.nn.Linear(4, 8), tally.nn.ReLU(), tally.nn.Linear(8, 2))
    path = os.path.join(tmpdir_path, "model.safetensors")
    tally.save(model.state_dict(), path)
    sd = tally.load(path)
    assert set(sd) == set(model.state_dict())
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(sd[k].numpy(), v.numpy())
    tally.manual_seed(4)
    other = tally.nn.Sequential(tally.nn.Linear(4, 8), tally.nn.ReLU(), tally.nn.Linear(8, 2))
    other.load_state_dict(tally.load(path, map_location="cpu"))
    np.testing.assert_array_equal(other[0].weight.numpy(), model[0].weight.numpy())

    t = tally.randn(3, 5)
    tpath = os.path.join(tmpdir_path, "t.safetensors")
    tally.save(t, tpath)
    back = tally.load(tpath)
    assert tally.is_tensor(back) and back.shape == (3, 5)
    np.testing.assert_array_equal(back.numpy(), t.numpy())


def test_save_refuses_what_it_cannot_write(tmpdir_path):
    path = os.path.join(tmpdir_path, "x.safetensors")
    model = tally.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="state_dict"):
        tally.save(model, path)
    with pytest.raises(TypeError, match="key 'step' holds int"):
        tally.save({"w": tally.zeros(2), "step": 3}, path)
    with pytest.raises(TypeError, match="not a file object"):
        with open(path, "wb") as f:
            tally.save(tally.zeros(2), f)
    assert os.path.getsize(path) == 0  # nothing was written


def test_seed_no_grad_inference_mode_and_device():
    tally.manual_seed(7)
    a = tally.randn(4).numpy().copy()
    tally.cuda.manual_seed(7)  # one generator serves CPU and CUDA
    np.testing.assert_array_equal(tally.randn(4).numpy(), a)
    w = tally.ones(3, requires_grad=True)
    with tally.no_grad():
        assert not (w * 2).requires_grad
    with tally.inference_mode():
        assert not tally.is_grad_enabled()
    with tally.inference_mode(False):
        assert tally.is_grad_enabled()
    assert tally.is_grad_enabled()
    assert tally.device("cpu").type == "cpu"
    with tally.device("meta"):
        assert tally.nn.Linear(2, 2).weight.device.type == "meta"
