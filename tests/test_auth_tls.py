"""TLS between workers: a test CA and worker certificates made with openssl, a TLS
socket carrying concurrent traffic both ways, a certificate from another CA refused,
TLS between real workers end to end, and a secret or TLS configured on some workers
only failing at init."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import run_world
from test_auth import _add, _init_and_call
from torchwire._wire.tls import TlsConfig


# ---------------------------------------------------------------- TLS


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_ca_and_cert(d, prefix: str) -> dict:
    """A CA and a worker certificate for 127.0.0.1 signed by it (EC P-256, 2 days)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", f"{prefix}ca.key", "-out", f"{prefix}ca.pem",
             "-days", "2", "-subj", f"/CN={prefix}torchwire-test-ca", cwd=d)
    _openssl("req", *ec, "-keyout", f"{prefix}w.key", "-out", f"{prefix}w.csr",
             "-subj", "/CN=torchwire-worker", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                               "basicConstraints=CA:FALSE\n"
                               "authorityKeyIdentifier=keyid,issuer\n")
    _openssl("x509", "-req", "-in", f"{prefix}w.csr", "-CA", f"{prefix}ca.pem",
             "-CAkey", f"{prefix}ca.key", "-CAcreateserial", "-out", f"{prefix}w.pem",
             "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return {"tls_certfile": str(d / f"{prefix}w.pem"), "tls_keyfile": str(d / f"{prefix}w.key"),
            "tls_cafile": str(d / f"{prefix}ca.pem")}


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("TLS tests need the openssl command to make a test CA and certificate")
    return _make_ca_and_cert(tmp_path_factory.mktemp("tls"), "")


def _tls(files) -> TlsConfig:
    return TlsConfig(files["tls_certfile"], files["tls_keyfile"], files["tls_cafile"])


def test_tls_socket_carries_concurrent_traffic_both_ways(tls_files):
    """One reader and one writer thread per side at once (what a Connection does)."""
    cfg = _tls(tls_files)
    listener = socket.create_server(("127.0.0.1", 0))
    raw_c = socket.create_connection(listener.getsockname(), 5)
    raw_s, _ = listener.accept()
    listener.close()
    deadline = time.monotonic() + 10
    box = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "s", cfg.wrap(raw_s, server_side=True, hostname=None, deadline=deadline)))
    t.start()
    c = cfg.wrap(raw_c, server_side=False, hostname="127.0.0.1", deadline=deadline)
    t.join(10)
    s = box["s"]
    for sock in (c, s):
        sock.settimeout(20)
    blobs = {"c": os.urandom(3 << 20), "s": os.urandom(3 << 20)}
    got = {}

    def write(sock, data):
        parts = [memoryview(data)[i:i + 1000] for i in range(0, 4000, 1000)]
        sock.sendall_parts(parts + [memoryview(data)[4000:]])

    def read(sock, key, n):
        buf = bytearray(n)
        mv = memoryview(buf)
        off = 0
        while off < n:
            k = sock.recv_into(mv[off:])
            assert k
            off += k
        got[key] = bytes(buf)

    threads = [threading.Thread(target=write, args=(c, blobs["c"])),
               threading.Thread(target=write, args=(s, blobs["s"])),
               threading.Thread(target=read, args=(s, "at s", len(blobs["c"]))),
               threading.Thread(target=read, args=(c, "at c", len(blobs["s"])))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert got["at s"] == blobs["c"] and got["at c"] == blobs["s"]
    assert not hasattr(c, "sendmsg")  # never a way around the encryption
    c.close()
    s.close()


def test_tls_refuses_a_certificate_from_another_ca(tls_files, tmp_path):
    other = _make_ca_and_cert(tmp_path, "other-")
    a, b = socket.socketpair()
    box = {}

    def serve():
        try:
            _tls(tls_files).wrap(a, server_side=True, hostname=None,
                                 deadline=time.monotonic() + 5)
        except Exception as exc:
            box["server"] = exc

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises((OSError, EOFError)):
        _tls(other).wrap(b, server_side=False, hostname="127.0.0.1",
                         deadline=time.monotonic() + 5)
    t.join(10)
    a.close()
    b.close()
    assert isinstance(box.get("server"), OSError)


def test_tls_between_workers_end_to_end(tls_files):
    from torchwire._wire.tls import TlsSocket

    def body(rank, world_size):
        big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: many TLS records
        peer = f"worker{1 - rank}"
        out = rpc.rpc_sync(peer, _add, args=(big, 1))
        small = rpc.rpc_sync(peer, _add, args=(rank, 1))
        # both workers at once, many calls in flight: readers and writers share each link
        futs = [rpc.rpc_async(peer, _add, args=(torch.full((1 + 5000 * (i % 7),), i), 1))
                for i in range(200)]
        assert all(f.wait()[0].item() == i + 1 for i, f in enumerate(futs))
        for i in range(100):  # back to back: a plain TCP reader would poll (test_polling)
            rpc.rpc_sync(peer, _add, args=(i, 1))
        agent = rpc.api._get_current_rpc_agent()
        conn = agent.links.connection_to(1 - rank)
        return (torch.equal(out, big + 1), small, rpc.stats()["transports"],
                isinstance(conn.sock, TlsSocket), rpc.stats()["polls"]["episodes"])

    results = run_world(body, 2, timeout=60, _transports=["tcp"], **tls_files)
    # a TLS reader never polls: the record layer reads in its own steps
    assert results == [(True, 1, ["tcp"], True, 0), (True, 2, ["tcp"], True, 0)]


# ---------------------------------------------------------------- settings on some workers only

@pytest.mark.parametrize("only_rank0", [{"auth_secret": "s3cret"}, "tls"])
def test_security_settings_on_some_workers_only_fail_at_init(only_rank0, tls_files):
    extra = tls_files if only_rank0 == "tls" else only_rank0

    def body(rank, world_size, init_method):
        return _init_and_call(rank, world_size, init_method, {0: extra, 1: {}})

    for where, name, msg, elapsed in run_world(body, 2, init=False, timeout=60):
        assert (where, name) == ("init", "RendezvousError")
        assert "disagree on security settings" in msg
        assert elapsed < 10
