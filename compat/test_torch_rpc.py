"""torch's RPC test suite, run against torchwire (collected only by ``./run compat``).

The classes below are torch's own (imported from the installed torch), mixed with
torchwire's fixture; see ``compat/fixture.py``.
"""

import os

import _alias

# A spawned worker (the CUDA suites) imports this module without conftest.py: alias first.
_alias.install(placeholders=os.environ.get("TORCHWIRE_COMPAT_PATCH_ONLY") != "1")

from fixture import build_classes  # noqa: E402

globals().update(build_classes(__name__))
