"""torch.no_grad, enable_grad and set_grad_enabled: context managers and decorators over
Tally's thread-local grad mode."""

import functools

from . import _C


class _GradModeContext:
    _mode = True

    def __enter__(self):
        self._prev = _C.is_grad_enabled()
        _C._set_grad_enabled(self._mode)
        return self

    def __exit__(self, *exc):
        _C._set_grad_enabled(self._prev)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.__class__():
                return fn(*args, **kwargs)
        return wrapper


class no_grad(_GradModeContext):
    """Ops inside record no graph (torch.no_grad); also a decorator."""
    _mode = False


class enable_grad(_GradModeContext):
    """Recording on again inside a no_grad region (torch.enable_grad)."""
    _mode = True


class set_grad_enabled:
    """Sets grad mode now; as a context manager, restores the previous mode on exit."""

    def __init__(self, mode):
        self._prev = _C.is_grad_enabled()
        _C._set_grad_enabled(bool(mode))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _C._set_grad_enabled(self._prev)
        return False
