"""``torchwire.optim``: a drop-in for ``torch.distributed.optim``'s ``DistributedOptimizer``."""

from __future__ import annotations

from ._optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
