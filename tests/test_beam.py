"""descent="beam": a one-round budget's leaves taken level by level (a GPU warp a query), against
an enumeration of every leaf's key, against the queue's leaves, and the same on both devices."""
from __future__ import annotations

import numpy as np
import pytest

from scanforest.kernels.knn import _kdtree_cpu as kc
from scanforest.kernels.knn.bruteforce import knn_bruteforce, pair_distances
from scanforest.kernels.knn.kdforest import KDForest
from scanforest.kernels.knn._kdtree_cpu import PATH_SAFE
from scanforest.kernels.knn.kdtree import build_kdforest, build_kdtree, query_kdtree


def _data(rng, kind, n, m, d):
    if kind == "random":
        return rng.standard_normal((n, d)).astype(np.float32), rng.standard_normal((m, d)).astype(np.float32)
    return rng.integers(0, 3, (n, d)).astype(np.float32), rng.integers(0, 3, (m, d)).astype(np.float32)


def _leaf_keys(tree, q):
    """Every leaf's incremental key for query ``q``, walked from the roots in float32 (each
    operation rounded as the kernels round it; the roots' box distances summed in dimension
    order): {leaf: key}."""
    f32 = np.float32
    roots = [0] if tree.roots is None else [int(r) for r in tree.roots]
    out = {}
    stack = []
    for r in roots:
        acc = f32(0)
        for j in range(q.shape[0]):
            v, a, b = q[j], tree.lo[r, j], tree.hi[r, j]
            t = a - v if v < a else (v - b if v > b else f32(0))
            acc = f32(acc + f32(t * t))
        stack.append((r, f32(acc + f32(0)), r))
    while stack:
        node, key, pn = stack.pop()
        c = int(tree.child[node])
        if c < 0:
            out[node] = key
            continue
        s, v = int(tree.split_dim[node]), tree.split_val[node]
        qs, a, b = q[s], tree.lo[pn, s], tree.hi[pn, s]
        left = qs <= v
        near, far = (c, c + 1) if left else (c + 1, c)
        cc = f32((a - qs) * (a - qs)) if qs < a else (f32((qs - b) * (qs - b)) if qs > b else f32(0))
        e = (v if v > a else a) if left else (v if v < b else b)
        t = f32((e - qs) * (e - qs)) if left else f32((qs - e) * (qs - e))
        bd = f32(f32(f32(key - cc) + t) * PATH_SAFE)
        stack.append((far, f32(bd + f32(0)), far))
        stack.append((near, key, pn))
    return out


def _beam_leaves(tree, Q, B, lim=None):
    m = Q.shape[0]
    roots = np.zeros(1, np.int32) if tree.roots is None else tree.roots.astype(np.int32)
    lim = np.full(m, np.inf, np.float32) if lim is None else lim
    leaves = np.full((m, B), -1, np.int64)
    nleaves = np.zeros(m, np.int64)
    HD, HN = np.empty((m, 256), np.float32), np.empty((m, 256), np.int32)
    HS, OVF = np.zeros(m, np.int64), np.zeros(m, np.bool_)
    kc._banns_init_cpu(Q, lim, roots, tree.lo, tree.hi, HD, HN, HS, OVF)  # the roots within the bound
    kc._banns_beam_cpu(tree.child, tree.split_dim, tree.split_val, tree.lo, tree.hi, HD, HN, HS, Q, lim,
                       np.arange(m), B, B, np.zeros(m, np.int32), leaves, nleaves, np.zeros(m, np.bool_))
    return [set(leaves[i, :nleaves[i]].tolist()) for i in range(m)]


@pytest.mark.parametrize("kind", ["random", "duplicates"])
@pytest.mark.parametrize("n_trees", [1, 3])
def test_beam_takes_the_leaves_of_the_smallest_keys(rng, kind, n_trees):
    """The beam's B leaves have the B smallest of all leaves' keys enumerated in float32 (a tie
    at the B-th key may take either leaf; the exceptions: a far child's bound a few ulps below its parent's key
    (PATH_SAFE), which can hide a leaf behind its ancestor's rank; at most 2% of queries)."""
    X, Q = _data(rng, kind, 6000, 60, 8)
    tree = (build_kdtree(X, leaf_size=8, device="cpu") if n_trees == 1
            else build_kdforest(X, n_trees=n_trees, leaf_size=8, random_dims=4, device="cpu"))
    for B in (2, 17, 64, 128):
        got = _beam_leaves(tree, Q, B)
        same = 0
        for i in range(Q.shape[0]):
            keys = _leaf_keys(tree, Q[i])
            assert len(got[i]) == min(B, len(keys)) and got[i] <= keys.keys()
            # the same keys (a tie at the B-th key may take either leaf)
            same += sorted(keys[n] for n in got[i]) == sorted(keys.values())[:B]
        assert same >= 0.98 * Q.shape[0], f"B={B}: {same} of {Q.shape[0]} queries"


@pytest.mark.parametrize("kind", ["random", "duplicates"])
def test_beam_search_against_the_queue_and_the_brute_force(rng, kind):
    """Searches with descent="beam": the budget's leaves (min(budget, leaves)) scanned, each
    distance the canonical one of its id, no id twice; on one tree the same lists as the
    queue's ("incremental") on >= 99% of queries, on a forest (where every tree's nearest leaf
    has the key 0: ties the beam breaks by node, the queue by its heap) a recall within 0.02 of
    the queue's; an unlimited budget (no beam) is the brute force; a budget beyond one round
    descends from the queue (the same answer as "incremental")."""
    from scanforest.kernels.knn.bruteforce import recall

    X, Q = _data(rng, kind, 8000, 300, 12)
    k = 5
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    tree = build_kdtree(X, leaf_size=16, device="cpu")
    forest = build_kdforest(X, n_trees=3, leaf_size=16, random_dims=5, device="cpu")
    for index in (tree, forest):
        for b in (2, 9, 40, 128):
            d1, i1, s1 = query_kdtree(index, Q, k, backtracks=b, method="banns", descent="beam", return_stats=True)
            d0, i0 = query_kdtree(index, Q, k, backtracks=b, method="banns", descent="incremental")
            assert int(s1["leaves_visited"].max()) == b
            np.testing.assert_array_equal(d1, pair_distances(X, Q, i1, device="cpu"))
            for r in i1:
                assert len(np.unique(r[r >= 0])) == (r >= 0).sum()
            if index is tree and kind == "random":
                assert np.mean(np.all(i1 == i0, axis=1)) >= 0.99, b
            else:
                assert recall(d1, bd) >= recall(d0, bd) - 0.02, (index.n_trees, b)
        d, i = query_kdtree(index, Q, k, method="banns", descent="beam")
        np.testing.assert_array_equal(i, bi)
        np.testing.assert_array_equal(d, bd)
        for b, per_round in ((200, None), (40, 8)):  # beyond the beam: the queue's incremental descent
            kw = dict(backtracks=b, method="banns", leaves_per_round=per_round)
            da, ia = query_kdtree(index, Q, k, descent="beam", **kw)
            db, ib = query_kdtree(index, Q, k, descent="incremental", **kw)
            np.testing.assert_array_equal(ia, ib)
            np.testing.assert_array_equal(da, db)


def test_beam_with_bounds(rng):
    """A bounded beam (the global k-th distance from other shards): boxes beyond the bound are
    not taken, only points strictly closer come back, and a bound just above the true k-th
    distance with a budget of every leaf returns the brute force."""
    X, Q = _data(rng, "random", 3000, 200, 6)
    k = 4
    bd, bi = knn_bruteforce(X, Q, k, device="cpu")
    tree = build_kdtree(X, leaf_size=64, device="cpu")
    n_leaves = int((tree.child < 0).sum())
    assert n_leaves <= 128
    lim = np.nextafter(bd[:, -1], np.float32(np.inf))
    d, i = query_kdtree(tree, Q, k, backtracks=n_leaves, method="banns", descent="beam", bounds=lim)
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(d, bd)
    half = bd[:, 1]  # only the nearest point is strictly closer than the second distance (no ties here)
    d, i = query_kdtree(tree, Q, k, backtracks=8, method="banns", descent="beam", bounds=half)
    assert np.all(d[:, 1:] == np.inf) and np.all(i[:, 1:] == -1)
    assert np.all((i[:, 0] == bi[:, 0]) | (i[:, 0] == -1))


def test_forest_descent_defaults(rng):
    """KDForest(descent="auto") takes the beam on the GPU and the queue on the CPU; an unknown
    name is refused."""
    from scanforest.kernels.errors import InputError
    from scanforest.kernels.knn.kdforest import DEVICE_DEFAULTS

    assert DEVICE_DEFAULTS["gpu"]["descent"] == "beam" and DEVICE_DEFAULTS["cpu"]["descent"] == "incremental"
    X, Q = _data(rng, "random", 4000, 100, 8)
    f = KDForest(device="cpu").fit(X)
    d0, i0 = f.query(Q, 4, backtracks=32)
    d1, i1 = query_kdtree(f.tree_, Q, 4, backtracks=32, method="banns", descent="incremental")
    np.testing.assert_array_equal(i0, i1)
    with pytest.raises(InputError, match="descent must be one of"):
        KDForest(descent="bean", device="cpu").fit(X)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "duplicates"])
def test_gpu_beam_matches_cpu(rng, kind):
    """The GPU's banns_beam (a warp a query, a bitonic sort in shared memory) and the CPU's beam:
    the same lists bit for bit and the same leaf counts, on trees and forests, with and
    without bounds, budgets from 2 to 128, float32 and float16 rows; and the graph forest's
    answer (the beam seeds its walk) the same on both devices."""
    import cupy as cp

    X, Q = _data(rng, kind, 30000, 500, 32)
    for host in (build_kdtree(X, leaf_size=16, device="cpu"),
                 build_kdforest(X, n_trees=4, leaf_size=16, random_dims=5, device="cpu")):
        dev = build_kdtree(cp.asarray(X), leaf_size=16) if host.roots is None else \
            build_kdforest(cp.asarray(X), n_trees=4, leaf_size=16, random_dims=5)
        bd, _ = knn_bruteforce(X, Q, 8, device="cpu")
        for bounds in (None, np.nextafter(bd[:, 3], np.float32(np.inf))):
            for b, k in ((2, 1), (24, 4), (64, 8), (128, 16)):
                kw = dict(backtracks=b, method="banns", descent="beam", bounds=bounds, return_stats=True)
                cd, ci, cs = query_kdtree(host, Q, k, **kw)
                gd, gi, gs = query_kdtree(dev, cp.asarray(Q), k, **kw)
                msg = f"{host.n_trees} tree(s), budget {b}, k {k}, bounds {bounds is not None}"
                np.testing.assert_array_equal(gi.get(), ci, err_msg=msg)
                np.testing.assert_array_equal(gd.get(), cd, err_msg=msg)
                np.testing.assert_array_equal(np.asarray(gs["leaves_visited"]), cs["leaves_visited"], err_msg=msg)
    Xh = X.astype(np.float16).astype(np.float32)
    fc = KDForest(n_trees=1, leaf_size=32, graph_degree=16, descent="beam", device="cpu").fit(Xh)
    fg = KDForest(n_trees=1, leaf_size=32, graph_degree=16, descent="beam", device="gpu").fit(cp.asarray(Xh))
    for scan in ("float32", "float16"):
        fc.set_params(scan_dtype=scan)
        fg.set_params(scan_dtype=scan)
        cd, ci = fc.query(Q, 4, backtracks=48)
        gd, gi = fg.query(cp.asarray(Q), 4, backtracks=48)
        np.testing.assert_array_equal(gi.get(), ci, err_msg=scan)
        np.testing.assert_array_equal(gd.get(), cd, err_msg=scan)
