"""The agent's request counters: for ``rpc.stats()`` and shutdown's termination detection.

Graceful shutdown ends when the requests every worker sent equal those every worker
received, twice in a row (``termination.py``); once a peer was lost, the counts per
pair of workers decide, so they are kept per peer too.
"""

from __future__ import annotations

import collections
import threading


class Counters:
    """Requests sent and received (in total and per peer), replies sent.

    Args:
        world_size: the static job's size (per-peer counts in lists), or None for a
            dynamic group (per-peer counts in dicts: ranks come and go; only counted).
    """

    __slots__ = ("lock", "sent", "received", "replies", "replies_in_place", "sent_to",
                 "recv_from")

    def __init__(self, world_size: int | None) -> None:
        self.lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.replies = 0
        self.replies_in_place = 0  # replies an I/O thread wrote itself, without a pool hop
        if world_size is None:
            self.sent_to = collections.defaultdict(int)
            self.recv_from = collections.defaultdict(int)
        else:
            self.sent_to = [0] * world_size
            self.recv_from = [0] * world_size

    def __repr__(self) -> str:
        return (f"<Counters sent={self.sent} received={self.received} replies={self.replies} "
                f"in_place={self.replies_in_place}>")

    def count_sent(self, peer: int) -> None:
        with self.lock:
            self.sent += 1
            self.sent_to[peer] += 1

    def count_received(self, peer: int, n: int) -> None:
        with self.lock:
            self.received += n
            self.recv_from[peer] += n

    def count_reply(self, n: int) -> None:
        """A reply is about to be written (``n=1``), or was not after all (``n=-1``)."""
        with self.lock:
            self.replies += n

    def count_reply_in_place(self) -> None:
        with self.lock:
            self.replies_in_place += 1

    def shutdown_record(self, per_peer: bool, down: list[int]) -> str:
        """This worker's termination-detection record: ``"sent,received"``, then, with
        ``per_peer`` or peers ``down``, ``";s:r s:r ...;down,ranks"``."""
        with self.lock:
            head = f"{self.sent},{self.received}"
            if not (per_peer or down):
                return head
            vec = " ".join(f"{s}:{r}" for s, r in zip(self.sent_to, self.recv_from))
        return f"{head};{vec};{','.join(map(str, down))}"
