"""``torchwire.nn``: ``RemoteModule``, as ``torch.distributed.nn``."""

from ._remote_module import RemoteModule

__all__ = ["RemoteModule"]
