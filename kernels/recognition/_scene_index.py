"""The scene as verification (:mod:`.verification`) and ICP (:mod:`.icp`) both search it.

:class:`_SceneIndex` holds a scene's points and normals with its nearest-neighbour structure
(CPU: a lazily built cell list, and a ``scipy`` KD-tree for radii wider than a cell; GPU: the cell list of
:mod:`._verification_gpu`) and its voxel ranks. It lives apart from both so that :mod:`.icp`
can build one without importing the recognition pipeline.
"""
from __future__ import annotations

import numpy as np

from ..backend import to_numpy
from ..errors import InputError


class _SceneIndex:
    """The scene as seen by verification and ICP: points, normals, NN search, voxel ranks."""

    def __init__(self, points, normals, cell: float, device: str):
        self.device = device
        self.cell = float(cell)
        if device == "gpu":
            import cupy as cp

            from . import _verification_gpu as g

            self.points = cp.ascontiguousarray(cp.asarray(points, dtype=cp.float32))
            self.normals = None if normals is None else cp.ascontiguousarray(
                cp.asarray(normals, dtype=cp.float32))
            self.grid = g.build_grid(self.points, self.cell)
        else:
            self.points = np.ascontiguousarray(to_numpy(points), np.float32)
            self.normals = None if normals is None else np.ascontiguousarray(to_numpy(normals),
                                                                             np.float32)
            self._tree = None  # a KD-tree, for a radius wider than a cell, built on first use
            self._cells = None  # the cell list of verification lookups, built on first use
        self._vox = None
        self._n_vox = 0

    @property
    def vox(self):
        """Dense rank of each point's voxel (edge ``cell``, origin at the min corner; voxels in
        key order), built on first use (verification claims voxels; ICP and the polish do not)."""
        if self._vox is None:
            if self.device == "gpu":
                from . import _verification_gpu as g

                self._vox = g.voxel_ranks(self.points, self.cell)
            else:
                from ..descriptors.keypoints import voxel_ranks

                self._vox = voxel_ranks(self.points, self.cell)
            self._n_vox = int(self._vox.max()) + 1 if len(self._vox) else 0
        return self._vox

    @property
    def n_vox(self) -> int:
        """The number of occupied voxels (with :attr:`vox`)."""
        _ = self.vox  # built with the ranks
        return self._n_vox

    @property
    def tree(self):
        """CPU: the scene's ``scipy`` KD-tree, built on first use."""
        if self._tree is None:
            from scipy.spatial import cKDTree

            self._tree = cKDTree(self.points)
        return self._tree

    def cells(self):
        """CPU: cell list of the scene (cells of edge >= ``cell``), as ``neighbors.search.cpu_grid``."""
        if self._cells is None:
            from ..neighbors.search import cpu_grid

            if len(self.points) == 0:
                raise InputError("scene is empty (0 points)")
            self._cells = cpu_grid(self.points, self.cell)
        return self._cells

    def cells_hold(self, r: float) -> bool:
        """CPU: whether the cell list answers a nearest search within ``r`` (3x3x3 cells hold every
        point within a cell's width), as ICP's and verification's radius is."""
        return 0 < r <= self.cell and len(self.points) > 0

    def nearest(self, q, r: float):
        """Nearest scene point within ``r`` (squared distance < r^2) of each query: (idx|-1, d2).
        CPU: the cell list's float32 search, as the GPU's (first of equals in cell order), when
        ``r`` is at most a cell (ICP's and verification's radius); the KD-tree beyond."""
        if self.device == "gpu":
            from . import _verification_gpu as g

            return g.nearest(self.grid, q, r)
        if self.cells_hold(r):
            from ..neighbors.search_cpu import grid_nearest_many

            P, order, cs, origin, inv_h, dims = self.cells()
            q = np.ascontiguousarray(to_numpy(q), np.float32)
            bi = np.empty(len(q), np.int64)
            d2 = np.empty(len(q), np.float32)
            grid_nearest_many(P, cs, origin, inv_h, dims, q, np.float32(r * r), bi, d2)
            return np.where(bi >= 0, order[np.maximum(bi, 0)], -1), d2
        d, i = self.tree.query(np.asarray(q, np.float64), k=1, distance_upper_bound=r,
                                 workers=-1 if len(q) > 100_000 else 1)  # threads pay off on big batches
        d2 = (d * d).astype(np.float32)
        i = np.where(np.isfinite(d) & (d2 < np.float32(r * r)), i, -1).astype(np.int64)
        return i, d2

