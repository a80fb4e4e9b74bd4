"""The polish's fit (:func:`.refinement.polish_poses`) in one numba loop: point-to-point ICP of
one pose's model points against a crop of the scene's own points (its cell list), the pairing,
the least-squares rigid step (:func:`.rigid.rigid_transform`'s Umeyama fit) and the update of
every iteration without a return to Python (in numpy each iteration was a dozen array calls and
an SVD: 0.4-0.5 ms on a few thousand points)."""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange
from ..geom_cpu import centroid3, scatter3
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
    near = np.empty(m, np.int64)
    A = np.empty((m, 3))  # the pairs, gathered: moved model points and their crop points
    B = np.empty((m, 3))
    H = np.empty((3, 3))
    for _ in range(iterations):
        _pair(V, T, P, order, cs, origin, inv_h, dims, r2, W, near)  # on every core
        n = 0
        for i in range(m):
            if near[i] >= 0:
                A[n] = W[i]
                B[n] = host[near[i]]
                n += 1
        if n < 3:
            break
        ca0, ca1, ca2 = centroid3(A, n)
        cb0, cb1, cb2 = centroid3(B, n)
        scatter3(A, ca0, ca1, ca2, B, cb0, cb1, cb2, None, n, H)  # the cross-covariance
        U, _s, Vt = np.linalg.svd(H)
        Vm = Vt.T.copy()
        if np.linalg.det(U) * np.linalg.det(Vm) < 0:
            Vm[:, 2] = -Vm[:, 2]
        R = Vm @ U.T
        step = np.eye(4)
        step[:3, :3] = R
        step[0, 3] = cb0 - (R[0, 0] * ca0 + R[0, 1] * ca1 + R[0, 2] * ca2)
        step[1, 3] = cb1 - (R[1, 0] * ca0 + R[1, 1] * ca1 + R[1, 2] * ca2)
        step[2, 3] = cb2 - (R[2, 0] * ca0 + R[2, 1] * ca1 + R[2, 2] * ca2)
        T = step @ T
        if np.abs(step[:3, 3]).max() < 1e-9 and np.abs(step[:3, :3] - np.eye(3)).max() < 1e-9:
            break
    return T
