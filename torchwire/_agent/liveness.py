"""Which peers are reachable: the heartbeat, remembered losses, reconnection.

The agent reports every sign of a lost peer here (a connection that ended
without a GOODBYE, a connection that could not be made, a heartbeat that went
silent); :class:`PeerHealth` remembers the peer as *down*, so new calls to it
fail at once instead of each one trying to connect, and the agent fails what
depended on it (``RpcAgent.peer_lost``).

Peer states::

    UP    --loss-->  DOWN  --reconnected (either side)-->  UP
                     DOWN  --its listener refused us-->    DEAD (final)

A refused connection is proof that the process is gone (its listening socket
is closed), so a DEAD peer is never tried again.  A DOWN peer may only be cut
off (a link down, packets dropped): a background attempt reconnects it every
``retry_interval`` seconds, one attempt at a time, so a restored link works
again for new calls.

Heartbeat (``heartbeat_interval`` / ``heartbeat_timeout`` in the options): every
interval the monitor thread looks at what each open connection has received.
Traffic is the evidence: a connection that received anything since the last
look costs nothing.  One idle for an interval gets a PING (a 32-byte CONTROL
frame; the peer's reader answers PONG without involving its agent); one silent
for ``heartbeat_timeout`` means the peer is frozen or unreachable, and it is
reported lost.  Both ends ping, so an idle pair exchanges one frame each way per
interval.  A long transfer is not silence: the reader counts its progress.
"""

from __future__ import annotations

import enum
import logging
import threading
import time

from .._base.errors import AuthenticationError, ConnectError, RpcStateError, WorkerUnavailableError
from .._wire import frame as F

log = logging.getLogger("torchwire")


class PeerState(enum.Enum):
    """A peer's state, as this worker knows it (the diagram in the module docstring)."""

    UP = "up"
    DOWN = "down"
    DEAD = "dead"


class PeerHealth:
    """Down and dead peers, and the monitor thread (heartbeat and reconnection).

    Args:
        agent: the :class:`RpcAgent` (its public methods: ``open_connections``,
            ``reconnect``, ``peer_lost``, ``defer``, ``unavailable``, ``name_of``).
        interval: seconds between looks at the connections; 0 disables the heartbeat
            (reconnection attempts then run every second).
        timeout: seconds of silence after which a connection's peer is lost.
    """

    def __init__(self, agent, interval: float, timeout: float) -> None:
        self._agent = agent
        self.interval = float(interval)
        self.timeout = float(timeout) if interval > 0 else 0.0
        self.retry_interval = max(min(self.interval, 1.0), 0.2) if interval > 0 else 1.0
        self._lock = threading.Lock()
        self._down: dict[int, str] = {}  # rank -> why
        self._dead: set[int] = set()
        self.ever_down: set[int] = set()  # for shutdown: their traffic may have been lost
        self._retrying: set[int] = set()
        self._next_retry: dict[int, float] = {}
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

    def mark_down(self, rank: int, why: str, dead: bool = False) -> bool:
        """Remember ``rank`` as down (``dead``: for good); True if it was up."""
        with self._lock:
            first = rank not in self._down
            if first or dead:
                self._down[rank] = why
            self.ever_down.add(rank)
            if dead:
                self._dead.add(rank)
            self._next_retry[rank] = time.monotonic() + self.retry_interval
        return first

    def mark_up(self, rank: int) -> None:
        """``rank`` proved alive (a connection to or from it completed its handshake)."""
        with self._lock:
            if rank in self._dead or self._down.pop(rank, None) is None:
                return
        log.warning("torchwire: %s reaches %s again", self._agent.name,
                    self._agent.name_of(rank))

    def forget(self, rank: int) -> None:
        """``rank`` left a dynamic group, or a new member took it: start afresh."""
        with self._lock:
            self._down.pop(rank, None)
            self._dead.discard(rank)
            self.ever_down.discard(rank)
            self._next_retry.pop(rank, None)

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
            mark = c.frames_in + c.heartbeats_in + c.progress_in
            old = self._seen.get(c)
            if old is None or old[0] != mark:
                seen[c] = (mark, now)
                continue
            seen[c] = old
            silent = now - old[1]
            if silent >= self.timeout:
                agent.peer_lost(c.peer_rank, f"no heartbeat for {silent:.1f} s (heartbeat_"
                                 f"timeout={self.timeout:g} s): frozen or unreachable")
            elif silent >= self.interval * 0.9 and c not in self._pinging:
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
        agent = self._agent
        try:
            agent.reconnect(rank)
        except WorkerUnavailableError as exc:
            why, dead = self.connect_failed(rank, exc)
            if dead:
                self.mark_down(rank, why, dead=True)
            log.debug("torchwire: %s: reconnecting to rank %d failed: %s", agent.name, rank, exc)
        except Exception as exc:
            log.debug("torchwire: %s: reconnecting to rank %d failed: %s", agent.name, rank, exc)
        finally:
            with self._lock:
                self._retrying.discard(rank)
                self._next_retry[rank] = time.monotonic() + self.retry_interval
