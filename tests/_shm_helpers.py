"""Helpers and remote functions of the shared-memory tests (tests/test_shm*.py): tensors
made from a seed and compared bit for bit, the channel's counters, and the functions
a callee runs to keep, check, modify, return or fork over the tensors it receives."""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os

import torch

import torchwire.rpc as rpc
from _cluster import wait_until
from torchwire._wire.channels import segments as shm

SMALL = 4096  # _channel_threshold of the tests that send small tensors through shm


# ----------------------------------------------------------------- helpers


def make(dtype, numel, seed, shape=None):
    """``numel`` elements of ``dtype`` with random bits (NaN payloads included), the
    same on every worker for the same ``seed``; 1-D unless ``shape`` is given."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        raw &= 1  # a bool byte other than 0 or 1 is not a value
    t = raw.view(dtype)
    return t if shape is None else t.view(shape)


def same(a, b) -> bool:
    """Same dtype, shape and bytes (bit-exact: NaN == NaN)."""
    return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def edited(t, edits):
    t = t.clone()
    for i, v in edits:
        t[i] = v
    return t


def bumped(t):
    t = t.clone()
    t[0] += 1
    return t


def wait_for(pred) -> bool:
    return wait_until(pred, 10.0)


def grew(before, after):
    return {k: after[k] - before[k] for k in ("created", "reused", "copies", "copied_bytes",
                                              "sent_back", "sent_own", "received")}


def connections():
    agent = rpc.api._get_current_rpc_agent()
    return agent.links.all()


def settled(peer) -> bool:
    """Neither this worker nor ``peer`` leases a segment or maps one."""
    theirs = rpc.rpc_sync(peer, counters)
    mine = shm.stats()
    return not (mine["leased"] or mine["mappings"] or theirs["leased"] or theirs["mappings"])


# ----------------------------------------------------------------- remote functions

_held: dict = {}  # tensors a callee keeps between calls


def counters():
    return shm.stats()


def echo(x):
    return x


def check_and_return(specs, tensors):
    """Compare with what ``make`` gives; return the tensors as received (unmodified:
    back-references) and fresh copies of them (new segments)."""
    ok = [same(t, make(*s)) for s, t in zip(specs, tensors)]
    return ok, tensors, [t.clone() for t in tensors]


def matches(t, spec, edits=()):
    return same(t, edited(make(*spec), edits))


def store(key, t):
    _held[key] = t


def store_and_echo(key, t):
    _held[key] = t
    return t


def store_slice(key, t, start, stop):
    _held[key] = t[start:stop]  # only a view: the received tensor itself is dropped


def held_matches(key, spec, start=0, stop=None):
    return same(_held[key], make(*spec)[start:stop])


def fetch(key):
    return _held[key]


def drop(key):
    del _held[key]


def mutate(t):
    """Write every byte of ``t`` in place; True if its values changed."""
    before = t.clone()
    t.bitwise_not_()
    return not torch.equal(t, before)


def mutate_held(key):
    return mutate(_held[key])


def modify_and_return(t, edits):
    for i, v in edits:
        t[i] = v
    return t


def bump(t):
    t[0] += 1
    return t


def fresh(spec):
    return make(*spec)


def fork_holder(t):
    """Fork a child that inherits ``t`` (as a DataLoader worker inherits a dataset) and
    waits; this process then drops ``t``."""
    ask, answer = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # only os calls and C code here: other threads' locks may be held
        os.read(ask[0], 1)
        os.write(answer[1], hashlib.sha256(ctypes.string_at(t.data_ptr(), t.nbytes)).digest())
        os._exit(0)
    os.close(ask[0])
    os.close(answer[1])
    _held["child"] = (pid, ask[1], answer[0])


def child_digest():
    """The digest of the tensor the child of :func:`fork_holder` inherited, as it sees it now."""
    pid, ask, answer = _held.pop("child")
    os.write(ask, b"?")
    digest = os.read(answer, 64)
    os.waitpid(pid, 0)
    os.close(ask)
    os.close(answer)
    return digest


def fork_and_drop(key):
    """A forked child drops its copy of the held tensor.  Returns whether the mapping
    died there (not if a thread that was finishing the call that stored it still
    held it at the fork) and whether the child then tried to send a RELEASE for it
    (it holds no lease of its own)."""
    done = os.pipe()
    pid = os.fork()
    if pid == 0:
        conn = next(iter(rpc.api._get_current_rpc_agent().links.incoming))
        sent, mapped = conn.frames_out, shm.stats()["mappings"]
        del _held[key]
        gc.collect()
        died = shm.stats()["mappings"] < mapped
        posted = shm._releaser.pid == os.getpid()  # the child started a release thread
        if posted:  # let it write what it has to before this process exits
            wait_until(lambda: conn.frames_out > sent, 5.0)
        os.write(done[1], bytes([died, posted]))
        os._exit(0)
    os.close(done[1])
    died, posted = os.read(done[0], 2)
    os.waitpid(pid, 0)
    os.close(done[0])
    return bool(died), bool(posted)


def send_held_to(dst, key, spec):
    """Send a tensor received from ``dst`` back to it in a request of our own (a
    connection other than the one it came on: it cannot travel by reference)."""
    return rpc.rpc_sync(dst, matches, args=(_held[key], spec))
