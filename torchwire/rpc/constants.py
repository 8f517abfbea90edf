"""``torchwire.rpc.constants``, as ``torch.distributed.rpc.constants``."""

from datetime import timedelta

from .._base.options import (DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS,  # noqa: F401
                             DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_SHUTDOWN_TIMEOUT,
                             UNSET_RPC_TIMEOUT)

# torch's bound on its process group's waits (2**31 - 1 ms); torchwire makes no process
# group, but programs read the constant.
DEFAULT_PROCESS_GROUP_TIMEOUT: timedelta = timedelta(milliseconds=2**31 - 1)

__all__: list[str] = []
