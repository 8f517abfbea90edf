"""A connection lends its reading to the caller waiting for its reply (``_wire/lending.py``).

The state machine on its own (threads, no sockets), then real two-worker jobs: calls
whose callers read their own replies, replies nobody waits for while the reading is
lent, a borrowed wait's deadline, a peer killed during one, Ctrl-C in one and inside
a frame, and a frame that breaks in a borrower's hands.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading

import pytest
import torch

import torchwire.rpc as rpc
from _cluster import after_gate, die, open_gate, options, run_world, wait_until
from torchwire._base.errors import ProtocolError, RpcTimeoutError
from torchwire._wire import frame as F
from torchwire._wire import lending, polling, reader
from torchwire._wire.lending import BORROWED, LENT, READING, ReadRole

pytestmark = pytest.mark.timeout(90)


# ------------------------------------------------------------------ the state machine


def _park(role, idle=lambda: True):
    """The reader's side: ``role.lend(idle)`` on a thread; returns (thread, result)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(role.lend(idle)), daemon=True)
    t.start()
    return t, out


def test_a_lent_reading_nobody_borrows_returns_to_its_reader(monkeypatch):
    monkeypatch.setattr(lending, "LINGER_S", 0.05)
    role = ReadRole()
    t, out = _park(role)
    assert wait_until(lambda: role.state is LENT)
    t.join(10)
    assert not t.is_alive() and out == [None]
    assert role.state is READING and role.lends == 1 and not role.borrow()


def test_a_call_pending_keeps_the_reader_reading():
    role = ReadRole()
    assert role.lend(lambda: False) is None  # returns at once: nothing to park for
    assert role.state is READING and role.lends == 0 and not role.borrow()


def test_a_borrower_lends_the_reading_on_or_hands_it_back(monkeypatch):
    monkeypatch.setattr(lending, "LINGER_S", 30.0)  # only a hand-back ends the park
    role = ReadRole()
    t, out = _park(role)
    assert wait_until(lambda: role.state is LENT)
    assert role.borrow() and role.state is BORROWED
    assert not role.borrow()  # one borrower at a time
    role.give_back(False)  # its reply is in, nothing else pending: lent on
    assert role.state is LENT and t.is_alive()
    assert role.borrow()
    role.give_back(True)  # another call pending: the reader reads again
    t.join(10)
    assert out == [None] and role.state is READING and role.borrows == 2


def test_a_borrowers_error_reaches_the_reader(monkeypatch):
    monkeypatch.setattr(lending, "LINGER_S", 30.0)
    role = ReadRole()
    t, out = _park(role)
    assert wait_until(lambda: role.state is LENT) and role.borrow()
    err = ProtocolError("broken inside a frame")
    role.give_back(False, err)  # an error always goes back to the reader
    t.join(10)
    assert out == [err] and role.state is READING and role.error is None


def test_closing_wakes_a_parked_reader_and_stops_lending(monkeypatch):
    monkeypatch.setattr(lending, "LINGER_S", 30.0)
    role = ReadRole()
    t, out = _park(role)
    assert wait_until(lambda: role.state is LENT)
    role.wake()
    t.join(10)
    assert out == [None] and role.state is READING
    assert not role.borrow()
    assert role.lend(lambda: True) is None and role.state is READING  # no more lending


def test_lend_us_is_checked(monkeypatch):
    monkeypatch.setenv("TORCHWIRE_LEND_US", "soon")
    with pytest.raises(ValueError, match="TORCHWIRE_LEND_US must be a number"):
        lending._linger_s()
    monkeypatch.setenv("TORCHWIRE_LEND_US", "0")
    assert lending._linger_s() == 0


# ------------------------------------------------------------------ real jobs


def triple(t):
    return t * 3


def noop():
    return None


def _role():
    """This worker's connection to worker1, and its ReadRole."""
    from torchwire._agent.runtime import current
    conn = current.runtime.agent.links.connection_to(1)
    return conn, conn.role


def _lent_for_long() -> None:
    """This worker's lent connections wait for a borrower up to 30 s (not 2 ms): a
    test that needs the next call borrowed must not depend on how soon it comes."""
    lending.LINGER_S = 30.0


def _lent():
    """A call to worker1 whose reply the reader completes, which then lends the
    reading (for long); returns ``_role()`` once it is lent."""
    conn, role = _role()
    _lent_for_long()
    rpc.rpc_sync("worker1", noop)
    assert wait_until(lambda: role.state is LENT, 20), role
    return conn, role


def _init(rank, world_size, init_method):
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=options(init_method))


def test_a_caller_waiting_at_once_reads_its_replies_itself():
    def body(rank, world_size):
        if rank == 1:
            return None
        conn, role = _lent()
        before = role.borrows
        ok = True
        for k in range(200):
            x = torch.full((64,), float(k))
            ok = ok and torch.equal(rpc.rpc_sync("worker1", triple, args=(x,)), x * 3)
        synced = role.borrows - before, role.lends
        # remote() + to_here(): to_here() borrows and reads the creation's reply too;
        # when the creation's reply comes after to_here()'s (the owner answers them on
        # different threads), the reading goes back to the reader for it, and the
        # next to_here() waits as before, until a reply lends the reading again
        before = role.borrows
        for k in range(50):
            x = torch.full((1 << 18,), float(k))  # 1 MiB: a channel's buffer
            rref = rpc.remote("worker1", triple, args=(x,))
            ok = ok and torch.equal(rref.to_here(), x * 3)
        return ok, synced, role.borrows - before, conn.closed

    ok, (synced, lends), remote_borrows, closed = run_world(body, 2)[0]
    assert ok and not closed
    # the reader lent the reading once; every rpc_sync caller read its own reply
    assert synced == 200 and lends == 1, (synced, lends)
    assert remote_borrows >= 25, remote_borrows


def test_waiting_on_futures_lends_the_reading_to_the_next_wait():
    def body(rank, world_size):
        if rank == 1:
            return None
        _conn, role = _role()
        _lent_for_long()
        assert role.state == READING  # nothing lent yet: the first reply is the reader's
        values, lent_before = [], []
        for _ in range(50):
            lent_before.append(role.lends)
            values.append(float(rpc.rpc_async("worker1", triple,
                                              args=(torch.ones(1),)).wait()))
        return values == [3.0] * 50, lent_before, role.lends, role.borrows

    ok, lent_before, lends, borrows = run_world(body, 2)[0]
    assert ok
    # The reader lends the reading after the first reply a wait() waited for: the
    # first call's, unless its reply came before wait() did (a busy machine), then
    # the next one's.  Every wait() after that read its own reply.
    read_by_reader = lent_before.count(0)
    assert lends == 1 and read_by_reader <= 10, (lends, lent_before)
    assert borrows == 50 - read_by_reader, (borrows, read_by_reader)


def test_turned_off_no_connection_lends():
    def body(rank, world_size, init_method):
        lending.LINGER_S = 0  # TORCHWIRE_LEND_US=0, read at import
        _init(rank, world_size, init_method)
        role = None
        if rank == 0:
            values = [rpc.rpc_sync("worker1", triple, args=(torch.ones(2),)) for _ in range(20)]
            assert all(torch.equal(v, torch.full((2,), 3.0)) for v in values)
            role = _role()[1]
        rpc.shutdown()
        return role

    assert run_world(body, 2, init=False) == [None, None]


def _relent(role) -> bool:
    """A call whose reply the reader completes, then lends the reading: lent again."""
    rpc.rpc_sync("worker1", noop)
    return wait_until(lambda: role.state is LENT, 20)


def _waited_elsewhere(how: str) -> threading.Event:
    """A call to worker1 whose reply ``how`` waits for, not the calling thread: an
    event set once it has."""
    import asyncio
    called = threading.Event()
    one = torch.ones(3)
    if how == "then":
        rpc.rpc_async("worker1", triple, args=(one,)).then(lambda f: called.set())
    elif how == "add_done_callback":
        rpc.rpc_async("worker1", triple, args=(one,)).add_done_callback(
            lambda f: called.set())
    elif how == "await":
        async def main():
            await rpc.rpc_async("worker1", triple, args=(one,))
            called.set()
        threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
    else:  # a pool thread's wait()
        from torchwire._agent.runtime import current
        fut = rpc.rpc_async("worker1", triple, args=(one,))
        current.runtime.agent.defer(lambda: (fut.wait(), called.set()))
    return called


def test_calls_sent_while_the_reading_is_lent_reach_whoever_waits():
    def body(rank, world_size):
        if rank == 1:
            return None
        _conn, role = _lent()  # a lent reading waits 30 s for a borrower
        one = torch.ones(3)
        # fut.wait() borrows the reading, as rpc_sync does
        before = role.borrows
        waited = torch.equal(rpc.rpc_async("worker1", triple, args=(one,)).wait(), one * 3)
        borrowed = role.borrows - before
        # a callback, an await, a wait on one of torchwire's threads: nobody borrows,
        # so the reader takes the reading back at once (not after 30 s)
        outcomes = {}
        for how in ("then", "add_done_callback", "await", "pool thread"):
            relent = _relent(role)
            outcomes[how] = (relent, _waited_elsewhere(how).wait(20))
        # threads mixing calls they wait for and calls in flight: every value right
        errors: list = []

        def syncs():
            try:
                for k in range(200):
                    x = torch.full((8,), float(k))
                    assert torch.equal(rpc.rpc_sync("worker1", triple, args=(x,)), x * 3)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=syncs)
        t.start()
        for k in range(40):
            futs = [rpc.rpc_async("worker1", triple, args=(torch.full((4,), float(j)),))
                    for j in range(5)]
            got = [f.wait() for f in futs]
            if not all(torch.equal(g, torch.full((4,), 3.0 * j)) for j, g in enumerate(got)):
                errors.append(AssertionError(f"wrong values in round {k}"))
        t.join(60)
        return waited, borrowed, outcomes, [repr(e) for e in errors], t.is_alive()

    waited, borrowed, outcomes, errors, stuck = run_world(body, 2)[0]
    assert waited and borrowed == 1
    assert outcomes == {how: (True, True) for how in outcomes} and len(outcomes) == 4, \
        outcomes
    assert errors == [] and not stuck


def test_a_burst_of_calls_sent_while_lent_wakes_the_reader():
    def body(rank, world_size):
        if rank == 1:
            return None
        _conn, role = _lent()  # 30 s before the reader would take the reading back
        one = torch.ones(2)
        futs = [rpc.rpc_async("worker1", triple, args=(one,))
                for _ in range(lending.SENT_MAX)]
        after_few = role.state  # a remote() before its to_here(): still lent
        futs.append(rpc.rpc_async("worker1", triple, args=(one,)))
        after_burst = role.state  # more: their replies must not pile up unread
        done = threading.Event()
        torch.futures.collect_all(futs).then(lambda f: done.set())  # (no reclaim)
        return after_few, after_burst, done.wait(20), all(
            torch.equal(f.wait(), one * 3) for f in futs)

    after_few, after_burst, done, values_ok = run_world(body, 2)[0]
    assert after_few == LENT and after_burst == READING
    assert done and values_ok


def test_a_reply_nobody_asks_for_waits_for_the_reader_at_most_the_linger():
    def body(rank, world_size):
        if rank == 1:
            return None
        _conn, role = _role()
        lending.LINGER_S = 0.2
        rpc.rpc_sync("worker1", noop)
        lent = wait_until(lambda: role.state is LENT, 20)
        done = threading.Event()
        # an inline callback (torchwire's own bookkeeping) does not reclaim the
        # reading: the reader reads the reply once the linger has passed
        fut = rpc.rpc_async("worker1", triple, args=(torch.ones(2),))
        fut._add_inline_callback(lambda f: done.set())
        return lent, done.wait(20), role.state

    lent, done, state = run_world(body, 2)[0]
    assert lent and done
    assert state is READING or state == READING  # taken back, not borrowed


def test_replies_decode_as_on_a_reader_whatever_modes_the_caller_is_in():
    def body(rank, world_size):
        if rank == 1:
            return None
        _conn, role = _lent()
        x = torch.ones(4)
        out = {}
        for name, mode in (("device", lambda: torch.device("meta")),
                           ("inference", torch.inference_mode),
                           ("no_grad", torch.no_grad)):
            _relent(role)
            with mode():
                y = rpc.rpc_sync("worker1", triple, args=(x,))
                z = rpc.remote("worker1", triple, args=(x,)).to_here()
            out[name] = [(str(t.device), t.is_inference(), t.tolist()) for t in (y, z)]
        return out

    out = run_world(body, 2)[0]
    # as torch's agent threads make them: CPU tensors, not inference tensors
    expected = [("cpu", False, [3.0] * 4)] * 2
    assert out == {"device": expected, "inference": expected, "no_grad": expected}, out


def _nested_calls(n):
    """On worker1, inside a call (a torchwire thread): ``n`` sync calls to worker0;
    whether worker1's connection to worker0 ever lent its reading."""
    from torchwire._agent.runtime import current
    _lent_for_long()  # a lent reading would keep these waiting for 30 s
    values = [float(rpc.rpc_sync("worker0", triple, args=(torch.ones(1),))) for _ in range(n)]
    role = current.runtime.agent.links.connection_to(0).role
    return values == [3.0] * n, role.lends, role.borrows


def test_calls_made_on_torchwires_own_threads_never_lend():
    def body(rank, world_size):
        if rank == 1:
            return None
        return rpc.rpc_sync("worker1", _nested_calls, args=(50,))

    ok, lends, borrows = run_world(body, 2)[0]
    assert ok and lends == 0 and borrows == 0


def test_a_borrowed_wait_ends_at_the_calls_deadline():
    def body(rank, world_size):
        if rank == 1:
            return None
        _conn, role = _lent()
        before = role.borrows
        try:
            rpc.rpc_sync("worker1", after_gate, args=("lend-deadline", 1), timeout=0.5)
            outcome = "returned"
        except RpcTimeoutError as exc:
            outcome = str(exc)
        borrowed = role.borrows - before
        rpc.rpc_sync("worker1", open_gate, args=("lend-deadline",))
        after = rpc.rpc_sync("worker1", triple, args=(torch.ones(1),))
        return outcome, borrowed, float(after)

    outcome, borrowed, after = run_world(body, 2)[0]
    assert "RPC ran for more than set timeout (500 ms)" in outcome, outcome
    assert "worker1" in outcome
    assert borrowed == 1  # the timed-out call's caller was reading
    assert after == 3.0  # the late reply was dropped; the connection serves on


def _die_now():
    die("killed", signal.SIGKILL)


def test_a_peer_killed_during_a_borrowed_wait_fails_the_call_naming_it():
    def body(rank, world_size, init_method):
        _init(rank, world_size, init_method)
        if rank == 1:
            threading.Event().wait(60)  # until killed
            return None
        _conn, role = _lent()
        before = role.borrows
        try:
            rpc.rpc_sync("worker1", _die_now)
            outcome = "returned"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        borrowed = role.borrows - before
        rpc.shutdown(graceful=False)
        return outcome, borrowed

    (outcome, borrowed), killed = run_world(body, 2, init=False)
    assert killed == "killed"
    assert borrowed == 1
    assert "worker1" in outcome, outcome


def _blocked_borrowing(ident: int) -> bool:
    """Is thread ``ident`` waiting for a frame in a borrowed read (``ready``, or the
    polling it calls)?"""
    f = sys._current_frames().get(ident)
    if f is not None and f.f_code.co_filename == polling.__file__:
        f = f.f_back
    return (f is not None and f.f_code.co_name == "ready"
            and f.f_code.co_filename == reader.__file__)


def test_ctrl_c_interrupts_a_borrowed_wait_and_the_connection_serves_on():
    def body(rank, world_size):
        if rank == 1:
            return None
        conn, role = _lent()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        main, signalled = threading.get_ident(), []

        def interrupt():
            if wait_until(lambda: _blocked_borrowing(main), 20):
                signalled.append(True)
                os.kill(os.getpid(), signal.SIGINT)

        helper = threading.Thread(target=interrupt, daemon=True)
        helper.start()
        try:
            rpc.rpc_sync("worker1", after_gate, args=("lend-ctrl-c", 1))
            outcome = "returned"
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        helper.join()
        handler_back = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        rpc.rpc_sync("worker1", open_gate, args=("lend-ctrl-c",))
        after = rpc.rpc_sync("worker1", triple, args=(torch.ones(1),))
        return signalled, outcome, handler_back, float(after), conn.closed, \
            _role()[0] is conn

    signalled, outcome, handler_back, after, closed, same = run_world(body, 2)[0]
    assert signalled, "the main thread was never seen waiting in a borrowed read"
    assert outcome == "KeyboardInterrupt"
    assert handler_back  # Python's own SIGINT handler is back
    assert after == 3.0 and not closed and same


def test_ctrl_c_inside_a_frame_waits_for_its_end():
    def body(rank, world_size):
        if rank == 1:
            return None
        from torchwire._agent.runtime import current
        pending = current.runtime.agent.pending
        conn, role = _lent()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        complete = pending.complete
        seen: list = []

        def complete_under_ctrl_c(*args):  # a fault hook: Ctrl-C while a reply is read
            if threading.current_thread() is threading.main_thread() and not seen:
                seen.append(role.state)
                os.kill(os.getpid(), signal.SIGINT)
            return complete(*args)

        pending.complete = complete_under_ctrl_c
        try:
            rpc.rpc_sync("worker1", triple, args=(torch.ones(2),))
            outcome = "returned"
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        finally:
            pending.complete = complete
        after = rpc.rpc_sync("worker1", triple, args=(torch.ones(1),))
        return seen, outcome, float(after), conn.closed, _role()[0] is conn

    seen, outcome, after, closed, same = run_world(body, 2)[0]
    assert seen == [BORROWED]  # the reply was being read by the waiting caller
    assert outcome == "KeyboardInterrupt"  # raised after the frame, not inside it
    assert after == 3.0 and not closed and same  # the stream stayed whole


def test_a_frame_broken_in_a_borrowers_hands_ends_the_connection_with_why():
    finished = mp.get_context("fork").Event()  # rank 0 is done: rank 1 may go

    def body(rank, world_size, init_method):
        _init(rank, world_size, init_method)
        outcome = None
        if rank == 1:
            finished.wait(60)
        else:
            conn, role = _lent()
            original = F.decode_buffer_lens

            def broken(*args):  # a fault hook: what a corrupt table of buffers raises
                raise ProtocolError("planted: buffer table does not add up")

            F.decode_buffer_lens = broken  # taken by the next read loop: the borrower's
            try:
                rpc.rpc_sync("worker1", triple, args=(torch.ones(4),))
                outcome = "returned"
            except Exception as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            finally:
                F.decode_buffer_lens = original
            outcome = (outcome, conn.closed, repr(conn.close_reason))
            finished.set()
        rpc.shutdown(graceful=False)
        return outcome

    (outcome, closed, reason), _ = run_world(body, 2, init=False)
    assert "worker1" in outcome and "planted" in outcome, outcome
    assert closed and "planted" in reason
