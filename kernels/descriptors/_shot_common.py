"""What SHOT's public module and its GPU backend share: the approximate mode's default cap.

It lives apart from :mod:`.shot` so that :mod:`.shot_gpu`, which :mod:`.shot` imports, can use
it without importing :mod:`.shot` back.
"""
from __future__ import annotations

import numpy as np

from ..backend import to_numpy

__all__ = ["median_count"]


def median_count(counts) -> int:
    """The approximate mode's default cap: the median neighbour count (at least 5)."""
    c = np.asarray(to_numpy(counts))
    if c.size == 0:
        return 5
    return max(5, int(np.median(c)))
