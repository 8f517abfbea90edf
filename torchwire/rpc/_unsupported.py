"""torch's RPC names that torchwire deliberately does not implement.

Each is here under torch's name so that a ported program imports as before; calling
one raises ``NotImplementedError`` saying what is not supported and why.  README.md,
"Not supported", lists them.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

_TORCHSCRIPT = ("torchwire runs RPC from Python only: TorchScript code cannot call "
                "rpc_async/remote or hold RRefs (a @torch.jit.script function can still "
                "be the function an RPC runs)")
_PICKLER = ("torchwire pickles every message with its own RPC pickler (tensors beside "
            "the stream, RRefs and autograd hooks); a custom pickler cannot replace it")
_GIL = ("torchwire's agent is Python: there is no C++ agent whose GIL waits to profile; "
        "see torchwire.rpc.stats() for its counters")


def unsupported(name: str, reason: str) -> Callable[..., NoReturn]:
    """A stand-in for torch's ``name`` that raises ``NotImplementedError(reason)``."""

    def not_supported(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{name} is not supported by torchwire: {reason}")

    not_supported.__name__ = not_supported.__qualname__ = name.rpartition(".")[2]
    not_supported.__doc__ = f"Not supported by torchwire (raises NotImplementedError): {reason}."
    return not_supported


_use_rpc_pickler = unsupported("torch.distributed.rpc.api._use_rpc_pickler", _PICKLER)
_enable_jit_rref_pickle = unsupported("torch.distributed.rpc._enable_jit_rref_pickle",
                                      _TORCHSCRIPT)
_disable_jit_rref_pickle = unsupported("torch.distributed.rpc._disable_jit_rref_pickle",
                                       _TORCHSCRIPT)
_invoke_rpc_torchscript = unsupported("torch.distributed.rpc._invoke_rpc_torchscript",
                                      _TORCHSCRIPT)
_invoke_remote_torchscript = unsupported("torch.distributed.rpc._invoke_remote_torchscript",
                                         _TORCHSCRIPT)
enable_gil_profiling = unsupported("torch.distributed.rpc.enable_gil_profiling", _GIL)

# torch's name -> its stand-in (tests check each is in the README's "Not supported")
NOT_SUPPORTED = {
    "_use_rpc_pickler": _use_rpc_pickler,
    "_enable_jit_rref_pickle": _enable_jit_rref_pickle,
    "_disable_jit_rref_pickle": _disable_jit_rref_pickle,
    "_invoke_rpc_torchscript": _invoke_rpc_torchscript,
    "_invoke_remote_torchscript": _invoke_remote_torchscript,
    "enable_gil_profiling": enable_gil_profiling,
}
