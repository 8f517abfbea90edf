"""A handshake recorded on one connection of a job and replayed on another is refused.

What binds a connection (``torchwire/_wire/auth.py``): the client's HELLO carries
an HMAC over the server's fresh challenge nonce, so bytes recorded from one
connection prove nothing on the next, and no frame is read before a HELLO is
proved.  The replayed stream carries a pickle that would create a file if loaded.
"""

from __future__ import annotations

import os
import socket

import pytest

import torchwire.rpc as rpc
from _cluster import run_world
from test_auth import _capture_logs, _evil_frame, _wait_closed
from torchwire._wire import frame as F
from torchwire._wire.auth import client_handshake

pytestmark = pytest.mark.timeout(60)


class _Recorder:
    """A socket that keeps a copy of every byte sent through it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent = bytearray()

    def sendall(self, data) -> None:
        self.sent += data
        self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _add(a, b):
    return a + b


def test_a_handshake_replayed_on_another_connection_is_refused(tmp_path):
    target = str(tmp_path / "pwned")

    def body(rank, world_size):
        logs = _capture_logs()
        if rank == 0:
            return logs, None
        agent = rpc.api._get_current_rpc_agent()
        address = tuple(agent.names.member(0).record.tcp)
        # 1. a genuine connection of this job (our key, our rank), recorded
        first = _Recorder(socket.create_connection(address, 5))
        client_handshake(first, rank, agent.links.job, 0, transport="tcp")
        hello = bytes(first.sent)
        first.sendall(F.encode_frame(F.K_GOODBYE, 0, 0))  # an orderly close
        first.sock.close()
        # 2. a new connection: its own challenge, answered with the recorded HELLO
        second = socket.create_connection(address, 5)
        second.settimeout(5)
        challenge = second.recv(4096)
        second.sendall(hello + _evil_frame(target))
        replayed = _wait_closed(second, 10)
        # 3. a new connection: the recorded bytes alone, the challenge unread
        third = socket.create_connection(address, 5)
        third.sendall(hello + _evil_frame(target))
        blind = _wait_closed(third, 10)
        after = rpc.rpc_sync("worker0", _add, args=(1, 2))
        return (len(hello), len(challenge), replayed, blind, after), None

    (logs0, _), (seen, _) = run_world(body, 2, timeout=50, auth_secret="s3cret",
                                      _transports=["tcp"])
    hello_size, challenge_size, replayed, blind, after = seen
    assert hello_size > 0 and challenge_size > 0
    for state, seconds, told in (replayed, blind):
        assert state == "closed" and seconds < 5
        assert b"authentication failed" in told  # the HMAC over the old nonce fails
    assert not os.path.exists(target)  # nothing after the HELLO was unpickled
    assert after == 3  # the job goes on
    assert sum("failed authentication" in m for m in logs0) >= 2, logs0
