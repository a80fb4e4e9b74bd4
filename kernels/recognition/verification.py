"""Hypothesis verification: every pose hypothesis of a scene scored in one pass, accepted greedily.

Each hypothesis' model verification points are transformed into the scene, the ones whose normal
faces the viewpoint are "visible", and a visible point is an inlier when the nearest scene point
lies within ``inlier_dist`` (cell-list lookup: CUDA in :mod:`._verification_gpu`, numba on the
CPU) and the scene voxel (edge ``inlier_dist``) of that scene point is not yet claimed. The score
is the inlier fraction. Acceptance is greedy without sorting: take the argmax among the hypotheses
above ``min_inlier_fraction``, claim the scene voxels it explains (occupancy), rescore the rest (a
hypothesis that overlaps an accepted one loses the inliers it shares with it) and repeat.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backend import resolve_device, xp_for
from ..errors import InputError
from ..hypotheses import masked_argmax
from ..validation import points
from ._scene_index import _SceneIndex
from .grouping import Hypotheses
from .library import ModelLibrary

__all__ = ["VerifyResult", "verify"]


@dataclass
class VerifyResult:
    accepted: np.ndarray       # (A,) hypothesis indices in acceptance order
    scores: np.ndarray         # (A,) inlier fraction at acceptance
    inliers: np.ndarray        # (A,) inlier counts at acceptance
    visible: np.ndarray        # (A,) visible verification points
    first_scores: np.ndarray   # (H,) inlier fraction of every hypothesis before any claim

    @classmethod
    def empty(cls) -> "VerifyResult":
        """No hypotheses: nothing accepted, nothing scored."""
        z = np.zeros(0)
        return cls(np.zeros(0, np.int64), z, np.zeros(0, np.int64), np.zeros(0, np.int64), z)


def _verify_nearest_cpu(idx, library, hyp, src, poses, r: float, vp):
    """CPU twin of ``_verification_gpu.verify_nearest``: one parallel numba pass, float32 like
    the GPU kernel, nearest scene point from the cell list (no per-point pose gather)."""
    from ..neighbors.search_cpu import verify_points

    P, order, cs, origin, inv_h, dims = idx.cells()
    T = np.ascontiguousarray(np.asarray(poses, np.float64)[:, :3, :4].reshape(-1, 12), np.float32)
    vp = np.asarray(vp, np.float32)
    return verify_points(np.ascontiguousarray(hyp, np.int64), np.ascontiguousarray(src, np.int64), T,
                         np.ascontiguousarray(library.verify_points, np.float32),
                         np.ascontiguousarray(library.verify_normals, np.float32),
                         vp[0], vp[1], vp[2], P, cs, origin, inv_h, dims, np.float32(r * r), order,
                         np.ascontiguousarray(idx.vox, np.int64))


def _hyp_points(library, model_id, poses, xp):
    """Flattened verification points of every hypothesis: (hyp index, library row, sizes),
    built with ``xp`` (on the GPU the millions of entries never touch the host)."""
    vo = library.verify_offsets
    sizes = (vo[model_id + 1] - vo[model_id]).astype(np.int64)
    if xp is np:
        hyp = np.repeat(np.arange(len(model_id)), sizes)
        starts = np.repeat(vo[model_id] - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        src = starts + np.arange(sizes.sum())
        return hyp, src, sizes
    ends = np.cumsum(sizes)
    k = xp.arange(int(ends[-1]) if len(ends) else 0, dtype=xp.int64)
    hyp = xp.searchsorted(xp.asarray(ends), k, side="right")
    shift = xp.asarray(vo[model_id] - (ends - sizes))
    return hyp, k + shift[hyp], sizes


def verify(hypotheses: Hypotheses, library: ModelLibrary, scene, *, inlier_dist: float,
           min_inlier_fraction: float = 0.5, min_inliers: int = 10, viewpoint=(0.0, 0.0, 0.0),
           max_detections: int | None = None, device: str = "auto") -> VerifyResult:
    """Score all hypotheses at once and accept them greedily by argmax (no sort).

    Parameters
    ----------
    hypotheses : Hypotheses
    library : ModelLibrary
    scene : (N, 3) array or a prepared scene index
        The full scene cloud.
    inlier_dist : float
        A visible model point is an inlier when the nearest scene point is closer than this.
    min_inlier_fraction : float
        Acceptance threshold on ``inliers / visible``.
    min_inliers : int
        Acceptance also needs this many inliers.
    viewpoint : 3 floats
        Camera centre: a model point is visible when its transformed normal faces it.
    max_detections : int, optional
        Stop after this many acceptances.
    device : {"auto", "cpu", "gpu"}

    Notes
    -----
    Round ``r`` scores every remaining hypothesis in parallel; the inliers of a point are
    withdrawn when the scene voxel (edge ``inlier_dist``) of its nearest scene point is already
    claimed by an accepted hypothesis (occupancy conflict). The best remaining hypothesis above
    the thresholds (argmax of the fraction; ties go to the lower index) is accepted and claims
    its inlier voxels. The loop ends when no hypothesis qualifies.
    """
    if not (float(inlier_dist) > 0):
        raise InputError(f"inlier_dist must be > 0, got {inlier_dist!r}")
    if isinstance(scene, _SceneIndex):
        dev, idx = scene.device, scene
    else:
        dev = resolve_device(device, scene)
        idx = _SceneIndex(points(scene, "scene", finite=False, dtype=None), None, inlier_dist, dev)
    h = len(hypotheses)
    if h == 0:
        return VerifyResult.empty()
    xp = xp_for(dev)
    vp = np.asarray(viewpoint, np.float64).reshape(3)
    mid = np.asarray(hypotheses.model_id, np.int64)
    hyp, src, sizes = _hyp_points(library, mid, hypotheses.poses, xp)
    limit = h if max_detections is None else int(max_detections)
    if dev == "gpu":  # every round of _accept_rounds in one launch, on the device
        from . import _verification_gpu as g

        vox = g.verify_nearest(idx, library, hyp, src, hypotheses.poses, inlier_dist, vp)
        return VerifyResult(*g.accept_greedy(vox, [sizes], [idx.n_vox], min_fraction=float(min_inlier_fraction),
                                             min_inliers=math.ceil(float(min_inliers)), limit=limit)[0])
    vox = _verify_nearest_cpu(idx, library, hyp, src, hypotheses.poses, inlier_dist, vp)
    return _accept_rounds(vox, hyp, h, idx.n_vox, min_inlier_fraction, min_inliers, limit)


def _accept_rounds(vox, hyp, h: int, n_vox: int, min_inlier_fraction: float, min_inliers: float,
                   limit: int) -> VerifyResult:
    """The acceptance rounds on the host (the device runs them in one launch,
    ``_verification_gpu.accept_greedy``): ``vox`` per (hypothesis, point) as ``verify_nearest``
    gives it, ``hyp`` the hypothesis of each entry."""
    if h == 0:
        return VerifyResult.empty()
    # per point: -2 invisible, -1 visible but no scene point, >= 0 voxel rank of the nearest
    vis_count = np.bincount(hyp, weights=(vox >= -1).astype(np.float64), minlength=h)
    claimed = np.zeros(max(n_vox, 1), dtype=bool)
    active = np.ones(h, dtype=bool)
    acc, scores, inls, viss = [], [], [], []
    first = None
    while True:
        inl = (vox >= 0)
        inl &= ~claimed[np.maximum(vox, 0)]
        cnt = np.bincount(hyp, weights=inl.astype(np.float64), minlength=h)
        frac = cnt / np.maximum(vis_count, 1.0)
        if first is None:
            first = frac
        if len(acc) >= limit:
            break
        ok = active & (frac >= min_inlier_fraction) & (cnt >= min_inliers)
        best, _ = masked_argmax(frac, ok)  # shared with flow.hypothesis_flow (hypotheses.py)
        if best < 0:
            break
        acc.append(best)
        scores.append(float(frac[best]))
        inls.append(int(cnt[best]))
        viss.append(int(vis_count[best]))
        active[best] = False
        mine = (hyp == best) & inl
        claimed[vox[mine]] = True
    return VerifyResult(np.asarray(acc, np.int64), np.asarray(scores), np.asarray(inls, np.int64),
                        np.asarray(viss, np.int64), first if first is not None else np.zeros(h))
