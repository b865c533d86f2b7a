"""PyTorch habits (issue 50): everyday calls written as a PyTorch user writes them, with `torch`
being `tally`, each with its expected result. A call Tally cannot do must raise an error that
names what Tally offers instead (RAISES rows). The other habits files go deeper per family:
test_ops_habits.py (index and shape ops), test_layers_habits.py (layers), test_data_python.py
(datasets and the DataLoader)."""

import collections

import numpy as np
import pytest

import tally as torch
import tally.nn as nn
import tally.nn.functional as F
from tally.utils.data import DataLoader, TensorDataset

A = np.arange(1, 7, dtype=np.float32).reshape(2, 3)


def env():
    """The names the calls use, fresh for every call."""
    torch.manual_seed(0)
    return {
        "torch": torch, "nn": nn, "F": F, "np": np, "DataLoader": DataLoader,
        "TensorDataset": TensorDataset,
        "x": torch.tensor(A),                                  # [[1, 2, 3], [4, 5, 6]]
        "v": torch.tensor([3.0, -1.0, 2.0]),
        "i": torch.tensor([2, 0, 1]),
        "m": torch.tensor([[True, False, True], [False, True, False]]),
        "lin": nn.Linear(3, 2),
    }


# (call, expected): expected is a value (numbers, nested lists, tuples for shapes, a dtype, True
# for "any truthy result"), or Raises(exception, text the message must contain).
Raises = collections.namedtuple("Raises", "exc text")

CASES = [
    # ---- creation ----
    ("torch.zeros(2, 3).tolist()", [[0, 0, 0], [0, 0, 0]]),
    ("torch.zeros((2, 3)).shape", (2, 3)),
    ("torch.ones(3).tolist()", [1, 1, 1]),
    ("torch.full((2,), 7.0).tolist()", [7, 7]),
    ("torch.arange(5).tolist()", [0, 1, 2, 3, 4]),
    ("torch.arange(1, 7, 2).tolist()", [1, 3, 5]),
    ("torch.arange(5).dtype", torch.int64),
    ("torch.arange(0.0, 1.0, 0.25).tolist()", [0, 0.25, 0.5, 0.75]),
    ("torch.tensor([1, 2]).dtype", torch.int64),
    ("torch.tensor([1.0, 2.0]).dtype", torch.float32),
    ("torch.tensor([True]).dtype", torch.bool),
    ("torch.tensor(np.zeros(2)).dtype", torch.float64),
    ("torch.from_numpy(np.ones((2, 2), np.float32)).sum().item()", 4.0),
    ("torch.as_tensor([1, 2, 3]).tolist()", [1, 2, 3]),
    ("torch.zeros_like(x).shape", (2, 3)),
    ("torch.ones_like(x).sum().item()", 6.0),
    ("torch.empty(4, 2).shape", (4, 2)),
    ("torch.randn(3, 4).shape", (3, 4)),
    ("torch.rand(100).max().item() < 1.0", True),
    ("torch.randint(0, 5, (10,)).max().item() < 5", True),
    ("sorted(torch.randperm(5).tolist())", [0, 1, 2, 3, 4]),
    ("torch.tensor([[1, 2], [3, 4]]).shape", (2, 2)),
    ("torch.is_tensor(x)", True),
    # ---- dtype and device ----
    ("x.dtype", torch.float32),
    ("x.float().dtype", torch.float32),
    ("x.double().dtype", torch.float64),
    ("x.long().tolist()", [[1, 2, 3], [4, 5, 6]]),
    ("x.half().dtype", torch.float16),
    ("x.to(torch.float64).dtype", torch.float64),
    ("x.int().dtype", torch.int32),
    ("x.bool().dtype", torch.bool),
    ("str(x.device)", "cpu"),
    ("x.to('cpu').device.type", "cpu"),
    ("x.cpu().shape", (2, 3)),
    ("x.is_cuda", False),
    ("x.numpy().tolist()", A.tolist()),
    ("x.element_size()", 4),
    # ---- shape ----
    ("x.shape", (2, 3)),
    ("x.size()", (2, 3)),
    ("x.size(1)", 3),
    ("x.dim()", 2),
    ("x.ndim", 2),
    ("x.numel()", 6),
    ("x.view(3, 2).shape", (3, 2)),
    ("x.view(-1).shape", (6,)),
    ("x.reshape(3, -1).shape", (3, 2)),
    ("x.t().tolist()", [[1, 4], [2, 5], [3, 6]]),
    ("x.T.shape", (3, 2)),
    ("x.transpose(0, 1).shape", (3, 2)),
    ("x.permute(1, 0).shape", (3, 2)),
    ("x.unsqueeze(0).shape", (1, 2, 3)),
    ("x.unsqueeze(0).squeeze(0).shape", (2, 3)),
    ("x.flatten().tolist()", [1, 2, 3, 4, 5, 6]),
    ("x.contiguous().is_contiguous()", True),
    ("x.t().is_contiguous()", False),
    ("x.expand(4, 2, 3).shape", (4, 2, 3)),
    ("x.repeat(2, 1).shape", (4, 3)),
    ("torch.cat([x, x]).shape", (4, 3)),
    ("torch.cat([x, x], dim=1).shape", (2, 6)),
    ("torch.stack([x, x]).shape", (2, 2, 3)),
    ("[c.shape for c in x.chunk(3, dim=1)]", [(2, 1), (2, 1), (2, 1)]),
    ("[s.shape for s in torch.split(x, 2, dim=1)]", [(2, 2), (2, 1)]),
    ("x.narrow(1, 1, 2).tolist()", [[2, 3], [5, 6]]),
    ("x.flip(0).tolist()", [[4, 5, 6], [1, 2, 3]]),
    ("x.fliplr().tolist()", [[3, 2, 1], [6, 5, 4]]),
    ("x.roll(1, 1).tolist()", [[3, 1, 2], [6, 4, 5]]),
    ("torch.tril(torch.ones(2, 2)).tolist()", [[1, 0], [1, 1]]),
    ("torch.triu(torch.ones(2, 2), 1).tolist()", [[0, 1], [0, 0]]),
    # ---- indexing ----
    ("x[0].tolist()", [1, 2, 3]),
    ("x[:, 1].tolist()", [2, 5]),
    ("x[-1, -1].item()", 6.0),
    ("x[..., 0].tolist()", [1, 4]),
    ("x[:, None].shape", (2, 1, 3)),
    ("x[x > 3].tolist()", [4, 5, 6]),
    ("x[m].tolist()", [1, 3, 5]),
    ("x[1, 0:2].tolist()", [4, 5]),
    ("v[i].tolist()", [2, 3, -1]),
    ("x.index_select(1, i).tolist()", [[3, 1, 2], [6, 4, 5]]),
    ("x.gather(1, torch.tensor([[0], [2]])).tolist()", [[1], [6]]),
    ("x.masked_fill(m, 0.0).tolist()", [[0, 2, 0], [4, 0, 6]]),
    ("torch.where(x > 3, x, torch.zeros_like(x)).tolist()", [[0, 0, 0], [4, 5, 6]]),
    ("v.sort().values.tolist()", [-1, 2, 3]),
    ("v.sort(descending=True).indices.tolist()", [0, 2, 1]),
    ("v.argsort().tolist()", [1, 2, 0]),
    ("v.topk(2).values.tolist()", [3, 2]),
    ("x.cumsum(1).tolist()", [[1, 3, 6], [4, 9, 15]]),
    ("x.cumprod(1).tolist()", [[1, 2, 6], [4, 20, 120]]),
    ("x.index_fill(1, torch.tensor([0]), torch.tensor(-1.0)).tolist()", [[-1, 2, 3], [-1, 5, 6]]),
    ("torch.nonzero(x > 4).tolist()", [[1, 1], [1, 2]]),
    ("(x > 4).nonzero(as_tuple=True)[1].tolist()", [1, 2]),
    # ---- arithmetic ----
    ("(x + 1).tolist()", [[2, 3, 4], [5, 6, 7]]),
    ("(x * x).sum().item()", 91.0),
    ("(x - x).abs().sum().item()", 0.0),
    ("(x / 2).tolist()", [[0.5, 1, 1.5], [2, 2.5, 3]]),
    ("(2 ** torch.tensor([1.0, 2.0])).tolist()", [2, 4]),
    ("(x ** 2).tolist()", [[1, 4, 9], [16, 25, 36]]),
    ("(-v).tolist()", [-3, 1, -2]),
    ("x.add(1).tolist()", [[2, 3, 4], [5, 6, 7]]),
    ("x.add(x, alpha=2).tolist()", [[3, 6, 9], [12, 15, 18]]),
    ("x.mul(2).sum().item()", 42.0),
    ("x.sub(1).min().item()", 0.0),
    ("x.div(2).max().item()", 3.0),
    ("x.pow(2).sum().item()", 91.0),
    ("(x @ x.t()).tolist()", [[14, 32], [32, 77]]),
    ("torch.matmul(x, x.t()).shape", (2, 2)),
    ("torch.mm(x, x.t()).shape", (2, 2)),
    ("torch.bmm(x[None], x.t()[None]).shape", (1, 2, 2)),
    ("torch.einsum('ij,kj->ik', x, x).tolist()", [[14, 32], [32, 77]]),
    ("v.abs().tolist()", [3, 1, 2]),
    ("v.clamp(min=0).tolist()", [3, 0, 2]),
    ("v.clamp(-0.5, 2.5).tolist()", [2.5, -0.5, 2]),
    ("torch.maximum(v, torch.zeros(3)).tolist()", [3, 0, 2]),
    ("torch.exp(torch.zeros(1)).item()", 1.0),
    ("torch.log(torch.ones(1)).item()", 0.0),
    ("torch.sqrt(torch.tensor([4.0])).item()", 2.0),
    ("torch.sin(torch.zeros(1)).item()", 0.0),
    ("torch.cos(torch.zeros(1)).item()", 1.0),
    ("torch.tanh(torch.zeros(1)).item()", 0.0),
    ("torch.sigmoid(torch.zeros(1)).item()", 0.5),
    ("torch.relu(v).tolist()", [3, 0, 2]),
    ("(x > 3).tolist()", [[False, False, False], [True, True, True]]),
    ("(x == 2).sum().item()", 1),
    ("x.eq(x).all().item()", True),
    ("(x > 5).any(dim=1).tolist()", [False, True]),
    ("torch.zeros(0).all().item(), torch.zeros(0).any().item()", (True, False)),
    ("torch.zeros(0, 2).all(0).tolist()", [True, True]),
    ("torch.flip(torch.tensor(2.0), [0]).item()", 2.0),
    ("torch.isfinite(torch.tensor([1.0, float('inf')])).tolist()", [True, False]),
    ("torch.allclose(x, x + 1e-7)", True),
    ("torch.outer(v, v).shape", (3, 3)),
    ("x.new_zeros(2).tolist()", [0.0, 0.0]),
    ("F.normalize(torch.tensor([[3.0, 4.0]]), dim=1).tolist()", [[0.6, 0.8]]),
    # ---- reductions ----
    ("x.sum().item()", 21.0),
    ("x.sum(0).tolist()", [5, 7, 9]),
    ("x.sum(dim=1, keepdim=True).shape", (2, 1)),
    ("x.mean().item()", 3.5),
    ("x.mean(1).tolist()", [2, 5]),
    ("x.max().item()", 6.0),
    ("x.max(dim=1).values.tolist()", [3, 6]),
    ("x.max(1).indices.tolist()", [2, 2]),
    ("x.min().item()", 1.0),
    ("x.argmax().item()", 5),
    ("torch.max(x, 1).values.tolist()", [3, 6]),
    ("torch.min(x).item()", 1.0),
    ("x.argmax(dim=0).tolist()", [1, 1, 1]),
    ("torch.amax(x, 1).tolist()", [3, 6]),
    ("round(x.std().item(), 4)", round(float(np.std(A, ddof=1)), 4)),
    ("round(x.var(1).tolist()[0], 4)", 1.0),
    ("round(x.norm().item(), 4)", round(float(np.linalg.norm(A)), 4)),
    ("torch.logsumexp(torch.zeros(2), 0).item() == pytest.approx(np.log(2))", True),
    ("x.softmax(-1).sum(-1).tolist() == pytest.approx([1, 1])", True),
    # ---- autograd ----
    ("torch.ones(2, requires_grad=True).requires_grad", True),
    ("torch.ones(2).requires_grad_().is_leaf", True),
    ("(lambda w: ((w * w).sum().backward(), w.grad.tolist())[1])"
     "(torch.tensor([1.0, 2.0], requires_grad=True))", [2, 4]),
    ("(lambda w: ((w * 3).sum().backward(), w.grad.tolist())[1])"
     "(torch.ones(2, requires_grad=True))", [3, 3]),
    ("torch.ones(2, requires_grad=True).detach().requires_grad", False),
    ("torch.no_grad()(lambda: (torch.ones(1, requires_grad=True) * 2).requires_grad)()", False),
    ("torch.is_grad_enabled()", True),
    # ---- nn ----
    ("lin(torch.ones(4, 3)).shape", (4, 2)),
    ("lin.weight.shape", (2, 3)),
    ("lin.bias.shape", (2,)),
    ("sum(p.numel() for p in lin.parameters())", 8),
    ("[n for n, _ in lin.named_parameters()]", ["weight", "bias"]),
    ("list(lin.state_dict().keys())", ["weight", "bias"]),
    ("nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))(x).shape", (2, 1)),
    ("nn.Conv2d(3, 8, 3, padding=1)(torch.randn(1, 3, 8, 8)).shape", (1, 8, 8, 8)),
    ("nn.MaxPool2d(2)(torch.randn(1, 1, 4, 4)).shape", (1, 1, 2, 2)),
    ("nn.AvgPool2d(2)(torch.ones(1, 1, 4, 4)).sum().item()", 4.0),
    ("nn.BatchNorm2d(3)(torch.randn(2, 3, 4, 4)).shape", (2, 3, 4, 4)),
    ("nn.LayerNorm(3)(x).mean(-1).abs().max().item() < 1e-5", True),
    ("nn.GroupNorm(1, 3)(torch.randn(2, 3, 4)).shape", (2, 3, 4)),
    ("nn.Embedding(10, 4)(torch.tensor([1, 2])).shape", (2, 4)),
    ("nn.Dropout(0.5).eval()(x).tolist()", A.tolist()),
    ("nn.Flatten()(torch.ones(2, 3, 4)).shape", (2, 12)),
    ("nn.Softmax(dim=1)(x).sum(1).tolist() == pytest.approx([1, 1])", True),
    ("nn.GELU()(torch.zeros(1)).item()", 0.0),
    ("nn.SiLU()(torch.zeros(1)).item()", 0.0),
    ("nn.Tanh()(torch.zeros(1)).item()", 0.0),
    ("nn.Sigmoid()(torch.zeros(1)).item()", 0.5),
    ("nn.Upsample(scale_factor=2)(torch.ones(1, 1, 2, 2)).shape", (1, 1, 4, 4)),
    ("nn.ConvTranspose2d(2, 1, 2, stride=2)(torch.ones(1, 2, 3, 3)).shape", (1, 1, 6, 6)),
    ("nn.ModuleList([nn.Linear(2, 2)] * 2).__len__()", 2),
    ("nn.MSELoss()(torch.zeros(2), torch.ones(2)).item()", 1.0),
    ("nn.L1Loss()(torch.zeros(2), torch.ones(2)).item()", 1.0),
    ("nn.CrossEntropyLoss()(torch.zeros(2, 4), torch.tensor([0, 1])).item() "
     "== pytest.approx(np.log(4))", True),
    ("F.mse_loss(x, x).item()", 0.0),
    ("F.cross_entropy(torch.zeros(1, 2), torch.tensor([1])).item() == pytest.approx(np.log(2))",
     True),
    ("F.relu(v).tolist()", [3, 0, 2]),
    ("F.softmax(torch.zeros(2), dim=0).tolist()", [0.5, 0.5]),
    ("F.one_hot(torch.tensor([0, 2]), 3).tolist()", [[1, 0, 0], [0, 0, 1]]),
    ("F.pad(torch.ones(1, 2), (1, 1)).tolist()", [[0, 1, 1, 0]]),
    ("F.interpolate(torch.ones(1, 1, 2, 2), scale_factor=2).shape", (1, 1, 4, 4)),
    ("F.interpolate(torch.ones(1, 1, 3), size=5, mode='linear').shape", (1, 1, 5)),
    ("F.interpolate(torch.ones(1, 1, 2, 2, 2), scale_factor=2, mode='trilinear').shape",
     (1, 1, 4, 4, 4)),
    ("lin.train().training", True),
    ("lin.eval().training", False),
    ("lin.zero_grad()", None),
    ("lin.apply(lambda m: None) is lin", True),
    ("(nn.init.zeros_(lin.weight), lin.weight.sum().item())[1]", 0.0),
    # ---- optim ----
    ("type(torch.optim.SGD(lin.parameters(), lr=0.1)).__name__", "SGD"),
    ("torch.optim.Adam(lin.parameters(), lr=1e-3).param_groups[0]['lr']", 1e-3),
    ("torch.optim.AdamW(lin.parameters()).param_groups[0]['weight_decay']", 0.01),
    ("(lambda o: (lin(x).sum().backward(), o.step(), o.zero_grad(), lin.weight.grad)[3])"
     "(torch.optim.SGD(lin.parameters(), lr=0.1))", None),
    ("nn.utils.clip_grad_norm_(lin.parameters(), 1.0) is not None", True),
    # ---- data ----
    ("len(TensorDataset(x, torch.tensor([0, 1])))", 2),
    ("[b[1].tolist() for b in DataLoader(TensorDataset(x, torch.tensor([0, 1])), batch_size=1)]",
     [[0], [1]]),
    ("len(DataLoader(TensorDataset(torch.arange(10)), batch_size=4, drop_last=True))", 2),
    # ---- misc ----
    ("torch.cuda.is_available() in (True, False)", True),
    ("torch.manual_seed(1) is None or True", True),
    ("x.clone().zero_().sum().item()", 0.0),
    ("x.clone().fill_(2).sum().item()", 12.0),
    ("x.item()", Raises(ValueError, "cannot be converted to a scalar")),
]


def normalise(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(normalise(v) for v in value)
    return value


def same(got, expected):
    if isinstance(expected, list):
        try:
            g = np.asarray(got, dtype=np.float64)
            e = np.asarray(expected, dtype=np.float64)
        except (TypeError, ValueError):
            return got == expected
        return g.shape == e.shape and np.allclose(g, e, rtol=1e-6, atol=1e-6)
    if isinstance(expected, float) and isinstance(got, (int, float)):
        return abs(got - expected) <= 1e-6 * max(1.0, abs(expected))
    return got == expected


@pytest.mark.parametrize("call,expected", CASES, ids=[c for c, _ in CASES])
def test_habit(call, expected):
    names = env()
    names["pytest"] = pytest
    if isinstance(expected, Raises):
        with pytest.raises(expected.exc) as info:
            eval(call, names)
        assert expected.text in str(info.value), str(info.value)
        return
    got = normalise(eval(call, names))
    assert same(got, expected), (got, expected)


def test_at_least_150_habits():
    assert len(CASES) >= 150, len(CASES)
