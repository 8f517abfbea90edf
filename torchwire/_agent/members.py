"""Changes to the members of a running job: a member joins or leaves a dynamic group,
or a rank's next incarnation takes it back after its process died (a rejoin,
either kind of group; ``torchwire._bootstrap.rejoin``).

A member that is replaced or removed is *dropped*: new calls to it fail at once,
calls pending on it fail with ``WorkerUnavailableError`` naming it and why (for a
restart: "it restarted", with the old and new incarnations), its links are
retired, and the plug-ins forget it (its RRefs, its forks, its autograd
contexts) before the rank can be reused.
"""

from __future__ import annotations

import contextlib
import logging
import time

from .._base import threads
from .._base.worker_record import WorkerRecord

log = logging.getLogger("torchwire")


class MemberChanges:
    """The agent's member changes (see the module docstring).

    Args:
        agent: the :class:`~torchwire._agent.agent.RpcAgent`.
    """

    def __init__(self, agent) -> None:
        self._agent = agent

    def __repr__(self) -> str:
        return f"<MemberChanges of {self._agent.name}>"

    def add(self, record: WorkerRecord):
        """A dynamic group gained a member (it joined, or a connection from it arrived
        first), or a rank's next incarnation rejoined (either kind of group).  A
        different worker known under its rank or name died without leaving (the group
        gave them to the newcomer): it is dropped first, and what depended on it fails
        (with "it restarted" when the newcomer has its name and rank).

        Returns:
            its :class:`~.names.Member`.
        """
        agent = self._agent
        known = agent.names.member(record.rank)
        if known is not None and known.record == record:
            return known  # (a joiner's first connection came before its announcement)
        restarted = False
        while True:
            member, stale = agent.names.add(record)
            if member is not None:
                break
            old = stale.record
            if old.rank == record.rank and old.name == record.name:
                restarted = True
                why = (f"it restarted: {old.describe()} is gone, and {record.describe()} "
                       "took its place")
            else:
                why = "another worker joined with its rank or name (it is gone)"
            self._drop(stale, why)
        agent.health.forget(member.info.id)
        if restarted and agent.world_size is not None:
            # what was in flight to the old process is lost: shutdown's pair counts
            # with this rank can never balance (termination.py)
            agent.health.ever_down.add(member.info.id)
        if restarted:
            log.warning("torchwire: %s: worker %s (rank %d) rejoined as %s", agent.name,
                        record.name, record.rank, record.describe())
        agent.update_router()
        return member

    def remove(self, rank: int, deadline: float, why: str) -> None:
        """A dynamic group lost member ``rank`` (``why``: it left, or it is gone).

        New calls to it fail at once; calls already sent to it are waited for until
        ``deadline`` (a leaving member still serves them); what is left then fails
        with a ``WorkerUnavailableError`` naming it and ``why``.
        """
        agent = self._agent
        member = agent.names.member(rank)
        if member is not None and rank != agent.rank:
            self._drop(member, why, deadline)

    def _drop(self, member, why: str, deadline: float | None = None) -> None:
        agent = self._agent
        rank = member.info.id
        if not agent.names.remove(member, why):
            return
        if deadline is not None and agent.pending.to_peer(rank):
            in_pool = threads.current_pool() is agent.pool
            with agent.pool.blocking() if in_pool else contextlib.nullcontext():
                delay = 0.001
                while agent.pending.to_peer(rank) and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.02)
        err = agent.unavailable(rank, why)
        agent.pending.fail_where(err, peer=rank)
        agent.links.retire(rank)
        agent.health.forget(rank)
        agent.update_router()
        for p in agent.plugins():  # here, not on the pool: before the rank can be reused
            try:
                p.peer_lost(rank, err)
            except Exception:
                log.exception("torchwire: %r could not forget rank %d", p, rank)

