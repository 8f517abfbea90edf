import os
import sys
from pathlib import Path

# Workers are forked from this process, so it must not initialize CUDA (a forked child
# could not use it then): torch.cuda.is_available() asks NVML instead of the runtime.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Workers are forked from this process: it must never start torch's intra-op thread
# pool, or a child's first parallel op hangs on the pool state it inherited.
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))

from _cluster import World  # noqa: E402


@pytest.fixture(scope="session")
def world():
    """Four workers (worker0..worker3) shared by the tests that only make calls."""
    w = World(4)
    yield w
    w.close()
