"""Remote references: owner and user RRefs and their reference-counting protocol.

An RRef names a value that lives on one worker, its *owner*.  Every other worker
that holds it holds a *user* RRef, identified by the value's ``rref_id`` and its
own ``fork_id`` (both ``(created_on, local_id)``: the rank that made it and a
counter).  The owner keeps the value while any fork of it exists anywhere, and
while local RRef objects on the owner refer to it.

The protocol (torch's RRef design note; G1: the owner learns of every user's
deletion; G2: a parent keeps its own fork until the owner knows of the child):

* ``remote(to, f)``: the caller makes ``rref_id`` and ``fork_id`` and sends
  ``remote_exec``; the owner registers the fork, runs ``f`` and replies.  The
  reply *confirms* the caller's fork.
* A user RRef pickled into a message to a third worker makes a child fork: the
  parent keeps itself alive in ``_children`` until the child has told the owner
  (FORK control message, confirmed by its reply) and then the parent (ACCEPT).
* Pickled into a *request* to its owner, nothing is forked: the parent is
  pinned to the call until the reply, by which time the owner has unpickled it.
  Into a *reply* to its owner it is forked, and the owner sends ACCEPT.
* The owner pickling its own RRef for a user registers the fork itself: the
  child is confirmed at once.
* A user RRef that dies (or is deleted by shutdown) sends DEL once it is
  confirmed; never before, so a deletion cannot overtake its fork.

Control messages go through one thread per process, the janitor (``janitor.py``).

Out-of-order arrival: a fork or fetch may reach the owner before the
``remote_exec`` that creates the value (a pool runs them concurrently); the owner
then creates the entry empty and the value fills it later.  A deletion that
arrives for a fork never registered leaves a tombstone, so the late registration
is dropped; so does the deletion of a fork whose FORK went more than once (retried,
or given up on), whatever it finds.

Modules: ``records`` (ids, entries, fork state, event kinds), ``handlers`` (what
runs on the owner), ``rref`` (the ``RRef`` class and its proxies), ``janitor``,
``context`` (the per-runtime tables and pickling).
"""

from .context import RRefContext
from .records import context
from .rref import RRef, remote

__all__ = ["RRef", "RRefContext", "context", "remote"]
