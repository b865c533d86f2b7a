"""Tally from Python: tensors (numpy in and out), autograd, nn modules (ResNet, GPT),
optimizers and learning-rate schedulers, autocast and GradScaler, checkpointing, activation
offload, step-in-backward, datasets and the DataLoader, the memory API and estimator, the
profiler and the A/B runner. See docs/python.md.

    import numpy as np, tally
    x = tally.tensor(np.random.randn(8, 4))             # a copy in Tally's allocator
    model = tally.nn.Sequential(tally.nn.Linear(4, 16), tally.nn.ReLU(), tally.nn.Linear(16, 3))
    loss = tally.nn.functional.cross_entropy(model(x.float()), tally.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
    loss.backward()
    print(tally.memory.memory_summary())
"""

import sys as _sys

from . import _C
from ._C import *  # noqa: F401,F403  Tensor, dtype, device, the factories and ops
from ._C import (OutOfMemoryError, Tensor, UnpickleError, autograd, device, dtype,  # noqa: F401
                 is_grad_enabled)
from ._C import amp, cuda, memory, nn, optim, profiler, utils  # noqa: F401

__version__ = _C.__version__

for _name, _mod in (("nn", nn), ("nn.functional", nn.functional), ("nn.init", nn.init),
                    ("optim", optim),
                    ("amp", amp), ("memory", memory), ("profiler", profiler), ("cuda", cuda),
                    ("autograd", autograd), ("utils", utils),
                    ("utils.checkpoint", utils.checkpoint), ("utils.data", utils.data),
                    ("optim.lr_scheduler", optim.lr_scheduler),
                    ("autograd.graph", autograd.graph), ("nn.lora", nn.lora)):
    _sys.modules[__name__ + "." + _name] = _mod

from . import _data  # noqa: E402

# torch.utils.data over Python datasets (python/tally/_data.py); Tally's C++ datasets stay.
for _name in ("Dataset", "TensorDataset", "ConcatDataset", "Subset", "Sampler",
              "SequentialSampler", "RandomSampler", "BatchSampler", "default_collate",
              "default_convert", "DataLoader"):
    setattr(utils.data, _name, getattr(_data, _name))

from ._grad import enable_grad, no_grad, set_grad_enabled  # noqa: E402,F401
from ._nn import Parameter  # noqa: E402,F401
from . import ab  # noqa: E402,F401
from ._torch import (backends, get_float32_matmul_precision, inference_mode,  # noqa: E402,F401
                     is_tensor, load, save, set_float32_matmul_precision)
from ._cuda import graph as _graph  # noqa: E402

cuda.graph = _graph

# Allocations name the Python line outside this package that asked for them (when history is
# recorded or the profiler or leak detector watches; python/call_sites.cpp).
_C._enable_python_call_sites(__import__("os").path.dirname(__file__))

autocast = amp.autocast
GradScaler = amp.GradScaler
memory_summary = memory.memory_summary
memory_stats = memory.memory_stats
memory_allocated = memory.memory_allocated
max_memory_allocated = memory.max_memory_allocated
memory_reserved = memory.memory_reserved
record_memory_history = memory.record_memory_history
dump_snapshot = memory.dump_snapshot
estimate = memory.estimate
