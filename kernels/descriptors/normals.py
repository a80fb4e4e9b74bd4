"""Surface normals by PCA of each point's neighbourhood (PCL ``NormalEstimation`` conventions).

For every query point the neighbourhood is its ``k`` nearest surface points or every surface
point within ``radius`` (the point itself included, as in PCL). The normal is the eigenvector
of the smallest eigenvalue of the neighbourhood's covariance about its centroid, flipped to
face ``viewpoint`` (PCL's ``flipNormalTowardsViewpoint``: flip when ``(vp - p) . n < 0``);
curvature is ``l0 / (l0 + l1 + l2)`` (PCL's surface variation). Fewer than 3 neighbours give a
NaN normal and curvature; collinear or coincident neighbourhoods (middle eigenvalue <= 1e-12 x
trace) a NaN normal, as PCL's ``eigen33`` does. k-NN neighbourhoods break distance ties by index (FLANN's choice among tied points is
arbitrary, so on grid-like Kinect scans ~1% of k-NN normals differ from PCL's).

The centroid and covariance are accumulated in float64 (two passes) and the 3x3 problem is
solved by the same float64 Jacobi solver on both backends; PCL accumulates in float32, so
results agree with PCL to ~1e-5, and CPU and GPU agree to float32 rounding.
"""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange
from .. import validation
from ..backend import resolve_device, to_device, to_numpy
from ..coordinates import localize
from ..errors import InputError
from ..geom_cpu import centroid3, cov_eig3

__all__ = ["normals"]


def normals(points, *, k: int | None = None, radius: float | None = None,
            viewpoint=(0.0, 0.0, 0.0), surface=None, device: str = "auto"):
    """Estimate normals and curvature.

    Parameters
    ----------
    points : (N, 3) array
        Points at which normals are wanted (numpy or CuPy, finite).
    k : int, optional
        Use the ``k`` nearest surface points (exactly one of ``k`` / ``radius``).
    radius : float, optional
        Use every surface point closer than ``radius`` (PCL/FLANN rule: d^2 < r^2 in float32).
    viewpoint : 3 floats
        Normals are flipped to face this point (PCL default: the origin).
    surface : (M, 3) array, optional
        Search surface (PCL's ``setSearchSurface``); ``points`` when omitted.
    device : {"auto", "cpu", "gpu"}

    Returns
    -------
    normals : (N, 3) float32
    curvature : (N,) float32
        NaN rows where the neighbourhood has fewer than 3 points.
    """
    if (k is None) == (radius is None):
        raise InputError("give exactly one of k= or radius= for the normal neighbourhood")
    dev = resolve_device(device, points, *([] if surface is None else [surface]))
    (points, surface), shift = localize(points, surface)  # float64 far from 0: computed about its box
    pts = validation.points(to_device(points, dev), "points", allow_empty=True)
    surf = pts if surface is None else validation.points(to_device(surface, dev), "surface")
    if surf.shape[0] == 0:
        raise InputError("points is empty (0 points)")
    try:
        vp = np.asarray(to_numpy(viewpoint), dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        vp = np.zeros(0)
    if vp.shape != (3,) or not np.isfinite(vp).all():
        raise InputError(f"viewpoint must be 3 finite numbers, got {viewpoint!r}")
    if shift is not None:
        vp = vp - shift
    if k is not None:
        k = validation.integer(k, "k", minimum=3)  # a plane needs 3 points: fewer give only NaN normals
        if k > surf.shape[0]:
            raise InputError(f"k={k} is larger than the number of surface points ({surf.shape[0]})")
    else:
        radius = validation.positive(radius, "radius")
    if dev == "gpu":
        from . import shot_gpu

        return shot_gpu.normals_gpu(pts, surf, k=k, radius=radius, viewpoint=vp)
    return _normals_cpu(pts, surf, k=k, radius=radius, viewpoint=vp)


def _normals_cpu(pts, surf, *, k, radius, viewpoint, chunk: int = 1 << 18):
    from ..neighbors.search import knn_cpu, radius_search_cpu

    n = pts.shape[0]
    out_n = np.empty((n, 3), np.float32)
    out_c = np.empty(n, np.float32)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        q = pts[s:e]
        if k is not None:
            idx, _ = knn_cpu(surf, q, k)
            off = np.arange(0, (e - s + 1) * k, k, dtype=np.int64)
            flat = idx.reshape(-1)
        else:
            off, flat, _ = radius_search_cpu(surf, q, radius, sort=False)
        _pca_normals(surf, q, off, flat, viewpoint, out_n[s:e], out_c[s:e])
    return out_n, out_c


@njit(cache=True, parallel=True)
def _pca_normals(surf, q, off, flat, vp, out_n, out_c):
    nq = q.shape[0]
    for i in prange(nq):
        s = off[i]
        e = off[i + 1]
        cnt = e - s
        if cnt < 3:
            out_n[i, 0] = np.nan
            out_n[i, 1] = np.nan
            out_n[i, 2] = np.nan
            out_c[i] = np.nan
            continue
        X = np.empty((cnt, 3), np.float64)
        for j in range(cnt):
            p = flat[s + j]
            X[j, 0] = surf[p, 0]
            X[j, 1] = surf[p, 1]
            X[j, 2] = surf[p, 2]
        cx, cy, cz = centroid3(X, cnt)
        C = np.empty((3, 3), np.float64)
        w = np.empty(3, np.float64)
        V = np.empty((3, 3), np.float64)
        ok = cov_eig3(X, cnt, cx, cy, cz, None, C, w, V)
        if not ok:
            out_n[i, 0] = np.nan
            out_n[i, 1] = np.nan
            out_n[i, 2] = np.nan
            out_c[i] = np.nan
            continue
        nx = V[0, 0]
        ny = V[1, 0]
        nz = V[2, 0]
        tr = C[0, 0] + C[1, 1] + C[2, 2]
        curv = abs(w[0] / tr) if tr != 0.0 else 0.0
        if w[1] <= 1e-12 * tr:
            # collinear or coincident points: the normal is undefined; PCL's eigen33 gives NaN
            out_n[i, 0] = np.nan
            out_n[i, 1] = np.nan
            out_n[i, 2] = np.nan
            out_c[i] = curv
            continue
        vx = vp[0] - np.float64(q[i, 0])
        vy = vp[1] - np.float64(q[i, 1])
        vz = vp[2] - np.float64(q[i, 2])
        if vx * nx + vy * ny + vz * nz < 0.0:
            nx = -nx
            ny = -ny
            nz = -nz
        out_n[i, 0] = nx
        out_n[i, 1] = ny
        out_n[i, 2] = nz
        out_c[i] = curv
