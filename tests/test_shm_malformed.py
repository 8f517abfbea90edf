"""A receiver's defences against malformed shared-memory input: ``import_fd`` refuses a
descriptor that is unsealed, not a regular file, too small for what it is said to
hold or empty, ``import_back`` a segment its connection does not hold, and a real
Connection fed such frames by hand closes with a ProtocolError and leaves no
descriptor open (a valid frame arrives, and its RELEASE goes back)."""

from __future__ import annotations

import array
import errno
import fcntl
import os
import socket
import threading

import pytest
import torch

from _cluster import run_world
from _shm_helpers import make, same, wait_for
from torchwire import ProtocolError
from torchwire._wire import frame as F
from torchwire._wire.channels import segments as shm
from torchwire._wire.channels.link import ChannelSet
from torchwire._wire.connection import Connection

pytestmark = pytest.mark.skipif(not shm.available(),
                                reason="memfd and descriptor passing are not available")

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


# ----------------------------------------------------------------- bad input


class _StandIn:
    """A connection, as far as shm's import and export functions look at one."""

    closed = False
    peer_rank = 1


def _closed(fd) -> bool:
    try:
        os.fstat(fd)
    except OSError as exc:
        return exc.errno == errno.EBADF
    return False


def _memfd(size, sealed=True):
    fd = os.memfd_create("twtest", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    return fd


_IMPORT_ERRORS = {  # case -> what the ProtocolError says
    "unsealed": "not sealed",
    "pipe": "does not fit",  # not a regular file
    "smaller than said": "does not fit",
    "out of range": "does not fit",
    "empty": "cannot map",
}


@pytest.mark.parametrize("case", list(_IMPORT_ERRORS))
def test_import_fd_rejects_a_malformed_descriptor(case):
    extra = []
    if case == "pipe":
        fd, w = os.pipe()
        extra.append(w)
        args = (1, 4096, 0, 4096)
    elif case == "unsealed":
        fd, args = _memfd(4096, sealed=False), (1, 4096, 0, 4096)
    elif case == "smaller than said":
        fd, args = _memfd(4096), (1, 8192, 0, 8192)
    elif case == "out of range":
        fd, args = _memfd(4096), (1, 4096, 4000, 200)
    else:  # a buffer of 0 bytes: no sender makes one
        fd, args = _memfd(4096), (1, 4096, 0, 0)
    try:
        with pytest.raises(ProtocolError, match=_IMPORT_ERRORS[case]):
            shm.import_fd(_StandIn(), fd, *args)
        assert _closed(fd), "the descriptor was left open"
    finally:
        for x in extra:
            os.close(x)


def test_import_back_of_an_unknown_segment():
    with pytest.raises(ProtocolError, match="does not hold"):
        shm.import_back(_StandIn(), 987_654, 0, 4096)


def test_import_of_valid_segments_and_back_references():
    """The counterpart of the two tests above, in a child process (it maps segments and
    starts the release thread): a sealed segment maps, with its bytes; a back-reference
    is accepted only from the connection that holds the segment, within its size."""
    def body(rank, world_size, init_method):
        conn, other = _StandIn(), _StandIn()
        data = make(torch.uint8, 3 * 4096, 5)
        fd = _memfd(3 * 4096)
        os.pwrite(fd, data.numpy().tobytes(), 0)
        t = shm.import_fd(conn, fd, 1, 3 * 4096, 4096 + 10, 5000)
        imported = same(t, data[4096 + 10:4096 + 10 + 5000]) and _closed(fd)
        seg_id, _, offset, how, dup = shm.export(data, data.nbytes, conn)
        os.close(dup)
        errors = []
        for c, off, n in ((other, 0, 4096), (conn, 0, 4 * 4096), (conn, 3 * 4096, 1)):
            try:
                shm.import_back(c, seg_id, off, n)
                errors.append(None)
            except ProtocolError as exc:
                errors.append(str(exc))
        back = shm.import_back(conn, seg_id, 100, 1000)
        return (imported, how == shm.HOW_FD, errors, same(back, data[100:1100]),
                shm.stats()["own_mappings"])

    imported, by_fd, errors, back_same, own = run_world(body, 1, init=False)[0]
    assert imported
    assert by_fd
    assert all(e is not None for e in errors), errors
    assert back_same and own == 1


def _raw_frame(nbytes, ref):
    """A REQUEST (id 7, empty payload) of one shared-memory buffer."""
    return F.encode_header(F.K_REQUEST, 0, 7, 0, [nbytes | F.SHM_BIT]) + ref


def _memfd_links() -> int:
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += "memfd:twtest" in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return n


_READ_ERRORS = {  # case -> what the ProtocolError closing the connection says
    "valid": None,
    "unsealed": "not sealed",
    "no descriptor": "without its descriptor",
    "unknown mode": "unknown shared-memory buffer mode",
    "unknown back-reference": "does not hold",
    "channel off": "without that channel",
}


@pytest.mark.parametrize("case", list(_READ_ERRORS))
def test_a_connection_reading_a_malformed_shm_buffer_closes(case):
    """A real Connection on a socketpair, fed frames by hand: a malformed buffer ends
    the connection with a ProtocolError, and the descriptor that came with it is
    closed; a valid one arrives, and its RELEASE goes back once it is dropped."""
    def body(rank, world_size, init_method):
        links0 = _memfd_links()  # descriptors inherited from the test process
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        got, closed = [], threading.Event()
        result = {}

        def on_frames(conn, frames, at_rest):
            got.extend(frames)
            return False

        def on_close(conn, exc):
            result["exc"] = exc
            closed.set()

        conn = Connection(ours, 0, on_frames, on_close, initiated=False, transport="unix",
                          channels=ChannelSet(shm_recv=case != "channel off"))
        conn.start()
        fd = _memfd(2 * 4096, sealed=case != "unsealed")
        os.pwrite(fd, bytes(range(256)) * 32, 0)
        how = {"unknown mode": 9, "unknown back-reference": shm.HOW_BACK}.get(case, shm.HOW_FD)
        msg = _raw_frame(5000, F.SHM_REF.pack(3, 2 * 4096, 100, how))
        anc = [] if case == "no descriptor" else [
            (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        theirs.sendmsg([msg], anc)
        os.close(fd)
        if case == "valid":
            assert wait_for(lambda: got)
            (kind, _, rid, _, tensors), = got
            expect = (bytes(range(256)) * 32)[100:5100]
            ok = kind == F.K_REQUEST and rid == 7 and bytes(tensors[0].numpy()) == expect
            got.clear()
            del tensors
            theirs.settimeout(10)
            release = F.HEADER.unpack(theirs.recv(F.HEADER_SIZE, socket.MSG_WAITALL))
            theirs.close()
            closed.wait(10)
            return ok, release[2:5], _memfd_links() - links0
        done = closed.wait(10)
        exc = result.get("exc")
        theirs.close()
        return done, type(exc).__name__, str(exc), _memfd_links() - links0

    result = run_world(body, 1, init=False)[0]
    if case == "valid":
        ok, release, links = result
        assert ok
        assert release == (F.K_RELEASE, F.F_SHM, 3)  # kind, flags, segment id
        assert links == 0
        return
    done, exc_type, message, links = result
    assert done, "the connection stayed open"
    assert exc_type == "ProtocolError", message
    assert _READ_ERRORS[case] in message, message
    assert links == 0, "the descriptor the peer sent is still open"
