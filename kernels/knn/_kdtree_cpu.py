"""numba CPU backend of :mod:`scanforest.kernels.knn.kdtree`: level-by-level build, P-ANNS, P-BANNS.

The split rules, the build and the searches described in :mod:`.kdtree`, operation for
operation as the CUDA kernels of :mod:`._kdtree_gpu` (same hash, same float32 sums, same
min-max queue, same ties), so the CPU and GPU builds and searches return the same trees and the
same answers. :mod:`.kdtree` validates the arguments and dispatches here.

The helpers are plain ``@njit`` functions, not ``inline="always"``: numba's own inlining types
each helper again at every call site, and a fresh machine's first P-ANNS query compiled for
15.6 s instead of 9.9 s (2 cores); LLVM inlines them all the same (2,000 queries of a 4-tree
forest over 20k x 352 rows: 0.24-0.29 s either way, 2026-12-07).
"""
from __future__ import annotations

import numpy as np

from ..jit import njit, prange
from ._kdtree_common import RULE_IDS
from .bruteforce import _sqdist, _sqdist4


# ----------------------------------------------------------------------------------------------
# shared split rule (mirrored in CUDA in cuda/kdtree.cu)
# ----------------------------------------------------------------------------------------------
@njit(cache=True)
def _hash(seed, node):
    z = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(node) + np.uint64(0x632BE59BD9B4E019)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True)
def _choose_split(lo, hi, node, rand_f, seed, topd, tope):
    """(dim, value) of the split of a node with box (lo, hi); dim = -1 means: make a leaf."""
    d = lo.shape[0]
    if rand_f <= 1:
        best = -1
        bext = np.float32(0.0)
        for j in range(d):
            e = hi[j] - lo[j]
            if e > bext:
                bext = e
                best = j
        dim = best
    else:
        cnt = 0
        for j in range(d):
            e = hi[j] - lo[j]
            if not (e > 0):
                continue
            if cnt < rand_f:
                pos = cnt
                cnt += 1
            elif e > tope[rand_f - 1]:
                pos = rand_f - 1
            else:
                continue
            while pos > 0 and tope[pos - 1] < e:
                tope[pos] = tope[pos - 1]
                topd[pos] = topd[pos - 1]
                pos -= 1
            tope[pos] = e
            topd[pos] = j
        if cnt == 0:
            dim = -1
        else:
            dim = topd[np.int64(_hash(seed, node) % np.uint64(cnt))]
    if dim < 0:
        return -1, np.float32(0.0)
    a = lo[dim]
    b = hi[dim]
    v = np.float32(0.5) * a + np.float32(0.5) * b
    if not (v < b):
        v = a
    return dim, v


SAMPLE = 64  # points per node looked at by the sample rules (mirrored in CUDA)


@njit(cache=True)
def _choose_split_sample(X, perm, s, e, lo, hi, node, rand_f, seed, topd, tope, smin, smax, buf, zero, rule):
    """The sample rules (``rule`` 1: median, 2: variance; see the module docstring); fall back
    to :func:`_choose_split` when the sample has zero extent in every dimension."""
    d = X.shape[1]
    cnt = e - s
    ns = min(cnt, SAMPLE)
    for j in range(d):
        smin[j] = np.inf
        smax[j] = -np.inf
    for k in range(ns):
        x = X[perm[s + (k * cnt) // ns]]
        for j in range(d):
            v = x[j] + np.float32(0.0)
            if v < smin[j]:
                smin[j] = v
            if v > smax[j]:
                smax[j] = v
    if rule == 2:
        for j in range(d):  # smax[j] becomes the sample variance (x n), 0 without extent
            zero[j] = np.float32(0.0)
            if not (smax[j] > smin[j]):
                smax[j] = np.float32(0.0)
                continue
            mean = _sample_mean(X, perm, s, cnt, ns, j)
            acc = np.float32(0.0)
            for k in range(ns):
                t = X[perm[s + (k * cnt) // ns], j] - mean
                acc = acc + t * t
            smax[j] = acc
        dim, _ = _choose_split(zero, smax, node, rand_f, seed, topd, tope)
        if dim < 0:
            return _choose_split(lo, hi, node, rand_f, seed, topd, tope)
        v = _sample_mean(X, perm, s, cnt, ns, dim)
        if not (v >= smin[dim]):
            v = smin[dim]
        if not (v < hi[dim]):
            v = smin[dim]  # < the sample maximum <= hi: both children non-empty
        return dim, v
    dim, _ = _choose_split(smin, smax, node, rand_f, seed, topd, tope)
    if dim < 0:
        return _choose_split(lo, hi, node, rand_f, seed, topd, tope)
    for k in range(ns):
        buf[k] = X[perm[s + (k * cnt) // ns], dim] + np.float32(0.0)
    for a in range(1, ns):  # insertion sort of <= 64 values
        v = buf[a]
        b = a - 1
        while b >= 0 and buf[b] > v:
            buf[b + 1] = buf[b]
            b -= 1
        buf[b + 1] = v
    h = ns // 2
    v = buf[h]
    if not (v < hi[dim]):
        while h > 0 and not (buf[h] < v):
            h -= 1
        v = buf[h]  # buf[0] < v here: the sample extent in dim is > 0
    return dim, v


@njit(cache=True)
def _sample_mean(X, perm, s, cnt, ns, j):
    acc = np.float32(0.0)
    for k in range(ns):
        acc = acc + X[perm[s + (k * cnt) // ns], j]
    return acc / np.float32(ns)


# ----------------------------------------------------------------------------------------------
# CPU build (level by level, same numbering as the GPU build)
# ----------------------------------------------------------------------------------------------
@njit(cache=True)
def _box(X, perm, s, e, lo, hi):
    d = X.shape[1]
    for j in range(d):
        lo[j] = np.inf
        hi[j] = -np.inf
    for p in range(s, e):
        x = X[perm[p]]
        for j in range(d):
            v = x[j] + np.float32(0.0)  # -0 -> +0, as on the GPU
            if v < lo[j]:
                lo[j] = v
            if v > hi[j]:
                hi[j] = v


@njit(cache=True, parallel=True)
def _level_split(X, perm, tmp, child, sdim, sval, start, end, lo, hi, l0, l1, next_id,
                 leaf_size, depth, max_depth, rand_f, seed, rule):
    """Split the nodes l0..l1-1 of one level; children get ids from next_id upward."""
    nl = l1 - l0
    d = X.shape[1]
    dims = np.full(nl, -1, np.int32)
    vals = np.zeros(nl, np.float32)
    for t in prange(nl):
        i = l0 + t
        if end[i] - start[i] > leaf_size and depth < max_depth:
            topd = np.empty(max(rand_f, 1), np.int64)
            tope = np.empty(max(rand_f, 1), np.float32)
            if rule > 0:
                smin = np.empty(d, np.float32)
                smax = np.empty(d, np.float32)
                zero = np.empty(d, np.float32)
                buf = np.empty(SAMPLE, np.float32)
                dm, v = _choose_split_sample(X, perm, start[i], end[i], lo[i], hi[i], i, rand_f, seed,
                                             topd, tope, smin, smax, buf, zero, rule)
            else:
                dm, v = _choose_split(lo[i], hi[i], i, rand_f, seed, topd, tope)
            dims[t] = dm
            vals[t] = v
    nid = next_id
    for t in range(nl):
        if dims[t] >= 0:
            i = l0 + t
            child[i] = nid
            sdim[i] = dims[t]
            sval[i] = vals[t]
            nid += 2
    for t in prange(nl):
        if dims[t] < 0:
            continue
        i = l0 + t
        s = start[i]
        e = end[i]
        dm = dims[t]
        v = vals[t]
        nleft = 0
        for p in range(s, e):
            if X[perm[p], dm] <= v:
                nleft += 1
        a = s
        b = s + nleft
        for p in range(s, e):
            pid = perm[p]
            if X[pid, dm] <= v:
                tmp[a] = pid
                a += 1
            else:
                tmp[b] = pid
                b += 1
        for p in range(s, e):
            perm[p] = tmp[p]
        c = child[i]
        start[c] = s
        end[c] = s + nleft
        start[c + 1] = s + nleft
        end[c + 1] = e
    for c in prange(next_id, nid):
        _box(X, perm, start[c], end[c], lo[c], hi[c])
    return nid


def _grow(arrs, need):
    out = []
    for a in arrs:
        if a.shape[0] >= need:
            out.append(a)
            continue
        cap = max(need, 2 * a.shape[0])
        b = np.empty((cap,) + a.shape[1:], a.dtype)
        b[: a.shape[0]] = a
        out.append(b)
    return out


def _build_cpu(X, leaf_size, max_depth, rand_f, seed, rule=RULE_IDS["variance"]):
    n, d = X.shape
    cap = max(3, 4 * (n // max(leaf_size, 1)) + 3)
    child = np.full(cap, -1, np.int32)
    sdim = np.full(cap, -1, np.int32)
    sval = np.zeros(cap, np.float32)
    start = np.zeros(cap, np.int64)
    end = np.zeros(cap, np.int64)
    lo = np.empty((cap, d), np.float32)
    hi = np.empty((cap, d), np.float32)
    perm = np.arange(n, dtype=np.int64)
    tmp = np.empty(n, np.int64)
    start[0], end[0] = 0, n
    lo[0] = X.min(axis=0) + np.float32(0.0)
    hi[0] = X.max(axis=0) + np.float32(0.0)
    l0, l1, depth = 0, 1, 0
    while l1 > l0:
        need = l1 + 2 * (l1 - l0)
        if need > child.shape[0]:
            child, sdim, sval, start, end, lo, hi = _grow([child, sdim, sval, start, end, lo, hi], need)
            child[l1:] = -1
            sdim[l1:] = -1
            sval[l1:] = 0  # leaves keep split_val 0 (grown arrays are uninitialised)
        nid = _level_split(X, perm, tmp, child, sdim, sval, start, end, lo, hi, l0, l1, l1,
                           leaf_size, depth, max_depth, rand_f, seed, rule)
        l0, l1 = l1, nid
        depth += 1
    nn = l1
    return (perm, child[:nn].copy(), sdim[:nn].copy(), sval[:nn].copy(), start[:nn].copy(),
            end[:nn].copy(), lo[:nn].copy(), hi[:nn].copy(), depth - 1)


# ----------------------------------------------------------------------------------------------
# CPU P-ANNS (mirrored in CUDA)
# ----------------------------------------------------------------------------------------------
#: shrink factor of the O(1) descent bound (1 - 2^-18): above the float32 rounding of
#: ``D_P - c_s + e_s`` relative to D_P, so the bound stays below the far box's distance
PATH_SAFE = np.float32(1.0 - 2.0 ** -18)


@njit(cache=True)
def _path_bound(dp, q_s, a, b, v, near_left):
    """Lower bound of the far child's box distance: P's box distance ``dp`` with its term on the
    split dimension (P's interval ``[a, b]``) replaced by the term of the far side of the cut at
    ``v`` (``near_left``: the query is on the left, ``q_s <= v``). Same operation order as CUDA's
    ``path_bound``."""
    if q_s < a:
        c = (a - q_s) * (a - q_s)
    elif q_s > b:
        c = (q_s - b) * (q_s - b)
    else:
        c = np.float32(0.0)
    if near_left:
        e = v if v > a else a
        t = (e - q_s) * (e - q_s)
    else:
        e = v if v < b else b
        t = (q_s - e) * (q_s - e)
    return ((dp - c) + t) * PATH_SAFE

@njit(cache=True)
def _box_dist(q, lo, hi):
    acc = np.float32(0.0)
    for j in range(q.shape[0]):
        v = q[j]
        if v < lo[j]:
            t = lo[j] - v
        elif v > hi[j]:
            t = v - hi[j]
        else:
            t = np.float32(0.0)
        acc += t * t
    return acc


# The queue of pending boxes is a min-max heap (Atkinson et al. 1986; mirrored in CUDA in
# cuda/kdtree.cu): the closest box pops in O(log n) and, when the queue is full, the farthest is
# found and replaced in O(log n) too (a binary min-heap scans its leaves for it: half the queue
# per push, which made a 2,048-box queue cost 30% of the search). Levels alternate: even
# levels hold the minimum of their subtree, odd levels the maximum.
@njit(cache=True)
def _mm_swap(hd, hn, a, b):
    t = hd[a]
    hd[a] = hd[b]
    hd[b] = t
    u = hn[a]
    hn[a] = hn[b]
    hn[b] = u


@njit(cache=True)
def _mm_min_level(i):
    lvl = 0
    i += 1
    while i > 1:
        i >>= 1
        lvl += 1
    return (lvl & 1) == 0


@njit(cache=True)
def _mm_up(hd, hn, pos):
    """Restore the order after an entry was placed at ``pos`` (its subtree is in order)."""
    if pos == 0:
        return
    par = (pos - 1) >> 1
    is_min = _mm_min_level(pos)
    if (is_min and hd[pos] > hd[par]) or (not is_min and hd[pos] < hd[par]):
        _mm_swap(hd, hn, pos, par)
        pos = par
        is_min = not is_min
    while pos >= 3:
        g = (((pos - 1) >> 1) - 1) >> 1
        if (is_min and hd[pos] < hd[g]) or (not is_min and hd[pos] > hd[g]):
            _mm_swap(hd, hn, pos, g)
            pos = g
        else:
            break


@njit(cache=True)
def _mm_down(hd, hn, pos, size):
    """Sift the entry at ``pos`` down (min levels: towards larger, max levels: smaller)."""
    is_min = _mm_min_level(pos)
    while True:
        c = 2 * pos + 1
        if c >= size:
            return
        m = c
        for j in (c + 1, 2 * c + 1, 2 * c + 2, 2 * c + 3, 2 * c + 4):
            if j < size and ((is_min and hd[j] < hd[m]) or (not is_min and hd[j] > hd[m])):
                m = j
        if m > c + 1:  # a grandchild
            if (is_min and hd[m] < hd[pos]) or (not is_min and hd[m] > hd[pos]):
                _mm_swap(hd, hn, m, pos)
                p = (m - 1) >> 1
                if (is_min and hd[m] > hd[p]) or (not is_min and hd[m] < hd[p]):
                    _mm_swap(hd, hn, m, p)
                pos = m
            else:
                return
        else:
            if (is_min and hd[m] < hd[pos]) or (not is_min and hd[m] > hd[pos]):
                _mm_swap(hd, hn, m, pos)
            return


@njit(cache=True)
def _heap_push(hd, hn, size, dv, nv):
    hd[size] = dv
    hn[size] = nv
    _mm_up(hd, hn, size)
    return size + 1


@njit(cache=True)
def _heap_remove(hd, hn, size, pos):
    """Remove the entry at ``pos`` (the root or the maximum); returns the new size."""
    size -= 1
    if pos < size:
        hd[pos] = hd[size]
        hn[pos] = hn[size]
        _mm_down(hd, hn, pos, size)
    return size


@njit(cache=True)
def _heap_pop(hd, hn, size):
    """Remove the root (the closest box); returns the new size (the caller read hd[0], hn[0])."""
    return _heap_remove(hd, hn, size, 0)


@njit(cache=True)
def _heap_max(hd, size):
    if size <= 2:
        return size - 1
    return 2 if hd[2] > hd[1] else 1


@njit(cache=True)
def _heap_push_bounded(hd, hn, size, cap, dv, nv):
    """Push onto a heap that keeps the ``cap`` closest boxes; returns (size, evicted distance).

    When full, the farthest entry is replaced if the new one is closer; the evicted distance
    (the old maximum or the new entry) is returned, else -1.
    """
    if size < cap:
        return _heap_push(hd, hn, size, dv, nv), np.float32(-1.0)
    mi = _heap_max(hd, size)
    if not (dv < hd[mi]):
        return size, dv
    ev = hd[mi]
    size = _heap_remove(hd, hn, size, mi)
    return _heap_push(hd, hn, size, dv, nv), ev


@njit(cache=True)
def _insert_unique(dist, ids, cnt, k, dv, iv):
    """Insert (dv, iv) into the ascending (dist, id) list unless it is already there (a point
    reached through a second tree of a forest has the same key); returns the new count."""
    if cnt == k:
        last = k - 1
        if dv > dist[last] or (dv == dist[last] and iv >= ids[last]):
            return cnt
    j = cnt - 1
    while j >= 0 and (dist[j] > dv or (dist[j] == dv and ids[j] > iv)):
        j -= 1
    if j >= 0 and dist[j] == dv and ids[j] == iv:
        return cnt
    if cnt < k:
        cnt += 1
    p = cnt - 1
    while p > j + 1:
        dist[p] = dist[p - 1]
        ids[p] = ids[p - 1]
        p -= 1
    dist[j + 1] = dv
    ids[j + 1] = iv
    return cnt


@njit(cache=True)
def _scan_leaves(q, points, perm, start, end, leaves, n, dist, ids, cnt, k):
    """Insert the rows of ``leaves[:n]`` into the query's (dist, id) list; returns its count."""
    for t in range(n):
        p = start[leaves[t]]
        e = end[leaves[t]]
        while p + 4 <= e:  # four rows at a time, inserted in row order as one by one
            d0, d1, d2, d3 = _sqdist4(q, points[p], points[p + 1], points[p + 2], points[p + 3])
            cnt = _insert_unique(dist, ids, cnt, k, d0, perm[p])
            cnt = _insert_unique(dist, ids, cnt, k, d1, perm[p + 1])
            cnt = _insert_unique(dist, ids, cnt, k, d2, perm[p + 2])
            cnt = _insert_unique(dist, ids, cnt, k, d3, perm[p + 3])
            p += 4
        while p < e:
            cnt = _insert_unique(dist, ids, cnt, k, _sqdist(q, points[p]), perm[p])
            p += 1
    return cnt


@njit(cache=True)
def _push_roots(q, bl, roots, lo, hi, hd, hn, heap_cap):
    """Push every root of a (packed) forest within ``bl``; returns (queue size, overflowed)."""
    hs = 0
    ovf = False
    for t in range(roots.shape[0]):
        r = roots[t]
        bd = _box_dist(q, lo[r], hi[r])
        if bd <= bl:
            hs, ev = _heap_push_bounded(hd, hn, hs, heap_cap, bd, r)
            if ev >= 0 and ev <= bl:
                ovf = True
    return hs, ovf


@njit(cache=True)
def _split_children(child, sdim, sval, q, node):
    """An inner node's (near child, far child, split dimension, query on the left side)."""
    c = child[node]
    s = sdim[node]
    left = q[s] <= sval[node]
    if left:
        return c, c + 1, s, left
    return c + 1, c, s, left


@njit(cache=True)
def _next_leaf(q, worst, check_near, path, child, sdim, sval, lo, hi, hd, hn, hs, heap_cap):
    """Pop the closest box within ``worst`` and descend to its nearest leaf, pushing the far
    children (``path``: DESCENT_IDS); a pruned descent takes the next box. Returns (leaf, or -1
    when no box within ``worst`` is left; the queue size; whether the full queue dropped a box
    within ``worst``)."""
    ovf = False
    while True:
        node = -1
        key = np.float32(0.0)
        while hs > 0:
            bd = hd[0]
            nd = hn[0]
            hs = _heap_pop(hd, hn, hs)
            if bd <= worst:
                node = nd
                key = bd
                break
            hs = 0
        if node < 0:
            return -1, hs, ovf
        pn = node
        dp = np.float32(0.0)
        if path == 2:  # incremental: the popped key (a lower bound of P's box distance) stands for it
            dp = key
        elif path == 1:
            dp = _box_dist(q, lo[pn], hi[pn])
            if dp > worst:  # its key was a lower bound: the box itself is too far
                continue
        pruned = False
        while child[node] >= 0:
            near, far, s, left = _split_children(child, sdim, sval, q, node)
            if path > 0:
                bd = _path_bound(dp, q[s], lo[pn, s], hi[pn, s], sval[node], left)
            else:
                bd = _box_dist(q, lo[far], hi[far])
            if bd <= worst:
                hs, ev = _heap_push_bounded(hd, hn, hs, heap_cap, bd, far)
                if ev >= 0 and ev <= worst:
                    ovf = True
            if check_near and _box_dist(q, lo[near], hi[near]) > worst:
                pruned = True  # bounded search: the near side cannot hold a point below the bound
                break
            node = near
        if not pruned:
            return node, hs, ovf


@njit(cache=True, parallel=True)
def _anns_cpu(points, perm, child, sdim, sval, start, end, lo, hi, roots, queries, lim, k, budget, heap_cap,
              out_d, out_i, overflow, visits_out, path, per_round):
    """P-ANNS over one tree or a packed forest (one queue over the boxes of all trees).

    ``lim[q]``: boxes farther than it are pruned (the float below the query's bound, or inf).
    ``per_round``: leaves taken against one pruning distance before they are scanned (1:
    P-ANNS; L > 1: P-BANNS's batched rounds one query at a time, the reference of
    :func:`_banns_cpu` and of the GPU's rounds: the same leaves and the same answer).
    """
    m = queries.shape[0]
    for qi in prange(m):
        pend = np.empty(per_round, np.int64)
        npend = 0
        q = queries[qi]
        bl = lim[qi]
        dist = np.empty(k, np.float32)
        ids = np.empty(k, np.int64)
        cnt = 0
        hd = np.empty(heap_cap, np.float32)
        hn = np.empty(heap_cap, np.int32)
        hs, ovf = _push_roots(q, bl, roots, lo, hi, hd, hn, heap_cap)
        check_near = bl < np.float32(np.inf)
        visits = 0
        worst = bl
        while True:
            if npend == 0:  # a new round: the pruning distance of the leaves scanned so far
                worst = dist[k - 1] if cnt == k else np.float32(np.inf)
                if bl < worst:
                    worst = bl
            leaf, hs, o = _next_leaf(q, worst, check_near, path, child, sdim, sval, lo, hi, hd, hn, hs, heap_cap)
            ovf = ovf or o
            if leaf < 0:
                break
            pend[npend] = leaf
            npend += 1
            visits += 1
            stop = budget > 0 and visits >= budget
            if npend == per_round or stop:
                cnt = _scan_leaves(q, points, perm, start, end, pend, npend, dist, ids, cnt, k)
                npend = 0
            if stop:
                break
        cnt = _scan_leaves(q, points, perm, start, end, pend, npend, dist, ids, cnt, k)
        for j in range(k):
            ok = j < cnt and dist[j] <= bl
            out_d[qi, j] = dist[j] if ok else np.inf
            out_i[qi, j] = ids[j] if ok else -1
        overflow[qi] = ovf
        visits_out[qi] = visits


# ---- P-BANNS on the CPU: the GPU's batched rounds, leaves shared between the queries that take them
@njit(cache=True, parallel=True)
def _banns_init_cpu(queries, lim, roots, lo, hi, HD, HN, HS, OVF):
    for qi in prange(queries.shape[0]):
        hs, ovf = _push_roots(queries[qi], lim[qi], roots, lo, hi, HD[qi], HN[qi], HD.shape[1])
        HS[qi] = hs
        OVF[qi] = ovf


@njit(cache=True, parallel=True)
def _banns_collect_cpu(child, sdim, sval, lo, hi, queries, lim, active, L, budget, path, HD, HN, HS, OVF, visits,
                       top_d, cnt, leaves, nleaves, keep):
    """A round's leaves: up to ``L`` per active query against its pruning distance at the round's
    start (the GPU's ``banns_collect``); ``keep[i]``: the query goes on to another round."""
    k = top_d.shape[1]
    for i in prange(active.shape[0]):
        qi = active[i]
        q = queries[qi]
        bl = lim[qi]
        worst = top_d[qi, k - 1] if cnt[qi] == k else np.float32(np.inf)
        if bl < worst:
            worst = bl
        hs = HS[qi]
        v = visits[qi]
        ovf = OVF[qi]
        n = 0
        while n < L and not (budget > 0 and v >= budget):
            leaf, hs, o = _next_leaf(q, worst, bl < np.float32(np.inf), path, child, sdim, sval, lo, hi, HD[qi],
                                     HN[qi], hs, HD.shape[1])
            ovf = ovf or o
            if leaf < 0:
                break
            leaves[i, n] = leaf
            n += 1
            v += 1
        nleaves[i] = n
        keep[i] = n == L and hs > 0 and not (budget > 0 and v >= budget)
        HS[qi] = hs
        OVF[qi] = ovf
        visits[qi] = v


@njit(cache=True, parallel=True)
def _banns_scan_cpu(points, perm, start, end, queries, qrow, group_start, group_leaf, slot_d, slot_i, slot_n):
    """Each leaf once for the queries that took it: position t (sorted by leaf) scans leaf
    ``group_leaf[g]`` for query ``qrow[t]`` into slot t, while the leaf's rows are in cache."""
    k = slot_d.shape[1]
    for g in prange(group_leaf.shape[0]):
        for t in range(group_start[g], group_start[g + 1]):
            slot_n[t] = _scan_leaves(queries[qrow[t]], points, perm, start, end, group_leaf[g:g + 1], 1, slot_d[t],
                                     slot_i[t], 0, k)


@njit(cache=True, parallel=True)
def _banns_merge_cpu(active, slot_of, slot_d, slot_i, slot_n, top_d, top_i, cnt):
    """Merge each active query's slots (``slot_of[i]``: its sorted positions, -1 none) into its list."""
    k = top_d.shape[1]
    for i in prange(active.shape[0]):
        qi = active[i]
        c = cnt[qi]
        for j in range(slot_of.shape[1]):
            t = slot_of[i, j]
            if t < 0:
                break
            for u in range(slot_n[t]):
                c = _insert_unique(top_d[qi], top_i[qi], c, k, slot_d[t, u], slot_i[t, u])
        cnt[qi] = c


# ---- the beam: a one-round budget's leaves chosen level by level (descent="beam")
BEAM_MAX = 128  # the largest budget (and root count) a beam takes; the GPU keeps 2 * BEAM_MAX entries a query


@njit(cache=True)
def _beam_select(node, key, pn, n, B, code):
    """Keep the ``B`` entries of the smallest (key, node) among the first ``n`` (in place, in any
    order; keys are stored with -0 read as +0): the GPU's order, a key's float order then its
    node, as one uint64 code. Returns how many are kept."""
    if n <= B:
        return n
    kb = key.view(np.uint32)
    for t in range(n):
        u = np.uint64(kb[t])
        if u & np.uint64(0x80000000):
            u = np.uint64(0xFFFFFFFF) ^ u
        else:
            u = u | np.uint64(0x80000000)
        code[t] = (u << np.uint64(32)) | np.uint64(node[t])
    cut = np.partition(code[:n], B - 1)[B - 1]
    j = 0
    for t in range(n):
        if code[t] <= cut:
            node[j] = node[t]
            key[j] = key[t]
            pn[j] = pn[t]
            j += 1
    return j


@njit(cache=True, parallel=True)
def _banns_beam_cpu(child, sdim, sval, lo, hi, HD, HN, HS, queries, lim, active, B, L, visits, leaves, nleaves,
                    keep):
    """A one-round budget's ``B`` leaves per active query by a beam over the trees' levels: the
    entries start as ``_banns_init_cpu``'s queue (the roots within the query's bound, keyed by
    their box distance; the GPU starts from ``banns_init``'s); at each step every
    entry that is not a leaf becomes its near child (the entry's key, its popped box P) and its
    far child (the incremental bound from the key and P's interval on the split dimension, as
    ``_path_bound``; P the far child itself), a far child beyond the bound dropped, a near child
    whose box lies beyond a finite bound dropped; then the ``B`` entries of the smallest (key,
    node) are kept, until all are leaves. A node's key is the key of the leaf its near children
    lead to, so the beam keeps the ancestors of the B leaves of the smallest keys up to the few
    ulps by which a far child's bound can fall below its parent's key. The GPU's ``banns_beam``."""
    for i in prange(active.shape[0]):
        qi = active[i]
        q = queries[qi]
        bl = lim[qi]
        check_near = bl < np.float32(np.inf)
        cap = 2 * max(B, HS[qi])
        code = np.empty(cap, np.uint64)
        node = np.empty(cap, np.int64)
        key = np.empty(cap, np.float32)
        pn = np.empty(cap, np.int64)
        node2 = np.empty(cap, np.int64)
        key2 = np.empty(cap, np.float32)
        pn2 = np.empty(cap, np.int64)
        n = HS[qi]
        for t in range(n):
            node[t] = HN[qi, t]
            key[t] = HD[qi, t] + np.float32(0.0)
            pn[t] = HN[qi, t]
        n = _beam_select(node, key, pn, n, B, code)
        while True:
            m = 0
            internal = False
            for j in range(n):
                nd = node[j]
                c = child[nd]
                if c < 0:
                    node2[m] = nd
                    key2[m] = key[j]
                    pn2[m] = pn[j]
                    m += 1
                    continue
                internal = True
                near, far, s, left = _split_children(child, sdim, sval, q, nd)
                p = pn[j]
                bd = _path_bound(key[j], q[s], lo[p, s], hi[p, s], sval[nd], left)
                if bd <= bl:
                    node2[m] = far
                    key2[m] = bd + np.float32(0.0)
                    pn2[m] = far
                    m += 1
                if not (check_near and _box_dist(q, lo[near], hi[near]) > bl):
                    node2[m] = near
                    key2[m] = key[j]
                    pn2[m] = p
                    m += 1
            if not internal:
                break
            node, node2 = node2, node
            key, key2 = key2, key
            pn, pn2 = pn2, pn
            n = _beam_select(node, key, pn, m, B, code)
        for j in range(n):
            leaves[i, j] = node[j]
        nleaves[i] = n
        keep[i] = False
        visits[qi] = n


BANNS_CPU_SLOTS = 1 << 22  # slot entries of a CPU round: queries are taken L * k entries each


def _banns_cpu(tree, points, queries, lim, k, budget, heap_cap, path, L, beam=False):
    """P-BANNS on the CPU in rounds of ``L`` leaves per query, as the GPU: the round's leaves are
    chosen per query (``_banns_collect_cpu``), the (query, leaf) pairs sorted by leaf, each leaf
    scanned once for all the queries that took it (its rows stay in cache from one query to the
    next: ``_banns_scan_cpu``), and each query's slots merged into its list. The same answer as
    ``_anns_cpu`` with ``per_round=L``; ``beam``: the one round's leaves chosen by
    ``_banns_beam_cpu`` (a budget of at most ``min(L, BEAM_MAX)`` leaves). Returns (dist2, ids,
    overflow, visits)."""
    m = queries.shape[0]
    roots = np.zeros(1, np.int32) if tree.roots is None else np.ascontiguousarray(tree.roots, dtype=np.int32)
    chunk = max(1, BANNS_CPU_SLOTS // (L * k))
    if m > chunk:  # a query's answer does not depend on the others
        parts = [_banns_cpu(tree, points, queries[a:a + chunk], lim[a:a + chunk], k, budget, heap_cap, path, L, beam)
                 for a in range(0, m, chunk)]
        return tuple(np.concatenate([p[j] for p in parts]) for j in range(4))
    HD = np.empty((m, heap_cap), np.float32)
    HN = np.empty((m, heap_cap), np.int32)
    HS = np.zeros(m, np.int64)
    OVF = np.zeros(m, np.bool_)
    visits = np.zeros(m, np.int32)
    top_d = np.full((m, k), np.inf, np.float32)
    top_i = np.full((m, k), -1, np.int64)
    cnt = np.zeros(m, np.int64)
    _banns_init_cpu(queries, lim, roots, tree.lo, tree.hi, HD, HN, HS, OVF)
    active = np.nonzero(HS > 0)[0]
    while active.size:
        na = active.size
        leaves = np.empty((na, L), np.int64)
        nleaves = np.empty(na, np.int64)
        keep = np.empty(na, np.bool_)
        if beam:  # the whole budget in this round
            _banns_beam_cpu(tree.child, tree.split_dim, tree.split_val, tree.lo, tree.hi, HD, HN, HS, queries, lim,
                            active, budget, L, visits, leaves, nleaves, keep)
        else:
            _banns_collect_cpu(tree.child, tree.split_dim, tree.split_val, tree.lo, tree.hi, queries, lim, active, L,
                               budget, path, HD, HN, HS, OVF, visits, top_d, cnt, leaves, nleaves, keep)
        pair = np.nonzero(np.arange(L)[None, :] < nleaves[:, None])  # (query position, j) of each taken leaf
        leaf = leaves[pair]
        if leaf.size == 0:  # every active query found nothing left within its pruning distance
            break
        order = np.argsort(leaf, kind="stable")
        sleaf = leaf[order]
        group_start = np.flatnonzero(np.r_[True, sleaf[1:] != sleaf[:-1], True]).astype(np.int64)
        n = sleaf.size
        slot_d = np.empty((n, k), np.float32)
        slot_i = np.empty((n, k), np.int64)
        slot_n = np.zeros(n, np.int64)
        _banns_scan_cpu(points, tree.perm, tree.start, tree.end, queries, active[pair[0][order]], group_start,
                        sleaf[group_start[:-1]], slot_d, slot_i, slot_n)
        slot_of = np.full((na, L), -1, np.int64)
        slot_of[pair[0][order], pair[1][order]] = np.arange(n)
        _banns_merge_cpu(active, slot_of, slot_d, slot_i, slot_n, top_d, top_i, cnt)
        active = active[keep]
    ok = (np.arange(k)[None, :] < cnt[:, None]) & (top_d <= lim[:, None])
    return np.where(ok, top_d, np.float32(np.inf)), np.where(ok, top_i, -1), OVF, visits
