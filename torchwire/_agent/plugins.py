"""The interfaces through which the layers above plug into the agent.

The agent never imports the RRef, autograd or bootstrap layers: the bootstrap
registers their objects here (``RpcAgent.add_plugin``, ``RpcAgent.set_membership``),
and the agent calls them only through these protocols.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class AgentPlugin(Protocol):
    """A layer above the agent that takes part in shutdown and hears of lost peers
    (the RRef context, the distributed autograd container)."""

    def settle(self, deadline: float) -> None:
        """Send what is queued and wait for it (before each termination-detection
        round of a graceful shutdown), until ``deadline`` at most."""

    def idle(self) -> bool:
        """Nothing queued or in flight."""

    def all_arrived(self) -> None:
        """Every worker has entered graceful shutdown (or this one leaves its group)."""

    def peer_lost(self, rank: int, error: BaseException) -> None:
        """Worker ``rank`` is gone or cut off (``error`` names it); called once per loss,
        on a pool thread, or at once when it left a dynamic group."""

    def close(self) -> None:
        """The agent is closed: fail whatever still waits."""


@runtime_checkable
class Admission(Protocol):
    """Who an accepted connection comes from, when the group's members may change: a
    dynamic group's membership, or a static group's rejoins
    (``torchwire._bootstrap.rejoin.StaticAdmission``)."""

    def admit(self, rank: int, known):
        """Handshake thread: the member an authenticated connection from ``rank`` comes
        from (``known``: the agent's record of it, or None); None if not a member."""


@runtime_checkable
class GroupMembership(Admission, Protocol):
    """A dynamic group's membership (``torchwire._bootstrap.membership``), as the agent
    uses it."""

    def leave(self, deadline: float) -> None:
        """Graceful shutdown of a member: leave the group."""
