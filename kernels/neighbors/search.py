"""3-D neighbourhood search: radius search and k nearest neighbours, CPU and GPU.

Both backends use the same inclusion rule so that their lists are identical: a surface point
``p`` is a radius neighbour of a query ``q`` when its squared distance, computed in float32 as
``(q.x-p.x)**2 + (q.y-p.y)**2 + (q.z-p.z)**2`` (left to right, no fused multiply-add), is
strictly below ``float32(radius * radius)``. This is FLANN's rule, which PCL's ``KdTreeFLANN``
uses, so neighbour lists match PCL's.

Lists come back as CSR (:class:`Neighbors`): ``offsets`` (Q+1,), ``indices`` (M,) and
``sq_distances`` (M,) float32, each query's segment sorted by (squared distance, index) unless
``sort=False``. With ``max_neighbors`` a list keeps only its nearest ``max_neighbors`` entries
(the "capped" lists of the approximate G-SHOT mode).

* CPU: the same uniform grid (cell list) in numba, parallel over queries; per-segment sort
  or O(n) nearest-m selection for capped lists. k-NN uses :class:`scipy.spatial.cKDTree`
  candidates re-ranked with the exact float32 distances.
* GPU: a uniform grid (cell list) in CuPy: points are counting-sorted into cells of edge
  >= radius, then each query scans the 27 surrounding cells (one thread per query) in two
  passes (count, then fill) around an exclusive scan. k-NN scans growing shells of cells.
"""
from __future__ import annotations

import numpy as np

from .. import validation
from ..backend import resolve_device, to_device
from ..errors import InputError
from ._search_common import Neighbors

__all__ = ["Neighbors", "radius_search", "knn"]


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def radius_search(points, queries=None, *, radius, max_neighbors: int | None = None,
                  sort: bool = True, device: str = "auto") -> Neighbors:
    """All points within ``radius`` of each query (PCL/FLANN inclusion rule, see module doc).

    Parameters
    ----------
    points : (N, 3) array
        The searched set (numpy or CuPy).
    queries : (Q, 3) array, optional
        Query coordinates; ``points`` itself when omitted (each point is then its own
        neighbour at distance 0).
    radius : float
        Search radius (strict: squared distance < float32(radius**2)).
    max_neighbors : int, optional
        Keep only the nearest ``max_neighbors`` of each list (ties by index).
    sort : bool
        Sort each list by (squared distance, index). Capped lists are always sorted on the CPU;
        on the GPU, ``sort=False`` returns lists in cell-scan order (capped lists then hold the
        right set, in no particular order).
    device : {"auto", "cpu", "gpu"}

    Returns
    -------
    Neighbors
    """
    r = validation.positive(radius, "radius")
    dev = resolve_device(device, points, *([] if queries is None else [queries]))
    pts = validation.points(to_device(points, dev), "points")
    qs = pts if queries is None else validation.points(to_device(queries, dev), "queries", allow_empty=True)
    if max_neighbors is not None:
        max_neighbors = int(max_neighbors)
        if max_neighbors < 1:
            raise InputError(f"max_neighbors must be >= 1, got {max_neighbors}")
    if dev == "gpu":
        from . import search_gpu as g

        grid = g.build_grid(pts, r)
        return g.radius_search(grid, qs, r, max_neighbors=max_neighbors, sort=sort,
                               original_indices=True)
    return radius_search_cpu(pts, qs, r, max_neighbors=max_neighbors, sort=sort)


def knn(points, queries=None, *, k: int, device: str = "auto"):
    """The ``k`` nearest points of each query.

    Parameters
    ----------
    points : (N, 3) array
    queries : (Q, 3) array, optional (defaults to ``points``; each point is then its own
        first neighbour)
    k : int
        Number of neighbours, ``1 <= k <= N``.
    device : {"auto", "cpu", "gpu"}

    Returns
    -------
    indices : (Q, k) int64 (CPU) / int32 (GPU)
        Sorted by (squared distance, index).
    sq_distances : (Q, k) float32
    """
    dev = resolve_device(device, points, *([] if queries is None else [queries]))
    pts = validation.points(to_device(points, dev), "points")
    qs = pts if queries is None else validation.points(to_device(queries, dev), "queries", allow_empty=True)
    k = int(k)
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}")
    if k > pts.shape[0]:
        raise InputError(f"k={k} is larger than the number of points ({pts.shape[0]})")
    if dev == "gpu":
        from . import search_gpu as g

        if k > g.KNN_KMAX:
            raise InputError(f"k={k} exceeds the GPU k-NN limit of {g.KNN_KMAX}")
        grid = g.build_grid_knn(pts, k)
        idx, d2 = g.knn(grid, qs, k)
        return grid.order[idx].astype(idx.dtype), d2
    return knn_cpu(pts, qs, k)


# ---------------------------------------------------------------------------------------------
# CPU backend
# ---------------------------------------------------------------------------------------------
def radius_search_cpu(pts: np.ndarray, qs: np.ndarray, r: float, *, max_neighbors=None,
                      sort=True) -> Neighbors:
    """:func:`radius_search` on the CPU for arrays already validated (float32 (N, 3) ``pts`` and
    (Q, 3) ``qs``): the CPU backend that descriptors call directly, chunk by chunk."""
    from .search_cpu import grid_radius

    nq = qs.shape[0]
    r2 = np.float32(r * r)
    if nq == 0:
        return Neighbors(np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
    g = cpu_grid(pts, r)
    cap = -1 if max_neighbors is None else int(max_neighbors)
    return Neighbors(*grid_radius(g[0], g[1], g[2], g[3], g[4], g[5], qs, r2, cap, bool(sort)))


_GRID_CACHE: dict = {}


def cpu_grid(pts: np.ndarray, r: float):
    """Cell list of ``pts`` with cells of edge >= r (the last one is cached for reuse): ``(sorted
    points, order, cell starts, origin, 1/edge, dims)``, the grid of :func:`radius_search_cpu`, which
    SHOT and recognition's scene index reuse."""
    from .search_cpu import cell_ids

    key = (pts.__array_interface__["data"][0], pts.shape, float(r))
    hit = _GRID_CACHE.get("g")
    if hit is not None and hit[0] == key and hit[2] is pts:
        return hit[1]
    n = pts.shape[0]
    lo = pts.min(axis=0).astype(np.float64)
    ext = np.maximum(pts.max(axis=0).astype(np.float64) - lo, 0.0)
    h = float(r) * 1.001
    while True:
        dims = np.floor(ext / h).astype(np.int64) + 1
        if int(np.prod(dims)) <= max(8 * n, 1 << 16):
            break
        h *= 1.25
    origin = lo.astype(np.float32)
    inv_h = np.float32(1.0 / h)
    cid = cell_ids(pts, origin, inv_h, dims)
    order = np.argsort(cid, kind="stable")
    cs = np.zeros(int(np.prod(dims)) + 1, np.int64)
    np.cumsum(np.bincount(cid, minlength=int(np.prod(dims))), out=cs[1:])
    g = (np.ascontiguousarray(pts[order]), order.astype(np.int64), cs, origin, inv_h, dims)
    _GRID_CACHE["g"] = (key, g, pts)
    return g


_TREE_CACHE: dict = {}


def _tree(pts):
    """cKDTree of ``pts`` (the last one is cached: SHOT chunks reuse it)."""
    from scipy.spatial import cKDTree

    key = (pts.__array_interface__["data"][0], pts.shape, pts.strides)
    hit = _TREE_CACHE.get("t")
    if hit is not None and hit[0] == key and hit[2] is pts:
        return hit[1]
    t = cKDTree(pts, leafsize=16, balanced_tree=False, compact_nodes=False)
    _TREE_CACHE["t"] = (key, t, pts)
    return t


def knn_cpu(pts, qs, k):
    """:func:`knn` on the CPU for arrays already validated (float32 (N, 3) ``pts``, (Q, 3) ``qs``,
    ``1 <= k <= N``): ``(indices (Q, k) int64, sq_distances (Q, k) float32)``."""
    from .search_cpu import exact_sq_dist_sort

    if qs.shape[0] == 0:
        return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
    tree = _tree(pts)
    # ask for a few extra so that ties / float32 re-ranking at the k-th place are resolved
    kk = min(pts.shape[0], k + 4)
    _, idx = tree.query(qs, k=kk, workers=-1)
    idx = np.ascontiguousarray(idx.reshape(qs.shape[0], kk), dtype=np.int64)
    idx, d2 = exact_sq_dist_sort(pts, qs, idx)
    return np.ascontiguousarray(idx[:, :k]), np.ascontiguousarray(d2[:, :k])
