"""tally.utils.data over datasets written in Python: TensorDataset, Dataset subclasses, the
DataLoader's batching, shuffling with a seeded generator, drop_last, collate_fn, samplers and
default_collate, each checked against what PyTorch gives on the same small example."""

import collections

import numpy as np
import pytest

import tally
from tally.utils.data import (BatchSampler, ConcatDataset, DataLoader, Dataset, RandomSampler,
                              SequentialSampler, Subset, SyntheticImages, TensorDataset,
                              default_collate, default_convert)


def ints(t):
    return [int(v) for v in t.tolist()]


def test_tensor_dataset_indexes_every_tensor():
    x = tally.tensor(np.arange(12, dtype=np.float32).reshape(6, 2))
    y = tally.tensor([0, 1, 0, 1, 0, 1])
    ds = TensorDataset(x, y)
    assert len(ds) == 6
    xi, yi = ds[4]
    assert xi.tolist() == [8.0, 9.0] and int(yi.item()) == 0
    assert isinstance(ds, Dataset)
    with pytest.raises(ValueError, match="Size mismatch between tensors"):
        TensorDataset(x, tally.tensor([0, 1]))


def test_loader_batches_a_tensor_dataset_like_pytorch():
    x = tally.tensor(np.arange(10, dtype=np.float32).reshape(5, 2))
    y = tally.tensor([0, 1, 2, 3, 4])
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    assert len(loader) == 3
    batches = list(loader)
    # PyTorch: a list [x_batch, y_batch] per batch (a tuple sample collates to a list).
    assert isinstance(batches[0], list) and len(batches[0]) == 2
    assert batches[0][0].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert [ints(b[1]) for b in batches] == [[0, 1], [2, 3], [4]]
    dropped = DataLoader(TensorDataset(x, y), batch_size=2, drop_last=True)
    assert len(dropped) == 2 and [ints(b[1]) for b in dropped] == [[0, 1], [2, 3]]
    # batch_size larger than the dataset: one short batch, none with drop_last.
    assert len(list(DataLoader(TensorDataset(y), batch_size=8))) == 1
    assert list(DataLoader(TensorDataset(y), batch_size=8, drop_last=True)) == []


class Squares(Dataset):
    """A map-style dataset written in Python: dict samples of numpy arrays and numbers."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.n:
            raise IndexError(i)
        return {"x": np.full((2,), i, dtype=np.float32), "y": i * i, "name": f"s{i}"}


def test_loader_over_a_python_dataset_collates_dicts():
    batches = list(DataLoader(Squares(5), batch_size=2))
    assert len(batches) == 3
    b = batches[1]
    assert set(b) == {"x", "y", "name"}
    assert b["x"].dtype == tally.float32 and b["x"].tolist() == [[2.0, 2.0], [3.0, 3.0]]
    assert b["y"].dtype == tally.int64 and ints(b["y"]) == [4, 9]
    assert b["name"] == ["s2", "s3"]


def test_default_collate_matches_pytorch():
    # Python floats: float64; ints: int64; bools: bool; strings: the list.
    f = default_collate([1.5, 2.5])
    assert f.dtype == tally.float64 and f.tolist() == [1.5, 2.5]
    i = default_collate([1, 2, 3])
    assert i.dtype == tally.int64 and ints(i) == [1, 2, 3]
    assert default_collate([True, False]).dtype == tally.bool
    assert default_collate(["a", "b"]) == ["a", "b"]
    # numpy scalars and arrays keep their dtype.
    assert default_collate([np.float32(1), np.float32(2)]).dtype == tally.float32
    a = default_collate([np.zeros((2, 3)), np.ones((2, 3))])
    assert a.dtype == tally.float64 and tuple(a.shape) == (2, 2, 3)
    # Tally tensors are stacked.
    t = default_collate([tally.tensor([1.0, 2.0]), tally.tensor([3.0, 4.0])])
    assert t.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    # Tuples transpose into a list; lists stay lists; namedtuples keep their type.
    assert [ints(v) for v in default_collate([(1, 2), (3, 4)])] == [[1, 3], [2, 4]]
    nested = default_collate([[1, [2, 3]], [4, [5, 6]]])
    assert ints(nested[0]) == [1, 4] and [ints(v) for v in nested[1]] == [[2, 5], [3, 6]]
    Point = collections.namedtuple("Point", "x y")
    p = default_collate([Point(1, 2.0), Point(3, 4.0)])
    assert isinstance(p, Point) and ints(p.x) == [1, 3] and p.y.dtype == tally.float64
    # PyTorch's errors.
    with pytest.raises(RuntimeError, match="each element in list of batch should be of equal size"):
        default_collate([[1, 2], [3]])
    with pytest.raises(TypeError, match="default_collate: batch must contain tensors"):
        default_collate([object(), object()])
    with pytest.raises(TypeError, match="default_collate: batch must contain tensors"):
        default_collate([np.array(["a"]), np.array(["b"])])


def test_default_convert_and_batch_size_none():
    c = default_convert({"a": np.arange(3), "b": 7})
    assert isinstance(c["a"], tally.Tensor) and ints(c["a"]) == [0, 1, 2] and c["b"] == 7
    # batch_size=None: no batching, every sample converted (numpy to tensors).
    samples = list(DataLoader(Squares(3), batch_size=None))
    assert len(samples) == 3 and tuple(samples[2]["x"].shape) == (2,) and samples[2]["y"] == 4
    with pytest.raises(ValueError, match="mutually exclusive with drop_last"):
        DataLoader(Squares(3), batch_size=None, drop_last=True)


def test_shuffle_is_a_permutation_seeded_by_the_generator():
    y = tally.tensor(list(range(10)))
    ds = TensorDataset(y)

    def epoch(loader):
        return [v for (b,) in loader for v in ints(b)]

    g = tally.Generator().manual_seed(42)
    assert g.initial_seed() == 42
    loader = DataLoader(ds, batch_size=3, shuffle=True, generator=g)
    first, second = epoch(loader), epoch(loader)
    assert sorted(first) == list(range(10)) and first != list(range(10))
    assert sorted(second) == list(range(10)) and second != first  # the generator advanced
    again = DataLoader(ds, batch_size=3, shuffle=True,
                       generator=tally.Generator().manual_seed(42))
    assert epoch(again) == first
    # Without a generator the seed comes from the default generator: tally.manual_seed repeats.
    tally.manual_seed(7)
    a = epoch(DataLoader(ds, batch_size=4, shuffle=True))
    tally.manual_seed(7)
    assert epoch(DataLoader(ds, batch_size=4, shuffle=True)) == a
    # drop_last with shuffle: whole batches only.
    assert [len(ints(b)) for (b,) in DataLoader(ds, batch_size=4, shuffle=True,
                                                drop_last=True)] == [4, 4]


def test_randperm_and_random_sampler():
    g = tally.Generator().manual_seed(0)
    p = tally.randperm(6, generator=g)
    assert p.dtype == tally.int64 and sorted(ints(p)) == list(range(6))
    assert ints(tally.randperm(6, generator=tally.Generator().manual_seed(0))) == ints(p)
    assert list(tally.randperm(0).tolist()) == []
    s = RandomSampler(range(5), replacement=True, num_samples=40,
                      generator=tally.Generator().manual_seed(1))
    draws = list(s)
    assert len(draws) == 40 and set(draws) <= set(range(5)) and len(set(draws)) > 1
    assert len(list(RandomSampler(range(5), num_samples=7))) == 7
    with pytest.raises(ValueError, match="num_samples should be a positive integer"):
        RandomSampler(range(0))


def test_collate_fn_samplers_and_their_errors():
    ds = Squares(6)
    seen = []

    def collate(batch):
        seen.append(len(batch))
        return [s["y"] for s in batch]

    assert list(DataLoader(ds, batch_size=4, collate_fn=collate)) == [[0, 1, 4, 9], [16, 25]]
    assert seen == [4, 2]
    # A sampler of the user's, and a batch sampler.
    odd = DataLoader(ds, batch_size=2, sampler=[5, 3, 1], collate_fn=collate)
    assert list(odd) == [[25, 9], [1]] and len(odd) == 2
    bs = BatchSampler(SequentialSampler(ds), batch_size=4, drop_last=True)
    assert list(bs) == [[0, 1, 2, 3]] and len(bs) == 1
    assert list(DataLoader(ds, batch_sampler=bs, collate_fn=collate)) == [[0, 1, 4, 9]]
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        DataLoader(ds, sampler=[0], shuffle=True)
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive"):
        DataLoader(ds, batch_sampler=bs, batch_size=2)
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        DataLoader(ds, num_workers=-1)
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        DataLoader(ds, batch_size=0)
    # num_workers > 0 loads the same batches (in the calling thread).
    assert list(DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate)) == [
        [0, 1, 4, 9], [16, 25]]

    class NoLen:
        def __getitem__(self, i):
            return i

    with pytest.raises(TypeError, match="map-style, with __len__ and __getitem__"):
        DataLoader(NoLen())


def test_subset_concat_and_tallys_own_datasets():
    ds = Squares(4) + Squares(2)
    assert isinstance(ds, ConcatDataset) and len(ds) == 6 and ds[5]["y"] == 1 and ds[-1]["y"] == 1
    sub = Subset(Squares(5), [4, 0])
    assert [s["y"] for s in sub] == [16, 0] and len(sub) == 2
    # A C++ dataset is a Dataset, and keeps the C++ loader's arguments (seed=).
    images = SyntheticImages(6, [1, 2, 2], classes=3, seed=1)
    assert isinstance(images, Dataset)
    loader = DataLoader(images, batch_size=4, shuffle=True, seed=3)
    x, y = next(iter(loader))
    assert tuple(x.shape) == (4, 1, 2, 2) and loader.epoch_order(0) != list(range(6))
    # With a collate_fn the same dataset is read from Python.
    pairs = list(DataLoader(images, batch_size=4, collate_fn=lambda b: b))
    assert [len(p) for p in pairs] == [4, 2] and len(pairs[0][0]) == 2
    with pytest.raises(ValueError, match="generator=tally.Generator"):
        DataLoader(Squares(2), seed=3)


def test_a_training_loop_over_a_python_dataset():
    tally.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    ds = TensorDataset(tally.tensor(x), tally.tensor(y))
    model = tally.nn.Linear(4, 2)
    opt = tally.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        for xb, yb in DataLoader(ds, batch_size=16, shuffle=True,
                                 generator=tally.Generator().manual_seed(3)):
            loss = tally.nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
