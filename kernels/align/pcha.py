"""Parametric chamfer alignment (PChA) with Levenberg-Marquardt, on the CPU and the GPU.

Objective (Elliethy & Sharma, eq. 1-3): ``f(alpha) = sum_j rho(|| mu(T_alpha(p_j)) - T_alpha(p_j) ||)``
with ``mu`` the reference point nearest to the transformed observed point, read from an exact
Euclidean distance-transform table (:mod:`scanforest.kernels.align.edt`) and ``rho(e) = e^2`` (``loss="l2"``,
the paper) or the Huber function ``rho(e) = e^2`` for ``e <= delta`` and ``2 delta e - delta^2``
beyond (``loss="huber"``, beyond the paper, minimised by IRLS weights ``w = min(1, delta / e)``).

Levenberg-Marquardt exactly as the paper's Algorithm 3 (pipelined form):

* step ``(H + lambda I) delta = -g`` with ``g = -2 sum_j J_j^T w_j r_j`` and ``H = sum_j w_j J_j^T J_j``
  (eq. 4-7). ``scaling="consistent"`` (default) uses ``-g / 2`` on the right-hand side, i.e. the
  Gauss-Newton step at ``lambda -> 0``; ``scaling="paper"`` uses eq. 4 literally (twice the
  Gauss-Newton step at ``lambda -> 0``; the damping absorbs it, at the cost of more rejections).
* candidate ``alpha + delta`` (additive models) or ``M_delta @ M_t`` (projective, eq. 12-14);
  ``f``, ``g`` and ``H`` are evaluated at the candidate in one pass (one fused GPU kernel);
* accept only on a strict decrease of ``f``: ``lambda /= 10`` and keep the candidate's ``g``, ``H``;
  otherwise ``lambda *= 10`` and keep the current ones. The iteration counter counts both.
* stop when ``||delta||_2 <= xtol`` (the paper's epsilon), when an accepted step decreases ``f``
  by less than ``ftol * f`` (relative), when ``f == 0``, or after ``max_iter`` iterations.

Defaults the paper leaves open: ``lambda_0 = lambda0 * mean(diag(H(alpha_0)))`` with
``lambda0 = 1e-3``, and lambda kept within ``LAMBDA_RANGE`` x that unit; ``xtol = 1e-6``
(parameters live in the normalised frame, unit RMS radius, so this is an absolute step of about
1e-6 radius or radian); ``ftol = 1e-5`` (1e-6 gave the same final errors on the synthetic
problems with 10-40 % more iterations); ``max_iter = 100`` per model stage; the L x L system is
solved with LAPACK (``numpy.linalg.solve``, least squares if singular). ``scaling="paper"`` is
the default: on the synthetic problems the paper's literal step (twice Gauss-Newton at small
lambda) converged in fewer iterations than the consistent one and no less accurately (3-D rigid,
20k points, 4 problems: 31-44 vs 55-74 iterations; 3-D affine: 68-95 vs 100, the cap; 2-D
similarity: 10 vs 19-23), an over-relaxation that counters the slow, ICP-like progress of a
point-to-point objective.

Lookup (``lookup=``): ``"corners"`` (default) takes, for each transformed point, the nearest of
the table entries of the 2^d grid cells around it, which makes ``f`` the continuous minimum over
candidate reference locations; ``"cell"`` is the paper's single lookup of the cell containing
the point, whose ``f`` jumps at cell borders (not at Voronoi borders) and stalls LM early: on
the synthetic 3-D problems it left 3-4x larger final errors (see ``scanforest bench align
--convergence``). Residuals are always ``mu - x'`` with the continuous ``x'`` (no interpolation
of a distance).

Points leaving the grid (``outside=``): ``"clamp"`` (default) clamps the cell index to the
border and uses the border cell's nearest reference point with the *true* location, so the
residual includes the distance outside the grid and the objective stays well defined;
``"drop"`` skips them as the paper does (they add nothing to f, g, H) and the result reports how
many were dropped (``n_dropped``). With ``"drop"``, f can fall just because points leave the grid.

Initialisation (``init=``): LM on a chamfer objective only finds the minimum of the basin it
starts in, and the grid covers the reference plus a margin of a quarter of its extent. Two scans
of one object in unrelated frames (a scan rotated about the sensor origin, a copy moved by a
tenth of its size) start with most observed points outside that margin at the identity: there
the objective only pulls points towards the border (``outside="clamp"``) or ignores them
(``"drop"``, and then ``"no_inliers"``). ``init="centroids"`` starts from the translation that
puts the observed centroid on the reference centroid, which removes the translation of a rigid
copy exactly and leaves only the rotation about the centroid to LM (PCL's milk carton and Kinect
scenes turned by 30 degrees come back to within 0.01 degree, in metres and in millimetres alike;
the carton up to 60 degrees; at 90 degrees LM can stop in another minimum). It is not
the default of the kernel: when only part of the reference is observed (a scene crop against a
model), the centroids differ and the caller's pose (``init=`` matrix, the identity) is better.

Everything runs in the grid's normalised frame (reference centroid, RMS radius); the result is
converted back to the input frame.

The tuning parameters (LM controls, loss, lookup, GPU kernel form, ...) are one frozen
:class:`PChAParams` (``params=``, shared with the GPU evaluator); each may also be given as a
keyword of :func:`align` / :func:`align_batch`, overriding the object's value.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .. import validation
from ..backend import resolve_device, to_numpy
from ..errors import InputError
from . import transforms as T
from ._pcha_common import PChAParams, resolve_params
from .edt import DistanceGrid, distance_transform

__all__ = ["AlignResult", "PChAParams", "align", "align_batch", "cpu_evaluate", "reference_evaluate",
           "synthetic_problem", "random_transform", "point_error"]

LOSSES = ("l2", "huber")
#: lambda is kept in [1e-6, 1e8] x mean(diag(H(alpha_0))): the /10 on acceptance would otherwise
#: underflow after long runs of acceptances and need dozens of rejections to recover; past the
#: upper bound the step is far below any tolerance and the run counts as converged.
LAMBDA_RANGE = (1e-6, 1e8)
OUTSIDE = ("clamp", "drop")
LOOKUPS = ("corners", "cell")
INITS = ("identity", "centroids")


@dataclass
class AlignResult:
    """Result of one alignment.

    Attributes
    ----------
    transform : ndarray (d+1, d+1)
        Homogeneous matrix mapping observed points onto the reference (input frame).
    params : ndarray (L,)
        Parameters of ``model`` in the input frame (see :mod:`scanforest.kernels.align.transforms`).
    model : str
    history : ndarray
        Objective ``f`` (input units squared) at the current estimate after each iteration;
        ``history[0]`` is ``f`` at the initial transform. Non-increasing by construction.
    status : str
        ``"converged"`` (small step or small relative decrease), ``"max_iter"``,
        ``"no_inliers"`` (fewer than L points inside the grid) or ``"invalid"`` (non-finite f).
    iterations, accepted : int
        LM iterations (accepted + rejected) and accepted ones.
    n_points, n_inliers, n_dropped : int
        Observed points, points inside the grid at the solution, points dropped
        (``outside="drop"``; 0 with ``"clamp"``).
    objective, rmse : float
        Final ``f`` and ``sqrt(f / n_used)`` (input units).
    """

    transform: np.ndarray
    params: np.ndarray
    model: str
    history: np.ndarray
    status: str
    iterations: int
    accepted: int
    n_points: int
    n_inliers: int
    n_dropped: int
    objective: float
    rmse: float
    device: str
    huber_delta: float | None = None
    stages: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def converged(self) -> bool:
        return self.status == "converged"

    def to_dict(self) -> dict:
        return {
            "model": self.model, "transform": self.transform.tolist(),
            "params": self.params.tolist(), "status": self.status,
            "iterations": self.iterations, "accepted": self.accepted,
            "n_points": self.n_points, "n_inliers": self.n_inliers, "n_dropped": self.n_dropped,
            "objective": self.objective, "rmse": self.rmse, "history": self.history.tolist(),
            "device": self.device, "huber_delta": self.huber_delta, "seconds": self.seconds,
            "stages": list(self.stages),
        }


# ----------------------------------------------------------------------------- CPU kernel
def _numba():
    import numba

    from ..jit import install_compile_lock

    install_compile_lock()  # one compilation across processes (the jit module's doc)
    return numba


_CPU_KERNELS = {}
#: below this many points the serial numba kernel is used (thread-pool dispatch costs more)
SERIAL_BELOW = 4096


def _cpu_kernel(parallel: bool = True):
    if parallel in _CPU_KERNELS:
        return _CPU_KERNELS[parallel]
    numba = _numba()

    def accumulate(X, M, index, cent, origin, inv_cell, shape, proj, drop, huber, delta, nchunks,
                   corners):
        N, d = X.shape
        d1 = d + 1
        L = 8
        if proj:
            nv = 2 + L + L * (L + 1) // 2
        else:
            nv = 2 + d * d1 + d1 * (d1 + 1) // 2
        out = np.zeros((nchunks, nv))
        for c in numba.prange(nchunks):
            lo = c * N // nchunks
            hi = (c + 1) * N // nchunks
            acc = np.zeros(nv)
            xp = np.empty(d)
            r = np.empty(d)
            q = np.empty(d1)
            J0 = np.empty(L)
            J1 = np.empty(L)
            lo3 = np.zeros(d, np.int64)
            for j in range(lo, hi):
                for a in range(d):
                    s = M[a, d]
                    for b in range(d):
                        s += M[a, b] * X[j, b]
                    xp[a] = s
                if proj:
                    w = M[d, d]
                    for b in range(d):
                        w += M[d, b] * X[j, b]
                    for a in range(d):
                        xp[a] /= w
                inside = True
                flat = 0
                for a in range(d):
                    u = np.floor((xp[a] - origin[a]) * inv_cell + 0.5)
                    if not (u >= 0.0):
                        inside = False
                        iu = 0
                    elif u > shape[a] - 1:
                        inside = False
                        iu = shape[a] - 1
                    else:
                        iu = int(u)
                    flat = flat * shape[a] + iu
                if drop and not inside:
                    continue
                e2 = 0.0
                if not corners:
                    cid = index[flat]
                    for a in range(d):
                        r[a] = cent[cid, a] - xp[a]
                        e2 += r[a] * r[a]
                else:
                    # nearest of the entries of the 2^d cells around x (continuous objective)
                    for a in range(d):
                        u = np.floor((xp[a] - origin[a]) * inv_cell)
                        if not (u >= 0.0):
                            lo3[a] = 0
                        elif u > shape[a] - 2:
                            lo3[a] = shape[a] - 2
                        else:
                            lo3[a] = int(u)
                    e2 = np.inf
                    for corner in range(1 << d):
                        fl = 0
                        for a in range(d):
                            fl = fl * shape[a] + lo3[a] + ((corner >> a) & 1)
                        cid = index[fl]
                        s2 = 0.0
                        for a in range(d):
                            t = cent[cid, a] - xp[a]
                            s2 += t * t
                        if s2 < e2:
                            e2 = s2
                            for a in range(d):
                                r[a] = cent[cid, a] - xp[a]
                wgt = 1.0
                fj = e2
                if huber:
                    e = np.sqrt(e2)
                    if e > delta:
                        wgt = delta / e
                        fj = 2.0 * delta * e - delta * delta
                acc[0] += fj
                if inside:
                    acc[1] += 1.0
                k = 2
                if not proj:
                    for a in range(d):
                        q[a] = X[j, a]
                    q[d] = 1.0
                    for a in range(d):
                        for m in range(d1):
                            acc[k] += wgt * r[a] * q[m]
                            k += 1
                    for m in range(d1):
                        for n in range(m, d1):
                            acc[k] += wgt * q[m] * q[n]
                            k += 1
                else:
                    x0 = xp[0]
                    y0 = xp[1]
                    J0[0] = x0; J0[1] = y0; J0[2] = 1.0; J0[3] = 0.0; J0[4] = 0.0; J0[5] = 0.0
                    J0[6] = -x0 * x0; J0[7] = -x0 * y0
                    J1[0] = 0.0; J1[1] = 0.0; J1[2] = 0.0; J1[3] = x0; J1[4] = y0; J1[5] = 1.0
                    J1[6] = -x0 * y0; J1[7] = -y0 * y0
                    for l in range(L):
                        acc[k] += wgt * (J0[l] * r[0] + J1[l] * r[1])
                        k += 1
                    for l in range(L):
                        for m in range(l, L):
                            acc[k] += wgt * (J0[l] * J0[m] + J1[l] * J1[m])
                            k += 1
            for v in range(nv):
                out[c, v] = acc[v]
        return out.sum(axis=0)

    # distinct names so numba's on-disk cache keeps the two variants apart
    import types

    name = "accumulate_parallel" if parallel else "accumulate_serial"
    fn = types.FunctionType(accumulate.__code__, accumulate.__globals__, name,
                            accumulate.__defaults__, accumulate.__closure__)
    fn.__qualname__ = name
    _CPU_KERNELS[parallel] = numba.njit(parallel=parallel, cache=True, fastmath=False)(fn)
    return _CPU_KERNELS[parallel]


def gpu_evaluator(model, grid, points, params: PChAParams | None = None, **overrides):
    """The GPU evaluator of the objective, :class:`CpuEvaluator`'s twin (the GPU backend's
    ``GpuEvaluator``: ``grid`` a distance grid on the GPU, ``points`` the observed point sets),
    for benchmarks that time one evaluation and its kernel (``kernel_ms``); :func:`align` makes
    its own."""
    from ._pcha_gpu import GpuEvaluator

    return GpuEvaluator(model, grid, points, params, **overrides)


class CpuEvaluator:
    """CPU twin of :class:`scanforest.kernels.align._pcha_gpu.GpuEvaluator` (numba, all cores,
    float64 accumulation)."""

    def __init__(self, model, grid: DistanceGrid, points, params: PChAParams | None = None, **overrides):
        params = resolve_params(params, overrides, "CpuEvaluator")
        self.model = model
        self.corners = params.lookup == "corners"
        self.pts = [np.ascontiguousarray(to_numpy(p), dtype=np.float64) for p in points]
        self.index = np.ascontiguousarray(to_numpy(grid.index), dtype=np.int32).reshape(-1)
        self.cent = np.ascontiguousarray(to_numpy(grid.centroids), dtype=np.float32)
        self.origin = np.asarray(grid.origin, np.float64)
        self.inv_cell = 1.0 / grid.cell
        self.shape = np.asarray(grid.shape, np.int64)
        self.drop = params.outside == "drop"
        self.huber = params.loss == "huber"
        self.B = len(points)
        self.sizes = np.asarray([len(p) for p in self.pts])

    def raw(self, M, D, active, huber_delta):
        from numba import get_num_threads

        from ._pcha_gpu import n_values

        reduced = not self.model.compositional
        nv = n_values(self.model, reduced)
        vals = np.zeros((self.B, nv))
        for b in range(self.B):
            if not active[b]:
                continue
            X = self.pts[b]
            serial = len(X) < SERIAL_BELOW
            nch = 1 if serial else int(max(1, min(len(X) // 1024, 4 * get_num_threads())))
            vals[b] = _cpu_kernel(not serial)(X, M[b], self.index, self.cent, self.origin, self.inv_cell, self.shape,
                                  self.model.compositional, self.drop, self.huber,
                                  float(huber_delta[b]), nch, self.corners)
        return vals

    def __call__(self, params, active, huber_delta):
        from ._pcha_gpu import host_terms, unpack

        M, D = host_terms(self.model, params)
        return unpack(self.model, D, self.raw(M, D, active, huber_delta),
                      not self.model.compositional)


def cpu_evaluate(model, grid, points_n, params, *, outside="clamp", loss="l2", huber_delta=1.0,
                 lookup="corners"):
    """``(f, g, H, n_inside)`` of one alignment on the CPU (normalised frame)."""
    m = T.get_model(model, grid.dim)
    ev = CpuEvaluator(m, grid, [points_n], PChAParams(outside=outside, loss=loss, lookup=lookup))
    f, g, H, nin = ev(np.asarray(params, np.float64)[None], np.ones(1, bool),
                      np.asarray([huber_delta], np.float64))
    return f[0], g[0], H[0], nin[0]


def reference_evaluate(model, grid, points_n, params, *, outside="clamp", loss="l2",
                       huber_delta=1.0, lookup="corners"):
    """Independent float64 numpy reference of ``(f, g, H, n_inside)`` (eq. 1-7 with the
    explicit per-point Jacobians of :func:`scanforest.kernels.align.transforms.increment_jacobian`)."""
    m = T.get_model(model, grid.dim)
    X = np.asarray(to_numpy(points_n), np.float64)
    Mx = T.to_matrix(m, params)
    Xp = T.apply(Mx, X)
    mu, inside = grid.lookup(Xp, mode=lookup)
    keep = inside if outside == "drop" else np.ones(len(X), bool)
    r = (mu - Xp)[keep]
    J = T.increment_jacobian(m, params, X)[keep]
    e = np.linalg.norm(r, axis=1)
    if loss == "huber":
        w = np.where(e > huber_delta, huber_delta / np.maximum(e, 1e-300), 1.0)
        fj = np.where(e > huber_delta, 2 * huber_delta * e - huber_delta ** 2, e ** 2)
    else:
        w = np.ones_like(e)
        fj = e ** 2
    g = -2.0 * np.einsum("n,ncl,nc->l", w, J, r)
    H = np.einsum("n,nck,ncl->kl", w, J, J)
    return fj.sum(), g, H, float(inside.sum())


# ----------------------------------------------------------------------------- LM driver
def _lm(evaluate, model, P0, delta, params: PChAParams, *, min_points):
    """Batched LM (Algorithm 3): every alignment has its own lambda, state and stop flag; one
    evaluation (one kernel launch on the GPU) per iteration serves all active alignments.
    ``params``: ``max_iter``, ``xtol``, ``ftol``, ``lambda0`` and ``scaling``."""
    max_iter, xtol, ftol = int(params.max_iter), params.xtol, params.ftol
    B, L = P0.shape
    P = P0.copy()
    active = np.ones(B, bool)
    f, g, H, nin = evaluate(P, active, delta)
    diag = np.einsum("bkk->bk", H).mean(1)
    lam_unit = np.where(diag > 0, diag, 1.0)
    lam = params.lambda0 * lam_unit
    lam_lo, lam_hi = LAMBDA_RANGE[0] * lam_unit, LAMBDA_RANGE[1] * lam_unit
    hist = [[float(v)] for v in f]
    status = ["running"] * B
    iters = np.zeros(B, int)
    acc_n = np.zeros(B, int)
    for b in range(B):
        if not np.isfinite(f[b]):
            status[b], active[b] = "invalid", False
        elif nin[b] < min_points and f[b] > 0:
            status[b], active[b] = "no_inliers", False
        elif f[b] == 0:
            status[b], active[b] = "converged", False
    eye = np.eye(L)
    rhs_scale = 1.0 if params.scaling == "paper" else 0.5
    hist_arr = np.full((max_iter + 1, B), np.nan)
    hist_arr[0] = f
    it = 0
    while active.any():
        # every active alignment has done the same number of iterations (they start together)
        idx = np.flatnonzero(active)
        A = H[idx] + lam[idx, None, None] * eye
        rhs = -rhs_scale * g[idx]
        try:
            step = np.linalg.solve(A, rhs[..., None])[..., 0]
        except np.linalg.LinAlgError:
            step = np.stack([np.linalg.lstsq(A[i], rhs[i], rcond=None)[0] for i in range(len(idx))])
        cand = P.copy()
        cand[idx] = T.update(model, P[idx], step)
        fn, gn, Hn, ninn = evaluate(cand, active, delta)
        it += 1
        iters[idx] = it
        f_old = f[idx]
        ok = np.isfinite(fn[idx]) & (fn[idx] < f_old) & np.all(np.isfinite(cand[idx]), axis=1)
        acc = idx[ok]
        rej = idx[~ok]
        P[acc], f[acc], g[acc], H[acc], nin[acc] = cand[acc], fn[acc], gn[acc], Hn[acc], ninn[acc]
        lam[acc] = np.maximum(lam[acc] / 10.0, lam_lo[acc])
        acc_n[acc] += 1
        lam[rej] *= 10.0
        hist_arr[it, idx] = f[idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(f_old > 0, (f_old - f[idx]) / f_old, 0.0)
        conv = (ok & ((rel <= ftol) | (f[idx] == 0))) | (~ok & (lam[idx] > lam_hi[idx]))
        conv |= np.sqrt((step ** 2).sum(1)) <= xtol
        capped = ~conv & (it >= max_iter)
        for b in idx[conv]:
            status[b] = "converged"
        for b in idx[capped]:
            status[b] = "max_iter"
        active[idx[conv | capped]] = False
    hist = [list(hist_arr[: iters[b] + 1, b]) for b in range(B)]
    return P, f, nin, hist, status, iters, acc_n


# ----------------------------------------------------------------------------- public API
def _init_matrix(init, m, observed, grid):
    d = m.dim
    if init is None or (isinstance(init, str) and init == "identity"):
        return np.eye(d + 1)
    if isinstance(init, str):
        if init != "centroids":
            raise InputError(f"init must be one of {INITS}, a ({d + 1}, {d + 1}) matrix or "
                             f"{m.n_params} parameters of model {m.name!r}, got {init!r}")
        M = np.eye(d + 1)
        M[:d, d] = grid.extra.get("centroid", grid.center) - to_numpy(observed.mean(0))
        return M
    a = np.asarray(init, np.float64)
    if not np.all(np.isfinite(a)):
        raise InputError("init contains NaN or inf")
    if a.shape == (d + 1, d + 1):
        if abs(np.linalg.det(a[:d, :d])) < 1e-12 * max(1.0, float(np.abs(a[:d, :d]).max()) ** d):
            raise InputError(f"init's {d}x{d} linear part is singular (determinant ~0): not a transform of model "
                             f"{m.name!r}")
        return a
    if a.shape == (m.n_params,):
        return T.to_matrix(m, a)
    raise InputError(f"init must be a ({d + 1}, {d + 1}) matrix or {m.n_params} parameters of "
                     f"model {m.name!r}, got shape {a.shape}")


def _number(name: str, v, *, positive: bool) -> None:
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    if not ok or not np.isfinite(float(v)) or (float(v) <= 0 if positive else float(v) < 0):
        raise InputError(f"{name} must be a {'positive' if positive else 'non-negative'} finite number, got {v!r}")


def _validate(p: PChAParams):
    if p.loss not in LOSSES:
        raise InputError(f"loss must be one of {LOSSES}, got {p.loss!r}")
    if p.outside not in OUTSIDE:
        raise InputError(f"outside must be one of {OUTSIDE}, got {p.outside!r}")
    if p.scaling not in ("consistent", "paper"):
        raise InputError(f"scaling must be 'consistent' or 'paper', got {p.scaling!r}")
    validation.integer(p.max_iter, "max_iter")
    # the solver's numbers (a negative damping ran and reported convergence at twice the error)
    _number("xtol", p.xtol, positive=False)
    _number("ftol", p.ftol, positive=False)
    _number("lambda0", p.lambda0, positive=True)
    if p.huber_delta is not None:
        _number("huber_delta", p.huber_delta, positive=True)
    validation.integer(p.resolution, "resolution", minimum=2, none=True)  # cells along the longest side
    if p.form not in ("fused", "two_kernel"):
        raise InputError(f"form must be 'fused' or 'two_kernel', got {p.form!r}")
    if p.hessian not in ("reduced", "full"):
        raise InputError(f"hessian must be 'reduced' or 'full', got {p.hessian!r}")


def align(observed, reference, model: str = "rigid", *, params: PChAParams | None = None, init=None,
          grid: DistanceGrid | None = None, device: str = "auto", **overrides) -> AlignResult:
    """Align ``observed`` points onto ``reference`` points with a parametric model (PChA).

    Parameters
    ----------
    observed : array (N, d)
        Points to move (numpy or CuPy), d = 2 or 3.
    reference : array (Nq, d) or None
        Reference points; may be None when ``grid`` is given.
    model : str
        2-D: ``euclidean`` (alias ``rigid``), ``similarity``, ``affine``, ``projective``;
        3-D: ``rigid`` (alias ``euclidean``), ``similarity``, ``affine``.
    init : array or str, optional
        Initial transform, a ``(d+1, d+1)`` matrix or a parameter vector; ``"identity"`` (the
        default, for poses that are already close, e.g. refinement of a recognition hypothesis)
        or ``"centroids"`` (the translation moving the observed centroid onto the reference
        centroid: two scans of one object in unrelated frames, see the module docstring).
    params : PChAParams, optional
        The tuning parameters below, as one object (default ``PChAParams()``: the defaults
        listed here). Each of them may also be given as a keyword (``max_iter=50``), which
        overrides its value in ``params``.
    grid : DistanceGrid, optional
        Precomputed distance-transform table of the reference (the paper precomputes it; reuse
        it across alignments). Built with :func:`scanforest.kernels.align.edt.distance_transform`
        otherwise (``resolution`` passed through).
    device : {"auto", "cpu", "gpu"}

    Other Parameters
    ----------------
    The tuning parameters: fields of :class:`PChAParams` (``params=``), or keywords.

    chain : bool
        Run the coarse-to-fine chain of models ending at ``model`` (paper P:466), each stage
        initialised by the previous one; ``history`` concatenates the stages.
    max_iter, xtol, ftol, lambda0, scaling :
        LM controls (module docstring).
    loss : {"l2", "huber"}
    huber_delta : float, optional
        Huber threshold in input units; default: the median residual norm at the initial
        transform, at least 2 grid cells (fixed for the run, so the objective is well defined).
    outside : {"clamp", "drop"}
        Treatment of points that leave the grid (module docstring).
    form : {"fused", "two_kernel"}
        GPU kernel form (the CPU has one form). ``hessian="full"`` makes the fused kernel build
        per-point Jacobians instead of the reduced statistics.
    lookup : {"corners", "cell"}
        Nearest entry of the 2^d surrounding cells (default) or the paper's single cell.
    resolution : int, optional
        Cells along the longest side of the distance transform built when ``grid`` is None.

    Returns
    -------
    AlignResult
    """
    params = resolve_params(params, overrides, "align")
    return align_batch([observed], reference, model, params=params, init=None if init is None else [init],
                       grid=grid, device=device)[0]


def align_batch(observed, reference, model: str = "rigid", *, params: PChAParams | None = None, init=None,
                grid: DistanceGrid | None = None, device: str = "auto", **overrides) -> list[AlignResult]:
    """Many alignments against ONE reference, advanced in lockstep: every LM iteration is one
    launch for all still-active alignments (``blockIdx.y`` = alignment on the GPU), so small
    point sets still fill the GPU. ``observed`` is a list of ``(N_b, d)`` arrays or a
    ``(B, N, d)`` array; ``init`` a list of B initial transforms (or None, or one of
    ``"identity"``, ``"centroids"`` for all). Other parameters (``params`` and its keyword
    overrides) as :func:`align`."""
    t0 = time.perf_counter()
    p = resolve_params(params, overrides, "align_batch")
    if observed is None:
        raise InputError("observed is None")
    if not isinstance(observed, (list, tuple)):
        arr = observed
        if getattr(arr, "ndim", None) == 3:
            observed = [arr[i] for i in range(arr.shape[0])]
        else:
            observed = [arr]
    if len(observed) == 0:
        raise InputError("observed is an empty batch")
    obs = [validation.points(o, f"observed[{i}]" if len(observed) > 1 else "observed", dims=(2, 3),
                             dtype=np.float64) for i, o in enumerate(observed)]
    d = obs[0].shape[1]
    if any(o.shape[1] != d for o in obs):
        raise InputError("all observed clouds of a batch must have the same dimension")
    _validate(p)
    if p.lookup not in LOOKUPS:
        raise InputError(f"lookup must be one of {LOOKUPS}, got {p.lookup!r}")
    m = T.get_model(model, d)
    if grid is None:
        if reference is None:
            raise InputError("give a reference point set or a precomputed grid")
        ref = validation.points(reference, "reference", dims=(2, 3), dtype=None)
        if ref.shape[1] != d:
            raise InputError(f"observed points are {d}-D but reference points are {ref.shape[1]}-D")
    dev = resolve_device(device, *obs, *([] if reference is None else [reference]))
    if grid is None:
        grid = distance_transform(reference, resolution=p.resolution, device=dev)
    elif grid.dim != d:
        raise InputError(f"grid is {grid.dim}-D but observed points are {d}-D")
    if grid.device != dev:
        grid = grid.to(dev)
    B = len(obs)
    if init is None or isinstance(init, str):
        inits = [init] * B
    else:
        inits = list(init)
        if len(inits) != B:
            raise InputError(f"init has {len(inits)} entries for {B} observed clouds")
    M0 = np.stack([_init_matrix(i, m, o, grid) for i, o in zip(inits, obs)])
    c, s = grid.center, grid.scale
    Mn = np.stack([T.conjugate(M, c, s) for M in M0])
    if dev == "gpu":
        import cupy as cp

        obs_n = [(cp.asarray(o, dtype=cp.float64) - cp.asarray(c)) / s for o in obs]
    else:
        obs_n = [(np.asarray(o, np.float64) - c) / s for o in obs]

    stages = T.chain(m, d) if p.chain else [m]
    hist_all = [[] for _ in range(B)]
    stage_info = [[] for _ in range(B)]
    delta_n = None
    for st in stages:
        P0 = T.from_matrix(st, Mn)
        if p.loss == "huber" and delta_n is None:
            delta_n = (np.full(B, p.huber_delta / s) if p.huber_delta is not None
                       else _default_delta(grid, obs_n, Mn, p.lookup))
        dl = delta_n if delta_n is not None else np.ones(B)
        if dev == "gpu":
            from ._pcha_gpu import GpuEvaluator

            ev = GpuEvaluator(st, grid, obs_n, p)
        else:
            ev = CpuEvaluator(st, grid, obs_n, p)
        P, f, nin, hist, status, iters, accn = _lm(ev, st, P0, dl, p, min_points=st.n_params)
        Mn = T.to_matrix(st, P)
        for b in range(B):
            stage_info[b].append({"model": st.name, "status": status[b],
                                  "iterations": int(iters[b]), "accepted": int(accn[b]),
                                  "objective": float(f[b] * s * s)})
            # a later stage starts where the previous one ended: do not repeat that value
            hist_all[b].extend(hist[b] if not hist_all[b] else hist[b][1:])
    elapsed = time.perf_counter() - t0
    results = []
    for b in range(B):
        Mraw = T.unconjugate(Mn[b], c, s)
        n = int(obs[b].shape[0])
        nin_b = int(round(nin[b]))
        used = nin_b if p.outside == "drop" else n
        fb = float(f[b] * s * s)
        last = stage_info[b][-1]
        results.append(AlignResult(
            transform=Mraw, params=T.from_matrix(m, Mraw), model=m.name,
            history=np.asarray(hist_all[b]) * s * s, status=last["status"],
            iterations=sum(x["iterations"] for x in stage_info[b]),
            accepted=sum(x["accepted"] for x in stage_info[b]), n_points=n, n_inliers=nin_b,
            n_dropped=(n - nin_b) if p.outside == "drop" else 0, objective=fb,
            rmse=float(np.sqrt(fb / used)) if used > 0 else float("nan"), device=dev,
            huber_delta=None if delta_n is None else float(delta_n[b] * s),
            stages=stage_info[b] if p.chain else [], seconds=elapsed))
    return results


def _default_delta(grid, obs_n, Mn, lookup="corners", sample=20000):
    """Median residual norm at the initial transform (at least 2 cells), per alignment."""
    out = np.empty(len(obs_n))
    for b, X in enumerate(obs_n):
        Xs = to_numpy(X[:: max(1, X.shape[0] // sample)])
        Xp = T.apply(Mn[b], Xs)
        mu, _ = grid.lookup(Xp, mode=lookup)
        e = np.linalg.norm(mu - Xp, axis=1)
        out[b] = max(float(np.median(e)), 2 * grid.cell)
    return out


# ----------------------------------------------------------------------------- synthetic data
def _sample_shape(dim: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Points on a fixed asymmetric shape: a 2-D "road network" of segments and an arc, or a
    bumpy 3-D ellipsoid surface (same shape for every call; ``rng`` only draws the samples)."""
    if dim == 2:
        segs = np.array([[-1.0, -0.8, 0.9, -0.6], [-0.7, -1.0, -0.5, 0.9], [0.2, -0.9, 0.4, 1.0],
                         [-1.0, 0.3, 1.0, 0.5], [0.5, 0.2, 1.0, -0.4], [-0.9, 0.9, -0.2, 0.6]])
        k = rng.integers(0, len(segs) + 1, n)
        t = rng.random(n)
        out = np.empty((n, 2))
        seg = k < len(segs)
        a = segs[k[seg]]
        out[seg] = a[:, :2] + t[seg, None] * (a[:, 2:] - a[:, :2])
        th = 0.2 + 2.5 * t[~seg]
        out[~seg] = np.stack([0.3 + 0.35 * np.cos(th), -0.2 + 0.25 * np.sin(th)], 1)
        return out
    v = rng.normal(size=(n, 3))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    r = 1 + 0.3 * np.sin(3 * v[:, 0]) * np.cos(2 * v[:, 1]) + 0.2 * v[:, 2] ** 2 + 0.15 * v[:, 0] * v[:, 1]
    return v * r[:, None] * np.array([1.0, 0.6, 0.4])


def random_transform(model, level: float, rng: np.random.Generator) -> np.ndarray:
    """A random transform of ``model`` at error ``level`` (1.0 = rotations up to 20 deg,
    translations up to 0.2, scale changes up to 10 %, affine/projective distortions up to 0.1 /
    0.05), as a homogeneous matrix. Signs are random, magnitudes ``level * [0.5, 1]`` of the cap."""
    m = model
    d = m.dim

    def mag(cap, size=None):
        return level * cap * rng.uniform(0.5, 1.0, size) * rng.choice([-1.0, 1.0], size)

    M = np.eye(d + 1)
    nang = 1 if d == 2 else 3
    ang = mag(np.deg2rad(20), nang)
    R = T._rot2(ang[0]) if d == 2 else T._rot3(ang)
    t = mag(0.2, d)
    s = 1.0 + (mag(0.1) if m.name in ("similarity", "affine", "projective") else 0.0)
    A = s * R
    if m.name in ("affine", "projective"):
        A = A @ (np.eye(d) + mag(0.1, (d, d)))
    M[:d, :d] = A
    M[:d, d] = t
    if m.name == "projective":
        M[d, :d] = mag(0.05, d)
    return M


def synthetic_problem(model: str, dim: int, n_observed: int, *, n_reference: int | None = None,
                      level: float = 0.5, noise: float = 0.0, seed: int = 0):
    """``(observed, reference, M_true)`` for benchmarks and tests: reference and observed are
    independent samples of one shape (:func:`_sample_shape`), the observed ones moved by the
    inverse of a random transform at error ``level``, so ``M_true`` maps observed onto reference.
    """
    rng = np.random.default_rng(seed)
    m = T.get_model(model, dim)
    nq = n_reference or max(2000, n_observed // 4)
    ref = _sample_shape(dim, nq, rng)
    M = random_transform(m, level, rng)
    obs = T.apply(np.linalg.inv(M), _sample_shape(dim, n_observed, rng))
    if noise:
        obs = obs + rng.normal(scale=noise, size=obs.shape)
    return obs, ref, M


def point_error(M_est, M_true, points, radius: float = 1.0) -> float:
    """RMS distance between the two transforms' images of ``points`` over ``radius``."""
    a = T.apply(M_est, points)
    b = T.apply(M_true, points)
    return float(np.sqrt(((a - b) ** 2).sum(1).mean()) / radius)
