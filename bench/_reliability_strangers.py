"""Stranger payloads (parent side of ``bench/reliability.py``): this script plays a
stranger that finds worker1's listening TCP and Unix sockets in ``/proc`` and sends
each one malicious pickles and garbage, on a fresh connection per payload."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import tempfile
import time

from _reliability_job import (CAP, Job, answers_within, check, combine, rss_kib,
                              setup_failed, shutdown_check)

WATCH = 2.0  # seconds this script waits for the worker to close a stranger's connection

STRANGERS = {
    "title": "stranger payloads to the listening sockets",
    "setup": "3 workers; worker0 first makes 10 000 `rpc_async(add)` to worker1 from 4 "
             "threads; then this script finds worker1's listening TCP and Unix sockets in "
             "`/proc/<pid>/fd` + `/proc/net/{tcp,tcp6,unix}` and sends each, on a fresh "
             "connection per payload: a raw malicious pickle, the same after an 8-byte "
             "length, a well-formed torchwire REQUEST frame carrying it, 64 KiB of random "
             f"bytes (watching {WATCH:.0f} s whether the worker closes the connection). Each "
             "pickle creates its own file in a temp dir if it is ever unpickled.",
    "thresholds": [
        "nothing unpickled: no file created",
        "the load before: 10 000/10 000 correct",
        "worker1 alive after the attacks",
        "worker0's call on its existing connection answers within 1 s",
        "a legitimate NEW peer (worker2, first contact) can still call worker1",
        f"graceful `shutdown()` of all three ends within {CAP['shutdown']:.0f} s",
    ],
}


class _CreateFile:
    """Unpickling this creates ``path``: the stand-in for any code a pickle can run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def check_pickle_runs() -> bool:
    """Guard: the attack pickle really creates its file when unpickled."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "guard")
        pickle.loads(pickle.dumps(_CreateFile(path))).close()
        return os.path.exists(path)


def listening_sockets(pid: int) -> list[tuple[str, object]]:
    """(kind, address) of every listening TCP and Unix socket the process holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found: list[tuple[str, object]] = []
    for table, fam in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, state, inode = parts[1], parts[3], parts[9]
            if state != "0A" or inode not in inodes:
                continue
            hexip, hexport = local.split(":")
            raw = bytes.fromhex(hexip)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = socket.inet_ntop(fam, raw)
            if ip in ("0.0.0.0", "::"):
                ip = "127.0.0.1" if fam == socket.AF_INET else "::1"
            found.append(("tcp", (ip, int(hexport, 16))))
    with open("/proc/net/unix") as f:
        lines = f.read().splitlines()[1:]
    for line in lines:
        parts = line.split()
        # Num RefCount Protocol Flags Type St Inode [Path]; 00010000 = listening
        if len(parts) >= 8 and parts[6] in inodes and int(parts[3], 16) & 0x10000:
            path = parts[7]
            found.append(("unix", "\0" + path[1:] if path.startswith("@") else path))
    return found


def _dial(kind: str, addr):
    if kind == "tcp":
        fam = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect(addr)
    return s


def send_and_watch(kind: str, addr, data: bytes) -> str:
    """Send ``data``; say whether the worker closed the connection within WATCH s."""
    try:
        s = _dial(kind, addr)
    except OSError:
        return "connect failed"
    try:
        s.sendall(data)
        s.settimeout(WATCH)
        while True:
            if not s.recv(4096):
                return "closed by worker"
    except socket.timeout:
        return "left open"
    except OSError:
        return "reset by worker"
    finally:
        s.close()


def attack_payloads(tmpdir: str) -> list[tuple[str, bytes]]:
    from torchwire._wire import frame as F

    out = []
    data = pickle.dumps(_CreateFile(os.path.join(tmpdir, "raw-pickle")))
    out.append(("raw pickle", data))
    data = pickle.dumps(_CreateFile(os.path.join(tmpdir, "len-prefixed-pickle")))
    out.append(("length + pickle", struct.pack("<Q", len(data)) + data))
    data = pickle.dumps(_CreateFile(os.path.join(tmpdir, "torchwire-frame")))
    out.append(("torchwire frame + pickle",
                F.encode_header(F.K_REQUEST, 0, 1, len(data), []) + data))
    out.append(("64 KiB random", os.urandom(64 << 10)))
    return out


def _summary(attacks) -> str:
    """'raw pickle: 2× reset by worker, ...' per payload."""
    parts = []
    for name in dict.fromkeys(a[0] for a in attacks):
        counts: dict = {}
        for a in attacks:
            if a[0] == name:
                counts[a[1]] = counts.get(a[1], 0) + 1
        parts.append(f"{name}: " + ", ".join(f"{v}× {c}" for c, v in counts.items()))
    return "; ".join(parts)


def run_strangers(lib: str, skip_note) -> dict:
    job = Job(lib, "strangers", 3, {})
    tmpdir = tempfile.mkdtemp(prefix="torchwire-rel-attack-")
    try:
        if not job.all((1, 2), "armed", 60) or not job.all((0,), "armed", 60 + CAP["load"]):
            out = setup_failed(job)
            return out
        load = job.get(0, "load", 1)
        pid = job.pid(1)
        endpoints = listening_sockets(pid)
        rss0 = rss_kib(pid)
        attacks = [(name, send_and_watch(kind, addr, data))
                   for kind, addr in endpoints for name, data in attack_payloads(tmpdir)]
        time.sleep(0.5)
        created = sorted(os.listdir(tmpdir))
        alive = job.procs[1].is_alive()
        rss1 = rss_kib(pid)
        after = len(listening_sockets(pid)) if alive else 0
        job.phase(1)
        wait = CAP["call"] + 10
        if load is not None and load["status"] == "ok":
            v = load["value"]
            load_ok, load_fig = v["ok"] == v["total"] == 10_000, \
                f"{v['ok']}/{v['total']} in {v['s']:.2f} s"
        else:
            load_ok, load_fig = False, " ".join(
                str(x) for x in answers_within("", load, 1e9)[2:] if x)
        checks = [
            check("nothing unpickled", not created,
                  f"files created: {', '.join(created) if created else 'none'}; "
                  f"{len(endpoints)} listening sockets: {_summary(attacks)}"),
            check("load before: all correct", load_ok, load_fig),
            check("worker alive", alive,
                  f"{'alive' if alive else '**dead**'}, RSS "
                  f"{(rss0 or 0) / 1024:.0f} → {(rss1 or 0) / 1024:.0f} MiB, listening "
                  f"sockets {len(endpoints)} → {after}"),
            combine("call on an existing connection within 1 s",
                    [answers_within("w0", job.get(0, "existing_call", wait), 1.0)]),
            combine("a new peer's first call succeeds",
                    [answers_within("w2", job.get(2, "new_peer", wait), CAP["call"])]),
        ]
        job.all(range(3), "checked", wait)
        job.phase(2)
        checks.append(shutdown_check(job, (0, 1, 2), CAP["shutdown"] + 10))
        return {"checks": checks, "errors": job.errors()}
    finally:
        job.close()
        for name in os.listdir(tmpdir):
            os.unlink(os.path.join(tmpdir, name))
        os.rmdir(tmpdir)
