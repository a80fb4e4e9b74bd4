"""CPU kernel of a KD-forest's graph rounds (:meth:`scanforest.kernels.knn.kdforest.KDForest._expand`),
the numba twin of :mod:`._graph_gpu`: each query's list takes the graph neighbours of its first
entries, scored with the canonical distance (:func:`.bruteforce._sqdist4`: four rows at a time,
each summed in dimension order, the brute force's bits), a row already in the list never scored
again; which entries a round expands is the caller's (:func:`.kdforest._next_seeds`). The list
keeps the ``kk`` smallest ``(distance, id)`` pairs, a row once: the answer of
:func:`.kdforest.merge_topk_unique` over the list and the candidates, without their sorts."""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange
from .bruteforce import _sqdist, _sqdist4


@njit(cache=True, inline="always")
def _less(d1, i1, d2, i2):
    """``(d1, i1) < (d2, i2)`` in the (distance, id) order, an empty slot (id -1) last."""
    if i2 < 0:
        return i1 >= 0
    if i1 < 0:
        return False
    if d1 != d2:
        return d1 < d2
    return i1 < i2


@njit(cache=True, inline="always")
def _has(li, kk, iv):
    for t in range(kk):
        if li[t] == iv:
            return True
    return False


@njit(cache=True, inline="always")
def _offer(ld, li, kk, dv, iv):
    """Insert ``(dv, iv)`` into the ascending list when it beats its last entry and is not in it."""
    if not _less(dv, iv, ld[kk - 1], li[kk - 1]) or _has(li, kk, iv):
        return
    t = kk - 1
    while t > 0 and _less(dv, iv, ld[t - 1], li[t - 1]):
        ld[t] = ld[t - 1]
        li[t] = li[t - 1]
        t -= 1
    ld[t] = dv
    li[t] = iv


@njit(parallel=True, cache=True)
def graph_round(X, Q, G, dist, ids, seeds, out_d, out_i):
    """One round for every query ``r`` (in parallel): the graph rows ``G`` of the list entries
    ``seeds[r]`` (-1: none) scored against ``Q[r]`` and offered to the list
    ``(dist[r], ids[r])``; the lists come back in ``out_d`` / ``out_i``."""
    m, kk = dist.shape
    deg = G.shape[1]
    e = seeds.shape[1]
    for r in prange(m):
        ld = out_d[r]
        li = out_i[r]
        for c in range(kk):
            ld[c] = dist[r, c]
            li[c] = ids[r, c]
        q = Q[r]
        buf = np.empty(4, np.int64)
        nb = 0
        for c in range(e):
            s = seeds[r, c]
            if s < 0:
                continue
            for j in range(deg):
                cid = np.int64(G[s, j])
                if cid < 0 or _has(li, kk, cid):
                    continue
                buf[nb] = cid
                nb += 1
                if nb == 4:
                    d0, d1, d2, d3 = _sqdist4(q, X[buf[0]], X[buf[1]], X[buf[2]], X[buf[3]])
                    _offer(ld, li, kk, d0, buf[0])
                    _offer(ld, li, kk, d1, buf[1])
                    _offer(ld, li, kk, d2, buf[2])
                    _offer(ld, li, kk, d3, buf[3])
                    nb = 0
        for t in range(nb):
            _offer(ld, li, kk, _sqdist(q, X[buf[t]]), buf[t])
