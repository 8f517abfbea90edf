"""torch's RPC test suite, run against torchwire (collected only by ``./run compat``).

The classes below are torch's own (imported from the installed torch), mixed with
torchwire's fixture; see ``compat/fixture.py``.
"""

from fixture import build_classes

globals().update(build_classes(__name__))
