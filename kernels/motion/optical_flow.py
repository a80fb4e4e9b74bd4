"""Dense optical flow from sparse tracks, the GPU-tailored way (Kim, Hwangbo & Kanade, ECV 2009).

The paper reformulates dense flow as per-pixel *hypothesis generation* from features tracked in
advance plus *change detection* against the second image, so that every pixel is an
independent, single-path computation. Both of its methods are implemented, on the CPU (numba,
all cores) and on the GPU (CuPy RawKernels, :mod:`scanforest.kernels.motion._optical_flow_gpu`), with the
same signature and semantics.

Tracked features
    ``f_i``: position ``(x_i, y_i)`` in ``I0``, colour ``c_i = I0(x_i, y_i)`` (bilinear) and
    flow ``(u_i, v_i) = (x'_i - x_i, y'_i - y_i)``. Tracks are caller-given point pairs
    (``(M, 4)`` arrays ``x0, y0, x1, y1`` or a pair of ``(M, 2)`` arrays) or, with
    ``tracks=None`` (or ``None`` for some pairs of a list), KLT tracks: Shi-Tomasi corners,
    pyramidal Lucas-Kanade and a forward-backward check. ``tracker="builtin"`` (default) runs
    :mod:`scanforest.kernels.motion.tracking` on the device of the flow - on the GPU the
    frames are uploaded once and serve tracking and the flow kernels, and only the tracks
    (a few KB per pair, needed on the host for the DFS bounds) come back; ``tracker="opencv"``
    is the reference, :func:`klt_tracks` on the host (``goodFeaturesToTrack`` +
    ``calcOpticalFlowPyrLK``). Both take the same ``klt`` options.

Likelihood (eq. 1-3)
    ``L(p, f_i) = N1(alpha|r - r_i|) N1(alpha|g - g_i|) N1(alpha|b - b_i|) N1(beta|x - x_i|)
    N1(beta|y - y_i|)`` with ``N1`` the standard normal density; here ``alpha = 1/sigma_c``,
    ``beta = 1/sigma_x``, so ``L = exp(-|c - c_i|^2 / (2 sigma_c^2) - |p - p_i|^2 / (2
    sigma_x^2))`` up to a constant that cancels. The paper gives only ``alpha/beta = 4``;
    ``sigma_x = 4 sigma_c`` is the default (``sigma_c`` in colour levels of the input, so
    0..255 for ``uint8`` frames; ``sigma_x`` in pixels).

Method 1, direct interpolation (eq. 4, Algorithm 1) - :func:`interpolate_flow`
    ``u(p) = sum_i L(p, f_i) u_i / sum_i L(p, f_i)``, likewise ``v``; then the change test.

Method 2, multiple hypotheses (Algorithm 3) - :func:`hypothesis_flow`
    The *discretised flow space* (DFS) is the integer grid spanning the rounded minimum to the
    rounded maximum of the features' ``u`` and ``v`` (``[-4, 4] x [-2, 2]`` -> 45 labels). Every
    feature votes for every label ``h`` with the 7-D likelihood ``L(p, f_i) N1(|h - (u_i,
    v_i)| / sigma_f)``; the label score is the sum of the votes. Every label is change-tested
    and the pixel takes the best-scoring label among the unchanged ones (masked argmax,
    :func:`scanforest.kernels.hypotheses.masked_argmax`; no sort, ties to the lower label).
    Algorithm 2 (sort, then test from the most likely) picks the same label whenever it tests
    all labels. ``sigma_f`` (the flow scale of the 7-D likelihood) is not given in the paper.

Change test
    ``I1`` is sampled at ``p + (u, v)`` (bilinear for Method 1's real-valued flow, the exact
    pixel for Method 2's integer labels); the pixel is *unchanged* when every colour channel
    differs from ``I0(p)`` by at most ``tau``, and a target outside ``I1`` cannot be tested, so
    it counts as changed. Pixels whose flow fails (Method 2: all labels fail) are
    "unclassified": ``valid = False``. Their ``flow`` still holds the method's estimate (Method
    1's weighted mean, Method 2's best label regardless of the test) so a caller may use it;
    :meth:`FlowResult.masked` gives NaN there. The paper's threshold, colour metric and
    sub-pixel rule are not given: max-abs over channels, ``tau = 20`` levels and bilinear are
    our choices (``tau=None`` turns the test off).

Numerics (not in the paper, the same formulas in exact arithmetic): ``sum L u / sum L`` is
evaluated as ``sum 2^(m - d_i) u_i / sum 2^(m - d_i)`` with ``d_i`` the scaled squared 5-D
distance (log2 units) and ``m = min_i d_i`` from a first pass over the features, so a pixel
whose colour no feature shares gets the flow of its 5-D nearest features instead of ``0/0``
(in float32 ``exp`` underflows once a colour differs by ~13 sigma_c). Method 2 scales its
scores by the same per-pixel factor, which leaves the argmax unchanged. The 7-D vote factorises
exactly into ``L(p, f_i) * K(h, f_i)``: ``L`` is computed once per (pixel, feature) and
``K`` once per (label, feature) and frame pair - ``O(n m + n m h)`` multiply-adds, not
``O(n m h)`` exponentials.

Batching: frames are ``(H, W)``/``(H, W, C)`` for one pair, ``(B, H, W[, C])`` for ``B`` pairs
(``frames1`` given) or a sequence of ``T`` frames (``frames1=None``: the ``T - 1`` consecutive
pairs, each frame stored once). All pairs of a call run in one kernel launch per method.
``C`` is 1 (grey) or 3 (colour); ``uint8``, ``uint16`` or float frames.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import array_module, resolve_device, to_numpy
from ..errors import InputError, ScanforestError
from ..hypotheses import masked_argmax
from ._frames import as_frames as _as_frames, check_finite as _check_finite

__all__ = ["FlowResult", "MissingDependency", "interpolate_flow", "hypothesis_flow", "dense_flow",
           "klt_tracks", "flow_labels", "METHODS", "TRACKERS", "SIGMA_C", "ALPHA_OVER_BETA",
           "SIGMA_F", "TAU"]

METHODS = ("interpolation", "hypotheses")
#: sources of tracks when none are given: our tracker on the flow's device, or OpenCV's (host)
TRACKERS = ("builtin", "opencv")
#: colour scale (levels of the input; 0..255 for uint8 frames), our choice
SIGMA_C = 10.0
#: the paper's alpha / beta = sigma_x / sigma_c
ALPHA_OVER_BETA = 4.0
#: flow scale of the 7-D likelihood (pixels), our choice
SIGMA_F = 1.0
#: change-test threshold (max abs colour difference, levels), our choice
TAU = 20.0
#: cap on the DFS size (a stray track with a huge flow would otherwise blow it up)
MAX_LABELS = 4096
_LOG2E = 1.4426950408889634


class MissingDependency(ScanforestError, ImportError):
    """An optional package is needed for this call (the message says which and how to get it)."""


@dataclass
class FlowResult:
    """Dense flow of one or more frame pairs.

    Attributes
    ----------
    flow : (H, W, 2) or (B, H, W, 2) float32
        ``(u, v)`` per pixel of frame 0 (the estimate, also where ``valid`` is False).
    valid : (H, W) or (B, H, W) bool
        Pixels whose flow passed the change test; the others are "unclassified".
    method : str
    device : str
    label : int32 array like ``valid``, Method 2 only
        Index of the chosen label in ``labels[b]``.
    labels : list of (L_b, 2) int32, Method 2 only
        The DFS of each pair, ``(u, v)`` per label.
    n_features : list of int
        Tracked features used per pair.
    params : dict
        Every constant used (sigma_c, sigma_x, sigma_f, tau, ...).
    """

    flow: Any
    valid: Any
    method: str
    device: str
    label: Any = None
    labels: list | None = None
    n_features: list = field(default_factory=list)
    params: dict = field(default_factory=dict)

    @property
    def coverage(self) -> float:
        """Fraction of classified pixels."""
        v = self.valid
        return float(v.mean()) if v.size else 0.0

    def masked(self):
        """``flow`` with NaN at unclassified pixels."""
        xp = array_module(self.flow)
        return xp.where(self.valid[..., None], self.flow, xp.float32(np.nan))

    def to_numpy(self) -> "FlowResult":
        return FlowResult(to_numpy(self.flow), to_numpy(self.valid), self.method, self.device,
                          None if self.label is None else to_numpy(self.label), self.labels,
                          list(self.n_features), dict(self.params))


# ---------------------------------------------------------------------------------------------
# input checking
# ---------------------------------------------------------------------------------------------


def _frames_and_pairs(frames0, frames1):
    """(list of frame arrays to stack, pairs (B, 2) int32, single pair?, (H, W, C))."""
    f0, single0 = _as_frames(frames0, "frames0")
    if frames1 is None:
        if single0:
            raise InputError("frames1 is None, so frames0 must be a sequence (T, H, W[, C]) of at "
                             "least 2 frames; got a single frame")
        t = f0.shape[0]
        if t < 2:
            raise InputError(f"a sequence needs at least 2 frames, got {t}")
        pairs = np.stack([np.arange(t - 1), np.arange(1, t)], 1).astype(np.int32)
        parts, single = [f0], False
    else:
        f1, single1 = _as_frames(frames1, "frames1")
        if f0.shape != f1.shape:
            raise InputError(f"frame sizes differ: frames0 {tuple(f0.shape)} vs frames1 "
                             f"{tuple(f1.shape)} (as (N, H, W, C))")
        b = f0.shape[0]
        pairs = np.stack([np.arange(b), np.arange(b, 2 * b)], 1).astype(np.int32)
        parts, single = [f0, f1], single0 and single1
    n, h, w, c = parts[0].shape
    if n == 0:
        raise InputError("no frames given")
    if h < 2 or w < 2:
        raise InputError(f"frames must be at least 2x2 pixels, got {h}x{w}")
    for i, p in enumerate(parts):
        _check_finite(p, f"frames{i}")
    return parts, pairs, single, (h, w, c)


def _tracks_list(tracks, n_pairs: int, single: bool) -> list:
    """One entry per pair (an (M, 4) array or a pair of (M, 2) arrays)."""
    if single:
        if isinstance(tracks, (list, tuple)) and len(tracks) == 1:
            return [tracks[0]]
        return [tracks]
    if not isinstance(tracks, (list, tuple)):
        if n_pairs == 1:
            return [tracks]
        raise InputError(f"{n_pairs} frame pairs need a list of {n_pairs} track arrays, got "
                         f"{type(tracks).__name__}")
    if n_pairs == 1 and len(tracks) == 2 and not _is_track_array(tracks[0]):
        return [tracks]          # one pair given as (points0, points1)
    if len(tracks) != n_pairs:
        raise InputError(f"{n_pairs} frame pairs but {len(tracks)} track arrays")
    return list(tracks)


def _is_track_array(t) -> bool:
    return hasattr(t, "shape") and len(t.shape) == 2 and t.shape[1] == 4


def _one_tracks(t, b: int, h: int, w: int) -> np.ndarray:
    """Validate one pair's tracks -> (M, 4) float32 x0, y0, x1, y1."""
    if t is None:
        raise InputError(f"pair {b}: no tracks")
    if isinstance(t, (list, tuple)) and len(t) == 2 and not _is_track_array(t):
        p0 = np.asarray(to_numpy(t[0]), np.float64)
        p1 = np.asarray(to_numpy(t[1]), np.float64)
        if p0.ndim != 2 or p0.shape[1] != 2 or p0.shape != p1.shape:
            raise InputError(f"pair {b}: point pairs must be two (M, 2) arrays of equal shape, "
                             f"got {p0.shape} and {p1.shape}")
        a = np.concatenate([p0, p1], axis=1)
    else:
        a = np.asarray(to_numpy(t), np.float64)
        if a.ndim != 2 or a.shape[1] != 4:
            raise InputError(f"pair {b}: tracks must be an (M, 4) array (x0, y0, x1, y1) or a "
                             f"pair of (M, 2) arrays, got shape {a.shape}")
    if a.shape[0] == 0:
        raise InputError(f"pair {b}: empty track list (0 tracked features); the flow needs at "
                         "least one track")
    if not np.isfinite(a).all():
        raise InputError(f"pair {b}: tracks contain NaN or infinite coordinates "
                         f"({int((~np.isfinite(a).all(axis=1)).sum())} of {len(a)} rows)")
    out = (a[:, 0] < 0) | (a[:, 0] > w - 1) | (a[:, 1] < 0) | (a[:, 1] > h - 1)
    if out.any():
        raise InputError(f"pair {b}: {int(out.sum())} of {len(a)} track start points lie outside "
                         f"the {w}x{h} frame (x in [0, {w - 1}], y in [0, {h - 1}])")
    return a.astype(np.float32)


def _positive(name, v):
    if not (isinstance(v, (int, float, np.floating, np.integer)) and math.isfinite(float(v))
            and float(v) > 0):
        raise InputError(f"{name} must be a positive finite number, got {v!r}")
    return float(v)


def _params(sigma_c, sigma_x, tau):
    sigma_c = _positive("sigma_c", sigma_c)
    sigma_x = ALPHA_OVER_BETA * sigma_c if sigma_x is None else _positive("sigma_x", sigma_x)
    if tau is not None:
        if not (isinstance(tau, (int, float, np.floating, np.integer)) and float(tau) >= 0
                and not math.isnan(float(tau))):
            raise InputError(f"tau must be a number >= 0 or None (no change test), got {tau!r}")
        tau = float(tau)
    return sigma_c, sigma_x, tau


def flow_labels(tracks, max_labels: int = MAX_LABELS) -> np.ndarray:
    """The discretised flow space of one pair: ``(L, 2)`` int32 ``(u, v)`` labels.

    The integer grid from the rounded minimum to the rounded maximum of the tracks' ``u`` and
    ``v`` (nearest grid point, Fig. 1 of the paper), label ``l = (v - v_min) * n_u + (u - u_min)``.
    """
    u0, v0, nu, nv = _dfs(np.asarray(to_numpy(tracks), np.float32), 0, max_labels)
    hv, hu = np.divmod(np.arange(nu * nv), nu)
    return np.stack([u0 + hu, v0 + hv], 1).astype(np.int32)


def _dfs(t: np.ndarray, b: int, max_labels: int):
    u = t[:, 2] - t[:, 0]
    v = t[:, 3] - t[:, 1]
    ru = np.floor(u.astype(np.float64) + 0.5)
    rv = np.floor(v.astype(np.float64) + 0.5)
    u0, u1 = int(ru.min()), int(ru.max())
    v0, v1 = int(rv.min()), int(rv.max())
    nu, nv = u1 - u0 + 1, v1 - v0 + 1
    if nu * nv > max_labels:
        raise InputError(f"pair {b}: the discretised flow space has {nu} x {nv} = {nu * nv} labels "
                         f"(u in [{u0}, {u1}], v in [{v0}, {v1}]), more than max_labels="
                         f"{max_labels}; remove outlier tracks or raise max_labels")
    return u0, v0, nu, nv


# ---------------------------------------------------------------------------------------------
# KLT tracks (OpenCV)
# ---------------------------------------------------------------------------------------------
def _cv2():
    try:
        import cv2
    except ImportError as exc:
        raise MissingDependency(
            "KLT tracking needs OpenCV: pip install 'scanforest[flow]' (opencv-python-headless), "
            "or pass tracks= (point pairs) yourself") from exc
    return cv2


def _grey_u8(frame: np.ndarray) -> np.ndarray:
    f = np.asarray(frame)
    if f.ndim == 3:
        f = f[..., :3].astype(np.float64) @ np.array([0.299, 0.587, 0.114]) if f.shape[2] == 3 else f[..., 0]
    if f.dtype == np.uint8:
        return np.ascontiguousarray(f)
    f = np.asarray(f, np.float64)
    lo, hi = float(np.min(f)), float(np.max(f))
    if f.dtype.kind == "f" and hi <= 255.0 and lo >= 0.0 and hi > 1.0:
        g = f
    else:
        g = (f - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(f)
    return np.clip(np.rint(g), 0, 255).astype(np.uint8)


def klt_tracks(frame0, frame1, *, max_features: int = 200, quality: float = 0.01,
               min_distance: float = 7.0, block_size: int = 7, win_size: int = 21,
               levels: int = 3, fb_threshold: float | None = 1.0) -> np.ndarray:
    """KLT tracks between two frames with OpenCV: ``(M, 4)`` float32 ``x0, y0, x1, y1``.

    The reference for :mod:`scanforest.kernels.motion.tracking` (``tracker="opencv"`` of the
    flow functions; :func:`~scanforest.kernels.motion.tracking.sparse_tracks` takes the same
    options and computes the same tracks on the CPU or the GPU).

    Shi-Tomasi corners (``cv2.goodFeaturesToTrack``: ``max_features``, ``quality``,
    ``min_distance``, ``block_size``) tracked by pyramidal Lucas-Kanade
    (``cv2.calcOpticalFlowPyrLK``, ``win_size`` x ``win_size`` window, ``levels`` pyramid levels,
    30 iterations / 0.01 px). Lost tracks are dropped, and with ``fb_threshold`` the tracks
    whose backward track (frame 1 -> 0) misses the start by more than that many pixels. Colour
    frames are converted to grey (BT.601 weights); non-uint8 frames are rescaled to 0..255.
    Raises :class:`MissingDependency` without OpenCV.
    """
    cv2 = _cv2()
    g0, g1 = _grey_u8(to_numpy(frame0)), _grey_u8(to_numpy(frame1))
    if g0.shape != g1.shape:
        raise InputError(f"frame sizes differ: {g0.shape} vs {g1.shape}")
    p0 = cv2.goodFeaturesToTrack(g0, maxCorners=int(max_features), qualityLevel=float(quality),
                                 minDistance=float(min_distance), blockSize=int(block_size))
    if p0 is None or len(p0) == 0:
        return np.zeros((0, 4), np.float32)
    p0 = p0.reshape(-1, 1, 2).astype(np.float32)
    crit = (cv2.TERM_CRITERIA_EPS | cv2.TERM_CRITERIA_COUNT, 30, 0.01)
    kw = dict(winSize=(int(win_size), int(win_size)), maxLevel=int(levels), criteria=crit)
    p1, st, _ = cv2.calcOpticalFlowPyrLK(g0, g1, p0, None, **kw)
    keep = st.reshape(-1).astype(bool) & np.isfinite(p1.reshape(-1, 2)).all(axis=1)
    if fb_threshold is not None and keep.any():
        pb, st2, _ = cv2.calcOpticalFlowPyrLK(g1, g0, p1, None, **kw)
        fb = np.linalg.norm((pb - p0).reshape(-1, 2), axis=1)
        keep &= st2.reshape(-1).astype(bool) & (fb <= float(fb_threshold))
    a, b = p0.reshape(-1, 2)[keep], p1.reshape(-1, 2)[keep]
    return np.concatenate([a, b], axis=1).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# CPU backend (numba)
# ---------------------------------------------------------------------------------------------
def _numba_kernels():
    from . import _optical_flow_cpu

    return _optical_flow_cpu


def _features_cpu(frames4: np.ndarray, pairs: np.ndarray, tr: np.ndarray, tpair: np.ndarray,
                  sx: np.float32, sc: np.float32) -> np.ndarray:
    """Feature table (M, 8) float32: x sx, y sx, r sc, g sc, b sc, u, v, 0 (same as the GPU)."""
    h, w = frames4.shape[1:3]
    X = np.clip(tr[:, 0], np.float32(0), np.float32(w - 1))
    Y = np.clip(tr[:, 1], np.float32(0), np.float32(h - 1))
    x0 = np.floor(X).astype(np.int64)
    y0 = np.floor(Y).astype(np.int64)
    fx = (X - x0.astype(np.float32))[:, None]
    fy = (Y - y0.astype(np.float32))[:, None]
    x1 = np.minimum(x0 + 1, w - 1)
    y1 = np.minimum(y0 + 1, h - 1)
    f = pairs[tpair, 0]
    a, b_ = frames4[f, y0, x0], frames4[f, y0, x1]
    c, d = frames4[f, y1, x0], frames4[f, y1, x1]
    top = a + fx * (b_ - a)
    bot = c + fx * (d - c)
    col = top + fy * (bot - top)
    feat = np.zeros((len(tr), 8), np.float32)
    feat[:, 0] = tr[:, 0] * sx
    feat[:, 1] = tr[:, 1] * sx
    feat[:, 2] = col[:, 0] * sc
    feat[:, 3] = col[:, 1] * sc
    feat[:, 4] = col[:, 2] * sc
    feat[:, 5] = tr[:, 2] - tr[:, 0]
    feat[:, 6] = tr[:, 3] - tr[:, 1]
    return feat


def _frames4_cpu(parts) -> np.ndarray:
    n = sum(p.shape[0] for p in parts)
    _, h, w, c = parts[0].shape
    out = np.zeros((n, h, w, 4), np.float32)
    i = 0
    for p in parts:
        out[i:i + p.shape[0], ..., :c] = np.asarray(to_numpy(p), np.float32)
        i += p.shape[0]
    return out


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def _prepare(frames0, frames1, tracks, device, klt, tracker="builtin"):
    parts, pairs, single, (h, w, c) = _frames_and_pairs(frames0, frames1)
    dev = resolve_device(device, *parts)
    if tracker not in TRACKERS:
        raise InputError(f"tracker must be one of {TRACKERS}, got {tracker!r}")
    n_pairs = len(pairs)
    if tracks is None:
        tl = [None] * n_pairs
    else:
        tl = _tracks_list(tracks, n_pairs, single)
    todo = [b for b, t in enumerate(tl) if t is None]
    source = "given" if not todo else (tracker if len(todo) == n_pairs else f"given+{tracker}")
    if todo and tracker == "opencv":
        host = [to_numpy(p) for p in parts]
        stack = np.concatenate(host) if len(host) > 1 else host[0]
        for b in todo:
            tl[b] = klt_tracks(stack[pairs[b, 0]], stack[pairs[b, 1]], **(klt or {}))
    elif todo:
        if dev == "gpu":
            from ..backend import to_device

            parts = [to_device(p, "gpu") for p in parts]    # one upload: tracking and flow
        for b, t in zip(todo, _builtin_tracks(parts, pairs[todo], klt, dev)):
            tl[b] = t
    tl = [_one_tracks(t, b, h, w) for b, t in enumerate(tl)]
    return parts, pairs, single, (h, w, c), dev, tl, source


def check_trackable(h: int, w: int, klt: dict | None = None):
    """Raise :class:`InputError` unless the built-in tracker takes the options ``klt`` and can
    track frames of ``h`` x ``w`` pixels (a cheap check, e.g. before frames are dispatched).
    Returns the checked (detection, tracking) parameters."""
    from . import tracking as T

    opts = dict(T.TRACKER_DEFAULTS)
    unknown = sorted(set(klt or {}) - set(opts))
    if unknown:
        raise InputError(f"klt: unknown option(s) {unknown}; the tracker takes {sorted(opts)}")
    opts.update(klt or {})
    det = T._detect_params(opts["max_features"], opts["quality"], opts["min_distance"],
                           opts["block_size"])
    lk = T._lk_params(opts["win_size"], opts["levels"], opts["iters"], opts["eps"],
                      opts["fb_threshold"], opts["min_eig"])
    win, bs = lk[0], det[3]
    if min(h, w) <= max(win, bs - 1):
        raise InputError(f"frames of {w}x{h} pixels are too small to track features with "
                         f"win_size={win} (need more than {win} pixels a side); pass tracks= or a "
                         "smaller klt win_size")
    return det, lk


def _builtin_tracks(parts, pairs, klt, dev) -> list:
    """Tracks of ``pairs`` (frame indices into the stacked ``parts``) by
    :func:`scanforest.kernels.motion.tracking.track_grey` on ``dev``; host (M, 4) arrays."""
    from . import tracking as T

    xp = array_module(*parts)
    stack = parts[0] if len(parts) == 1 else xp.concatenate(parts)
    h, w = stack.shape[1:3]
    (maxf, q, md, bs), (win, lev, it, eps, fb, me) = check_trackable(h, w, klt)
    tr, keep = T.track_grey(T.grey_u8(stack), pairs, dev, maxf, q, md, bs, win, lev, it, eps, fb,
                            me)
    tr, keep = to_numpy(tr), to_numpy(keep)            # (B, P, 4) + (B, P): a few KB per pair
    return [tr[b][keep[b]] for b in range(len(pairs))]


def _scales(sigma_c, sigma_x):
    k = math.sqrt(0.5 * _LOG2E)
    return np.float32(k / sigma_x), np.float32(k / sigma_c)


def _run(method, frames0, frames1, tracks, sigma_c, sigma_x, sigma_f, tau, max_labels, device,
         klt, tracker="builtin"):
    sigma_c, sigma_x, tau = _params(sigma_c, sigma_x, tau)
    parts, pairs, single, (h, w, c), dev, tl, source = _prepare(frames0, frames1, tracks, device,
                                                                klt, tracker)
    n_pairs = len(pairs)
    offs = np.zeros(n_pairs + 1, np.int32)
    offs[1:] = np.cumsum([len(t) for t in tl])
    tr = np.concatenate(tl).astype(np.float32)
    tpair = np.repeat(np.arange(n_pairs, dtype=np.int32), [len(t) for t in tl])
    sx, sc = _scales(sigma_c, sigma_x)
    tau32 = np.float32(tau if tau is not None else np.inf)
    test = tau is not None
    params = dict(sigma_c=sigma_c, sigma_x=sigma_x, tau=tau, change_metric="max_abs_channel",
                  sampling="bilinear" if method == "interpolation" else "nearest (integer labels)",
                  tracks=source)
    lab = None
    labels = None
    if method == "hypotheses":
        sigma_f = _positive("sigma_f", sigma_f)
        params["sigma_f"] = sigma_f
        lab = np.array([_dfs(t, b, int(max_labels)) for b, t in enumerate(tl)], np.int32)
        labels = []
        for u0, v0, nu, nv in lab:
            hv, hu = np.divmod(np.arange(nu * nv), nu)
            labels.append(np.stack([u0 + hu, v0 + hv], 1).astype(np.int32))
        sf2 = np.float32(0.5 * _LOG2E / sigma_f ** 2)
    if dev == "gpu":
        from . import _optical_flow_gpu as g

        f4 = g.frames4(parts)
        tables = g.features(f4, pairs, tr, tpair, offs, sx, sc, lab)
        if method == "interpolation":
            flow, valid = g.interpolate(f4, pairs, tables, offs, sx, sc, tau32, test)
            label = None
        else:
            flow, valid, label = g.hypotheses(f4, pairs, tables, offs, lab, sx, sc, sf2, tau32,
                                              test)
    else:
        cpu = _numba_kernels()
        f4 = _frames4_cpu(parts)
        feat = _features_cpu(f4, pairs, tr, tpair, sx, sc)
        flow = np.empty((n_pairs, h, w, 2), np.float32)
        valid = np.empty((n_pairs, h, w), np.bool_)
        if method == "interpolation":
            cpu.interpolate(f4, pairs, feat, offs, sx, sc, tau32, test, flow, valid)
            label = None
        else:
            label = np.empty((n_pairs, h, w), np.int32)
            for b in range(n_pairs):
                _hypotheses_cpu(cpu, f4, pairs[b], feat[offs[b]:offs[b + 1]], labels[b], sx, sc,
                                sf2, tau32, test, flow[b], valid[b], label[b])
    if single:
        flow, valid = flow[0], valid[0]
        label = None if label is None else label[0]
    return FlowResult(flow, valid, method, dev, label, labels, [len(t) for t in tl], params)


def _hypotheses_cpu(cpu, f4, pair, feat, labels, sx, sc, sf2, tau32, test, flow, valid, label):
    """Method 2 on the CPU: numba scores + change tests per pixel block, then masked argmax."""
    h, w = f4.shape[1:3]
    nl = len(labels)
    du = labels[:, 0:1].astype(np.float32) - feat[None, :, 5]
    dv = labels[:, 1:2].astype(np.float32) - feat[None, :, 6]
    K = np.exp2(-(du * du + dv * dv) * sf2).astype(np.float32)      # (L, M) label x feature
    rows = max(1, min(h, (1 << 22) // max(1, w * nl)))               # <= 16 MB of scores a block
    scores = np.empty((rows * w, nl), np.float32)
    ok = np.empty((rows * w, nl), np.bool_)
    lab = np.ascontiguousarray(labels, np.int32)
    for y0 in range(0, h, rows):
        y1 = min(h, y0 + rows)
        n = (y1 - y0) * w
        cpu.hypothesis_scores(f4, int(pair[0]), int(pair[1]), feat, K, lab, sx, sc, tau32, test,
                              y0, y1, scores, ok)
        best, _ = masked_argmax(scores[:n], ok[:n], axis=1)
        anyb = np.argmax(scores[:n], axis=1)
        pick = np.where(best >= 0, best, anyb)
        flow[y0:y1] = labels[pick].reshape(y1 - y0, w, 2).astype(np.float32)
        valid[y0:y1] = (best >= 0).reshape(y1 - y0, w)
        label[y0:y1] = pick.reshape(y1 - y0, w)


def interpolate_flow(frames0, frames1=None, tracks=None, *, sigma_c: float = SIGMA_C,
                     sigma_x: float | None = None, tau: float | None = TAU,
                     klt: dict | None = None, tracker: str = "builtin",
                     device: str = "auto") -> FlowResult:
    """Method 1: dense flow by colour-and-position Gaussian interpolation of the tracks' flows.

    Parameters
    ----------
    frames0 : (H, W[, C]) | (B, H, W[, C]) | (T, H, W[, C]) array
        First frame(s) (numpy or CuPy; ``C`` = 1 or 3), or the whole sequence with
        ``frames1=None``.
    frames1 : array like ``frames0``, optional
        Second frame(s) of each pair.
    tracks : (M, 4) array, pair of (M, 2) arrays, or a list of those (one per pair), optional
        ``x0, y0`` in frame 0 (inside the frame) and ``x1, y1`` in frame 1, pixels (x = column).
        ``None`` (or ``None`` entries of the list): KLT tracks by ``tracker``, options in
        ``klt`` (those of :func:`klt_tracks`).
    sigma_c : float
        Colour standard deviation (levels of the input).
    sigma_x : float, optional
        Spatial standard deviation (pixels); default ``4 sigma_c`` (the paper's alpha/beta = 4).
    tau : float or None
        Change-test threshold (max abs channel difference); None disables the test.
    tracker : {"builtin", "opencv"}
        ``"builtin"``: :mod:`~scanforest.kernels.motion.tracking` on the flow's device (the GPU
        tracker when the GPU computes); ``"opencv"``: :func:`klt_tracks` on the host (the
        reference; needs OpenCV).
    device : {"auto", "cpu", "gpu"}

    Returns
    -------
    FlowResult (``flow`` float32, ``valid`` bool; on the device that computed them).
    """
    return _run("interpolation", frames0, frames1, tracks, sigma_c, sigma_x, None, tau,
                MAX_LABELS, device, klt, tracker)


def hypothesis_flow(frames0, frames1=None, tracks=None, *, sigma_c: float = SIGMA_C,
                    sigma_x: float | None = None, sigma_f: float = SIGMA_F,
                    tau: float | None = TAU, max_labels: int = MAX_LABELS,
                    klt: dict | None = None, tracker: str = "builtin",
                    device: str = "auto") -> FlowResult:
    """Method 2: per-pixel scoring of every label of the discretised flow space, masked argmax.

    Parameters as :func:`interpolate_flow`, plus

    sigma_f : float
        Flow standard deviation (pixels) of the 7-D likelihood.
    max_labels : int
        Refuse DFS larger than this (InputError naming the flow bounds).

    Returns
    -------
    FlowResult with ``label`` (chosen label per pixel) and ``labels`` (the DFS of every pair).
    """
    return _run("hypotheses", frames0, frames1, tracks, sigma_c, sigma_x, sigma_f, tau,
                max_labels, device, klt, tracker)


def dense_flow(frames0, frames1=None, tracks=None, *, method: str = "hypotheses",
               **kwargs) -> FlowResult:
    """:func:`interpolate_flow` (``method="interpolation"``) or :func:`hypothesis_flow`."""
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    if method == "interpolation":
        kwargs.pop("sigma_f", None)
        kwargs.pop("max_labels", None)
        return interpolate_flow(frames0, frames1, tracks, **kwargs)
    return hypothesis_flow(frames0, frames1, tracks, **kwargs)


def gpu_flow_kernel(frames, tracks, method: str, params: dict):
    """The GPU flow kernel alone, for benchmarks: a no-argument callable that launches the
    interpolation (``method="interpolation"``) or hypotheses kernel once over the consecutive pairs
    of ``frames`` (a sequence already on the GPU), with ``tracks`` one array per pair and
    ``params`` those of a :class:`FlowResult` computed on them. Frames and feature tables are
    prepared here, once, outside the callable."""
    from . import _optical_flow_gpu as g

    tl = [np.asarray(t, np.float32) for t in tracks]
    nb = len(tl)
    pairs = np.stack([np.arange(nb), np.arange(1, nb + 1)], 1).astype(np.int32)
    offs = np.zeros(nb + 1, np.int32)
    offs[1:] = np.cumsum([len(t) for t in tl])
    tr = np.concatenate(tl)
    tpair = np.repeat(np.arange(nb, dtype=np.int32), [len(t) for t in tl])
    sx, sc = _scales(params["sigma_c"], params["sigma_x"])
    f4 = g.frames4([frames])
    dfs = np.array([_dfs(t, b, MAX_LABELS) for b, t in enumerate(tl)], np.int32)
    tables = g.features(f4, pairs, tr, tpair, offs, sx, sc, dfs)
    tau = np.float32(params["tau"])
    if method == "interpolation":
        return lambda: g.interpolate(f4, pairs, tables, offs, sx, sc, tau, True)
    sf2 = np.float32(0.5 * _LOG2E / params["sigma_f"] ** 2)
    return lambda: g.hypotheses(f4, pairs, tables, offs, None, sx, sc, sf2, tau, True)
