"""Cross-memory attach: read a same-host peer's tensor bytes straight from its memory.

``process_vm_readv(2)`` copies from another process's address space into ours
in one system call: one copy end to end, no socket buffer in between (the
channel TensorPipe calls "cma").  The kernel allows it between processes of
the same user unless a security module (Yama ``ptrace_scope`` >= 1 without a
parent relation, seccomp, containers in other PID namespaces) forbids it, so a
connection uses it only after a probe: the reader tries to read a known token
from the peer's published probe address and compares.

A frame's buffers from ``min_size`` stay in the sender's memory; the stream
carries ``REMOTE_REF`` (address, the frame's release token) for each.  The
transfer, per frame::

    sender                                   receiver
    token = next token; hold the tensors
    REQUEST/RESPONSE (CMA flag, REMOTE_BIT) ->
                                             read each buffer (process_vm_readv)
                                          <- RELEASE (token), written by the reader
    drop the tensors                            itself unless another thread writes

A connection that closes drops what it held: the peer can no longer ask for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import secrets
import sys

from ..._base.errors import ProtocolError
from .. import frame as F
from ..buffers import byte_view, prefault, receive_buffer
from . import Channel, OutFrame, register


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

MIN_SIZE = 256 * 1024  # smaller buffers are cheaper inline than a syscall + a RELEASE


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


@register
class CmaChannel(Channel):
    """The CMA channel of one connection, to the process ``pid``.

    Args:
        pid: the peer's process id (its probe record read back right).
        min_size: the smallest buffer sent this way.
    """

    name = "cma"
    bit = F.REMOTE_BIT
    release_flag = 0

    def __init__(self, pid: int, min_size: int = MIN_SIZE) -> None:
        self.pid = pid
        self.min_size = max(1, min_size)
        self._tokens = itertools.count(1)  # next() is atomic under the GIL
        self._held: dict[int, object] = {}  # token -> the frame's tensors, until RELEASE

    def encode(self, conn, frame: OutFrame, t, n: int) -> bool:
        if frame.state is None:
            frame.state = next(self._tokens)
            frame.flags |= F.F_CMA
        frame.add(n | F.REMOTE_BIT, F.REMOTE_REF.pack(t.data_ptr(), frame.state))
        return True

    def ready(self, conn, frame: OutFrame) -> None:
        self._held[frame.state] = frame.tensors  # before it is written: RELEASE follows

    def drop(self, conn, frame: OutFrame) -> None:
        self._held.pop(frame.state, None)

    def decode(self, conn, rx, n: int):
        addr, token = rx.read_ref(F.REMOTE_REF)
        t, fresh = receive_buffer(n)
        if fresh:
            prefault(byte_view(t, n))
        try:
            read(self.pid, addr, t.data_ptr(), n)
        except OSError as exc:
            raise ProtocolError(f"cannot read a buffer from rank {conn.peer_rank}'s memory: "
                                f"{exc}") from exc
        rx.ack = token  # the reader sends the RELEASE once the frame is read
        return t

    def released(self, conn, token: int, flags: int) -> None:
        self._held.pop(token, None)

    def holding(self, conn) -> int:
        return len(self._held)

    def close(self, conn) -> None:
        self._held.clear()
