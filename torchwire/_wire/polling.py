"""Polling a connection at rest after serving, before the reader sleeps.

A reader that has just served requests (and replied) usually gets the next request
soon: a caller in a loop, ``remote()`` followed by ``to_here()``, a pipeline's next
micro-batch.  Asleep in ``recv``, the reader costs that request a thread wake-up, and
on a virtual machine whose idle vCPUs halt, waking one is a trip through the host
(tens of microseconds).  So the reader polls the socket (``MSG_DONTWAIT``) for a
short window first.  The window adapts per connection the way Linux's ``haltpoll``
adapts a vCPU's: it grows (up to ``poll_us``) while the next request comes within
``poll_us`` of the last reply, and shrinks to nothing while requests come further
apart, so a connection whose requests are rare never polls.  It grows at once to
a window that would have caught the last request (doubling until it spans the
wait), not one doubling a miss: four misses end in a rest (below), and 50, 100,
200, 400 µs would never reach a caller that works 500 µs between its calls.

Polling must not take what others need.  Between two polls the reader yields its
core (``sched_yield``: a task waiting for this core goes first) and, with it,
the GIL; and it stops as soon as the other threads of its process have run for
``BUSY_NS`` since it began (user code in the pool, the main thread: its GIL is
wanted), or once a yield has let another task run (its core is wanted).  When more
threads are runnable than there are cores, a poll can even hold up the request it
waits for (the peer waits for a core the poller keeps busy: a yield only hands
over to tasks queued on the same core), so a connection whose polls miss
``MISS_LIMIT`` times in a row blocks without polling for its next ``REST_READS``
reads.  That bounds the harm, not all of it: on a host with more busy threads than
cores, ``poll_us=0`` is the better setting.  It never polls over TLS (the record
layer reads in its own steps).

A caller that borrowed its connection's reading (``reader.read_borrowed``) waits
for its reply the same way, with a window of its own (``Connection.reply_poll``,
the same ``poll_us``): a reply often comes within tens of microseconds, and a
caller asleep in ``poll`` would pay the same wake-up for it.  What it polls is
``poll`` with no timeout, not a read: a borrower reads exact sizes.

One episode, after a batch with requests ends what was read::

    window 0 ---------------------------------------------> BLOCKED
    POLLING --data----------------------------------------> READ       (a hit)
    POLLING --the window passed---------------------------> BLOCKED    (a miss)
    POLLING --other threads ran, or a task took the core--> BLOCKED    (ceded)
    a miss, the MISS_LIMIT-th in a row: window 0, rest REST_READS reads
    BLOCKED --resting: one read less to rest--------------> READ
    BLOCKED --data within poll_us of the reply: grow------> READ
              (double, and again until the window spans that wait)
    BLOCKED --data later: shrink (halve; under the start: 0)-> READ
"""

from __future__ import annotations

import os
import time

POLL_START_NS = 50_000  # the window a connection starts polling with, once it should
BUSY_NS = 20_000  # other threads of the process ran this long: stop polling
_CHECK_EVERY = 8  # polls between two looks at the other threads' CPU time (syscalls)
MISS_LIMIT = 4  # polls in a row that find nothing ...
REST_READS = 64  # ... and the connection's next reads block without polling

_clock = time.perf_counter_ns
_process_time = time.process_time_ns
_thread_time = time.thread_time_ns
_yield = getattr(os, "sched_yield", lambda: None)


try:
    from resource import RUSAGE_THREAD as _RUSAGE_THREAD, getrusage as _getrusage
except ImportError:  # not Linux: the other threads' CPU time is the only sign
    _getrusage = None


def _preempted() -> int:
    """This thread's involuntary context switches: a yield that let another task run
    counts as one, so a change means something else wants this core."""
    return _getrusage(_RUSAGE_THREAD).ru_nivcsw if _getrusage is not None else 0


class RestPoll:
    """One connection's polling window and what it did (read by ``rpc.stats()``).

    Args:
        max_ns: the longest window; 0 never polls.
    """

    __slots__ = ("max_ns", "start_ns", "window_ns", "misses", "rest", "episodes", "hits",
                 "ceded", "spent_ns")

    def __init__(self, max_ns: int) -> None:
        self.max_ns = max(0, int(max_ns))
        self.start_ns = min(POLL_START_NS, self.max_ns)
        self.window_ns = 0
        self.misses = 0  # polls in a row that found nothing
        self.rest = 0  # reads to go without polling, after MISS_LIMIT misses
        self.episodes = 0  # polls begun
        self.hits = 0  # ... that found data
        self.ceded = 0  # ... that stopped early: other threads ran, or the core was taken
        self.spent_ns = 0  # time spent polling, hits and misses

    def read(self, recv_nowait, recv, view) -> int:
        """Read the next bytes into ``view``: poll for the window, else block.

        Args:
            recv_nowait: ``recv_nowait(view) -> int``, raising ``BlockingIOError``
                when nothing is there.
            recv: the blocking ``recv(view) -> int``.

        Returns:
            The bytes read (0 at the end of the stream).
        """
        window = self.window_ns
        t0 = _clock()
        if window:
            self.episodes += 1
            deadline = t0 + window
            n = 0
            while True:
                try:
                    got = recv_nowait(view)
                except BlockingIOError:
                    if not n:  # what the others have used so far (syscalls: not on a hit)
                        others, switches = _process_time() - _thread_time(), _preempted()
                    _yield()
                    n += 1
                    if n % _CHECK_EVERY:
                        if _clock() < deadline:
                            continue
                    elif (_process_time() - _thread_time() - others >= BUSY_NS
                          or _preempted() != switches):
                        self.ceded += 1  # not a miss: polling was not in vain yet
                        break
                    elif _clock() < deadline:
                        continue
                    self.misses += 1
                    break
                self.hits += 1
                self.misses = 0
                self.spent_ns += _clock() - t0
                return got
            self.spent_ns += _clock() - t0
            if self.misses >= MISS_LIMIT:  # polling keeps missing: rest from it
                self.misses, self.rest, self.window_ns = 0, REST_READS, 0
        got = recv(view)
        waited = _clock() - t0
        if self.rest:
            self.rest -= 1
        elif waited <= self.max_ns:  # a longer window would have caught it: grow to one
            grown = max(self.start_ns, window * 2)
            while grown < waited:
                grown *= 2
            self.window_ns = min(self.max_ns, grown)
        else:
            window //= 2
            self.window_ns = window if window >= self.start_ns else 0
        return got

    def stats(self) -> dict:
        return {"episodes": self.episodes, "hits": self.hits, "ceded": self.ceded,
                "seconds": self.spent_ns / 1e9}
