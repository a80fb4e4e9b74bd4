"""numba backends of :func:`.keypoints.voxel_grid` (voxel centroids) and :func:`.keypoints.voxel_ranks`:
a hash of the occupied voxels (one pass over the points, no sort of them; only the occupied
voxels' keys are sorted)."""
from __future__ import annotations

import math

import numpy as np

from ..jit import njit


@njit(cache=True)
def voxel_bounds(P, inv):
    """The lowest voxel and the grid's extent in voxels (int64 (3,) each) of the float32 points
    ``P`` in voxels of ``1 / inv`` (float32 product, then floor)."""
    lo = np.empty(3, np.float32)
    hi = np.empty(3, np.float32)
    for j in range(3):
        lo[j] = P[0, j]
        hi[j] = P[0, j]
    for i in range(1, P.shape[0]):
        for j in range(3):
            v = P[i, j]
            if v < lo[j]:
                lo[j] = v
            elif v > hi[j]:
                hi[j] = v
    a = np.empty(3, np.int64)
    d = np.empty(3, np.int64)
    for j in range(3):  # floor is monotone: the corners' voxels bound every point's
        a[j] = np.int64(math.floor(lo[j] * inv))
        d[j] = np.int64(math.floor(hi[j] * inv)) - a[j] + 1
    return a, d


@njit(cache=True)
def _table(n):
    """An empty open-addressing hash for up to ``n`` keys: (slot -> row, all -1; the slot mask)."""
    size = 1
    while size < 2 * n:
        size *= 2
    return np.full(size, -1, np.int64), size - 1


@njit(cache=True, inline="always")
def _row_of(table, mask, keys, key, m):
    """The row of voxel ``key`` (``keys``: row -> key), added as row ``m`` when new: (row, rows)."""
    h = (np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)
    s = np.int64(h) & mask
    while True:
        r = table[s]
        if r < 0:
            table[s] = m
            keys[m] = key
            return m, m + 1
        if keys[r] == key:
            return r, m
        s = (s + 1) & mask


@njit(cache=True)
def voxel_sums(P, inv, lo, dims):
    """Per occupied voxel, in first-seen order: its key (``i + dims0 (j + dims1 k)``), the float64
    sum of its points (in point order) and their count."""
    n = P.shape[0]
    table, mask = _table(n)
    keys = np.empty(n, np.int64)
    sums = np.empty((n, 3), np.float64)
    cnt = np.empty(n, np.int64)
    m = 0
    last_key = np.int64(-1)
    r = np.int64(-1)
    for i in range(n):
        a = np.int64(math.floor(P[i, 0] * inv)) - lo[0]
        b = np.int64(math.floor(P[i, 1] * inv)) - lo[1]
        c = np.int64(math.floor(P[i, 2] * inv)) - lo[2]
        key = a + dims[0] * (b + dims[1] * c)
        if key != last_key:  # scans come in scan-line order: a point's voxel is often the last one's
            last_key = key
            r, m2 = _row_of(table, mask, keys, key, m)
            if m2 > m:
                sums[r, 0] = 0.0
                sums[r, 1] = 0.0
                sums[r, 2] = 0.0
                cnt[r] = 0
                m = m2
        sums[r, 0] += P[i, 0]
        sums[r, 1] += P[i, 1]
        sums[r, 2] += P[i, 2]
        cnt[r] += 1
    return keys[:m], sums[:m], cnt[:m]


@njit(cache=True)
def centroids(order, sums, cnt):
    """float32 centroids of the voxels in ``order``."""
    out = np.empty((order.shape[0], 3), np.float32)
    for t in range(order.shape[0]):
        r = order[t]
        for j in range(3):
            out[t, j] = np.float32(sums[r, j] / cnt[r])
    return out


@njit(cache=True)
def voxel_rank_of_rows(P, lo, inv, dims):
    """Each float32 point's voxel rank (int64): voxels ``floor((p - lo) * inv)`` (float32
    subtraction and product), keyed ``i + dims0 (j + dims1 k)``, ranked by key among the occupied
    ones (``np.unique``'s inverse), through a hash of the occupied voxels and a sort of their keys."""
    n = P.shape[0]
    table, mask = _table(n)
    keys = np.empty(n, np.int64)
    row = np.empty(n, np.int64)
    m = 0
    last_key = np.int64(-1)
    r = np.int64(-1)
    for i in range(n):
        a = np.int64(math.floor(np.float32(P[i, 0] - lo[0]) * inv))
        b = np.int64(math.floor(np.float32(P[i, 1] - lo[1]) * inv))
        c = np.int64(math.floor(np.float32(P[i, 2] - lo[2]) * inv))
        key = a + dims[0] * (b + dims[1] * c)
        if key != last_key:
            last_key = key
            r, m = _row_of(table, mask, keys, key, m)
        row[i] = r
    order = np.argsort(keys[:m])
    rank = np.empty(m, np.int64)
    for t in range(m):
        rank[order[t]] = t
    for i in range(n):
        row[i] = rank[row[i]]
    return row
