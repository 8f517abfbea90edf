"""Which kind of torchwire thread is running, and how a thread waits without starving.

An I/O thread (a reader, the timer) never runs user code; a pool thread runs user
functions and callbacks.  A thread that waits for a torchwire result goes through
:func:`wait_blocking`: a reader running a request in place first hands its reading
off (the result may arrive on its own connection), and a pool thread tells its pool
so that queued work gets another thread meanwhile (nested calls cannot exhaust it).
"""

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
    return _local.io


def set_current_pool(pool) -> None:
    _local.pool = pool


def current_pool():
    """The pool the calling thread belongs to, or ``None``."""
    return _local.pool


def in_torchwire_thread() -> bool:
    """Whether the calling thread is one of torchwire's: an I/O thread (the event loop
    of ``async def`` functions included), a pool thread, or a reader running a
    request in place."""
    return _local.io or _local.pool is not None or _local.inline is not None


def set_inline_run(run) -> None:
    """The reader's inline run the calling thread is executing (or ``None``)."""
    _local.inline = run


def before_blocking() -> None:
    """Called before a thread blocks on a torchwire result: a reader running a
    request in place first hands its reading off, so that the reply it may be
    waiting for (on its own connection) gets read."""
    run = _local.inline
    if run is not None:
        run.hand_off()


def wait_blocking(wait, *args):
    """``wait(*args)``, a call that blocks until a torchwire result is there (a lock
    acquired, an event waited for, a torch future waited on); returns what it returns.

    Callers check first whether the result is already there: this hands an inline
    run's reading off and counts a blocked pool thread even if ``wait`` would return
    at once.
    """
    local = _local
    run = local.inline
    if run is not None:
        run.hand_off()
    pool = local.pool
    if pool is None:
        return wait(*args)
    with pool.blocking():
        return wait(*args)
