"""Authentication and listener binding: strangers, other jobs and attacks on real workers.

The end-to-end tests run real worker processes (``run_world``) and, beside them,
a stranger process that attacks their real TCP port and Unix socket.  The unit
tests drive the handshake over socket pairs in this process.  TLS, and security
settings that only some workers have, are tested in tests/test_auth_tls.py.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import secrets
import socket
import threading
import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import new_init_method, options, run_world, wait_until
from torchwire import _serialization as ser
from torchwire import AuthenticationError, ConnectError, ConnectionBrokenError, ProtocolError
from torchwire._wire import frame as F
from torchwire._wire.auth import CHALLENGE, HELLO, JobAuth, client_handshake, server_handshake
from torchwire._wire.listener import Listener

_fork = mp.get_context("fork")


# ---------------------------------------------------------------- helpers


class _CreateFile:
    """Unpickling this creates ``path``: the stand-in for any code a pickle can run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil_frame(path: str) -> bytes:
    payload = pickle.dumps(_CreateFile(path))
    return F.encode_header(F.K_REQUEST, 0, 1, len(payload), []) + payload


def _auth(secret: bytes | None = None, job: bytes = b"j" * 16, timeout: float = 5.0, tls=None):
    return JobAuth(secret, source="options", tls=tls, timeout=timeout).bind(job)


def _wait_closed(sock: socket.socket, limit: float) -> tuple[str, float, bytes]:
    """Read until the peer closes; return ("closed" | "open", seconds, what it sent)."""
    t0 = time.monotonic()
    got = bytearray()
    sock.settimeout(limit)
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
    except ConnectionResetError:
        pass
    except socket.timeout:
        return "open", time.monotonic() - t0, bytes(got)
    finally:
        sock.close()
    return "closed", time.monotonic() - t0, bytes(got)


def _capture_logs() -> list[str]:
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("torchwire").addHandler(Keep(logging.WARNING))
    return messages


def _add(a, b):
    return a + b


def _serve_pair(server_auth, client_auth, client_rank=1, server_rank=0, world_size=2):
    """Run both handshake sides over a socket pair; return (server result, client result)."""
    a, b = socket.socketpair()
    out = {}

    def serve():
        try:
            out["server"] = server_handshake(a, server_rank, server_auth, world_size, "unix")[1]
        except Exception as exc:
            out["server"] = exc

    t = threading.Thread(target=serve)
    t.start()
    try:
        client_handshake(b, client_rank, client_auth, server_rank, transport="unix")
        out["client"] = "ok"
    except Exception as exc:
        out["client"] = exc
    t.join(10)
    a.close()
    b.close()
    return out["server"], out["client"]


# ---------------------------------------------------------------- handshake units


def test_handshake_with_the_same_secret_succeeds_both_ways():
    server, client = _serve_pair(_auth(b"s3cret"), _auth(b"s3cret"))
    assert (server, client) == (1, "ok")


def test_handshake_with_a_different_secret_is_refused_with_a_clear_reason():
    server, client = _serve_pair(_auth(b"s3cret"), _auth(b"other"))
    assert isinstance(server, AuthenticationError)
    assert isinstance(client, AuthenticationError)
    assert "refused" in str(client) and "auth_secret" in str(client)


def test_the_same_secret_in_another_job_is_refused():
    # The key binds the job token from rendezvous: another job cannot replay into this one.
    server, client = _serve_pair(_auth(b"s3cret", job=b"a" * 16), _auth(b"s3cret", job=b"b" * 16))
    assert isinstance(server, AuthenticationError) and isinstance(client, AuthenticationError)


def test_client_detects_an_impostor_server():
    # A server that does not know the key: it answers any HELLO with a made-up proof.
    a, b = socket.socketpair()

    def impostor():
        a.sendall(F.encode_header(F.K_CHALLENGE, 0, 0, CHALLENGE.size, [])
                  + CHALLENGE.pack(0, secrets.token_bytes(32)))
        a.recv(F.HEADER_SIZE + HELLO.size)
        a.sendall(F.encode_header(F.K_HELLO_ACK, 0, 0, 32, []) + secrets.token_bytes(32))

    t = threading.Thread(target=impostor)
    t.start()
    with pytest.raises(AuthenticationError, match="failed to prove"):
        client_handshake(b, 1, _auth(b"s3cret"), 0, transport="unix")
    t.join(5)
    a.close()
    b.close()


def test_a_silent_peer_is_dropped_after_the_handshake_timeout():
    a, b = socket.socketpair()
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match="timed out after 0.5s") as info:
        server_handshake(a, 0, _auth(b"s", timeout=0.5), 2, "unix")
    assert isinstance(info.value.__cause__, socket.timeout) and not info.value.refused
    assert time.monotonic() - t0 < 2.0
    a.close()
    b.close()


def test_a_trickling_peer_is_dropped_at_one_deadline_not_one_per_read():
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle():
        hello = F.encode_header(F.K_HELLO, 0, 0, HELLO.size, []) + bytes(HELLO.size)
        for byte in hello:
            if stop.wait(0.1):
                return
            try:
                b.send(bytes([byte]))
            except OSError:
                return

    t = threading.Thread(target=trickle)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match="timed out"):
        server_handshake(a, 0, _auth(b"s", timeout=0.8), 2, "unix")
    elapsed = time.monotonic() - t0
    stop.set()
    t.join(5)
    a.close()
    b.close()
    assert elapsed < 2.0


def test_a_peer_that_hangs_up_midway_breaks_the_handshake_on_either_side():
    # The server's side: a liveness probe dials and hangs up at once.
    a, b = socket.socketpair()
    b.close()
    with pytest.raises(ConnectionBrokenError, match="during the handshake") as info:
        server_handshake(a, 0, _auth(b"s"), 2, "unix")
    assert not isinstance(info.value, ConnectError) and info.value.__cause__ is not None
    a.close()
    # The client's side: the server closes before its challenge.
    a, b = socket.socketpair()
    a.close()
    with pytest.raises(ConnectionBrokenError, match="during the handshake"):
        client_handshake(b, 1, _auth(b"s"), 0, transport="unix")
    b.close()


def test_dialling_nobody_is_a_refused_connect_error():
    from torchwire._wire.listener import connect_tcp, connect_unix
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ConnectError) as info:
            connect_tcp(("127.0.0.1", port), 2.0)
    assert info.value.refused and isinstance(info.value.__cause__, ConnectionRefusedError)
    with pytest.raises(ConnectError) as info:
        connect_unix("\0torchwire-test-nobody-listens-here", 2.0)
    assert info.value.refused


def test_a_payload_frame_instead_of_hello_is_refused_unread(tmp_path):
    target = tmp_path / "pwned"
    # A HELLO with an absurd length is refused from its header: nothing allocated or read.
    huge = F.pack_header(F.K_HELLO, 0, 0, 1 << 40, 0)
    for data, why in ((_evil_frame(str(target)), "expected a HELLO frame"),
                      (huge, "exceeds max message size")):
        a, b = socket.socketpair()
        try:
            b.sendall(data)
            with pytest.raises(ProtocolError, match=why):
                server_handshake(a, 0, _auth(b"s"), 2, "unix")
        finally:
            a.close()
            b.close()
    assert not target.exists()


def test_the_test_pickle_really_runs_code_when_unpickled(tmp_path):
    # Guard for the end-to-end test: this payload does create a file when loaded.
    target = tmp_path / "created"
    payload = _evil_frame(str(target))[F.HEADER_SIZE:]
    f = ser.loads(payload, [])
    f.close()
    assert target.exists()


def test_the_listener_caps_concurrent_handshakes():
    release = threading.Event()
    entered = []

    def handler(sock, transport):
        entered.append(sock)
        release.wait(10)
        sock.close()

    listener = Listener("127.0.0.1", 0, unix=False, max_handshakes=3)
    listener.set_handler(handler)
    try:
        socks = [socket.create_connection(listener.tcp_address, 5) for _ in range(6)]
        assert wait_until(lambda: len(entered) >= 3, 5)
        # the three over the cap are closed (the handler holds the others up to 10 s)
        states = [_wait_closed(s, 5)[0] for s in socks[3:]]
        assert sorted(states) == ["closed"] * 3
        assert len(entered) == 3
        for s in socks[:3]:  # the three in their handshake stay open until released
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
        release.set()
        for s in socks[:3]:
            assert _wait_closed(s, 5)[0] == "closed"
        late = socket.create_connection(listener.tcp_address, 5)  # slots are free again
        assert wait_until(lambda: len(entered) >= 4, 5)
        assert len(entered) == 4
        late.close()
    finally:
        release.set()
        listener.close()


# ---------------------------------------------------------------- end to end: strangers


def _stranger(addr_q, out_q, done, target: str, timeout: float) -> None:
    """Attack a worker's TCP port and Unix socket; report what happened to each attack."""
    report = {}
    try:
        tcp, unix = addr_q.get(timeout=60)

        def dial(kind):
            if kind == "tcp":
                return socket.create_connection(tuple(tcp), 5)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(unix)
            return s

        for kind in ("tcp", "unix"):
            # 1. a well-formed frame carrying a malicious pickle, no handshake at all
            s = dial(kind)
            s.sendall(_evil_frame(target))
            report[f"{kind} pickle"] = _wait_closed(s, 10)[:2]
            # 2. answers the challenge with a HELLO whose HMAC is wrong, then the pickle
            s = dial(kind)
            s.settimeout(5)
            s.recv(F.HEADER_SIZE + CHALLENGE.size)
            hello = HELLO.pack(1, secrets.token_bytes(32), secrets.token_bytes(32))
            s.sendall(F.encode_header(F.K_HELLO, 0, 0, HELLO.size, []) + hello
                      + _evil_frame(target))
            state, elapsed, got = _wait_closed(s, 10)
            report[f"{kind} bad hmac"] = (state, elapsed, b"authentication failed" in got)
            # 3. connects and sends nothing
            report[f"{kind} idle"] = _wait_closed(dial(kind), timeout + 5)[:2]
        # 4. a worker of another job (its own rendezvous, its own secret) dials in
        rpc.init_rpc("intruder", rank=0, world_size=1,
                     rpc_backend_options=options(new_init_method()))
        # its job's JobAuth: another secret, another token
        own_auth = rpc.api._get_current_rpc_agent().links.job
        for kind in ("tcp", "unix"):
            s = dial(kind)
            try:
                client_handshake(s, 1, own_auth, 0, transport=kind)
                report[f"{kind} other job"] = "accepted"
            except AuthenticationError as exc:
                report[f"{kind} other job"] = f"refused: {exc}"
            finally:
                s.close()
        rpc.shutdown()
    except BaseException as exc:
        report["error"] = repr(exc)
    finally:
        out_q.put(report)
        done.set()


def test_strangers_and_other_jobs_are_refused_and_no_pickle_is_loaded(tmp_path):
    target = str(tmp_path / "pwned")
    addr_q, out_q, done = _fork.Queue(), _fork.Queue(), _fork.Event()
    handshake_timeout = 2.0
    stranger = _fork.Process(target=_stranger,
                             args=(addr_q, out_q, done, target, handshake_timeout))
    stranger.start()

    def body(rank, world_size):
        logs = _capture_logs()
        if rank == 0:
            listener = rpc.api._get_current_rpc_agent().links.listener
            addr_q.put((list(listener.tcp_address), listener.unix_address))
        assert done.wait(60), "the stranger did not finish"
        peer = f"worker{1 - rank}"
        value = rpc.rpc_sync(peer, _add, args=(torch.ones(2), rank)).tolist()
        return os.path.exists(target), value, logs

    try:
        results = run_world(body, 2, timeout=90, handshake_timeout=handshake_timeout)
        report = out_q.get(timeout=10)
    finally:
        stranger.join(10)
        if stranger.is_alive():
            stranger.kill()
    assert "error" not in report, report
    for kind in ("tcp", "unix"):
        state, elapsed = report[f"{kind} pickle"]
        assert state == "closed" and elapsed < 2, report
        state, elapsed, told = report[f"{kind} bad hmac"]
        assert state == "closed" and elapsed < 2 and told, report
        state, elapsed = report[f"{kind} idle"]
        assert state == "closed" and elapsed < handshake_timeout + 3, report
        assert report[f"{kind} other job"].startswith("refused: "), report
        assert "auth_secret" in report[f"{kind} other job"]
    assert not os.path.exists(target)
    (created0, value0, logs0), (created1, value1, _) = results
    assert not created0 and not created1
    assert value0 == [1.0, 1.0] and value1 == [2.0, 2.0]  # the job keeps serving
    refusals = [m for m in logs0 if "refused" in m]
    assert any("tcp connection" in m and "expected a HELLO" in m for m in refusals), logs0
    assert any("unix connection" in m and "expected a HELLO" in m for m in refusals), logs0
    assert sum("failed authentication" in m for m in refusals) >= 4, logs0  # bad hmac, other job
    assert any("timed out" in m for m in refusals), logs0


# ---------------------------------------------------------------- end to end: secrets


def _init_and_call(rank, world_size, init_method, opts_by_rank, env_by_rank=None):
    """init_rpc with per-rank options (and environment), one call to the other rank."""
    for key, value in (env_by_rank or {}).get(rank, {}).items():
        os.environ[key] = value
    t0 = time.monotonic()
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, **opts_by_rank[rank]))
    except Exception as exc:
        return "init", type(exc).__name__, str(exc), time.monotonic() - t0
    try:
        t0 = time.monotonic()
        try:
            result = rpc.rpc_sync(f"worker{1 - rank}", _add, args=(rank, 10))
            return "ok", result
        except Exception as exc:
            return "call", type(exc).__name__, str(exc), time.monotonic() - t0
    finally:
        rpc.shutdown()


def test_secret_from_options_on_one_worker_and_environment_on_the_other_works():
    def body(rank, world_size, init_method):
        return _init_and_call(rank, world_size, init_method,
                              {0: {"auth_secret": "correct horse"}, 1: {}},
                              {1: {"TORCHWIRE_SECRET": "correct horse"}})

    assert run_world(body, 2, init=False, timeout=60) == [("ok", 10), ("ok", 11)]


def test_different_secrets_fail_the_first_call_with_a_clear_error_not_a_hang():
    def body(rank, world_size, init_method):
        return _init_and_call(rank, world_size, init_method,
                              {0: {"auth_secret": b"alpha"}, 1: {"auth_secret": b"beta"}})

    for where, name, msg, elapsed in run_world(body, 2, init=False, timeout=60):
        assert (where, name) == ("call", "WorkerUnavailableError")
        assert "refused the connection: authentication failed" in msg
        assert "auth_secret" in msg and "TORCHWIRE_SECRET" in msg
        assert elapsed < 5


def test_options_validate_the_secret_and_tls_files(tmp_path):
    with pytest.raises(ValueError, match="auth_secret"):
        rpc.TorchwireRpcBackendOptions(auth_secret="")
    with pytest.raises(ValueError, match="handshake_timeout"):
        rpc.TorchwireRpcBackendOptions(handshake_timeout=0)
    opts = rpc.TorchwireRpcBackendOptions(tls_certfile=str(tmp_path / "none.pem"))
    with pytest.raises(ValueError, match="all of tls_certfile"):
        JobAuth.from_options(opts)
    assert "s3cret" not in repr(JobAuth.from_options(
        rpc.TorchwireRpcBackendOptions(auth_secret="s3cret")))


# ---------------------------------------------------------------- listener binding


def test_listener_binds_the_chosen_interface_not_every_interface():
    def body(rank, world_size):
        agent = rpc.api._get_current_rpc_agent()
        me = agent.names.member(rank).record.tcp[0]
        return agent.links.listener.tcp_address[0], me, rpc.rpc_sync(f"worker{1 - rank}", _add,
                                                                  args=(rank, 1))

    assert run_world(body, 2, timeout=60) == [("127.0.0.1", "127.0.0.1", 1),
                                              ("127.0.0.1", "127.0.0.1", 2)]
    # Asked for every interface: it binds 0.0.0.0 but advertises an address peers can dial.
    assert run_world(body, 2, timeout=60, _transports=["tcp"], listen_addr="0.0.0.0") == [
        ("0.0.0.0", "127.0.0.1", 1), ("0.0.0.0", "127.0.0.1", 2)]


def test_a_job_across_hosts_without_a_secret_warns_once(caplog):
    from types import SimpleNamespace

    from torchwire._bootstrap.runtime import warn_if_unauthenticated

    def recs(*hosts):
        return [SimpleNamespace(rank=r, host=h) for r, h in enumerate(hosts)]

    token, user = JobAuth(None), JobAuth(b"s", source="options")
    with caplog.at_level(logging.WARNING, logger="torchwire"):
        assert warn_if_unauthenticated(recs("a", "b"), token, 0)
        assert not warn_if_unauthenticated(recs("a", "b"), token, 1)   # rank 0 tells the job
        assert not warn_if_unauthenticated(recs("a", "a"), token, 0)   # one host
        assert not warn_if_unauthenticated(recs("a", "b"), user, 0)    # a secret of the user's
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "2 hosts and no auth_secret" in caplog.records[0].getMessage()
