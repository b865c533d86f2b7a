"""torch.utils.data over datasets written in Python: Dataset, TensorDataset, the samplers,
default_collate / default_convert and the DataLoader, with PyTorch's arguments and behaviour.

A DataLoader over one of Tally's own datasets (SyntheticImages, MNIST, CIFAR10, ...) without a
collate_fn, sampler or generator keeps the C++ loader (a worker thread assembles the batches
ahead, `seed=`, `device=` and `prefetch=` as before); any other dataset is read in the calling
thread: indices from the sampler, `dataset[i]` for each, `collate_fn` over the list. Batches are
allocated under the memory category `input`. num_workers > 0 is accepted and loads in the
calling thread too (the batches are the same; Tally has no worker processes).
"""

import collections.abc
import copy
import re


from . import _C

_NativeDataset = _C.utils.data.Dataset
_NativeDataLoader = _C.utils.data.DataLoader


class _DatasetMeta(type):
    # Tally's C++ datasets (SyntheticImages, MNIST, ...) are Datasets too.
    def __instancecheck__(cls, obj):
        return type.__instancecheck__(cls, obj) or (
            cls is Dataset and isinstance(obj, _NativeDataset))


class Dataset(metaclass=_DatasetMeta):
    """torch.utils.data.Dataset: subclass it with __getitem__ (and __len__)."""

    def __getitem__(self, index):
        raise NotImplementedError("Subclasses of Dataset should implement __getitem__.")

    def __add__(self, other):
        return ConcatDataset([self, other])


class TensorDataset(Dataset):
    """torch.utils.data.TensorDataset: example i is (t[i] for t in tensors)."""

    def __init__(self, *tensors):
        if not tensors:
            raise ValueError("TensorDataset: needs at least one tensor")
        n = tensors[0].shape[0] if len(tensors[0].shape) > 0 else None
        if any(len(t.shape) == 0 or t.shape[0] != n for t in tensors):
            raise ValueError("Size mismatch between tensors: TensorDataset needs every tensor's "
                             "first dimension equal, got shapes "
                             f"{[tuple(t.shape) for t in tensors]}")
        self.tensors = tensors

    def __getitem__(self, index):
        return tuple(t[index] for t in self.tensors)

    def __len__(self):
        return self.tensors[0].shape[0]


class ConcatDataset(Dataset):
    """torch.utils.data.ConcatDataset: the datasets one after the other."""

    def __init__(self, datasets):
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("datasets should not be an empty iterable")
        self.cumulative_sizes = []
        total = 0
        for d in self.datasets:
            total += len(d)
            self.cumulative_sizes.append(total)

    def __len__(self):
        return self.cumulative_sizes[-1] if self.cumulative_sizes else 0

    def __getitem__(self, idx):
        if idx < 0:
            if -idx > len(self):
                raise ValueError("absolute value of index should not exceed dataset length")
            idx += len(self)
        for i, end in enumerate(self.cumulative_sizes):
            if idx < end:
                start = self.cumulative_sizes[i - 1] if i > 0 else 0
                return self.datasets[i][idx - start]
        raise IndexError(f"index {idx} out of range for a ConcatDataset of {len(self)}")


class Subset(Dataset):
    """torch.utils.data.Subset: the dataset at `indices`."""

    def __init__(self, dataset, indices):
        self.dataset = dataset
        self.indices = indices

    def __getitem__(self, idx):
        return self.dataset[self.indices[idx]]

    def __len__(self):
        return len(self.indices)


# ---- samplers ----
class Sampler:
    """torch.utils.data.Sampler: iterates dataset indices."""

    def __init__(self, data_source=None):
        pass

    def __iter__(self):
        raise NotImplementedError("Subclasses of Sampler should implement __iter__.")


class SequentialSampler(Sampler):
    def __init__(self, data_source):
        self.data_source = data_source

    def __iter__(self):
        return iter(range(len(self.data_source)))

    def __len__(self):
        return len(self.data_source)


def _fresh_seed():
    # A seed drawn from the default generator (tally.manual_seed makes it reproducible), as
    # PyTorch's RandomSampler does without a generator.
    return int(_C._randint_generator(0, 2**62, 1, None).tolist()[0])


def _require_bool(name, value, error):
    # PyTorch's samplers' messages (RandomSampler raises TypeError, BatchSampler ValueError).
    if not isinstance(value, bool):
        raise error(f"{name} should be a boolean value, but got {name}={value}")


def _require_positive_int(name, value, bool_ok=False):
    if (isinstance(value, bool) and not bool_ok) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} should be a positive integer value, but got {name}={value}")


class RandomSampler(Sampler):
    """torch.utils.data.RandomSampler: a new permutation each epoch from `generator` (without
    one: from a seed drawn from the default generator at each epoch)."""

    def __init__(self, data_source, replacement=False, num_samples=None, generator=None):
        _require_bool("replacement", replacement, TypeError)
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        _require_positive_int("num_samples", self.num_samples, bool_ok=True)

    @property
    def num_samples(self):
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self):  # lazy: a long epoch is drawn as it is read
        n = len(self.data_source)
        gen = self.generator
        if gen is None:
            gen = _C.Generator().manual_seed(_fresh_seed())
        if self.replacement:  # PyTorch's chunks of 32 draws
            for start in range(0, self.num_samples, 32):
                k = min(32, self.num_samples - start)
                yield from (int(i) for i in _C._randint_generator(0, n, k, gen).tolist())
            return
        for _ in range(self.num_samples // n):
            yield from (int(i) for i in _C.randperm(n, generator=gen).tolist())
        rest = self.num_samples % n
        if rest:
            yield from (int(i) for i in _C.randperm(n, generator=gen).tolist()[:rest])

    def __len__(self):
        return self.num_samples


class BatchSampler(Sampler):
    """torch.utils.data.BatchSampler: lists of batch_size indices from `sampler`."""

    def __init__(self, sampler, batch_size, drop_last):
        _require_positive_int("batch_size", batch_size)
        _require_bool("drop_last", drop_last, ValueError)
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self):
        batch = []
        for idx in self.sampler:
            batch.append(idx)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self):
        if self.drop_last:
            return len(self.sampler) // self.batch_size
        return (len(self.sampler) + self.batch_size - 1) // self.batch_size


# ---- collate ----
_np_str_obj = re.compile(r"[SaUO]")
_collate_err = ("default_collate: batch must contain tensors, numpy arrays, numbers, dicts or "
                "lists; found {}")


def _np():
    # numpy only where a batch holds numpy arrays: `import tally` works without it.
    import numpy
    return numpy


def _as_tensor(array):
    return _C.tensor(_np().ascontiguousarray(array))


def _rebuild_mapping(elem, values):
    # `values` (a dict) in elem's mapping type where it can be rebuilt, else a dict (PyTorch's).
    try:
        if isinstance(elem, collections.abc.MutableMapping):
            clone = copy.copy(elem)
            clone.update(values)
            return clone
        return type(elem)(values)
    except TypeError:
        return values


def _rebuild_sequence(elem, items):
    # `items` (a list) in elem's sequence type where it can be rebuilt, else the list.
    try:
        if isinstance(elem, collections.abc.MutableSequence):
            clone = copy.copy(elem)
            for i, item in enumerate(items):
                clone[i] = item
            return clone
        return type(elem)(items)
    except TypeError:
        return items


def default_collate(batch):
    """torch.utils.data.default_collate: tensors and numpy arrays stacked along a new first
    dimension, Python floats to float64, ints to int64 and bools to bool tensors, strings kept
    as a list; dicts, namedtuples, tuples and lists collated field by field (a tuple gives a
    list, as in PyTorch)."""
    elem = batch[0]
    elem_type = type(elem)
    if isinstance(elem, _C.Tensor):
        return _C.stack(list(batch), 0)
    if elem_type.__module__ == "numpy" and elem_type.__name__ not in ("str_", "string_"):
        if elem_type.__name__ in ("ndarray", "memmap"):
            if _np_str_obj.search(elem.dtype.str) is not None:
                raise TypeError(_collate_err.format(elem.dtype))
            shapes = {tuple(b.shape) for b in batch}
            if len(shapes) != 1:
                raise RuntimeError(f"stack expects each tensor to be equal size, but got "
                                   f"{sorted(shapes)}")
            return _as_tensor(_np().stack(batch))
        if elem.shape == ():  # numpy scalars
            return _as_tensor(_np().array(batch))
    if isinstance(elem, float):
        return _C.tensor(list(batch), dtype=_C.float64)
    if isinstance(elem, int):  # bool too: a bool tensor
        return _C.tensor(list(batch))
    if isinstance(elem, (str, bytes)):
        return batch
    if isinstance(elem, collections.abc.Mapping):
        return _rebuild_mapping(elem, {key: default_collate([d[key] for d in batch])
                                       for key in elem})
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # namedtuple
        return elem_type(*(default_collate(samples) for samples in zip(*batch)))
    if isinstance(elem, collections.abc.Sequence):
        it = iter(batch)
        elem_size = len(next(it))
        if not all(len(e) == elem_size for e in it):
            raise RuntimeError("each element in list of batch should be of equal size")
        transposed = list(zip(*batch))
        collated = [default_collate(samples) for samples in transposed]
        return collated if isinstance(elem, tuple) else _rebuild_sequence(elem, collated)
    raise TypeError(_collate_err.format(elem_type))


def default_convert(data):
    """torch.utils.data.default_convert: numpy arrays (and numpy scalars) to tensors, recursing
    into dicts, namedtuples, tuples and lists; everything else unchanged (the collate of
    batch_size=None)."""
    elem_type = type(data)
    if isinstance(data, _C.Tensor):
        return data
    if elem_type.__module__ == "numpy" and elem_type.__name__ not in ("str_", "string_"):
        if elem_type.__name__ == "ndarray" and _np_str_obj.search(data.dtype.str) is not None:
            return data
        return _as_tensor(data)
    if isinstance(data, collections.abc.Mapping):
        return _rebuild_mapping(data, {key: default_convert(data[key]) for key in data})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return elem_type(*(default_convert(d) for d in data))
    if isinstance(data, tuple):
        return [default_convert(d) for d in data]
    if isinstance(data, collections.abc.Sequence) and not isinstance(data, (str, bytes)):
        return _rebuild_sequence(data, [default_convert(d) for d in data])
    return data


# ---- the loader ----
class DataLoader:
    """torch.utils.data.DataLoader over any map-style dataset (__len__ and __getitem__).

    DataLoader(dataset, batch_size=1, shuffle=False, sampler=None, batch_sampler=None,
    num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, ..., generator=None).
    Tally's own datasets keep the C++ loader when no collate_fn, sampler or generator is given
    (with its extra arguments seed=, device=, prefetch=)."""

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=None, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True, seed=None, device=None, prefetch=None):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError("num_workers option should be non-negative; use num_workers=0 to "
                             "disable multiprocessing.")
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        self.dataset = dataset
        self.num_workers = num_workers
        self.timeout = timeout
        self.prefetch_factor = prefetch_factor
        self.drop_last = drop_last
        self.generator = generator
        self._native = None
        if (isinstance(dataset, _NativeDataset) and collate_fn is None and sampler is None and
                batch_sampler is None and generator is None and batch_size is not None):
            kw = dict(batch_size=batch_size, shuffle=bool(shuffle), drop_last=drop_last)
            if seed is not None:
                kw["seed"] = seed
            if device is not None:
                kw["device"] = device
            if pin_memory is not None:
                kw["pin_memory"] = pin_memory
            if prefetch is not None:
                kw["prefetch"] = prefetch
            self._native = _NativeDataLoader(dataset, **kw)
            self.batch_size = batch_size
            self.collate_fn = None
            self.sampler = self.batch_sampler = None
            return
        if seed is not None or device is not None or prefetch is not None:
            raise ValueError("DataLoader: seed=, device= and prefetch= are the C++ loader's, for "
                             "Tally's own datasets without collate_fn, sampler or generator; "
                             "shuffle a Python dataset with generator=tally.Generator()."
                             "manual_seed(seed) and move batches with .to(device)")
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(f"DataLoader: the dataset ({type(dataset).__name__}) must be "
                            "map-style, with __len__ and __getitem__ (iterable-style datasets "
                            "are not supported)")
        if sampler is not None and shuffle:
            raise ValueError(f"sampler option is mutually exclusive with shuffle, got "
                             f"shuffle={shuffle}")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, "
                                 "shuffle, sampler, and drop_last")
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually "
                             "exclusive with drop_last")
        if sampler is None:
            sampler = (RandomSampler(dataset, generator=generator) if shuffle
                       else SequentialSampler(dataset))
        if batch_size is not None and batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.pin_memory = bool(pin_memory)
        if collate_fn is None:
            collate_fn = default_collate if batch_sampler is not None else default_convert
        self.collate_fn = collate_fn

    def __len__(self):
        if self._native is not None:
            return len(self._native)
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        return len(self.sampler)

    def __iter__(self):
        if self._native is not None:
            return iter(self._native)
        return self._iterate()

    def _fetch(self, indices):
        with _C.memory.context(category="input"):
            if self.batch_sampler is None:
                return self.collate_fn(self.dataset[indices])
            return self.collate_fn([self.dataset[i] for i in indices])

    def _iterate(self):
        for indices in (self.batch_sampler if self.batch_sampler is not None else self.sampler):
            yield self._fetch(indices)

    def __getattr__(self, name):
        # The C++ loader's extras (epoch, epoch_order, pinned, stop) for Tally's datasets.
        native = self.__dict__.get("_native")
        if native is not None and not name.startswith("__"):
            return getattr(native, name)
        raise AttributeError(f"'DataLoader' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        native = self.__dict__.get("_native")
        if native is not None and name == "epoch":
            native.epoch = value
        else:
            object.__setattr__(self, name, value)

