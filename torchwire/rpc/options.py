"""``torchwire.rpc.options``, as ``torch.distributed.rpc.options``."""

from .._base.options import TensorPipeRpcBackendOptions, TorchwireRpcBackendOptions

__all__ = ["TensorPipeRpcBackendOptions", "TorchwireRpcBackendOptions"]
