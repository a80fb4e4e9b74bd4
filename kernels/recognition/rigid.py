"""Rigid fits of paired points: least squares (SVD, Horn's quaternions) and RANSAC.

:func:`rigid_transform` is PCL's ``TransformationEstimationSVD`` (Umeyama without scale),
:func:`ransac_rigid` its ``CorrespondenceRejectorSampleConsensus`` (3-point samples, adaptive
iteration count), and :func:`ransac_rigid_groups` the same RANSAC for the many small groups of
one scene at once. The 3-point fits of RANSAC run batched in numba (:func:`_kabsch_nb`).
"""
from __future__ import annotations

import math

import numpy as np

from ..jit import njit
from ..errors import InputError
from ..geom_cpu import centroid3, jacobi_eigh, scatter3

__all__ = ["rigid_transform", "ransac_rigid", "ransac_rigid_groups"]


def rigid_transform(src, dst, weights=None) -> np.ndarray:
    """Least-squares rigid transform ``dst ~ R src + t`` (PCL ``TransformationEstimationSVD``).

    Float64 SVD of the cross-covariance of the demeaned sets; the reflection case is fixed by
    negating the last column of V (as PCL/Umeyama). Returns a 4x4 float64 matrix.
    """
    s = np.asarray(src, np.float64)
    d = np.asarray(dst, np.float64)
    if s.shape != d.shape or s.ndim != 2 or s.shape[1] != 3:
        raise InputError(f"src and dst must both be (N, 3), got {s.shape} and {d.shape}")
    if len(s) < 3:
        raise InputError(f"a rigid fit needs at least 3 correspondences, got {len(s)}")
    w = np.ones(len(s)) if weights is None else np.asarray(weights, np.float64)
    ws = w.sum()
    cs = (w[:, None] * s).sum(0) / ws
    cd = (w[:, None] * d).sum(0) / ws
    H = ((s - cs) * w[:, None]).T @ (d - cd)
    U, _, Vt = np.linalg.svd(H)
    V = Vt.T
    if np.linalg.det(U) * np.linalg.det(V) < 0:
        V[:, 2] *= -1
    R = V @ U.T
    T = np.eye(4)
    T[:3, :3] = R
    T[:3, 3] = cd - R @ cs
    return T


def _kabsch_batch(S, D, W=None):
    """Batched (optionally weighted) rigid fits: S, D (B, n, 3) float64, W (B, n) weights or
    None -> R (B, 3, 3), t (B, 3).

    The unweighted fits (RANSAC's 3-point samples, tens of thousands per scene) run in one
    numba loop (:func:`_kabsch_nb`): Horn's quaternion form of the same least-squares rotation,
    the top eigenvector of a 4x4 symmetric matrix by Jacobi sweeps (no LAPACK call per sample)."""
    if W is None and S.dtype == np.float64 and D.dtype == np.float64:
        return _kabsch_nb(np.ascontiguousarray(S), np.ascontiguousarray(D))
    return _kabsch_svd(S, D, W)


def _kabsch_svd(S, D, W=None):
    """:func:`_kabsch_batch` by batched SVD (Kabsch with the reflection fix)."""
    if W is None:
        cs = S.mean(axis=1)
        cd = D.mean(axis=1)
        H = np.einsum("bni,bnj->bij", S - cs[:, None], D - cd[:, None])
    else:
        ws = np.maximum(W.sum(axis=1), 1e-12)
        cs = np.einsum("bn,bni->bi", W, S) / ws[:, None]
        cd = np.einsum("bn,bni->bi", W, D) / ws[:, None]
        H = np.einsum("bn,bni,bnj->bij", W, S - cs[:, None], D - cd[:, None])
    U, _, Vt = np.linalg.svd(H)
    V = np.swapaxes(Vt, 1, 2)
    bad = np.linalg.det(U) * np.linalg.det(V) < 0
    V[bad, :, 2] *= -1
    R = V @ np.swapaxes(U, 1, 2)
    t = cd - np.einsum("bij,bj->bi", R, cs)
    return R, t


@njit(cache=True)
def _kabsch_nb(S, D):
    """Unweighted batched rigid fits (Horn 1987): the rotation maximising sum d'^T R s' is the
    unit quaternion of the largest eigenvalue of a symmetric 4x4 matrix built from the
    cross-covariance of the demeaned pairs (``geom_cpu.scatter3``): its eigenvector by the
    package's Jacobi solver (``geom_cpu.jacobi_eigh``; the first of equal largest eigenvalues)."""
    B, n = S.shape[0], S.shape[1]
    R = np.empty((B, 3, 3))
    t = np.empty((B, 3))
    H = np.empty((3, 3))
    N = np.empty((4, 4))
    Q = np.empty((4, 4))
    for b in range(B):
        Sb = S[b]
        Db = D[b]
        cs0, cs1, cs2 = centroid3(Sb, n)
        cd0, cd1, cd2 = centroid3(Db, n)
        scatter3(Sb, cs0, cs1, cs2, Db, cd0, cd1, cd2, None, n, H)
        sxx, sxy, sxz = H[0, 0], H[0, 1], H[0, 2]
        syx, syy, syz = H[1, 0], H[1, 1], H[1, 2]
        szx, szy, szz = H[2, 0], H[2, 1], H[2, 2]
        N[0, 0] = sxx + syy + szz
        N[0, 1] = N[1, 0] = syz - szy
        N[0, 2] = N[2, 0] = szx - sxz
        N[0, 3] = N[3, 0] = sxy - syx
        N[1, 1] = sxx - syy - szz
        N[1, 2] = N[2, 1] = sxy + syx
        N[1, 3] = N[3, 1] = szx + sxz
        N[2, 2] = -sxx + syy - szz
        N[2, 3] = N[3, 2] = syz + szy
        N[3, 3] = -sxx - syy + szz
        jacobi_eigh(N, Q, 4, 30, 1e-30)  # N is overwritten
        top = 0
        for p in range(1, 4):
            if N[p, p] > N[top, top]:
                top = p
        w, x, y, z = Q[0, top], Q[1, top], Q[2, top], Q[3, top]
        R[b, 0, 0] = w * w + x * x - y * y - z * z
        R[b, 0, 1] = 2.0 * (x * y - w * z)
        R[b, 0, 2] = 2.0 * (x * z + w * y)
        R[b, 1, 0] = 2.0 * (x * y + w * z)
        R[b, 1, 1] = w * w - x * x + y * y - z * z
        R[b, 1, 2] = 2.0 * (y * z - w * x)
        R[b, 2, 0] = 2.0 * (x * z - w * y)
        R[b, 2, 1] = 2.0 * (y * z + w * x)
        R[b, 2, 2] = w * w - x * x - y * y + z * z
        t[b, 0] = cd0 - (R[b, 0, 0] * cs0 + R[b, 0, 1] * cs1 + R[b, 0, 2] * cs2)
        t[b, 1] = cd1 - (R[b, 1, 0] * cs0 + R[b, 1, 1] * cs1 + R[b, 1, 2] * cs2)
        t[b, 2] = cd2 - (R[b, 2, 0] * cs0 + R[b, 2, 1] * cs1 + R[b, 2, 2] * cs2)
    return R, t


def ransac_rigid(src, dst, *, threshold: float, max_iterations: int = 10000,
                 probability: float = 0.99, refine: bool = True, seed: int = 0, batch: int = 256):
    """RANSAC rigid registration of paired points (PCL ``CorrespondenceRejectorSampleConsensus``).

    3-point samples, inlier when ``|R s + t - d|^2 < threshold^2``, adaptive iteration count
    for the given ``probability`` (capped at ``max_iterations``). With ``refine`` the best
    model is refitted by SVD on its inliers (and the inliers recomputed once), which PCL leaves
    to the caller.

    Returns
    -------
    (pose 4x4 float64, inlier mask) or ``(None, None)`` with fewer than 3 pairs.
    """
    s = np.asarray(src, np.float64)
    d = np.asarray(dst, np.float64)
    n = len(s)
    if n < 3:
        return None, None
    rng = np.random.default_rng(seed)
    thr2 = float(threshold) ** 2
    best_cnt, best = -1, None
    needed, it = max_iterations, 0
    while it < min(needed, max_iterations):
        # small first batches: consistent groups (most of them) stop after a few samples
        b = min(batch, max(16, it), max_iterations - it, max(needed - it, 1))
        samp = np.stack([rng.choice(n, 3, replace=False) for _ in range(min(b, 1))]) if n == 3 \
            else _triples(rng, n, b)
        R, t = _kabsch_batch(s[samp], d[samp])
        res = np.einsum("bij,nj->bni", R, s) + t[:, None, :] - d[None]
        inl = np.einsum("bni,bni->bn", res, res) < thr2
        cnt = inl.sum(axis=1)
        j = int(np.argmax(cnt))
        if cnt[j] > best_cnt:
            best_cnt = int(cnt[j])
            best = (R[j], t[j], inl[j])
            w = best_cnt / n
            p_fail = 1.0 - w ** 3
            if p_fail <= 0:
                needed = 0
            elif p_fail < 1:
                needed = int(math.ceil(math.log(1 - probability) / math.log(p_fail)))
        it += b
        if n == 3:
            break
    R, t, inl = best
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, t
    if refine and inl.sum() >= 3:
        T = rigid_transform(s[inl], d[inl])
        res = s @ T[:3, :3].T + T[:3, 3] - d
        inl2 = np.einsum("ni,ni->n", res, res) < thr2
        if inl2.sum() >= 3 and inl2.sum() >= inl.sum():
            inl = inl2
            T = rigid_transform(s[inl], d[inl])
    return T, inl


def _triples(rng, n, b):
    s = rng.integers(0, n, size=(b, 3))
    bad = (s[:, 0] == s[:, 1]) | (s[:, 0] == s[:, 2]) | (s[:, 1] == s[:, 2])
    while bad.any():
        s[bad] = rng.integers(0, n, size=(int(bad.sum()), 3))
        bad = (s[:, 0] == s[:, 1]) | (s[:, 0] == s[:, 2]) | (s[:, 1] == s[:, 2])
    return s


def ransac_rigid_groups(srcs, dsts, *, threshold: float, max_iterations: int = 10000,
                        probability: float = 0.99, seed: int = 0, first: int = 32, cap: int = 1024):
    """:func:`ransac_rigid` for many small groups at once (the hypotheses of one scene).

    The groups are padded to a common length and sampled together: ``first`` 3-point samples
    per group in one batched Kabsch, then, for the groups whose best inlier ratio asks for more
    samples (adaptive count for ``probability``), a second batch up to ``min(max_iterations,
    cap)``; the best model is refitted on its inliers and the inliers recomputed once, as
    :func:`ransac_rigid` does. Returns a list of ``(pose, inlier mask)`` (``(None, None)`` for
    groups of fewer than 3 pairs).
    """
    G = len(srcs)
    out = [(None, None)] * G
    ok = [g for g in range(G) if len(srcs[g]) >= 3]
    if not ok:
        return out
    rng = np.random.default_rng(seed)
    thr2 = float(threshold) ** 2
    n = np.array([len(srcs[g]) for g in ok])
    L = int(n.max())
    S = np.zeros((len(ok), L, 3))
    D = np.zeros((len(ok), L, 3))
    M = np.zeros((len(ok), L), bool)
    for r, g in enumerate(ok):
        S[r, :n[r]], D[r, :n[r]], M[r, :n[r]] = srcs[g], dsts[g], True
    best_cnt = np.full(len(ok), -1)
    best_R = np.zeros((len(ok), 3, 3))
    best_t = np.zeros((len(ok), 3))

    def run(rows, b):
        rows = np.asarray(rows)[np.argsort(n[rows], kind="stable")]  # similar sizes share a chunk
        c0 = 0
        while c0 < len(rows):
            Lc = int(n[rows[min(len(rows), c0 + 256) - 1]])  # chunk padded to its largest group
            step = max(1, min(256, 2_000_000 // max(b * Lc, 1)))
            rr = rows[c0:c0 + step]
            c0 += len(rr)
            Lc = int(n[rr].max())
            nn = n[rr][:, None, None]
            smp = np.floor(rng.random((len(rr), b, 3)) * nn).astype(np.int64)
            bad = (smp[..., 0] == smp[..., 1]) | (smp[..., 0] == smp[..., 2]) | (smp[..., 1] == smp[..., 2])
            while bad.any():  # distinct triples (every group has >= 3 pairs)
                smp[bad] = np.floor(rng.random((int(bad.sum()), 3))
                                    * np.broadcast_to(nn, smp.shape)[bad]).astype(np.int64)
                bad = (smp[..., 0] == smp[..., 1]) | (smp[..., 0] == smp[..., 2]) | (smp[..., 1] == smp[..., 2])
            gi = rr[:, None, None]
            R, t = _kabsch_batch(S[gi, smp].reshape(-1, 3, 3), D[gi, smp].reshape(-1, 3, 3))
            R, t = R.reshape(len(rr), b, 3, 3), t.reshape(len(rr), b, 3)
            Sc, Dc = S[rr, :Lc], D[rr, :Lc]
            res = np.matmul(Sc[:, None], np.swapaxes(R, 2, 3)) + (t[:, :, None, :] - Dc[:, None])
            res *= res
            inl = (res.sum(axis=3) < thr2) & M[rr, :Lc][:, None, :]
            cnt = inl.sum(axis=2)
            j = np.argmax(cnt, axis=1)
            ar = np.arange(len(rr))
            cj = cnt[ar, j]
            better = cj > best_cnt[rr]
            upd = rr[better]
            best_cnt[upd] = cj[better]
            best_R[upd] = R[ar[better], j[better]]
            best_t[upd] = t[ar[better], j[better]]

    b1 = min(first, max_iterations)
    run(np.arange(len(ok)), b1)
    w = best_cnt / n
    p_fail = 1.0 - w ** 3
    with np.errstate(divide="ignore", invalid="ignore"):
        needed = np.where(p_fail <= 0, 0, np.ceil(np.log(1 - probability) / np.log(np.clip(p_fail, 1e-300, 1 - 1e-16))))
    more = np.flatnonzero(needed > b1)
    if len(more) and max_iterations > b1:
        run(more, int(min(max_iterations, cap, needed[more].max())) - b1)

    def inliers(R, t):
        res = np.einsum("gij,glj->gli", R, S) + t[:, None, :] - D
        return (np.einsum("gli,gli->gl", res, res) < thr2) & M

    inl = inliers(best_R, best_t)
    R, t = best_R, best_t
    fit = inl.sum(axis=1) >= 3
    if fit.any():  # refit on the inliers, recompute them once, keep when not worse
        R2, t2 = _kabsch_batch(S, D, inl.astype(np.float64))
        inl2 = inliers(R2, t2)
        R = np.where(fit[:, None, None], R2, R)
        t = np.where(fit[:, None], t2, t)
        take = fit & (inl2.sum(axis=1) >= 3) & (inl2.sum(axis=1) >= inl.sum(axis=1))
        if take.any():
            R3, t3 = _kabsch_batch(S, D, inl2.astype(np.float64))
            R = np.where(take[:, None, None], R3, R)
            t = np.where(take[:, None], t3, t)
            inl = np.where(take[:, None], inl2, inl)
    for r, g in enumerate(ok):
        T = np.eye(4)
        T[:3, :3], T[:3, 3] = R[r], t[r]
        out[g] = (T, inl[r, :n[r]].copy())
    return out
