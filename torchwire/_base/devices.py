"""Device maps: which device a tensor lands on at the receiver (torch's TensorPipe rules).

``device_maps[callee] = {local device: callee device}``.  A request's tensor on a
mapped local device is delivered on the callee's device; a reply's tensor goes
back through the inverse of the caller's map.  Maps are 1-to-1 (so invertible),
and are checked once at init against every worker's device count, on every
worker, so all of them fail with the same clear error.

Tensors travel through host memory: the sender copies a CUDA tensor to the CPU,
the receiver copies it onto the mapped device.
"""

from __future__ import annotations

import os

import torch


def to_device(device) -> torch.device:
    """A CUDA device from an int, str or ``torch.device`` (what ``devices`` accepts)."""
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type != "cuda":
        raise ValueError(f"`set_devices` expect a list of CUDA devices, but got device type "
                         f"{d.type}.")
    return d


def _device(x) -> torch.device:
    d = torch.device("cuda", x) if isinstance(x, int) and not isinstance(x, bool) \
        else torch.device(x)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", 0)
    return d


def to_device_map(device_map: dict) -> dict[torch.device, torch.device]:
    """Normalize one worker's map; it must be 1-to-1 (torch's wording on failure)."""
    if not isinstance(device_map, dict):
        raise TypeError(f"a device map must be a dict of devices, got "
                        f"{type(device_map).__name__}")
    out: dict[torch.device, torch.device] = {}
    reverse: dict[torch.device, torch.device] = {}
    for k, v in device_map.items():
        k, v = _device(k), _device(v)
        if v in reverse and reverse[v] != k:
            raise ValueError("`device_map` only supports 1-to-1 mapping, trying to map "
                             f"{k} and {reverse[v]} to {v}")
        out[k] = v
        reverse[v] = k
    return out


def encode(device_maps: dict, devices: list) -> dict:
    """JSON-able form for the rendezvous record."""
    return {"device_maps": {name: {str(k): str(v) for k, v in m.items()}
                            for name, m in device_maps.items()},
            "devices": [str(d) for d in devices],
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_ipc": os.environ.get("TORCHWIRE_CUDA_IPC", "1") != "0"}


def _valid(d: torch.device, count: int) -> bool:
    return d.type == "cpu" or (d.type == "cuda" and 0 <= (d.index or 0) < count)


def check_all(records: list, dynamic: bool = False) -> None:
    """Check every worker's device maps and devices against every device count.

    ``records``: every worker's ``WorkerRecord``.  ``dynamic``: the group's membership
    changes, so a map may name a worker that has not joined yet; such a target is
    checked when it joins.

    Raises:
        ValueError: a bad name, a duplicated or out-of-range device (torch's phrases).
    """
    names = {r.name for r in records}
    counts = {r.name: r.device_count for r in records}
    for r in records:
        node = r.name
        devices = [torch.device(d) for d in r.devices]
        if len(set(devices)) != len(devices):
            raise ValueError(f"Node {node} has duplicated devices\ndevices = {devices}")
        if not all(_valid(d, counts[node]) for d in devices):
            raise ValueError(f"Node {node} has devices with invalid indices\n"
                             f"devices = {devices}\ndevice count = {counts[node]}")
        maps = r.device_maps
        unknown = sorted(set(maps) - names)
        if unknown and dynamic:
            maps = {target: m for target, m in maps.items() if target in names}
        elif unknown:
            raise ValueError(f"Node {node} has invalid target node names in its device maps\n"
                             f"device maps = {sorted(maps)}\nnode names = {sorted(names)}")
        for target, m in maps.items():
            m = {torch.device(k): torch.device(v) for k, v in m.items()}
            if len(set(m.values())) != len(m):
                raise ValueError(f"Node {node} has duplicated target devices in its device "
                                 f"map for {target}\ndevice map = {m}")
            if devices and not set(m) <= set(devices):
                raise ValueError(f"Node {node} has unexpected source devices in its device "
                                 f"map for {target}\ndevice map = {m}\ndevices = {devices}")
            if not all(_valid(d, counts[node]) for d in m):
                raise ValueError(f"Node {node} has source devices with invalid indices in its "
                                 f"device map for {target}\ndevice map = {m}\n"
                                 f"device count = {counts[node]}")
            if not all(_valid(d, counts[target]) for d in m.values()):
                raise ValueError(f"Node {node} has target devices with invalid indices in its "
                                 f"device map for {target}\ndevice map = {m}\n"
                                 f"device count = {counts[target]}")


class Router:
    """Where a tensor on ``device`` goes when sent to rank ``dest``."""

    def __init__(self, my_name: str, records: list) -> None:
        self._out: dict[int, dict] = {}  # dest rank -> my map to it (requests)
        self._back: dict[int, dict] = {}  # dest rank -> inverse of its map to me (replies)
        me = next((r for r in records if r.name == my_name), None)
        self.rank = me.rank if me is not None else -1
        mine = me.device_maps if me is not None else {}
        # another process of this kernel, the same GPUs under the same indices, both
        # willing: CUDA IPC (a process cannot open its own memory's IPC handle)
        self._ipc = {r.rank for r in records
                     if me is not None and r is not me and me.cuda_ipc and r.cuda_ipc
                     and r.host == me.host and r.cuda_visible == me.cuda_visible}
        for r in records:
            m = mine.get(r.name, {})
            self._out[r.rank] = {torch.device(k): torch.device(v) for k, v in m.items()}
            theirs = r.device_maps.get(my_name, {})
            self._back[r.rank] = {torch.device(v): torch.device(k) for k, v in theirs.items()}

    def __bool__(self) -> bool:
        return any(self._out.values()) or any(self._back.values())

    def ipc(self, dest: int) -> bool:
        """Whether CUDA tensors to rank ``dest`` may travel by CUDA IPC."""
        return dest in self._ipc

    @property
    def routes_cpu(self) -> bool:
        """Whether some map sends CPU tensors elsewhere (``{"cpu": 0}``)."""
        cpu = torch.device("cpu")
        return any(cpu in m and m[cpu] != cpu
                   for m in (*self._out.values(), *self._back.values()))

    def target(self, dest: int, request: bool | None,
               device: torch.device) -> torch.device | None:
        """Where ``device``'s tensor lands on ``dest``: a request through this worker's
        map to ``dest``, a reply (``request`` False) through the inverse of ``dest``'s
        map to this worker, a one-way message (None) through whichever covers it."""
        if request is None:
            return self._out.get(dest, {}).get(device) or \
                self._back.get(dest, {}).get(device)
        table = (self._out if request else self._back).get(dest, {})
        return table.get(device)
