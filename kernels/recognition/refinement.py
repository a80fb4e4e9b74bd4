"""Refinement of the promising hypotheses between the two verification passes of ``recognize``.

Pass 1 of verification scores every hypothesis (no claims); :func:`refine_hypotheses` keeps the
promising ones (inlier fraction ``>= min_fraction``, at most ``max_refine``, best first) and
refines their poses against the scene, all candidates in lockstep: point-to-plane ICP
(:func:`~scanforest.kernels.recognition.icp.icp_point_to_plane_batch`, one batched iteration on
the GPU) or parametric chamfer alignment (:func:`scanforest.kernels.align.pcha.align_batch`:
Levenberg-Marquardt on a distance transform of the scene around the candidates, Huber loss at
``inlier_dist``). Pass 2 then runs the greedy acceptance on the refined poses.

:func:`polish_poses` is the last step of a recognition on a thinned scene (``scene_voxel``): each
accepted pose, found on voxel centroids, is fitted by point-to-point ICP to the scene's own points
around it (the model's verification points, its own points ``verify_leaf`` apart, paired with
their nearest scene point within ``inlier_dist``; least-squares rigid fits (SVD, Umeyama) until
the step is below 1e-9 m and rad): on the host one pose at a time (:mod:`._polish_cpu`), on the
device every pose in lockstep (:mod:`._polish_gpu`).
"""
from __future__ import annotations

import numpy as np

from ..backend import array_module, to_numpy, xp_for
from ._groups import take_groups
from .grouping import Hypotheses
from .icp import icp_point_to_plane_batch

__all__ = ["polish_poses", "refine_hypotheses"]


def polish_poses(poses, model_ids, library, scene, *, dist: float, iterations: int = 30, viewpoint=None,
                 voxel: float | None = None, stages: int = 1):
    """Point-to-point ICP of each pose's model (its verification points) against ``scene`` (the
    full-resolution points, numpy or CuPy): a list of float64 4x4 poses. Only the scene points
    within ``2 dist`` of the model's bounding sphere at the start are searched; with
    ``viewpoint``, only the model points whose normal faces it at the start are fitted (as
    verification counts them: the far side of a full model would pair with the near side's edges);
    with ``voxel``, those scene points averaged into voxels of that edge first. With ``stages``
    > 1 the fit goes on, coarse to fine, with pairs within ``dist / 2``, ``dist / 4``, ... (each
    stage to its stop, at most ``iterations``). A pose with fewer than 3 pairs is returned as
    given (a later stage with fewer than 3 pairs keeps the pose of the stage before). A CuPy scene's poses are fitted together on the device
    (:mod:`._polish_gpu`: one cut of every crop, two launches an iteration), a numpy scene's one by
    one on the host."""
    from ..validation import integer

    stages = integer(stages, "stages")
    xp = array_module(scene)  # where the crops are cut: the scene's own device
    vo = library.verify_offsets
    out = [np.array(T, np.float64) for T in poses]
    todo = []  # (index, model points, centre, reach) of the poses with points to fit
    for i, (T, mid) in enumerate(zip(out, model_ids)):
        V = np.asarray(library.verify_points[vo[mid]:vo[mid + 1]], np.float64)
        W = V @ T[:3, :3].T + T[:3, 3]
        if viewpoint is not None:
            N = np.asarray(library.verify_normals[vo[mid]:vo[mid + 1]], np.float64) @ T[:3, :3].T
            seen = np.einsum("ij,ij->i", N, np.asarray(viewpoint, np.float64) - W) > 0
            V, W = V[seen], W[seen]
        if len(V) < 3:
            continue
        c = W.mean(axis=0)
        todo.append((i, np.ascontiguousarray(V), c, float(np.sqrt(((W - c) ** 2).sum(axis=1).max())) + 2.0 * dist))
    if not todo:
        return out
    if xp is not np:  # every pose at once on the device (._polish_gpu)
        from ._polish_gpu import crops, polish_batch

        centres = np.stack([t[2] for t in todo])
        reach = [t[3] for t in todo]
        fitted = polish_batch([t[1] for t in todo], np.stack([out[t[0]] for t in todo]), centres, reach,
                              crops(scene, centres, reach, voxel), dist, iterations, stages)
        for (i, *_), T in zip(todo, fitted):
            out[i] = T
        return out
    from ..neighbors.search import cpu_grid
    from ._polish_cpu import polish_fit

    for i, V, c, reach in todo:  # on the host: one crop and one fit a pose
        crop = _ball(scene, c, reach)
        if voxel is not None and len(crop):
            from ..descriptors.keypoints import thin

            crop = thin(crop, float(voxel), "cpu")
        if len(crop) < 3:
            continue
        P, order, cs, origin, inv_h, dims = cpu_grid(np.ascontiguousarray(crop, np.float32), dist, slot="polish")
        host = crop.astype(np.float64)
        for k in range(int(stages)):  # the cells hold every pair within dist, and so within dist / 2^k
            d = dist / 2.0 ** k
            out[i] = polish_fit(V, out[i], P, order, cs, origin, inv_h, dims, host, np.float32(d * d),
                                int(iterations))
    return out


def _ball(scene, c, r: float):
    """The points of a numpy scene within ``r`` of ``c`` (float32 distances)."""
    from ..geom_cpu import ball_indices

    return scene[ball_indices(scene, c.astype(np.float32), np.float32(r * r))]


def refine_hypotheses(hyps: Hypotheses, first_scores, library, sidx, *, method: str = "icp",
                      min_fraction: float = 0.3, max_refine: int = 32, inlier_dist: float,
                      iterations: int = 30):
    """Refine the promising hypotheses and keep only them.

    Parameters
    ----------
    hyps : Hypotheses
    first_scores : (H,) array
        Inlier fraction of every hypothesis before any claim (verification pass 1).
    library : ModelLibrary
    sidx : _SceneIndex
        The scene (cell ``inlier_dist``, with normals for ICP).
    method : {"icp", "pcha"}
    min_fraction, max_refine :
        The candidates: ``first_scores >= min_fraction``, at most ``max_refine`` (best first).
    inlier_dist : float
        ICP correspondence distance / PChA Huber threshold.
    iterations : int

    Returns
    -------
    (work, back, rmse): the candidates as :class:`Hypotheses` with refined poses (in hypothesis
    order), their indices into ``hyps``, and the (H,) refinement RMSE (NaN where not refined).
    """
    cand = np.flatnonzero(first_scores >= min_fraction)
    if len(cand) > max_refine:
        cand = cand[np.argpartition(-first_scores[cand], max_refine - 1)[:max_refine]]
    poses = hyps.poses.copy()
    rmse = np.full(len(hyps), np.nan)
    if method == "pcha":
        _refine_pcha(library, hyps, cand, poses, rmse, sidx, inlier_dist, iterations, sidx.device)
    else:
        _refine_icp(library, hyps, cand, poses, rmse, sidx, inlier_dist, iterations)
    keep = np.zeros(len(hyps), bool)
    keep[cand] = True
    work = Hypotheses(hyps.model_id[keep], poses[keep], hyps.n_corr[keep], take_groups(hyps.groups, keep))
    return work, np.flatnonzero(keep), rmse


def _refine_icp(library, hyps, cand, poses, rmse, sidx, inlier_dist, iterations):
    """Refine ``poses[cand]`` in place by point-to-plane ICP, all candidates in lockstep (one
    batched iteration on the GPU)."""
    if not len(cand):
        return
    vo = library.verify_offsets
    mids = [int(hyps.model_id[hi]) for hi in cand]
    results = icp_point_to_plane_batch(
        [library.verify_points[vo[m]:vo[m + 1]] for m in mids], sidx,
        inits=[poses[hi] for hi in cand],
        source_normals=[library.verify_normals[vo[m]:vo[m + 1]] for m in mids],
        max_correspondence_distance=inlier_dist, max_iterations=iterations)
    for hi, res in zip(cand, results):
        poses[hi], rmse[hi] = res.pose, res.rmse


def _refine_pcha(library, hyps, cand, poses, rmse, sidx, inlier_dist, iterations, dev):
    """Refine ``poses[cand]`` in place by parametric chamfer alignment (rigid, Huber)."""
    from ..align.edt import distance_transform
    from ..align.pcha import PChAParams, align_batch

    if not len(cand):
        return
    xp = xp_for(dev)
    vo = library.verify_offsets
    Ps, Ws = [], []
    for h in cand:
        mid = int(hyps.model_id[h])
        P = np.asarray(library.verify_points[vo[mid]:vo[mid + 1]], np.float64)
        Ps.append(P)
        Ws.append((P @ poses[h][:3, :3].T + poses[h][:3, 3]).astype(np.float32))
    idx, _ = sidx.nearest(xp.asarray(np.concatenate(Ws)), inlier_dist)  # one search for all candidates
    near_all = np.split(to_numpy(idx) >= 0, np.cumsum([len(W) for W in Ws])[:-1])
    obs, keep_c = [], []
    lo, hi_ = np.full(3, np.inf), np.full(3, -np.inf)
    for h, P, W, near in zip(cand, Ps, Ws, near_all):
        if near.sum() < 6:  # nothing of the model overlaps the scene here: leave the pose as it is
            continue
        obs.append(P[near].astype(np.float32))
        keep_c.append(h)
        lo, hi_ = np.minimum(lo, W[near].min(0)), np.maximum(hi_, W[near].max(0))
    if not obs:
        return
    # the distance transform covers the scene around the candidates only, cells ~ inlier_dist / 2
    margin = 4.0 * inlier_dist
    S = to_numpy(sidx.points)
    box = np.all((S >= lo - margin) & (S <= hi_ + margin), axis=1)
    ext = float(np.max(hi_ - lo + 2 * margin))
    res = int(np.clip(np.ceil(1.5 * ext / (0.5 * inlier_dist)), 32, 256 if dev == "gpu" else 160))
    grid = distance_transform(S[box], resolution=res, device=dev)  # the EDT reads its reference on the host
    params = PChAParams(loss="huber", huber_delta=float(inlier_dist), max_iter=int(iterations))
    out = align_batch([xp.asarray(o) for o in obs], None, "rigid", params=params, init=[poses[h] for h in keep_c],
                      grid=grid, device=dev)
    for h, r in zip(keep_c, out):
        if np.all(np.isfinite(r.transform)):
            poses[h], rmse[h] = np.asarray(r.transform, np.float64), r.rmse
