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


def cpu_grid(pts: np.ndarray, r: float, *, slot: str = "g"):
    """Cell list of ``pts`` with cells of edge >= r (the last one is cached for reuse): ``(sorted
    points, order, cell starts, origin, 1/edge, dims)``, the grid of :func:`radius_search_cpu`, which
    SHOT and recognition's scene index reuse."""
    from ..geom_cpu import finite_bounds
    from .search_cpu import cell_ids, cell_order

    key = (pts.__array_interface__["data"][0], pts.shape, float(r))
    hit = _GRID_CACHE.get(slot)
    if hit is not None and hit[0] == key and hit[2] is pts:
        return hit[1]
    n = pts.shape[0]
    _, lo, hi = finite_bounds(pts)  # (the points are finite)
    ext = np.maximum(hi - lo, 0.0)
    h = float(r) * 1.001
    while True:  # counted in float64: a tiny r's cell counts overflowed int64 (negative dims)
        dims_f = np.floor(np.asarray(ext, np.float64) / h) + 1.0
        if float(np.prod(dims_f)) <= max(8 * n, 1 << 16):
            dims = dims_f.astype(np.int64)
            break
        h *= 1.25
    origin = lo.astype(np.float32)
    inv_h = np.float32(1.0 / h)
    cid = cell_ids(pts, origin, inv_h, dims)
    P, order, cs = cell_order(cid, int(np.prod(dims)), pts)
    g = (P, order, cs, origin, inv_h, dims)
    _GRID_CACHE[slot] = (key, g, pts)
    return g


def knn_cpu(pts, qs, k):
    """:func:`knn` on the CPU for arrays already validated (float32 (N, 3) ``pts``, (Q, 3) ``qs``,
    ``1 <= k <= N``): ``(indices (Q, k) int64, sq_distances (Q, k) float32)``, exact (float32
    distances, ties by index) from a cell list sized for ``k`` (:func:`knn_grid`;
    :func:`.search_cpu.grid_knn`)."""
    from .search_cpu import grid_knn

    nq = qs.shape[0]
    out_i = np.empty((nq, k), np.int64)
    out_d2 = np.empty((nq, k), np.float32)
    if nq == 0:
        return out_i, out_d2
    P, order, cs, origin, inv_h, dims = knn_grid(pts, k)
    grid_knn(P, order, cs, origin, inv_h, dims, qs, int(k), out_i, out_d2)
    return out_i, out_d2


def knn_grid(pts: np.ndarray, k: int):
    """The cell list of ``pts`` for ``k``-NN (cached for the last ``pts``), its edge about the
    ``k``-th neighbour distance of three quarters of the points: a query then reads the 27 cells
    around its own (about 10 k points on a surface) and only the rest go a shell further. The
    distance is measured, exactly, on 1,024 points drawn with a fixed seed, searched in a first
    grid sized from the bounding box (one cell per 64 points of its volume, or per 16 points of its
    largest face where that is finer)."""
    from .search_cpu import grid_knn

    key = (pts.__array_interface__["data"][0], pts.shape, int(k))
    hit = _GRID_CACHE.get("k")
    if hit is not None and hit[0] == key and hit[2] is pts:
        return hit[1]
    from ..geom_cpu import finite_bounds

    n = max(pts.shape[0], 1)
    _, lo, hi = finite_bounds(pts)
    ext = np.maximum(hi - lo, 1e-9)
    ext = np.maximum(ext, ext.max() * 1e-3)
    # one cell per 64 points of the box's volume, or per 16 points of its largest face when
    # that is finer (scans are surfaces: a volume-sized cell would hold hundreds of points)
    e = np.sort(ext)
    h0 = min((float(np.prod(ext)) / n * 64) ** (1 / 3), (float(e[1] * e[2]) / n * 16) ** 0.5)
    g0 = cpu_grid(pts, h0, slot="k-grid")
    sample = pts if n <= 1024 else pts[np.random.default_rng(0).choice(n, 1024, replace=False)]
    si, sd = np.empty((sample.shape[0], k), np.int64), np.empty((sample.shape[0], k), np.float32)
    grid_knn(*g0, np.ascontiguousarray(sample), int(k), si, sd)
    h = float(np.sqrt(np.quantile(sd[:, k - 1].astype(np.float64), 0.75)))
    h = max(h, h0 * 1e-3)
    g = cpu_grid(pts, h, slot="k-grid")
    _GRID_CACHE["k"] = (key, g, pts)
    return g
