"""The current runtime, and the interfaces through which higher layers plug into the agent.

``init_rpc`` (``torchwire._bootstrap.runtime``) makes one :class:`Runtime` - the agent,
the RRef context, the distributed autograd container, a dynamic group's membership,
the state of torch's private collectives - and publishes it in :data:`current`;
``shutdown`` clears it.  Every layer from here up reads it there: on a hot path that
is one attribute lookup (``current.runtime``), and nothing else is global.

Lifecycle of ``current.runtime``::

    None  --init_rpc: agent built, plug-ins registered-->  Runtime  (before the agent serves)
    Runtime  --shutdown: agent closed-->  None
    Runtime  --init_rpc fails after publishing (a dynamic join)-->  None

The agent knows the layers above it only through the two protocols of ``plugins.py``.
"""

from __future__ import annotations

from typing import Any

from .._base.errors import not_initialized
from .state import AgentState
from .plugins import AgentPlugin, GroupMembership  # noqa: F401 - part of this module's API


class Runtime:
    """Everything one ``init_rpc`` made in this process.

    Attributes:
        agent: the :class:`~torchwire._agent.RpcAgent`.
        rrefs: the RRef context (``torchwire._rref``).
        autograd: the distributed autograd container (``torchwire._autograd``).
        membership: a dynamic group's :class:`GroupMembership`, else None.
        collectives: the state of torch's private collectives (``_all_gather``).
    """

    __slots__ = ("agent", "rrefs", "autograd", "membership", "collectives")

    def __init__(self, agent, rrefs, autograd, membership=None, collectives=None) -> None:
        self.agent = agent
        self.rrefs: Any = rrefs
        self.autograd: Any = autograd
        self.membership = membership
        self.collectives: Any = collectives

    def __repr__(self) -> str:
        return f"<Runtime {self.agent!r} membership={self.membership is not None}>"


class _Current:
    __slots__ = ("runtime",)

    def __init__(self) -> None:
        self.runtime: Runtime | None = None


current = _Current()

_CLOSED = AgentState.CLOSED


def require_runtime(lookup: bool = False) -> Runtime:
    """The current runtime.

    Raises:
        RpcStateError: RPC is not initialized, or was shut down (see
            :func:`~torchwire._base.errors.not_initialized` for ``lookup``).
    """
    rt = current.runtime
    if rt is None or rt.agent.state is _CLOSED:
        raise not_initialized(lookup)
    return rt


def require_agent(lookup: bool = False):
    """The current agent (see :func:`require_runtime`)."""
    rt = current.runtime
    if rt is None or rt.agent.state is _CLOSED:
        raise not_initialized(lookup)
    return rt.agent
