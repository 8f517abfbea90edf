"""The examples' real data, all installed with a package or shipped in the repo.

Nothing is downloaded at run time.
"""

from __future__ import annotations

from pathlib import Path

import torch

DATA = Path(__file__).parent / "data"


def digits(seed: int, test_fraction: float = 0.2):
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).

    Returns:
        ``(x_train, y_train, x_test, y_test)``: float pixels scaled to 0..1, int64
        labels; a fixed shuffle by ``seed``.
    """
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = int(len(y) * test_fraction)
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def corpus() -> str:
    """A few KB of public-domain English text shipped with torchwire (see data/README)."""
    return (DATA / "corpus.txt").read_text(encoding="utf-8")
