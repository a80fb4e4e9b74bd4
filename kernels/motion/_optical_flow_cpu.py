"""numba CPU backend of the flow methods (see :mod:`scanforest.kernels.motion.optical_flow`).

Same float32 arithmetic, feature order and sampling rules as the CUDA kernels in
``_optical_flow_gpu.py``, one image row per parallel task. Frames are ``(F, H, W, 4)`` float32 (unused
channels zero); the feature table is ``(M, 8)`` float32 ``x sx, y sx, r sc, g sc, b sc, u, v, 0``
with ``sx = sqrt(log2(e) / 2) / sigma_x`` and ``sc`` likewise, so that a feature's likelihood is
``2^(-d)`` with ``d`` the squared distance of the scaled 5-vectors.
"""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange


@njit(cache=True, inline="always")
def _d5(feat, k, qx, qy, qr, qg, qb):
    dx = feat[k, 0] - qx
    dy = feat[k, 1] - qy
    dr = feat[k, 2] - qr
    dg = feat[k, 3] - qg
    db = feat[k, 4] - qb
    return dx * dx + dy * dy + dr * dr + dg * dg + db * db


@njit(cache=True, inline="always")
def _lerp2(frames, f, ch, x0, x1, y0, y1, fx, fy):
    a = frames[f, y0, x0, ch]
    b = frames[f, y0, x1, ch]
    c = frames[f, y1, x0, ch]
    d = frames[f, y1, x1, ch]
    top = a + fx * (b - a)
    bot = c + fx * (d - c)
    return top + fy * (bot - top)


@njit(cache=True, inline="always")
def _bilinear(frames, f, X, Y):
    """Bilinear colour at (X, Y) inside the frame (x1/y1 clamped at the last column/row)."""
    h = frames.shape[1]
    w = frames.shape[2]
    x0 = int(np.floor(X))
    y0 = int(np.floor(Y))
    fx = X - np.float32(x0)
    fy = Y - np.float32(y0)
    x1 = min(x0 + 1, w - 1)
    y1 = min(y0 + 1, h - 1)
    return (_lerp2(frames, f, 0, x0, x1, y0, y1, fx, fy), _lerp2(frames, f, 1, x0, x1, y0, y1, fx, fy),
            _lerp2(frames, f, 2, x0, x1, y0, y1, fx, fy))


@njit(cache=True, inline="always")
def _min_d(feat, s, e, qx, qy, qr, qg, qb):
    m = np.float32(np.inf)
    for k in range(s, e):
        d = _d5(feat, k, qx, qy, qr, qg, qb)
        if d < m:
            m = d
    return m


@njit(cache=True, parallel=True)
def interpolate(frames, pairs, feat, offs, sx, sc, tau, test, flow, valid):
    """Method 1 for every pair: weighted mean of the feature flows, bilinear change test."""
    nb = pairs.shape[0]
    h = frames.shape[1]
    w = frames.shape[2]
    wm1 = np.float32(w - 1)
    hm1 = np.float32(h - 1)
    for job in prange(nb * h):
        b = job // h
        y = job - b * h
        f0 = pairs[b, 0]
        f1 = pairs[b, 1]
        s = offs[b]
        e = offs[b + 1]
        qy = np.float32(y) * sx
        for x in range(w):
            qx = np.float32(x) * sx
            qr = frames[f0, y, x, 0] * sc
            qg = frames[f0, y, x, 1] * sc
            qb = frames[f0, y, x, 2] * sc
            m = _min_d(feat, s, e, qx, qy, qr, qg, qb)
            sw = np.float32(0.0)
            su = np.float32(0.0)
            sv = np.float32(0.0)
            for k in range(s, e):
                wk = np.exp2(m - _d5(feat, k, qx, qy, qr, qg, qb))
                sw += wk
                su += wk * feat[k, 5]
                sv += wk * feat[k, 6]
            u = su / sw
            v = sv / sw
            flow[b, y, x, 0] = u
            flow[b, y, x, 1] = v
            if not test:
                valid[b, y, x] = True
                continue
            X = np.float32(x) + u
            Y = np.float32(y) + v
            if not (X >= 0 and X <= wm1 and Y >= 0 and Y <= hm1):
                valid[b, y, x] = False
                continue
            c1 = _bilinear(frames, f1, X, Y)
            dmax = max(abs(c1[0] - frames[f0, y, x, 0]), abs(c1[1] - frames[f0, y, x, 1]),
                       abs(c1[2] - frames[f0, y, x, 2]))
            valid[b, y, x] = dmax <= tau


@njit(cache=True, parallel=True)
def hypothesis_scores(frames, f0, f1, feat, K, lab, sx, sc, tau, test, y0, y1, scores, ok):
    """Method 2 scores and change tests of rows ``y0 .. y1`` of one pair.

    ``scores[i, l] = sum_k 2^(m - d_k) K[l, k]`` and ``ok[i, l]`` (label ``l`` unchanged) for
    pixel ``i = (y - y0) * W + x``; ``K[l, k]`` is the flow factor of label ``l`` and feature ``k``.
    """
    w = frames.shape[2]
    h = frames.shape[1]
    nl = lab.shape[0]
    nf = feat.shape[0]
    for row in prange(y1 - y0):
        y = y0 + row
        qy = np.float32(y) * sx
        acc = np.empty(nl, np.float32)
        for x in range(w):
            i = row * w + x
            qx = np.float32(x) * sx
            qr = frames[f0, y, x, 0] * sc
            qg = frames[f0, y, x, 1] * sc
            qb = frames[f0, y, x, 2] * sc
            m = _min_d(feat, 0, nf, qx, qy, qr, qg, qb)
            for l in range(nl):
                acc[l] = 0.0
            for k in range(nf):
                wk = np.exp2(m - _d5(feat, k, qx, qy, qr, qg, qb))
                for l in range(nl):
                    acc[l] += wk * K[l, k]
            for l in range(nl):
                scores[i, l] = acc[l]
                if not test:
                    ok[i, l] = True
                    continue
                xx = x + lab[l, 0]
                yy = y + lab[l, 1]
                if xx < 0 or xx >= w or yy < 0 or yy >= h:
                    ok[i, l] = False
                    continue
                dmax = max(abs(frames[f1, yy, xx, 0] - frames[f0, y, x, 0]),
                           abs(frames[f1, yy, xx, 1] - frames[f0, y, x, 1]),
                           abs(frames[f1, yy, xx, 2] - frames[f0, y, x, 2]))
                ok[i, l] = dmax <= tau
