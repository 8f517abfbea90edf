"""``torchwire.profiler``: one trace of a whole job.

:class:`JobProfile` starts torch.profiler on every worker from one driver, stops it,
and writes one Chrome/Perfetto trace: a process row per worker, clocks aligned by
offsets measured over the RPC links, and flow arrows from each call to its run on
the callee.  See docs/guide-observability.md.
"""

from __future__ import annotations

from ._job import JobProfile

__all__ = ["JobProfile"]

JobProfile.__module__ = __name__
