"""``WorkerRecord``: what a worker publishes about itself at rendezvous.

Records travel through the rendezvous store as JSON objects (never pickles: the store
is reachable by anyone who reaches its port), under these keys::

    name, rank       who it is
    host             a string equal for two workers exactly when they share a kernel
                     and network namespace (same-host channels need it)
    tcp              [address, port] of its TCP listener
    unix             its abstract Unix socket's name (null off Linux)
    pid, cma         its pid, and what a peer reads to check it may read its memory
                     ({pid, addr, token}; null where cross-memory attach is unavailable)
    shm              whether it takes buffers in shared-memory segments
    security         whether a user secret and TLS are set (workers must agree)
    device_maps, devices, device_count   its CUDA device maps, devices and count
    cuda_visible, cuda_ipc   its CUDA_VISIBLE_DEVICES, and whether it shares CUDA memory
                     with workers of its host (TORCHWIRE_CUDA_IPC is not "0")
    incarnation      0 for the first process of its rank; one more for each process
                     that took the rank back after its predecessor died (a rejoin)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .errors import RendezvousError


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerRecord:
    name: str
    rank: int
    host: str
    tcp: tuple[str, int]
    unix: str | None = None
    pid: int = 0
    cma: dict | None = None
    shm: bool = False
    security: dict = dataclasses.field(default_factory=dict)
    device_maps: dict = dataclasses.field(default_factory=dict)
    devices: tuple[str, ...] = ()
    device_count: int = 0
    cuda_visible: str | None = None
    cuda_ipc: bool = False
    max_message_size: int = 0  # the largest frame it accepts (0: not published)
    incarnation: int = 0  # how many processes held this rank before this one

    def describe(self) -> str:
        """``"incarnation N (pid P)"``, for messages about a restart."""
        return f"incarnation {self.incarnation} (pid {self.pid})"

    def to_json(self) -> dict[str, Any]:
        """The JSON object published in the store."""
        d = dataclasses.asdict(self)
        d["tcp"] = list(self.tcp)
        d["devices"] = list(self.devices)
        return d

    @classmethod
    def from_json(cls, d) -> WorkerRecord:
        """A record read from the store.

        Raises:
            RendezvousError: not a worker record (a missing or mistyped field).
        """
        try:
            rec = cls(name=d["name"], rank=d["rank"], host=d["host"],
                      tcp=(d["tcp"][0], d["tcp"][1]), unix=d.get("unix"), pid=d.get("pid", 0),
                      cma=d.get("cma"), shm=bool(d.get("shm")), security=d.get("security") or {},
                      device_maps=d.get("device_maps") or {},
                      devices=tuple(d.get("devices") or ()),
                      device_count=d.get("device_count", 0),
                      cuda_visible=d.get("cuda_visible"),
                      cuda_ipc=bool(d.get("cuda_ipc")),
                      max_message_size=int(d.get("max_message_size") or 0),
                      incarnation=int(d.get("incarnation") or 0))
        except (KeyError, IndexError, TypeError) as exc:
            raise RendezvousError(f"malformed worker record in the rendezvous store: {exc!r} "
                                  f"in {d!r:.200}") from None
        if not (isinstance(rec.name, str) and isinstance(rec.rank, int)
                and isinstance(rec.host, str) and isinstance(rec.tcp[0], str)
                and isinstance(rec.tcp[1], int)):
            raise RendezvousError(f"malformed worker record in the rendezvous store: {d!r:.200}")
        return rec
