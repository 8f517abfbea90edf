"""Rendezvous: ``init_method`` -> a torch Store, then membership through it.

Only torch's own stores are used (``TCPStore``, ``FileStore``).  Keys live under
a prefix of their own, so a gloo process group may share the same store or
``file://`` init file.  Records are JSON, never pickles: the store is reachable
by anyone who can reach its port, and must not become a way to run code here.

Static join protocol (``world_size`` given; every rank, in this order)::

    0. claim  "group"      compare_set("", "static"): a group of the other kind
                           (dynamic, see membership.py) in this session is an error;
              "world_size" compare_set("", world_size): another size is an error
    1. claim  "rank/<r>"   add(1) returns 1: a first join; else the rank's worker
                           died and this process takes its place, or the rank is
                           held by a live worker and it is refused (rejoin.py)
    2. rank 0 sets "job"   a random job token: part of every connection's key, and the
                           secret itself unless the user gave one (see _wire/auth.py)
    3. publish "worker/<r>" {name, rank, host, tcp, unix, pid, cma, security}
    4. wait for "worker/0" .. "worker/<world-1>" (init timeout); report missing ranks
    5. read all records; duplicate names, or workers that disagree on "security"
       (user secret or not, TLS or not), are an error on every rank
    6. add(1) to "read"    the rank that brings it to world_size sets "read/all"
                           (a restarted worker adds too: it stands for one that
                           died before reading)
    7. rank 0, if its process hosts the store: wait for "read/all" (init deadline)
                           before init_rpc returns, as torch's ends with a barrier:
                           a rank 0 that exits right after init_rpc must not take
                           the store from a rank still reading it.  When the join
                           fails (step 5) rank 0 waits so in any case, so that every
                           rank reports the same error

Without ``world_size`` (argument, ``?world_size=`` or ``WORLD_SIZE``) the group is
dynamic: workers join and leave while it runs (``membership.py``).  Every key above
lives in the session's key space (``sessions.py``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
import urllib.parse
from datetime import timedelta

import torch.distributed as dist

from .._base.errors import RendezvousError
from .rejoin import take_over

log = logging.getLogger("torchwire")
PREFIX = "torchwire"
# torch's WorkerInfo id is an int16: the largest rank a dynamic group accepts.
MAX_RANK = 2**15 - 1
# torch's phrase, kept whole: ported code and torch's tests match on it.
MIXED_GROUPS = ("RPC group mixes statically and dynamically initialized members which is not "
                "supported.")
def _env_int(key: str, what: str) -> int:
    value = os.environ.get(key)
    if value is None:
        # "environment variable RANK expected" is torch's phrase (its env:// handler's)
        raise ValueError(f"{what} was not given: environment variable {key} expected, but not "
                         "set")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from None


def open_store(init_method: str, rank: int | None, world_size: int | None, timeout: float):
    """Create the store an ``init_method`` names.

    ``world_size`` is taken from the argument, else ``?world_size=`` in the
    ``init_method``, else ``WORLD_SIZE``; with none of them it stays ``None``: the
    worker joins a dynamic group.

    Returns:
        ``(store, rank, world_size, store_host)``; ``store`` is already prefixed;
        ``world_size`` is ``None`` for a dynamic group.

    Raises:
        ValueError: malformed ``init_method``, missing environment, bad rank.
        RendezvousError: the store could not be reached or created in time.
    """
    url = urllib.parse.urlparse(init_method)
    query = dict(urllib.parse.parse_qsl(url.query))
    if rank is None or rank < 0:
        if "rank" in query:
            rank = int(query["rank"])
        elif url.scheme != "env" and "RANK" not in os.environ:
            raise ValueError(f"rank parameter missing: pass rank= to init_rpc (or ?rank= in "
                             f"the init_method {init_method!r})")
        else:
            rank = _env_int("RANK", "rank")
    if world_size is None:
        if "world_size" in query:
            world_size = int(query["world_size"])
        elif "WORLD_SIZE" in os.environ:
            world_size = _env_int("WORLD_SIZE", "world_size")
    if world_size is None:
        if not 0 <= rank <= MAX_RANK:
            raise ValueError(f"rank {rank} is outside 0..{MAX_RANK}, the ranks a dynamic group "
                             "(init_rpc without world_size) accepts")
    elif world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    elif not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of size {world_size} "
                         f"(valid ranks: 0..{world_size - 1})")
    td = timedelta(seconds=timeout)
    prefix = PREFIX
    if url.scheme in ("env", "tcp"):
        if url.scheme == "env":
            host = os.environ.get("MASTER_ADDR")
            if not host:
                raise ValueError("init_method env:// needs MASTER_ADDR in the environment")
            port = _env_int("MASTER_PORT", "MASTER_PORT")
        else:
            if not url.hostname or url.port is None:
                raise ValueError(f"init_method {init_method!r} must look like tcp://host:port")
            host, port = url.hostname, url.port
        if not 0 <= port < 65536:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if _agent_store(url.scheme):
            # torchrun's agent hosts the store and outlives restarts: one key space per attempt
            prefix = f"{PREFIX}/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        is_master = hosts_store(init_method, rank)
        deadline = time.monotonic() + timeout
        if not is_master:
            # TCPStore's client retries with a random backoff that can overshoot the
            # timeout by seconds; wait for the port ourselves, then connect with what is left.
            _wait_for_port(host, port, deadline)
            td = timedelta(seconds=max(0.5, deadline - time.monotonic()))
        try:
            listen_fd = _ipv4_listener(host, port) if is_master else None
            store = dist.TCPStore(host, port, world_size, is_master, td,
                                  wait_for_workers=False, multi_tenant=True,
                                  master_listen_fd=listen_fd)
        except Exception as exc:
            if is_master:
                raise RendezvousError(
                    f"rank 0 could not start the rendezvous store on {host}:{port}: {exc} "
                    "(is the port taken, or is another process also rank 0?)") from exc
            raise RendezvousError(
                f"rank {rank} could not reach the rendezvous store at {host}:{port} within "
                f"{timeout:g}s: {exc} (is rank 0 running, and MASTER_ADDR/MASTER_PORT right?)"
            ) from exc
        store_host = host
    elif url.scheme == "file":
        path = url.path
        if not path:
            raise ValueError(f"init_method {init_method!r} must look like file:///path")
        try:
            # -1: nobody deletes the file (a dynamic group has no count of members to wait for)
            store = dist.FileStore(path, world_size if world_size is not None else -1)
        except Exception as exc:
            raise RendezvousError(f"cannot open file store {path}: {exc}") from exc
        store.set_timeout(td)
        store_host = None
    else:
        raise ValueError(f"unsupported init_method {init_method!r}: use env://, tcp://host:port "
                         "or file:///path")
    return dist.PrefixStore(prefix, store), rank, world_size, store_host


def _ipv4_listener(host: str, port: int) -> int | None:
    """A listening IPv4 socket on every interface at ``port`` for the store's server, or
    None to let the store bind its own (a host with an IPv6 address, which clients may
    try first, or the port already served in this process: the store then shares that
    server, ``multi_tenant``).

    The store's own socket is IPv6 dual-stack, so every client appears to it as
    ``::ffff:a.b.c.d``, and it names each one with a reverse lookup that
    ``/etc/hosts`` cannot answer for such an address: one DNS query per connection,
    made in the server's only thread.  A resolver that drops one of a burst of them
    (32 workers joining at once) stalled every join for its 5 s timeout.  Over IPv4 a
    loopback peer is named from ``/etc/hosts``.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    if not infos or any(family != socket.AF_INET for family, *_ in infos):
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        return None
    return sock.detach()


def _agent_store(scheme: str) -> bool:
    return scheme == "env" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def hosts_store(init_method: str, rank: int) -> bool:
    """Does the worker of ``rank`` host the rendezvous store itself?  (rank 0 of
    ``tcp://`` and ``env://``, unless torchrun's agent hosts it): it must leave last."""
    scheme = urllib.parse.urlparse(init_method).scheme
    return rank == 0 and scheme in ("env", "tcp") and not _agent_store(scheme)


def claim_group_kind(store, kind: str) -> None:
    """Record this store's group as ``"static"`` or ``"dynamic"`` (the first member
    decides); a member of the other kind is refused.

    Raises:
        RendezvousError: the group is of the other kind (torch's message), or the
            store failed.
    """
    try:
        found = store.compare_set("group", "", kind).decode()
    except Exception as exc:
        raise RendezvousError(f"rendezvous store failed: {exc}") from exc
    if found != kind:
        how = "with" if found == "static" else "without"
        raise RendezvousError(
            f"{MIXED_GROUPS} This {kind} member cannot join: the group in this store was "
            f"started by members that called init_rpc {how} world_size; give every member "
            "the same kind of init_rpc call")


def _wait_for_port(host: str, port: int, deadline: float) -> None:
    delay = 0.01
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.05, deadline - time.monotonic())
                                     ).close()
            return
        except OSError as exc:
            if time.monotonic() + delay >= deadline:
                raise RendezvousError(
                    f"could not reach the rendezvous store at {host}:{port} within the init "
                    f"timeout: {exc} (is rank 0 running, and MASTER_ADDR/MASTER_PORT right?)"
                ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


class _NotJoined(Exception):
    """The wait for every worker's record ended without them (its cause: why)."""


def _wait_and_read(store, keys: list[str], deadline: float) -> list[bytes]:
    """``store.wait(keys)`` until ``deadline``, then their values.  On the main thread
    both run on a helper thread while the main thread waits on an event, which Ctrl-C
    interrupts: the store's own wait is a C++ call that runs no signal handler until
    it returns (short waits in a loop would each log a C++ warning as they time out).

    Raises:
        _NotJoined: the wait ended without them (``__cause__``: the store's error).
    """
    left = timedelta(seconds=max(0.001, deadline - time.monotonic()))

    def read() -> list[bytes]:
        try:
            store.wait(keys, left)
        except Exception as exc:
            raise _NotJoined() from exc
        return store.multi_get(keys)  # at once: the store's host may go right after
    if threading.current_thread() is not threading.main_thread():
        return read()
    done, result = threading.Event(), []

    def run() -> None:
        try:
            result.append(read())
        except BaseException as exc:
            result.append(exc)
        finally:
            done.set()
    threading.Thread(target=run, daemon=True, name="torchwire-rendezvous").start()
    done.wait()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def join(store, rank: int, world_size: int, record: dict, timeout: float,
         hosts: bool = False) -> tuple[list[dict], bytes]:
    """Publish this worker and wait for everyone else (see the module docstring).
    ``hosts``: this process hosts the store (:func:`hosts_store`).

    Returns:
        ``(records, job_token)`` with ``records[r]`` the record of rank ``r``.

    Raises:
        RendezvousError: rank taken, duplicate names, peers missing after ``timeout``.
    """
    deadline = time.monotonic() + timeout
    claim_group_kind(store, "static")
    try:
        found = store.compare_set("world_size", "", str(world_size)).decode()
        claims = store.add(f"rank/{rank}", 1) if found == str(world_size) else 0
    except Exception as exc:
        raise RendezvousError(f"rendezvous store failed: {exc}") from exc
    if found != str(world_size):
        raise RendezvousError(
            f"this worker (rank {rank}) was started with world_size={world_size}, and the "
            f"job running on this rendezvous store has world_size={found}; start every "
            "worker with the same world_size (a worker for the next job waits for this one "
            "to shut down first)")
    if claims != 1:
        take_over(store, rank, record, deadline)  # a restarted worker, or refused
    else:
        if rank == 0:
            store.set("job", secrets.token_hex(16))
        store.set(f"worker/{rank}", json.dumps(record))
    keys = [f"worker/{r}" for r in range(world_size)] + ["job"]
    try:
        values = _wait_and_read(store, keys, deadline)
    except _NotJoined as exc:
        try:
            missing = [r for r, key in enumerate(keys[:-1]) if not store.check([key])]
        except Exception as gone:
            raise RendezvousError(
                f"the rendezvous store failed while this worker (rank {rank}) waited for the "
                f"others to join: {gone}; the store's host (rank 0 for tcp:// and env://) "
                "exited or cannot be reached") from exc.__cause__
        hint = ""
        if rank == 0 and len(missing) == world_size - 1 and world_size > 1:
            hint = ("; if rank 0 was restarted after a crash: the rendezvous store lived in "
                    "its process and died with it, so the job cannot take it back (restart "
                    "the whole job)")
        raise RendezvousError(
            f"worker(s) with rank {missing} did not join within the init timeout of "
            f"{timeout:g}s (world_size={world_size}); check that every process was started "
            f"with the same init_method and world_size{hint}") from exc.__cause__
    records = [json.loads(v) for v in values[:-1]]
    job = bytes.fromhex(values[-1].decode())
    try:
        if store.add("read", 1) == world_size:
            store.set("read/all", "1")
    except Exception as exc:
        raise RendezvousError(f"rendezvous store failed: {exc}") from exc
    by_name: dict[str, list[int]] = {}
    for r in records:
        by_name.setdefault(r["name"], []).append(r["rank"])
    dups = {n: rs for n, rs in by_name.items() if len(rs) > 1}
    problem = None
    if dups:
        name, ranks = next(iter(dups.items()))
        problem = (f"worker name {name!r} is not unique: it is used by ranks {ranks}; "
                   "every worker needs a unique name")
    else:
        problem = security_disagreement(records)
    if problem:
        if rank == 0:  # keep the store up until every rank has read what it needs
            wait_count(store, "read", world_size, deadline)
        raise RendezvousError(problem)
    if hosts and claims == 1 and world_size > 1:
        _wait_all_read(store, world_size, deadline)
    return records, job


def _wait_all_read(store, world_size: int, deadline: float) -> None:
    """Step 7: the store's host waits until every rank has read the records."""
    try:
        _wait_and_read(store, ["read/all"], deadline)
    except _NotJoined:
        try:
            n = int(store.add("read", 0))
        except Exception:
            n = -1
        log.warning("torchwire: %s of %d workers read the rendezvous records within the "
                    "init timeout; init_rpc returns, and a worker that did not may fail its "
                    "init if this process exits now", "some" if n < 0 else n, world_size)


def security_disagreement(records: list[dict]) -> str | None:
    """What is wrong when workers disagree on security settings (user secret or not,
    TLS or not), else None."""
    if len({json.dumps(r.get("security"), sort_keys=True) for r in records}) <= 1:
        return None
    setups = "; ".join(f"rank {r['rank']}: {r.get('security')}" for r in records)
    return ("workers disagree on security settings (" + setups + "): give every worker "
            "the same auth_secret or TORCHWIRE_SECRET (or none to all), and TLS files "
            "to all or none")


def wait_count(store, key: str, target: int, deadline: float) -> bool:
    """Wait until counter ``key`` reaches ``target`` or ``deadline`` passes."""
    delay = 0.001
    while True:
        try:
            if store.add(key, 0) >= target:
                return True
        except Exception:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
