"""Correspondence grouping: pose hypotheses from the correspondences of each model.

:func:`group_hough` is PCL's ``Hough3DGrouping``: every correspondence casts the model
keypoint-to-centroid vector, expressed in the keypoint's local reference frame, into the scene
through the scene keypoint's frame; a sparse 3-D accumulator with PCL's bin layout, trilinear
interpolation and threshold; local maxima over the 6 face neighbours (:func:`hough_maxima`).
:func:`group_gc` is PCL's ``GeometricConsistencyGrouping``: greedy consensus sets in order of
descriptor distance, ``| |m_i - m_j| - |s_i - s_j| | <= gc_size`` against every member, kept when
the set has more than ``gc_thresh`` members (numba sweeps, :func:`_gc_sets`). Each group is
cleaned by RANSAC (PCL ``CorrespondenceRejectorSampleConsensus``: 3-point samples, inlier
threshold = bin size / ``gc_size``, up to 10,000 iterations) and its pose is the SVD/Umeyama fit
(PCL ``TransformationEstimationSVD``) on the RANSAC inliers (:mod:`.rigid`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..jit import njit, prange
from ..backend import resolve_device, to_numpy
from ._groups import GroupList  # noqa: F401 - part of this module's API (Hypotheses.groups)
from .correspondences import Correspondences
from .library import ModelLibrary
from .rigid import ransac_rigid, ransac_rigid_groups, rigid_transform

__all__ = ["Hypotheses", "GroupList", "hough_maxima", "group_hough", "group_gc"]


@dataclass
class Hypotheses:
    """Pose hypotheses: ``poses`` (H, 4, 4) float64 map model coordinates into the scene."""

    model_id: np.ndarray                 # (H,) int32
    poses: np.ndarray                    # (H, 4, 4) float64
    n_corr: np.ndarray                   # (H,) int32: correspondences kept (RANSAC inliers)
    groups: Sequence = field(default_factory=list)  # per hypothesis: correspondence indices (a list
    # of arrays, or a GroupList)

    def __len__(self) -> int:
        return len(self.model_id)

    @classmethod
    def empty(cls) -> "Hypotheses":
        return cls(np.zeros(0, np.int32), np.zeros((0, 4, 4)), np.zeros(0, np.int32), [])

    @classmethod
    def concat(cls, hs) -> "Hypotheses":
        hs = [h for h in hs if len(h)]
        if not hs:
            return cls.empty()
        return cls(np.concatenate([h.model_id for h in hs]), np.concatenate([h.poses for h in hs]),
                   np.concatenate([h.n_corr for h in hs]), [g for h in hs for g in h.groups])


def hough_maxima(votes, *, bin_size: float, threshold: float, use_interpolation: bool = True,
                 weights=None):
    """PCL ``HoughSpace3D`` voting and ``findMaxima`` on a sparse accumulator.

    The accumulator spans ``[min(votes), max(votes)]`` with ``ceil(extent / bin)`` bins per
    axis (PCL's layout: a vote exactly on the upper bound falls outside and is dropped, as in
    PCL). With interpolation a vote spreads over the 8 bins around it with PCL's trilinear
    weights. A bin is a maximum when its value is ``>= threshold`` (a negative threshold in
    [-1, 0) is a fraction of the global maximum) and not smaller than any of its 6 face
    neighbours.

    Returns
    -------
    values : list of float, voters : list of int arrays (voter ids of each maximum, ascending)
    """
    V = np.asarray(votes, np.float64)
    n = len(V)
    if n == 0:
        return [], []
    w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    b = float(bin_size)
    dmin = V.min(axis=0)
    dmax = V.max(axis=0)
    counts = np.ceil((dmax - dmin) / b).astype(np.int64)
    if (counts <= 0).any():
        return [], []
    prod = np.array([1, counts[0], counts[0] * counts[1]], np.int64)
    rel = V - dmin
    c = np.floor(rel / b).astype(np.int64)
    ok = ((c >= 0) & (c < counts)).all(axis=1)
    if use_interpolation:
        centroid = ((2.0 * c * b + b) / 2.0).astype(np.float32)
        cw = (1.0 - np.abs(rel - centroid) / b).astype(np.float32)
        interp = np.where(rel < centroid, c - 1, np.where(rel > centroid, c + 1, c))
        offs = np.array([[(m // e) % 3 - 1 for e in (1, 3, 9)] for m in range(27)], np.int64)
        nb = c[:, None, :] + offs[None]                           # (n, 27, 3)
        valid = ((nb >= 0) & (nb < counts)).all(axis=2) & ok[:, None]
        is_i = nb == interp[:, None, :]
        is_c = nb == c[:, None, :]
        valid &= (is_i | is_c).all(axis=2)
        fw = np.where(is_i, (1.0 - cw)[:, None, :].astype(np.float32),
                      cw[:, None, :].astype(np.float32)).astype(np.float32)
        iw = fw[..., 0] * fw[..., 1] * fw[..., 2]                 # float32, as PCL's interp_weight
        keys = (nb * prod).sum(axis=2)
        vi, _ = np.nonzero(valid)
        bins = keys[valid]
        vals = w[vi] * iw[valid].astype(np.float64)
    else:
        vi = np.flatnonzero(ok)
        bins = (c[ok] * prod).sum(axis=1)
        vals = w[vi]
    if len(bins) == 0:
        return [], []
    ub, inv = np.unique(bins, return_inverse=True)
    acc = np.bincount(inv, weights=vals, minlength=len(ub))
    thr = float(threshold)
    if thr < 0:
        hmax = max(acc.max(), np.finfo(np.float64).tiny)
        thr = -thr * hmax if thr >= -1 else hmax
    cand = np.flatnonzero(acc >= thr)
    if len(cand) == 0:
        return [], []
    ck = ub[cand]
    coords = np.stack([ck % counts[0], (ck // counts[0]) % counts[1], ck // (counts[0] * counts[1])], 1)
    is_max = np.ones(len(cand), bool)
    for dim in range(3):
        for sgn in (-1, 1):
            inside = (coords[:, dim] > 0) if sgn < 0 else (coords[:, dim] < counts[dim] - 1)
            nk = ck + sgn * prod[dim]
            pos = np.searchsorted(ub, nk)
            pos_c = np.minimum(pos, len(ub) - 1)
            found = ub[pos_c] == nk
            nval = np.where(found, acc[pos_c], 0.0)
            is_max &= ~(inside & (acc[cand] < nval))
    values, voters = [], []
    order = np.argsort(inv, kind="stable")
    starts = np.searchsorted(inv[order], np.arange(len(ub) + 1))
    for ci in cand[is_max]:
        values.append(float(acc[ci]))
        voters.append(np.sort(vi[order[starts[ci]:starts[ci + 1]]]))
    return values, voters


def group_hough(corr: Correspondences, library: ModelLibrary, scene_kp_coords, scene_rf, *,
                bin_size: float = 0.01, threshold: float = 5.0, use_interpolation: bool = True,
                use_distance_weight: bool = False, ransac: bool = True,
                ransac_threshold: float | None = None, max_iterations: int = 10000,
                seed: int = 0) -> Hypotheses:
    """Hough 3-D voting with local reference frames (PCL ``Hough3DGrouping``), per model.

    Each correspondence votes ``s + F_s^T v_m`` where ``v_m = F_m (c_m - m)`` is the model
    keypoint's vector to the model centroid in its own frame (``F`` rows = axes). Maxima of the
    accumulator (see :func:`hough_maxima`) are groups; each group is cleaned by RANSAC
    (inlier threshold ``ransac_threshold``, default ``bin_size``) and fitted by SVD.
    Correspondences whose scene or model frame is undefined (NaN) do not vote.
    """
    skp = np.asarray(to_numpy(scene_kp_coords), np.float64)
    srf = np.asarray(to_numpy(scene_rf), np.float64)
    out = []
    thr = bin_size if ransac_threshold is None else ransac_threshold
    for mid in np.unique(corr.model_id):
        sel = np.flatnonzero(corr.model_id == mid)
        mrow = corr.ref_row[sel]
        F = srf[corr.scene_kp[sel]]
        v = library.votes[mrow].astype(np.float64)
        good = np.isfinite(F).all(axis=(1, 2)) & np.isfinite(v).all(axis=1)
        sel, mrow, F, v = sel[good], mrow[good], F[good], v[good]
        if len(sel) == 0:
            continue
        votes = np.einsum("nji,nj->ni", F, v) + skp[corr.scene_kp[sel]]
        wts = None
        if use_distance_weight:
            dd = corr.dist2[sel].astype(np.float64)
            mx = dd.max()
            wts = 1.0 - dd / mx if mx != 0 else None
        _, voters = hough_maxima(votes, bin_size=bin_size, threshold=threshold,
                                 use_interpolation=use_interpolation, weights=wts)
        for vs in voters:
            out.append((sel[vs], int(mid)))
    return _fit_groups(corr, library, skp, out, ransac, thr, max_iterations, seed)


def _fit_groups(corr, library, skp, groups, ransac, thr, max_iterations, seed, batched_max: int = 64):
    """Hypotheses of many ``(correspondence indices, model id)`` groups: RANSAC batched over
    all groups of at most ``batched_max`` pairs, :func:`ransac_rigid` for the larger ones."""
    small = [g for g in range(len(groups)) if 3 <= len(groups[g][0]) <= batched_max]
    res = {}
    if ransac and small:
        srcs = [library.kp_coords[corr.ref_row[groups[g][0]]].astype(np.float64) for g in small]
        dsts = [skp[corr.scene_kp[groups[g][0]]] for g in small]
        for g, (T, inl) in zip(small, ransac_rigid_groups(srcs, dsts, threshold=thr, max_iterations=max_iterations,
                                                          seed=seed)):
            if T is not None and inl.sum() >= 3:
                idx = groups[g][0]
                res[g] = Hypotheses(np.array([groups[g][1]], np.int32), T[None], np.array([int(inl.sum())], np.int32),
                                    [idx[inl]])
            else:
                res[g] = None
    out = []
    for g, (idx, mid) in enumerate(groups):
        h = res[g] if g in res else _fit_group(corr, library, skp, idx, mid, ransac, thr, max_iterations, seed)
        if h is not None:
            out.append(h)
    return Hypotheses.concat(out)


def _fit_group(corr, library, skp, idx, mid, ransac, thr, max_iterations, seed):
    src = library.kp_coords[corr.ref_row[idx]].astype(np.float64)
    dst = skp[corr.scene_kp[idx]]
    if len(idx) < 3:
        return None
    if ransac:
        T, inl = ransac_rigid(src, dst, threshold=thr, max_iterations=max_iterations, seed=seed)
        if T is None or inl.sum() < 3:
            return None
        kept = idx[inl]
    else:
        T = rigid_transform(src, dst)
        kept = idx
    return Hypotheses(np.array([mid], np.int32), T[None], np.array([len(kept)], np.int32), [kept])


def group_gc(corr: Correspondences, library: ModelLibrary, scene_kp_coords, *,
             gc_size: float = 0.01, gc_threshold: int = 5, ransac: bool = True,
             max_iterations: int = 10000, seed: int = 0, device: str = "auto") -> Hypotheses:
    """Geometric-consistency grouping (PCL ``GeometricConsistencyGrouping``), per model.

    Correspondences are sorted by descriptor distance (stable); from every untaken seed a
    consensus set grows greedily: ``j`` joins when ``| |s_k - s_j| - |m_k - m_j| | <= gc_size``
    for every member ``k`` (the test of current PCL; PCL <= 1.8 compared against the first
    ``|set|`` correspondences instead of the set's members, a bug). A set with more than
    ``gc_threshold`` members is kept, its members taken, cleaned by RANSAC (threshold
    ``gc_size``) and fitted by SVD.

    On the GPU (``device``; ``auto`` follows ``scene_kp_coords``) the sweeps of all models run
    in one launch with the same labels (``_grouping_gpu.gc_sets_batch``), and RANSAC fits every
    kept set at once (one warp per set, samples from a counter-based hash of ``seed``: the same
    sets and, where the inliers are unambiguous, the same inliers and poses as on the CPU).
    """
    dev = resolve_device(device, scene_kp_coords)
    if dev == "gpu" and ransac:
        from ._grouping_gpu import gc_hypotheses

        mids, poses, n_corr, groups = gc_hypotheses(
            corr.model_id, corr.scene_kp, corr.ref_row, corr.dist2, scene_kp_coords, library.kp_coords,
            gc_size=gc_size, gc_threshold=int(gc_threshold), max_iterations=max_iterations, seed=seed)
        return Hypotheses(mids, poses, n_corr, groups) if len(mids) else Hypotheses.empty()
    skp = np.asarray(to_numpy(scene_kp_coords), np.float64)
    out = []
    for mid in np.unique(corr.model_id):
        sel = np.flatnonzero(corr.model_id == mid)
        sel = sel[np.argsort(corr.dist2[sel], kind="stable")]
        S = skp[corr.scene_kp[sel]].astype(np.float32)
        M = library.kp_coords[corr.ref_row[sel]].astype(np.float32)
        labels = _gc_sets(S, M, np.float64(gc_size), int(gc_threshold))
        kept = np.flatnonzero(labels >= 0)
        if len(kept):  # the members of each set in ascending descriptor distance, for RANSAC
            kept = kept[np.argsort(labels[kept], kind="stable")]
            for members in np.split(sel[kept], np.cumsum(np.bincount(labels[kept]))[:-1]):
                out.append((members, int(mid)))
    return _fit_groups(corr, library, skp, out, ransac, gc_size, max_iterations, seed)


def group_gc_many(corrs, library: ModelLibrary, scene_kp_coords, *, gc_size: float = 0.01,
                  gc_threshold: int = 5, ransac: bool = True, max_iterations: int = 10000, seed: int = 0,
                  device: str = "auto") -> list:
    """:func:`group_gc` of many scenes (``corrs`` and ``scene_kp_coords``, one per scene): the
    same hypotheses as one call per scene. On the GPU every scene's sweeps run in one launch and
    every kept set's RANSAC in another (``_grouping_gpu.gc_hypotheses_many``): a sweep is
    sequential within its (scene, model) group, so a batch keeps the device's SMs busy where
    one scene's few groups cannot."""
    if not len(corrs):
        return []
    dev = resolve_device(device, scene_kp_coords[0])
    if dev == "gpu" and ransac:
        from ._grouping_gpu import gc_hypotheses_many

        res = gc_hypotheses_many([(c.model_id, c.scene_kp, c.ref_row, c.dist2, k)
                                  for c, k in zip(corrs, scene_kp_coords)], library.kp_coords,
                                 gc_size=gc_size, gc_threshold=int(gc_threshold),
                                 max_iterations=max_iterations, seed=seed)
        return [Hypotheses(*r) if len(r[0]) else Hypotheses.empty() for r in res]
    return [group_gc(c, library, k, gc_size=gc_size, gc_threshold=gc_threshold, ransac=ransac,
                     max_iterations=max_iterations, seed=seed, device=dev)
            for c, k in zip(corrs, scene_kp_coords)]


def _numba_threads() -> int:
    import numba

    return numba.get_num_threads()


def _gc_sets(S, M, gc_size, gc_threshold, chunk: int = 256, sequential: bool | None = None):
    """Consensus-set label of each (distance-sorted) correspondence, -1 when in no kept set.

    With ``sequential`` (default: when numba has at most 4 threads, e.g. one of several workers on
    a host) the sequential sweep :func:`_gc_sweep_seq`. On 2 threads it takes 0.14 s of a 20k-point
    scene's grouping against 0.26-0.38 s for the parallel sweep, so even perfect scaling would only
    tie at 4 threads, with 4 cores busy instead of one. In an archive the host's cores are shared
    by workers that also wait on a GPU, where chunk barriers stall: with the parallel sweep on 4
    threads each, 8 workers on 2 H200s spent 2.7 s per scene in grouping, one process alone 0.48 s.
    Otherwise the greedy sweep of PCL, made parallel without changing its result: the sets of the next
    ``chunk`` untaken seeds are grown in parallel against the current ``taken`` flags; then the
    seeds are committed in order. A seed's speculative set stays valid unless a set committed
    earlier in the same chunk took one of its members or the seed itself (a taken candidate
    that was rejected anyway changes nothing), in which case it is grown again.
    """
    n = S.shape[0]
    if sequential is None:
        sequential = _numba_threads() <= 4
    if n and sequential:
        # few threads (a worker's share of a host): the sequential sweep beats the speculative one
        return _gc_sweep_seq(S, M, np.float64(gc_size), int(gc_threshold))
    taken = np.zeros(n, np.bool_)
    labels = np.full(n, -1, np.int64)
    if n == 0:
        return labels
    buf = np.empty((min(chunk, n), n), np.int64)
    cnt = np.empty(min(chunk, n), np.int64)
    ng = 0
    i = 0
    while i < n:
        seeds = np.flatnonzero(~taken[i:])[:chunk] + i
        if len(seeds) == 0:
            break
        _gc_grow_many(S, M, gc_size, seeds, taken, buf, cnt)
        ng = _gc_commit(S, M, gc_size, gc_threshold, seeds, taken, labels, buf, cnt, ng)
        i = int(seeds[-1]) + 1
    return labels


# ---------------------------------------------------------------------------------------------
# numba sweeps of geometric consistency
# ---------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _gc_fails(S, M, k, j, gc_size):
    """Correspondence ``j`` is inconsistent with member ``k``: the scene and model distances
    of the pair differ by more than ``gc_size``."""
    dsx = S[k, 0] - S[j, 0]
    dsy = S[k, 1] - S[j, 1]
    dsz = S[k, 2] - S[j, 2]
    dmx = M[k, 0] - M[j, 0]
    dmy = M[k, 1] - M[j, 1]
    dmz = M[k, 2] - M[j, 2]
    ds = math.sqrt(dsx * dsx + dsy * dsy + dsz * dsz)
    dm = math.sqrt(dmx * dmx + dmy * dmy + dmz * dmz)
    return abs(ds - dm) > gc_size

@njit(cache=True, inline="always")
def _gc_grow(S, M, gc_size, i, taken, members):
    n = S.shape[0]
    m = 1
    members[0] = i
    for j in range(n):
        if j == i or taken[j]:
            continue
        good = True
        for kk in range(m):
            if _gc_fails(S, M, members[kk], j, gc_size):
                good = False
                break
        if good:
            members[m] = j
            m += 1
    return m

@njit(cache=True, parallel=True)
def _gc_grow_many(S, M, gc_size, seeds, taken, buf, cnt):
    for t in prange(len(seeds)):
        cnt[t] = _gc_grow(S, M, gc_size, seeds[t], taken, buf[t])

@njit(cache=True)
def _gc_commit(S, M, gc_size, gc_threshold, seeds, taken, labels, buf, cnt, ng):
    dirty = False
    for t in range(len(seeds)):
        i = seeds[t]
        if taken[i]:
            continue
        m = cnt[t]
        if dirty:
            for kk in range(m):
                if taken[buf[t, kk]]:
                    m = _gc_grow(S, M, gc_size, i, taken, buf[t])
                    break
        if m > gc_threshold:
            for kk in range(m):
                taken[buf[t, kk]] = True
                labels[buf[t, kk]] = ng
            ng += 1
            dirty = True
    return ng

@njit(cache=True)
def _gc_sets_nb(S, M, gc_size, gc_threshold):
    """The plain sequential sweep (the reference the parallel form is tested against)."""
    n = S.shape[0]
    taken = np.zeros(n, np.bool_)
    labels = np.full(n, -1, np.int64)
    members = np.empty(n, np.int64)
    ng = 0
    for i in range(n):
        if taken[i]:
            continue
        m = _gc_grow(S, M, gc_size, i, taken, members)
        if m > gc_threshold:
            for kk in range(m):
                taken[members[kk]] = True
                labels[members[kk]] = ng
            ng += 1
    return labels

@njit(cache=True)
def _gc_sweep_seq(S, M, gc_size, gc_threshold):
    """PCL's sequential sweep (labels as :func:`_gc_sets_nb`), faster: each seed first tests
    every candidate against itself in one branch-free, vectorisable loop over coordinate
    columns (the arithmetic of :func:`_gc_fails`), then only the survivors against the other
    members."""
    n = S.shape[0]
    sx = np.ascontiguousarray(S[:, 0])
    sy = np.ascontiguousarray(S[:, 1])
    sz = np.ascontiguousarray(S[:, 2])
    mx = np.ascontiguousarray(M[:, 0])
    my = np.ascontiguousarray(M[:, 1])
    mz = np.ascontiguousarray(M[:, 2])
    taken = np.zeros(n, np.bool_)
    cons = np.empty(n, np.bool_)
    labels = np.full(n, -1, np.int64)
    members = np.empty(n, np.int64)
    ng = 0
    for i in range(n):
        if taken[i]:
            continue
        six, siy, siz, mix, miy, miz = sx[i], sy[i], sz[i], mx[i], my[i], mz[i]
        for j in range(n):
            dsx = six - sx[j]
            dsy = siy - sy[j]
            dsz = siz - sz[j]
            dmx = mix - mx[j]
            dmy = miy - my[j]
            dmz = miz - mz[j]
            ds = math.sqrt(dsx * dsx + dsy * dsy + dsz * dsz)
            dm = math.sqrt(dmx * dmx + dmy * dmy + dmz * dmz)
            cons[j] = not (abs(ds - dm) > gc_size)
        members[0] = i
        m = 1
        for j in range(n):
            if j == i or taken[j] or not cons[j]:
                continue
            good = True
            for kk in range(1, m):
                if _gc_fails(S, M, members[kk], j, gc_size):
                    good = False
                    break
            if good:
                members[m] = j
                m += 1
        if m > gc_threshold:
            for kk in range(m):
                taken[members[kk]] = True
                labels[members[kk]] = ng
            ng += 1
    return labels
