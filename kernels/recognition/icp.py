"""Point-to-plane ICP (Chen & Medioni; the linearised Gauss-Newton step of PCL's
``TransformationEstimationPointToPlaneLLS``), CPU and GPU.

Each iteration transforms the source by the current pose, pairs every source point with its
nearest target point strictly within ``max_correspondence_distance`` (the scene's cell list in
float32; on the CPU one compiled pass an iteration, :mod:`._icp_cpu`), drops pairs whose target
normal is undefined or (with source normals) disagrees by more than ``acos(normal_agreement)``,
and solves the 6x6 normal equations of
``sum(((R p + t) - q) . n_q)^2`` linearised around the current pose, in float64. The increment
(a rotation vector and a translation) is applied on the left. It stops when the increment is
below ``tolerance`` (rotation in radians plus translation in units) or after ``max_iterations``.
Both backends share these semantics; they differ only by float64 summation order and by float32
ties in the nearest-neighbour search. The GPU iterates on the device without a host round trip
(:mod:`._icp_gpu`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import resolve_device, to_numpy
from ..errors import InputError
from ..validation import points

__all__ = ["IcpResult", "icp_point_to_plane", "icp_point_to_plane_batch"]


@dataclass
class IcpResult:
    pose: np.ndarray        # (4, 4) float64
    rmse: float             # point-to-plane RMS residual of the last pairing
    fitness: float          # fraction of source points paired in the last iteration
    iterations: int
    converged: bool


def icp_point_to_plane(source, target, target_normals, *, init=None, source_normals=None,
                       max_correspondence_distance: float, max_iterations: int = 30,
                       tolerance: float = 1e-7, normal_agreement: float = 0.5,
                       device: str = "auto", _target_index=None) -> IcpResult:
    """Align ``source`` to ``target`` by point-to-plane ICP.

    Parameters
    ----------
    source : (N, 3) array
        Points to move (model frame).
    target : (M, 3) array
        Fixed points (scene).
    target_normals : (M, 3) array
        Target normals (NaN rows are never paired).
    init : (4, 4) array, optional
        Initial pose (identity by default).
    source_normals : (N, 3) array, optional
        Enables the normal-agreement test ``(R n_s) . n_t >= normal_agreement``.
    max_correspondence_distance : float
        Pairs farther apart are ignored.
    max_iterations : int
    tolerance : float
    device : {"auto", "cpu", "gpu"}

    Returns
    -------
    IcpResult
    """
    dev = resolve_device(device, target) if _target_index is None else _target_index.device
    r = float(max_correspondence_distance)
    if not r > 0:
        raise InputError(f"max_correspondence_distance must be > 0, got {max_correspondence_distance!r}")
    src = points(to_numpy(source), "source", finite=False, dtype=np.float64)
    sn = None if source_normals is None else points(to_numpy(source_normals), "source_normals",
                                                    finite=False, dtype=np.float64, rows=len(src))
    T = np.eye(4) if init is None else np.array(to_numpy(init), np.float64)
    if T.shape != (4, 4) or not np.isfinite(T).all():
        raise InputError(f"init must be a finite 4x4 matrix, got shape {T.shape}")
    if _target_index is not None and abs(_target_index.cell - r) <= 1e-12 * max(r, 1):
        idx = _target_index
    else:
        from ._scene_index import _SceneIndex

        tgt = points(target, "target", finite=False, dtype=None)
        if target_normals is None:
            raise InputError("target_normals are required for point-to-plane ICP")
        tn = points(target_normals, "target_normals", finite=False, dtype=None, rows=tgt.shape[0])
        idx = _SceneIndex(tgt, tn, r, dev)
    if idx.normals is None:
        raise InputError("target_normals are required for point-to-plane ICP")
    if dev == "gpu":
        return _icp_gpu(src, sn, T, idx, r, max_iterations, tolerance, normal_agreement)
    return _icp_cpu(src, sn, T, idx, r, max_iterations, tolerance, normal_agreement)


def _step(P, Q, Nq, xp):
    """Normal equations of the linearised point-to-plane problem (float64)."""
    e = ((P - Q) * Nq).sum(axis=1)
    J = xp.concatenate([xp.cross(P, Nq), Nq], axis=1)
    A = J.T @ J
    b = -(J.T @ e)
    return A, b, e


def _solve(A, b):
    try:
        return np.linalg.solve(A, b)
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(A, b, rcond=None)[0]


def _increment(T, A, b):
    """Solve the 6x6 normal equations and apply the increment on the left: (new pose, step)."""
    T2, x = _increment_batch(np.asarray(T, np.float64)[None], np.asarray(A)[None], np.asarray(b)[None])
    return T2[0], x[0]


def _increment_batch(T, A, b):
    """:func:`_increment` for a batch: (B, 4, 4) poses, (B, 6, 6) systems, (B, 6) right-hand sides."""
    try:
        x = np.linalg.solve(A, b[..., None])[..., 0]
    except np.linalg.LinAlgError:  # a singular system somewhere: solve each on its own
        x = np.stack([_solve(a, v) for a, v in zip(A, b)])
    D = np.broadcast_to(np.eye(4), T.shape).copy()
    w = x[:, :3]
    th = np.linalg.norm(w, axis=1)
    turn = th >= 1e-15
    k = w[turn] / th[turn, None]
    z = np.zeros(len(k))
    K = np.stack([np.stack([z, -k[:, 2], k[:, 1]], 1), np.stack([k[:, 2], z, -k[:, 0]], 1),
                  np.stack([-k[:, 1], k[:, 0], z], 1)], 1)
    D[turn, :3, :3] = (np.eye(3) + np.sin(th[turn])[:, None, None] * K
                       + (1 - np.cos(th[turn]))[:, None, None] * (K @ K))
    D[:, :3, 3] = x[:, 3:]
    return D @ T, x


def _icp_cpu(src, sn, T, idx, r, iters, tol, agree):
    if not idx.cells_hold(r):  # a radius wider than the cell list's cells
        return _icp_cpu_arrays(src, sn, T, idx, r, iters, tol, agree)
    from ._icp_cpu import icp_normal_equations

    P, order, cs, origin, inv_h, dims = idx.cells()
    src = np.ascontiguousarray(src, np.float64)
    snx = src if sn is None else np.ascontiguousarray(sn, np.float64)  # read only when given
    A, b = np.empty((6, 6)), np.empty(6)

    def pair(T):
        kept, se = icp_normal_equations(src, snx, sn is not None, np.ascontiguousarray(T), P, order, cs, origin,
                                        inv_h, dims, np.float32(r * r), idx.points, idx.normals, float(agree), A, b)
        return (kept / len(src) if len(src) else float("nan")), kept, A, b, se

    return _iterate(T, iters, tol, pair)


def _icp_cpu_batch(srcs, sns, T, idx, r, iters, tol, agree):
    """:func:`_icp_cpu` of every problem at once: each iteration pairs the problems still going
    in parallel and solves their systems together; each stops by :func:`_iterate`'s rule.
    (poses (B, 4, 4), rmse, fitness, iterations, converged)."""
    from ._icp_cpu import icp_normal_equations_batch

    B = len(srcs)
    off = np.zeros(B + 1, np.int64)
    off[1:] = np.cumsum([len(s) for s in srcs])
    src = np.ascontiguousarray(np.concatenate(srcs), np.float64)
    sn = src if sns is None else np.ascontiguousarray(np.concatenate(sns), np.float64)  # read only when given
    T = np.ascontiguousarray(T, np.float64).copy()
    P, order, cs, origin, inv_h, dims = idx.cells()
    n_src = np.diff(off)
    rmse, fit = np.full(B, np.nan), np.zeros(B)
    its, conv = np.zeros(B, np.int64), np.zeros(B, bool)
    A, b, kept, se = np.empty((B, 6, 6)), np.empty((B, 6)), np.empty(B, np.int64), np.empty(B)
    active = np.arange(B, dtype=np.int64)
    for it in range(1, iters + 1):
        if not active.size:
            break
        na = active.size
        icp_normal_equations_batch(src, sn, sns is not None, off, T, active, P, order, cs, origin, inv_h, dims,
                                   np.float32(r * r), idx.points, idx.normals, float(agree), A, b, kept, se)
        its[active] = it
        with np.errstate(invalid="ignore", divide="ignore"):
            fit[active] = np.where(n_src[active] > 0, kept[:na] / np.maximum(n_src[active], 1), np.nan)
        ok = kept[:na] >= 6  # fewer pairs: that problem stops with its pose
        go = active[ok]
        if not go.size:
            break
        rmse[go] = np.sqrt(se[:na][ok] / kept[:na][ok])
        T2, x = _increment_batch(T[go], A[:na][ok], b[:na][ok])
        T[go] = T2
        done = np.array([np.linalg.norm(v) < tol for v in x], bool)  # _iterate's norm, one step at a time
        conv[go[done]] = True
        active = go[~done]
    return T, rmse, fit, its, conv


def _icp_cpu_arrays(src, sn, T, idx, r, iters, tol, agree):
    """The CPU loop on gathered arrays (:func:`_step`): the reference of the compiled pass, and
    the path for a radius wider than the scene index's cells (its KD-tree)."""
    tp, tn = idx.points, idx.normals

    def pair(T):
        P = src @ T[:3, :3].T + T[:3, 3]
        ni, _ = idx.nearest(P, r)
        ok = ni >= 0
        j = np.maximum(ni, 0)
        Nq = tn[j].astype(np.float64)
        ok &= np.isfinite(Nq).all(axis=1)
        if sn is not None:
            ok &= np.einsum("ij,ij->i", sn @ T[:3, :3].T, np.nan_to_num(Nq)) >= agree
        kept = int(ok.sum())
        if kept < 6:
            return float(ok.mean()), kept, None, None, 0.0
        A, b, e = _step(P[ok], tp[j[ok]].astype(np.float64), Nq[ok], np)
        return float(ok.mean()), kept, A, b, float(e @ e)

    return _iterate(T, iters, tol, pair)


def _iterate(T, iters, tol, pair):
    """The CPU's iterations and stopping rule: ``pair(T)`` gives (fitness, pairs kept, the 6x6
    normal equations A and b, the sum of squared residuals) for the current pose."""
    rmse, fit, it, conv = float("nan"), 0.0, 0, False
    for it in range(1, iters + 1):
        fit, kept, A, b, se = pair(T)
        if kept < 6:
            break
        rmse = float(np.sqrt(se / kept))
        T, x = _increment(T, A, b)
        if np.linalg.norm(x) < tol:
            conv = True
            break
    return IcpResult(T, rmse, fit, it, conv)


def _icp_gpu(src, sn, T, idx, r, iters, tol, agree):
    """The device loop of :mod:`._icp_gpu`, a batch of one."""
    from ._icp_gpu import icp_batch

    P, rm, ft, its, cv = icp_batch([src], None if sn is None else [sn], T[None], idx, r, iters, tol, agree)
    return IcpResult(P[0], float(rm[0]), float(ft[0]), int(its[0]), bool(cv[0]))


def icp_point_to_plane_batch(sources, index, *, inits, source_normals=None, max_correspondence_distance: float,
                             max_iterations: int = 30, tolerance: float = 1e-7,
                             normal_agreement: float = 0.5) -> list[IcpResult]:
    """Many ICP problems against ONE target, advanced in lockstep (the verification step's
    candidates of one scene).

    The same iteration, stopping rule and result as :func:`icp_point_to_plane` for each source.
    On the GPU the whole loop runs on the device (:mod:`._icp_gpu`: per iteration one launch
    pairs every source point and sums the normal equations per problem, one solves the 6x6
    systems and updates the poses; the host looks at the active flags every few iterations and
    fetches the results once). On the CPU the problems advance in lockstep too, each iteration
    pairing the active ones in parallel (:func:`._icp_cpu.icp_normal_equations_batch`; each
    problem's sums, steps and stopping those of :func:`icp_point_to_plane`, bit for bit). ``index``
    is the target's ``_SceneIndex`` (cell = ``max_correspondence_distance``).
    """
    r = float(max_correspondence_distance)
    B = len(sources)
    if len(inits) != B or (source_normals is not None and len(source_normals) != B):
        raise InputError("sources, inits and source_normals must have the same length")
    if index.normals is None:
        raise InputError("target_normals are required for point-to-plane ICP")
    if B == 0:
        return []
    cpu_cells = index.device != "gpu" and abs(index.cell - r) <= 1e-12 * max(r, 1) and index.cells_hold(r)
    if index.device != "gpu" and not cpu_cells:
        return [icp_point_to_plane(s, None, None, init=T, source_normals=None if source_normals is None
                                   else source_normals[b], max_correspondence_distance=r,
                                   max_iterations=max_iterations, tolerance=tolerance,
                                   normal_agreement=normal_agreement, _target_index=index)
                for b, (s, T) in enumerate(zip(sources, inits))]
    srcs = [points(to_numpy(s), f"sources[{b}]", finite=False, dtype=np.float64)
            for b, s in enumerate(sources)]
    sns = None
    if source_normals is not None:
        sns = [points(to_numpy(x), f"source_normals[{b}]", finite=False, dtype=np.float64, rows=len(srcs[b]))
               for b, x in enumerate(source_normals)]
    T = np.stack([np.array(to_numpy(t), np.float64) for t in inits])
    if T.shape != (B, 4, 4) or not np.isfinite(T).all():
        raise InputError("every init must be a finite 4x4 matrix")
    if cpu_cells:
        P, rm, ft, its, cv = _icp_cpu_batch(srcs, sns, T, index, r, max_iterations, tolerance, normal_agreement)
    else:
        from ._icp_gpu import icp_batch

        P, rm, ft, its, cv = icp_batch(srcs, sns, T, index, r, max_iterations, tolerance, normal_agreement)
    return [IcpResult(P[b], float(rm[b]), float(ft[b]), int(its[b]), bool(cv[b])) for b in range(B)]
