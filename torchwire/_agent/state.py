"""The agent's states.

::

    RUNNING  --shutdown(graceful=True)-->  DRAINING  --rounds done-->  CLOSED
    RUNNING  --shutdown(graceful=False)-->  CLOSED

A DRAINING agent still serves and calls (termination detection needs it); a CLOSED
one refuses both.
"""

from __future__ import annotations

import enum


class AgentState(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"
