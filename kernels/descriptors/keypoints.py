"""Keypoint selection (PCL ``UniformSampling``, caller-given indices or coordinates, or all points)
and the voxel-grid filter that thins a cloud before it is described (PCL ``VoxelGrid``).

Uniform sampling (PCL 1.13 semantics): voxels of edge ``radius`` aligned to the origin
(``ijk = floor(p * (1/radius))`` in float32), and in each occupied voxel the point closest to
the voxel centre ``(ijk + 0.5) * radius`` (float32 squared distance; on a tie the earlier
point wins, as PCL's strict ``<``). The indices come back sorted ascending (PCL returns them
in voxel order).

Voxel grid (:func:`voxel_grid`, PCL 1.13 ``VoxelGrid`` semantics): the same voxels of edge
``leaf`` (``ijk = floor(p * (1/leaf))`` in float32), one point per occupied voxel, the centroid of
its points, in voxel order (``i`` fastest, then ``j``, then ``k``, as PCL's ``divb_mul``). The
centroid is summed in float64 in point order and rounded once to float32 (PCL sums in float32).
"""
from __future__ import annotations

import numpy as np

from .. import validation
from ..backend import resolve_device, to_device, xp_for
from ..coordinates import localize
from ..errors import InputError

__all__ = ["keypoints", "voxel_grid", "voxel_ranks"]


def keypoints(points, *, radius: float | None = None, indices=None, coords=None,
              device: str = "auto"):
    """Select keypoints and return their indices into ``points``.

    Parameters
    ----------
    points : (N, 3) array
        The cloud (finite coordinates; numpy or CuPy).
    radius : float, optional
        Uniform-sampling leaf size (PCL ``UniformSampling::setRadiusSearch``).
    indices : (K,) int array, optional
        Caller-given keypoint indices (validated and returned sorted, unique).
    coords : (K, 3) array, optional
        Caller-given keypoint coordinates: each is mapped to its nearest point of the cloud.
    device : {"auto", "cpu", "gpu"}

    Returns
    -------
    (K,) int64 indices, sorted ascending (numpy or CuPy, following the device). With none of
    ``radius`` / ``indices`` / ``coords``: every point.
    """
    given = [x is not None for x in (radius, indices, coords)]
    if sum(given) > 1:
        raise InputError("give at most one of radius=, indices=, coords=")
    dev = resolve_device(device, points)
    (points, coords), _ = localize(points, coords)  # float64 far from 0: computed about its box
    pts = validation.points(to_device(points, dev), "points", allow_empty=True)
    xp = xp_for(dev)
    n = pts.shape[0]
    if indices is not None:
        idx = to_device(indices, dev)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise InputError(f"indices must be a 1-D integer array, got shape {tuple(idx.shape)} "
                             f"dtype {idx.dtype}")
        idx = idx.astype(xp.int64)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise InputError(f"indices must lie in [0, {n}), got [{int(idx.min())}, {int(idx.max())}]")
        return xp.unique(idx)
    if coords is not None:
        from ..neighbors.search import knn

        c = validation.points(to_device(coords, dev), "coords", allow_empty=True)
        if c.shape[0] == 0:
            return xp.zeros(0, xp.int64)
        if n == 0:
            raise InputError("points is empty (0 points)")
        idx, _ = knn(pts, c, k=1, device=dev)
        return xp.unique(idx[:, 0].astype(xp.int64))
    if radius is None:
        return xp.arange(n, dtype=xp.int64)
    r = validation.positive(radius, "radius")
    if n == 0:
        return xp.zeros(0, xp.int64)
    return _uniform_sampling(pts, r, xp)




#: voxel indices are float32 products (as PCL's): exact integers below 2^24
_MAX_VOXEL_INDEX = float(1 << 24)


def _check_voxels(corners, r: float, inv) -> None:
    """Refuse a leaf ``r`` whose voxel indices (float32 products, as PCL's) would not be exact
    integers at these coordinates (``corners``: the box's two corners, float32) or whose voxel
    count overflows the int64 keys: a tiny radius gave a handful of keypoints and a cast warning."""
    far = float(np.abs(corners).max()) * float(inv)
    if not far < _MAX_VOXEL_INDEX:
        raise InputError(f"radius {r:g} is too small for coordinates up to {float(np.abs(corners).max()):g}: "
                         f"voxel indices reach {far:.3g}, float32 holds them exactly up to 2^24 (radius at least "
                         f"{float(np.abs(corners).max()) / _MAX_VOXEL_INDEX:.3g}, or float64 points, "
                         "which are computed about their own box)")
    n = np.prod([float(v) + 1.0 for v in np.floor(corners[1] * inv) - np.floor(corners[0] * inv)])
    if not n < 2.0 ** 62:
        raise InputError(f"radius {r:g} makes {n:.3g} voxels over this cloud's box: too many to key (at most 2^62)")


def _uniform_sampling(pts, r, xp):
    f32 = xp.float32
    inv = np.float32(np.float32(1.0) / np.float32(r))
    if xp is np:
        box = (pts.min(axis=0), pts.max(axis=0))
    else:  # one kernel and one read
        from ..neighbors.search_gpu import bounds

        box = bounds(pts)
    corners = np.stack([np.asarray(v, np.float32) for v in box])
    _check_voxels(corners, r, inv)
    ijk = xp.floor(pts * inv).astype(xp.int64)  # float32 product, as PCL
    # the corners' voxels (the float32 product and floor are monotone): no reductions of ijk
    c = np.floor(corners * inv).astype(np.int64)
    lo, dims = xp.asarray(c[0]), [int(v) for v in c[1] - c[0] + 1]
    rel = ijk - lo
    key = rel[:, 0] + dims[0] * (rel[:, 1] + dims[1] * rel[:, 2])
    centre = (ijk.astype(f32) + f32(0.5)) * f32(r)
    diff = pts - centre
    d2 = (diff[:, 0] * diff[:, 0] + diff[:, 1] * diff[:, 1]) + diff[:, 2] * diff[:, 2]
    # stable sorts: by distance to the centre (ties keep the earlier point), then by voxel
    kw = {"kind": "stable"} if xp is np else {}
    o1 = xp.argsort(d2, **kw)
    order = o1[xp.argsort(key[o1], **kw)]
    n = pts.shape[0]
    ks = key[order]
    first = xp.ones(n, dtype=bool)
    first[1:] = ks[1:] != ks[:-1]
    return xp.sort(order[first]).astype(xp.int64)


def voxel_grid(points, leaf: float, *, device: str = "auto"):
    """Thin a cloud to one point per occupied voxel: its points' centroid (PCL ``VoxelGrid``).

    Parameters
    ----------
    points : (N, 3) array
        The cloud (finite coordinates; numpy or CuPy).
    leaf : float
        Voxel edge (positive).
    device : {"auto", "cpu", "gpu"}

    Returns
    -------
    (M, 3) float32 centroids in voxel order (numpy or CuPy, following the device), M the number
    of occupied voxels.
    """
    dev = resolve_device(device, points)
    pts = validation.points(to_device(points, dev), "points", allow_empty=True)
    v = validation.positive(leaf, "leaf")
    return thin(pts, v, dev)


def thin(pts, leaf: float, dev: str):
    """:func:`voxel_grid` of points already checked (finite (N, 3) on ``dev``)."""
    xp = xp_for(dev)
    if pts.shape[0] == 0:
        return xp.zeros((0, 3), xp.float32)
    inv = np.float32(np.float32(1.0) / np.float32(leaf))
    if dev == "gpu":
        return _voxel_grid_gpu(xp.ascontiguousarray(pts, xp.float32), inv)
    return _voxel_grid_cpu(np.ascontiguousarray(pts, np.float32), inv)


def _voxel_grid_cpu(P, inv):
    from ._voxel_cpu import centroids, voxel_bounds, voxel_sums

    lo, dims = voxel_bounds(P, inv)
    keys, sums, cnt = voxel_sums(P, inv, lo, dims)
    return centroids(np.argsort(keys), sums, cnt)


def _voxel_keys(pts, inv, lo, dims, xp):
    rel = xp.floor(pts * inv).astype(xp.int64) - xp.asarray(lo)
    return rel[:, 0] + int(dims[0]) * (rel[:, 1] + int(dims[1]) * rel[:, 2])


def _voxel_grid_gpu(pts, inv):
    import cupy as cp

    from ..neighbors.search_gpu import bounds

    c = np.floor(np.stack([v.astype(np.float32) for v in bounds(pts)]) * inv).astype(np.int64)
    key = _voxel_keys(pts, inv, c[0], c[1] - c[0] + 1, cp)
    order = cp.argsort(key)
    ks = key[order]
    first = cp.ones(ks.shape[0], dtype=bool)
    first[1:] = ks[1:] != ks[:-1]
    seg = cp.cumsum(first) - 1  # the voxel rank of each sorted point
    m = int(seg[-1]) + 1
    sums = cp.zeros((m, 3), cp.float64)
    cp.add.at(sums, seg, pts[order].astype(cp.float64))
    cnt = cp.bincount(seg, minlength=m)
    return (sums / cnt[:, None]).astype(cp.float32)


def voxel_ranks(points, cell: float) -> np.ndarray:
    """Dense rank (int64) of each point's voxel, on the CPU: voxels of edge ``cell`` from the
    cloud's min corner (``floor((p - min) * (1/cell))`` in float32), ranked by key (``i + dims0 (j
    + dims1 k)``) among the occupied ones, as ``np.unique``'s inverse gives them and as
    recognition's GPU verification computes them; through a hash of the occupied voxels (one pass;
    only their keys are sorted). ``points``: finite float32 (N, 3) numpy."""
    from ..geom_cpu import finite_bounds
    from ._voxel_cpu import voxel_rank_of_rows

    P = np.ascontiguousarray(points, np.float32)
    if len(P) == 0:
        return np.zeros(0, np.int64)
    _, lo, hi = finite_bounds(P)
    lo = lo.astype(np.float32)
    inv = np.float32(1.0 / cell)
    dims = np.floor((hi.astype(np.float32) - lo) * inv).astype(np.int64) + 1
    return voxel_rank_of_rows(P, lo, inv, dims)
