"""Which peers are reachable: the heartbeat, remembered losses, the reconnection gate.

The agent reports every sign of a lost peer here (a connection that ended
without a GOODBYE, a connection that could not be made, a heartbeat that went
silent); :class:`PeerHealth` remembers the peer as *down* and the agent fails
what depended on it (``RpcAgent.peer_lost``).  These are the DOWN and DEAD
states of a link's state machine (written out in ``links.py``)::

    UP    --loss-->  DOWN  --reconnected (either side)-->  UP
                     DOWN  --its listener refused us, or it failed our
                             authentication-->              DEAD (final)

A refused connection is proof that the process is gone (its listening socket is
closed), so a DEAD peer fails every call at once: the process dialed, not a newcomer
that took its rank meanwhile (a restart: ``mark_down``'s ``current``).  A DOWN peer
may only be cut off (a link down, packets dropped, a frozen process): the next call
to it connects again (:meth:`PeerHealth.gate`).  Attempts are spaced by a backoff: the first
retry after a loss is immediate, each failed attempt doubles the pause from
``_BACKOFF_MIN`` up to ``_BACKOFF_MAX`` (1 s).  A call whose deadline comes before
the next attempt fails at once; one whose deadline allows it waits for the attempt.
The monitor thread also retries DOWN peers in the background on the same schedule,
so a healed link is found even when nobody calls.

Heartbeat (``heartbeat_interval`` / ``heartbeat_timeout`` in the options): every
interval the monitor thread looks at what each open connection has received.
Traffic is the evidence: a connection that received anything since the last
look costs nothing.  One idle for an interval is *suspect*: it gets a PING (a
32-byte CONTROL frame; the peer's reader answers PONG without involving its
agent); one silent for ``heartbeat_timeout`` means the peer is frozen or
unreachable, and it is reported lost.  Both ends ping, so an idle pair
exchanges one frame each way per interval.  A long transfer is not silence: the
reader counts its progress, and the writer counts a full socket that drained (the
peer is reading what we send).  A call's own timeout does not wait for the
heartbeat: calls fail at their deadlines whatever the link's state.
"""

from __future__ import annotations

import enum
import logging
import threading
import time

from .._base.errors import AuthenticationError, ConnectError, RpcStateError, RpcTimeoutError
from .._wire import frame as F

log = logging.getLogger("torchwire")

_BACKOFF_MIN = 0.05  # seconds between the first failed attempt and the next
_BACKOFF_MAX = 1.0  # the longest pause between attempts to reach a DOWN peer


class PeerState(enum.Enum):
    """A peer's state, as this worker knows it (the diagram in the module docstring)."""

    UP = "up"
    DOWN = "down"
    DEAD = "dead"


class PeerHealth:
    """Down and dead peers, and the monitor thread (heartbeat and reconnection).

    Args:
        agent: the :class:`RpcAgent` (its public methods: ``open_connections``,
            ``peer_lost``, ``defer``, ``unavailable``, ``name_of``; its ``links``:
            ``reconnect``, ``suspect``).
        interval: seconds between looks at the connections; 0 disables the heartbeat
            (reconnection attempts then run every second).
        timeout: seconds of silence after which a connection's peer is lost.
    """

    def __init__(self, agent, interval: float, timeout: float) -> None:
        self._agent = agent
        self.interval = float(interval)
        self.timeout = float(timeout) if interval > 0 else 0.0
        self._lock = threading.Lock()
        self._down: dict[int, str] = {}  # rank -> why
        self._dead: set[int] = set()
        self.ever_down: set[int] = set()  # for shutdown: their traffic may have been lost
        self._retrying: set[int] = set()
        self._next_retry: dict[int, float] = {}  # rank -> when it may be tried again
        self._backoff: dict[int, float] = {}  # rank -> pause after its next failure
        self._seen: dict = {}  # connection -> (evidence mark, monotonic time it changed)
        self._pinging: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"torchwire-liveness-{agent.name}")

    def __repr__(self) -> str:
        return (f"<PeerHealth down={sorted(self._down)} dead={sorted(self._dead)} "
                f"heartbeat={self.interval:g}s/{self.timeout:g}s>")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    # ------------------------------------------------------------------ state

    def state(self, rank: int) -> PeerState:
        if rank in self._dead:
            return PeerState.DEAD
        return PeerState.DOWN if rank in self._down else PeerState.UP

    def is_down(self, rank: int) -> bool:
        return rank in self._down

    def down(self) -> dict[int, str]:
        with self._lock:
            return dict(self._down)

    def check(self, rank: int) -> None:
        """Raise at once if ``rank`` is known to be down.

        Raises:
            WorkerUnavailableError: naming the worker and why it is down.
        """
        why = self._down.get(rank)
        if why is not None:
            raise self._agent.unavailable(rank, why)

    def gate(self, rank: int, deadline: float | None) -> None:
        """Before connecting to ``rank``: return when an attempt may be made.

        A DOWN peer is tried again once its backoff has passed (waited for here,
        at most ``_BACKOFF_MAX``); a DEAD one never.

        Raises:
            WorkerUnavailableError: it is dead, or ``deadline`` comes before its next
                attempt.
        """
        why = self._down.get(rank)
        if why is None:
            return
        if rank in self._dead:
            raise self._agent.unavailable(rank, why)
        wait = self._next_retry.get(rank, 0.0) - time.monotonic()
        if wait <= 0:
            return
        if deadline is not None and time.monotonic() + wait > deadline:
            raise self._agent.unavailable(rank, f"{why} (next attempt to reconnect in "
                                                f"{wait:.2f} s, after this call's deadline)")
        self._stop.wait(wait)

    def attempt_failed(self, rank: int) -> None:
        """An attempt to reach DOWN ``rank`` failed: pause before the next one."""
        with self._lock:
            pause = self._backoff.get(rank, _BACKOFF_MIN)
            self._next_retry[rank] = time.monotonic() + pause
            self._backoff[rank] = min(pause * 2, _BACKOFF_MAX)

    def mark_down(self, rank: int, why: str, dead: bool = False,
                  current=None) -> bool | None:
        """Remember ``rank`` as down (``dead``: for good); True if it was up.

        ``current()``: whether the incarnation the loss concerns still holds the rank,
        asked under the lock :meth:`forget` takes after a newcomer took it (so a loss
        of the old one seen meanwhile cannot mark the newcomer): None if not.
        """
        with self._lock:
            if current is not None and not current():
                return None
            first = rank not in self._down
            if first or dead:
                self._down[rank] = why
            self.ever_down.add(rank)
            if dead:
                self._dead.add(rank)
            if first:  # the first attempt to reach it again may be made at once
                self._next_retry[rank] = time.monotonic()
                self._backoff[rank] = _BACKOFF_MIN
        return first

    def mark_up(self, rank: int) -> None:
        """``rank`` proved alive (a connection to or from it completed its handshake)."""
        with self._lock:
            if rank in self._dead or self._down.pop(rank, None) is None:
                return
            self._backoff.pop(rank, None)
        log.warning("torchwire: %s reaches %s again", self._agent.name,
                    self._agent.name_of(rank))

    def forget(self, rank: int) -> None:
        """``rank`` left a dynamic group, or a new member took it: start afresh."""
        with self._lock:
            self._down.pop(rank, None)
            self._dead.discard(rank)
            self.ever_down.discard(rank)
            self._next_retry.pop(rank, None)
            self._backoff.pop(rank, None)

    def connect_failed(self, rank: int, exc: BaseException) -> tuple[str, bool]:
        """Why a connection to ``rank`` could not be made, and whether that is final.

        Final: its listener refused (the process is gone), or it failed our
        authentication (retrying cannot help).
        """
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        if isinstance(cause, ConnectError) and cause.refused:
            return f"its listener refused the connection (the process is gone): {cause}", True
        if isinstance(cause, AuthenticationError):
            return f"handshake failed: {cause}", True
        return f"cannot connect: {cause}", False

    # ------------------------------------------------------------------ monitor

    def _run(self) -> None:
        period = self.interval if self.interval > 0 else 1.0
        while not self._stop.wait(period):
            try:
                if self.timeout > 0:
                    self._beat()
                self._retry_down()
            except Exception:  # the monitor must outlive any one bad look
                log.exception("torchwire: liveness check failed")

    def _beat(self) -> None:
        agent = self._agent
        now = time.monotonic()
        conns = agent.open_connections()
        seen = {}
        for c in conns:
            if c.closed:
                continue
            mark = c.evidence
            old = self._seen.get(c)
            if old is None or old[0] != mark:
                seen[c] = (mark, now)
                if old is not None and now - old[1] >= self.interval * 0.9:
                    c.silent_mark = None
                    agent.links.suspect(c, False)  # it spoke again
                continue
            seen[c] = old
            silent = now - old[1]
            if silent >= self.timeout:
                agent.peer_lost(c.peer_rank, f"no heartbeat for {silent:.1f} s (heartbeat_"
                                 f"timeout={self.timeout:g} s): frozen or unreachable")
            elif silent >= self.interval * 0.9 and c not in self._pinging:
                c.silent_mark = mark
                agent.links.suspect(c, True)
                self._pinging.add(c)
                try:
                    # on the pool: a write to a frozen peer may block its writer
                    agent.defer(self._ping, c)
                except RpcStateError:
                    self._pinging.discard(c)
        self._seen = seen

    def _ping(self, conn) -> None:
        try:
            conn.send_control(F.CTRL_PING)
        finally:
            self._pinging.discard(conn)

    def _retry_down(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [r for r in self._down if r not in self._dead and r not in self._retrying
                   and self._next_retry.get(r, 0.0) <= now]
            self._retrying.update(due)
        for rank in due:
            threading.Thread(target=self._reconnect, args=(rank,), daemon=True,
                             name=f"torchwire-reconnect-{rank}").start()

    def _reconnect(self, rank: int) -> None:
        """A background attempt (its own thread): a failure moves the backoff on
        (``Links._attempt``); one cut short by its bound does so here."""
        agent = self._agent
        try:
            agent.links.reconnect(rank)
        except RpcTimeoutError as exc:
            self.attempt_failed(rank)
            log.debug("torchwire: %s: reconnecting to rank %d: %s", agent.name, rank, exc)
        except Exception as exc:
            log.debug("torchwire: %s: reconnecting to rank %d failed: %s", agent.name, rank, exc)
        finally:
            with self._lock:
                self._retrying.discard(rank)
