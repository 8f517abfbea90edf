"""A module whose import takes a while (as one importing large libraries does): the
import-race test calls it from several threads of a worker that has not imported it.
Only that test imports it."""

import time

time.sleep(0.3)  # widens the window in which the module is partly initialised


def triple(x):
    return 3 * x
