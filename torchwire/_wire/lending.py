"""Lending a connection's reading to the thread that waits for its reply.

A caller that waits for its reply at once (``rpc_sync``, ``to_here``) costs two
thread wake-ups per call when a reader thread reads its connection: the kernel
wakes the reader when the reply arrives, and the reader wakes the caller.  After
the reader completes such a reply and rests (nothing buffered, no call pending on
the connection), it *lends* the reading: it parks, and the next caller that waits
for a reply on this connection (``rpc_sync``, ``to_here``, a future's ``wait()``, an
``await`` on an idle asyncio loop: ``Future._read_idle``) *borrows* it and reads
the socket itself
(``reader.read_borrowed``) until its own reply is in.  A call then costs one
wake-up, the kernel's, of the thread that wants the reply.

States of one connection's reading::

    READING  --the reader rests after a waiter's reply, no call pending: lend()-->  LENT
    LENT     --a caller waits for its reply: borrow()-->                        BORROWED
    BORROWED --its reply is in, no other call pending: give_back()-->           LENT
    BORROWED --another call pending, an error, the stream's end: give_back(wake)-->  READING
    LENT     --LINGER_S since lent or given back, reclaim() (SENT_MAX calls sent,
               a callback, an await), or close(): wake()-->                 READING

In READING only the reader thread reads, in BORROWED only the borrower, in LENT
nobody.  A call sent while the reading is lent does not wake the reader: its
caller may borrow (``wait()``, or a ``to_here()`` after a ``remote()``).  A burst
of them does (more than ``SENT_MAX``, :meth:`ReadRole.sent_one`): their replies
would pile up unread, and the peer's writes stall, until someone waits.
Interest that will not read a reply itself (a callback, an ``await`` on a busy
loop, a wait on one of torchwire's own threads) reclaims the reading for the reader; anything
else (torchwire's inline bookkeeping, torch's ``collect_all``) waits ``LINGER_S``
at most.

A borrower reads exact sizes, never past the end of a frame, so the role passes
with no state: the reader's buffer is empty at rest and the borrower's when it
leaves.  A borrower stopped inside a frame (a decoding error, Ctrl-C) leaves the
stream unusable: it gives the reading back with that error, and the reader ends the
connection with it.  Only connections this side opened, on plain sockets, lend (not
TLS, whose reads are its own, nor lanes).  ``TORCHWIRE_LEND_US=0`` turns it off.
"""

from __future__ import annotations

import os
import threading
import time

READING, LENT, BORROWED = "reading", "lent", "borrowed"

_monotonic = time.monotonic


def _linger_s() -> float:
    raw = os.environ.get("TORCHWIRE_LEND_US", "")
    try:
        us = float(raw) if raw else 2000.0
    except ValueError:
        raise ValueError(
            f"TORCHWIRE_LEND_US must be a number of microseconds, not {raw!r}") from None
    if us < 0:
        raise ValueError(f"TORCHWIRE_LEND_US must be >= 0, not {raw!r}")
    return us / 1e6


# How long a lent connection waits for a borrower before its reader reads again.
LINGER_S = _linger_s()
# Calls sent while lent, with nobody borrowing, beyond which the reader reads again.
SENT_MAX = 2


class ReadRole:
    """Who reads one connection now: its reader thread, or a borrowing caller."""

    __slots__ = ("state", "closing", "error", "lends", "borrows", "sent", "_cond",
                 "_since")

    def __init__(self) -> None:
        self.state = READING
        self.sent = 0  # calls sent since it was last lent (an estimate: not locked)
        self.closing = False  # the connection is closing: no more lending
        self.error: BaseException | None = None  # a borrower's, for the reader to end with
        self.lends = 0  # times the reader lent the reading
        self.borrows = 0  # times a caller borrowed it
        self._cond = threading.Condition(threading.Lock())
        self._since = 0.0  # when it was last lent or given back

    def __repr__(self) -> str:
        return f"<ReadRole {self.state} lends={self.lends} borrows={self.borrows}>"

    def lend(self, idle) -> BaseException | None:
        """Reader thread, at rest: lend the reading and park until it comes back.

        ``idle()``: no call is pending on the connection.  It is asked once the role is
        LENT, so a call added before is seen by it and one added after finds LENT.

        Returns:
            the error a borrower left the stream with (the reader must end the
            connection with it), else None: read on.
        """
        cond = self._cond
        with cond:
            if self.closing:
                return None
            self.state = LENT
            self.sent = 0
            self._since = _monotonic()
        if not idle():
            with cond:
                if self.state is LENT:
                    self.state = READING
                    return None
        with cond:
            self.lends += 1
            while self.state is not READING:
                if self.state is LENT:
                    left = self._since + LINGER_S - _monotonic()
                    if left <= 0 or self.closing:
                        self.state = READING
                        break
                    cond.wait(left)
                else:  # borrowed: until it is given back (checked every LINGER_S)
                    cond.wait(LINGER_S)
            error, self.error = self.error, None
        return error

    def borrow(self) -> bool:
        """A caller waiting for its reply: take the reading if it is lent."""
        if self.state is not LENT:
            return False
        with self._cond:
            if self.state is LENT and not self.closing:
                self.state = BORROWED
                self.borrows += 1
                return True
        return False

    def give_back(self, wake: bool, error: BaseException | None = None) -> None:
        """The borrower is done: lend the reading on (LENT), or (``wake``, or an
        ``error`` the reader must end the connection with) return it to the reader."""
        with self._cond:
            if error is not None:
                self.error = error
                wake = True
            if wake or self.closing:
                self.state = READING
                self._cond.notify()
            else:
                self.state = LENT
                self.sent = 0
                self._since = _monotonic()

    def sent_one(self) -> None:
        """A call was sent on the connection while the reading is lent, by a caller
        that does not wait for its reply at once: past ``SENT_MAX`` of them, the
        reader reads again."""
        self.sent += 1
        if self.sent > SENT_MAX:
            self.reclaim()

    def reclaim(self) -> None:
        """Someone needs a reply read and will not read it itself (a callback, an
        ``await``): a lent reading goes back to the reader now."""
        with self._cond:
            if self.state is LENT:
                self.state = READING
                self._cond.notify()

    def wake(self) -> None:
        """The connection is closing: the reader reads again (and finds the end)."""
        with self._cond:
            self.closing = True
            if self.state is LENT:
                self.state = READING
            self._cond.notify()


def lendable() -> bool:
    """Whether connections lend their reading at all (``TORCHWIRE_LEND_US`` > 0)."""
    return LINGER_S > 0
