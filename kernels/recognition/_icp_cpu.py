"""The CPU's ICP iteration in one compiled pass (the CPU twin of :mod:`._icp_gpu`'s pairing kernel).

One call moves every source point by the current pose, pairs it with its nearest scene point
strictly within the radius (the cell list's float32 search, first of equals in cell order, as
:meth:`._scene_index._SceneIndex.nearest` and the GPU), drops pairs whose target normal is undefined
or disagrees with the moved source normal, and sums the 6x6 normal equations of the linearised
point-to-plane problem in float64, with no array per iteration. The numpy reference it replaced
(:func:`.icp._step` on gathered pairs) built a dozen arrays of the source's size per iteration,
which made ICP most of a CPU scene's recognition time; the sums now differ from it only by float64
summation order.
"""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange
from ..neighbors.search_cpu import grid_nearest


@njit(cache=True)
def icp_normal_equations(src, sn, use_sn, T, P, order, cs, origin, inv_h, dims, r2, tp, tn, agree, A, b):
    """Pair ``src`` (float64, model frame) moved by ``T`` with the scene and sum the normal
    equations into ``A`` (6x6) and ``b`` (6,), both zeroed here.

    ``P, order, cs, origin, inv_h, dims``: the scene's cell list (``_SceneIndex.cells()``); ``tp``
    and ``tn`` the scene's points and normals in their own order. ``sn`` is read only when
    ``use_sn``. Returns (pairs kept, sum of squared point-to-plane residuals)."""
    for i in range(6):
        b[i] = 0.0
        for j in range(6):
            A[i, j] = 0.0
    r00, r01, r02, t0 = T[0, 0], T[0, 1], T[0, 2], T[0, 3]
    r10, r11, r12, t1 = T[1, 0], T[1, 1], T[1, 2], T[1, 3]
    r20, r21, r22, t2 = T[2, 0], T[2, 1], T[2, 2], T[2, 3]
    kept = 0
    se = 0.0
    for i in range(src.shape[0]):
        sx = src[i, 0]
        sy = src[i, 1]
        sz = src[i, 2]
        px = r00 * sx + r01 * sy + r02 * sz + t0
        py = r10 * sx + r11 * sy + r12 * sz + t1
        pz = r20 * sx + r21 * sy + r22 * sz + t2
        bi = grid_nearest(P, cs, origin, inv_h, dims, np.float32(px), np.float32(py), np.float32(pz), r2)
        if bi < 0:
            continue
        k = order[bi]
        nx = np.float64(tn[k, 0])
        ny = np.float64(tn[k, 1])
        nz = np.float64(tn[k, 2])
        if not (np.isfinite(nx) and np.isfinite(ny) and np.isfinite(nz)):
            continue
        if use_sn:
            mx = r00 * sn[i, 0] + r01 * sn[i, 1] + r02 * sn[i, 2]
            my = r10 * sn[i, 0] + r11 * sn[i, 1] + r12 * sn[i, 2]
            mz = r20 * sn[i, 0] + r21 * sn[i, 1] + r22 * sn[i, 2]
            if not (mx * nx + my * ny + mz * nz >= agree):  # a NaN source normal never agrees
                continue
        e = (px - np.float64(tp[k, 0])) * nx + (py - np.float64(tp[k, 1])) * ny + (pz - np.float64(tp[k, 2])) * nz
        J0 = py * nz - pz * ny
        J1 = pz * nx - px * nz
        J2 = px * ny - py * nx
        J = (J0, J1, J2, nx, ny, nz)
        for r in range(6):
            jr = J[r]
            b[r] -= jr * e
            for c in range(r, 6):
                A[r, c] += jr * J[c]
        kept += 1
        se += e * e
    for r in range(6):
        for c in range(r):
            A[r, c] = A[c, r]
    return kept, se


@njit(cache=True, parallel=True)
def icp_normal_equations_batch(src, sn, use_sn, off, T, act, P, order, cs, origin, inv_h, dims, r2, tp, tn, agree,
                               A, b, kept, se):
    """:func:`icp_normal_equations` of the problems ``act`` (in parallel): problem ``p``'s source
    rows are ``src[off[p]:off[p + 1]]`` (``sn`` alike), its pose ``T[p]``; its sums go to
    ``A[j]``, ``b[j]``, ``kept[j]``, ``se[j]`` for ``p = act[j]``. Each problem's sums are those
    of the one-problem call, bit for bit."""
    for j in prange(act.shape[0]):
        p = act[j]
        a0, a1 = off[p], off[p + 1]
        k, e = icp_normal_equations(src[a0:a1], sn[a0:a1] if use_sn else src[a0:a1], use_sn, T[p], P, order, cs,
                                    origin, inv_h, dims, r2, tp, tn, agree, A[j], b[j])
        kept[j] = k
        se[j] = e
