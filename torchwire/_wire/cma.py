"""Cross-memory attach: read a same-host peer's tensor bytes straight from its memory.

``process_vm_readv(2)`` copies from another process's address space into ours
in one system call: one copy end to end, no socket buffer in between (the
channel TensorPipe calls "cma").  The kernel allows it between processes of
the same user unless a security module (Yama ``ptrace_scope`` >= 1 without a
parent relation, seccomp, containers in other PID namespaces) forbids it, so a
connection uses it only after a probe: the reader tries to read a known token
from the peer's published probe address and compares.

The sender keeps each tensor alive until the receiver says it has read it
(a RELEASE frame).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import secrets
import sys


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _readv = _libc.process_vm_readv
        _readv.restype = ctypes.c_ssize_t
        _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                           ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    except (OSError, AttributeError):
        _readv = None

_TOKEN = secrets.token_bytes(16)
_PROBE = ctypes.create_string_buffer(_TOKEN, len(_TOKEN))


def available() -> bool:
    return _readv is not None


def probe_record() -> dict | None:
    """What a worker publishes so that peers can check they may read its memory."""
    if _readv is None:
        return None
    return {"pid": os.getpid(), "addr": ctypes.addressof(_PROBE), "token": _TOKEN.hex()}


def can_read(record: dict | None) -> bool:
    """Can this process read the memory of the process that published ``record``?"""
    if _readv is None or not record:
        return False
    token = bytes.fromhex(record["token"])
    buf = ctypes.create_string_buffer(len(token))
    try:
        read(record["pid"], record["addr"], ctypes.addressof(buf), len(token))
    except OSError:
        return False
    return buf.raw == token


def read(pid: int, remote_addr: int, local_addr: int, n: int) -> None:
    """Copy ``n`` bytes from ``pid``'s ``remote_addr`` to our ``local_addr``.

    Raises:
        OSError: the kernel refused or the peer's memory is gone.
    """
    done = 0
    while done < n:
        local = _IOVec(local_addr + done, n - done)
        remote = _IOVec(remote_addr + done, n - done)
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += got
