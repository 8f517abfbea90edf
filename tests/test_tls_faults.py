"""TLS faults between real workers: a certificate for another host, an expired one,
and a client that shows none.  Each is refused during the TLS handshake, with an
error that names the cause on the side that connects, and nothing the peer sent is
unpickled (the payload would create a file)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time

import pytest

import torchwire.rpc as rpc
from _cluster import freeze, options, run_world, wait_until
from test_auth import _capture_logs, _CreateFile, _evil_frame

pytestmark = pytest.mark.timeout(90)

_fork = mp.get_context("fork")

_CA_CONFIG = """[ca]
default_ca = test
[test]
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = any
copy_extensions = none
[any]
commonName = supplied
"""


def _openssl(d, *args) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=30)


def _issue(d, name: str, san: str, start: str, end: str) -> dict:
    """A worker key and certificate signed by the CA in ``d``, valid from ``start`` to
    ``end`` (``YYYYMMDDHHMMSSZ``) for the names in ``san``."""
    _openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (d / f"{name}.ext").write_text(f"[ext]\nsubjectAltName={san}\nbasicConstraints=CA:FALSE\n")
    _openssl(d, "ca", "-batch", "-config", "ca.cnf", "-cert", "ca.pem", "-keyfile", "ca.key",
             "-in", f"{name}.csr", "-out", f"{name}.pem", "-startdate", start, "-enddate", end,
             "-extfile", f"{name}.ext", "-extensions", "ext", "-notext")
    return {"tls_certfile": str(d / f"{name}.pem"), "tls_keyfile": str(d / f"{name}.key"),
            "tls_cafile": str(d / "ca.pem")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("TLS tests need the openssl command to make a test CA and certificates")
    d = tmp_path_factory.mktemp("pki")
    (d / "ca.cnf").write_text(_CA_CONFIG)
    (d / "index.txt").write_text("")
    (d / "serial").write_text("01\n")
    _openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=torchwire-fault-ca")
    start = time.strftime("%Y%m%d%H%M%SZ", time.gmtime(time.time() - 3600))
    end = time.strftime("%Y%m%d%H%M%SZ", time.gmtime(time.time() + 2 * 86400))
    right = "IP:127.0.0.1,DNS:localhost"
    return {
        "good": _issue(d, "good", right, start, end),
        "wrong_host": _issue(d, "wrong", "DNS:elsewhere.invalid,IP:10.255.255.1", start, end),
        "expired": _issue(d, "expired", right, "20200101000000Z", "20200102000000Z"),
    }


def _add(a, b):
    return a + b


def _call(peer, *args):
    """(error type, message, seconds) of a call to ``peer``, or ("ok", value, seconds)."""
    t0 = time.monotonic()
    try:
        return "ok", rpc.rpc_sync(peer, _add, args=args), time.monotonic() - t0
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0


# Workers dial addresses, so a wrong name shows as an "IP address mismatch".
@pytest.mark.parametrize("bad,cause", [("wrong_host", r"(IP address|Hostname) mismatch"),
                                       ("expired", "certificate has expired")])
def test_a_bad_server_certificate_is_refused_by_the_caller_naming_worker_and_cause(
        pki, bad, cause, tmp_path):
    """worker0 shows a bad certificate, worker1 a good one; worker1 dials worker0."""
    target = str(tmp_path / "pwned")
    done = _fork.Event()
    back_done = _fork.Event()  # worker0's own call has ended: worker1 may shut down

    def body(rank, world_size, init_method):
        logs = _capture_logs()
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=10,
                                                 _transports=["tcp"],
                                                 **pki[bad if rank == 0 else "good"]))
        try:
            if rank == 1:
                call = _call("worker0", _CreateFile(target), 1)
                # listening until worker0's call ended: a closed listener would
                # refuse it before any certificate is looked at
                assert back_done.wait(30)
                return call, None
            # the other way (whether worker1 has marked us dead by then or not)
            back = _call("worker1", 1, 1)
            back_done.set()
            assert done.wait(30)
            if bad == "expired":  # worker1's refusal reaches our handshake thread meanwhile
                wait_until(lambda: any("refused a tcp connection" in m for m in logs), 10)
            return back, logs
        finally:
            if rank == 1:
                done.set()
            rpc.shutdown(graceful=False)

    (back, logs0), (call, _) = run_world(body, 2, init=False, timeout=80)
    name, msg, seconds = call
    assert name == "WorkerUnavailableError", call
    assert "worker0" in msg and "TLS handshake" in msg, msg
    assert re.search(f"certificate verify failed: {cause}", msg), msg
    assert seconds < 5
    assert not os.path.exists(target)
    if bad == "expired":  # worker1 refuses it as a client certificate too
        assert back[0] == "WorkerUnavailableError" and "worker1" in back[1], back
        assert "alert certificate expired" in back[1], back
        assert any("refused a tcp connection" in m and "certificate expired" in m
                   for m in logs0), logs0


def _dial_without_certificate(address, cafile: str, target: str) -> str:
    """A TLS client that trusts the job's CA but shows no certificate sends a pickle;
    return what its side saw."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile)
    raw = socket.create_connection(address, 5)
    raw.settimeout(5)
    try:
        s = ctx.wrap_socket(raw, server_hostname=address[0])
        s.sendall(_evil_frame(target))  # TLS 1.3: the server judges us after this
        return f"closed: {s.recv(4096)!r}"
    except (ssl.SSLError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        raw.close()


def test_a_client_without_a_certificate_is_refused_and_nothing_is_unpickled(pki, tmp_path):
    target = str(tmp_path / "pwned")
    done = _fork.Event()

    def body(rank, world_size, init_method):
        logs = _capture_logs()
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options(init_method, rpc_timeout=10,
                                                 _transports=["tcp"], **pki["good"]))
        try:
            if rank == 1:
                record = rpc.api._get_current_rpc_agent().names.member(0).record
                seen = _dial_without_certificate(tuple(record.tcp), pki["good"]["tls_cafile"],
                                                 target)
                return seen, _call("worker0", 2, 1)
            assert done.wait(30)
            return os.path.exists(target), logs
        finally:
            if rank == 1:
                done.set()
            rpc.shutdown(graceful=False)

    (created, logs0), (seen, after) = run_world(body, 2, init=False, timeout=80)
    assert "certificate required" in seen, seen
    assert not created and not os.path.exists(target)
    assert after[:2] == ("ok", 3)  # the worker goes on serving its job
    assert any("refused a tcp connection" in m and "peer did not return a certificate" in m
               for m in logs0), logs0


# ---------------------------------------------------------------- writes over TLS


def _total(t):
    return float(t.sum())


def test_a_write_to_a_frozen_peer_over_tls_ends_at_the_call_deadline_and_the_link_survives(pki):
    """worker1 is frozen (SIGSTOP) while worker0 sends it 64 MiB over TLS with a 1 s
    timeout: the socket fills, ``rpc_async`` returns by the deadline, and the call fails
    with ``RpcTimeoutError`` at it (without the heartbeat: its timeout is 6 s).  The
    records already encrypted are finished by a pool thread once worker1 is thawed, so
    the TLS session is intact and the next call succeeds."""
    import torch

    pid1, ready, done = _fork.Value("i", 0), _fork.Event(), _fork.Event()

    def body(rank, world_size):
        if rank == 1:
            pid1.value = os.getpid()
            ready.set()
            assert done.wait(60)  # frozen for part of this
            return None
        try:
            assert ready.wait(30)
            assert rpc.rpc_sync("worker1", _add, args=(1, 1), timeout=10) == 2  # connected
            freeze(pid1.value)
            try:
                t0 = time.monotonic()
                fut = rpc.rpc_async("worker1", _total, args=(torch.ones(16 << 20),),
                                    timeout=1.0)
                issued = time.monotonic() - t0
                try:
                    fut.wait()
                    failed = ("no error", "")
                except Exception as exc:
                    failed = (type(exc).__name__, str(exc))
                ended = time.monotonic() - t0
            finally:
                os.kill(pid1.value, signal.SIGCONT)
            after = rpc.rpc_sync("worker1", _add, args=(2, 1), timeout=30)
            return issued, failed, ended, after, sorted(
                rpc.api._get_current_rpc_agent().health.down())
        finally:
            done.set()

    (issued, failed, ended, after, down), _ = run_world(
        body, 2, timeout=80, _transports=["tcp"], heartbeat_timeout=6.0, **pki["good"])
    assert failed[0] == "RpcTimeoutError", failed
    assert issued < 1.0 + 1.5, issued  # the calling thread was not held past the deadline
    assert ended < 1.0 + 1.5, ended
    assert after == 3  # the half-sent frame went on, record by record, intact
    assert down == [], down


def test_a_tls_transfer_longer_than_the_heartbeat_timeout_is_not_silence(pki):
    """768 MiB over TLS with a 0.5 s heartbeat timeout: the sender's pings wait behind
    the frame, so what keeps the receiver alive in its eyes is the writes the receiver
    made room for (``progress_out``).  Neither side declares the other lost."""
    import torch

    def body(rank, world_size):
        agent = rpc.api._get_current_rpc_agent()
        out = {}
        if rank == 0:
            out["sum"] = rpc.rpc_sync("worker1", _total, args=(torch.ones(192 << 20),),
                                      timeout=60)
            out["progress"] = agent.links.connection_to(1)._writer.progress_out
        out["down"] = sorted(agent.health.down())
        return out

    reports = run_world(body, 2, timeout=80, _transports=["tcp"], heartbeat_interval=0.1,
                        heartbeat_timeout=0.5, **pki["good"])
    assert reports[0]["sum"] == 192 << 20, reports
    assert reports[0]["progress"] > 0, reports
    assert [r["down"] for r in reports] == [[], []], reports
