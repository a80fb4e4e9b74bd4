"""The polish's fit (:func:`.refinement.polish_poses`) in one numba loop: point-to-point ICP of
one pose's model points against a crop of the scene's own points (its cell list), the pairing,
the least-squares rigid step (:func:`.rigid.rigid_transform`'s Umeyama fit) and the update of
every iteration without a return to Python (in numpy each iteration was a dozen array calls and
an SVD: 0.4-0.5 ms on a few thousand points)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..neighbors.search_cpu import grid_nearest


@njit(cache=True, parallel=True)
def _pair(V, T, P, order, cs, origin, inv_h, dims, r2, W, near):
    """``W`` = ``V`` moved by ``T``; ``near``: each point's nearest crop point strictly within
    ``sqrt(r2)`` (an index into the crop) or -1."""
    for i in prange(V.shape[0]):
        for k in range(3):
            W[i, k] = T[k, 0] * V[i, 0] + T[k, 1] * V[i, 1] + T[k, 2] * V[i, 2] + T[k, 3]
        bi = grid_nearest(P, cs, origin, inv_h, dims, np.float32(W[i, 0]), np.float32(W[i, 1]),
                          np.float32(W[i, 2]), r2)
        near[i] = order[bi] if bi >= 0 else -1


@njit(cache=True)
def polish_fit(V, T0, P, order, cs, origin, inv_h, dims, host, r2, iterations):
    """``T0`` (float64 4x4) refined: each iteration moves ``V`` (float64 (m, 3)) by the pose,
    pairs every point with its nearest crop point strictly within ``sqrt(r2)`` (the float32
    search of the cell list ``P, order, cs, origin, inv_h, dims``; ``host`` the crop in float64,
    in its own order), and composes the rigid fit of the pairs with the pose. It stops with
    fewer than 3 pairs or once the step moves less than 1e-9 (m and rotation entries)."""
    m = V.shape[0]
    T = T0.copy()
    W = np.empty((m, 3))
    src = np.empty(m, np.int64)
    dst = np.empty(m, np.int64)
    H = np.empty((3, 3))
    near = np.empty(m, np.int64)
    for _ in range(iterations):
        _pair(V, T, P, order, cs, origin, inv_h, dims, r2, W, near)  # on every core
        n = 0
        for i in range(m):
            if near[i] >= 0:
                src[n] = i
                dst[n] = near[i]
                n += 1
        if n < 3:
            break
        cs0 = np.zeros(3)
        cd0 = np.zeros(3)
        for j in range(n):
            for k in range(3):
                cs0[k] += W[src[j], k]
                cd0[k] += host[dst[j], k]
        for k in range(3):
            cs0[k] /= n
            cd0[k] /= n
        H[:] = 0.0
        for j in range(n):
            for a in range(3):
                sa = W[src[j], a] - cs0[a]
                for b in range(3):
                    H[a, b] += sa * (host[dst[j], b] - cd0[b])
        U, _s, Vt = np.linalg.svd(H)
        Vm = Vt.T.copy()
        if np.linalg.det(U) * np.linalg.det(Vm) < 0:
            for a in range(3):
                Vm[a, 2] = -Vm[a, 2]
        R = Vm @ U.T
        step = np.eye(4)
        step[:3, :3] = R
        for a in range(3):
            step[a, 3] = cd0[a] - (R[a, 0] * cs0[0] + R[a, 1] * cs0[1] + R[a, 2] * cs0[2])
        T = step @ T
        small = True
        for a in range(3):
            if abs(step[a, 3]) >= 1e-9:
                small = False
            for b in range(3):
                if abs(step[a, b] - (1.0 if a == b else 0.0)) >= 1e-9:
                    small = False
        if small:
            break
    return T
