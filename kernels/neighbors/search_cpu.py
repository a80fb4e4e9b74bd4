"""numba helpers of the CPU neighbour search (exact float32 rule, segment sort, cap).

A public module: SHOT counts its neighbour lists with :func:`grid_radius` and recognition's
verification scans the scene's cell list with :func:`verify_points`.
"""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange


@njit(cache=True, inline="always")
def sqdist32(qx, qy, qz, px, py, pz):
    """float32 squared distance, FLANN order: ((dx*dx + dy*dy) + dz*dz)."""
    dx = np.float32(qx - px)
    dy = np.float32(qy - py)
    dz = np.float32(qz - pz)
    return np.float32(np.float32(np.float32(dx * dx) + np.float32(dy * dy)) + np.float32(dz * dz))


# The neighbour lists are ordered by (squared distance, index) with the two helpers below rather
# than numba's np.argsort / np.sort / np.partition: the same order and values, and a first run on a
# machine compiles them in a fraction of the time numba's generic sort and partition take.
@njit(cache=True)
def argsort_key_index(keys, ids):
    """The permutation that orders positions by (``keys``, ``ids``) ascending: a bottom-up merge
    sort (stable; ties of both keep their order)."""
    n = keys.shape[0]
    a = np.arange(n)
    b = np.empty(n, np.int64)
    width = 1
    while width < n:
        i = 0
        while i < n:
            mid = min(i + width, n)
            hi = min(i + 2 * width, n)
            lo, r, k = i, mid, i
            while lo < mid and r < hi:
                x, y = a[lo], a[r]
                if keys[y] < keys[x] or (keys[y] == keys[x] and ids[y] < ids[x]):
                    b[k] = y
                    r += 1
                else:
                    b[k] = x
                    lo += 1
                k += 1
            while lo < mid:
                b[k] = a[lo]
                lo += 1
                k += 1
            while r < hi:
                b[k] = a[r]
                r += 1
                k += 1
            i += 2 * width
        a, b = b, a
        width *= 2
    return a


@njit(cache=True)
def kth_smallest(values, k):
    """The ``k``-th smallest of ``values`` (0-based; ``values`` is left as it was): quickselect on
    a copy."""
    a = values.copy()
    lo, hi = 0, a.shape[0] - 1
    while lo < hi:
        pivot = a[(lo + hi) // 2]
        i, j = lo, hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while pivot < a[j]:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            break
    return a[k]


@njit(cache=True)
def _sort_segment(idx, d2):
    """In-place sort of one segment by (d2, idx)."""
    n = idx.shape[0]
    if n < 2:
        return
    order = argsort_key_index(d2, idx)
    i2 = idx.copy()
    e2 = d2.copy()
    for t in range(n):  # plain loops: numba's fancy indexing and slice assignment compile slowly
        idx[t] = i2[order[t]]
        d2[t] = e2[order[t]]


# ---------------------------------------------------------------------------------------------
# uniform grid (cell list), the CPU twin of search_gpu
# ---------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _cell(v, o, inv_h, d):
    c = int(np.floor(np.float32(np.float32(v - o) * inv_h)))
    if c < 0:
        c = 0
    if c > d - 1:
        c = d - 1
    return c


@njit(cache=True, parallel=True)
def cell_ids(pts, origin, inv_h, dims):
    n = pts.shape[0]
    out = np.empty(n, np.int64)
    for i in prange(n):
        cx = _cell(pts[i, 0], origin[0], inv_h, dims[0])
        cy = _cell(pts[i, 1], origin[1], inv_h, dims[1])
        cz = _cell(pts[i, 2], origin[2], inv_h, dims[2])
        out[i] = (cz * dims[1] + cy) * dims[0] + cx
    return out


@njit(cache=True)
def cell_order(cid, ncells, pts):
    """Counting sort of the points by cell: ``(sorted points (float32, C order), order, cell
    starts)``, ``order`` stable (by index within a cell), ``starts`` of length ``ncells + 1``."""
    n = cid.shape[0]
    cs = np.zeros(ncells + 1, np.int64)
    for i in range(n):
        cs[cid[i] + 1] += 1
    for c in range(ncells):
        cs[c + 1] += cs[c]
    pos = cs[:-1].copy()
    order = np.empty(n, np.int64)
    P = np.empty((n, 3), np.float32)
    for i in range(n):
        c = cid[i]
        j = pos[c]
        pos[c] = j + 1
        order[j] = i
        P[j, 0] = pts[i, 0]
        P[j, 1] = pts[i, 1]
        P[j, 2] = pts[i, 2]
    return P, order, cs


@njit(cache=True)
def _scan(P, cs, origin, inv_h, dims, qx, qy, qz, r2, oidx, od2, w, fill):
    cx = _cell(qx, origin[0], inv_h, dims[0])
    cy = _cell(qy, origin[1], inv_h, dims[1])
    cz = _cell(qz, origin[2], inv_h, dims[2])
    x0 = max(cx - 1, 0)
    x1 = min(cx + 1, dims[0] - 1)
    cnt = 0
    for z in range(max(cz - 1, 0), min(cz + 1, dims[2] - 1) + 1):
        for y in range(max(cy - 1, 0), min(cy + 1, dims[1] - 1) + 1):
            base = (z * dims[1] + y) * dims[0]
            for j in range(cs[base + x0], cs[base + x1 + 1]):
                d = sqdist32(qx, qy, qz, P[j, 0], P[j, 1], P[j, 2])
                if d < r2:
                    if fill:
                        oidx[w + cnt] = j
                        od2[w + cnt] = d
                    cnt += 1
    return cnt


@njit(cache=True)
def _select_nearest(idx, d2, m):
    """Move the m nearest entries (by d2, then index) to the front, in O(n)."""
    n = idx.shape[0]
    thr = kth_smallest(d2, m - 1)
    less = 0
    for j in range(n):
        if d2[j] < thr:
            less += 1
    need = m - less
    # indices of the entries equal to the threshold, smallest first
    eq = np.empty(n, np.int64)
    ne = 0
    for j in range(n):
        if d2[j] == thr:
            eq[ne] = idx[j]
            ne += 1
    lim = kth_smallest(eq[:ne], need - 1)
    w = 0
    for j in range(n):
        if d2[j] < thr or (d2[j] == thr and idx[j] <= lim):
            i = idx[j]
            d = d2[j]
            idx[j] = idx[w]
            d2[j] = d2[w]
            idx[w] = i
            d2[w] = d
            w += 1


@njit(cache=True, parallel=True)
def grid_radius(P, order, cs, origin, inv_h, dims, qs, r2, cap, do_sort):
    """CSR lists (original indices) of all P within sqrt(r2) of each query; sorted by
    (d2, index) when do_sort or cap > 0, capped at ``cap`` entries when cap > 0."""
    nq = qs.shape[0]
    dummy_i = np.empty(0, np.int64)
    dummy_d = np.empty(0, np.float32)
    counts = np.empty(nq, np.int64)
    for q in prange(nq):
        counts[q] = _scan(P, cs, origin, inv_h, dims, qs[q, 0], qs[q, 1], qs[q, 2], r2,
                          dummy_i, dummy_d, 0, False)
    off = np.zeros(nq + 1, np.int64)
    for q in range(nq):
        off[q + 1] = off[q] + counts[q]
    idx = np.empty(off[nq], np.int64)
    d2 = np.empty(off[nq], np.float32)
    keep = np.empty(nq, np.int64)
    for q in prange(nq):
        s = off[q]
        n = _scan(P, cs, origin, inv_h, dims, qs[q, 0], qs[q, 1], qs[q, 2], r2, idx, d2, s, True)
        for j in range(s, s + n):
            idx[j] = order[idx[j]]
        if do_sort and n > 1:
            _sort_segment(idx[s:s + n], d2[s:s + n])
        elif cap > 0 and n > cap:
            _select_nearest(idx[s:s + n], d2[s:s + n], cap)
        keep[q] = n if (cap <= 0 or n <= cap) else cap
    if cap <= 0:
        return off, idx, d2
    out_off = np.zeros(nq + 1, np.int64)
    for q in range(nq):
        out_off[q + 1] = out_off[q] + keep[q]
    out_idx = np.empty(out_off[nq], np.int64)
    out_d2 = np.empty(out_off[nq], np.float32)
    for q in prange(nq):
        s = off[q]
        o = out_off[q]
        for j in range(keep[q]):
            out_idx[o + j] = idx[s + j]
            out_d2[o + j] = d2[s + j]
    return out_off, out_idx, out_d2


@njit(cache=True, inline="always")
def grid_nearest(P, cs, origin, inv_h, dims, qx, qy, qz, r2):
    """Index (into the cell-sorted P) of the nearest point strictly within sqrt(r2), or -1;
    the first of equals in cell order, as the GPU's device function of that name (ICP and
    verification inline it)."""
    cx = _cell(qx, origin[0], inv_h, dims[0])
    cy = _cell(qy, origin[1], inv_h, dims[1])
    cz = _cell(qz, origin[2], inv_h, dims[2])
    x0 = max(cx - 1, 0)
    x1 = min(cx + 1, dims[0] - 1)
    best = r2
    bi = -1
    for z in range(max(cz - 1, 0), min(cz + 1, dims[2] - 1) + 1):
        for y in range(max(cy - 1, 0), min(cy + 1, dims[1] - 1) + 1):
            base = (z * dims[1] + y) * dims[0]
            for j in range(cs[base + x0], cs[base + x1 + 1]):
                d = sqdist32(qx, qy, qz, P[j, 0], P[j, 1], P[j, 2])
                if d < best:
                    best = d
                    bi = j
    return bi


@njit(cache=True, parallel=True)
def grid_nearest_many(P, cs, origin, inv_h, dims, Q, r2, out_i, out_d2):
    """CPU twin of the GPU ``nearest`` kernel: for each query (rows of ``Q``, taken as float32),
    the index (into the cell-sorted P) of the nearest point strictly within sqrt(r2), the first
    of equals in cell order, or -1; and its float32 squared distance (inf without one). The
    grid's cells must be at least sqrt(r2) wide."""
    for i in prange(Q.shape[0]):
        qx = np.float32(Q[i, 0])
        qy = np.float32(Q[i, 1])
        qz = np.float32(Q[i, 2])
        bi = grid_nearest(P, cs, origin, inv_h, dims, qx, qy, qz, r2)
        out_i[i] = bi
        out_d2[i] = sqdist32(qx, qy, qz, P[bi, 0], P[bi, 1], P[bi, 2]) if bi >= 0 else np.float32(np.inf)


@njit(cache=True, parallel=True)
def verify_points(hyp, src, T, VP, VN, vx, vy, vz, P, cs, origin, inv_h, dims, r2, order, vox):
    """CPU twin of the GPU ``verify_points`` kernel: for every (hypothesis, verification point)
    pair, the point and normal are moved by the hypothesis pose (float32, rows of T = [R | t]);
    -2 when the normal does not face the viewpoint, else the voxel rank of the nearest scene
    point strictly within sqrt(r2), or -1 when there is none."""
    n = hyp.shape[0]
    out = np.empty(n, np.int64)
    for i in prange(n):
        t = T[hyp[i]]
        s = src[i]
        px = VP[s, 0]
        py = VP[s, 1]
        pz = VP[s, 2]
        nx = VN[s, 0]
        ny = VN[s, 1]
        nz = VN[s, 2]
        wx = t[0] * px + t[1] * py + t[2] * pz + t[3]
        wy = t[4] * px + t[5] * py + t[6] * pz + t[7]
        wz = t[8] * px + t[9] * py + t[10] * pz + t[11]
        mx = t[0] * nx + t[1] * ny + t[2] * nz
        my = t[4] * nx + t[5] * ny + t[6] * nz
        mz = t[8] * nx + t[9] * ny + t[10] * nz
        if mx * (wx - vx) + my * (wy - vy) + mz * (wz - vz) >= 0:
            out[i] = -2
            continue
        bi = grid_nearest(P, cs, origin, inv_h, dims, wx, wy, wz, r2)
        out[i] = vox[order[bi]] if bi >= 0 else -1
    return out


@njit(cache=True, inline="always")
def insert_sorted(dist, ids, cnt, k, dv, iv):
    """Insert (dv, iv) into the ascending (distance, id) list ``dist``/``ids`` holding ``cnt <= k``
    entries; returns the new count (an entry not below the last of a full list is dropped). The
    k-NN lists here and the exact brute force's (:mod:`scanforest.kernels.knn.bruteforce`) keep
    theirs with it."""
    if cnt == k:
        last = k - 1
        if dv > dist[last] or (dv == dist[last] and iv >= ids[last]):
            return cnt
        pos = last
    else:
        pos = cnt
        cnt += 1
    while pos > 0 and (dist[pos - 1] > dv or (dist[pos - 1] == dv and ids[pos - 1] > iv)):
        dist[pos] = dist[pos - 1]
        ids[pos] = ids[pos - 1]
        pos -= 1
    dist[pos] = dv
    ids[pos] = iv
    return cnt


@njit(cache=True, parallel=True)
def grid_knn(P, order, cs, origin, inv_h, dims, qs, k, out_i, out_d2):
    """The exact ``k`` nearest points of each query (float32 :func:`sqdist32`, ties by the
    smaller index, the order of :func:`grid_radius`'s sorted lists), from the cell list: the query's
    cell, then shells of cells around it, until the ``k``-th distance lies inside the block
    searched (or the block covers the grid). ``order`` maps the cell-sorted ``P`` to indices."""
    h = 1.0 / np.float64(inv_h)
    span = 0.0
    for a in range(3):
        span = max(span, abs(np.float64(origin[a])) + dims[a] * h)
    eps = 4e-6 * span + 1e-30  # float32 cell assignment and coordinates: a point's cell may be off by this
    for q in prange(qs.shape[0]):
        qx = np.float32(qs[q, 0])
        qy = np.float32(qs[q, 1])
        qz = np.float32(qs[q, 2])
        c0 = _cell(qx, origin[0], inv_h, dims[0])
        c1 = _cell(qy, origin[1], inv_h, dims[1])
        c2 = _cell(qz, origin[2], inv_h, dims[2])
        bd = out_d2[q]
        bi = out_i[q]
        cnt = 0
        r = 0
        while True:
            for z in range(max(c2 - r, 0), min(c2 + r, dims[2] - 1) + 1):
                zs = abs(z - c2) == r
                for y in range(max(c1 - r, 0), min(c1 + r, dims[1] - 1) + 1):
                    base = (z * dims[1] + y) * dims[0]
                    if zs or abs(y - c1) == r:  # a face row of the shell: every x of the block
                        x0 = max(c0 - r, 0)
                        x1 = min(c0 + r, dims[0] - 1)
                        for j in range(cs[base + x0], cs[base + x1 + 1]):
                            cnt = insert_sorted(bd, bi, cnt, k,
                                              sqdist32(qx, qy, qz, P[j, 0], P[j, 1], P[j, 2]), order[j])
                    else:  # inside rows: the shell's two ends
                        for x in (c0 - r, c0 + r):
                            if 0 <= x < dims[0]:
                                for j in range(cs[base + x], cs[base + x + 1]):
                                    cnt = insert_sorted(bd, bi, cnt, k,
                                                      sqdist32(qx, qy, qz, P[j, 0], P[j, 1], P[j, 2]), order[j])
            # every point outside the block is farther than g: the nearest face with cells beyond it
            g = np.inf
            whole = True
            for a in range(3):
                c = c0 if a == 0 else (c1 if a == 1 else c2)
                v = np.float64(qx if a == 0 else (qy if a == 1 else qz))
                if c - r > 0:
                    g = min(g, v - (np.float64(origin[a]) + (c - r) * h))
                    whole = False
                if c + r < dims[a] - 1:
                    g = min(g, np.float64(origin[a]) + (c + r + 1) * h - v)
                    whole = False
            if whole:
                break
            g -= eps
            if cnt == k and g > 0 and np.float64(bd[k - 1]) < g * g * (1.0 - 1e-5):
                break
            r += 1
