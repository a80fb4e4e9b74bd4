"""numba CPU backend of SHOT352 (PCL 1.13 ``SHOTEstimation`` + ``SHOTLocalReferenceFrameEstimation``).

Every step follows PCL's arithmetic: float32 differences and dot products, float64 covariance,
float32 histogram accumulation; see ``descriptors/shot.py`` for the definition. The CUDA kernels in
``shot_gpu.py`` use the same operations in the same precision.
"""
from __future__ import annotations

import math

import numpy as np

from ..jit import njit, prange
from ..geom_cpu import cov_eig3
from ..neighbors.search_cpu import argsort_key_index

NBINS = 10
DESC_LEN = 352

PST_RAD_45 = 0.78539816339744830961566084581988
PST_RAD_90 = 1.5707963267948966192313216916398
PST_RAD_135 = 2.3561944901923449288469825374596
PST_RAD_PI_7_8 = 2.7488935718910690836548129603691


@njit(cache=True)
def _median_window(idx, d2, vj, valid):
    """List positions of the valid neighbours ranked med-2 .. med+2 by (d2, index)."""
    keys = np.empty(valid, np.float32)
    ids = np.empty(valid, np.int64)
    for t in range(valid):
        keys[t] = d2[vj[t]]
        ids[t] = idx[vj[t]]
    o = argsort_key_index(keys, ids)  # by distance, ties by index
    med = valid // 2
    out = np.empty(5, np.int64)
    for t in range(5):
        out[t] = o[med - 2 + t]
    return out


@njit(cache=True)
def lrf_one(c, surf, idx, d2, R, rows, frame):
    """PCL's getLocalRF for keypoint ``c`` with neighbour list (idx, d2) in any order.

    ``rows`` is scratch (n, 3) float64. Writes frame rows x, y, z into ``frame`` (3, 3)
    float32. Returns False (frame NaN) when fewer than 5 non-coincident neighbours remain or
    the eigen-solver fails.
    """
    n = idx.shape[0]
    valid = 0
    vj = np.empty(max(n, 1), np.int64)
    wts = np.empty(max(n, 1), np.float64)
    for j in range(n):
        p = idx[j]
        if surf[p, 0] == c[0] and surf[p, 1] == c[1] and surf[p, 2] == c[2]:
            continue
        vj[valid] = j
        vx = np.float64(np.float32(surf[p, 0] - c[0]))
        vy = np.float64(np.float32(surf[p, 1] - c[1]))
        vz = np.float64(np.float32(surf[p, 2] - c[2]))
        rows[valid, 0] = vx
        rows[valid, 1] = vy
        rows[valid, 2] = vz
        wts[valid] = R - np.float64(np.float32(math.sqrt(d2[j])))
        valid += 1
    if valid < 5:
        for a in range(3):
            for b in range(3):
                frame[a, b] = np.nan
        return False
    # PCL's frame covariance: float32 differences (widened), about the keypoint, weighted by R - d
    C = np.empty((3, 3), np.float64)
    ev = np.empty(3, np.float64)
    V = np.empty((3, 3), np.float64)
    ok = cov_eig3(rows, valid, 0.0, 0.0, 0.0, wts, C, ev, V)
    if not ok:
        for a in range(3):
            for b in range(3):
                frame[a, b] = np.nan
        return False
    x0 = V[0, 2]
    x1 = V[1, 2]
    x2 = V[2, 2]
    z0 = V[0, 0]
    z1 = V[1, 0]
    z2 = V[2, 0]
    plus_x = 0
    plus_z = 0
    for j in range(valid):
        if rows[j, 0] * x0 + rows[j, 1] * x1 + rows[j, 2] * x2 >= 0.0:
            plus_x += 1
        if rows[j, 0] * z0 + rows[j, 1] * z1 + rows[j, 2] * z2 >= 0.0:
            plus_z += 1
    plus_x = 2 * plus_x - valid
    plus_z = 2 * plus_z - valid
    win = np.empty(5, np.int64)
    if plus_x == 0 or plus_z == 0:
        w5 = _median_window(idx, d2, vj, valid)
        for t in range(5):
            win[t] = w5[t]
    if plus_x == 0:
        for t in range(5):
            j = win[t]
            if rows[j, 0] * x0 + rows[j, 1] * x1 + rows[j, 2] * x2 > 0.0:
                plus_x += 1
        if plus_x < 3:
            x0 = -x0
            x1 = -x1
            x2 = -x2
    elif plus_x < 0:
        x0 = -x0
        x1 = -x1
        x2 = -x2
    if plus_z == 0:
        for t in range(5):
            j = win[t]
            if rows[j, 0] * z0 + rows[j, 1] * z1 + rows[j, 2] * z2 > 0.0:
                plus_z += 1
        if plus_z < 3:
            z0 = -z0
            z1 = -z1
            z2 = -z2
    elif plus_z < 0:
        z0 = -z0
        z1 = -z1
        z2 = -z2
    fx0 = np.float32(x0)
    fx1 = np.float32(x1)
    fx2 = np.float32(x2)
    fz0 = np.float32(z0)
    fz1 = np.float32(z1)
    fz2 = np.float32(z2)
    frame[0, 0] = fx0
    frame[0, 1] = fx1
    frame[0, 2] = fx2
    frame[2, 0] = fz0
    frame[2, 1] = fz1
    frame[2, 2] = fz2
    frame[1, 0] = np.float32(np.float32(fz1 * fx2) - np.float32(fz2 * fx1))
    frame[1, 1] = np.float32(np.float32(fz2 * fx0) - np.float32(fz0 * fx2))
    frame[1, 2] = np.float32(np.float32(fz0 * fx1) - np.float32(fz1 * fx0))
    return True


@njit(cache=True, inline="always")
def dot32(ax, ay, az, bx, by, bz):
    return np.float32(np.float32(np.float32(ax * bx) + np.float32(ay * by)) + np.float32(az * bz))


@njit(cache=True)
def shot_one(c, surf, snrm, idx, d2, R, frame, shot):
    """PCL's computePointSHOT (shape only, 10 cosine bins) into ``shot`` (352,) float32."""
    n = idx.shape[0]
    r12 = R / 2
    r14 = R / 4
    r34 = (R * 3) / 4
    for b in range(DESC_LEN):
        shot[b] = np.float32(0.0)
    fx0 = frame[0, 0]
    fx1 = frame[0, 1]
    fx2 = frame[0, 2]
    fy0 = frame[1, 0]
    fy1 = frame[1, 1]
    fy2 = frame[1, 2]
    fz0 = frame[2, 0]
    fz1 = frame[2, 1]
    fz2 = frame[2, 2]
    for j in range(n):
        p = idx[j]
        nx = snrm[p, 0]
        ny = snrm[p, 1]
        nz = snrm[p, 2]
        if not (np.isfinite(nx) and np.isfinite(ny) and np.isfinite(nz)):
            continue
        distance = np.float64(np.float32(math.sqrt(d2[j])))
        if abs(distance) < 1e-15:
            continue
        cosd = np.float64(dot32(nx, ny, nz, fz0, fz1, fz2))
        if cosd > 1.0:
            cosd = 1.0
        if cosd < -1.0:
            cosd = -1.0
        bdist = ((1.0 + cosd) * NBINS) / 2
        dx = np.float32(surf[p, 0] - c[0])
        dy = np.float32(surf[p, 1] - c[1])
        dz = np.float32(surf[p, 2] - c[2])
        xr = np.float64(dot32(dx, dy, dz, fx0, fx1, fx2))
        yr = np.float64(dot32(dx, dy, dz, fy0, fy1, fy2))
        zr = np.float64(dot32(dx, dy, dz, fz0, fz1, fz2))
        if abs(yr) < 1e-30:
            yr = 0.0
        if abs(xr) < 1e-30:
            xr = 0.0
        if abs(zr) < 1e-30:
            zr = 0.0
        bit4 = 1 if ((yr > 0) or ((yr == 0.0) and (xr < 0))) else 0
        if (xr > 0) or ((xr == 0.0) and (yr > 0)):
            bit3 = 1 - bit4
        else:
            bit3 = bit4
        desc_index = (bit4 << 3) + (bit3 << 2)
        desc_index = desc_index << 1
        if (xr * yr > 0) or (xr == 0.0):
            desc_index += 0 if abs(xr) >= abs(yr) else 4
        else:
            desc_index += 4 if abs(xr) > abs(yr) else 0
        desc_index += 1 if zr > 0 else 0
        desc_index += 2 if distance > r12 else 0

        step_index = int(math.floor(bdist + 0.5))
        volume_index = desc_index * (NBINS + 1)
        bdist -= step_index
        int_weight = 1 - abs(bdist)
        if bdist > 0:
            shot[volume_index + ((step_index + 1) % NBINS)] += np.float32(bdist)
        else:
            shot[volume_index + ((step_index - 1 + NBINS) % NBINS)] += -np.float32(bdist)

        if distance > r12:
            rd = (distance - r34) / r12
            if distance > r34:
                int_weight += 1 - rd
            else:
                int_weight += 1 + rd
                shot[(desc_index - 2) * (NBINS + 1) + step_index] -= np.float32(rd)
        else:
            rd = (distance - r14) / r12
            if distance < r14:
                int_weight += 1 + rd
            else:
                int_weight += 1 - rd
                shot[(desc_index + 2) * (NBINS + 1) + step_index] += np.float32(rd)

        icos = zr / distance
        if icos < -1.0:
            icos = -1.0
        if icos > 1.0:
            icos = 1.0
        incl = math.acos(icos)
        if incl > PST_RAD_90 or (abs(incl - PST_RAD_90) < 1e-30 and zr <= 0):
            idist = (incl - PST_RAD_135) / PST_RAD_90
            if incl > PST_RAD_135:
                int_weight += 1 - idist
            else:
                int_weight += 1 + idist
                shot[(desc_index + 1) * (NBINS + 1) + step_index] -= np.float32(idist)
        else:
            idist = (incl - PST_RAD_45) / PST_RAD_90
            if incl < PST_RAD_45:
                int_weight += 1 + idist
            else:
                int_weight += 1 - idist
                shot[(desc_index - 1) * (NBINS + 1) + step_index] += np.float32(idist)

        if yr != 0.0 or xr != 0.0:
            azimuth = math.atan2(yr, xr)
            sel = desc_index >> 2
            adist = (azimuth - (-PST_RAD_PI_7_8 + PST_RAD_45 * sel)) / PST_RAD_45
            adist = max(-0.5, min(adist, 0.5))
            if adist > 0:
                int_weight += 1 - adist
                ii = (desc_index + 4) % 32
                shot[ii * (NBINS + 1) + step_index] += np.float32(adist)
            else:
                ii = (desc_index - 4 + 32) % 32
                int_weight += 1 + adist
                shot[ii * (NBINS + 1) + step_index] -= np.float32(adist)

        shot[volume_index + step_index] += np.float32(int_weight)

    acc = 0.0
    for b in range(DESC_LEN):
        acc += np.float64(np.float32(shot[b] * shot[b]))
    acc = math.sqrt(acc)
    fa = np.float32(acc)
    if fa == 0.0:  # no neighbour with a finite normal: PCL divides 0/0 and yields NaN (so does the GPU)
        for b in range(DESC_LEN):
            shot[b] = np.nan
        return
    for b in range(DESC_LEN):
        shot[b] = np.float32(shot[b] / fa)


@njit(cache=True, parallel=True)
def shot_csr(kp, surf, snrm, off, idx, d2, R, desc, frames):
    """SHOT for every keypoint ``kp[i]`` with neighbour list ``off[i]:off[i+1]`` (sorted)."""
    nk = kp.shape[0]
    for i in prange(nk):
        s = off[i]
        e = off[i + 1]
        rows = np.empty((max(e - s, 1), 3), np.float64)
        ok = lrf_one(kp[i], surf, idx[s:e], d2[s:e], R, rows, frames[i])
        if not ok or (e - s) < 5:
            for b in range(DESC_LEN):
                desc[i, b] = np.nan
            for a in range(3):
                for b in range(3):
                    frames[i, a, b] = np.nan
            continue
        shot_one(kp[i], surf, snrm, idx[s:e], d2[s:e], R, frames[i], desc[i])
