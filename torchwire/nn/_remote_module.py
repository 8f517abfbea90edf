"""``RemoteModule``: an ``nn.Module`` created and run on another worker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn

from .. import _serialization as ser
from .. import rpc
from .._agent.runtime import require_agent
from .._base.errors import RpcStateError, SerializationError


class RemoteDeviceError(ValueError, RuntimeError):
    """A remote_device naming no valid device: a ``ValueError`` as for a malformed string,
    and the ``RuntimeError`` torch's parser raises for the device part."""


def _parse_remote_device(remote_device: str) -> tuple[str | int, str]:
    """``"worker1/cpu"``, ``"worker1"``, ``"rank:1/cuda:0"`` -> (worker name or rank, device).

    Raises:
        ValueError: the string is not of that form or names no valid device.
    """
    if not isinstance(remote_device, str):
        raise TypeError(f"remote_device must be a string like 'worker1/cpu', got "
                        f"{type(remote_device).__name__}")
    parts = remote_device.split("/")
    if len(parts) > 2 or not parts[0]:
        raise ValueError(f"Could not parse remote_device: {remote_device}. The valid format "
                         "is '<workername>/<device>' or 'rank:<rank>/<device>'")
    where: str | int = parts[0]
    device = parts[1] if len(parts) == 2 else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise RemoteDeviceError(f"Could not parse remote_device: {remote_device}: invalid "
                                f"device {device!r} ({exc})") from None
    if parts[0].startswith("rank:"):
        try:
            where = int(parts[0][len("rank:"):])
        except ValueError:
            raise ValueError(f"Could not parse remote_device: {remote_device}: the rank in "
                             f"{parts[0]!r} is not an integer") from None
    return where, str(dev)


def _create_module(module_cls: Callable[..., nn.Module], args: tuple[Any, ...],
                   kwargs: dict[str, Any], device: str) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError("Expect `module_cls(*args, **kwargs)` returns an instance of <class "
                         f"nn.Module>, but it returns an instance of {type(module)}.")
    return module.to(device)


def _to_device(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x


def _remote_forward(module_rref: rpc.RRef, device: str, is_device_map_set: bool, *args: Any,
                    **kwargs: Any) -> Any:
    module = module_rref.local_value()
    if torch.device(device).type == "cpu":
        return module.forward(*args, **kwargs)
    out = module.forward(*_to_device(args, device), **_to_device(kwargs, device))
    return out if is_device_map_set else _to_device(out, "cpu")


def _param_rrefs(module_rref: rpc.RRef, recurse: bool) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref: rpc.RRef, mode: bool) -> None:
    module_rref.local_value().train(mode)


# As torch's RemoteModule, these raise: they would act on a module that is not here.
# Unlike torch, walking the module tree (modules(), children() ...) works, so a local
# model holding a RemoteModule can still call model.parameters() for its own
# parameters (the remote ones come from remote_parameters()).
_UNSUPPORTED = (
    "register_buffer", "register_parameter", "add_module", "apply", "cuda", "ipu", "xpu",
    "cpu", "type", "float", "double", "half", "bfloat16", "to", "register_backward_hook",
    "register_full_backward_hook", "register_forward_pre_hook", "register_forward_hook",
    "state_dict", "load_state_dict", "named_parameters", "buffers", "named_buffers",
    "requires_grad_", "zero_grad", "share_memory", "extra_repr",
)


class RemoteModule(nn.Module):
    """A module created on a remote worker; ``forward`` runs there.

    Same interface as ``torch.distributed.nn.RemoteModule``.  Use it inside a
    local ``nn.Module`` like any layer; with distributed autograd the backward
    pass reaches the remote parameters.

    Args:
        remote_device: ``"<worker name>/<device>"`` or ``"rank:<rank>/<device>"``;
            the device defaults to ``cpu`` (``"ps"`` means ``"ps/cpu"``).
        module_cls: the ``nn.Module`` class to build on that worker.
        args, kwargs: its constructor arguments.

    Raises:
        RuntimeError: RPC is not initialized.
        ValueError: bad ``remote_device``.

    Example::

        >>> linear = RemoteModule("worker1/cpu", nn.Linear, args=(20, 30))
        >>> out = linear(torch.randn(128, 20))          # runs on worker1
        >>> fut = linear.forward_async(torch.randn(128, 20))
        >>> param_rrefs = linear.remote_parameters()    # for DistributedOptimizer
    """

    def __init__(self, remote_device: str, module_cls: Callable[..., nn.Module],
                 args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None,
                 _module_interface_cls: Any = None) -> None:
        super().__init__()
        self._prepare(remote_device)
        if _module_interface_cls is not None:
            raise NotImplementedError("TorchScript module interfaces are not supported by "
                                      "torchwire's RemoteModule")
        self.module_rref = rpc.remote(self.on, _create_module,
                                      (module_cls, tuple(args or ()), dict(kwargs or {}),
                                       self.device))

    def _prepare(self, remote_device: str) -> None:
        try:
            require_agent()
        except RpcStateError:
            raise RpcStateError("RemoteModule only works in RPC: call "
                                "torchwire.rpc.init_rpc first") from None
        where, self.device = _parse_remote_device(remote_device)
        self.on = rpc.get_worker_info(where).name
        self.is_device_map_set = False
        self.is_scriptable = False
        self.generated_methods = _GENERATED

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: rpc.RRef,
                              _module_interface_cls: Any = None) -> RemoteModule:
        """A RemoteModule around an existing module RRef (the module is shared, not copied).

        As torch's, ``forward`` runs on the RRef's owner; ``remote_device`` names this
        RemoteModule's ``on`` and ``device``."""
        m = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(m)
        m._prepare(remote_device)
        m.module_rref = module_rref
        return m

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # to the module's owner, as torch's generated forward
        return rpc.rpc_sync(self.module_rref.owner_name(), _remote_forward,
                            (self.module_rref, self.device, self.is_device_map_set, *args),
                            kwargs)

    def forward_async(self, *args: Any, **kwargs: Any) -> rpc.Future:
        """Like ``forward``; returns a future of the output."""
        return rpc.rpc_async(self.module_rref.owner_name(), _remote_forward,
                             (self.module_rref, self.device, self.is_device_map_set, *args),
                             kwargs)

    def __getattr__(self, name: str) -> Any:
        # A RemoteModule received over RPC carries torch's pickled attributes only (its
        # __dict__ is torch's); nn.Module's own state is made when first asked for.
        if name in _MODULE_STATE and "_parameters" not in self.__dict__:
            nn.Module.__init__(self)
            return getattr(self, name)
        return super().__getattr__(name)

    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef]:
        """RRefs to the remote module's parameters (e.g. for ``DistributedOptimizer``)."""
        params: list[rpc.RRef] = rpc.rpc_sync(self.on, _param_rrefs,
                                              args=(self.module_rref, recurse))
        return params

    def get_module_rref(self) -> rpc.RRef:
        """The RRef to the remote ``nn.Module``."""
        return self.module_rref

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        raise ValueError("Method ``parameters`` not supported for RemoteModule. Please use "
                         "``remote_parameters`` instead.")

    def train(self, mode: bool = True) -> RemoteModule:
        rpc.rpc_sync(self.module_rref.owner_name(), _set_training, args=(self.module_rref, mode))
        self.training = mode
        return self

    def eval(self) -> RemoteModule:
        return self.train(False)

    def __getstate__(self) -> NoReturn:
        raise SerializationError("Cannot pickle RemoteModule in python pickler. RemoteModule "
                                 "can only be pickled when using RPC")

    def __setstate__(self, state: Any) -> NoReturn:
        raise SerializationError("Cannot unpickle RemoteModule in python pickler. "
                                 "RemoteModule can only be unpickled when using RPC")

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on!r}, device={self.device!r}, " \
               f"module_rref={self.module_rref})"


def _not_supported(name: str) -> Callable[..., NoReturn]:
    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule")
    method.__name__ = name
    return method


for _name in _UNSUPPORTED:
    setattr(RemoteModule, _name, _not_supported(_name))
del _name


# What a RemoteModule sent over RPC carries, in torch's order
# (torch.distributed.nn.api.remote_module._REMOTE_MODULE_PICKLED_ATTRIBUTES); the receiver
# installs the generated methods after them, as torch's does.
_PICKLED = ("on", "device", "is_device_map_set", "is_scriptable", "generated_methods",
            "module_rref")
_GENERATED = ("forward_async", "forward")
_MODULE_STATE = frozenset(vars(nn.Module()))  # what nn.Module.__init__ sets


def _rebuild_remote_module(*values: Any) -> RemoteModule:
    m = RemoteModule.__new__(RemoteModule)
    m.__dict__.update(zip(_PICKLED, values))
    for name in m.generated_methods:
        m.__dict__[name] = getattr(RemoteModule, name).__get__(m)
    return m


def _reduce_remote_module(m: RemoteModule) -> tuple[Callable[..., RemoteModule], tuple[Any, ...]]:
    return _rebuild_remote_module, tuple(getattr(m, k) for k in _PICKLED)


# torch's base class, which takes a TorchScript module interface (refused here)
_RemoteModule = RemoteModule


ser.hooks.register_reducer(RemoteModule, _reduce_remote_module)
