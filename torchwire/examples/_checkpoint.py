"""The parameter server's snapshots (``--checkpoint DIR``): written atomically, so a
restarted server never reads half a file.

A snapshot is one ``torch.save`` of a dict (model and optimizer state, the step
count, the test curve) to ``DIR/ps.pt.tmp``, then ``os.replace`` onto ``DIR/ps.pt``
(atomic on POSIX): a crash during the write leaves the previous snapshot whole.
"""

from __future__ import annotations

import os

import torch

NAME = "ps.pt"


def save(directory: str, state: dict) -> None:
    """Write ``state`` as the latest snapshot in ``directory`` (atomically)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, NAME)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(directory: str) -> dict | None:
    """The latest snapshot in ``directory``, or None if there is none."""
    path = os.path.join(directory, NAME)
    if not os.path.exists(path):
        return None
    return torch.load(path, weights_only=False)
