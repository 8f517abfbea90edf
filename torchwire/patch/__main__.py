"""``python -m torchwire.patch SCRIPT [ARGS...]`` or ``-m MODULE [ARGS...]``: run a program
written for ``torch.distributed.rpc`` on torchwire (see :mod:`torchwire.patch`).

The program runs as ``__main__`` with ``sys.argv`` as it expects (``[SCRIPT, ARGS...]``)
and its own directory first on ``sys.path``, as ``python SCRIPT`` would run it.
"""

from __future__ import annotations

import os
import runpy
import sys

from . import install

_USAGE = "usage: python -m torchwire.patch SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main(argv: list[str]) -> None:
    """Install the patch, then run the program that ``argv`` names."""
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(_USAGE, file=sys.stderr if not argv or argv[0] == "-m" else sys.stdout)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] != "-m" and not os.path.exists(argv[0]):
        print(f"python -m torchwire.patch: can't open file {argv[0]!r}: no such file",
              file=sys.stderr)
        raise SystemExit(2)
    install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
