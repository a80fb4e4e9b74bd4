"""numba CPU backend of the sparse tracker (see :mod:`scanforest.kernels.motion.tracking`).

The CUDA kernels in ``_tracking_gpu.py`` translate these functions: the same integer arithmetic
(exact, so order-free), the same float32 expressions in the same order (the CUDA module is
compiled with ``--fmad=false`` so no multiply-add is contracted) and the same border rules, so
both backends give identical corners and track positions. Where the CPU needs it for speed it
computes the same integers another way (separable box and pyramid sums, a border-free fast path
for Lucas-Kanade windows inside the level); the CUDA kernels keep the direct form.

Layouts (shared with the GPU backend)
    ``grey``: ``(N, H, W)`` uint8 frames.
    ``pyr``: ``(N, S)`` uint8, every pyramid level of a frame one after the other, level ``l``
    at offset ``lv[l, 2]`` with ``lv[l, 0]`` rows and ``lv[l, 1]`` columns.
    ``der``: ``(N, S, 2)`` int16 Scharr derivatives ``(dI/dx, dI/dy)`` of every level (3/10/3
    weights, unscaled, as OpenCV's ``calcScharrDeriv``).
    Points: ``(K, P, 2)`` float32 slots, ``counts[k]`` of them in use for problem ``k``.

Borders: reflect-101 for the pyramid, the Scharr and Sobel derivatives and the box sums
(OpenCV's ``BORDER_DEFAULT``); outside a level, Lucas-Kanade samples the image reflect-101 and
the derivatives as zero (OpenCV pads ``derivI`` with ``BORDER_CONSTANT``).
"""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange

W_BITS = 14
FLT_SCALE = np.float32(1.0 / (1 << 20))
FLT_EPSILON = np.float32(np.finfo(np.float32).eps)


@njit(cache=True, inline="always")
def _reflect(i, n):
    """Reflect-101 index (``-1 -> 1``, ``n -> n - 2``); any distance, ``n >= 1``."""
    if n == 1:
        return 0
    while i < 0 or i >= n:
        if i < 0:
            i = -i
        else:
            i = 2 * n - 2 - i
    return i


# ---------------------------------------------------------------------------------------------
# pyramid: 5-tap Gaussian pyrDown and Scharr derivatives
# ---------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _w5(i):
    return 6 if i == 2 else (4 if i == 1 or i == 3 else 1)


@njit(parallel=True, cache=True)
def pyr_down(pyr, soff, sh, sw, doff, dh, dw):
    """Level ``d`` of every frame from level ``s`` (``[1 4 6 4 1] / 16`` both ways, rounded
    ``(sum + 128) >> 8`` as OpenCV's ``pyrDown``). Computed as exact integer column sums, then
    row sums: the same integers as the GPU's direct 5x5 sum."""
    n = pyr.shape[0]
    for k in prange(n * dh):
        f = k // dh
        y = k - f * dh
        col = np.empty(sw, np.int32)
        r0 = soff + _reflect(2 * y - 2, sh) * sw
        r1 = soff + _reflect(2 * y - 1, sh) * sw
        r2 = soff + _reflect(2 * y, sh) * sw
        r3 = soff + _reflect(2 * y + 1, sh) * sw
        r4 = soff + _reflect(2 * y + 2, sh) * sw
        for x in range(sw):
            col[x] = (np.int32(pyr[f, r0 + x]) + np.int32(pyr[f, r4 + x])
                      + 4 * (np.int32(pyr[f, r1 + x]) + np.int32(pyr[f, r3 + x]))
                      + 6 * np.int32(pyr[f, r2 + x]))
        base = doff + y * dw
        for x in range(dw):
            c = 2 * x
            if c >= 2 and c + 2 < sw:
                t = col[c - 2] + col[c + 2] + 4 * (col[c - 1] + col[c + 1]) + 6 * col[c]
            else:
                t = np.int32(0)
                for i in range(5):
                    t += _w5(i) * col[_reflect(c + i - 2, sw)]
            pyr[f, base + x] = np.uint8((t + 128) >> 8)


@njit(parallel=True, cache=True)
def scharr(pyr, der, off, h, w):
    """Scharr derivatives of one level of every frame into ``der``."""
    n = pyr.shape[0]
    for k in prange(n * h):
        f = k // h
        y = k - f * h
        r0 = off + _reflect(y - 1, h) * w
        r1 = off + y * w
        r2 = off + _reflect(y + 1, h) * w
        for x in range(w):
            if x >= 1 and x + 1 < w:
                xl = x - 1
                xr = x + 1
            else:
                xl = _reflect(x - 1, w)
                xr = _reflect(x + 1, w)
            a0 = np.int32(pyr[f, r0 + xl])
            a1 = np.int32(pyr[f, r1 + xl])
            a2 = np.int32(pyr[f, r2 + xl])
            b0 = np.int32(pyr[f, r0 + x])
            b2 = np.int32(pyr[f, r2 + x])
            c0 = np.int32(pyr[f, r0 + xr])
            c1 = np.int32(pyr[f, r1 + xr])
            c2 = np.int32(pyr[f, r2 + xr])
            dx = 3 * (c0 + c2) + 10 * c1 - (3 * (a0 + a2) + 10 * a1)
            dy = 3 * (a2 + c2) + 10 * b2 - (3 * (a0 + c0) + 10 * b0)
            der[f, r1 + x, 0] = np.int16(dx)
            der[f, r1 + x, 1] = np.int16(dy)


@njit(parallel=True, cache=True)
def grey_rgb8(frames, out):
    """``(299 R + 587 G + 114 B + 500) // 1000`` of 8-bit RGB frames (the CPU path of
    :func:`~scanforest.kernels.motion.tracking.grey_u8`; the same integers)."""
    n, h, w = frames.shape[0], frames.shape[1], frames.shape[2]
    for k in prange(n * h):
        f = k // h
        y = k - f * h
        for x in range(w):
            v = (299 * np.int32(frames[f, y, x, 0]) + 587 * np.int32(frames[f, y, x, 1])
                 + 114 * np.int32(frames[f, y, x, 2]) + 500) // 1000
            out[f, y, x] = np.uint8(v)


# ---------------------------------------------------------------------------------------------
# Shi-Tomasi corners
# ---------------------------------------------------------------------------------------------
@njit(parallel=True, cache=True)
def sobel(grey, fidx, out):
    """3x3 Sobel ``(dx, dy)`` of frames ``fidx`` (reflect-101), int16 ``(K, H, W, 2)``."""
    h, w = grey.shape[1], grey.shape[2]
    nk = fidx.shape[0]
    for k in prange(nk * h):
        i = k // h
        y = k - i * h
        f = fidx[i]
        y0 = _reflect(y - 1, h)
        y2 = _reflect(y + 1, h)
        for x in range(w):
            xl = _reflect(x - 1, w)
            xr = _reflect(x + 1, w)
            a0 = np.int32(grey[f, y0, xl])
            a1 = np.int32(grey[f, y, xl])
            a2 = np.int32(grey[f, y2, xl])
            b0 = np.int32(grey[f, y0, x])
            b2 = np.int32(grey[f, y2, x])
            c0 = np.int32(grey[f, y0, xr])
            c1 = np.int32(grey[f, y, xr])
            c2 = np.int32(grey[f, y2, xr])
            out[i, y, x, 0] = np.int16((c0 + 2 * c1 + c2) - (a0 + 2 * a1 + a2))
            out[i, y, x, 1] = np.int16((a2 + 2 * b2 + c2) - (a0 + 2 * b0 + c0))


@njit(parallel=True, cache=True)
def min_eig(sob, block, s2, out):
    """Minimum eigenvalue of the structure tensor summed over a ``block`` x ``block`` box
    (reflect-101), as ``cornerMinEigenVal``: integer box sums (exact; here column sums, then
    row sums - the same integers as the GPU's direct 2-D sum), then float32
    ``(a + c) - sqrt((a - c)^2 + b^2)`` with ``a, c`` halved and everything scaled by ``s2``."""
    nk, h, w = sob.shape[0], sob.shape[1], sob.shape[2]
    lo = block // 2
    for k in prange(nk * h):
        i = k // h
        y = k - i * h
        vxx = np.zeros(w, np.int64)
        vxy = np.zeros(w, np.int64)
        vyy = np.zeros(w, np.int64)
        for j in range(block):
            yy = _reflect(y + j - lo, h)
            for x in range(w):
                dx = np.int64(sob[i, yy, x, 0])
                dy = np.int64(sob[i, yy, x, 1])
                vxx[x] += dx * dx
                vxy[x] += dx * dy
                vyy[x] += dy * dy
        sxx = np.int64(0)
        sxy = np.int64(0)
        syy = np.int64(0)
        for q in range(block):                       # box of x = 0
            xx = _reflect(q - lo, w)
            sxx += vxx[xx]
            sxy += vxy[xx]
            syy += vyy[xx]
        for x in range(w):
            if x > 0:                                # slide: drop x - 1 - lo, add x + block - 1 - lo
                xo = _reflect(x - 1 - lo, w)
                xi = _reflect(x + block - 1 - lo, w)
                sxx += vxx[xi] - vxx[xo]
                sxy += vxy[xi] - vxy[xo]
                syy += vyy[xi] - vyy[xo]
            a = np.float32(sxx) * s2 * np.float32(0.5)
            b = np.float32(sxy) * s2
            c = np.float32(syy) * s2 * np.float32(0.5)
            d = a - c
            out[i, y, x] = (a + c) - np.float32(np.sqrt(d * d + b * b))


@njit(parallel=True, cache=True)
def candidates(resp, quality, mask):
    """Corner candidates: interior pixels above ``quality`` x the frame's maximum that are the
    maximum of their 3x3 neighbourhood (OpenCV's threshold + dilate + compare)."""
    nk, h, w = resp.shape
    for i in prange(nk):
        m = np.float32(-np.inf)
        for y in range(h):
            for x in range(w):
                if resp[i, y, x] > m:
                    m = resp[i, y, x]
        thr = np.float32(np.float64(m) * quality)
        for y in range(h):
            for x in range(w):
                mask[i, y, x] = False
        for y in range(1, h - 1):
            for x in range(1, w - 1):
                v = resp[i, y, x]
                if not (v > thr):
                    continue
                ok = True
                for dy in range(-1, 2):
                    for dx in range(-1, 2):
                        if resp[i, y + dy, x + dx] > v:
                            ok = False
                mask[i, y, x] = ok


@njit(parallel=True, cache=True)
def greedy(cx, cy, starts, max_features, min_d2, out, counts):
    """Minimum-distance suppression in the given (descending response) order, per problem:
    a candidate is kept unless a kept corner lies closer than ``sqrt(min_d2)``; stops at
    ``max_features`` (OpenCV's greedy pass)."""
    nk = counts.shape[0]
    for i in prange(nk):
        n = 0
        for k in range(starts[i], starts[i + 1]):
            x = cx[k]
            y = cy[k]
            ok = True
            for j in range(n):
                dx = x - np.int64(out[i, j, 0])
                dy = y - np.int64(out[i, j, 1])
                if np.float64(dx * dx + dy * dy) < min_d2:
                    ok = False
                    break
            if ok:
                out[i, n, 0] = np.float32(x)
                out[i, n, 1] = np.float32(y)
                n += 1
                if n == max_features:
                    break
        counts[i] = n


# ---------------------------------------------------------------------------------------------
# pyramidal Lucas-Kanade (Bouguet; OpenCV's LKTrackerInvoker arithmetic)
# ---------------------------------------------------------------------------------------------
# The border reads (_img, _der) stay calls: inlined into the four bilinear sums that lk inlines, they
# made lk's first compile take 18.9 s on 2 cores (4.9 s now), with no gain at run time (5,000
# points tracked 640x480: 0.237 s inlined, 0.213 s as calls; the same tracks bit for bit).
@njit(cache=True)
def _img(pyr, f, off, h, w, x, y):
    return np.int64(pyr[f, off + _reflect(y, h) * w + _reflect(x, w)])


@njit(cache=True)
def _der(der, f, off, h, w, x, y, c):
    if x < 0 or x >= w or y < 0 or y >= h:
        return np.int64(0)
    return np.int64(der[f, off + y * w + x, c])


@njit(cache=True, inline="always")
def _bil_img(pyr, f, off, h, w, x, y, inside, w00, w01, w10, w11):
    """The 4-tap fixed-point bilinear sum of the level image at (x, y): direct reads when the
    window is ``inside`` the level, border-reflected ones otherwise (the same values there)."""
    if inside:
        a0 = off + y * w + x
        a1 = a0 + w
        return (np.int64(pyr[f, a0]) * w00 + np.int64(pyr[f, a0 + 1]) * w01
                + np.int64(pyr[f, a1]) * w10 + np.int64(pyr[f, a1 + 1]) * w11)
    return (_img(pyr, f, off, h, w, x, y) * w00 + _img(pyr, f, off, h, w, x + 1, y) * w01
            + _img(pyr, f, off, h, w, x, y + 1) * w10 + _img(pyr, f, off, h, w, x + 1, y + 1) * w11)


@njit(cache=True, inline="always")
def _bil_der(der, f, off, h, w, x, y, c, inside, w00, w01, w10, w11):
    """:func:`_bil_img` of derivative channel ``c`` (zero outside the level)."""
    if inside:
        a0 = off + y * w + x
        a1 = a0 + w
        return (np.int64(der[f, a0, c]) * w00 + np.int64(der[f, a0 + 1, c]) * w01
                + np.int64(der[f, a1, c]) * w10 + np.int64(der[f, a1 + 1, c]) * w11)
    return (_der(der, f, off, h, w, x, y, c) * w00 + _der(der, f, off, h, w, x + 1, y, c) * w01
            + _der(der, f, off, h, w, x, y + 1, c) * w10 + _der(der, f, off, h, w, x + 1, y + 1, c) * w11)


@njit(cache=True, inline="always")
def _descale(v, n):
    return (v + (1 << (n - 1))) >> n


@njit(cache=True, inline="always")
def _weights(a, b):
    one = np.float32(1.0)
    sc = np.float32(1 << W_BITS)
    w00 = np.int64(np.rint((one - a) * (one - b) * sc))
    w01 = np.int64(np.rint(a * (one - b) * sc))
    w10 = np.int64(np.rint((one - a) * b * sc))
    w11 = (1 << W_BITS) - w00 - w01 - w10
    return w00, w01, w10, w11


@njit(parallel=True, cache=True)
def lk(pyr, der, lv, nlev, fprev, fnext, pts, init, use_init, counts, win, iters, eps2,
       min_eig_thr, out, status):
    """Track ``pts[k, i]`` (``i < counts[k]``) from frame ``fprev[k]`` to ``fnext[k]``.

    ``init`` (same layout) is the starting guess in the next frame when ``use_init``; the
    result goes to ``out`` and ``status`` (1 tracked, 0 lost: left the frame or a window with a
    too small minimum eigenvalue at level 0).
    """
    nk, npt = pts.shape[0], pts.shape[1]
    half = np.float32((win - 1) * 0.5)
    area = win * win
    mdiv = np.float32(2 * area)
    for g in prange(nk * npt):
        k = g // npt
        i = g - k * npt
        if i >= counts[k]:
            continue
        fp = fprev[k]
        fn = fnext[k]
        ib = np.empty(area, np.int64)
        ibx = np.empty(area, np.int64)
        iby = np.empty(area, np.int64)
        st = True
        nx = np.float32(0.0)
        ny = np.float32(0.0)
        for level in range(nlev - 1, -1, -1):
            h = lv[level, 0]
            w = lv[level, 1]
            off = lv[level, 2]
            sc = np.float32(1.0 / (1 << level))
            px = pts[k, i, 0] * sc
            py = pts[k, i, 1] * sc
            if level == nlev - 1:
                if use_init:
                    nx = init[k, i, 0] * sc
                    ny = init[k, i, 1] * sc
                else:
                    nx = px
                    ny = py
            else:
                nx = nx * np.float32(2.0)
                ny = ny * np.float32(2.0)
            px = px - half
            py = py - half
            # floor(p) in [-win, size) <=> p in [-win, size) (integer bounds); NaN fails too
            if not (px >= -win and px < w and py >= -win and py < h):
                if level == 0:
                    st = False
                continue
            ipx = np.int64(np.floor(px))
            ipy = np.int64(np.floor(py))
            a = px - np.float32(ipx)
            b = py - np.float32(ipy)
            w00, w01, w10, w11 = _weights(a, b)
            s11 = np.int64(0)
            s12 = np.int64(0)
            s22 = np.int64(0)
            inside = ipx >= 0 and ipy >= 0 and ipx + win < w and ipy + win < h
            for yy in range(win):
                for xx in range(win):
                    q = yy * win + xx
                    X = ipx + xx
                    Y = ipy + yy
                    ival = _descale(_bil_img(pyr, fp, off, h, w, X, Y, inside, w00, w01, w10, w11), W_BITS - 5)
                    ixv = _descale(_bil_der(der, fp, off, h, w, X, Y, 0, inside, w00, w01, w10, w11), W_BITS)
                    iyv = _descale(_bil_der(der, fp, off, h, w, X, Y, 1, inside, w00, w01, w10, w11), W_BITS)
                    ib[q] = ival
                    ibx[q] = ixv
                    iby[q] = iyv
                    s11 += ixv * ixv
                    s12 += ixv * iyv
                    s22 += iyv * iyv
            A11 = np.float32(s11) * FLT_SCALE
            A12 = np.float32(s12) * FLT_SCALE
            A22 = np.float32(s22) * FLT_SCALE
            D = A11 * A22 - A12 * A12
            dd = A11 - A22
            mev = (A22 + A11 - np.float32(np.sqrt(dd * dd + np.float32(4.0) * A12 * A12))) / mdiv
            if mev < min_eig_thr or D < FLT_EPSILON:
                if level == 0:
                    st = False
                continue
            D = np.float32(1.0) / D
            qx = nx - half
            qy = ny - half
            pdx = np.float32(0.0)
            pdy = np.float32(0.0)
            for j in range(iters):
                if not (qx >= -win and qx < w and qy >= -win and qy < h):
                    if level == 0:
                        st = False
                    break
                inx = np.int64(np.floor(qx))
                iny = np.int64(np.floor(qy))
                a = qx - np.float32(inx)
                b = qy - np.float32(iny)
                w00, w01, w10, w11 = _weights(a, b)
                b1 = np.int64(0)
                b2 = np.int64(0)
                inside = inx >= 0 and iny >= 0 and inx + win < w and iny + win < h
                for yy in range(win):
                    for xx in range(win):
                        q = yy * win + xx
                        diff = _descale(_bil_img(pyr, fn, off, h, w, inx + xx, iny + yy, inside,
                                                 w00, w01, w10, w11), W_BITS - 5) - ib[q]
                        b1 += diff * ibx[q]
                        b2 += diff * iby[q]
                fb1 = np.float32(b1) * FLT_SCALE
                fb2 = np.float32(b2) * FLT_SCALE
                ddx = (A12 * fb2 - A22 * fb1) * D
                ddy = (A12 * fb1 - A11 * fb2) * D
                qx = qx + ddx
                qy = qy + ddy
                nx = qx + half
                ny = qy + half
                if np.float64(ddx) * np.float64(ddx) + np.float64(ddy) * np.float64(ddy) <= eps2:
                    break
                if j > 0 and abs(ddx + pdx) < 0.01 and abs(ddy + pdy) < 0.01:
                    nx = nx - ddx * np.float32(0.5)
                    ny = ny - ddy * np.float32(0.5)
                    break
                pdx = ddx
                pdy = ddy
        out[k, i, 0] = nx
        out[k, i, 1] = ny
        status[k, i] = 1 if st else 0


# ---------------------------------------------------------------------------------------------
# host wrappers (same signatures as the GPU backend's)
# ---------------------------------------------------------------------------------------------
def build_pyramids(grey: np.ndarray, lv: np.ndarray):
    """Pyramids (``pyr``) and Scharr derivatives (``der``) of every frame of ``grey``."""
    n = grey.shape[0]
    size = int(lv[-1, 2] + lv[-1, 0] * lv[-1, 1])
    pyr = np.empty((n, size), np.uint8)
    pyr[:, :grey.shape[1] * grey.shape[2]] = grey.reshape(n, -1)
    for level in range(1, len(lv)):
        (sh, sw, so), (dh, dw, do) = lv[level - 1], lv[level]
        pyr_down(pyr, so, sh, sw, do, dh, dw)
    der = np.empty((n, size, 2), np.int16)
    for h, w, off in lv:
        scharr(pyr, der, off, h, w)
    return pyr, der


def detect(grey: np.ndarray, fidx: np.ndarray, max_features: int, quality: float,
           min_d2: float, block_size: int):
    """Shi-Tomasi corners of frames ``fidx``: ``(K, max_features, 2)`` float32 slots and
    ``(K,)`` int32 counts."""
    k = len(fidx)
    h, w = grey.shape[1:]
    fidx = np.ascontiguousarray(fidx, np.int64)
    sob = np.empty((k, h, w, 2), np.int16)
    sobel(grey, fidx, sob)
    resp = np.empty((k, h, w), np.float32)
    min_eig(sob, int(block_size), response_scale(block_size), resp)
    mask = np.empty((k, h, w), np.bool_)
    candidates(resp, float(quality), mask)
    kk, yy, xx = np.nonzero(mask)
    order = np.lexsort((-(yy * w + xx), -resp[kk, yy, xx], kk))
    starts = np.searchsorted(kk[order], np.arange(k + 1)).astype(np.int64)
    out = np.zeros((k, max_features, 2), np.float32)
    counts = np.zeros(k, np.int32)
    greedy(xx[order].astype(np.int64), yy[order].astype(np.int64), starts, int(max_features),
           float(min_d2), out, counts)
    return out, counts


def response_scale(block_size: int) -> np.float32:
    """``cornerMinEigenVal``'s derivative scale, squared: ``1 / (4 block 255)^2`` (3x3 Sobel of
    8-bit images)."""
    s = 1.0 / (4.0 * block_size * 255.0)
    return np.float32(s * s)


def track(pyr, der, lv, fprev, fnext, pts, counts, init, win, iters, eps2, min_eig_thr):
    """Lucas-Kanade of the point slots ``pts`` (K, P, 2): ``(out (K, P, 2) float32, status
    (K, P) uint8)``."""
    out = np.zeros(pts.shape, np.float32)
    status = np.zeros(pts.shape[:2], np.uint8)
    use_init = init is not None
    lk(pyr, der, np.ascontiguousarray(lv, np.int64), len(lv),
       np.ascontiguousarray(fprev, np.int64), np.ascontiguousarray(fnext, np.int64),
       np.ascontiguousarray(pts, np.float32),
       np.ascontiguousarray(init if use_init else pts, np.float32), use_init,
       np.ascontiguousarray(counts, np.int64), int(win), int(iters), float(eps2),
       np.float32(min_eig_thr), out, status)
    return out, status
