"""Which kind of torchwire thread is running: I/O (never runs user code) or pool."""

from __future__ import annotations

import threading

class _Local(threading.local):
    # defaults as class attributes: getattr() on a missing one raises and catches an
    # AttributeError (microseconds, with the caches cold, on every RPC wait)
    io = False
    pool = None
    inline = None


_local = _Local()


def mark_io_thread() -> None:
    """Mark the calling thread as an I/O thread: user callbacks must leave it."""
    _local.io = True


def set_io(flag: bool) -> None:
    """Enter or leave the I/O role (a thread that hands its reading off runs user code)."""
    _local.io = flag


def in_io_thread() -> bool:
    return getattr(_local, "io", False)


def set_current_pool(pool) -> None:
    _local.pool = pool


def current_pool():
    """The pool the calling thread belongs to, or ``None``."""
    return getattr(_local, "pool", None)


def set_inline_run(run) -> None:
    """The reader's inline run the calling thread is executing (or ``None``)."""
    _local.inline = run


def before_blocking() -> None:
    """Called before a thread blocks on a torchwire result: a reader running a
    request in place first hands its reading off, so that the reply it may be
    waiting for (on its own connection) gets read."""
    run = getattr(_local, "inline", None)
    if run is not None:
        run.hand_off()
