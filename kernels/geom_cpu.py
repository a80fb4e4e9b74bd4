"""numba building blocks shared by normals, SHOT and the rigid fits of recognition on the CPU.

``jacobi_eigh`` is the one cyclic Jacobi eigen-solver of the package: a symmetric n x n float64
matrix, in place. ``eig3`` wraps it for the 3x3 covariances of normals and SHOT frames (sorted
eigenpairs); ``recognition.rigid`` uses it on the 4x4 matrix of Horn's quaternion fit. The CUDA
source in ``descriptors/shot_gpu.py`` carries the same algorithm for 3x3, operation for operation
(compiled without fused multiply-add), so that both backends produce the same frames bit for bit
on the same inputs.

``centroid3``, ``scatter3`` and ``cov_eig3`` are the one covariance step: ``scatter3`` the
(weighted) scatter of 3-D rows about given centres (a covariance, or the cross-covariance of two
paired sets for Horn's fit), ``cov_eig3`` the covariance of one set divided by its weight, then
``eig3``. Normals (float64 points about their centroid, unweighted) and SHOT frames (PCL's
float32 differences to the keypoint, widened, about zero, weighted by ``R - d``) pass their own
rows, centre and weights, so each keeps its arithmetic bit for bit.
"""
from __future__ import annotations

import numpy as np

from .jit import njit


@njit(cache=True, inline="always")
def jacobi_eigh(A, V, n, max_sweeps, tol):
    """Eigen-decomposition of the symmetric (n, n) float64 matrix ``A`` by cyclic Jacobi sweeps.

    ``n`` is ``A``'s size, given by the caller as a constant: the function is inlined, so the
    sweeps' loops get a fixed trip count and unroll (as fast as a hand-written 3x3 solver).
    ``A`` is overwritten: it ends (nearly) diagonal with the eigenvalues on its diagonal, in no
    particular order. ``V`` (n, n) is set to the identity and receives the unit eigenvectors as
    its columns, column ``i`` belonging to ``A[i, i]``. A sweep rotates every pair ``p < q`` in
    row order; the sweeps stop when the squared off-diagonal sum is ``<= tol`` times the squared
    diagonal sum (or zero), after at most ``max_sweeps``. Only the upper triangle of ``A`` is read
    for the pivots, but both triangles are rotated: pass a full symmetric matrix.
    """
    for i in range(n):
        for j in range(n):
            V[i, j] = 1.0 if i == j else 0.0
    for _sweep in range(max_sweeps):
        off = 0.0
        for p in range(n - 1):
            for q in range(p + 1, n):
                off += A[p, q] * A[p, q]
        dia = 0.0
        for p in range(n):
            dia += A[p, p] * A[p, p]
        if off <= tol * dia or off == 0.0:
            break
        for p in range(n - 1):
            for q in range(p + 1, n):
                apq = A[p, q]
                if apq == 0.0:
                    continue
                theta = (A[q, q] - A[p, p]) / (2.0 * apq)
                t = 1.0 / (abs(theta) + np.sqrt(theta * theta + 1.0))
                if theta < 0.0:
                    t = -t
                c = 1.0 / np.sqrt(t * t + 1.0)
                s = t * c
                for k in range(n):  # A <- J^T A J, V <- V J
                    akp = A[k, p]
                    akq = A[k, q]
                    A[k, p] = c * akp - s * akq
                    A[k, q] = s * akp + c * akq
                for k in range(n):
                    apk = A[p, k]
                    aqk = A[q, k]
                    A[p, k] = c * apk - s * aqk
                    A[q, k] = s * apk + c * aqk
                for k in range(n):
                    vkp = V[k, p]
                    vkq = V[k, q]
                    V[k, p] = c * vkp - s * vkq
                    V[k, q] = s * vkp + c * vkq


@njit(cache=True)
def eig3(a00, a01, a02, a11, a12, a22, w, V):
    """Eigen-decomposition of [[a00,a01,a02],[a01,a11,a12],[a02,a12,a22]] (float64).

    Writes eigenvalues ascending into ``w`` (3,) and the unit eigenvectors as the columns of
    ``V`` (3, 3) in the same order. Returns False when the input is not finite.
    """
    if not (np.isfinite(a00) and np.isfinite(a01) and np.isfinite(a02) and np.isfinite(a11)
            and np.isfinite(a12) and np.isfinite(a22)):
        for i in range(3):
            for j in range(3):
                V[i, j] = 1.0 if i == j else 0.0
        w[0] = np.nan
        w[1] = np.nan
        w[2] = np.nan
        return False
    A = np.empty((3, 3), np.float64)
    A[0, 0] = a00
    A[0, 1] = a01
    A[0, 2] = a02
    A[1, 0] = a01
    A[1, 1] = a11
    A[1, 2] = a12
    A[2, 0] = a02
    A[2, 1] = a12
    A[2, 2] = a22
    jacobi_eigh(A, V, 3, 32, 1e-34)
    # components at rounding level are zero (Eigen's solver returns exact zeros for the
    # block-structured covariances of grid-like scans; keeping 1e-17 would flip their bins)
    for i in range(3):
        for j in range(3):
            if abs(V[i, j]) < 1e-15:
                V[i, j] = 0.0
    # sort ascending (stable, 3 elements)
    d0 = A[0, 0]
    d1 = A[1, 1]
    d2 = A[2, 2]
    o0 = 0
    o1 = 1
    o2 = 2
    if d1 < d0:
        d0, d1 = d1, d0
        o0, o1 = o1, o0
    if d2 < d1:
        d1, d2 = d2, d1
        o1, o2 = o2, o1
    if d1 < d0:
        d0, d1 = d1, d0
        o0, o1 = o1, o0
    w[0] = d0
    w[1] = d1
    w[2] = d2
    T = np.empty((3, 3), np.float64)
    for k in range(3):
        T[k, 0] = V[k, o0]
        T[k, 1] = V[k, o1]
        T[k, 2] = V[k, o2]
    for k in range(3):
        for j in range(3):
            V[k, j] = T[k, j]
    return np.isfinite(d0) and np.isfinite(d1) and np.isfinite(d2)


@njit(cache=True, inline="always")
def centroid3(X, n):
    """Mean of the rows ``0 .. n-1`` of ``X`` (n, 3): float64 sums in row order, divided by ``n``."""
    cx = 0.0
    cy = 0.0
    cz = 0.0
    for j in range(n):
        cx += np.float64(X[j, 0])
        cy += np.float64(X[j, 1])
        cz += np.float64(X[j, 2])
    return cx / n, cy / n, cz / n


@njit(cache=True, inline="always")
def scatter3(A, ca0, ca1, ca2, B, cb0, cb1, cb2, w, n, S):
    """Weighted scatter of paired rows: ``S[r, c] = sum_j w_j (A_jr - ca_r)(B_jc - cb_c)`` over
    ``j = 0 .. n-1``, float64, summed in row order; returns the weight total ``sum_j w_j``.

    ``w`` is a (n,) float64 array or None (every weight 1: the terms are added unscaled, and the
    total is ``n``); a weighted term is ``w_j * (a * b)``. ``S`` is (3, 3) and fully written.
    With ``B`` = ``A`` and the same centre, ``S`` is the (unnormalised) covariance; with two point
    sets, the cross-covariance of Horn's and Umeyama's rigid fits.
    """
    s00 = 0.0
    s01 = 0.0
    s02 = 0.0
    s10 = 0.0
    s11 = 0.0
    s12 = 0.0
    s20 = 0.0
    s21 = 0.0
    s22 = 0.0
    total = 0.0
    for j in range(n):
        a0 = A[j, 0] - ca0
        a1 = A[j, 1] - ca1
        a2 = A[j, 2] - ca2
        b0 = B[j, 0] - cb0
        b1 = B[j, 1] - cb1
        b2 = B[j, 2] - cb2
        if w is None:
            s00 += a0 * b0
            s01 += a0 * b1
            s02 += a0 * b2
            s10 += a1 * b0
            s11 += a1 * b1
            s12 += a1 * b2
            s20 += a2 * b0
            s21 += a2 * b1
            s22 += a2 * b2
        else:
            wj = w[j]
            s00 += wj * (a0 * b0)
            s01 += wj * (a0 * b1)
            s02 += wj * (a0 * b2)
            s10 += wj * (a1 * b0)
            s11 += wj * (a1 * b1)
            s12 += wj * (a1 * b2)
            s20 += wj * (a2 * b0)
            s21 += wj * (a2 * b1)
            s22 += wj * (a2 * b2)
            total += wj
    S[0, 0] = s00
    S[0, 1] = s01
    S[0, 2] = s02
    S[1, 0] = s10
    S[1, 1] = s11
    S[1, 2] = s12
    S[2, 0] = s20
    S[2, 1] = s21
    S[2, 2] = s22
    if w is None:
        return np.float64(n)
    return total


@njit(cache=True)
def cov_eig3(X, n, cx, cy, cz, w, C, ev, V):
    """Covariance of the rows ``0 .. n-1`` of ``X`` (n, 3) float64 about ``(cx, cy, cz)`` and
    its eigen-decomposition: the covariance and its precision are the caller's choice.

    ``C`` (3, 3) receives ``sum_j w_j d_j d_j^T / sum_j w_j`` with ``d_j = X_j - c``
    (:func:`scatter3`; ``w`` None: weights 1, divided by ``n``), ``ev`` (3,) and ``V`` (3, 3)
    the eigenvalues ascending and the unit eigenvectors as columns (:func:`eig3`). Returns
    ``eig3``'s flag (False on a non-finite covariance). Normals pass float64 points about their
    centroid, unweighted; SHOT frames pass PCL's float32 differences to the keypoint (widened)
    about zero with the weights ``R - d``: each stays bit for bit what it was.
    """
    total = scatter3(X, cx, cy, cz, X, cx, cy, cz, w, n, C)
    for r in range(3):
        for c in range(3):
            C[r, c] /= total
    return eig3(C[0, 0], C[0, 1], C[0, 2], C[1, 1], C[1, 2], C[2, 2], ev, V)


@njit(cache=True)
def finite_bounds(P):
    """``(bad, lo, hi)`` of an (N, 3) float array in one pass: the number of rows holding a NaN or
    an inf, and the per-axis minimum and maximum (float64 holding the input's values) of the
    other rows (``+inf`` / ``-inf`` when there are none)."""
    lo = np.full(3, np.inf)
    hi = np.full(3, -np.inf)
    bad = 0
    for i in range(P.shape[0]):
        x, y, z = P[i, 0], P[i, 1], P[i, 2]
        if not (np.isfinite(x) and np.isfinite(y) and np.isfinite(z)):
            bad += 1
            continue
        if x < lo[0]:
            lo[0] = x
        if x > hi[0]:
            hi[0] = x
        if y < lo[1]:
            lo[1] = y
        if y > hi[1]:
            hi[1] = y
        if z < lo[2]:
            lo[2] = z
        if z > hi[2]:
            hi[2] = z
    return bad, lo, hi


@njit(cache=True)
def ball_indices(P, c, r2):
    """Indices (int64, ascending) of the rows of the (N, 3) float32 ``P`` whose float32 squared
    distance to ``c`` is below ``r2``."""
    out = np.empty(P.shape[0], np.int64)
    m = 0
    for i in range(P.shape[0]):
        dx = P[i, 0] - c[0]
        dy = P[i, 1] - c[1]
        dz = P[i, 2] - c[2]
        if dx * dx + dy * dy + dz * dz < r2:
            out[m] = i
            m += 1
    return out[:m]
