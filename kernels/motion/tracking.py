"""Sparse feature tracking on the CPU (numba) and the GPU (CuPy RawKernels): Shi-Tomasi corners
tracked by pyramidal Lucas-Kanade with a forward-backward check - the KLT tracks that
:mod:`scanforest.kernels.motion.optical_flow` turns into dense flow, without OpenCV and, on the
GPU, without leaving the device.

Both backends (``_tracking_cpu``, numba; ``_tracking_gpu``, CUDA) follow OpenCV's arithmetic,
so OpenCV stays the reference (:func:`~scanforest.kernels.motion.optical_flow.klt_tracks`):

Corners (:func:`good_features`, as ``cv2.goodFeaturesToTrack``)
    3x3 Sobel derivatives, the structure tensor summed over a ``block_size`` box (reflect-101
    borders, as ``cornerMinEigenVal``), its minimum eigenvalue; pixels above ``quality`` x
    the image maximum that are the maximum of their 3x3 neighbourhood (the one-pixel border
    excluded); then, in descending response order (ties: the later pixel in raster order
    first, OpenCV's pointer order), a corner is kept unless a kept one lies closer than
    ``min_distance``, until ``max_features`` are kept. The box sums are exact integers, so the
    responses differ from OpenCV's float sums only by rounding (~1e-7 relative): the corners
    agree except where two responses tie to that precision.

Tracking (:func:`lk_track`, as ``cv2.calcOpticalFlowPyrLK``; Bouguet 2001)
    Pyramids by 5-tap Gaussian ``pyrDown`` (levels stop early when the next level would not
    be larger than the window), Scharr derivatives of the first image per level; per point and
    level the window's intensities and derivatives are bilinearly sampled with 14-bit fixed
    point weights, the 2x2 gradient matrix is inverted unless its minimum eigenvalue
    (``/ win^2``) is below ``min_eig`` (then the point is lost at level 0), and up to ``iters``
    Newton steps run until a step is shorter than ``eps`` px (or oscillates: half a step back).
    Sums are exact 64-bit integers (OpenCV sums in float32 SIMD lanes): positions agree with
    OpenCV to ~1e-4 px. With ``fb_threshold`` the tracked points are tracked back; a point is
    kept when both directions succeed and the backward track ends within ``fb_threshold`` px
    of its start.

Batched tracking (:func:`sparse_tracks`)
    A sequence ``(T, H, W[, C])`` gives the ``T - 1`` consecutive pairs (or ``frames0`` and
    ``frames1`` give ``B`` pairs). Every frame's pyramid and derivatives are built once and used
    by both pairs the frame belongs to (as the second image of one pair's forward track and of
    the next pair's backward track, and as the first image of the others); corners of all
    first frames in one pass; all points of all pairs in one forward and one backward launch
    (GPU: one warp per point, the whole pyramid walked inside the launch).

Colour frames are converted to grey as ``(299 R + 587 G + 114 B + 500) // 1000`` (BT.601, the
weights of ``klt_tracks``; exact integers, so both backends agree); non-8-bit frames are
rescaled to 0..255 per frame (floats already in 0..255 are only rounded).
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import is_cupy, resolve_device, to_numpy
from ..errors import InputError
from ._frames import as_frames, check_finite

__all__ = ["good_features", "lk_track", "sparse_tracks", "grey_u8", "TRACKER_DEFAULTS"]

#: defaults of :func:`sparse_tracks` (the same as :func:`~.optical_flow.klt_tracks`)
TRACKER_DEFAULTS = dict(max_features=200, quality=0.01, min_distance=7.0, block_size=7,
                        win_size=21, levels=3, iters=30, eps=0.01, fb_threshold=1.0,
                        min_eig=1e-4)
#: most corners per image (the GPU keeps the kept corners of a frame in shared memory)
MAX_FEATURES = 4096


# ---------------------------------------------------------------------------------------------
# input checking
# ---------------------------------------------------------------------------------------------
def _int_in(name, v, lo, hi):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
        raise InputError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
    return int(v)


def _num_in(name, v, lo, hi, lo_open=False):
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
    ok = ok and math.isfinite(float(v)) and (float(v) > lo if lo_open else float(v) >= lo)
    if not ok or float(v) > hi:
        left = "(" if lo_open else "["
        raise InputError(f"{name} must be a number in {left}{lo}, {hi}], got {v!r}")
    return float(v)


def _detect_params(max_features, quality, min_distance, block_size):
    return (_int_in("max_features", max_features, 1, MAX_FEATURES),
            _num_in("quality", quality, 0.0, 1.0, lo_open=True),
            _num_in("min_distance", min_distance, 0.0, 1e4),
            _int_in("block_size", block_size, 1, 31))


def _lk_params(win_size, levels, iters, eps, fb_threshold, min_eig):
    win = _int_in("win_size", win_size, 3, 63)
    lev = _int_in("levels (max_level)", levels, 0, 10)
    it = _int_in("iters", iters, 1, 100)
    eps = _num_in("eps", eps, 0.0, 10.0)
    if fb_threshold is not None:
        fb_threshold = _num_in("fb_threshold", fb_threshold, 0.0, 1e4)
    me = _num_in("min_eig", min_eig, 0.0, 1e6)
    return win, lev, it, eps, fb_threshold, me


def _frames(a, name: str, sequence: bool):
    """``(N, H, W, C)`` frames (numpy or CuPy, as given) from (H, W[, C]) or (N, H, W[, C])
    (:func:`._frames.as_frames`); for a sequence a 3-D array is always (T, H, W) grey."""
    if sequence and a is not None:
        if not is_cupy(a):
            a = np.asarray(a)
        if a.ndim < 3:
            raise InputError(f"{name}: frames1 is None, so {name} must be a sequence (T, H, W[, C]) "
                             f"of at least 2 frames; got shape {tuple(a.shape)}")
        if a.ndim == 3:
            a = a[..., None]                 # (T, H, W) grey sequence
    return as_frames(a, name)[0]


def _check_frames(f, name: str, min_side: int):
    n, h, w = f.shape[:3]
    if n == 0:
        raise InputError(f"{name}: no frames given")
    if h < min_side or w < min_side:
        raise InputError(f"{name}: frames of {w}x{h} pixels are too small for this window; "
                         f"need at least {min_side}x{min_side} (win_size + 1)")
    check_finite(f, name)


def grey_u8(frames):
    """``(N, H, W, C)`` frames -> ``(N, H, W)`` uint8 grey on the same device.

    8-bit colour: ``(299 R + 587 G + 114 B + 500) // 1000``; other types: the BT.601 mix in
    float64, rescaled to 0..255 per frame unless it already lies in 0..255 (floats), rounded.
    """
    xp = np if not is_cupy(frames) else __import__("cupy")
    c = frames.shape[-1]
    if frames.dtype == np.uint8:
        if c == 1:
            return xp.ascontiguousarray(frames[..., 0])
        if xp is np:
            from . import _tracking_cpu

            out = np.empty(frames.shape[:3], np.uint8)
            _tracking_cpu.grey_rgb8(frames, out)
            return out
        f = frames.astype(xp.int32)
        g = (299 * f[..., 0] + 587 * f[..., 1] + 114 * f[..., 2] + 500) // 1000
        return g.astype(xp.uint8)
    f = frames.astype(xp.float64)
    g = f[..., 0] if c == 1 else f[..., 0] * 0.299 + f[..., 1] * 0.587 + f[..., 2] * 0.114
    lo = g.min(axis=(1, 2), keepdims=True)
    hi = g.max(axis=(1, 2), keepdims=True)
    keep = (frames.dtype.kind == "f") & (hi <= 255.0) & (lo >= 0.0) & (hi > 1.0)
    span = xp.where(hi > lo, hi - lo, 1.0)
    g = xp.where(keep, g, (g - lo) * (255.0 / span))
    return xp.clip(xp.rint(g), 0, 255).astype(xp.uint8)


def _levels(h: int, w: int, win: int, max_level: int) -> np.ndarray:
    """``(L, 3)`` int64 rows ``(height, width, offset)`` of the pyramid levels: halving
    (``(n + 1) // 2``) stops before a level no larger than the window (OpenCV's rule)."""
    sizes = [(h, w)]
    for _ in range(max_level):
        nh, nw = (sizes[-1][0] + 1) // 2, (sizes[-1][1] + 1) // 2
        if nw <= win or nh <= win:
            break
        sizes.append((nh, nw))
    lv = np.zeros((len(sizes), 3), np.int64)
    off = 0
    for i, (a, b) in enumerate(sizes):
        lv[i] = (a, b, off)
        off += a * b
    return lv


def _backend(dev: str):
    if dev == "gpu":
        from . import _tracking_gpu as be
    else:
        from . import _tracking_cpu as be
    return be


def _to(dev, a):
    if dev == "gpu":
        import cupy as cp

        return cp.asarray(a)
    return np.asarray(to_numpy(a))


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def good_features(grey, max_features: int = 200, quality: float = 0.01,
                  min_distance: float = 7.0, block_size: int = 3, *, device: str = "auto"):
    """Shi-Tomasi corners (``cv2.goodFeaturesToTrack`` with the minimum-eigenvalue score).

    Parameters
    ----------
    grey : (H, W) or (N, H, W) array (numpy or CuPy), or colour (H, W, 3)
        Image(s); non-uint8 or colour input is converted by :func:`grey_u8`.
    max_features : int
        Most corners per image (1 .. 4096).
    quality : float
        Keep responses above ``quality`` x the image's largest response (0 < quality <= 1).
    min_distance : float
        Minimum distance between kept corners (pixels; below 1 nothing is suppressed).
    block_size : int
        Side of the box the structure tensor is summed over (1 .. 31).
    device : {"auto", "cpu", "gpu"}

    Returns
    -------
    (K, 2) float32 corners ``(x, y)`` (integer pixel positions) in descending response order,
    or for ``(N, H, W)`` input a list of N such arrays; on the computing device.
    """
    maxf, q, md, bs = _detect_params(max_features, quality, min_distance, block_size)
    single = not (hasattr(grey, "ndim") and grey.ndim == 3 and grey.shape[-1] not in (1, 3))
    f = _frames(grey, "grey", sequence=False)
    _check_frames(f, "grey", max(3, bs))
    dev = resolve_device(device, f)
    g = _to(dev, grey_u8(_to(dev, f)))
    be = _backend(dev)
    pts, counts = be.detect(g, np.arange(g.shape[0]), maxf, q, _min_d2(md), bs)
    c = to_numpy(counts)
    out = [pts[i, :int(c[i])] for i in range(len(c))]
    return out[0] if single else out


def _min_d2(min_distance: float) -> float:
    return float(min_distance) ** 2 if min_distance >= 1.0 else 0.0


def lk_track(grey0, grey1, points, *, win_size: int = 21, max_level: int = 3, iters: int = 30,
             eps: float = 0.01, fb_threshold: float | None = 1.0, min_eig: float = 1e-4,
             device: str = "auto"):
    """Track ``points`` of ``grey0`` into ``grey1`` by pyramidal Lucas-Kanade.

    Parameters
    ----------
    grey0, grey1 : (H, W) arrays (numpy or CuPy; colour or non-uint8 converted by
        :func:`grey_u8`)
    points : (M, 2) float array
        ``(x, y)`` in ``grey0`` (x = column).
    win_size : int
        Side of the square window (3 .. 63).
    max_level : int
        Pyramid levels above the image (fewer when a level would not exceed the window).
    iters, eps : int, float
        Newton steps per level at most, and the step length (px) that ends them.
    fb_threshold : float or None
        Forward-backward check (px); None: forward only.
    min_eig : float
        Minimum eigenvalue of the window's gradient matrix (``/ win^2``, derivatives in
        Scharr units / 32, as OpenCV) below which a point is lost.
    device : {"auto", "cpu", "gpu"}

    Returns
    -------
    points1 : (M, 2) float32
        Positions in ``grey1`` (the last estimate also where ``status`` is False).
    status : (M,) bool
        Tracked, and when asked, passed the forward-backward check.
    """
    win, lev, it, eps, fb, me = _lk_params(win_size, max_level, iters, eps, fb_threshold, min_eig)
    f0 = _frames(grey0, "grey0", sequence=False)
    f1 = _frames(grey1, "grey1", sequence=False)
    if f0.shape[0] != 1 or f1.shape[0] != 1:
        raise InputError(f"lk_track takes one image pair, got shapes {tuple(grey0.shape)} and "
                         f"{tuple(grey1.shape)} (use sparse_tracks for batches)")
    if f0.shape[1:3] != f1.shape[1:3]:
        raise InputError(f"image sizes differ: {tuple(f0.shape[1:3])} vs {tuple(f1.shape[1:3])}")
    _check_frames(f0, "grey0", win + 1)
    _check_frames(f1, "grey1", win + 1)
    p = to_numpy(points) if not is_cupy(points) else points
    if p.ndim != 2 or p.shape[1] != 2:
        raise InputError(f"points must be an (M, 2) array of (x, y), got shape {tuple(p.shape)}")
    dev = resolve_device(device, f0, f1, points)
    xp = np if dev == "cpu" else __import__("cupy")
    p = xp.asarray(p, xp.float32)
    if not bool(xp.isfinite(p).all()):
        raise InputError("points contain NaN or infinite coordinates")
    grey = xp.concatenate([grey_u8(_to(dev, f0)), grey_u8(_to(dev, f1))])
    m = p.shape[0]
    if m == 0:
        return xp.zeros((0, 2), xp.float32), xp.zeros(0, bool)
    pairs = np.array([[0, 1]], np.int64)
    p1, keep = _track_points(grey, pairs, p[None], np.array([m], np.int32), dev, win, lev, it,
                             eps, fb, me)
    return p1[0], keep[0]


def _track_points(grey, pairs, pts, counts, dev, win, lev, it, eps, fb, me):
    """Forward (and backward) LK of point slots ``pts`` (K, P, 2) of pairs ``pairs`` (K, 2):
    ``(points1 (K, P, 2), keep (K, P) bool)``."""
    be = _backend(dev)
    h, w = grey.shape[1:]
    lv = _levels(h, w, win, lev)
    pyr, der = be.build_pyramids(grey, lv)
    return _lk_fb(be, pyr, der, lv, pairs, pts, counts, dev, win, it, eps, fb, me)


def _lk_fb(be, pyr, der, lv, pairs, pts, counts, dev, win, it, eps, fb, me):
    xp = np if dev == "cpu" else __import__("cupy")
    pairs = np.asarray(pairs, np.int64)
    eps2 = min(max(eps, 0.0), 10.0) ** 2
    p1, st = be.track(pyr, der, lv, pairs[:, 0], pairs[:, 1], pts, counts, None, win, it, eps2, me)
    used = xp.arange(pts.shape[1])[None, :] < xp.asarray(counts)[:, None]
    keep = (st != 0) & used & xp.isfinite(p1).all(axis=-1)
    if fb is not None:
        pb, stb = be.track(pyr, der, lv, pairs[:, 1], pairs[:, 0], p1, counts, None, win, it, eps2,
                           me)
        d = (pb - pts).astype(xp.float64)
        err = xp.sqrt(d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1])
        keep &= (stb != 0) & (err <= fb)
    return p1, keep


def sparse_tracks(frames0, frames1=None, *, max_features: int = 200, quality: float = 0.01,
                  min_distance: float = 7.0, block_size: int = 7, win_size: int = 21,
                  levels: int = 3, iters: int = 30, eps: float = 0.01,
                  fb_threshold: float | None = 1.0, min_eig: float = 1e-4,
                  device: str = "auto", host: bool = False) -> list:
    """KLT tracks of frame pairs: corners of the first frame tracked into the second.

    The options and their defaults are those of :func:`~.optical_flow.klt_tracks` (so one
    ``klt=`` dict drives either tracker); see :func:`good_features` and :func:`lk_track`.

    Parameters
    ----------
    frames0 : (T, H, W[, C]) sequence (``frames1=None``: the T - 1 consecutive pairs), or
        (H, W[, C]) / (B, H, W[, C]) first frames of the pairs; numpy or CuPy.
    frames1 : array like ``frames0``, optional
        Second frames.
    device : {"auto", "cpu", "gpu"}
    host : bool
        Return numpy arrays even from the GPU (one small download of every pair's tracks).

    Returns
    -------
    list of (M_b, 4) float32 ``x0, y0, x1, y1`` per pair (kept tracks only, in descending
    corner response), on the computing device unless ``host``.
    """
    maxf, q, md, bs = _detect_params(max_features, quality, min_distance, block_size)
    win, lev, it, eps, fb, me = _lk_params(win_size, levels, iters, eps, fb_threshold, min_eig)
    if frames1 is None:
        f = _frames(frames0, "frames0", sequence=True)
        if f.shape[0] < 2:
            raise InputError(f"a sequence needs at least 2 frames, got {f.shape[0]}")
        stack = f
        pairs = np.stack([np.arange(f.shape[0] - 1), np.arange(1, f.shape[0])], 1)
    else:
        a = _frames(frames0, "frames0", sequence=False)
        b = _frames(frames1, "frames1", sequence=False)
        if a.shape != b.shape:
            raise InputError(f"frame sizes differ: frames0 {tuple(a.shape)} vs frames1 "
                             f"{tuple(b.shape)} (as (N, H, W, C))")
        dev0 = resolve_device(device, a, b)
        stack = _to(dev0, a)
        xp = np if dev0 == "cpu" else __import__("cupy")
        stack = xp.concatenate([stack, _to(dev0, b)])
        n = a.shape[0]
        pairs = np.stack([np.arange(n), np.arange(n, 2 * n)], 1)
    _check_frames(stack, "frames", max(win + 1, bs))
    dev = resolve_device(device, stack)
    grey = grey_u8(_to(dev, stack))
    tr, keep = track_grey(grey, pairs, dev, maxf, q, md, bs, win, lev, it, eps, fb, me)
    if host or dev == "cpu":
        tr, keep = to_numpy(tr), to_numpy(keep)
    return [tr[i][keep[i]] for i in range(len(pairs))]


def track_grey(grey, pairs, dev: str, max_features=200, quality=0.01, min_distance=7.0,
               block_size=7, win=21, levels=3, iters=30, eps=0.01, fb=1.0, min_eig=1e-4):
    """The batched tracker on validated input: ``grey`` (N, H, W) uint8 on ``dev``, ``pairs``
    (B, 2) frame indices. Returns ``(tracks (B, P, 4) float32, keep (B, P) bool)`` on the
    device, ``P = max_features`` slots per pair."""
    be = _backend(dev)
    xp = np if dev == "cpu" else __import__("cupy")
    pairs = np.asarray(pairs, np.int64)
    h, w = grey.shape[1:]
    lv = _levels(h, w, win, levels)
    pyr, der = be.build_pyramids(grey, lv)               # every frame once, both pairs reuse it
    pts, counts = be.detect(grey, pairs[:, 0], max_features, quality, _min_d2(min_distance),
                            block_size)
    p1, keep = _lk_fb(be, pyr, der, lv, pairs, pts, counts, dev, win, iters, eps, fb, min_eig)
    return xp.concatenate([pts, p1], axis=-1), keep
