"""``torchwire.rpc.constants``, as ``torch.distributed.rpc.constants``."""

from .._base.options import (DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS,  # noqa: F401
                       DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT)
