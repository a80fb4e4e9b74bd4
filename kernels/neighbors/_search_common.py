"""The result type shared by the neighbour search and its backends: CSR neighbour lists.

It lives apart from :mod:`.search` so that the GPU backend (:mod:`.search_gpu`), which
:mod:`.search` imports, can build it without importing :mod:`.search` back.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..backend import is_cupy

__all__ = ["Neighbors"]


class Neighbors(NamedTuple):
    """Neighbour lists in CSR form (numpy or CuPy arrays, following the device).

    Attributes
    ----------
    offsets : (Q + 1,) int64
        Query ``i`` owns entries ``offsets[i]:offsets[i + 1]``.
    indices : (M,) int64 on the CPU, int32 on the GPU
        Indices into the searched point set.
    sq_distances : (M,) float32
        Squared Euclidean distances, computed in float32.
    """

    offsets: object
    indices: object
    sq_distances: object

    @property
    def counts(self):
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def distances(self):
        """Euclidean distances (float32)."""
        if is_cupy(self.sq_distances):
            import cupy as cp

            return cp.sqrt(self.sq_distances)
        return np.sqrt(self.sq_distances)
