"""SHOT352 descriptors and their local reference frames, as PCL 1.13's ``SHOTEstimation``.

Definition (PCL ``shot_lrf.hpp`` + ``shot.hpp``; see ``shared/reference/seed-gshot.md``):

* Support: every surface point with float32 squared distance < float32(R**2) from the
  keypoint (PCL/FLANN radius search), sorted by distance.
* Frame: float64 covariance of the differences ``p_i - p`` (float32 differences) weighted
  by ``R - d_i``, skipping points that coincide with the keypoint; x = eigenvector of the
  largest eigenvalue, z = of the smallest; each is flipped to agree with the majority of the
  differences (``dot >= 0`` counts as plus), a tie being settled by the 5 neighbours around
  the median of the distance-sorted list (flip unless >= 3 have ``dot > 0``); y = z x x in
  float32. Fewer than 5 non-coincident neighbours: NaN frame and descriptor.
* Histogram: 32 volumes (8 azimuth x 2 elevation x 2 radial) x 11 slots of the cosine between
  the neighbour's normal and the frame's z (10 bins + PCL's rounding slot), filled with PCL's
  interpolation (cosine, radial, elevation and azimuth spills, the sum of four linear terms),
  float32 accumulation, L2 normalisation. Neighbours with NaN normals are skipped.

Output: descriptors (K, 352) float32 and frames (K, 3, 3) float32 whose rows are the x, y, z
axes; both NaN where PCL gives NaN. The approximate mode of the G-SHOT paper
(``approximate=True``) caps every neighbour list at its ``max_neighbors`` nearest points
(default: the median neighbour count of the keypoints), for the frame and the histogram alike.
"""
from __future__ import annotations

import numpy as np

from .. import validation
from ..backend import resolve_device, to_device, xp_for
from ..coordinates import localize
from ..errors import InputError
from ._shot_common import median_count

__all__ = ["shot", "DESCRIPTOR_LENGTH"]

DESCRIPTOR_LENGTH = 352


def shot(points, normals, keypoints, radius, *, surface=None, surface_normals=None,
         approximate: bool = False, max_neighbors: int | None = None, device: str = "auto",
         _chunk: int | None = None, _unit_normals: bool = False):
    """SHOT352 descriptors and local reference frames at keypoints.

    Parameters
    ----------
    points : (N, 3) array
        The input cloud (finite coordinates; numpy or CuPy).
    normals : (N, 3) array or None
        Unit normals of ``points`` (NaN rows allowed: such neighbours are skipped; rows of
        another length are an InputError). Used as the surface normals when ``surface`` is
        omitted.
    keypoints : (K,) int array or (K, 3) float array
        Indices into ``points`` or keypoint coordinates.
    radius : float
        Support radius (used for the frame and the descriptor, as PCL by default).
    surface : (M, 3) array, optional
        Search surface (PCL's ``setSearchSurface``); ``points`` when omitted.
    surface_normals : (M, 3) array, optional
        Normals of ``surface``; required when ``surface`` is given.
    approximate : bool
        G-SHOT's approximate mode: cap each neighbour list at its nearest ``max_neighbors``.
    max_neighbors : int, optional
        The cap (approximate mode only); default the median neighbour count.
    device : {"auto", "cpu", "gpu"}

    Returns
    -------
    descriptors : (K, 352) float32
    frames : (K, 3, 3) float32
        Rows are the x, y, z axes of each keypoint's local reference frame.
    """
    r = validation.positive(radius, "radius")
    arrays = [a for a in (points, normals, keypoints, surface, surface_normals) if a is not None]
    dev = resolve_device(device, *arrays)
    if not hasattr(keypoints, "ndim"):  # a list: indices, or coordinates
        keypoints = np.asarray(keypoints)
        if keypoints.size == 0:
            keypoints = keypoints.astype(np.int64).reshape(0)  # no keypoints, not "float indices"
    kp_xyz = keypoints.ndim == 2  # coordinates (shifted with the cloud), not indices
    (points, surface, kp_shifted), _ = localize(points, surface, keypoints if kp_xyz else None)
    keypoints = kp_shifted if kp_xyz else keypoints  # float64 far from 0: computed about its box
    pts = validation.points(to_device(points, dev), "points")
    xp = xp_for(dev)
    if surface is None:
        if normals is None:
            raise InputError("normals are required (the normals of points)")
        surf = pts
        snrm = validation.points(to_device(normals, dev), "normals", finite=False, allow_empty=True,
                                 rows=pts.shape[0])  # NaN normals allowed: such neighbours are skipped
    else:
        surf = validation.points(to_device(surface, dev), "surface")
        if surface_normals is None:
            raise InputError("surface_normals are required when surface is given")
        snrm = validation.points(to_device(surface_normals, dev), "surface_normals", finite=False,
                                 allow_empty=True, rows=surf.shape[0])
    if not _unit_normals:  # (recognition's own normals are unit already: not read again)
        validation.unit_normals(snrm, "normals" if surface is None else "surface_normals")
    kp = _keypoint_coords(to_device(keypoints, dev), pts, xp)
    if max_neighbors is not None and not approximate:
        raise InputError("max_neighbors only applies with approximate=True")
    if max_neighbors is not None and int(max_neighbors) < 1:
        raise InputError(f"max_neighbors must be >= 1, got {max_neighbors}")
    cap = None if max_neighbors is None else int(max_neighbors)
    if dev == "gpu":
        from . import shot_gpu

        return shot_gpu.shot_gpu(kp, surf, snrm, r, approximate=approximate, cap=cap)
    return _shot_cpu_driver(kp, surf, snrm, r, approximate=approximate, cap=cap,
                            chunk=_chunk or (1 << 15))




def _keypoint_coords(k, pts, xp):
    if k.ndim == 1:
        if k.dtype.kind not in "iu":
            raise InputError(f"keypoint indices must be integers, got dtype {k.dtype}")
        if k.size and (int(k.min()) < 0 or int(k.max()) >= pts.shape[0]):
            raise InputError(f"keypoint indices must lie in [0, {pts.shape[0]}), got range "
                             f"[{int(k.min())}, {int(k.max())}]")
        return xp.ascontiguousarray(pts[k.astype(xp.int64)])
    return validation.points(k, "keypoints", allow_empty=True)


def _shot_cpu_driver(kp, surf, snrm, r, *, approximate, cap, chunk):
    from ..neighbors.search import radius_search_cpu
    from ._shot_cpu import shot_csr

    k = kp.shape[0]
    desc = np.empty((k, DESCRIPTOR_LENGTH), np.float32)
    frames = np.empty((k, 3, 3), np.float32)
    if k == 0:
        return desc, frames
    if approximate and cap is None:
        from ..neighbors.search import cpu_grid
        from ..neighbors.search_cpu import grid_radius

        g = cpu_grid(surf, r)
        counts = np.diff(grid_radius(g[0], g[1], g[2], g[3], g[4], g[5], kp, np.float32(r * r),
                                     -1, False)[0])
        cap = median_count(counts)
    for s in range(0, k, chunk):
        e = min(k, s + chunk)
        # exact mode needs no sorted lists (the frame's tie-break ranks on demand)
        off, idx, d2 = radius_search_cpu(surf, kp[s:e], r, max_neighbors=cap if approximate else None,
                                         sort=False)
        shot_csr(kp[s:e], surf, snrm, off, idx, d2, float(r), desc[s:e], frames[s:e])
    return desc, frames
