"""tally.nn.Parameter: a tensor that, assigned to an attribute of a Module, is registered
as its parameter (tagged `parameter` in the allocator), as torch.nn.Parameter."""

from . import _C


class Parameter(_C.Tensor):
    def __init__(self, data, requires_grad=True):
        super().__init__(data.detach() if isinstance(data, _C.Tensor) else data)
        self.requires_grad = requires_grad

    def __repr__(self):
        return "Parameter containing:\n" + super().__repr__()


_C.nn.Parameter = Parameter


_module_init = _C.nn.Module.__init__


def _init_module(self, *args, **kwargs):
    # A Python subclass is named by its class in repr() and error messages ("Net(...)").
    if not args and "type_name" not in kwargs:
        kwargs["type_name"] = type(self).__name__
    _module_init(self, *args, **kwargs)


_init_module.__doc__ = _module_init.__doc__
_C.nn.Module.__init__ = _init_module
