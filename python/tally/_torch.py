"""The names a PyTorch user types first, over Tally's own: tally.cuda.is_available() and the
allocator's figures (tally.cuda.memory_allocated, synchronize, ...; tally.cuda.memory's
_record_memory_history and _dump_snapshot), tally.backends (cuda.matmul.allow_tf32,
cudnn.allow_tf32, cudnn.benchmark), tally.nn.utils (clip_grad_norm_, clip_grad_value_),
tally.save / tally.load (tensors and state dicts, as safetensors files),
set_float32_matmul_precision, inference_mode and is_tensor. Tally has one default generator
for CPU and CUDA, so tally.cuda.manual_seed seeds the same one as tally.manual_seed."""

import math
import os
import sys
import types
from collections.abc import Mapping

from . import _C
from ._grad import no_grad

_pkg = __name__.rsplit(".", 1)[0]


def _register(name, module):
    sys.modules[_pkg + "." + name] = module


# ---- tally.cuda ----

def is_available():
    """Whether this build has CUDA and a GPU is present (torch.cuda.is_available)."""
    return bool(_C.memory.cuda_available())


def device_count():
    return int(_C.memory.device_count()) if is_available() else 0


def current_device():
    """Tally works on cuda:0 unless told otherwise."""
    return 0


def _cuda_device(device):
    """"cuda:N" for None, an int, "cuda", "cuda:N" or a tally.device of type cuda."""
    if device is None:
        return "cuda:0"
    if isinstance(device, int):
        return f"cuda:{device}"
    spec = f"{device.type}:{device.index}" if isinstance(device, _C.device) else str(device)
    if spec == "cuda":
        return "cuda:0"
    if not spec.startswith("cuda:"):
        raise ValueError(f"tally.cuda: expected a CUDA device, got {device!r}")
    return spec


def _figure(name):
    fn = getattr(_C.memory, name)

    def figure(device=None):
        if not is_available():
            return 0  # as torch.cuda's figures before CUDA is initialised
        return fn(_cuda_device(device))

    figure.__name__ = name
    figure.__doc__ = f"torch.cuda.{name}: tally.memory.{name} of a CUDA device (0 without one)"
    return figure


memory_allocated = _figure("memory_allocated")
max_memory_allocated = _figure("max_memory_allocated")
memory_reserved = _figure("memory_reserved")
max_memory_reserved = _figure("max_memory_reserved")


def memory_stats(device=None):
    return _C.memory.memory_stats(_cuda_device(device)) if is_available() else {}


def memory_summary(device=None, abbreviated=False):
    if not is_available():
        raise RuntimeError("tally.cuda.memory_summary: no CUDA device "
                           "(use tally.memory.memory_summary('cpu') for the CPU's allocator)")
    return _C.memory.memory_summary(_cuda_device(device), abbreviated)


def reset_peak_memory_stats(device=None):
    if is_available():
        _C.memory.reset_peak_memory_stats(_cuda_device(device))


def empty_cache():
    """Returns the cached free blocks of every CUDA device to the driver (nothing without one)."""
    for d in range(device_count()):
        _C.memory.empty_cache(f"cuda:{d}")


def synchronize(device=None):
    """Waits for the work queued on the device (torch.cuda.synchronize)."""
    if not is_available():
        raise RuntimeError("tally.cuda.synchronize: no CUDA device (Tally was built without "
                           "CUDA or no GPU is present)")
    _C.memory.synchronize(_cuda_device(device))


def manual_seed(seed):
    """Seeds Tally's default generator, which serves CPU and CUDA alike."""
    _C.manual_seed(int(seed))


manual_seed_all = manual_seed


def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=100000,
                           device=None):
    """torch.cuda.memory._record_memory_history (context and stacks are accepted and ignored:
    Tally records the user's line, module, op and phase of every allocation)."""
    _C.memory.record_memory_history(enabled, max_entries, _cuda_device(device))


def _dump_snapshot(filename="dump_snapshot.pickle", device=None):
    _C.memory.dump_snapshot(os.fspath(filename), _cuda_device(device))


_cuda = _C.cuda
for _fn in (is_available, device_count, current_device, memory_allocated, max_memory_allocated,
            memory_reserved, max_memory_reserved, memory_stats, memory_summary,
            reset_peak_memory_stats, empty_cache, synchronize, manual_seed, manual_seed_all):
    setattr(_cuda, _fn.__name__, _fn)
_cuda.manual_seed_all = manual_seed

_cuda_memory = types.ModuleType(_pkg + ".cuda.memory", "torch.cuda.memory's names")
for _fn in (memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved,
            memory_stats, memory_summary, reset_peak_memory_stats, empty_cache,
            _record_memory_history, _dump_snapshot):
    setattr(_cuda_memory, _fn.__name__, _fn)
_cuda.memory = _cuda_memory
_register("cuda.memory", _cuda_memory)


# ---- tally.backends ----

_B = _C._backends


def _switch(name, doc=None):
    """A property over the boolean switch _B.<name>() / _B.set_<name>(value)."""
    return property(lambda self: getattr(_B, name)(),
                    lambda self, value: getattr(_B, "set_" + name)(bool(value)), doc=doc)


class _Matmul:
    """torch.backends.cuda.matmul: allow_tf32 (float32 matmuls may use TF32 tensor cores)."""

    allow_tf32 = _switch("allow_tf32")

    def __setattr__(self, name, value):
        if name != "allow_tf32":
            raise AttributeError(f"tally.backends.cuda.matmul has no setting {name!r} "
                                 "(allow_tf32 is the one there is)")
        object.__setattr__(self, name, value)

    def __repr__(self):
        return f"tally.backends.cuda.matmul(allow_tf32={self.allow_tf32})"


class _CudaBackend(types.ModuleType):
    matmul = _Matmul()

    @staticmethod
    def enable_cudnn_sdp(enabled):
        """float16/bfloat16 attention may run cuDNN's fused kernels."""
        _B.set_cudnn_sdp_enabled(bool(enabled))

    @staticmethod
    def cudnn_sdp_enabled():
        return _B.cudnn_sdp_enabled()

    @staticmethod
    def is_built():
        return bool(_C._built_with_cuda)


class _CudnnBackend(types.ModuleType):
    allow_tf32 = _switch(
        "cudnn_allow_tf32",
        "float32 convolutions may use TF32 tensor cores (on by default, as in PyTorch).")
    benchmark = _switch("cudnn_benchmark",
                        "Convolutions time cuDNN's algorithms once per shape and keep the fastest.")

    @property
    def enabled(self):
        return True

    @staticmethod
    def is_available():
        return is_available()


backends = types.ModuleType(_pkg + ".backends", "torch.backends: cuda and cudnn's switches")
backends.cuda = _CudaBackend(_pkg + ".backends.cuda", "torch.backends.cuda")
backends.cudnn = _CudnnBackend(_pkg + ".backends.cudnn", "torch.backends.cudnn")
_register("backends", backends)
_register("backends.cuda", backends.cuda)
_register("backends.cudnn", backends.cudnn)

_tunable = types.ModuleType(_pkg + ".cuda.tunable", "torch.cuda.tunable: enable, is_enabled")
_tunable.enable = lambda val=True: _B.set_tunable_enabled(bool(val))
_tunable.is_enabled = _B.tunable_enabled
_cuda.tunable = _tunable
_register("cuda.tunable", _tunable)

_PRECISIONS = ("highest", "high", "medium")


def set_float32_matmul_precision(precision):
    """'highest': float32 matmuls in float32; 'high' and 'medium': TF32 tensor cores allowed
    (Tally has no bfloat16 split for 'medium'), as torch.set_float32_matmul_precision."""
    if precision not in _PRECISIONS:
        raise ValueError(f"set_float32_matmul_precision: expected one of {_PRECISIONS}, "
                         f"got {precision!r}")
    _B.set_allow_tf32(precision != "highest")


def get_float32_matmul_precision():
    return "high" if _B.allow_tf32() else "highest"


# ---- tally.nn.utils ----

def _grads_of(parameters):
    return [parameters] if isinstance(parameters, _C.Tensor) else list(parameters)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """Scales the gradients so that their norm, as one vector, is at most max_norm; returns the
    norm before clipping (torch.nn.utils.clip_grad_norm_; `foreach` is accepted and ignored:
    Tally's CUDA path is always fused). error_if_nonfinite reads the norm on the host."""
    params = _grads_of(parameters)
    if error_if_nonfinite:
        with no_grad():
            total = _C.optim.clip_grad_norm_(params, math.inf, norm_type)
        if not math.isfinite(total.item()):
            raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the "
                               f"gradients is {total.item()} (error_if_nonfinite=True)")
    return _C.optim.clip_grad_norm_(params, float(max_norm), float(norm_type))


def clip_grad_value_(parameters, clip_value, foreach=None):
    """Clamps every gradient to [-clip_value, clip_value] (torch.nn.utils.clip_grad_value_)."""
    _C.optim.clip_grad_value_(_grads_of(parameters), float(clip_value))


nn_utils = types.ModuleType(_pkg + ".nn.utils", "torch.nn.utils: gradient clipping")
nn_utils.clip_grad_norm_ = clip_grad_norm_
nn_utils.clip_grad_value_ = clip_grad_value_
nn_utils.clip_grad_norm = clip_grad_norm_
_C.nn.utils = nn_utils
_register("nn.utils", nn_utils)


# ---- tally.save / tally.load ----

_TENSOR_KEY = "__tally_tensor__"


def save(obj, f):
    """Writes a tensor or a dict of name -> tensor (a state_dict) to the path `f` as a
    safetensors file (tally.nn.save_safetensors; written whole or not at all). Modules,
    optimizer states and other Python objects are refused: save their tensors' dict."""
    if isinstance(obj, _C.nn.Module):
        raise TypeError("tally.save: save model.state_dict(), not the module (Tally writes "
                        "tensors, as safetensors, not pickled objects)")
    if isinstance(obj, _C.Tensor):
        tensors = {_TENSOR_KEY: obj}
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str) or not isinstance(v, _C.Tensor):
                raise TypeError(f"tally.save: a dict of str -> Tensor is expected; key {k!r} "
                                f"holds {type(v).__name__} (an optimizer's state_dict holds "
                                "more than tensors and is not saved this way)")
        tensors = dict(obj)
    else:
        raise TypeError(f"tally.save: a Tensor or a dict of str -> Tensor is expected, got "
                        f"{type(obj).__name__}")
    if hasattr(f, "write"):
        raise TypeError("tally.save: give a path (a str or os.PathLike), not a file object")
    _C.nn.save_safetensors(os.fspath(f), tensors)


def load(f, map_location=None, weights_only=True):
    """Reads what tally.save wrote (any safetensors file): the tensor, or the dict of name ->
    tensor. map_location: a device (str or tally.device) to move every tensor to."""
    if hasattr(f, "read"):
        raise TypeError("tally.load: give a path (a str or os.PathLike), not a file object")
    tensors = _C.nn.load_safetensors(os.fspath(f))
    if map_location is not None:
        if not isinstance(map_location, (str, _C.device)):
            raise TypeError("tally.load: map_location must be a device (str or tally.device), "
                            f"got {type(map_location).__name__}")
        tensors = {k: v.to(map_location) for k, v in tensors.items()}
    if list(tensors) == [_TENSOR_KEY]:
        return tensors[_TENSOR_KEY]
    return tensors


def is_tensor(obj):
    return isinstance(obj, _C.Tensor)


class inference_mode(no_grad):
    """torch.inference_mode: ops inside record no graph (Tally's no_grad; also a decorator);
    inference_mode(False) changes nothing."""

    def __init__(self, mode=True):
        self._on = bool(mode)

    def __enter__(self):
        return super().__enter__() if self._on else self

    def __exit__(self, *exc):
        return super().__exit__(*exc) if self._on else False
